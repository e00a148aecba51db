"""Stage 3 of the pipeline: make a Plan real on the model.

Each decided module's forward runs under ``torch.utils.checkpoint`` (non-reentrant)
with a selective-checkpoint policy that recomputes exactly the planned op calls;
RNG state is preserved, so recomputed dropout draws the same mask, and
recomputation never updates buffers or Python state twice
(:mod:`autosac.applier.region`).  Around the whole model, a saved-tensor hook
keeps parameter casts from being saved, and a run with other input shapes
than the plan's is warned about.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autosac.applier.casts import pack_cast, unpack_cast
from autosac.applier.compiled import compiled_context_fn, save_keys
from autosac.applier.region import RegionPolicy, warn_user
from autosac.errors import PlanMismatchError, StatsFormatError
from autosac.fingerprint import model_fingerprint
from autosac.inputs import format_signature, input_signature
from autosac.integrations import cache_requested, no_cache_hook, own_checkpointing, transformers_models
from autosac.marks import APPLIED, CACHE_WARNED, POLICY
from autosac.plan import Plan

__all__ = ["apply", "unapply"]

_CAST_CTX = "_autosac_cast_ctx"  # the model's open parameter-cast hook contexts, one per running forward



def apply(model: nn.Module, plan: Plan) -> nn.Module:
    """Checkpoint ``model`` in place as ``plan`` says; return it.

    Parameters stay the same objects, ``state_dict`` keys do not change, and an
    optimizer built before still works.  Applying again replaces the previous
    plan (never double-wraps); :func:`unapply` restores the model.  FSDP2's
    ``fully_shard`` may be applied afterwards.

    Args:
        model: the model the plan was made for (same module tree and parameter shapes).
        plan: from :func:`autosac.solve` or :meth:`Plan.load`.

    Returns:
        The same ``model``.

    Raises:
        PlanMismatchError: the plan was made for another model, or names a module
            the model does not have.  Nothing is changed.
        StatsFormatError: the plan is internally inconsistent (hand-edited).
        ValueError: the model checkpoints by itself (transformers' gradient checkpointing).

    Example::

        >>> plan = autosac.solve(model, "60%", example_inputs=idx)
        >>> autosac.apply(model, plan)
        >>> model(idx).sum().backward()     # same gradients, lower peak
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply needs an nn.Module, got {type(model).__name__}")
    if not isinstance(plan, Plan):
        raise TypeError(f"apply needs an autosac.Plan, got {type(plan).__name__}")
    plan.validate()
    reason = own_checkpointing(model)
    if reason is not None:
        raise ValueError(reason)
    # Check everything before changing anything: nothing is applied halfway.
    modules = {}
    for fqn in plan.decisions:
        try:
            modules[fqn] = model.get_submodule(fqn)
        except AttributeError:
            raise PlanMismatchError(
                f"the plan checkpoints module {fqn!r}, which {type(model).__name__} does not have"
            ) from None
    found = model_fingerprint(model)
    if found != plan.fingerprint:
        raise PlanMismatchError(
            f"the plan was made for {plan.model} ({plan.fingerprint}) but this {type(model).__name__} is "
            f"({found}): module tree or parameter shapes differ -- re-plan for this model"
        )
    try:
        policies = {fqn: RegionPolicy.from_decision(plan.details[fqn]) for fqn in modules}
    except (TypeError, ValueError, IndexError) as e:
        raise StatsFormatError(f"malformed plan: {e}") from None
    unapply(model)
    for fqn, mod in modules.items():
        mod.forward = types.MethodType(_checkpointed_forward, mod)
        setattr(mod, POLICY, policies[fqn])
    enter_model, exit_model, no_cache = _model_hooks()
    model.register_forward_pre_hook(enter_model, with_kwargs=True)
    model.register_forward_hook(exit_model, always_call=True)
    for _, inner in transformers_models(model):  # wherever they sit: the root or inside a wrapper
        inner.register_forward_pre_hook(no_cache, with_kwargs=True, prepend=True)
    setattr(model, APPLIED, {"plan": plan, "warned_shapes": set()})
    model.__dict__[_CAST_CTX] = []  # made here, not at the first forward: a trace sees no new state
    return model


def unapply(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` (a no-op on a model without a plan); return the model.

    Args:
        model: a model :func:`apply` changed, or any other model.

    Returns:
        The same ``model``, with its modules' own forwards and no autosac hooks.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Example::

        >>> autosac.unapply(model)   # plain forward again
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"unapply needs an nn.Module, got {type(model).__name__}")
    state = model.__dict__.pop(APPLIED, None)
    if state is None:
        return model
    model.__dict__.pop(_CAST_CTX, None)
    # found by identity rather than through handles, which a deepcopy would share
    for mod in model.modules():
        for table in (mod._forward_pre_hooks, mod._forward_hooks):
            for key in [k for k, fn in table.items() if fn in _model_hooks()]:
                del table[key]
                mod._forward_hooks_always_called.pop(key, None)
                mod._forward_pre_hooks_with_kwargs.pop(key, None)
                mod._forward_hooks_with_kwargs.pop(key, None)
        mod.__dict__.pop(CACHE_WARNED, None)
    for mod in model.modules():
        if POLICY in mod.__dict__:
            mod.__dict__.pop("forward", None)
            mod.__dict__.pop(POLICY, None)
    return model


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan :func:`apply` put on ``model``, if any.

    Example::

        >>> autosac.applier.applied_plan(model) is None
        True
    """
    state = model.__dict__.get(APPLIED)
    return None if state is None else state["plan"]


def _checkpointed_forward(self, *args, **kwargs):
    # Looked up on ``self`` at call time, so a deepcopy of the model checkpoints
    # its own weights with its own policy.  Under torch.compile the module is
    # one traced region whose ops carry the decision (autosac.applier.compiled).
    original = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():
        return original(*args, **kwargs)
    if torch.compiler.is_compiling():  # one traced region; its decision as recompute tags
        policy = getattr(self, POLICY)
        return checkpoint(functools.partial(original, **kwargs), *args, use_reentrant=False,
                          context_fn=compiled_context_fn(save_keys(policy.calls, policy.save)))
    call = getattr(self, POLICY).start(self, args, kwargs)
    # keyword arguments are bound by the wrapper, never passed to checkpoint,
    # so a forward's own ``context_fn=`` or ``debug=`` cannot clash with checkpoint's
    out = checkpoint(call.wrap(original, args, kwargs), *args, use_reentrant=False, preserve_rng_state=True,
                     context_fn=call.contexts)
    call.finish()
    return out


@functools.cache
def _model_hooks() -> tuple:
    """The hooks :func:`apply` puts on a model, run outside ``torch.compile``'s
    tracing (``torch.compiler.disable``).  Wrapped at the first ``apply``, not
    at import: the wrapping imports Dynamo, which takes seconds."""
    return tuple(torch.compiler.disable(fn) for fn in (_enter_model, _exit_model, _no_cache))


def _enter_model(module, args, kwargs):
    state = module.__dict__.get(APPLIED)
    if state is not None and state["plan"].input_shapes:
        _check_shapes(state, input_signature(args, kwargs))
    if state is not None and torch.is_grad_enabled():
        _check_device(state, module)
    # the cast hook sees every tensor the model saves: only where the traced step saved casts
    casts = state is None or state["plan"].param_casts
    ctx = torch.autograd.graph.saved_tensors_hooks(pack_cast, unpack_cast) if casts else None
    if ctx is not None:
        ctx.__enter__()
    module.__dict__.setdefault(_CAST_CTX, []).append(ctx)
    return None


def _no_cache(module, args, kwargs):
    """On each transformers model of a planned model: no cache in training
    (:func:`autosac.integrations.no_cache_hook`), said once per model."""
    changed = no_cache_hook(module, args, kwargs)
    if changed is not None and cache_requested(module, kwargs) and not module.__dict__.get(CACHE_WARNED):
        module.__dict__[CACHE_WARNED] = True
        warn_user(
            f"autosac: use_cache=True in a training forward of {type(module).__name__} keeps every layer's keys and "
            "values in a cache nothing reads; with a plan applied the model runs with use_cache=False, as "
            "transformers' own gradient checkpointing does (pass use_cache=False to silence this)"
        )
    return changed


def _exit_model(module, args, output):
    stack = module.__dict__.get(_CAST_CTX)
    if stack:
        ctx = stack.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)


def _check_device(state: dict, module) -> None:
    """One warning when the model runs on another device class than the plan
    was made for: the ops there differ (dropout, attention), so checkpointed
    calls fall back to recomputing everything."""
    plan = state["plan"]
    if not plan.device or state.get("warned_device"):
        return
    where = next((t.device.type for t in module.parameters()), None)
    if where is None or where == plan.device:
        return
    state["warned_device"] = True
    warn_user(
        f"autosac: this plan was made for {plan.device} ({plan.target}) but the model runs on {where}: "
        f"the ops differ there and checkpointed modules fall back to recomputing everything -- plan with "
        f"target='{'cpu' if where == 'cpu' else 'h100'}' (or a DeviceSpec with device_type='{where}') to run here"
    )


def _check_shapes(state: dict, found: list) -> None:
    plan = state["plan"]
    key = repr(found)
    if found == plan.input_shapes or key in state["warned_shapes"]:
        return
    state["warned_shapes"].add(key)
    warn_user(
        f"autosac: the plan for {plan.model} was made for inputs {format_signature(plan.input_shapes)}, "
        f"but the model now runs {format_signature(found)}: its predicted peak and budget hold only for "
        "the traced shapes -- re-plan with these inputs (autosac.solve(model, budget, example_inputs=...))"
    )
