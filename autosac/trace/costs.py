"""What one aten op costs: FLOPs, bytes moved, and milliseconds on the target.

On a GPU target the time is a roofline: the slower of compute (FLOPs over the
dtype's dense rate) and memory traffic (bytes over bandwidth), each scaled by
the device's efficiency.  On ``cpu`` ops are timed for real with random tensors
of the traced shapes, once per op and shape on this machine
(:mod:`autosac.trace.timings`); ops too large to materialise, and ops whose
inputs may be indices or workspaces, use a CPU roofline calibrated once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache

import torch
from torch.utils import flop_counter
from torch.utils._pytree import tree_leaves, tree_map

from autosac.core.coldread import ColdReads
from autosac.core.devices import DeviceSpec
from autosac.core.host import host_costs
from autosac.core.hostsize import made_bytes
from autosac.core.noise import best_ms
from autosac.core.opkinds import is_view_op
from autosac.trace.timings import TimingCache, retiming

aten = torch.ops.aten

# Ops with no FLOP formula that are memory-bound by nature: no warning for these.
_MEMORY_BOUND = {
    "embedding", "embedding_dense_backward", "native_layer_norm", "native_layer_norm_backward",
    "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data",
    "native_dropout", "native_dropout_backward", "gelu_backward", "silu_backward",
    "threshold_backward", "sum", "mean", "amax", "amin", "max", "min", "var_mean", "cat",
    "stack", "copy_", "_to_copy", "clone", "masked_fill", "where", "fill_", "zero_", "zeros_like",
    "ones_like", "empty_like", "empty", "empty_strided", "new_empty", "new_empty_strided",
    "new_zeros", "new_ones", "full", "full_like", "zeros", "ones", "arange", "bernoulli_",
    "bernoulli", "rand", "randn", "rand_like", "randn_like", "index_select", "gather",
    "scatter", "scatter_add", "index_put_", "index_add_", "embedding_backward", "tril", "triu",
    "_unsafe_view", "repeat", "repeat_interleave", "_foreach_", "constant_pad_nd", "nll_loss_forward",
    "nll_loss_backward", "_fused_adamw_", "_fused_adam_", "lerp_", "addcmul_", "addcdiv_",
    "_local_scalar_dense", "lift_fresh", "alias", "clamp", "clamp_min", "clamp_max",
    "logical_not", "bitwise_not", "eq", "ne", "lt", "le", "gt", "ge", "masked_fill_",
    "detach", "rsqrt", "sqrt", "pow", "sort", "topk", "cumsum", "linalg_vector_norm",
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit_functional",
    "_fused_rms_norm", "_fused_rms_norm_backward", "split_with_sizes_copy", "unbind_copy",
    # pooling, resampling, group norm and the activations whose ops carry no pointwise tag
    "avg_pool2d", "avg_pool2d_backward", "max_pool2d_with_indices", "max_pool2d_with_indices_backward",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward", "adaptive_avg_pool2d",
    "upsample_nearest2d", "upsample_nearest2d_backward", "upsample_bilinear2d", "upsample_bilinear2d_backward",
    "native_group_norm", "native_group_norm_backward", "hardswish", "hardswish_backward",
    "hardsigmoid", "hardsigmoid_backward", "index", "index_put", "slice_scatter", "select_scatter",
    "_safe_softmax", "scalar_tensor", "softplus_backward", "as_strided_", "roll", "mse_loss", "mse_loss_backward",
    "smooth_l1_loss", "smooth_l1_loss_backward", "huber_loss", "huber_loss_backward",
    "binary_cross_entropy", "binary_cross_entropy_backward",
    # mixture-of-experts token dispatch (autosac.trace.routing)
    "nonzero", "floor_divide", "histc", "bincount", "_unique2", "unique_dim", "masked_select", "searchsorted",
    "index_add", "uniform_", "one_hot",
}


# Ops that return an alias of their input without being view ops (no kernel
# runs): ``_unsafe_view`` (matmul's reshape of its result: a Linear on a 3-d
# input, an LM head's logits) was priced as a memory-bound copy of its input
_ALIASES = frozenset({"_unsafe_view", "alias", "lift_fresh"})


def _sdpa_flops(q_shape, k_shape, v_shape) -> int:
    # QK^T and PV: two batched matmuls of (sq x d)@(d x sk) and (sq x sk)@(sk x dv).
    *batch, sq, d = q_shape
    sk, dv = k_shape[-2], v_shape[-1]
    b = 1
    for s in batch:
        b *= s
    return 2 * b * sq * sk * d + 2 * b * sq * sk * dv


def _cpu_flash_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return _sdpa_flops(query, key, value)


def _cpu_flash_bw_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    # Recompute QK^T, then dV, dP, dQ, dK: 2.5x the forward's matmul work.
    return int(2.5 * _sdpa_flops(query, key, value))


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # each row of a 2-d mat_a meets one group's matrix (a 2-d x 2-d call splits the
    # contraction over groups): 2*M*K*N either way; a 3-d mat_a contracts its last dim
    if len(a_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[-1]
    n = 1
    for s in out_shape:
        n *= s
    return 2 * n * a_shape[-1]


def _extra_registry() -> dict:
    extra = {}
    for name, fn in (
        ("_grouped_mm", _grouped_mm_flops),
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_flops),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_bw_flops),
    ):
        packet = getattr(aten, name, None)
        if packet is not None:
            extra[packet] = flop_counter.shape_wrapper(fn)
    return extra


FLOP_REGISTRY = {**flop_counter.flop_registry, **_extra_registry()}


def op_flops(func, args, kwargs, out) -> int | None:
    """FLOPs of one op call from torch's FLOP-formula registry; None when it has no formula."""
    fn = FLOP_REGISTRY.get(func.overloadpacket)
    if fn is None:
        return None
    try:
        return int(fn(*args, **kwargs, out_val=out))
    except AssertionError:  # torch < 2.13's attention formulas refuse grouped-query shapes
        widened = _heads_widened(args)
        if widened is None:
            raise
        return int(fn(*widened, **kwargs, out_val=out))


