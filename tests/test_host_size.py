"""Host time that grows with the ops' data on a CPU target (autosac.core.hostsize):
exact accounting of what large ops, an optimizer's in-place foreach ops and a
selective region's op calls are priced, and the calibration's fit.  How well
it predicts is measured in benchmarks/predict_suite.py, not here."""

import math
from dataclasses import replace

import pytest
import torch
from suite import A100_CPU_KERNELS

import autosac
from autosac.core.host import HostCosts
from autosac.core.hostsize import MIB, anchor_bytes, extra_us, fit_extras, largest_bytes, machinery_us
from autosac.models import build_model
from autosac.solver.problem import build_problem
from autosac.tools.calibration_models import _Block
from autosac.trace.costs import CostModel

SMALL, LARGE = 32 << 10, 1 << 20
SIZED = HostCosts(op_us=10.0, untimed_op_us=2.0, backward_untimed_us=1.0, selective_op_us=5.0,
                  small_op_bytes=SMALL, large_op_bytes=LARGE, untimed_us_per_mib=80.0,
                  backward_untimed_us_per_mib=40.0, selective_us_per_mib=20.0)


def test_a_large_op_pays_per_mib_it_makes_by_its_share_between_the_calibrated_sizes():
    """Where the large calibration's largest op is not known (figures of
    before host-costs-v29, a stated host): up to its typical op; beyond it,
    what that op pays."""
    assert SIZED.op_ms(1.0, "cpu", timed=True, nbytes=SMALL) == pytest.approx(1.0 + 2.0 / 1e3)  # no more
    assert SIZED.op_ms(1.0, "cpu", timed=True, nbytes=LARGE) == pytest.approx(1.0 + (2.0 + 80.0) / 1e3)
    assert SIZED.op_ms(1.0, "cpu", timed=True, nbytes=4 * LARGE) == pytest.approx(1.0 + (2.0 + 80.0) / 1e3)
    mid = 256 << 10  # share log(8) / log(32) = 0.6 of 80 us per MiB, on a quarter MiB
    assert SIZED.op_ms(1.0, "cpu", timed=True, nbytes=mid) == pytest.approx(1.0 + (2.0 + 0.6 * 80 / 4) / 1e3)
    assert SIZED.op_ms(1.0, "cpu", timed=True, backward=True, nbytes=LARGE) == pytest.approx(1.0 + 41.0 / 1e3)
    # a GPU's kernels evict no host cache; an untimed CPU op pays the whole op_us already
    assert SIZED.op_ms(1.0, "cuda", timed=False, nbytes=LARGE) == 1.0
    assert SIZED.op_ms(0.0, "cpu", timed=False, nbytes=LARGE) == pytest.approx(10.0 / 1e3)
    # figures without a large calibration (older caches, stated hosts): nothing more
    assert HostCosts(untimed_op_us=2.0).op_ms(1.0, "cpu", timed=True, nbytes=LARGE) == pytest.approx(1.002)


def test_an_op_pays_per_mib_up_to_the_large_calibrations_largest_op():
    """Where the large calibration's largest op is known, an op pays per MiB
    up to it: twice the typical op pays twice what it does, eight times no more than twice;
    the machinery's extra still stops at the typical op."""
    host = replace(SIZED, largest_op_bytes=2 * LARGE, checkpoint_us_per_mib=30.0)
    assert host.op_ms(1.0, "cpu", timed=True, nbytes=2 * LARGE) == pytest.approx(1.0 + (2.0 + 160.0) / 1e3)
    assert host.op_ms(1.0, "cpu", timed=True, nbytes=8 * LARGE) == pytest.approx(1.0 + (2.0 + 160.0) / 1e3)
    assert host.op_ms(1.0, "cpu", timed=True, nbytes=LARGE) == SIZED.op_ms(1.0, "cpu", timed=True, nbytes=LARGE)
    assert host.checkpoint_ms(0, 1, False, op_bytes=[2 * LARGE]) == pytest.approx(30.0 / 1e3)


