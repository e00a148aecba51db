"""Never save a parameter's low-precision copy for backward.

Under autocast each use of a weight makes a cast copy (``_to_copy``), and
autograd saves it for backward: a second copy of every parameter held from
forward to backward.  Outside checkpointed modules this saved-tensor hook
stores a reference to the parameter instead and re-makes the cast when
backward asks for it (inside checkpointed modules the policy recomputes it).
"""

from __future__ import annotations

import torch

_CAST_NODES = {"ToCopyBackward0"}


def _param_behind(t: torch.Tensor) -> torch.nn.Parameter | None:
    """The parameter ``t`` (or the base it views) is a plain dtype cast of, if any."""
    base = t._base if t._is_view() else t
    fn = base.grad_fn
    if fn is None or type(fn).__name__ not in _CAST_NODES:
        return None
    nxt = fn.next_functions
    if len(nxt) != 1 or nxt[0][0] is None or type(nxt[0][0]).__name__ != "AccumulateGrad":
        return None
    var = nxt[0][0].variable
    if not isinstance(var, torch.nn.Parameter) or var.shape != base.shape or var.device != base.device:
        return None
    return var


def pack_cast(t: torch.Tensor):
    if torch.compiler.is_compiling():  # a compiled graph: the partitioner decides (casts are MUST_RECOMPUTE)
        return t
    if t.requires_grad and t.grad_fn is not None:
        param = _param_behind(t)
        if param is not None:
            return ("autosac-cast", param, t.dtype, t.size(), t.stride(), t.storage_offset(), t._is_view())
    return t


def unpack_cast(packed):
    if isinstance(packed, tuple) and packed and packed[0] == "autosac-cast":
        _, param, dtype, size, stride, offset, is_view = packed
        with torch.no_grad():
            copy = param.to(dtype)
        return copy.as_strided(size, stride, offset) if is_view else copy
    return packed