def _heads_widened(args) -> tuple | None:
    """Attention arguments with key and value heads widened to the query's
    (grouped-query attention costs what attention over repeated key/value
    heads costs), as meta tensors; None where no 4-d argument has fewer heads."""
    heads = [a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4]
    if not heads or min(heads) == max(heads):
        return None
    top = max(heads)

    def widen(a):
        if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] != top and top % a.shape[1] == 0:
            return torch.empty((a.shape[0], top, *a.shape[2:]), dtype=a.dtype, device="meta")
        return a
    return tuple(widen(a) for a in args)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def op_bytes(args, kwargs, out) -> int:
    """Bytes an op reads and writes: its tensor inputs plus its tensor outputs."""
    total = 0
    for t in tree_leaves((args, kwargs, out)):
        if isinstance(t, torch.Tensor):
            total += tensor_bytes(t)
    return total


_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm"}
# softmax kernels -> how many leading tensor arguments they copy when not contiguous
_SOFTMAXES = {"_softmax": 1, "_log_softmax": 1, "_softmax_backward_data": 2, "_log_softmax_backward_data": 2}


def _blas_ready(t: torch.Tensor) -> bool:
    if t.dim() < 2:
        return True
    rows, cols = t.size(-2), t.size(-1)
    s_row, s_col = t.stride(-2), t.stride(-1)
    # a BLAS matrix has unit stride along one dim and a leading dimension covering the other
    return (s_col == 1 and s_row >= max(1, cols)) or (s_row == 1 and s_col >= max(1, rows))


