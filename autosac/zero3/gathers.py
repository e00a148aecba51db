"""Downcast gathers for FSDP2 (ZeRO-3): gather float32 parameters already cast
to bfloat16 (or float16) where the step only ever uses them cast.

Training with float32 parameters under ``torch.autocast(dtype=torch.bfloat16)``
and ``fully_shard`` without a ``param_dtype``, every FSDP2 all-gather moves
float32 -- and autocast casts the gathered weights to bfloat16 right after.
For a parameter whose *every* use in the traced step is that cast, gathering
the local shard already cast moves half the bytes and gives the same bfloat16
values: the step is bitwise the autocast baseline.

:func:`install_downcast_gather` marks exactly those parameters (read from the
trace's per-parameter consuming dtypes) with FSDP2's own extension points,
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``: each rank casts its shard
in one pass (the native :func:`autosac.ops.pack_downcast`), FSDP2 gathers the
bfloat16 shards, and the gathered parameter keeps its float32 type outside --
so autograd, the reduce-scatter of its gradient and the optimizer run in
float32 exactly as before -- while holding only the bfloat16 data.  Autocast's
cast of it is that data itself: no copy is made, none is kept for the
backward (FSDP2 frees and re-gathers it), and the planner counts it that way
(:func:`with_downcast_gather`).

Every other parameter (norm weights autocast runs in float32, an embedding
table, anything used once without a cast) stays float32.  If a downcast
parameter is used in float32 after all -- a call the trace did not see -- the
op raises one clear error instead of computing with rounded values.

This module chooses and installs; the parameter types FSDP2 sees
(:class:`DowncastShard`, :class:`DowncastGathered`) are in
:mod:`autosac.zero3.shards`.

Example::

    >>> stats = autosac.profile(model, batch, world_size=8, autocast=torch.bfloat16)
    >>> stats = autosac.zero3.with_downcast_gather(stats)      # the planner counts bf16 gathers
    >>> plan = autosac.solve(stats, "60GiB")
    >>> autosac.apply(model, plan)
    >>> autosac.zero3.install_downcast_gather(model, plan)      # before fully_shard, or after it before the first step
    >>> for block in model.blocks: fully_shard(block)
    >>> fully_shard(model)
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from autosac.core.errors import PlanMismatchError
from autosac.core.fingerprint import model_fingerprint
from autosac.core.plan import Plan
from autosac.core.stats import ModelStats
from autosac.zero3.shards import DowncastGathered, DowncastShard

__all__ = ["downcast_params", "with_downcast_gather", "install_downcast_gather", "DowncastShard", "DowncastGathered"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    return name


def downcast_params(stats: ModelStats, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """The parameters whose every use in the traced step is a cast to ``dtype``:
    those a downcast gather moves in ``dtype`` with bitwise the same step.

    Args:
        stats: a :func:`autosac.profile` of the step, traced under
            ``autocast=dtype`` (without autocast nothing is ever cast).
        dtype: ``torch.bfloat16`` or ``torch.float16``.

    Returns:
        Parameter fqns, in the model's order (float32 parameters only).

    Raises:
        ValueError: another ``dtype``, or stats traced under FSDP2's own mixed
            precision (``profile(param_dtype=...)``: it gathers in that dtype already).

    Example::

        >>> autosac.zero3.downcast_params(stats)
        ['blocks.0.attn.qkv.weight', 'blocks.0.attn.qkv.bias', ...]
    """
    name = _dtype_name(dtype)
    if stats.mixed_precision:
        raise ValueError(
            "these stats were profiled with FSDP2's mixed precision (param_dtype), which gathers in that dtype "
            "already: profile without param_dtype to use a downcast gather"
        )
    return [fqn for fqn, p in stats.params.items() if p.dtype == "float32" and p.consumed_dtypes == [name]]


def with_downcast_gather(stats: ModelStats, dtype: torch.dtype = torch.bfloat16) -> ModelStats:
    """A copy of ``stats`` whose FSDP2 memory model gathers :func:`downcast_params`
    in ``dtype``: the plan solved from it counts their gathered copies at
    ``dtype``'s size and their autocast casts as free, as
    :func:`install_downcast_gather` makes them.

    Args and raises: as :func:`downcast_params`.

    Returns:
        A new :class:`ModelStats` (``stats`` is not changed) with ``gathered_dtypes`` set.

    Example::

        >>> plan = autosac.solve(autosac.zero3.with_downcast_gather(stats), "70%")
    """
    name = _dtype_name(dtype)
    return dataclasses.replace(stats, gathered_dtypes={fqn: name for fqn in downcast_params(stats, dtype)})


def install_downcast_gather(model: nn.Module, stats_or_plan: ModelStats | Plan,
                            dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Make FSDP2 gather the parameters whose every use is a cast to ``dtype``
    already cast, so each gather moves half their bytes and the step stays
    bitwise the same.

    Call it after :func:`autosac.apply` if you use a plan, and either before
    ``fully_shard`` and before making the optimizer (it replaces the chosen
    parameter objects), or on the model ``fully_shard`` sharded, before its
    first step (the sharded parameters stay the same objects).  Do not give
    ``fully_shard`` a ``MixedPrecisionPolicy(param_dtype=...)`` as well.

    Args:
        model: the model the stats (or plan) were made for, sharded by
            ``fully_shard`` or not yet.
        stats_or_plan: a :class:`ModelStats` traced under ``autocast=dtype``, or
            a :class:`Plan` solved from :func:`with_downcast_gather` stats.
        dtype: ``torch.bfloat16`` or ``torch.float16``.

    Returns:
        The fqns of the parameters now gathered in ``dtype`` (possibly none).

    Raises:
        TypeError: ``model`` is not a module, or ``stats_or_plan`` neither stats nor a plan.
        ValueError: another ``dtype``; stats not traced under autocast in
            ``dtype``; a plan solved without :func:`with_downcast_gather`, or
            for another dtype; a sharded model that has run a step, or whose
            ``fully_shard`` has a ``param_dtype``.
        PlanMismatchError: the stats or plan were made for another model.
        Nothing is changed when it raises.

    Example::

        >>> autosac.zero3.install_downcast_gather(model, stats)
        ['blocks.0.attn.qkv.weight', ...]
        >>> for block in model.blocks: fully_shard(block)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"install_downcast_gather needs an nn.Module, got {type(model).__name__}")
    name = _dtype_name(dtype)
    fqns = _chosen(stats_or_plan, name, dtype)
    found = model_fingerprint(model)
    if found != stats_or_plan.fingerprint:
        raise PlanMismatchError(
            f"the {'plan' if isinstance(stats_or_plan, Plan) else 'stats'} were made for {stats_or_plan.model} "
            f"({stats_or_plan.fingerprint}) but this {type(model).__name__} is ({found}) -- profile this model"
        )
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [f for f in fqns if f not in params]
    if missing:
        raise PlanMismatchError(f"{type(model).__name__} has no parameter {missing[0]!r}")
    if _fsdp_params(model):
        _install_sharded(model, fqns, dtype)
    else:
        _install_unsharded(model, params, fqns, dtype)
    _recheck_at_first_step(model, list(fqns), dtype)
    _plain_state_dicts(model, list(fqns))
    return list(fqns)


def _plain_state_dicts(model: nn.Module, fqns: list[str]) -> None:
    """State dicts hold the marked parameters' data as plain tensors (sharded
    ones as DTensors of plain local shards, the same storage): checkpoints
    load anywhere (``torch.load(weights_only=True)``, DCP) and load back in place."""
    owners = {fqn.rpartition(".")[0] for fqn in fqns}
    for name in owners:
        module = model.get_submodule(name)
        if not getattr(module, "_autosac_plain_state_dict", False):
            module.register_state_dict_post_hook(_unmark_state_dict)
            module._autosac_plain_state_dict = True


def _unmark_state_dict(module, state_dict, prefix, local_metadata) -> None:
    for key, value in list(state_dict.items()):
        if isinstance(value, DowncastShard):
            state_dict[key] = value._data
        elif _is_dtensor(value) and isinstance(value._local_tensor, DowncastShard):
            from torch.distributed.tensor import DTensor

            state_dict[key] = DTensor.from_local(value._local_tensor._data, value.device_mesh, value.placements,
                                                 run_check=False, shape=value.shape, stride=value.stride())


def _is_dtensor(value) -> bool:
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _recheck_at_first_step(model: nn.Module, fqns: list[str], dtype) -> None:
    """Before the sharded model's first forward (ahead of FSDP2's own hook),
    mark again the shards that lost their mark since the install: ``to_empty``
    after building on ``meta`` and ``load_state_dict(assign=True)`` put plain
    tensors in their place, which would gather in float32 while the plan
    counts them in ``dtype``."""
    old = getattr(model, "_autosac_downcast_hook", None)
    if old is not None:
        old.remove()

    def hook(module, args):
        managed = _fsdp_params(module)
        if not managed:
            return  # not sharded (yet): the marks do nothing here
        lost = [f for f in fqns if f in managed and not isinstance(managed[f].sharded_param._local_tensor,
                                                                    DowncastShard)]
        if lost:
            _install_sharded(module, lost, dtype)
        module._autosac_downcast_hook.remove()

    model._autosac_downcast_hook = model.register_forward_pre_hook(hook, prepend=True)


def _check_marked(fqn: str, local, dtype) -> bool:
    """Whether ``local`` is marked already (for ``dtype``; another dtype raises)."""
    if isinstance(local, DowncastShard):
        if local.gather_dtype != dtype:
            raise ValueError(f"{fqn} is already gathered in {local.gather_dtype}, not {dtype}")
        return True
    return False


def _fsdp_params(model: nn.Module) -> dict:
    """fqn -> FSDP2's record of that parameter, for every parameter ``fully_shard``
    manages in ``model`` (empty for a model it has not sharded)."""
    import torch.distributed as dist

    if not dist.is_available():
        return {}
    from torch.distributed.fsdp import FSDPModule

    names = {id(mod): name for name, mod in model.named_modules(remove_duplicate=False)}
    out = {}
    for mod in model.modules():
        group = mod._get_fsdp_state()._fsdp_param_group if isinstance(mod, FSDPModule) else None
        for fp in group.fsdp_params if group is not None else ():
            info = fp._module_info  # the module holding it, and any others sharing it
            for owner, pname in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]:
                prefix = names.get(id(owner), "")
                out[f"{prefix}.{pname}" if prefix else pname] = fp
    return out


def _install_unsharded(model: nn.Module, params: dict, fqns: list[str], dtype) -> None:
    """Turn each chosen parameter into a marked one in place
    (``torch.utils.swap_tensors``: the same object, so an optimizer already
    made, tied uses and hooks keep it); ``fully_shard`` then shards the marked data."""
    marked = [_check_marked(f, params[f], dtype) for f in fqns]  # all checked before any change
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for fqn, done in zip(fqns, marked):
            p = params[fqn]
            if done or any(p is q for q, _ in swapped):
                continue
            new = nn.Parameter(DowncastShard(p.detach(), dtype, fqn), requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, new)
            swapped.append((p, new))
    except RuntimeError as e:
        for p, new in reversed(swapped):  # nothing half-done
            torch.utils.swap_tensors(p, new)
        first = str(e).strip().splitlines()[0]
        raise ValueError(f"cannot mark {fqn} in place ({first}): install before the first backward") from None


def _install_sharded(model: nn.Module, fqns: list[str], dtype) -> None:
    """On a model ``fully_shard`` already sharded, before its first step: mark
    each chosen parameter's local shard (the sharded parameter objects, which an
    optimizer may hold, stay the same) and let FSDP2 take up the extension,
    as it does for a marked parameter at ``fully_shard``."""
    managed = _fsdp_params(model)
    todo: dict[int, tuple[str, object]] = {}  # one entry per FSDP2 parameter (tied names share one)
    for fqn in fqns:
        fp = managed.get(fqn)
        if fp is None:
            raise ValueError(f"{fqn} is not sharded by fully_shard: call install_downcast_gather before fully_shard")
        if fp.all_gather_outputs:
            raise ValueError("the sharded model has run a step: call install_downcast_gather before its first step")
        if fp.mp_policy.param_dtype is not None:
            raise ValueError(
                f"fully_shard was given MixedPrecisionPolicy(param_dtype={fp.mp_policy.param_dtype}); a downcast "
                "gather replaces it: shard without param_dtype"
            )
        if not _check_marked(fqn, fp.sharded_param._local_tensor, dtype):
            todo.setdefault(id(fp), (fqn, fp))
    for fqn, fp in todo.values():
        fp.sharded_param._local_tensor = DowncastShard(fp.sharded_param._local_tensor, dtype, fqn)
        fp._sharded_param_data = DowncastShard(fp._sharded_param_data, dtype, fqn)
        fp._init_extensions()


def _chosen(stats_or_plan, name: str, dtype) -> list[str]:
    if isinstance(stats_or_plan, Plan):
        chosen = stats_or_plan.gathered_dtypes
        if not chosen:
            raise ValueError(
                "this plan was solved without a downcast gather: solve it from "
                "autosac.zero3.with_downcast_gather(stats), or pass the stats"
            )
        other = sorted({d for d in chosen.values() if d != name})
        if other:
            raise ValueError(f"this plan gathers in {other[0]}, not {name}")
        return list(chosen)
    if isinstance(stats_or_plan, ModelStats):
        if stats_or_plan.autocast != name:
            traced = f"under autocast {stats_or_plan.autocast}" if stats_or_plan.autocast else "without autocast"
            raise ValueError(
                f"the stats were traced {traced}: profile the step with autocast=torch.{name} to find the "
                f"parameters it only uses in {name}"
            )
        return downcast_params(stats_or_plan, dtype)
    raise TypeError(f"expected autosac.ModelStats or autosac.Plan, got {type(stats_or_plan).__name__}")
