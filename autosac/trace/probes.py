"""Real kernels run on zeros, once per shape, for what a fake trace cannot see:
the working memory a kernel allocates and frees inside one call, the sizes of
outputs the meta kernel sizes unlike the real one, and the numbers autograd
keeps as 0-dim tensors for an in-place op.  Used by
:class:`~autosac.trace.recorder.StepRecorder` for each op it records."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cache, lru_cache

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_leaves

from autosac.core.allocations import allocation_peak
from autosac.core.errors import ProfilerBusyError
from autosac.core.opkinds import is_view_op

# Kernels whose outputs the meta kernel sizes unlike the real one: their output
# sizes are read off a real call on zeros.  oneDNN's RNN workspace; and losses
# whose reduced result is a 0-dim view of the input-sized elementwise loss the
# kernel made (mse_loss(reduction="mean") of a 64 KiB input returns a scalar
# holding 64 KiB, alive as long as the loss is: through backward).
REAL_SIZE_OPS = frozenset({"mkldnn_rnn_layer", "mse_loss", "smooth_l1_loss", "soft_margin_loss",
                           "binary_cross_entropy"})
# Kernels whose internal working memory depends on the kernel's own choices
# (oneDNN's reorders in a convolution's backward; the CPU flash attention's
# per-thread blocks), and losses that reduce an input-sized elementwise loss
# they make inside the kernel (mse_loss(reduction="mean") of a 64 KiB input
# peaks 128 KiB above its result on the CPU): measured on a real call on zeros.
PROBE_SCRATCH_OPS = frozenset({
    "convolution_backward", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "mse_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "soft_margin_loss",
    "binary_cross_entropy_with_logits",  # three buffers of its input's size
    # the source's gradient: the selected values, zeros for the rest and their concatenation,
    # inside one call (a vision-language model's image features scattered into the text embeddings)
    "masked_scatter_backward",
})
# Matmuls in half precision (oneDNN converts and reorders blocks internally).
_HALF_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


# CPU kernels with working memory of their own: means divide by the count
# wrapped in a tensor (12 B for float32; a half-precision mean sums a float32
# copy of its input), oneDNN's forward convolution reorders into buffers
_CPU_PROBED = frozenset({"mean", "nanmean", "convolution"})
# ATen's grain size: a CPU reduction over fewer elements runs on one thread
_PARALLEL_GRAIN = 32768


def needs_probe(func, args, device_type: str = "cpu", outs=()) -> bool:
    """Whether the kernel's internal working memory is measured by a probe.

    On a CPU, a pointwise op whose tensor inputs differ in dtype (autocast's
    bfloat16 output added to a float32 residual, a float times a boolean
    mask) first copies the narrower ones to the common dtype, inside the call
    (TensorIterator promotes CPU inputs; CUDA kernels cast as they load); a
    reduction into another dtype (a mask's ``sum`` into int64) copies its
    input to it.  And on a CPU any
    other op that is not pointwise and reads half precision: its kernel may
    work in float32 on the side (``gather`` of bfloat16 with an expanded index
    peaks at 3x its result).  And on a CPU running more than one torch thread,
    a reduction to one number over at least ATen's grain of elements (the
    loss's ``sum``): its threads' partial results sit in a buffer while they
    are combined (8 B for a float32 ``sum`` at 2 threads, ``amax`` alike,
    ``max`` not).  On a CPU a ``mean`` (the count wrapped in a tensor; a
    half-precision input copied to float32).  And losses whose kernels work
    in input-sized buffers: the backwards of the ``*_loss`` kernels, and
    ``binary_cross_entropy_with_logits`` (three of its input's size)."""
    name = func.overloadpacket.__name__
    if name in PROBE_SCRATCH_OPS or name == "mkldnn_rnn_layer_backward" or name.endswith("_loss_backward"):
        return True  # loss backwards work in input-sized buffers (soft margin's: two)
    if device_type == "cpu" and name in _CPU_PROBED:
        return True
    if device_type == "cpu" and (_parallel_full_reduction(func, args, outs) or _casting_reduction(func, args, outs)):
        return True
    if device_type == "cpu" and torch.Tag.pointwise in func.tags and _mixed_dtypes(args):
        return True
    if device_type == "cpu" and torch.Tag.pointwise not in func.tags and not is_view_op(func) and _half(args):
        return True
    return name in _HALF_MATMULS and _half(args)


def _parallel_full_reduction(func, args, outs) -> bool:
    if torch.get_num_threads() < 2 or torch.Tag.reduction not in func.tags:
        return False
    if not outs or any(not isinstance(o, torch.Tensor) or o.numel() != 1 for o in outs):
        return False
    return any(isinstance(a, torch.Tensor) and a.numel() >= _PARALLEL_GRAIN for a in tree_leaves(args))


def _casting_reduction(func, args, outs) -> bool:
    """A reduction into another dtype than its input's (a boolean mask's
    ``sum`` into int64: the CPU kernel first copies the input to it)."""
    if torch.Tag.reduction not in func.tags or not outs or not isinstance(outs[0], torch.Tensor):
        return False
    return any(isinstance(a, torch.Tensor) and a.dim() and a.dtype != outs[0].dtype for a in tree_leaves(args))


def _half(args) -> bool:
    """Whether any tensor among the op's arguments is in half precision."""
    return any(isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) for a in tree_leaves(args))


def _mixed_dtypes(args) -> bool:
    """Whether the op's tensor arguments (not 0-dim ones) hold more than one dtype."""
    dtypes = {a.dtype for a in tree_leaves(args) if isinstance(a, torch.Tensor) and a.dim()}
    return len(dtypes) > 1


_PROBE_CAP_BYTES = 256 << 20
PROBE_CAP_FLOPS = 3e10  # a probe runs the kernel for real: about a second here at most


@dataclass(frozen=True)
class _Zeros:
    shape: tuple
    stride: tuple
    dtype: torch.dtype


def _spec(x):
    """A hashable stand-in for an op's arguments: tensors by shape, stride and dtype."""
    if isinstance(x, torch.Tensor):
        return _Zeros(tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_spec(v) for v in x)
    return x


def _real(x):
    """Zeros (with the recorded strides) for each :class:`_Zeros` in ``x``."""
    if isinstance(x, _Zeros):
        return torch.empty_strided(x.shape, x.stride, dtype=x.dtype).zero_()
    return [_real(v) for v in x] if isinstance(x, tuple) else x


@lru_cache(maxsize=256)
def _probe(func, args: tuple, kwargs: tuple) -> tuple[int, ...] | None:
    try:
        with unset_fake_temporarily(), torch.random.fork_rng(devices=[]):
            out = func(*[_real(a) for a in args], **{k: _real(v) for k, v in kwargs})
        return tuple(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    except Exception:  # noqa: BLE001 - no probe: keep the meta kernel's sizes
        return None


@lru_cache(maxsize=512)
def _probe_scratch(func, args: tuple, kwargs: tuple, threads: int) -> int | None:
    """The kernel's peak above what it returns, on zeros (``threads``: the torch
    thread count it ran at, part of the cache key: a parallel kernel's buffers
    depend on it)."""
    try:
        with unset_fake_temporarily(), torch.random.fork_rng(devices=[]):  # never advance the real RNG
            real_args = [_real(a) for a in args]
            real_kwargs = {k: _real(v) for k, v in kwargs}
            peak, made = allocation_peak(lambda: func(*real_args, **real_kwargs))
        return max(0, peak - max(made, 0))
    except ProfilerBusyError:
        raise
    except Exception:  # noqa: BLE001 - no probe: keep the modelled scratch
        return None


@lru_cache(maxsize=64)
def _probe_rnn_backward(args: tuple) -> tuple[int, int] | None:
    """oneDNN's RNN backward reads the workspace its forward wrote: a probe on
    zeros alone could crash, so the layer's forward runs first (on zeros of the
    same shapes, with the same settings) and its backward is measured on what
    that forward returned: ``(peak, net)`` as :func:`allocation_peak`."""
    (inp, w1, w2, w3, w4, hx, cx, _out, _hy, _cy, g_out, g_hy, g_cy,
     reverse, mode, hidden, layers, biases, train, bidirectional, batch_sizes, batch_first, _ws) = args
    try:
        with unset_fake_temporarily(), torch.enable_grad():  # the forward writes a workspace only with grad on
            x, a, b, c, d, h0, c0 = (_real(t) for t in (inp, w1, w2, w3, w4, hx, cx))
            out, hy, cy, ws = torch.ops.aten.mkldnn_rnn_layer(
                x, a, b, c, d, h0, c0, reverse, list(batch_sizes), mode, hidden, layers, biases, bidirectional,
                batch_first, train)
            grads = [None if g is None else _real(g) for g in (g_out, g_hy, g_cy)]
            return allocation_peak(lambda: torch.ops.aten.mkldnn_rnn_layer_backward(
                x, a, b, c, d, h0, c0, out, hy, cy, *grads, reverse, mode, hidden, layers, biases, train,
                bidirectional, list(batch_sizes), batch_first, ws))
    except ProfilerBusyError:
        raise
    except Exception:  # noqa: BLE001 - no probe: keep the modelled scratch
        return None


def probed_scratch_bytes(func, args, kwargs, default: int, outs=()) -> int:
    """Working memory the real kernel allocates and frees inside one call (its
    peak above what it returns), measured once per shape on zeros (inputs up to
    256 MiB); ``default`` when it cannot be measured.

    oneDNN's RNN backward returns the two bias gradients as two tensors where
    the meta kernel returns one: the difference to the fake ``outs`` is counted
    here too."""
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if sum(t.numel() * t.element_size() for t in tensors) > _PROBE_CAP_BYTES:
        return default
    try:
        if func.overloadpacket.__name__ == "mkldnn_rnn_layer_backward" and not kwargs:
            probed = _probe_rnn_backward(_spec(tuple(args)))
            if probed is None:
                return default
            peak, made = probed
            fake_made = sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in outs}.values())
            return max(0, peak - made) + max(0, made - fake_made)
        found = _probe_scratch(func, _spec(tuple(args)), tuple(sorted((k, _spec(v)) for k, v in kwargs.items())),
                               torch.get_num_threads())
    except TypeError:
        return default
    return default if found is None else found


