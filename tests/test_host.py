"""Host costs: the dispatch floor per op, what checkpointing costs per call,
per saved tensor and per selectively dispatched op, and how the solver weighs
them (plain regions where per-op modes are dear).  Timing accuracy is measured
in benchmarks/bench_dispatch_overhead.py, not here."""

from dataclasses import replace

import pytest
import torch
from suite import A100_CPU_KERNELS, gpt
from torch import nn

import autosac
from autosac.core.devices import DeviceSpec
from autosac.core.host import HostCosts
from autosac.models import build_model
from autosac.tools.calibrate import calibrate

ZERO = HostCosts()


GPT = dict(n_layer=4, dim=128, n_head=4, seq=128, vocab=256)


def test_host_costs_are_checked_and_travel_with_the_target():
    with pytest.raises(ValueError, match="op_us must be a number of microseconds >= 0"):
        HostCosts(op_us=-1.0)
    with pytest.raises(ValueError, match="selective_op_us"):
        HostCosts(selective_op_us="fast")
    with pytest.raises(ValueError, match="backward_op_us must be a number of microseconds >= 0"):
        HostCosts(backward_op_us=-1.0)
    with pytest.raises(ValueError, match="backward_untimed_us must be a number of microseconds"):
        HostCosts(backward_untimed_us=float("nan"))
    assert HostCosts(backward_untimed_us=-3.0).backward_untimed_us == -3.0  # timing may count more than the engine pays
    spec = replace(A100_CPU_KERNELS, host=HostCosts(1.0, 2.0, 3.0, 4.0))
    assert DeviceSpec.from_dict(spec.to_dict()) == spec
    model, idx = gpt(GPT, device="meta", batch=4)
    stats = autosac.profile(model, idx, target=spec)
    assert stats.target["host"] == {"op_us": 1.0, "checkpoint_call_us": 2.0, "saved_tensor_us": 3.0,
                                    "selective_op_us": 4.0, "untimed_op_us": 0.0, "backward_op_us": None,
                                    "backward_untimed_us": None, "small_op_bytes": 0.0, "large_op_bytes": 0.0,
                                    "untimed_us_per_mib": 0.0, "backward_untimed_us_per_mib": 0.0,
                                    "selective_us_per_mib": 0.0, "cold_read_us_per_mib": 0.0, "cast_hook_us": 0.0,
                                    "cast_remake_us": 0.0, "first_call_us": 0.0}
    assert autosac.ModelStats.from_json(stats.to_json()).target == stats.target
    # a figure a newer autosac added is left out, not a TypeError at solve time
    newer = {**spec.to_dict(), "host": {**HostCosts(1.0, 2.0, 3.0, 4.0).to_dict(), "figure_of_the_future_us": 9.0}}
    assert DeviceSpec.from_dict(newer) == spec
    stats.target["host"]["figure_of_the_future_us"] = 9.0
    assert autosac.solve(stats, "least").decisions


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_every_op_costs_at_least_the_host_dispatch(device_type):
    """On the CPU host time adds to each kernel; on a GPU they overlap (the longer counts)."""
    model, idx = gpt(GPT, device="meta", batch=4)
    base = replace(A100_CPU_KERNELS, device_type=device_type)
    floor_ms = 0.05
    zero = autosac.profile(model, idx, target=replace(base, host=ZERO), optimizer="none").timeline
    costs = HostCosts(op_us=floor_ms * 1e3, backward_op_us=floor_ms * 1e3 / 2)  # the engine runs no Python
    host = autosac.profile(model, idx, target=replace(base, host=costs), optimizer="none").timeline
    assert zero.ops == host.ops and "backward" in zero.phases
    for k, h, phase in zip(zero.ms, host.ms, zero.phases):
        floor = floor_ms / 2 if phase == "backward" else floor_ms
        expected = k + floor if device_type == "cpu" else max(k, floor)
        assert h == pytest.approx(expected, abs=1e-12)


def test_ops_timed_on_this_cpu_add_only_the_host_time_their_timing_does_not_see():
    """Timing an op by calling it already counts its dispatcher: a measured
    CPU target adds ``untimed_op_us`` per op, not the whole ``op_us``."""
    torch.manual_seed(0)
    model, idx = build_model("gpt2", device="cpu", n_layer=1, dim=32, n_head=2, seq=16, vocab=64, batch=2)
    cpu = autosac.core.devices.DEVICES["cpu"]
    zero = autosac.profile(model, idx, target=replace(cpu, host=ZERO), optimizer="none").timeline
    costs = HostCosts(op_us=500.0, untimed_op_us=20.0, backward_op_us=300.0, backward_untimed_us=-2.0)
    host = autosac.profile(model, idx, target=replace(cpu, host=costs), optimizer="none").timeline
    assert zero.ops == host.ops
    for k, h, phase in zip(zero.ms, host.ms, zero.phases):  # the same timings (cached), plus the untimed part
        expected = max(0.0, k - 0.002) if phase == "backward" else k + 0.02
        assert h == pytest.approx(expected, abs=1e-12)