def test_a_large_op_making_fresh_memory_pays_and_an_in_place_foreach_op_or_a_view_does_not():
    """AdamW's foreach ops write memory the step keeps: priced as timed.
    ``_unsafe_view`` (the end of every ``nn.Linear`` on a 3-D input) is no
    view op by its schema but returns its input's storage: it makes nothing
    (priced as making its output, transformers' forwards at width 256 came out 3-8 % higher)."""
    cm = CostModel(replace(autosac.core.devices.DEVICES["cpu"], host=HostCosts()))
    tensors = [torch.full((256, 256), 0.5) for _ in range(4)]  # 1 MiB in all
    ops = {"foreach": (torch.ops.aten._foreach_mul_.Scalar, (tensors, 0.9), None),
           "mul": (torch.ops.aten.mul.Tensor, (tensors[0], tensors[1]), tensors[0] * tensors[1]),
           "view": (torch.ops.aten.view.default, (tensors[0], [-1]), tensors[0].view(-1)),
           "unsafe_view": (torch.ops.aten._unsafe_view.default, (tensors[0], [-1]),
                           torch.ops.aten._unsafe_view.default(tensors[0], [-1]))}
    bare = {k: cm.op_ms(op, args, {}, out)[0] for k, (op, args, out) in ops.items()}
    cm.host = SIZED  # the same timings (cached), priced with the large-size figure
    sized = {k: cm.op_ms(op, args, {}, out)[0] for k, (op, args, out) in ops.items()}
    quarter = extra_us(256 * 256 * 4, SMALL, LARGE, 80.0)  # the mul's output: a quarter MiB
    assert quarter > 0
    assert sized["mul"] - bare["mul"] == pytest.approx((2.0 + quarter) / 1e3)
    assert sized["foreach"] - bare["foreach"] == pytest.approx(2.0 / 1e3)
    assert sized["view"] - bare["view"] == pytest.approx(2.0 / 1e3)
    assert sized["unsafe_view"] - bare["unsafe_view"] == pytest.approx(2.0 / 1e3)


def _selective_mechanisms(host: HostCosts, device_type: str):
    torch.manual_seed(0)
    model, idx = build_model("gpt2", device="meta", n_layer=2, dim=128, n_head=4, seq=128, vocab=256, batch=4)
    target = replace(A100_CPU_KERNELS, device_type=device_type, host=host)
    stats = autosac.profile(model, idx, target=target, optimizer="sgd")
    return stats, build_problem(stats)


def test_the_machinery_pays_for_an_op_no_more_than_for_the_large_calibrations_op():
    """An op's kernel evicts the caches the machinery's Python work runs in;
    more bytes do not evict more: a 4 MiB op adds to the checkpointing
    machinery what a 1 MiB one does, below the large size as the op's own
    figures do (which, where the largest op is known, run on up to it)."""
    host = replace(SIZED, checkpoint_us_per_mib=30.0)
    assert machinery_us(4 * LARGE, SMALL, LARGE, 30.0) == machinery_us(LARGE, SMALL, LARGE, 30.0) == 30.0
    assert machinery_us(256 << 10, SMALL, LARGE, 30.0) == extra_us(256 << 10, SMALL, LARGE, 30.0) > 0
    assert machinery_us(SMALL, SMALL, LARGE, 30.0) == 0.0 and machinery_us(LARGE, SMALL, 0.0, 30.0) == 0.0
    plain = host.checkpoint_ms(0, 0, selective=False)
    assert host.checkpoint_ms(0, 0, selective=False, op_bytes=[4 * LARGE] * 8) == pytest.approx(plain + 8 * 30e-3)
    selective = host.checkpoint_ms(0, 8, selective=True)
    assert host.checkpoint_ms(0, 8, selective=True, op_bytes=[4 * LARGE] * 8) == pytest.approx(
        selective + 8 * (30.0 + 2 * 20.0) / 1e3)
    assert host.op_ms(1.0, "cpu", timed=True, nbytes=4 * LARGE) == host.op_ms(1.0, "cpu", timed=True, nbytes=LARGE)


def _with_and_without(sized: HostCosts, without: HostCosts):
    """The trace's stats and both hosts' candidates on a CPU target, and both hosts' mechanisms on a CUDA one."""
    stats, a = _selective_mechanisms(sized, "cpu")
    _, b = _selective_mechanisms(without, "cpu")
    gpu = [[c.mechanism for c in _selective_mechanisms(h, "cuda")[1].candidates] for h in (sized, without)]
    return stats, a, b, gpu


