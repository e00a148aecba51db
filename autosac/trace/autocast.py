"""Trace under autocast as the target device runs it.

``torch.autocast`` keeps one cast policy per device type, and CUDA's differs
from the CPU's: on CUDA ``softmax``, ``log_softmax``, ``layer_norm``,
``rms_norm``, ``exp``, ``pow``, ``sum`` and the losses run in float32 (a
bfloat16 input is cast up first), ``einsum`` and ``addmv`` in the low
precision; the CPU runs most of those in the input's dtype and has its own
list besides.  Those casts are ops the applier must match call by call, and
their copies are memory, so the trace must make exactly the casts the target
makes.

For a CPU target the trace simply runs under ``torch.autocast("cpu")``.  For a
CUDA target it runs CPU fake tensors under CPU autocast whose per-op kernels
are replaced, for the trace only, by :class:`CudaAutocast`'s:

* an op with a CUDA autocast kernel: CUDA's own kernel is asked what it does
  to this call -- the op is called once on fake CUDA tensors of the same
  shapes and dtypes (fake tensors may name a CUDA device without one) and the
  arguments autocast hands on to the op are caught just below it -- then the
  same casts are made on the CPU tensors and the op runs, without autocast
  inside it, as CUDA's kernel runs it;
* an op only the CPU's autocast lists: passed through, as on CUDA.

No op list is kept here: the op set comes from the dispatcher's
registrations and the policy from CUDA's own kernels.  Weight casts are
cached per autocast region as autocast caches them (a float32 leaf that
requires grad is cast once).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)
_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
# what CUDA autocast does to a call, per (dtype, op, argument layout, argument
# dtypes): the same in every trace of this process, so asked once
_POLICY: dict[tuple, tuple[list[tuple[int, object]], dict, str]] = {}


def check_autocast_dtype(dtype) -> None:
    """Raise ValueError unless ``dtype`` is None or one autocast can run in."""
    if dtype is not None and dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast must be torch.bfloat16 or torch.float16, got {dtype!r}")


def target_autocast(device_type: str, dtype: torch.dtype | None):
    """The context the traced forward and loss run in: nothing without
    ``dtype``, CPU autocast for a CPU target, :class:`CudaAutocast` for CUDA."""
    if dtype is None:
        return nullcontext()
    if device_type == "cuda":
        return CudaAutocast(dtype)
    return torch.autocast("cpu", dtype=dtype)


class CudaAutocast:
    """CPU autocast that casts as CUDA autocast does (module docstring).

    Use as a context around the traced forward and loss.  While active it
    changes CPU autocast for the whole process (the trace is its only user);
    on exit torch's own kernels are back.  Not reentrant.

    Example::

        >>> with FakeTensorMode(), CudaAutocast(torch.bfloat16):
        ...     F.softmax(torch.randn(4, 4, dtype=torch.bfloat16), -1).dtype
        torch.float32
    """

    def __init__(self, dtype: torch.dtype):
        check_autocast_dtype(dtype)
        self.dtype = dtype
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._failed: set[str] = set()
        self._kernels = None
        self._autocast = None

    def __enter__(self):
        self._autocast = torch.autocast("cpu", dtype=self.dtype)
        self._autocast.__enter__()
        try:
            self._kernels = _override_cpu_autocast(self._run)
            self._kernels.__enter__()
        except BaseException:
            self._autocast.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self._kernels.__exit__(None, None, None)  # the CPU's own autocast kernels are back
        finally:
            self._kernels = None
            self._cache.clear()
            self._autocast.__exit__(*exc)
        return False

    def cast_args(self, op, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args``/``kwargs`` as CUDA autocast hands them on to ``op``."""
        leaves, spec = tree_flatten((args, kwargs))
        key = (self.dtype, op, spec, tuple(_leaf_key(x) for x in leaves))
        policy = _POLICY.get(key)
        if policy is None:
            policy = _POLICY[key] = _ask_cuda(op, leaves, spec, self.dtype)
        changes, extra, failure = policy
        if failure and str(op) not in self._failed:  # said once per trace
            self._failed.add(str(op))
            warnings.warn(f"autosac: could not ask CUDA autocast about {op} ({failure}); traced without its casts",
                          stacklevel=3)
        for pos, value in changes:
            leaves[pos] = self._cast(leaves[pos], value) if isinstance(leaves[pos], torch.Tensor) else value
        args, kwargs = tree_unflatten(leaves, spec)
        return args, {**kwargs, **extra}

    def _run(self, op, *args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):  # as CUDA's kernel: no autocast inside the op
            args, kwargs = self.cast_args(op, args, kwargs)
            return op(*args, **kwargs)

    def _cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t.to(dtype)``, cached for a float32 leaf that requires grad, as autocast caches."""
        # _is_view first: is_leaf reads a view's grad_fn, under the view's lock (see recorder._flush_pending)
        cacheable = (dtype == self.dtype and t.dtype == torch.float32 and not t._is_view() and t.is_leaf
                     and t.requires_grad and torch.is_autocast_cache_enabled())
        if not cacheable:
            return t.to(dtype)
        hit = self._cache.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self._cache[id(t)] = (t, t.to(dtype))
        return hit[1]


def _ask_cuda(op, leaves: list, spec, dtype: torch.dtype):
    """``(changes, extra, failure)``: what CUDA autocast does to the call (see
    :func:`_cuda_autocast_changes`), or nothing and why it could not be asked."""
    try:
        return (*_cuda_autocast_changes(op, leaves, spec, dtype), "")
    except Exception as e:
        if "autocast" in str(e):  # an op CUDA autocast refuses (binary_cross_entropy): so would the GPU
            raise
        return [], {}, type(e).__name__


class _CastOrder(TorchDispatchMode):
    """The positions of the probe's tensors in the order they were cast."""

    def __init__(self, twins: list):
        super().__init__()
        self.index = {id(t): i for i, t in enumerate(twins) if isinstance(t, torch.Tensor)}
        self.positions: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten._to_copy.default and args and id(args[0]) in self.index:
            self.positions.append(self.index[id(args[0])])
        return func(*args, **(kwargs or {}))


