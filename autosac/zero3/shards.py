"""The parameter types FSDP2 sees for a downcast gather
(:func:`autosac.zero3.install_downcast_gather`): :class:`DowncastShard`, a
float32 parameter (or its local shard) that FSDP2 gathers in a low-precision
dtype through its ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
extension, and :class:`DowncastGathered`, the whole parameter so gathered:
float32 outside, holding only the low-precision data, whose cast to that dtype
is the data itself."""

from __future__ import annotations

import copy
import weakref

import torch
from torch.utils._pytree import tree_leaves, tree_map

from autosac.core.opkinds import op_kind
from autosac.zero3 import ops

aten = torch.ops.aten


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