_WRAPPED = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def scalar_scratch_bytes(func, args, kwargs, device_type: str = "cpu") -> int:
    """What a CPU pointwise kernel allocates for a Python number passed as its
    ``other`` operand (``x * 2.0``, ``ids.ne(-100)``): the number wrapped in a
    0-dim tensor (8 bytes for a float or int, 1 for a bool), plus its cast to
    the op's dtype where that differs (4 more for float32).  Numbers in other
    slots (``alpha``, ``min``, a fill value) are kernel parameters and cost
    nothing.  Measured with the profiler's allocator events; on a GPU the
    number is a kernel argument and costs no device memory."""
    if device_type != "cpu" or torch.Tag.pointwise not in func.tags:
        return 0
    i = _other_slot(func)
    v = None if i is None else _arg(args, kwargs, i, "other")
    if type(v) not in _WRAPPED:
        return 0
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if first is None or first.device.type != "cpu":
        return 0
    wrapped = _WRAPPED[type(v)]
    return wrapped.itemsize + (first.element_size() if first.dtype != wrapped else 0)


# normalizations that save a mean and an inverse std (outputs 1 and 2): where their
# parameters sit among the arguments
_NORM_PARAMS = {"native_batch_norm": (1, 5), "_native_batch_norm_legit": (1, 5), "_batch_norm_with_update": (1, 5),
                "native_layer_norm": (2, 4), "native_group_norm": (1, 3)}