def transient_bytes(func, args) -> int:
    """Bytes an op allocates internally and frees before returning, invisible to
    the dispatcher: matmuls copy operands that are not BLAS-strided (e.g. the
    stride-0 gradient of a sum) into contiguous scratch; batch norm's backward
    works in an input-sized scratch tensor, layer norm's backward and softmax
    (forward and backward) copy non-contiguous operands, and foreach ops with a scalar wrap it in a tensor
    (CPU kernels, measured with the profiler's allocator events)."""
    name = func.overloadpacket.__name__
    if name == "native_batch_norm_backward" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return tensor_bytes(args[1])
    if name == "native_layer_norm_backward" and len(args) > 1:
        # the CPU kernel makes grad_out and input contiguous, and sums the weight's
        # gradient through a float per row
        grad_out, inp = args[0], args[1]
        copies = sum(tensor_bytes(t) for t in (grad_out, inp) if isinstance(t, torch.Tensor) and not t.is_contiguous())
        rows = inp.numel() // max(1, inp.shape[-1]) if isinstance(inp, torch.Tensor) and inp.dim() else 0
        return copies + 4 * rows
    if name in _SOFTMAXES:
        # the kernels (CPU and CUDA) work on contiguous copies of a non-contiguous input
        # (a channels-last conv's logits), and of the gradient and output in the backward
        copies = args[:_SOFTMAXES[name]]
        return sum(tensor_bytes(t) for t in copies if isinstance(t, torch.Tensor) and not t.is_contiguous())
    if name == "_safe_softmax" and args and isinstance(args[0], torch.Tensor):
        # the rows masked to -inf: a boolean mask of the input, its per-row summary and the -inf
        # scalar, alive while the result is made (the same as the allocator shows: tests)
        x, dim = args[0], args[1] if len(args) > 1 else -1
        return x.numel() + x.numel() // max(1, x.shape[dim] if x.dim() else 1) + x.element_size()
    if name in _FUSED_ATTENTION_BACKWARD and len(args) > 2:
        return _attention_backward_scratch(name, args[1], args[2])
    if name.startswith("_foreach_") and any(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
        # the CPU fallback wraps the scalar in a double tensor and casts it per tensor
        return 12
    if name not in _MATMULS:
        return 0
    return sum(tensor_bytes(t) for t in args if isinstance(t, torch.Tensor) and not _blas_ready(t))


# CUDA's fused attention backward kernels (a CUDA target's trace runs them):
# fp32 accumulators of dQ per query element (flash: two), and, where key and
# value have fewer heads than the query, dK and dV expanded to the query's
# heads before they are summed back.  Measured on an H100 (PyTorch 2.11,
# benchmarks/gpu_sdpa_memory.py): cuDNN and memory-efficient 2x the query's
# bf16 bytes, flash 4x; with grouped heads 4x and 6x.
_FUSED_ATTENTION_BACKWARD = {
    "_scaled_dot_product_cudnn_attention_backward": 4,
    "_scaled_dot_product_efficient_attention_backward": 4,
    "_scaled_dot_product_flash_attention_backward": 8,
}


def _attention_backward_scratch(name: str, query, key) -> int:
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor) or query.dim() < 3:
        return 0
    scratch = query.numel() * _FUSED_ATTENTION_BACKWARD[name]
    if key.size(-3) != query.size(-3):
        scratch += 2 * query.numel() * query.element_size()
    return scratch


def _compute_dtype(args) -> torch.dtype:
    for t in tree_leaves(args):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.dtype
    return torch.float32


@cache
def is_known_memory_bound(func) -> bool:
    """Ops that move memory and do little arithmetic per byte: pointwise and
    reduction ops (by their tags), the backward of a view (``slice_backward``:
    a zero-filled tensor with the gradient copied in), and the listed ones."""
    name = func.overloadpacket.__name__
    return (
        torch.Tag.pointwise in func.tags
        or torch.Tag.reduction in func.tags
        or _is_view_backward(name)
        or name in _MEMORY_BOUND
        or name.startswith("_foreach_")
        or name.rstrip("_") in _MEMORY_BOUND
    )