def test_a_selective_regions_op_calls_cost_more_by_what_they_make_on_a_cpu_target_only():
    without = replace(SIZED, selective_us_per_mib=0.0)
    stats, sized, plain, (gpu, gpu_plain) = _with_and_without(SIZED, without)
    checked = 0
    for a, b in zip(sized.candidates, plain.candidates):
        made = stats.timeline.made_bytes[a.window[0] : a.window[1]]
        extra = 2 * sum(machinery_us(m, SMALL, LARGE, 20.0) for m in made) / 1e3  # the forward and the replay
        for ma, mb in zip(a.mechanism, b.mechanism):
            selective = not math.isclose(mb, without.checkpoint_ms(stats.modules[a.fqn].saved_tensors[0], 0, False))
            assert ma - mb == pytest.approx(extra if selective else 0.0, abs=1e-12)
            checked += selective and extra > 0
    assert checked  # some choice is selective, over ops larger than the small size
    assert gpu == gpu_plain


def test_a_checkpointed_calls_machinery_costs_more_by_what_its_ops_make_on_a_cpu_target_only():
    """``checkpoint_us_per_mib``: every choice of a call, plain or selective,
    pays it once per share-weighted MiB its forward's ops make; a GPU's
    kernels evict no host cache."""
    stats, with_it, without, (gpu, gpu_without) = _with_and_without(replace(SIZED, checkpoint_us_per_mib=30.0), SIZED)
    checked = 0
    for a, b in zip(with_it.candidates, without.candidates):
        made = stats.timeline.made_bytes[a.window[0] : a.window[1]]
        extra = sum(machinery_us(m, SMALL, LARGE, 30.0) for m in made) / 1e3
        assert [ma - mb for ma, mb in zip(a.mechanism, b.mechanism)] == pytest.approx([extra] * len(a.mechanism),
                                                                                       abs=1e-12)
        checked += extra > 0
    assert checked
    assert gpu == gpu_without


def test_the_size_calibration_times_each_region_in_place_checkpointed_and_run_twice():
    """autosac.tools.calibration_size: in each model copy half the regions are
    checkpointed by autosac's applier and half run twice, the other way round
    in the other copy; one step times every region's forward and, by its
    gradient hooks, its backward (a checkpointed one's replay inside it)."""
    from autosac.tools import calibration_size as size

    torch.manual_seed(0)
    copies, x, traced = size._copies(32, 2, 8)
    assert traced["fqn"] in traced["stats"].modules
    names = [n for n, m in copies[0][0].named_modules() if isinstance(m, size._Timed)]
    assert len(names) == 4
    for k in (0, 1):
        model, ckpt, twice, plan = copies[k]
        assert sorted(ckpt + twice) == sorted(names) and not set(ckpt) & set(twice)
        assert set(plan.decisions) == {f"{n}.region" for n in ckpt}
        # the region's own call: once where checkpointed (its replay calls its forward, not the module),
        # twice where run twice; its first layer's: twice in both (the replay runs it again)
        runs = {n: [0, 0] for n in names}
        hooks = [model.get_submodule(f"{n}.{sub}").register_forward_pre_hook(
            lambda mod, args, n=n, i=i, runs=runs: runs[n].__setitem__(i, runs[n][i] + 1))
            for n in names for i, sub in enumerate(("region", "region.layers.0"))]
        model(x).sum().backward()
        for h in hooks:
            h.remove()
        assert all(runs[n] == [2, 2] for n in twice) and all(runs[n] == [1, 2] for n in ckpt), runs
        for n in names:
            fw, start, end = model.get_submodule(n).times
            assert fw > 0 and end > start > 0  # the backward reached its output, then its input
    assert copies[0][2] == copies[1][1]  # the kinds swapped between the copies
    (one,) = size._mechanism_ms(copies, x, rounds=1)  # a warm-up round, then the one asked for
    assert math.isfinite(one)


