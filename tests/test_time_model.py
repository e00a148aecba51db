"""What the CPU time model measures, checked by structure, never by timings
(issue 32: predicted overheads on this CPU against measured ones,
``benchmarks/predict_suite.py``)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autosac.applier import applied_plan
from autosac.tools.calibrate import _calibration_models, _Layer, _tiny
from autosac.trace.costs import _real_like


def test_ops_are_timed_on_values_they_are_defined_for():
    # sqrt and log of negative values make NaNs, 20-45x slower on a CPU: AdamW's
    # _foreach_sqrt was timed at 2.04 ms for a step whose real one took 0.03 ms
    with FakeTensorMode():
        fake = torch.empty(8, 64)
    real = _real_like(fake)
    assert not real.is_meta and real.shape == (8, 64)
    for op in (torch.sqrt, torch.rsqrt, torch.log, lambda x: x.pow(0.5), lambda x: torch._foreach_sqrt([x])[0]):
        assert torch.isfinite(op(real)).all()
    with FakeTensorMode():
        ids = torch.empty(4, dtype=torch.long)
    assert (_real_like(ids) == 0).all()  # indices stay valid for any embedding or gather


def test_calibration_runs_other_work_between_checkpointed_calls():
    # back to back, a checkpointed call finds its machinery's code and data in the
    # caches and costs less than half what it does in a model (180 against 410 us)
    x = torch.randn(2, 32, 64)  # the calibration's size
    setup = _calibration_models(lambda: _tiny(64), 3, x)
    whole = setup["variants"]["whole"]
    assert [n for n, _ in whole.named_children()] == [str(i) for i in range(6)]
    assert sorted(applied_plan(whole).decisions) == ["0", "2", "4"]
    for i in ("1", "3", "5"):
        assert isinstance(whole.get_submodule(i), _Layer)
    # the run-twice variant re-runs the regions only, as the checkpoint does
    twice = setup["variants"]["twice"]
    assert [type(m).__name__ for m in twice] == ["_Twice", "_Layer"] * 3
    # the first region's figures are read from module "0"
    assert setup["stats"].modules["0"].fw_windows
