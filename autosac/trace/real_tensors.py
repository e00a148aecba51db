"""The real tensors a fake-mode trace of the step meets, and what it runs in their place.

A step traced under FakeTensorMode still reads some real tensors: labels a
``loss_fn`` closes over on the GPU, a mask kept as a plain attribute, small
integer tensors the trace makes for real (their values decide shapes).  Two
things are kept for them:

* a real tensor of another device than the trace's is run as its cpu *twin*
  (small integer ones copied, so their values read as the real step reads
  them; the others fake), the same twin each time;
* a real tensor a fake op wrote in place (a mask ``zeros_like`` made small and
  real, filled under a fake condition) is *stale*: its values are unknown from
  then on, and every later read of it reads the fake tensor the write went to.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_map

from autosac.core.dataflow import DataflowTracker, tensors_in
from autosac.core.opkinds import written_tensors
from autosac.trace.execution import SMALL_NUMEL

__all__ = ["TRACE_DEVICES", "RealTensors", "same_layout"]

TRACE_DEVICES = ("cpu", "meta")  # the trace's fakes are on the cpu; a real meta tensor is a fake's equal


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view their storages alike (shape, strides, offset, dtype)."""
    return (a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.dtype == b.dtype)


class RealTensors:
    """The twins and stale storages of one trace (see the module docstring);
    ``flow``: the trace's dataflow, told that a stale storage's reads are its twin's."""

    def __init__(self, flow: DataflowTracker) -> None:
        self._flow = flow
        self._twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # real tensors of another device -> cpu twin
        self._stale: dict[int, torch.UntypedStorage] = {}  # real storages a fake op wrote (their values unknown)
        self._written_twins: dict[int, torch.Tensor] = {}  # ... the fake tensor the write went to, with their layout

    def as_traced(self, args, kwargs, fake_mode):
        """The op's arguments as the trace runs them: real tensors of another
        device as their cpu twins, stale real tensors as their fakes."""
        if any(not isinstance(t, FakeTensor) and t.device.type not in TRACE_DEVICES for t in tensors_in(args, kwargs)):
            args, kwargs = self._on_trace_device(args, kwargs)
        if self._stale and any(id(t.untyped_storage()) in self._stale for t in tensors_in(args, kwargs)
                               if not isinstance(t, FakeTensor)):
            args, kwargs = self._stale_as_fake(args, kwargs, fake_mode)
        return args, kwargs

    def note_written(self, func, args, kwargs, ran) -> None:
        """An in-place op that ran fake wrote a real tensor's fake twin: the
        real tensor's values are stale from now on, and nothing may read them
        (:meth:`as_traced` hands out the fake instead)."""
        outs = tensors_in(ran)
        if not outs or not isinstance(outs[0], FakeTensor):
            return  # it ran for real: the values are right
        written = [t for t in written_tensors(func, args, kwargs) if isinstance(t, torch.Tensor)]
        for t in written:
            if not isinstance(t, FakeTensor):
                st = t.untyped_storage()
                self._stale[id(st)] = st  # kept: its id is not reused while known
                if len(written) == 1 and same_layout(t, outs[0]):
                    # later reads of it are reads of the twin the write went to: one storage to the
                    # dataflow, made where the real one was (as the applier sees the real call)
                    self._written_twins[id(st)] = outs[0]
                    self._flow.alias(st, outs[0].untyped_storage())

    def _on_trace_device(self, args, kwargs):
        def twin(t):
            if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or t.device.type in TRACE_DEVICES:
                return t
            key = id(t)
            if key not in self._twins:
                if not t.is_floating_point() and not t.is_complex() and t.numel() <= SMALL_NUMEL:
                    with unset_fake_temporarily():
                        made = t.detach().to("cpu")
                else:
                    made = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                    if t.requires_grad:  # a leaf the step trains: its gradient is made as for the real one
                        made.requires_grad_()
                self._twins[key] = (t, made)  # t kept: its id is not reused while the twin is known
            return self._twins[key][1]

        return tree_map(twin, (args, kwargs))

    def _stale_as_fake(self, args, kwargs, fake_mode):
        def fake(t):
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and id(t.untyped_storage()) in self._stale:
                twin = self._written_twins.get(id(t.untyped_storage()))
                return twin if twin is not None and same_layout(t, twin) else fake_mode.from_tensor(t)
            return t

        return tree_map(fake, (args, kwargs))
