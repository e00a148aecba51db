"""Never save a parameter's low-precision copy for backward.

Under autocast each use of a weight makes a cast copy (``_to_copy``), and
autograd saves it for backward: a second copy of every parameter held from
forward to backward.  Outside checkpointed modules this saved-tensor hook
stores a reference to the parameter instead and re-makes the cast when
backward asks for it (inside checkpointed modules the policy recomputes it).
"""

from __future__ import annotations

import torch
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch.utils._python_dispatch import _disable_current_modes

from autosac.core.opkinds import is_param_cast

_CAST_NODES = {"ToCopyBackward0"}
# views that only reorder a parameter's dims, and how to make them again
_REORDER_VIEWS = {
    "TBackward0": lambda v, node: v.t(),
    "TransposeBackward0": lambda v, node: v.transpose(node._saved_dim0, node._saved_dim1),
    "PermuteBackward0": lambda v, node: v.permute(node._saved_dims),
    "AliasBackward0": lambda v, node: v,
}


def _param_behind(t: torch.Tensor) -> torch.nn.Parameter | None:
    """The parameter ``t`` (or the base it views) is a cast of, where
    :func:`autosac.core.opkinds.is_param_cast` says the cast is the parameter's:
    autograd's path from the cast runs through views that only reorder dims
    to the parameter, and the cast kept that view's layout."""
    base = t._base if t._is_view() else t
    node = base.grad_fn
    if node is None or type(node).__name__ not in _CAST_NODES:
        return None
    views = []
    while True:
        nxt = node.next_functions
        if len(nxt) != 1 or nxt[0][0] is None:
            return None
        node = nxt[0][0]
        if type(node).__name__ == "AccumulateGrad":
            break
        if type(node).__name__ not in _REORDER_VIEWS:
            return None
        views.append(node)
    var = node.variable
    if not isinstance(var, torch.nn.Parameter) or var.device != base.device:
        return None
    view = var.detach()
    for n in reversed(views):
        view = _REORDER_VIEWS[type(n).__name__](view, n)
    return var if is_param_cast(view, base, var) else None


def pack_cast(t: torch.Tensor):
    """A parameter's cast as what re-makes it; any other activation as an alias
    without its graph: kept as ``t`` itself, an output its own node saves
    (``exp``, ``tanh``) would hold that node, which holds it -- a cycle through
    C++ no collector breaks, so a result whose backward never runs (an unused
    ``std`` of a posterior) was never freed, a leak every step.  Autograd gives
    the unpacked alias its node back.  Detached with dispatch modes off: a
    mode of the caller's sees no op of autosac's."""
    if torch.compiler.is_compiling():  # a compiled graph: the partitioner decides (casts are MUST_RECOMPUTE)
        return t
    if t.requires_grad and t.grad_fn is not None:
        param = _param_behind(t)
        if param is not None:
            return ("autosac-cast", param, t.dtype, t.size(), t.stride(), t.storage_offset())
        if not torch._C._len_torch_dispatch_stack() and not _len_torch_dispatch_stack_pre_dispatch():
            return t.detach()  # no mode to hide it from: a microsecond where disabling modes takes four
        with _disable_current_modes():
            return t.detach()
    return t


def unpack_cast(packed):
    """The cast re-made from its parameter.  The forward's cast had the layout
    of a view reordering the contiguous parameter's dims (checked when packed),
    so its storage holds the elements in the parameter's own order: the
    parameter's cast, viewed with the saved tensor's geometry, is it."""
    if isinstance(packed, tuple) and packed and packed[0] == "autosac-cast":
        _, param, dtype, size, stride, offset = packed
        with torch.no_grad():
            copy = param.to(dtype)
        return copy.as_strided(size, stride, offset)
    return packed