def test_the_selective_size_figure_is_what_its_per_op_work_measured_beyond_the_small_figure(monkeypatch):
    """selective_us_per_mib's arithmetic: selective regions measured against
    whole ones, plus the cached op's price (which the whole replay runs and
    the selective one does not), at exactly selective_op_us per op call and
    pass plus K us per weighted MiB each pass reads K; under it, 0."""
    from autosac.core.hostsize import LARGE_BATCH, LARGE_SEQ, LARGE_WIDTH
    from autosac.tools import calibration_size as size

    figures = {"op_us": 10.0, "selective_op_us": 20.0, "untimed_op_us": 3.0, "untimed_us_per_mib": 50.0,
               "small_op_bytes": 25_000.0, "large_op_bytes": 800_000.0}
    torch.manual_seed(0)
    copies, _, traced = size._copies(LARGE_WIDTH, LARGE_BATCH, LARGE_SEQ, ("selective", "whole"))
    stats, fqn = traced["stats"], traced["fqn"]
    tl = stats.timeline
    w0, w1 = stats.modules[fqn].fw_windows[0]
    assert tl.ops[w0] == "native_layer_norm"  # the op the selective regions cache: small beside the rest
    cached_us = tl.ms[w0] * 1e3 + 3.0 + extra_us(tl.made_bytes[w0], 25_000.0, 800_000.0, 50.0)
    mib = sum(machinery_us(b, 25_000.0, 800_000.0, 1.0) for b in tl.made_bytes[w0:w1])
    assert mib > 1.0
    monkeypatch.setattr(size, "_copies", lambda *a: (copies, None, traced))
    for k, expected in ((40.0, 40.0), (-30.0, 0.0)):
        measured_ms = (2 * ((w1 - w0) * 20.0 + k * mib) - cached_us) / 1e3  # what the side-by-side rounds read
        rounds = [measured_ms - 0.01, measured_ms, measured_ms + 0.01, measured_ms]
        monkeypatch.setattr(size, "_mechanism_ms", lambda copies, x, n, r=rounds: r)
        got = size.selective_us_per_mib(figures)
        assert got.us_per_mib == pytest.approx(expected, abs=1e-3) and got.steady


