"""Where PyTorch's fake (meta) kernels reject what the real kernels run.

A trace must follow the path the real step takes.  When the meta kernel of
an op refuses arguments its real kernels accept, the trace would fail (and
blame the user's inputs) on a step that trains fine.  Known cases, each
checked against the real kernel:

* ``aten._grouped_mm`` (``torch.nn.functional.grouped_mm``, transformers'
  default MoE experts path): the meta kernel implements the CUDA bf16 kernel's
  checks and refuses float32 and float16, which the CPU kernel (and the CUDA
  fallback) run.  Its output is sized here as the meta kernel sizes it.

* ``aten._ctc_loss`` (CTC losses): its output's size follows the target
  lengths' values, so the fake kernel raises ``DynamicOutputShapeException``.
  Generally: an op whose output size follows values (op tag
  ``dynamic_output_shape``) is run on the real CPU kernel when the only fake
  inputs are floating ones and the real kernel makes the same sizes from
  zeros and from ones in their place (the labels and lengths are real: the
  sizes come from them); ``nonzero`` of a fake tensor stays data-dependent.

Where a meta kernel takes what the real kernel refuses, the trace would plan
a step that fails for real.  Meta kernels of ``mm`` and ``addmm`` (so of every
``nn.Linear``) take operands of two floating dtypes (float64 inputs to a
float32 model); the real kernels raise.  So an op that is not pointwise (whose
type promotion the meta kernel does follow) and reads floating tensors of more
than one dtype is also run once on the real CPU kernel, on zeros, per shape:
what it raises, the trace raises (:class:`FakeKernelError`, ``real="refused"``).

Any other op whose meta kernel raises is tried once on the real CPU kernel,
on zeros of the same shapes, strides and dtypes (real tensors of the trace,
an offsets tensor say, as they are; inputs up to 256 MiB): when the real
kernel runs, the trace goes on with fake outputs laid out as the real ones;
when it raises too, the error is the inputs' (or the model's), and
:class:`FakeKernelError` says which of the two happened.

:func:`run_fake` runs an op under the trace's fake mode that way.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten
_GROUPED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """Output of ``_grouped_mm`` for dtypes the meta kernel refuses: 2-d by
    3-d is ``(rows, n)``, 3-d by 2-d ``(m, n)``, 2-d by 2-d one matrix per
    group, 3-d by 3-d a batched matmul."""
    if mat_a.dtype not in _GROUPED_DTYPES or mat_b.dtype != mat_a.dtype:
        return None
    # the checks the real kernel makes besides the dtype: a wrong shape fails here as it would there
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
                 lambda: f"Multiplicands must be 2D or 3D but got mat_a.dim()={mat_a.dim()} and mat_b.dim()={mat_b.dim()}")
    torch._check(mat_a.size(-1) == mat_b.size(-2) or (mat_a.dim() == 2 and mat_b.dim() == 2),
                 lambda: "contraction dimension of mat_a and mat_b must match")
    torch._check((offs is not None) == (mat_a.dim() == 2 or mat_b.dim() == 2),
                 lambda: "offs is required exactly when one of the matrices is 2D")
    if offs is not None:
        torch._check(offs.dim() == 1 and offs.dtype == torch.int32, lambda: "offs must be a 1D int32 tensor")
        torch._check(mat_b.dim() == 2 or offs.size(0) == mat_b.size(0), lambda: "matrix batch sizes have to match")
        torch._check(mat_a.dim() == 2 or offs.size(0) == mat_a.size(0), lambda: "matrix batch sizes have to match")
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        if offs is None:
            return None
        shape = (offs.size(0), mat_a.size(0), mat_b.size(1))
    elif mat_a.dim() == 2:
        shape = (mat_a.size(0), mat_b.size(-1))
    elif mat_b.dim() == 2:
        shape = (mat_a.size(1), mat_b.size(1))
    else:
        shape = (mat_a.size(0), mat_a.size(1), mat_b.size(-1))
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


# op overload -> rule(*args, **kwargs) -> output, or None where the rule does not apply
RULES = {aten._grouped_mm.default: _grouped_mm}


_PROBE_CAP_BYTES = 256 << 20
_REFUSAL_CAP_BYTES = 64 << 20  # mixed-dtype checks: the kernel runs, on zeros, when it takes them


class FakeKernelError(RuntimeError):
    """An op's fake kernel raised ``error`` (its type and first line): ``op``
    names the op, ``real`` says what the real kernel did on zeros of the same
    inputs: ``"raised"`` (the inputs or the model are at fault) or
    ``"untried"`` (inputs too large to try); or ``"refused"``: the fake kernel
    ran and the real one raised ``error``."""

    def __init__(self, op: str, error: str, real: str) -> None:
        super().__init__(error)
        self.op, self.real = op, real


def _data_dependent(e: Exception) -> bool:
    return type(e).__name__ in ("DataDependentOutputException", "DynamicOutputShapeException",
                                "GuardOnDataDependentSymNode", "UnsupportedOperatorException")


def _real_twin(x, fill: float | None = 0.0):
    """A real tensor for a fake one: ``fill`` everywhere, or (``None``) a ramp
    of distinct values (as distinct as the dtype holds)."""
    if not isinstance(x, FakeTensor):
        return x
    if fill is None:
        ramp = torch.arange(x.numel(), dtype=torch.float64).remainder(4093).to(x.dtype)
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).copy_(ramp.reshape(x.shape))
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).fill_(fill)


def _run_real(func, args, kwargs, fill: float | None = 0.0, cap: int = _PROBE_CAP_BYTES):
    """The real CPU kernel on ``fill`` in place of each fake input; ``None``
    when the inputs are over ``cap`` bytes.  Raises what the kernel raises."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if sum(t.numel() * t.element_size() for t in tensors) > cap:
        return None
    with unset_fake_temporarily(), torch.random.fork_rng(devices=[]):
        real_args, real_kwargs = tree_map(lambda x: _real_twin(x, fill), (args, kwargs))
        return func(*real_args, **real_kwargs)