def _is_view_backward(name: str) -> bool:
    """Whether ``name`` is ``<view op>_backward`` (``slice_backward``, ``select_backward``, ...)."""
    if not name.endswith("_backward"):
        return False
    forward = getattr(torch.ops.aten, name.removesuffix("_backward"), None)
    overload = getattr(forward, "default", None) or next(
        (getattr(forward, o) for o in (forward.overloads() if forward is not None else ())), None)
    return overload is not None and is_view_op(overload)


class CostModel:
    """Times ops for one target; remembers ops it had no FLOP formula for.

    Example::

        >>> cm = CostModel(resolve_target("h100"))
        >>> ms = cm.op_ms(torch.ops.aten.mm.default, (a, b), {}, out)
    """

    def __init__(self, spec: DeviceSpec, cpu_size_cap_bytes: int = 256 << 20) -> None:
        self.spec = spec
        self.host = host_costs(spec.host)  # this machine's, measured once, unless the spec states them
        self.cpu_size_cap_bytes = cpu_size_cap_bytes
        self.unknown_ops: set[str] = set()
        self._timings = TimingCache() if spec.measured else None
        # ops timed for the first time by this cost model: key -> (op, its arguments' shapes)
        self.first_timed: dict[str, tuple] = {}
        # an optimizer's foreach ops read lists the step let go cold (autosac.core.coldread)
        self._cold = ColdReads()

    def op_ms(self, func, args, kwargs, out, backward: bool = False) -> tuple[float, int]:
        """(milliseconds, FLOPs) of one op call on the target, the host's
        dispatch included (:meth:`with_host`); a view's is only that.
        ``backward``: called by the autograd engine (less host time)."""
        ms, flops = self._kernel_ms(func, args, kwargs, out)
        return self.with_host(ms, backward, made_bytes(func, args, kwargs, out)) + self._cold_ms(func, args, kwargs,
                                                                                                 out), flops

    def _cold_ms(self, func, args, kwargs, out) -> float:
        """What a foreach op's cold reads add where its kernel was timed on this CPU (:mod:`autosac.core.coldread`)."""
        if self.spec.device_type != "cpu" or not self.spec.measured or not self.host.cold_read_us_per_mib:
            return 0.0
        h = self.host
        return self._cold.mib(func, args, kwargs, out, h.small_op_bytes, h.large_op_bytes) * h.cold_read_us_per_mib / 1e3

    def with_host(self, kernel_ms: float, backward: bool = False, nbytes: int = 0) -> float:
        """An op call's time with the host's (:meth:`autosac.core.host.HostCosts.op_ms`):
        on a GPU the two overlap (the longer counts: a short kernel waits for
        the next op to be issued); on the CPU they add up, and an op making
        ``nbytes`` of large data costs the host more (:mod:`autosac.core.hostsize`)."""
        return self.host.op_ms(kernel_ms, self.spec.device_type, timed=self.spec.measured, backward=backward,
                               nbytes=nbytes)

    def _kernel_ms(self, func, args, kwargs, out) -> tuple[float, int]:
        if is_view_op(func) or func.overloadpacket.__name__ in _ALIASES:
            return 0.0, 0
        flops = op_flops(func, args, kwargs, out)
        understood = flops is not None or is_known_memory_bound(func)
        if flops is None:
            flops = 0
            if not is_known_memory_bound(func):
                self.unknown_ops.add(str(func.overloadpacket))
        nbytes = op_bytes(args, kwargs, out)
        if self.spec.measured:
            if not understood:
                # an op we know nothing about may read its inputs as indices or
                # workspaces (an RNN's backward): never run it on random data
                return self.roofline_ms(flops, nbytes, _compute_dtype(args), local_cpu_spec()), flops
            return self._cpu_ms(func, args, kwargs, nbytes, flops), flops
        return self.roofline_ms(flops, nbytes, _compute_dtype(args), self.spec), flops

    @staticmethod
    def roofline_ms(flops: int, nbytes: int, dtype: torch.dtype, spec: DeviceSpec) -> float:
        """max(compute time, memory time) in ms for the given work on ``spec``."""
        compute_s = flops / (spec.peak_flops(dtype) * spec.compute_efficiency)
        memory_s = nbytes / (spec.bandwidth * spec.memory_efficiency)
        return 1e3 * max(compute_s, memory_s)

    def _cpu_ms(self, func, args, kwargs, nbytes: int, flops: int) -> float:
        roofline = self.roofline_ms(flops, nbytes, _compute_dtype(args), local_cpu_spec())
        if nbytes > self.cpu_size_cap_bytes:
            return roofline

        def time_op() -> tuple[float, bool]:
            try:
                return _time_real(func, args, kwargs)
            except Exception:  # noqa: BLE001 - data-dependent ops can fail on random data
                return roofline, False

        key = timing_key(func, args, kwargs)
        # timed now, for the first time (inside retimed() each timing is kept as measured)
        if key not in self.first_timed and self._timings.get(key) is None and not retiming():
            self.first_timed[key] = (func, tree_map(_Shape.of, (args, kwargs)))
        # cached, else timed now; a cached outlier (timed while another process ran) again
        return self._timings.timed(key, time_op, roofline)

    def confirm_timings(self) -> bool:
        """Time each op this cost model timed first (``target="cpu"``) once
        more, now -- after the rest of the trace, seconds later -- and keep the
        new timing where it is below the first by more than
        :data:`autosac.trace.timings.CONFIRM_RATIO`
        (:meth:`autosac.trace.timings.TimingCache.lower`; the next process still
        confirms each as before).  On a 2-core VM whose speed drifts, 130 of
        2,437 first timings (5 %) in a suite run were 1.5-20x what the next
        process timed (a ``bmm`` of 10 us at 508 us: a step predicted 29.9 ms,
        measured 13.9).  Returns whether any timing changed: the trace's
        times are then taken again (:func:`autosac.profile`)."""
        changed = False
        for key, (func, shapes) in self.first_timed.items():
            try:
                ms, noisy = _time_real(func, *tree_map(_Shape.meta, shapes))
            except Exception:  # noqa: BLE001 - as the first timing: it stands (a roofline is no second timing)
                continue
            changed |= self._timings.lower(key, ms, noisy)
        self.first_timed.clear()
        return changed

    def finish(self) -> None:
        """Keep this profile's new timings for the next one (``target="cpu"``)."""
        if self._timings is not None:
            self._timings.save()


