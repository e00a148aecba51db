"""Stage 3 of the pipeline: make a Plan real on the model.

Each decided module's forward runs under ``torch.utils.checkpoint`` (non-reentrant)
with a selective-checkpoint policy that recomputes exactly the planned op calls;
RNG state is preserved, so recomputed dropout draws the same mask, and
recomputation never updates buffers or Python state twice
(:mod:`autosac.applier.region`).  The checkpoint runs what the module ran
before: a ``forward`` set on the instance (accelerate's ``add_hook_to_module``)
is wrapped, not bypassed, and :func:`unapply` puts that same object back.
Around the whole model, a saved-tensor hook keeps parameter casts from being
saved, and a run with other input shapes than the plan's is warned about.

Everything apply puts on a model pickles (``torch.save(model)``) and deep-copies:
the checkpointed forward is a ``functools.partial`` of a module-level function,
and the model's hooks are :class:`_Hook` objects that pickle by name.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref

import torch
import torch.utils.checkpoint as _checkpoint_module
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from autosac.applier.casts import pack_cast, unpack_cast
from autosac.applier.inner_hooks import warn_inner_hooks
from autosac.applier.param_watch import ParamWatch
from autosac.applier.partitioner import require as require_partitioner
from autosac.applier.partitioner import unwrap_root, wrap_root
from autosac.applier.region import RegionPolicy
from autosac.core.errors import PlanMismatchError, StatsFormatError
from autosac.core.fingerprint import model_fingerprint
from autosac.core.inputs import format_signature, input_signature, quick_shapes
from autosac.core.integrations import cache_requested, no_cache_hook, own_checkpointing, transformers_models
from autosac.core.marks import APPLIED, CACHE_WARNED, POLICY
from autosac.core.plan import Plan
from autosac.core.userwarn import warn_user

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
        ValueError: the model checkpoints by itself (transformers' gradient checkpointing),
            or the plan is torch.compile's partitioner budget and this torch is older than 2.13
            (:mod:`autosac.applier.partitioner`).

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
    fraction = plan.compiled.get("partitioner_budget")  # under torch.compile: the partitioner's, for this model
    if fraction is not None:
        require_partitioner(fraction)
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
            f"({found}): module tree, parameter shapes or dtypes differ -- re-plan for this model"
        )
    try:
        policies = {fqn: RegionPolicy.from_decision(plan.details[fqn]) for fqn in modules}
    except (TypeError, ValueError, IndexError) as e:
        raise StatsFormatError(f"malformed plan: {e}") from None
    if not plan.compiled and any(plan.details[fqn].host_rng is None for fqn in modules):
        warn_user(
            f"autosac: this plan does not say which of its {len(modules)} checkpointed modules draw from Python's "
            "or NumPy's generators (a plan of format 6 or older, or from a compiled trace): every checkpointed "
            "call captures their states for its replay, unpriced -- re-plan with this autosac version to pay "
            "that only where a module draws"
        )
    unapply(model)
    for fqn, mod in modules.items():
        _wrap_forward(mod, policies[fqn])
    if fraction is not None:
        wrap_root(model, fraction)
    model.register_forward_pre_hook(_HOOKS["enter"], with_kwargs=True)
    model.register_forward_hook(_HOOKS["exit"], always_call=True)
    for _, inner in transformers_models(model):  # wherever they sit: the root or inside a wrapper
        inner.register_forward_pre_hook(_HOOKS["no_cache"], with_kwargs=True, prepend=True)
    setattr(model, APPLIED, {"plan": plan, "warned_shapes": set(), "checked_shapes": set(),
                             "release": _Release(list(modules.values())), "params": ParamWatch(plan)})
    model.__dict__[_CAST_CTX] = []  # made here, not at the first forward: a trace sees no new state
    return model


def unapply(model: nn.Module) -> nn.Module:
    """Undo :func:`apply` (a no-op on a model without a plan); return the model.

    Args:
        model: a model :func:`apply` changed, or any other model.

    Returns:
        The same ``model``, with its modules' own forwards and no autosac hooks:
        a ``forward`` the instance had before :func:`apply` is put back (the same
        object), one set after it is left in place.

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
            for key in [k for k, fn in table.items() if isinstance(fn, _Hook)]:
                del table[key]
                mod._forward_hooks_always_called.pop(key, None)
                mod._forward_pre_hooks_with_kwargs.pop(key, None)
                mod._forward_hooks_with_kwargs.pop(key, None)
        mod.__dict__.pop(CACHE_WARNED, None)
    for mod in model.modules():
        policy = mod.__dict__.pop(POLICY, None)
        if policy is not None:
            _unwrap_forward(mod)
    unwrap_root(model)
    return model


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan :func:`apply` put on ``model``, if any.

    Example::

        >>> autosac.applier.applied_plan(model) is None
        True
    """
    state = model.__dict__.get(APPLIED)
    return None if state is None else state["plan"]


class CheckpointedForward(functools.partial):
    """The forward :func:`apply` sets on a module: a partial of a module-level
    function (it pickles and deep-copies), of a type of autosac's own, so that
    :func:`autosac.core.pystate.capture` does not walk it at every call."""


class _WeakForward(functools.partial):
    """A checkpointed module's forward once its model is gone (:class:`_Release`):
    it holds the module weakly, so the module dies with its last outside
    reference, not at the garbage collector's next pass."""

    def __call__(self, *args, **kwargs):
        ref, own, policy = self.args
        return self.func(ref(), own, policy, *args, **kwargs)

    def __reduce__(self):
        ref, own, policy = self.args
        return CheckpointedForward, (self.func, ref(), own, policy)