def _as_fakes(out):
    return tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
                    if isinstance(t, torch.Tensor) else t, out)


def _follow_real(func, args, kwargs):
    """Fake outputs laid out as the real CPU kernel lays them out on zeros of
    the same inputs; ``None`` when the inputs are too large to try.  Raises
    what the real kernel raises."""
    out = _run_real(func, args, kwargs)
    return None if out is None else _as_fakes(out)


def _sizes(out) -> list:
    return [(t.shape, t.stride()) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def _sized_by_real_values(func, args, kwargs):
    """Fake outputs of an op whose output size follows values
    (``dynamic_output_shape``), where those values are all real: only
    floating inputs are fake, and the real kernel sizes its outputs alike on
    zeros, on ones and on distinct values in their place (``unique`` of a
    fake tensor sizes by them: it stays data-dependent).  ``None`` otherwise
    (or on any error)."""
    if torch.Tag.dynamic_output_shape not in func.tags:
        return None
    fakes = [t for t in tree_leaves((args, kwargs)) if isinstance(t, FakeTensor)]
    if not all(t.is_floating_point() for t in fakes):
        return None
    try:
        outs = [_run_real(func, args, kwargs, fill) for fill in (0.0, 1.0, None)]
    except Exception:  # noqa: BLE001 - the real kernel refuses: stays data-dependent
        return None
    if any(o is None for o in outs) or any(_sizes(o) != _sizes(outs[0]) for o in outs[1:]):
        return None
    return _as_fakes(outs[0])


def _mixed_floats(func, args, kwargs) -> bool:
    """Whether a non-pointwise op of the forward (grad enabled, no backward node
    running: a user's dtype mistake shows there; backward and optimizer ops mix
    dtypes by design) reads floating tensors of two or more dtypes."""
    if not torch.is_grad_enabled() or torch._C._current_autograd_node() is not None:
        return False
    if torch.Tag.pointwise in func.tags or func.overloadpacket.__name__ in ("copy_", "_to_copy") \
            or func.overloadpacket.__name__.startswith("_foreach_"):
        return False
    dtypes = {t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return len(dtypes) > 1


def _spec(x):
    if isinstance(x, FakeTensor):
        return ("fake", tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, torch.Tensor):
        raise TypeError("a real tensor: not cached")
    return tuple(_spec(v) for v in x) if isinstance(x, (list, tuple)) else x


def _real_refusal(func, args, kwargs) -> str | None:
    """What the real kernel raises on zeros of these inputs (its first line), or ``None``."""
    try:
        key = (func, _spec(args), _spec(tuple(sorted(kwargs.items()))))
    except TypeError:
        key = None
    if key is not None and key in _REFUSALS:
        return _REFUSALS[key]
    try:
        _run_real(func, args, kwargs, cap=_REFUSAL_CAP_BYTES)
        said = None
    except NotImplementedError:  # no CPU kernel (a CUDA-only op): nothing to ask
        said = None
    except Exception as e:  # noqa: BLE001 - its text is the answer
        text = str(e).strip()
        said = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    if key is not None and len(_REFUSALS) < 1024:
        _REFUSALS[key] = said
    return said


_REFUSALS: dict = {}  # (op, input specs) -> what the real kernel said on zeros of them


def run_fake(func, args, kwargs):
    """``func(*args, **kwargs)`` under the active fake mode; where its meta
    kernel raises, :data:`RULES`' output for the op, else the real kernel's
    layout (see the module docstring).

    Raises:
        FakeKernelError: the fake kernel raised and the real one did too (or
            could not be tried), or the fake kernel took operands of mixed
            dtypes that the real one refuses; data-dependent errors pass
            through as they are where real values cannot size the output.
    """
    name = f"{func.namespace}.{func.overloadpacket.__name__}"
    try:
        out = func(*args, **kwargs)
    except Exception as e:
        if _data_dependent(e):
            out = _sized_by_real_values(func, args, kwargs)
            if out is None:
                raise
            return out
        if not isinstance(e, (RuntimeError, ValueError, IndexError, TypeError)):
            raise
        # only the text is kept: the exception's traceback holds this frame's tensors, and
        # the trace runs with the garbage collector off (a cycle would keep them to the end)
        text = str(e).strip()
        error = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    else:
        refused = _real_refusal(func, args, kwargs) if _mixed_floats(func, args, kwargs) else None
        if refused is None:
            return out
        raise FakeKernelError(name, refused, "refused")
    rule = RULES.get(func)
    out = rule(*args, **kwargs) if rule is not None else None
    if out is not None:
        return out
    real = "untried"
    try:
        out = _follow_real(func, args, kwargs)
    except Exception:  # noqa: BLE001 - the real kernel refuses them too: the inputs' fault
        out, real = None, "raised"
    # raised here, outside the handler: the probe's exception (its frames hold the zeros it
    # ran on) is not kept as the context of the error the user sees
    if out is None:
        raise FakeKernelError(name, error, real)
    return out