@dataclass(frozen=True)
class _Shape:
    """A tensor argument's layout, kept without the tensor (a fake tensor held
    past its last use would keep its storage alive in the trace)."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype

    @staticmethod
    def of(x):
        return _Shape(tuple(x.shape), tuple(x.stride()), x.dtype) if isinstance(x, torch.Tensor) else x

    @staticmethod
    def meta(x):
        return torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device="meta") if isinstance(x, _Shape) else x


def timing_key(func, args, kwargs) -> str:
    """The key a CPU op timing is kept under (:class:`autosac.trace.timings.TimingCache`):
    the op, its tensors' shapes, strides and dtypes, its other arguments, the inputs' values."""
    shapes = _shape_key((args, kwargs))
    # an op on an expanded floating input is timed since host-costs-v30 (before, its input could not be
    # filled: priced by the roofline, and cached as timed)
    expanded = any(isinstance(x, tuple) and (x[2].is_floating_point or x[2].is_complex) and 0 not in x[0]
                   and any(st == 0 and n > 1 for n, st in zip(x[0], x[1])) for x in shapes)
    return repr((str(func), shapes, TIMED_INPUTS, *(("expanded",) if expanded else ())))


def _shape_key(tree) -> tuple:
    out = []
    for x in tree_leaves(tree):
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), tuple(x.stride()), x.dtype))
        else:
            out.append(repr(x))
    return tuple(out)


# Floating inputs an op is timed on: positive, away from 0 and 1.  Ops whose
# speed depends on the values are mostly those defined for positive values only
# (sqrt, log, pow with a fraction: a variance, AdamW's second moment): on
# negative ones they make NaNs, 20-45x slower on this CPU -- AdamW's
# _foreach_sqrt timed 2.04 ms against 0.03 ms in the real step.  Part of the
# cache key: timings taken on other inputs are taken again.
TIMED_INPUTS = (0.25, 0.75)


def _real_like(t: torch.Tensor) -> torch.Tensor:
    real = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    # filled through its whole storage, once per element: an expanded tensor (stride 0, one element at
    # several places: a sum's gradient) cannot be filled through itself, and was priced by the roofline
    every = real.as_strided((real.untyped_storage().nbytes() // real.element_size(),), (1,), 0)
    if t.is_floating_point() or t.is_complex():
        every.uniform_(*TIMED_INPUTS)
    elif t.dtype == torch.bool:
        every.fill_(True)
    else:
        every.zero_()  # indices: zero is valid for any embedding/gather
    return real


def _time_real(func, args, kwargs) -> tuple[float, bool]:
    """(least ms, noisy) of the op on random tensors of its shapes (:func:`autosac.core.noise.best_ms`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        real_args, real_kwargs = real_inputs(args, kwargs)
        return best_ms(lambda: func(*real_args, **real_kwargs))


def real_inputs(args, kwargs) -> tuple[tuple, dict]:
    """CPU tensors of the shapes, strides and dtypes of those in ``(args, kwargs)``
    (fake, meta or real), filled as ops are timed on (:data:`TIMED_INPUTS`), an
    expanded tensor (one element at several places) expanded as given.

    Example::

        >>> args, _ = real_inputs((torch.empty(4, 1, device="meta").expand(4, 8),), {})
        >>> args[0].stride(), bool(((args[0] >= 0.25) & (args[0] <= 0.75)).all())
        ((1, 0), True)
    """
    return tree_map(lambda x: _real_like(x) if isinstance(x, torch.Tensor) else x, (args, kwargs))


@lru_cache(maxsize=1)
def local_cpu_spec() -> DeviceSpec:
    """A roofline for this CPU, calibrated once with a float32 matmul and a copy
    (kept with the op timings, so it is the same in every process)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    timings = TimingCache()
    flops, bandwidth = timings.get("roofline-flops"), timings.get("roofline-bandwidth")
    if flops and bandwidth:  # the cache holds only finite numbers >= 0 (autosac.trace.timings); 0 is none
        return DeviceSpec("cpu-roofline", {"float32": flops}, bandwidth, compute_efficiency=1.0, memory_efficiency=1.0,
                          device_type="cpu")
    with unset_fake_temporarily():  # the least of settled calls; noisy ones are kept an hour (autosac.core.noise)
        a = torch.randn(512, 512)
        mm_ms, mm_noisy = best_ms(lambda: torch.mm(a, a), repeats=5)
        x = torch.empty(8 << 20, dtype=torch.uint8)
        clone_ms, clone_noisy = best_ms(x.clone, repeats=5)
    flops, bandwidth = 2 * 512**3 / max(mm_ms / 1e3, 1e-9), 2 * x.numel() / max(clone_ms / 1e3, 1e-9)
    timings.put("roofline-flops", flops, mm_noisy)
    timings.put("roofline-bandwidth", bandwidth, clone_noisy)
    timings.save()
    return DeviceSpec("cpu-roofline", {"float32": flops}, bandwidth, compute_efficiency=1.0, memory_efficiency=1.0,
                          device_type="cpu")
