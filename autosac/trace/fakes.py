"""Fake twins of the model's parameters and buffers and of the example inputs,
on the cpu, for the trace under ``FakeTensorMode`` (:mod:`autosac.trace.step`)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autosac.trace.execution import SMALL_NUMEL


def _fake_like(t: torch.Tensor, requires_grad: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    # Always on cpu: fake tensors hold no data, and one device keeps meta models,
    # real-weight models and any kind of input compatible.
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    fake = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="cpu")
    return fake.requires_grad_(requires_grad) if requires_grad else fake


@contextmanager
def fake_parameters(model: nn.Module, mode: FakeTensorMode, param_dtype: torch.dtype | None = None):
    """Swap every parameter and buffer for a fake twin (floating parameters in
    ``param_dtype`` when given); tied ones stay tied; restored on exit."""
    memo: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        with mode:
            for mod in model.modules():
                for table in (mod._parameters, mod._buffers):
                    for name, t in list(table.items()):
                        if t is None:
                            continue
                        if id(t) not in memo:
                            if isinstance(t, nn.Parameter):
                                memo[id(t)] = nn.Parameter(_fake_like(t, False, param_dtype),
                                                           requires_grad=t.requires_grad)
                            else:
                                memo[id(t)] = _fake_like(t, False)
                        swapped.append((table, name, t))
                        table[name] = memo[id(t)]
        yield
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


def trace_input(x, dtype: torch.dtype | None = None):
    """A fake twin of an example input -- except small integer and boolean
    tensors on the cpu (token ids, masks, positions), which stay real so that
    code reading their values branches as in the real step."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.device.type == "cpu" and not x.is_floating_point() and not x.is_complex() and x.numel() <= SMALL_NUMEL:
        return x
    return _fake_like(x, x.requires_grad, dtype)
