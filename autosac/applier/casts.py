"""Never save a parameter's low-precision copy for backward.

Under autocast each use of a weight makes a cast copy (``_to_copy``), and
autograd saves it for backward: a second copy of every parameter held from
forward to backward.  Outside checkpointed modules this saved-tensor hook
stores a reference to the parameter instead and re-makes the cast when
backward asks for it (inside checkpointed modules the policy recomputes it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch.utils._python_dispatch import _disable_current_modes

from autosac.core.opkinds import is_param_cast
from autosac.core.userwarn import warn_user

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


class _Cast(NamedTuple):
    """A parameter's cast, packed: what re-makes it, and the parameter's version then."""

    param: torch.nn.Parameter
    version: int
    dtype: torch.dtype
    size: torch.Size
    stride: tuple
    offset: int


def pack_cast(t: torch.Tensor, forward: object = None):
    """A parameter's cast as what re-makes it; any other activation as an alias
    without its graph: kept as ``t`` itself, an output its own node saves
    (``exp``, ``tanh``) would hold that node, which holds it -- a cycle through
    C++ no collector breaks, so a result whose backward never runs (an unused
    ``std`` of a posterior) was never freed, a leak every step.  Autograd gives
    the unpacked alias its node back.  Detached with dispatch modes off: a
    mode of the caller's sees no op of autosac's.

    Each with its version: autograd skips its in-place check for tensors that
    go through saved-tensor hooks, so :func:`unpack_cast` makes it.  A cast
    first saved in an earlier forward (``forward``: a token of the applied
    model's forward call) came from autocast's cache, which lives as long as
    the outermost ``torch.autocast`` region, optimizer steps included: it is
    saved as it is, since the parameter may have changed since (through
    ``.data`` too, which no version shows); re-made, it would hold the new values."""
    if torch.compiler.is_compiling():  # a compiled graph: the partitioner decides (casts are MUST_RECOMPUTE)
        return t
    version = t._version
    if t.requires_grad and t.grad_fn is not None:
        param = _param_behind(t)
        if param is not None and _fresh(t, forward):
            return _Cast(param, param._version, t.dtype, t.size(), t.stride(), t.storage_offset())
        if not torch._C._len_torch_dispatch_stack() and not _len_torch_dispatch_stack_pre_dispatch():
            return (t.detach(), version)  # no mode to hide it from: a microsecond where disabling modes takes four
        with _disable_current_modes():
            return (t.detach(), version)
    return (t, version)


def unpack_cast(packed):
    """The cast re-made from its parameter.  The forward's cast had the layout
    of a view reordering the contiguous parameter's dims (checked when packed),
    so its storage holds the elements in the parameter's own order: the
    parameter's cast, viewed with the saved tensor's geometry, is it.

    Raises:
        RuntimeError: the saved tensor, or the parameter a cast is re-made
            from, was changed in place since it was saved (as autograd raises
            without the hook; for a parameter, an optimizer step between a
            forward and its backward).
    """
    if type(packed) is tuple:  # (tensor, its version when saved): a plain tuple, the cheapest to make
        tensor, version = packed
        if tensor._version != version:
            raise RuntimeError(_modified(tensor, version, "a tensor saved for backward"))
        return tensor
    if isinstance(packed, _Cast):
        if packed.param._version != packed.version:
            raise RuntimeError(_modified(packed.param, packed.version, "a parameter whose autocast copy backward "
                                         "needs (an optimizer step between a forward and its backward?)"))
        with torch.no_grad():
            copy = packed.param.to(packed.dtype)
        return copy.as_strided(packed.size, packed.stride, packed.offset)
    return packed


def _fresh(cast: torch.Tensor, forward: object) -> bool:
    """Whether ``cast`` was made in this forward (``forward``: its token,
    noted on the cast when first saved; None: every cast is)."""
    if forward is None:
        return True
    base = cast._base if cast._is_view() else cast
    made = base.__dict__.setdefault("_autosac_forward", forward)
    if made is forward:
        return True
    if not base.__dict__.setdefault("_autosac_stale_said", False):
        base._autosac_stale_said = True
        warn_user(
            "autosac: autocast handed this forward a parameter's low-precision copy made in an earlier forward "
            "(one torch.autocast region keeps its casts until it exits: around an optimizer step, the forward ran "
            "on the weights from before it); such copies are saved as they are -- gradients as without a plan, "
            "held beyond the plan's budget. Put torch.autocast around each forward and its loss only"
        )
    return False


def _modified(t: torch.Tensor, saved: int, what: str) -> str:
    return (f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"{what}, {t.dtype} {list(t.shape)}, is at version {t._version}; expected version {saved} instead "
            "(autosac's saved-tensor hook checks what autograd checks without it)")