class _Release:
    """Kept in the applied model's state: when the model is freed, each of
    its checkpointed modules still alive gets a :class:`_WeakForward`.

    A checkpointed module holds its forward and the forward holds the module:
    a cycle, which plain reference counting never frees.  Without this a
    deleted model's checkpointed modules -- their parameters, gradients, on a
    GPU too -- stayed allocated until the garbage collector ran (a benchmark
    building one model after another on an H200 read 324 MiB more per model).
    The model itself is in no cycle: it is freed at once, and this with it."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.refs = [weakref.ref(m) for m in modules]

    def __del__(self) -> None:
        for ref in self.refs:
            mod = ref()
            fwd = mod.__dict__.get("forward") if mod is not None else None
            if type(fwd) is CheckpointedForward and fwd.args[0] is mod:
                mod.__dict__["forward"] = _WeakForward(fwd.func, ref, *fwd.args[1:])

    def __deepcopy__(self, memo):  # the copy's modules, copied with the model that holds this
        return _Release([memo.get(id(r()), r()) for r in self.refs if r() is not None])

    def __reduce__(self):
        return _Release, ([r() for r in self.refs if r() is not None],)


def _wrap_forward(mod: nn.Module, policy: RegionPolicy) -> None:
    """Checkpoint ``mod`` with ``policy``, around what it ran: the ``forward``
    set on the instance, if any (accelerate's hooks), else its class's."""
    mod.forward = CheckpointedForward(_checkpointed_forward, mod, _own_forward(mod), policy)
    setattr(mod, POLICY, policy)


def _own_forward(mod: nn.Module):
    """The instance's forward apart from ours (None: its class's)."""
    fwd = mod.__dict__.get("forward")
    return fwd.args[1] if _is_ours(fwd, mod) else fwd


def _is_ours(fwd, mod: nn.Module) -> bool:
    if not isinstance(fwd, functools.partial) or fwd.func is not _checkpointed_forward:
        return False
    return (fwd.args[0]() if isinstance(fwd, _WeakForward) else fwd.args[0]) is mod


def _unwrap_forward(mod: nn.Module) -> None:
    """Put back the forward ``mod`` had before :func:`apply`.  A forward set
    after it stays: it calls ours, which runs the one from before from now on."""
    fwd = mod.__dict__.get("forward")
    if not _is_ours(fwd, mod):
        return
    if fwd.args[1] is None:
        del mod.__dict__["forward"]
    else:
        mod.__dict__["forward"] = fwd.args[1]


def _checkpointed_forward(self, own, policy, *args, **kwargs):
    # A partial on the module (it pickles and deep-copies with it: a copy
    # checkpoints its own weights with its own policy).  ``own`` is the forward
    # the instance had before apply, or None for its class's.  Under
    # torch.compile the module is one traced region whose ops carry the
    # decision (autosac.applier.compiled).
    # a partial, not ``forward.__get__``: Dynamo before torch 2.13 breaks the graph at ``__get__``
    original = own if own is not None else functools.partial(type(self).forward, self)
    if not torch.is_grad_enabled() or self.__dict__.get(POLICY) is not policy:
        return original(*args, **kwargs)  # no grad, or unapplied (then applied again) since
    if torch.compiler.is_compiling():  # one traced region; its decision as recompute tags
        return checkpoint(functools.partial(original, **kwargs), *args, use_reentrant=False,
                          context_fn=policy.compiled_context_fn)
    if not _is_ours(self.__dict__.get("forward"), self) and "replaced" not in policy.warned:
        policy.warned.add("replaced")
        warn_user(
            f"autosac: a checkpointed {type(self).__name__}'s forward was replaced after autosac.apply by one that "
            "calls it: what the new one adds runs outside the checkpoint, once, and its backward's recomputation "
            "does not rerun it -- set it before planning and applying to have it run inside the checkpoint"
        )
    call = policy.start(self, args, kwargs)
    # keyword arguments are bound by the wrapper, never passed to checkpoint,
    # so a forward's own ``context_fn=`` or ``debug=`` cannot clash with checkpoint's
    # early stop on (checkpoint's default), as the plan's memory counts the replay; only where the user turned
    # it off process-wide is that setting overridden, for this call (it changes no result)
    early = set_checkpoint_early_stop(True) if _checkpoint_module._enable_checkpoint_early_stop is False \
        else contextlib.nullcontext()
    try:  # (a try, not a context manager: this runs at every checkpointed call)
        with early:
            out = checkpoint(call.wrap(original, args, kwargs), *args, use_reentrant=False, preserve_rng_state=True,
                             context_fn=call.contexts)
    except RuntimeError as e:
        _name_func_transforms(e)
        raise
    call.finish()
    return out


def _name_func_transforms(e: RuntimeError) -> None:
    """torch.func's ``grad``, ``vjp``, ``jacrev`` refuse saved-tensor hooks,
    which checkpointing runs on, in a message that names neither: where ``e``
    is that refusal, raise it again in one line with the way out."""
    if "torch.func" in str(e) and "saved tensor hooks" in str(e):
        raise RuntimeError(
            "autosac: torch.func transforms (grad, vjp, jacrev, hessian) cannot differentiate a model with a plan "
            "applied -- checkpointing runs on saved-tensor hooks, which torch.func does not support: call "
            "autosac.unapply(model) for those calls, or use torch.autograd.grad"
        ) from e


class _Hook:
    """One of the hooks :func:`apply` puts on a model, named: it pickles and
    deep-copies as its name (the one instance per name in ``_HOOKS``).  Eager,
    it calls its function; while Dynamo traces, it calls it outside the trace
    (``torch.compiler.disable``), wrapped at the first such call, not at
    import: the wrapping imports Dynamo, which takes seconds."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args):
        if not torch.compiler.is_compiling():  # eager: Dynamo's disable costs microseconds a call
            return _HOOK_FNS[self.name](*args)
        fn = _DISABLED.get(self.name)
        if fn is None:
            fn = _DISABLED[self.name] = torch.compiler.disable(_HOOK_FNS[self.name])
        return fn(*args)

    def __reduce__(self):
        return _hook, (self.name,)

    def __repr__(self) -> str:
        return f"<autosac model hook {self.name!r}>"