class _Caught(Exception):
    """Raised by the probe kernel below CUDA autocast once it noted the arguments
    it got (kept outside the exception: a traceback kept alive would hold the
    trace's tensors in a reference cycle, freed only when the GC runs)."""


def _cuda_autocast_changes(op, leaves: list, spec, dtype: torch.dtype):
    """Call ``op`` on fake CUDA twins of ``leaves`` under CUDA autocast in
    ``dtype`` and catch the call autocast makes next (a kernel on the
    AutogradCUDA key for ``op``, for this probe only).  Returns, per leaf
    that autocast changed, its position and its new dtype (a tensor) or
    value (a ``dtype`` argument), and the arguments autocast filled in where
    the caller left them out, by name."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    got: list = []

    def catch(*args, **kwargs):
        got.append((args, kwargs))
        raise _Caught

    with _temporary_kernels("AutogradCUDA", {op.name(): catch}):
        with _disable_current_modes(), _cuda_autocast(dtype):
            mode = FakeTensorMode()
            with mode:
                twins = [_cuda_twin(x) for x in leaves]
            args, kwargs = tree_unflatten(twins, spec)
            try:
                with torch.no_grad(), mode, _CastOrder(twins) as order:
                    op(*args, **kwargs)
            except _Caught:
                pass
            if not got:
                return [], {}  # never reached the op (a fast path before it): nothing autocast did
    (cargs, ckwargs), (gargs, gkwargs) = tree_unflatten(twins, spec), got[0]
    # arguments autocast set that the caller left to their defaults (``dtype``); the
    # dispatcher may leave out trailing defaults either way
    schema = {a.name: a for a in op._schema.arguments}
    names = list(schema)
    set_by_autocast = dict(zip(names[len(cargs):], gargs[len(cargs):]))
    set_by_autocast.update({k: v for k, v in gkwargs.items() if k not in ckwargs})
    extra = {k: v for k, v in set_by_autocast.items() if not _is_default(schema[k], v)}
    gargs = tuple(gargs[: len(cargs)]) + tuple(cargs[len(gargs):])
    got, got_spec = tree_flatten((gargs, {k: gkwargs.get(k, ckwargs[k]) for k in ckwargs}))
    if got_spec != spec:
        raise RuntimeError("autocast changed the layout of the call")
    changes = []
    for pos, (before, after) in enumerate(zip(twins, got)):
        if isinstance(before, torch.Tensor):
            if isinstance(after, torch.Tensor) and after.dtype != before.dtype:
                changes.append((pos, after.dtype))
        elif isinstance(after, torch.dtype) and after != before:
            changes.append((pos, after))
    # in the order autocast cast them (C++ may evaluate its arguments last to first)
    first = {pos: k for k, pos in reversed(list(enumerate(order.positions)))}
    changes.sort(key=lambda c: first.get(c[0], len(first) + c[0]))
    return changes, extra


def _is_default(arg, value) -> bool:
    if not arg.has_default_value():
        return False
    try:
        return bool(arg.default_value == value)
    except Exception:
        return False


def _leaf_key(x):
    if isinstance(x, torch.Tensor):
        return ("T", x.dtype)
    if x is None or isinstance(x, (bool, torch.dtype, str)):
        return x
    return type(x).__name__


def _cuda_twin(x):
    """A fake CUDA tensor of ``x``'s shape, strides and dtype (others as they are)."""
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cuda")