_HALF = (torch.bfloat16, torch.float16)


def norm_stat_bytes(func, args, outs) -> tuple[int, ...] | None:
    """Each output's bytes for a batch, layer or group norm of half-precision
    input with wider parameters (a float32 ``BatchNorm2d`` or ``LayerNorm``
    under autocast): its kernel keeps the saved mean and inverse std in the
    parameters' dtype, where the meta kernel says the input's (on the CPU,
    measured: 256 bytes for 64 channels, not 128; a Conv2d-BatchNorm2d step
    under bf16 autocast read 256 bytes over its least budget, a Segformer
    21 KB).  None for any other op or mix."""
    where = _NORM_PARAMS.get(func.overloadpacket.__name__)
    if where is None or not args or not isinstance(args[0], torch.Tensor) or args[0].dtype not in _HALF:
        return None
    params = [a for a in args[where[0]:where[1]] if isinstance(a, torch.Tensor)]
    if not params or params[0].element_size() <= args[0].element_size():
        return None
    wide = params[0].element_size()
    return tuple(t.numel() * wide if j in (1, 2) else t.untyped_storage().nbytes() for j, t in enumerate(outs))


def real_output_bytes(func, args, kwargs) -> tuple[int, ...] | None:
    """Storage bytes of each tensor output when the real kernel runs (on zeros
    of the same shapes; inputs up to 256 MiB), or None."""
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if sum(t.numel() * t.element_size() for t in tensors) > _PROBE_CAP_BYTES:
        return None

    try:
        return _probe(func, _spec(tuple(args)), tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))
    except TypeError:  # unhashable arguments
        return None


