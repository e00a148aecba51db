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

import copy
import dataclasses
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from autosac.core.errors import PlanMismatchError
from autosac.core.fingerprint import model_fingerprint
from autosac.core.opkinds import op_kind
from autosac.core.plan import Plan
from autosac.core.stats import ModelStats
from autosac.zero3 import ops

__all__ = ["downcast_params", "with_downcast_gather", "install_downcast_gather", "DowncastShard", "DowncastGathered"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
aten = torch.ops.aten


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


# --- the parameter types FSDP2 sees ------------------------------------------


def _unwrap(x):
    return x._data if isinstance(x, (DowncastShard, DowncastGathered)) else x


# ops that make a new tensor FSDP2 then keeps as the parameter's shard
# (padding, moving): their results stay marked
_SHARD_MAKERS = {aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default}


class DowncastShard(torch.Tensor):
    """A float32 parameter (or FSDP2's local shard of one) that FSDP2 gathers
    in ``gather_dtype``.  Every op sees the float32 data; views of it, and the
    padded copies FSDP2 makes while sharding, stay marked."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, gather_dtype: torch.dtype, name: str):
        t = torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, requires_grad=data.requires_grad,
        )
        t._data, t.gather_dtype, t.param_name = data, gather_dtype, name
        return t

    def __repr__(self) -> str:
        return f"DowncastShard({self._data!r}, gather_dtype={self.gather_dtype})"

    def _check_unchanged(self) -> None:
        """Raise if the parameter was changed around its wrapper (``.data = x``
        or a dtype conversion): the data it wraps would be stale."""
        if self._data.shape != self.shape or self._data.dtype != self.dtype or _holds_storage(self):
            raise RuntimeError(
                f"{self.param_name} was changed after install_downcast_gather (a .data assignment or a dtype "
                f"conversion): call install_downcast_gather after changing the model"
            )

    def __deepcopy__(self, memo):
        new = DowncastShard(copy.deepcopy(self._data, memo), self.gather_dtype, self.param_name)
        new.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            new._is_param = True
        memo[id(self)] = new
        return new

    def __tensor_flatten__(self):
        return ["_data"], (self.gather_dtype, self.param_name)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return DowncastShard(inner["_data"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        marked = [a for a in tree_leaves((args, kwargs)) if isinstance(a, DowncastShard)]
        first, wrappers = marked[0], {id(a._data): a for a in marked}
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        keep = op_kind(func).view or func in _SHARD_MAKERS or (
            func is aten._to_copy.default and kwargs.get("dtype", first.dtype) == first.dtype
        )
        if keep:  # what sharding runs: the data it carries on must be the parameter's
            first._check_unchanged()

        def back(x):
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) in wrappers:  # an in-place op returns its (marked) input
                return wrappers[id(x)]
            return DowncastShard(x, first.gather_dtype, first.param_name) if keep else x

        return tree_map(back, out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FSDP2's hook before the all-gather: this rank's shard cast to
        ``gather_dtype`` in one pass, padded as FSDP2 pads shards."""
        self._check_unchanged()
        if mp_policy.param_dtype is not None:
            raise ValueError(
                f"{self.param_name}: fully_shard was given MixedPrecisionPolicy(param_dtype="
                f"{mp_policy.param_dtype}) and install_downcast_gather; use one of them"
            )
        world = mesh.size()
        if self._data.numel() * world == outer_size.numel():
            padded = self._data.shape  # even shards (FSDP2 shards dims other than 0 only evenly)
        else:  # uneven on dim 0: FSDP2 pads every shard to the first one's rows
            padded = torch.Size([-(-outer_size[0] // world), *outer_size[1:]])
        flat = torch.empty(padded.numel(), dtype=self.gather_dtype, device=self.device)
        n = self._data.numel()
        if n:
            ops.pack_downcast([self._data], self.gather_dtype, out=flat[:n])
        flat[n:].zero_()
        return (flat.view(padded),), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2's hook after the all-gather: the whole parameter, float32 outside,
        holding the gathered ``gather_dtype`` data."""
        (data,) = all_gather_outputs
        if out is not None:  # FSDP2 re-gathered into the same storage: nothing to remake
            out._check_unwritten()
            return None
        return DowncastGathered(data, self.dtype, self.param_name), (data,)


def _holds_storage(t: torch.Tensor) -> bool:
    """Whether a wrapper has storage of its own: ``param.data = x`` gave it x's
    (the values it wraps are then stale)."""
    try:
        return t.untyped_storage().data_ptr() != 0  # 0 on meta
    except RuntimeError:  # a wrapper's own (invalid) storage
        return False


# ops whose result does not depend on their input's values
_VALUE_FREE = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default}


class DowncastGathered(torch.Tensor):
    """A whole parameter gathered in a low-precision dtype, typed as its float32
    self.  Casting it to that dtype gives the gathered data itself (no copy);
    views of it stay marked; any other use raises, since its float32 value
    does not exist on this rank."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, outer_dtype: torch.dtype, name: str):
        t = torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=outer_dtype, device=data.device, requires_grad=False,
        )
        t._data, t.param_name = data, name
        t.casts = []  # (weak reference, version when made) of each cast handed out
        return t

    def _check_unwritten(self) -> None:
        """Raise if a cast handed out (the gathered data itself) was written in
        place: FSDP2 would re-gather over the write, under tensors autograd saved."""
        alive = [(ref, v) for ref, v in self.casts if ref() is not None]
        self.casts = alive
        if any(ref()._version != v for ref, v in alive):
            raise RuntimeError(
                f"the {self._data.dtype} cast of {self.param_name} was written in place, but it is the gathered "
                f"parameter itself (install_downcast_gather): copy it first (.to({self._data.dtype}).clone())"
            )

    def __repr__(self) -> str:
        return f"DowncastGathered({self.param_name}, {tuple(self.shape)}, gathered in {self._data.dtype})"

    def __tensor_flatten__(self):
        return ["_data"], (self.dtype, self.param_name)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return DowncastGathered(inner["_data"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0] if args and isinstance(args[0], DowncastGathered) else None
        if me is not None and func is aten._to_copy.default and len(args) == 1 \
                and kwargs.get("dtype") == me._data.dtype and kwargs.get("device", me.device) == me.device:
            me._check_unwritten()
            cast = me._data.detach()  # the cast is the gathered data itself
            me.casts.append((weakref.ref(cast), cast._version))
            return cast
        if me is not None and func in _VALUE_FREE:  # e.g. FSDP2's zeros for a gradient that never came
            plain = torch.empty_strided(me.shape, me.stride(), dtype=me.dtype, device=me.device)
            return func(plain, *args[1:], **kwargs)
        if me is not None and op_kind(func).view and not any(
                isinstance(a, DowncastGathered) for a in tree_leaves((args[1:], kwargs))):
            out = func(me._data, *args[1:], **kwargs)
            return tree_map(lambda x: DowncastGathered(x, me.dtype, me.param_name)
                            if isinstance(x, torch.Tensor) else x, out)
        used = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, DowncastGathered))
        name, dtype = used.param_name, used._data.dtype
        raise RuntimeError(
            f"{name} is gathered in {dtype} (install_downcast_gather), but {func} used it outside a cast to "
            f"{dtype}, which the traced step never did: profile the step as it runs, or do not install the "
            f"downcast gather"
        )