@contextmanager
def _cuda_autocast(dtype: torch.dtype):
    """CUDA autocast switched on directly (``torch.autocast`` refuses without a GPU)."""
    enabled, before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", before)


def _autocast_ops() -> tuple[list[str], list[str]]:
    """The ops with an autocast kernel on CUDA, and those with one on the CPU only."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")]
    cuda = [n for n in names if has(n, "AutocastCUDA")]
    cpu_only = [n for n in names if has(n, "AutocastCPU") and not has(n, "AutocastCUDA")]
    return cuda, cpu_only


def _op_overload(name: str):
    base, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(aten, base), overload or "default")


def _override_cpu_autocast(run):
    """A context in which ``run(op, *args, **kwargs)`` is the CPU autocast
    kernel of every op CUDA autocasts, and a fall-through for those only the
    CPU autocasts; on exit torch's kernels are back."""
    cuda, cpu_only = _autocast_ops()
    kernels = dict.fromkeys(cpu_only, torch.library.fallthrough_kernel)
    for name in cuda:
        try:
            kernels[name] = _kernel(run, _op_overload(name))
        except AttributeError:
            continue
    return _temporary_kernels("AutocastCPU", kernels)


@contextmanager
def _temporary_kernels(key: str, kernels: dict):
    """Register ``kernels`` (op name, ``aten::`` optional -> kernel) on
    dispatch ``key`` for the block only.

    The Python dispatcher (on while Dynamo and AOTAutograd trace) caches per
    op which kernel a key resolves to, and destroying a library does not
    clear what it cached for an op it only implemented: an op probed while
    tracing a compiled step kept "AutogradCUDA has its own kernel" after the
    probe's kernel was gone, and every later compile of a real CUDA step
    sent that op to the autograd fallback -- no autograd formula, wrong
    gradients.  So that entry is dropped on registering (the block sees its
    kernel) and again on exit (later code resolves afresh).
    """
    dispatch_key = getattr(torch._C.DispatchKey, key)
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": on purpose, undone on exit
            warnings.simplefilter("ignore")
            for name, kernel in kernels.items():
                lib.impl(name.removeprefix("aten::"), kernel, key)
                _uncache(name, dispatch_key)
        yield
    finally:
        lib._destroy()
        for name in kernels:
            _uncache(name, dispatch_key)


def _uncache(name: str, key) -> None:
    """Drop the Python dispatcher's cached kernel choice for op ``name`` at ``key``."""
    try:
        _op_overload(name)._uncache_dispatch(key)
    except AttributeError:  # no Python overload object: nothing cached for it
        pass


def _kernel(run, op):
    def kernel(*args, **kwargs):
        return run(op, *args, **kwargs)
    return kernel
