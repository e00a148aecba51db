"""Strides of size-1 dims as ATen's kernels choose them, where FakeTensor
chooses others.

A size-1 dim may have any stride, and FakeTensor's view and pointwise ops
pick another than ATen's where the input is laid out otherwise than
contiguous: (1, 32, 2304) strided (73728, 1, 32) viewed as (1, 32, 48, 48)
has stride 32 for dim 0 on the cpu (``computeStride``), 73728 fake; and
``x / 2.0`` of that keeps 32 on the cpu (TensorIterator puts a size-1 dim
next to the dim of equal stride, and the wrapped number rules out its fast
path), 73728 fake.  The stride of a size-1 dim decides
``suggest_memory_format``: the real group norm of such a tensor copies it to
contiguous and returns a contiguous result where the fake one kept it
channels-last (diffusers' attention blocks at batch size 1), and the layouts,
and the copies they cost, differed from there on.

Views are restrided as ATen's meta kernel strides them; pointwise results as
TensorIterator lays out its output (a port of ``compute_fast_setup_type``,
``reorder_dimensions`` and ``allocate_or_resize_outputs``), and only where
that differs from the fake strides in size-1 dims alone.
"""

from __future__ import annotations

from functools import cache

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from autosac.core.opkinds import writes_input

_RESHAPES = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})


def restrides(func) -> bool:
    """Whether ``func``'s fake output strides are checked (views, out-of-place pointwise ops)."""
    return func in _RESHAPES or (torch.Tag.pointwise in func.tags and not writes_input(func))


def with_kernel_strides(func, args, kwargs, out):
    """``out`` (a fake result with a size-1 dim) strided as ATen strides it."""
    if not isinstance(out, FakeTensor) or 1 not in out.shape or out.numel() <= 1:
        return out
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if all(t.stride() == contiguous_strides(t.shape) for t in tensors):
        return out  # contiguous inputs: both lay the result out contiguous
    stride = _view_strides(func, args) if func in _RESHAPES else _pointwise_strides(func, args, kwargs, out)
    if stride is None or stride == tuple(out.stride()):
        return out
    if any(s != f and n != 1 for s, f, n in zip(stride, out.stride(), out.shape)):
        return out  # not a size-1 dim: the port is not sure of it, the fake kernel is
    return out.as_strided(out.shape, stride, out.storage_offset())


def _view_strides(func, args) -> tuple[int, ...] | None:
    x = args[0]
    try:
        with _disable_current_modes(), unset_fake_temporarily():
            twin = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            return tuple(func(twin, *args[1:]).stride())
    except Exception:  # noqa: BLE001 - keep the fake strides
        return None


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@cache
def _tensor_slots(func) -> tuple[tuple[int, str], ...]:
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                 if isinstance(a.type, torch.TensorType) or str(a.type) == "Optional[Tensor]")


def _operands(func, args, kwargs) -> list[tuple[tuple, tuple, int]]:
    """(shape, stride, item size) of each operand TensorIterator sees: the
    tensors, and numbers in Tensor slots as the 0-dim tensors they become."""
    ops = []
    for i, name in _tensor_slots(func):
        v = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(v, torch.Tensor):
            ops.append((tuple(v.shape), tuple(v.stride()), v.element_size()))
        elif isinstance(v, (bool, int, float, complex)):
            ops.append(((), (), 8))
    return ops


def _pointwise_strides(func, args, kwargs, out) -> tuple[int, ...] | None:
    ops = _operands(func, args, kwargs)
    shape = tuple(out.shape)
    if not ops:
        return None
    if all(s == shape for s, _, _ in ops):  # fast setup
        if all(_dense_like(s, st, contiguous_strides(s)) for s, st, _ in ops):
            return contiguous_strides(shape)
        if out.dim() == 4 and all(_channels_last(s, st) for s, st, _ in ops):
            return _channels_last_strides(shape)
        if len({st for _, st, _ in ops}) == 1 and _non_overlapping_dense(shape, ops[0][1]):
            return ops[0][1]
    return _permuted_strides(shape, ops)


def _dense_like(shape, stride, expected) -> bool:
    """``is_contiguous`` in the given order: strides of size-1 dims do not count."""
    return all(n == 1 or s == e for n, s, e in zip(shape, stride, expected))


def _channels_last(shape, stride) -> bool:
    return len(shape) == 4 and _dense_like(shape, stride, _channels_last_strides(shape))


def _channels_last_strides(shape) -> tuple[int, ...]:
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c) if c else contiguous_strides(shape)


def _non_overlapping_dense(shape, stride) -> bool:
    dims = sorted((s, n) for n, s in zip(shape, stride) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return False
        expected *= n
    return True


def _permuted_strides(shape, ops) -> tuple[int, ...]:
    """TensorIterator's ``reorder_dimensions`` and the output it allocates."""
    ndim = len(shape)
    strides = []  # per operand, bytes per dim of the broadcast shape (0 where broadcast)
    for s, st, size in ops:
        pad = ndim - len(s)
        strides.append([0] * pad + [0 if n == 1 and shape[pad + d] != 1 else st[d] * size
                                    for d, n in enumerate(s)])

    def should_swap(d0: int, d1: int) -> int:
        for st in strides:
            a, b = st[d0], st[d1]
            if a == 0 or b == 0:
                continue
            if a != b:
                return -1 if a < b else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(range(ndim))[::-1]  # perm[0] is the innermost dim
    for i in range(1, ndim):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    result, step = [0] * ndim, 1
    for d in perm:
        result[d] = step
        step *= shape[d]
    return tuple(result)
