"""What the CPU time model measures, checked by structure, never by timings
(issue 32: predicted overheads on this CPU against measured ones,
``benchmarks/predict_suite.py``)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autosac.applier import applied_plan
from autosac.tools.calibration_models import _calibration_models, _Layer, _tiny
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


def test_an_op_on_an_expanded_input_is_timed_on_inputs_laid_out_as_given():
    """A sum's gradient reaches the backward expanded (stride 0): its inputs are
    made as laid out, every element filled, so the op is timed, not priced by
    the roofline (1.9 ms of the large calibration model's 32 ms backward was),
    and under its own timing key (older caches kept the roofline's price as timed)."""
    from autosac.trace.costs import real_inputs, timing_key

    with FakeTensorMode():
        grad = torch.empty(4, 1, 64).expand(4, 16, 64)
        weight = torch.empty(32, 64)
    (g, w), _ = real_inputs((grad, weight), {})
    assert g.shape == (4, 16, 64) and g.stride() == (64, 0, 1) and w.stride() == (64, 1)
    assert ((g >= 0.25) & (g <= 0.75)).all() and (g[:, 0] == g[:, 15]).all()
    assert g.untyped_storage().nbytes() == 4 * 64 * 4  # the expanded tensor's own storage, not a copy
    op = torch.ops.aten.matmul.default
    assert torch.isfinite(op(g, w.t())).all()
    with FakeTensorMode():
        plain = torch.empty(4, 16, 64)
    assert "expanded" in timing_key(op, (grad, weight), {}) and "expanded" not in timing_key(op, (plain, weight), {})
    with FakeTensorMode():  # a size-1 dimension of stride 0 is no expansion; nor are expanded indices
        single = torch.empty(4, 1, 64).expand(4, 3, 64)[:, :1]
        ids = torch.empty(4, 1, dtype=torch.long).expand(4, 16)
    assert single.stride() == (64, 0, 1) and "expanded" not in timing_key(op, (single, weight), {})
    assert "expanded" not in timing_key(torch.ops.aten.add.Tensor, (ids, ids), {})


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


def _saves_and_casts(model, idx):
    """Tensors a real autocast forward saves, and how many are parameter casts (the cast hook's view)."""
    from autosac.applier.casts import _param_behind

    seen = [0, 0]

    def pack(t):
        seen[0] += 1
        seen[1] += _param_behind(t) is not None
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx)
    return seen


def test_the_cast_hook_is_priced_per_tensor_saved_and_per_cast_made_again():
    # a plan with parameter casts packs every tensor the forward saves through
    # the model-wide cast hook, and makes each cast again in the backward:
    # every plan pays it, none with a plan's regions (on a CPU target)
    from dataclasses import replace

    from suite import A100_CPU_KERNELS, gpt

    import autosac
    from autosac.core.host import HostCosts
    from autosac.solver.problem import build_problem

    torch.manual_seed(0)
    model, idx = gpt(dict(n_layer=2, dim=64, n_head=4, seq=32, vocab=128), batch=2)
    saves, casts = _saves_and_casts(model, idx)
    assert casts > 0 and saves > casts

    def always(spec, autocast=torch.bfloat16):
        stats = autosac.profile(model, idx, target=spec, autocast=autocast)
        return build_problem(stats).always_ms

    plain = replace(A100_CPU_KERNELS, host=HostCosts())
    priced = replace(A100_CPU_KERNELS, host=HostCosts(cast_hook_us=10.0, cast_remake_us=100.0))
    assert always(priced) - always(plain) == pytest.approx((saves * 10.0 + casts * 100.0) / 1e3, rel=1e-9)
    assert always(priced, autocast=None) == always(plain, autocast=None)  # no casts: no hook
    on_gpu = replace(priced, device_type="cuda")  # host work hidden under the kernels it queues
    assert always(on_gpu) == always(replace(on_gpu, host=HostCosts()))


def test_calibration_times_the_cast_hook_plain_and_under_autocast():
    x = torch.randn(2, 32, 64)
    setup = _calibration_models(lambda: _tiny(64), 2, x, selective=True, casts=True)
    assert {"casts", "ac_none", "ac_casts"} <= set(setup["variants"])
    saves, casts = setup["autocast_saves"]
    assert 0 < casts < saves
    assert setup["cast_op_us"] > 0