def _hook(name: str) -> _Hook:
    """The hook named ``name`` (how a pickled one loads)."""
    return _HOOKS[name]


def _enter_model(module, args, kwargs):
    state = module.__dict__.get(APPLIED)
    if state is not None and torch.is_grad_enabled():  # a training forward (no_grad validation checkpoints nothing)
        if state["plan"].input_shapes:
            _check_shapes(state, args, kwargs)
        if "params" in state:  # (a model applied and pickled by autosac before it)
            state["params"].check(module)
        _check_device(state, module)
        _check_units(state, module)
        warn_inner_hooks(state, module)
    # the cast hook sees every tensor the model saves: only where the traced step saved casts
    casts = state is None or state["plan"].param_casts
    # (each forward its own token: a cast first saved in an earlier one came from autocast's cache)
    ctx = torch.autograd.graph.saved_tensors_hooks(functools.partial(pack_cast, forward=object()),
                                                   unpack_cast) if casts else None
    if ctx is not None:
        try:
            ctx.__enter__()
        except RuntimeError as e:
            _name_func_transforms(e)
            raise
    module.__dict__.setdefault(_CAST_CTX, []).append(ctx)
    return None


def _no_cache(module, args, kwargs):
    """On each transformers model of a planned model: no cache in training
    (:func:`autosac.core.integrations.no_cache_hook`), said once per model."""
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


