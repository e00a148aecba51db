"""An optimizer's foreach ops on a CPU target pay per MiB they read that the
foreach op before them did not touch (autosac.core.coldread): exact
accounting, and the count on a real AdamW step.  How well it predicts is
measured in benchmarks/predict_suite.py, not here."""

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autosac
from autosac.core.coldread import ColdReads
from autosac.core.host import HostCosts
from autosac.core.hostsize import MIB, share
from autosac.core.optim import make_optimizer
from autosac.trace.costs import CostModel

SMALL, LARGE = 32 << 10, 1 << 20
COLD = HostCosts(untimed_op_us=2.0, small_op_bytes=SMALL, large_op_bytes=LARGE, cold_read_us_per_mib=40.0)


def _lists():
    return [torch.full((512, 512), 0.5) for _ in range(2)], [torch.full((512, 512), 0.5) for _ in range(2)]


def test_a_foreach_op_pays_for_the_lists_the_foreach_op_before_it_did_not_touch():
    a, b = _lists()  # two lists of 2 MiB, each tensor 1 MiB (share 1)
    ops = [(torch.ops.aten._foreach_mul_.Scalar, (a, 0.9)),  # a cold: 2 MiB
           (torch.ops.aten._foreach_add_.Scalar, (a, 1.0)),  # a just touched: 0
           (torch.ops.aten.mul.Tensor, (a[0], b[0])),  # not a foreach op: 0, and forgets nothing
           (torch.ops.aten._foreach_addcmul_.Scalar, (a, b, b, 0.1))]  # b cold (once): 2 MiB
    outs = [None, None, a[0] * b[0], None]
    expect = [2.0, 0.0, 0.0, 2.0]
    cpu = replace(autosac.core.devices.DEVICES["cpu"], host=replace(COLD, cold_read_us_per_mib=0.0))
    bare, cold = CostModel(cpu), CostModel(cpu)
    cold.host = COLD  # the same timings (cached), priced with the figure
    for (op, args), out, mib in zip(ops, outs, expect):
        got = cold.op_ms(op, args, {}, out)[0] - bare.op_ms(op, args, {}, out)[0]
        assert got == pytest.approx(mib * 40.0 / 1e3, abs=1e-9)
    gpu = CostModel(replace(autosac.core.devices.DEVICES["h100"], host=COLD))
    assert gpu._cold_ms(*ops[0], {}, None) == 0.0  # a GPU's kernels: no host cache to miss


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads, self.mib = ColdReads(), 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.mib += self.reads.mib(func, args, kwargs or {}, out, SMALL, LARGE)
        return out


def test_adamws_foreach_step_reads_each_list_cold_as_the_calibration_counts():
    """AdamW's foreach step: weight decay on the params, lerp_ of exp_avg to
    the grads, mul_ and addcmul_ of exp_avg_sq (the grads again), sqrt, div_,
    add_ on its result, addcdiv_ into the params from exp_avg: 7 lists read
    cold.  The count rests on the optimizer passing the same tensor objects
    from op to op."""
    params = [torch.nn.Parameter(torch.rand(256 << 10)) for _ in range(3)]  # 1 MiB each
    opt = make_optimizer("adamw", params)
    for p in params:
        p.grad = torch.rand_like(p)
    opt.step()  # its state
    mode = _Count()
    with mode:
        opt.step()
    per_list = 3 * share(MIB, SMALL, LARGE)
    assert mode.mib == pytest.approx(7 * per_list)
