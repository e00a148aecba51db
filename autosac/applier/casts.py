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
# views that keep every element of what they view, reordered or reshaped: a cast of
# one of a parameter (``x @ w.T`` under autocast casts ``w.T``) is still the whole
# parameter's cast, re-made from it.  The trace counts the same casts as the
# parameter's (a cast whose input has all of a parameter's elements).
_WHOLE_VIEW_NODES = {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
                     "AliasBackward0"}


def _param_behind(t: torch.Tensor) -> torch.nn.Parameter | None:
    """The parameter ``t`` (or the base it views) is a plain dtype cast of --
    of the parameter itself or of a view of all its elements -- if any."""
    base = t._base if t._is_view() else t
    node = base.grad_fn
    if node is None or type(node).__name__ not in _CAST_NODES:
        return None
    while True:
        nxt = node.next_functions
        if len(nxt) != 1 or nxt[0][0] is None:
            return None
        node = nxt[0][0]
        if type(node).__name__ == "AccumulateGrad":
            break
        if type(node).__name__ not in _WHOLE_VIEW_NODES:
            return None
    var = node.variable
    if not isinstance(var, torch.nn.Parameter) or var.numel() != base.numel() or var.device != base.device:
        return None
    if base.untyped_storage().nbytes() != base.numel() * base.element_size():
        return None  # the cast's storage is not exactly its elements: not laid out as the parameter's
    return var


def pack_cast(t: torch.Tensor):
    if torch.compiler.is_compiling():  # a compiled graph: the partitioner decides (casts are MUST_RECOMPUTE)
        return t
    if t.requires_grad and t.grad_fn is not None:
        param = _param_behind(t)
        if param is not None:
            return ("autosac-cast", param, t.dtype, t.size(), t.stride(), t.storage_offset())
    return t


def unpack_cast(packed):
    """The cast re-made from its parameter.  The forward's cast of a view of
    all the parameter's elements kept that view's strides (``to`` preserves a
    dense layout), so its storage holds the elements in the parameter's own
    order: the parameter's cast, viewed with the saved tensor's geometry, is it."""
    if isinstance(packed, tuple) and packed and packed[0] == "autosac-cast":
        _, param, dtype, size, stride, offset = packed
        with torch.no_grad():
            copy = param.to(dtype)
        return copy.as_strided(size, stride, offset)
    return packed
