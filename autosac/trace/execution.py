"""How the trace runs one op: fake, or for real when it only reads and makes
small real tensors (so code that reads values branches as in the real step),
and with the output laid out as the real kernel lays it out."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_leaves, tree_map

from autosac.core.opkinds import is_random_op, written_tensors
from autosac.trace.fake_kernels import run_fake
from autosac.trace.layouts import restrides, with_kernel_strides
from autosac.trace.routing import ROUTED_NUMEL, with_long_indices

SMALL_NUMEL = 1 << 16  # tensors this small (and on the cpu) may be computed for real


# Ops whose kernels (CPU and CUDA) lay their first output out in the input's
# suggested memory format -- contiguous, or channels-last -- where the meta
# kernel keeps the input's strides.  Found by comparing real and fake output
# strides of the common ops on non-contiguous inputs; only batch norm differed.
# The strides matter for memory: a transposed batch-norm output fed to a matmul
# is copied to contiguous in the real step, not in the trace.
# Op name -> the argument whose format it is (batch norm's backward: the forward input).
SUGGESTED_FORMAT_OPS = {"native_batch_norm": 0, "_native_batch_norm_legit": 0,
                        "_native_batch_norm_legit_no_training": 0, "native_batch_norm_backward": 1}


def with_kernel_layout(func, args, out, kwargs=None):
    """``out`` with its first tensor laid out as the real kernel lays it out
    (:data:`SUGGESTED_FORMAT_OPS`; a view's or pointwise op's size-1 dims,
    :mod:`autosac.trace.layouts`); other ops' outputs unchanged."""
    if restrides(func):
        return with_kernel_strides(func, args, kwargs or {}, out)
    which = SUGGESTED_FORMAT_OPS.get(func.overloadpacket.__name__)
    if which is None or not isinstance(out, tuple) or not out or len(args) <= which:
        return out
    x, first = args[which], out[0]
    fmt = _suggested_format(x)
    if not isinstance(first, FakeTensor) or not isinstance(x, torch.Tensor) or first.is_contiguous(memory_format=fmt):
        return out
    return (torch.empty_like(first, memory_format=fmt), *out[1:])


def _suggested_format(x: torch.Tensor) -> torch.memory_format:
    """ATen's ``suggest_memory_format``: channels-last for a 4-d (5-d) tensor laid
    out so, and not also contiguous; else contiguous."""
    for dim, fmt in ((4, torch.channels_last), (5, torch.channels_last_3d)):
        if x.dim() == dim and x.is_contiguous(memory_format=fmt) and not x.is_contiguous():
            return fmt
    return torch.contiguous_format


def run_op(func, args, kwargs, made_in_trace=lambda t: False, fake_mode=None, small_values=True, routed=None):
    """Run one op of the trace: under fake mode, unless it only reads small real
    tensors (or none) and makes small ones (and ``small_values``: a trace whose
    fused kernels are skipped computes no values, so its ops all run fake).

    Code that branches on tensor values -- position ids, attention masks, a
    cache's length -- then sees the values an eager step sees, and code that
    asks whether it is being traced (``isinstance(x, FakeTensor)``, as
    transformers does before choosing its attention-mask path) gets the same
    answer as in the real step, so the trace takes the real step's branches.
    Random ops always run fake: the trace never advances the real RNG; and an
    op that writes in place runs for real only into tensors the trace made
    (``made_in_trace``): the model's own tensors are never changed (a write
    into one goes to a fake twin of it).  ``routed`` (a
    :class:`~autosac.trace.routing.RoutingTrace`): real tensors derived from
    routing decisions run for real up to ``ROUTED_NUMEL`` elements, and what
    they make is derived too.  Fake ops go through
    :func:`~autosac.trace.fake_kernels.run_fake` (meta kernels that refuse
    what the real kernel runs).
    """
    if is_random_op(func):
        return func(*args, **kwargs)
    if func.namespace != "aten":
        return run_fake(func, args, kwargs)
    foreign = [t for t in written_tensors(func, args, kwargs) if not isinstance(t, FakeTensor) and not made_in_trace(t)]
    if foreign:
        if fake_mode is None:
            raise RuntimeError("autosac: an op writes into a real tensor of the model during the trace")
        twins = {id(t): fake_mode.from_tensor(t) for t in foreign}
        args, kwargs = tree_map(lambda a: twins.get(id(a), a) if isinstance(a, torch.Tensor) else a, (args, kwargs))
        return run_fake(func, args, kwargs)
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if small_values and func.overloadpacket.__name__ in VALUE_FREE_OPS:
        made = _made_from_shapes(func, args, kwargs)
        if made is not None:
            return made
    if not small_values or any(isinstance(t, FakeTensor) or t.requires_grad or t.device.type != "cpu"
                               for t in tensors):
        return run_fake(func, with_long_indices(func, args, routed), kwargs)
    from_routing = routed is not None and routed.reads_routing(tensors)
    if sum(t.numel() for t in tensors) > (ROUTED_NUMEL if from_routing else SMALL_NUMEL):
        return run_fake(func, args, kwargs)
    if not tensors:  # a factory: real only when what it makes is small and on the cpu
        fake = func(*args, **kwargs)
        made = [t for t in tree_leaves(fake) if isinstance(t, torch.Tensor)]
        if not made or any(t.device.type != "cpu" or t.numel() > SMALL_NUMEL for t in made):
            return fake
    with unset_fake_temporarily():
        out = func(*args, **kwargs)
    if from_routing:
        routed.mark(out)
    return out


# Ops whose output values are set by the op, not read from their tensor input
# (only its shape, dtype and device are): a small one on the cpu is made for
# real from a fake input, so lengths computed from it (``ones_like(audio,
# dtype=long).sum(-1)``, transformers' CTC heads) are values the trace has.
VALUE_FREE_OPS = frozenset({"ones_like", "zeros_like", "full_like", "new_ones", "new_zeros", "new_full"})


def _made_from_shapes(func, args, kwargs):
    """A :data:`VALUE_FREE_OPS` op's integer or boolean output (lengths, masks),
    made for real from an empty twin of its fake input when small and on the
    cpu; ``None`` otherwise.  A floating one stays fake: what it holds is
    written next by ops on fake activations (an MoE's ``zeros_like`` output
    buffer), whose results a real tensor could not keep."""
    x = args[0] if args else None
    if not isinstance(x, FakeTensor) or any(isinstance(a, torch.Tensor) for a in tree_leaves((args[1:], kwargs))):
        return None
    fake = func(*args, **kwargs)
    if (not isinstance(fake, torch.Tensor) or fake.device.type != "cpu" or fake.numel() > SMALL_NUMEL
            or fake.is_floating_point() or fake.is_complex()):
        return fake
    with unset_fake_temporarily():
        return func(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype), *args[1:], **kwargs)