def test_the_selective_size_figures_regions_skip_the_cached_op_in_their_replay():
    """The copies selective_us_per_mib times: in each, two regions replay
    without their cached first layer norm and two replay whole -- six layer
    norms in the backward where four whole regions would run eight."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autosac.tools import calibration_size as size

    counted = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counted.append(func)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    for kinds, norms in ((("selective", "whole"), 6), (("whole", "whole"), 8)):
        copies, x, _ = size._copies(64, 2, 16, kinds)
        for m, *_ in copies.values():
            loss = m(x).sum()
            counted.clear()
            with Count():
                loss.backward()
            assert counted.count(torch.ops.aten.native_layer_norm.default) == norms, kinds


def test_the_fitted_extras_price_the_large_calibration_model_as_measured():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(64, 1), _Block(64, 1))
    stats = autosac.profile(model, torch.randn(2, 64, 64), target=replace(A100_CPU_KERNELS, host=HostCosts()),
                            optimizer="none", output_held=False)
    small = {"untimed_op_us": 3.0, "backward_untimed_us": 1.5, "selective_op_us": 10.0}
    large = {"untimed_op_us": 30.0, "backward_untimed_us": 12.0}
    small_bytes = 1024.0
    large_bytes = anchor_bytes(stats)
    assert small_bytes < large_bytes
    largest = largest_bytes(stats)
    assert largest > large_bytes
    got = fit_extras(small, large, stats, small_bytes, large_bytes, largest)
    tl = stats.timeline
    fw = [m for m, ph in zip(tl.made_bytes, tl.phases) if ph != "backward"]
    bw = [m for m, ph in zip(tl.made_bytes, tl.phases) if ph == "backward"]
    host = HostCosts(small_op_bytes=small_bytes, large_op_bytes=large_bytes, largest_op_bytes=largest, **got)
    priced_fw = sum(3.0 + host.op_extra_us(m, got["untimed_us_per_mib"]) for m in fw)
    priced_bw = sum(1.5 + host.op_extra_us(m, got["backward_untimed_us_per_mib"]) for m in bw)
    assert max(host.op_extra_us(m, 1.0) for m in fw) > machinery_us(largest, small_bytes, large_bytes, 1.0)
    assert priced_fw == pytest.approx(30.0 * len(fw), rel=1e-3)
    assert priced_bw == pytest.approx(12.0 * len(bw), rel=1e-3)
    assert got["untimed_us_per_mib"] > 0 and MIB == 1 << 20
    assert "selective_us_per_mib" not in got  # measured in place: autosac.tools.calibration_size


def _plain_regions(host: HostCosts):
    torch.manual_seed(0)
    model, idx = build_model("gpt2", device="meta", n_layer=2, dim=128, n_head=4, seq=128, vocab=256, batch=4)
    stats = autosac.profile(model, idx, target=replace(autosac.core.devices.DEVICES["cpu"], host=host),
                            optimizer="sgd")
    return stats, build_problem(stats)


def test_a_plainly_checkpointed_call_re_runs_its_forward_at_the_price_the_unmodified_forward_paid():
    """Its re-run is priced as the unmodified forward's ops were, the per-MiB
    extra on large outputs included, and its machinery as checkpoint_ms says:
    crediting the saved outputs with memory just freed priced overheads low
    (zoo-gemma2, DeBERTa, Qwen3, ConvNeXt, GPT-2 at width 256: 10 of 20 rows
    within target with the credit, 16 without)."""
    host = replace(SIZED, checkpoint_call_us=500.0, saved_tensor_us=10.0)
    stats, problem = _plain_regions(host)
    tl = stats.timeline
    checked = 0
    for c in problem.candidates:
        stop = stats.modules[c.fqn].replay_stops[0]  # its replay stops at its last saved tensor
        assert c.window[0] < stop <= c.window[1]
        whole = float(sum(tl.ms[c.window[0] : stop]))
        extra = sum(extra_us(tl.made_bytes[e], SMALL, LARGE, 80.0) for e in range(*c.window)) / 1e3
        plain = host.checkpoint_ms(stats.modules[c.fqn].saved_tensors[0], 0, selective=False)
        for ms, mech, n in zip(c.ms, c.mechanism, c.n_items):
            if n == len(c.items) and math.isclose(mech, plain, abs_tol=1e-12):
                assert extra > 0  # some of its ops are larger than the small size, and pay for it
                assert ms == pytest.approx(whole + plain, abs=1e-9)
                checked += 1
    assert checked


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The op calls that reach the kernels (an op stopped while autograd saves its inputs does not)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_plain_re_run_is_priced_up_to_where_pytorchs_checkpoint_stops_it():
    """PyTorch's checkpoint stops re-running a call once its last saved tensor
    is made again: an MLP block's second matmul saves only its inputs, before
    it runs, so the replay never runs it (measured: a 6-block MLP at width 256
    re-ran each block for 4.6 ms where its whole forward, as priced, took 7.2).
    The replay's op calls, as a real backward dispatches them, end where the
    trace says, and the plan prices only those."""
    width = 64
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width),
                                                    torch.nn.GELU(), torch.nn.Linear(4 * width, width)),
                                torch.nn.Linear(width, 1))
    x = torch.randn(32, width)
    stats = autosac.profile(model, x, target=replace(autosac.core.devices.DEVICES["cpu"], host=SIZED),
                            optimizer="sgd", loss_fn=lambda out: out.sum())
    m, tl = stats.modules["0"], stats.timeline
    w0, w1 = m.fw_windows[0]
    stop = m.replay_stops[0]
    assert tl.ops[w0:w1] == ["native_layer_norm", "t", "addmm", "gelu", "t", "addmm"]
    assert stop == w1 - 1  # before the second addmm
    plan = autosac.solver.plan_from_decisions(stats, {"0": 1.0})
    applied = autosac.apply(model, plan)
    out = applied(x)
    with _Ops() as seen:
        out.sum().backward()
    # the backward's own matmuls are mm; the replay's are the forward's addmm
    assert seen.names.count("addmm") == tl.ops[w0:stop].count("addmm") == 1
    assert seen.names.count("gelu") == 1 and seen.names.count("native_layer_norm") == 1
    d = plan.details["0"]
    assert d.recompute_ms - d.mechanism_ms == pytest.approx(float(sum(tl.ms[w0:stop])), abs=1e-9)


def test_the_calibration_counts_what_its_checkpointed_regions_replay_skips_as_no_machinery():
    """Its machinery figure is a checkpointed region against the same region run
    twice: the replay stops before the last ops the twice-run region runs (the
    tiny region's GELU saves its input, so its kernel never re-runs), so their
    time goes back in -- else the per-call figure reads low by it."""
    from autosac.tools.calibration_figures import model_figures
    from autosac.tools.calibration_models import _calibration_models, _tiny

    setup = _calibration_models(lambda: _tiny(64), 2, torch.randn(2, 32, 64))
    m, tl = setup["stats"].modules["0"], setup["stats"].timeline
    w0, w1 = m.fw_windows[0]
    assert tl.ops[m.replay_end():w1] == ["gelu"]
    got = model_figures(setup, {"whole": 5.0, "twice": 5.0}, {})  # no machinery measured at all
    assert got["skipped_ops"] == 0  # the op it stops in is dispatched: only its kernel is skipped
    assert got["mechanism_us"] == pytest.approx(tl.ms[w1 - 1] * 1e3)
    assert got["mechanism_us"] > 0
