"""Downcast-then-gather for sharded float32 parameters.

:func:`pack_downcast` casts many float32 tensors into one flat bfloat16 or
float16 buffer in one pass (the native op of :mod:`autosac.zero3.native`, or PyTorch
code with identical results where it is not built); :func:`allgather_downcast`
gathers such a buffer from every rank, so a ZeRO-3 / FSDP2 parameter gather
moves half the bytes of gathering float32 and casting after.

Example::

    >>> flat = autosac.ops.pack_downcast([w.grad, b.grad], torch.bfloat16)
    >>> full = autosac.ops.allgather_downcast(local_shards, torch.bfloat16)   # in a process group
"""

from __future__ import annotations

import torch

from autosac.zero3 import native

__all__ = ["pack_downcast", "allgather_downcast"]

_DTYPES = (torch.bfloat16, torch.float16)

# torch.distributed's one-tensor all-gather: ``all_gather_single`` from torch 2.13, before it
# ``all_gather_into_tensor`` (FSDP2 gathers with the same one)
GATHER = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"


def _check(tensors, dtype) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"expected a list of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    bad = next((t for t in tensors if not isinstance(t, torch.Tensor)), None)
    if bad is not None:
        raise TypeError(f"expected a list of tensors, found a {type(bad).__name__} in it")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    wrong = next((t for t in tensors if t.dtype != torch.float32), None)
    if wrong is not None:
        raise ValueError(f"every tensor must be float32 (the shards to downcast), found {wrong.dtype}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"tensors on more than one device: {sorted(str(d) for d in devices)}")
    return tensors


def _check_out(tensors: list[torch.Tensor], dtype: torch.dtype, out: torch.Tensor) -> None:
    total = sum(t.numel() for t in tensors)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor, got {type(out).__name__}")
    if out.dtype != dtype or out.dim() != 1 or not out.is_contiguous() or out.numel() != total:
        raise ValueError(
            f"out must be a contiguous 1-D {dtype} tensor of {total} elements, got a "
            f"{'contiguous' if out.is_contiguous() else 'non-contiguous'} {out.dtype} tensor of shape {tuple(out.shape)}"
        )
    if out.device != tensors[0].device:
        raise ValueError(f"out is on {out.device}, the tensors on {tensors[0].device}")


def _fallback(tensors: list[torch.Tensor], dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        out = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    offset = 0
    for t in tensors:
        out[offset : offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    return out


def pack_downcast(tensors, dtype: torch.dtype = torch.bfloat16, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Cast float32 tensors to ``dtype`` into one flat buffer, in one pass.

    Args:
        tensors: float32 tensors on one device (any shapes; non-contiguous ones are read in order).
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        out: a buffer to write into (contiguous, 1-D, ``dtype``, as many
            elements as the tensors hold together), e.g. this rank's slice of
            an all-gather buffer.  A new buffer is made without it.

    Returns:
        A 1-D tensor of ``dtype`` holding each tensor's elements in turn,
        bitwise equal to ``torch.cat([t.reshape(-1) for t in tensors]).to(dtype)``
        (round to nearest even, NaN and Inf kept).  Under FakeTensorMode or on
        ``meta`` it returns a tensor of the right size without computing.  An
        empty list gives an empty tensor (``out`` itself when given).

    Raises:
        TypeError: ``tensors`` is not a list of tensors.
        ValueError: a tensor that is not float32, tensors on
            several devices, another ``dtype``, or an ``out`` of the wrong
            dtype, size, layout or device (checked before anything is written).

    Example::

        >>> autosac.ops.pack_downcast([torch.ones(2, 3), torch.zeros(4)], torch.bfloat16).shape
        torch.Size([10])
    """
    if isinstance(tensors, (list, tuple)) and tensors and isinstance(tensors[0], torch.Tensor) \
            and _native_for(tensors[0].device.type) \
            and (out is None or isinstance(out, torch.Tensor) and out.device == tensors[0].device):
        # the op checks everything before it writes: the checks below only name what was wrong
        try:
            if out is None:
                return torch.ops.autosac.pack_downcast(tensors, dtype)
            return torch.ops.autosac.pack_downcast.out(tensors, dtype, out=out)
        except (RuntimeError, TypeError):
            checked = _check(tensors, dtype)
            if out is not None:
                _check_out(checked, dtype, out)
            raise
    tensors = _check(tensors, dtype)
    if not tensors:  # nothing to pack: an empty buffer (on out's device, else the CPU)
        if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != dtype or out.shape != (0,)):
            raise ValueError(f"out must be an empty 1-D {dtype} tensor for an empty list")
        return out if out is not None else torch.empty(0, dtype=dtype)
    if out is not None:
        _check_out(tensors, dtype, out)
    return _fallback(tensors, dtype, out)


def _native_for(device: str) -> bool:
    """Whether the native op runs on tensors of this device type."""
    return device in ("cpu", "meta", "cuda") and native.available() and (device != "cuda" or native.has_cuda_kernel())


def allgather_downcast(tensors, dtype: torch.dtype = torch.bfloat16, group=None) -> list[torch.Tensor]:
    """Downcast this rank's float32 tensors, then gather every rank's in one
    collective: half the bytes of gathering float32 and casting after, and the
    same values.

    Every rank passes tensors of the same shapes, in the same order.

    Args:
        tensors: this rank's float32 tensors (its shards), on the process group's device.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        group: the process group (default: the world).

    Returns:
        Per input tensor, a ``(world_size, *shape)`` tensor of ``dtype`` whose
        ``[r]`` is rank ``r``'s tensor: views into one gathered buffer.  For
        dim-0 shards, ``out.flatten(0, 1)`` is the whole tensor.  An empty list
        gives an empty list (no collective runs, so every rank must pass one).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        TypeError, ValueError: as :func:`pack_downcast`.

    Example::

        >>> full = autosac.ops.allgather_downcast([shard], torch.bfloat16)[0].flatten(0, 1)
    """
    import torch.distributed as dist

    tensors = _check(tensors, dtype)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("allgather_downcast needs torch.distributed initialised (dist.init_process_group)")
    if not tensors:
        return []
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = sum(t.numel() for t in tensors)
    gathered = torch.empty(world * n, dtype=dtype, device=tensors[0].device)
    mine = gathered[rank * n : (rank + 1) * n]
    pack_downcast(tensors, dtype, out=mine)  # straight into this rank's slice: the gather runs in place
    getattr(dist, GATHER)(gathered, mine, group=group)
    rows = gathered.view(world, n)
    out, offset = [], 0
    for t in tensors:
        out.append(rows[:, offset : offset + t.numel()].view(world, *t.shape))
        offset += t.numel()
    return out
