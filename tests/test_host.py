"""Host costs: the dispatch floor per op, what checkpointing costs per call,
per saved tensor and per selectively dispatched op, and how the solver weighs
them (plain regions where per-op modes are dear).  Timing accuracy is measured
in benchmarks/bench_dispatch_overhead.py, not here."""

import math
from dataclasses import replace

import pytest
import torch
from suite import A100_CPU_KERNELS, gpt
from torch import nn

import autosac
from autosac.core.devices import DeviceSpec
from autosac.core.host import HostCosts, gap_roots
from autosac.models import build_model
from autosac.solver import plan_from_decisions
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
                                    "selective_us_per_mib": 0.0, "largest_op_bytes": 0.0,
                                    "cold_read_us_per_mib": 0.0, "cast_hook_us": 0.0,
                                    "cast_remake_us": 0.0, "call_gap_us": 0.0,
                                    "state_item_us": 0.0, "checkpoint_us_per_mib": 0.0, "host_rng_us": 0.0}
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


def _machinery_points(stats, plan) -> list[int]:
    """Where the plan's calls run the machinery, read off the trace: each
    decided module's forward start and its replay (its first backward read
    of a tensor saved inside it, within its backward)."""
    points = []
    for fqn in plan.decisions:
        m = stats.modules[fqn]
        for (start, _), (bw_start, bw_end), replay in zip(m.fw_windows, m.bw_windows, m.recompute_starts):
            points += [start, min(max(replay, bw_start), bw_end)]
    return points


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_checkpointed_call_costs_more_the_more_runs_since_the_last(device_type):
    """``call_gap_us``: a plan's machinery is priced per square root of the
    op calls between its runs (each call's forward start and replay) --
    exactly, for the plan's own calls: one block alone costs more than each
    of all blocks; a plan that checkpoints nothing costs nothing; on a GPU
    that host work hides under kernels (the calls' own prices only)."""
    model, idx = gpt(GPT, device="meta", batch=4)
    base = replace(A100_CPU_KERNELS, device_type=device_type)
    costs = HostCosts(op_us=5.0, checkpoint_call_us=100.0, saved_tensor_us=3.0, call_gap_us=20.0)
    stats = autosac.profile(model, idx, target=replace(base, host=costs))
    blocks = [f for f in stats.modules if f.startswith("blocks.") and f.count(".") == 1]
    least = autosac.solve(stats, "least")
    mid = autosac.solve(stats, (least.predicted_peak_bytes + stats.peak_bytes) // 2)
    one = plan_from_decisions(stats, {blocks[len(blocks) // 2]: 1.0})
    every = plan_from_decisions(stats, dict.fromkeys(blocks, 1.0))
    assert not autosac.solve(stats, stats.peak_bytes).decisions and len(least.decisions) > 1
    for plan in (least, mid, one, every):
        calls = sum(d.mechanism_ms for d in plan.details.values())
        own = sum(math.sqrt(w[1] - w[0]) for f in plan.decisions for w in stats.modules[f].fw_windows)
        points = _machinery_points(stats, plan)
        own += sum(math.sqrt(bw[1] - min(max(r, bw[0]), bw[1])) for f in plan.decisions
                   for bw, r in zip(stats.modules[f].bw_windows, stats.modules[f].recompute_starts))
        expected = 0.02 * (gap_roots(points, len(stats.timeline.ops)) - own) if device_type == "cpu" else 0.0
        assert plan.mechanism_ms == pytest.approx(calls + expected, abs=1e-9)
        assert plan.recompute_ms == pytest.approx(sum(d.recompute_ms for d in plan.details.values()) + expected,
                                                  abs=1e-9)
    per_call = [p.mechanism_ms / len(p.decisions) for p in (one, every)]
    assert per_call[0] > per_call[1] if device_type == "cpu" else per_call[0] == pytest.approx(per_call[1])


class _Block(nn.Module):
    def __init__(self, settings: int = 0) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        if settings:
            self.settings = {f"option_{i}": i for i in range(settings)}  # a config the forward could read

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def test_a_checkpointed_call_is_priced_by_the_python_state_it_captures():
    """``state_item_us``: a checkpoint captures, swaps in and puts back the
    Python state its module's forward may change (autosac.core.pystate) --
    a transformers block's config is hundreds of entries.  The trace counts
    them per module (``ModuleStats.state_items``): a dict of 500 entries on
    a block is 502 items more (the block's attribute, the dict, its entries), and its call is
    priced ``state_item_us`` for each."""
    x = torch.randn(256, 32)
    stats = {}
    for settings in (0, 500):
        torch.manual_seed(0)
        model = nn.Sequential(_Block(), _Block(settings), _Block())
        target = replace(A100_CPU_KERNELS, device_type="cpu", host=HostCosts(checkpoint_call_us=50.0, state_item_us=1.0))
        stats[settings] = autosac.profile(model, x, target=target)
    items = {k: s.modules["1"].state_items for k, s in stats.items()}
    assert items[0] > 0 and items[500] - items[0] == 502
    assert stats[500].modules["0"].state_items == stats[0].modules["0"].state_items
    plans = {k: plan_from_decisions(s, {"1": 1.0}) for k, s in stats.items()}
    assert plans[500].details["1"].mechanism_ms - plans[0].details["1"].mechanism_ms == pytest.approx(0.502)
