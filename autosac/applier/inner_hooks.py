"""Forward hooks inside checkpointed modules: said once, at the first
training forward of an applied model.

A checkpoint's replay re-runs the forward of every module inside the
checkpointed one, and with it their forward hooks and pre-hooks (as
``torch.utils.checkpoint`` does: a hook may change what the module returns,
so the replay cannot skip it); hooks registered for every module
(``torch.nn.modules.module.register_module_forward_hook``) too, for each module
inside.  A hook that only records -- activations
appended to a list, a counter or statistics logger of its own -- then sees
each of those calls twice, the second time in the backward (what it changes
on the modules themselves is undone: the replay swaps their Python state,
:mod:`autosac.core.pystate`).  A hook on the checkpointed module itself runs
once (the checkpoint is inside it).

PyTorch's own hooks and transformers' output-capturing hooks (inactive
outside the forward that asked for outputs) are not reported.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from autosac.core.marks import POLICY
from autosac.core.userwarn import warn_user

_QUIET_PACKAGES = ("torch", "transformers", "autosac")


def warn_inner_hooks(state: dict, model: nn.Module) -> None:
    """One warning, at the first training forward after ``apply`` (``state``:
    the applied model's), naming forward hooks and pre-hooks of yours on
    modules inside checkpointed modules: they run again in the backward.

    Example::

        >>> model.blocks[0].attn.register_forward_hook(record)   # blocks.0 checkpointed
        >>> model(x)   # UserWarning: ... 'blocks.0.attn' (record) run again ...
    """
    if state.get("hooks_checked"):
        return
    state["hooks_checked"] = True
    found, inside = [], False
    for fqn, region in model.named_modules():
        if POLICY not in region.__dict__:
            continue
        for name, inner in region.named_modules():
            if name:
                inside = True
                hooks = [*inner._forward_pre_hooks.values(), *inner._forward_hooks.values()]
                found.extend((f"{fqn}.{name}" if fqn else name, _name(h)) for h in hooks if _users(h))
    if inside:  # hooks for every module run again for each module inside a checkpointed one
        found.extend(_global_hooks())
    if found:
        shown = ", ".join(f"'{where}' ({what})" for where, what in found[:3])
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        warn_user(
            f"autosac: forward hooks on modules inside checkpointed ones -- {shown}{more} -- run again when the "
            "backward recomputes those modules (as under torch.utils.checkpoint): a hook that records into a list "
            "or counter of its own sees each call twice (changes to the modules' attributes are undone). A hook "
            "that only records can go on the checkpointed module itself, where it runs once, or on a module no "
            "checkpointed one holds"
        )


def _global_hooks() -> list[tuple[str, str]]:
    """The user's hooks for every module (``register_module_forward_hook`` and
    ``..._pre_hook``): they run for the modules inside a checkpointed one again
    in its replay.  Read from ``torch.nn.modules.module``'s tables (no public
    accessor); none where a torch version keeps them elsewhere."""
    tables = [getattr(torch.nn.modules.module, name, None) or {}
              for name in ("_global_forward_pre_hooks", "_global_forward_hooks")]
    return [("every module", _name(h)) for table in tables for h in table.values() if _users(h)]


def _target(hook):
    while isinstance(hook, functools.partial):
        hook = hook.func
    return hook


def _users(hook) -> bool:
    """Whether ``hook`` is the user's (not PyTorch's, transformers' or autosac's own)."""
    module = getattr(_target(hook), "__module__", None) or type(hook).__module__ or ""
    return module.split(".")[0] not in _QUIET_PACKAGES


def _name(hook) -> str:
    target = _target(hook)
    return getattr(target, "__qualname__", None) or type(target).__name__