def _plan(host: HostCosts, budget="least"):
    model, idx = gpt(GPT, device="meta", batch=4)
    stats = autosac.profile(model, idx, target=replace(A100_CPU_KERNELS, host=host), optimizer="sgd")
    return stats, autosac.solve(stats, budget)


def test_the_solver_prices_the_mechanism_and_prefers_plain_regions_where_modes_are_dear():
    """With free machinery the least-recompute plan is partly selective; where
    the dispatch modes cost more than recomputing, the same budget is met by
    plain regions only; the plan's mechanism time is the formula's."""
    budget = "60%"
    _, free = _plan(ZERO, budget)
    assert any(d.save for d in free.details.values())  # some module caches part of its forward
    assert free.mechanism_ms == 0
    dear = HostCosts(op_us=0.0, checkpoint_call_us=10.0, saved_tensor_us=1.0, selective_op_us=500.0)
    stats, plan = _plan(dear, budget)
    assert plan.decisions and not any(d.save for d in plan.details.values())
    expected = 0.0
    for fqn in plan.decisions:
        lo, hi = stats.modules[fqn].fw_windows[0]
        expected += dear.checkpoint_ms(stats.modules[fqn].saved_tensors[0], hi - lo, selective=False)
    assert plan.mechanism_ms == pytest.approx(expected)
    assert plan.details[next(iter(plan.decisions))].mechanism_ms > 0
    assert "checkpointing machinery" in str(plan)


def test_saved_tensors_counts_what_autograd_keeps_per_module_call():
    """Counted against autograd's own saved-tensor hooks on the real model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 8)))
    x = torch.randn(4, 8)
    stats = autosac.profile(model, x, target=replace(A100_CPU_KERNELS, host=ZERO), optimizer="none")
    counted = {}

    def counter(name):
        def pre(module, args):
            counted[name] = 0
            ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: counted.__setitem__(name, counted[name] + 1)
                                                           or t, lambda t: t)
            ctx.__enter__()
            module._ctx = ctx

        def post(module, args, out):
            module._ctx.__exit__(None, None, None)
        return pre, post

    for name, mod in model.named_children():
        pre, post = counter(name)
        mod.register_forward_pre_hook(pre)
        mod.register_forward_hook(post)
    model(x).sum().backward()
    assert {name: stats.modules[name].saved_tensors for name in counted} == {k: [v] for k, v in counted.items()}
    assert stats.modules[""].saved_tensors == [sum(counted.values())]


def test_calibration_is_measured_once_and_cached():
    first = calibrate()
    assert calibrate() is first
    assert first.checkpoint_call_us > 0 and first.selective_op_us > 0
    assert all(v >= 0 for k, v in first.to_dict().items() if k != "backward_untimed_us")
    assert first.op_us > first.untimed_op_us  # the whole host time of an op call, and the part timing misses
    # the engine calls backward ops without Python between them; timing one from Python may count more
    assert first.backward_op_us < first.op_us and first.backward_untimed_us >= -0.5 * first.backward_op_us


def test_profiling_on_this_cpu_leaves_the_seeded_generator_as_it_was(tmp_path, monkeypatch):
    # timing ops for real (and calibrating, with an empty cache) must not move
    # the user's RNG: a seeded run after planning would otherwise draw other dropout masks
    monkeypatch.setenv("AUTOSAC_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, idx = build_model("gpt2", device="cpu", n_layer=1, dim=32, n_head=2, seq=16, vocab=64, batch=2)
    state = torch.get_rng_state()
    autosac.profile(model, idx, target="cpu")
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_first_checkpointed_call_of_a_step_is_priced_once(device_type):
    """A step with checkpointed calls pays ``first_call_us`` once (one call
    alone costs more than each of several), at any number of regions; a plan
    that checkpoints nothing does not; on a GPU that host work hides under
    kernels."""
    model, idx = gpt(GPT, device="meta", batch=4)
    base = replace(A100_CPU_KERNELS, device_type=device_type)
    costs = HostCosts(op_us=5.0, checkpoint_call_us=100.0, saved_tensor_us=3.0)
    plans = {}
    for first in (0.0, 700.0):
        stats = autosac.profile(model, idx, target=replace(base, host=replace(costs, first_call_us=first)))
        least = autosac.solve(stats, "least")
        mid = (least.predicted_peak_bytes + stats.peak_bytes) // 2
        plans[first] = [autosac.solve(stats, b) for b in (stats.peak_bytes, mid, "least")]
    extra = 0.7 if device_type == "cpu" else 0.0
    for without, with_first in zip(plans[0.0], plans[700.0]):
        assert with_first.decisions == without.decisions  # the same for every plan that checkpoints: orders none
        expected = extra if without.decisions else 0.0
        assert with_first.recompute_ms == pytest.approx(without.recompute_ms + expected, abs=1e-9)
        assert with_first.mechanism_ms == pytest.approx(without.mechanism_ms + expected, abs=1e-9)
        calls = sum(d.mechanism_ms for d in with_first.details.values())
        assert with_first.mechanism_ms == pytest.approx(calls + expected, abs=1e-9)
    assert not plans[0.0][0].decisions and len(plans[0.0][2].decisions) > 1  # none, and several regions