@cache
def _tensor_slots(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of the schema's Tensor-typed arguments (once per op)."""
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments) if isinstance(a.type, torch.TensorType))


@cache
def _other_slot(func) -> int | None:
    """Position of the schema's ``other`` argument, if it has one."""
    return next((i for i, a in enumerate(func._schema.arguments) if a.name == "other"), None)


def _arg(args, kwargs, i: int, name: str):
    return args[i] if i < len(args) else kwargs.get(name)


def number_in_tensor_slot(func, args, kwargs) -> bool:
    """Whether a Python number was passed where the schema takes a Tensor."""
    return any(isinstance(_arg(args, kwargs, i, n), (int, float, complex)) for i, n in _tensor_slots(func))


def dtypes_key(x):
    """A hashable stand-in for an op's arguments: tensors by dtype alone."""
    if isinstance(x, torch.Tensor):
        return _Zeros((), (), x.dtype)
    if isinstance(x, dict):
        return tuple((k, dtypes_key(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return tuple(dtypes_key(v) for v in x)
    return x


@lru_cache(maxsize=256)
def saved_number_bytes(func, args: tuple, kwargs: tuple) -> int:
    """Bytes of the 0-dim tensors autograd keeps for the numbers an in-place op
    took in Tensor slots (``h.mul_(0.5)`` keeps 0.5): the op run for real on
    0-dim tensors, its node's saved values read.  It runs on a thread of its
    own, outside this dispatch (where autograd is below) and any mode."""
    found = []
    worker = threading.Thread(target=lambda: found.append(_numbers_kept(func, args, kwargs)), daemon=True)
    worker.start()
    worker.join()
    return found[0] if found else 0


def _numbers_kept(func, args: tuple, kwargs: tuple) -> int:
    try:
        real = [_real(a).requires_grad_().clone() if isinstance(a, _Zeros) else a for a in args]
        out = func(*real, **{k: _real(v) for k, v in kwargs})
    except Exception:  # noqa: BLE001 - an op that cannot run on 0-dim tensors: nothing counted
        return 0
    node = out.grad_fn if isinstance(out, torch.Tensor) else None
    saved = [getattr(node, n) for n in dir(node) if n.startswith("_saved_")] if node is not None else []
    mine = {id(t) for t in real if isinstance(t, torch.Tensor)}
    return sum(v.untyped_storage().nbytes() for v in saved
               if isinstance(v, torch.Tensor) and v.dim() == 0 and id(v) not in mine and not v.requires_grad)