_HOOK_FNS = {"enter": _enter_model, "exit": _exit_model, "no_cache": _no_cache}
_HOOKS = {name: _Hook(name) for name in _HOOK_FNS}
_DISABLED: dict = {}


def _check_device(state: dict, module) -> None:
    """One warning when the model runs on another device class than the plan
    was made for: the ops there differ (dropout, attention), so checkpointed
    calls fall back to recomputing everything."""
    plan = state["plan"]
    if not plan.device or state.get("warned_device"):
        return
    first = next(module.parameters(), None)
    if first is None or first.device.type == plan.device or is_fake(first):
        return  # (fake parameters: a trace of the step -- compile fitting's -- not a run)
    where = first.device.type
    state["warned_device"] = True
    warn_user(
        f"autosac: this plan was made for {plan.device} ({plan.target}) but the model runs on {where}: "
        f"the ops differ there and checkpointed modules fall back to recomputing everything -- plan with "
        f"target='{'cpu' if where == 'cpu' else 'h100'}' (or a DeviceSpec with device_type='{where}') to run here"
    )


def _check_units(state: dict, module: nn.Module) -> None:
    """At the first training forward (and the first after the root is
    sharded, which changes its class): no checkpointed module may hold an
    FSDP2 unit (a module ``fully_shard`` was applied to) inside it.  Its
    re-run in the backward would run the unit's hooks again -- a parameter
    gather the forward did not make there, on the ranks that re-run it only
    -- so the replay cannot match the forward; a sharded plan never makes
    such a region (:func:`autosac.solver.sharding.unit_holders`), one made
    for other units or for one process does.

    Raises:
        ValueError: naming the region, the unit inside it and the fix."""
    if state.get("units_checked") is type(module):  # checked, and not sharded since (fully_shard changes the class)
        return
    state["units_checked"] = type(module)
    if "torch.distributed.fsdp" not in sys.modules:  # never imported: no module is sharded (and no import to pay)
        return
    from torch.distributed.fsdp import FSDPModule

    for fqn, region in module.named_modules():
        if POLICY not in region.__dict__:
            continue
        inner = next((name for name, m in region.named_modules() if name and isinstance(m, FSDPModule)), None)
        if inner is not None:
            state["units_checked"] = None  # the error again at the next forward, not a run past it
            raise ValueError(
                f"autosac: checkpointed module {fqn!r} holds the FSDP2 unit {fqn + '.' + inner!r}, whose parameters "
                "its re-run would gather again: plan with autosac.profile(..., world_size=<ranks>, shard_units=<the "
                "modules you fully_shard>) and apply that plan, or fully_shard only modules no checkpointed module "
                "holds"
            )


def _check_shapes(state: dict, args: tuple, kwargs: dict) -> None:
    """One warning per input signature the plan was not made for.  Inputs
    checked before are known by :func:`quick_shapes` (the few shapes a loop
    runs; the full signature each call past 64)."""
    quick = quick_shapes(args, kwargs)
    if quick is not None and quick in state["checked_shapes"]:
        return
    found = input_signature(args, kwargs)
    if quick is not None and len(state["checked_shapes"]) < 64:
        state["checked_shapes"].add(quick)
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
