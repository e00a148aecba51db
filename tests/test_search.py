"""autosac.search: the batch size and plan with the most predicted samples per
second within a memory, and ``autosac plan --memory``."""

import dataclasses
import re

import pytest

import autosac
from autosac.cli import batch_sizes, main
from autosac.core.errors import UserError
from autosac.core.host import HostCosts
from autosac.core.plan import Plan
from autosac.models import build_model
from autosac.tools.search import rebatched

# An H100 roofline with CPU kernels behind a slow host: every op costs the host 0.5 ms, far more
# than a tiny model's kernels, so the step takes about the same time at any batch size and samples/s
# grow with the batch -- deterministic (no measured host figures), as a dispatch-bound small batch.
# On a CPU device the checkpointing machinery adds to the re-run (on a GPU it may hide behind it).
SLOW_HOST = dataclasses.replace(
    autosac.DEVICES["h100"], name="h100-slow-host", device_type="cpu",
    host=HostCosts(op_us=500.0, checkpoint_call_us=50.0, saved_tensor_us=5.0, selective_op_us=10.0))


@pytest.fixture(scope="module")
def tiny():
    model, idx = build_model("gpt-tiny")
    return model, (lambda b: rebatched(idx, b))


def test_a_larger_batch_with_a_plan_beats_the_largest_batch_without_one(tiny):
    model, make = tiny
    peaks = {b: autosac.profile(model, make(b), target=SLOW_HOST).peak_bytes for b in (4, 8)}
    memory = (peaks[4] + peaks[8]) // 2  # 4 fits as it is, 8 only with checkpointing
    result = autosac.search(model, make, memory, (2, 4, 8, 16), target=SLOW_HOST)
    rows = {r.batch_size: r for r in result.rows}
    assert [r.batch_size for r in result.rows] == [2, 4, 8, 16]
    largest_plain = max(b for b, r in rows.items() if r.feasible and r.plan is None)
    assert largest_plain == 4
    best = result.best
    assert best is rows[8] and best.plan is not None and best.plan.decisions
    assert best.predicted_samples_per_s > rows[4].predicted_samples_per_s
    assert best.predicted_peak_bytes == best.plan.predicted_peak_bytes <= memory < best.baseline_peak_bytes
    # the whole step: the unmodified step, the re-runs and the checkpointing machinery
    assert best.plan.mechanism_ms > 0
    assert best.predicted_step_ms == pytest.approx(best.stats.step_ms + best.plan.recompute_ms)
    assert best.predicted_samples_per_s == pytest.approx(8 / (best.predicted_step_ms / 1e3))
    assert rows[4].predicted_step_ms == rows[4].stats.step_ms  # no plan: the unmodified step
    assert not rows[16].feasible and rows[16].over_bytes > 0
    assert "<- best" in str(result).splitlines()[3] and "8" in result.message


def test_a_memory_nothing_fits_is_one_clear_line(tiny, capsys):
    model, make = tiny
    memory = 1 << 20
    result = autosac.search(model, make, memory, (2, 4, 8), target=SLOW_HOST)
    assert result.best is None
    first = result.rows[0]
    assert not first.feasible and not first.skipped
    # the least peak is bracketed from below, within 0.1 %
    least = autosac.solve(first.stats, "least").predicted_peak_bytes
    assert least * (1 - 1e-3) <= first.min_feasible_bytes <= least
    assert first.over_bytes == first.min_feasible_bytes - memory
    # larger batches are not profiled (they need more); profile_all says by exactly how much
    assert all(r.skipped and r.over_bytes == first.over_bytes for r in result.rows[1:])
    every = autosac.search(model, make, memory, (2, 4, 8), target=SLOW_HOST, profile_all=True)
    assert not any(r.skipped for r in every.rows)
    assert every.rows[2].over_bytes > every.rows[1].over_bytes > first.over_bytes
    message = result.message
    assert "\n" not in message and message.startswith("nothing fits in 1.00 MiB")
    assert "batch, 2, needs at least" in message
    # the command line: the table, then one line on stderr and exit status 2
    assert main(["plan", "--model", "gpt-tiny", "--memory", "1MiB", "--batch", "2,4", "--optimizer", "sgd",
                 "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert "does not fit" in out
    assert len(err.strip().splitlines()) == 1 and err.startswith("autosac: error: nothing fits in 1.00 MiB"), err


def test_a_global_batch_is_kept_by_gradient_accumulation(tiny):
    model, make = tiny
    result = autosac.search(model, make, "1GiB", (2, 4, 8, 16), target=SLOW_HOST, global_batch=16)
    assert [(r.batch_size, r.grad_accumulation) for r in result.rows] == [(2, 8), (4, 4), (8, 2), (16, 1)]
    for r in result.rows:
        assert r.feasible and r.samples_per_step == r.batch_size * r.grad_accumulation == 16
        plan = r.plan_to_save()
        assert plan.grad_accumulation == r.stats.grad_accumulation == r.grad_accumulation
        assert plan.input_shapes[0][1][0] == r.batch_size
        # every micro-batch's forward and backward, one optimizer update
        opt = r.stats.optimizer_ms
        assert r.predicted_step_ms == pytest.approx(r.grad_accumulation * (plan.step_ms - opt) + opt)
        assert r.predicted_samples_per_s == pytest.approx(16 / (r.predicted_step_ms / 1e3))
    # a micro-batch with gradients alive throughout holds more than the same batch without accumulation
    plain = autosac.search(model, make, "1GiB", (8,), target=SLOW_HOST)
    assert result.rows[2].predicted_peak_bytes > plain.rows[0].predicted_peak_bytes
    with pytest.raises(ValueError, match="batch size 3 x world size 1 does not divide global_batch 16"):
        autosac.search(model, make, "1GiB", (2, 3), target=SLOW_HOST, global_batch=16)
    with pytest.raises(ValueError, match="not both"):
        autosac.search(model, make, "1GiB", (2,), target=SLOW_HOST, global_batch=16, grad_accumulation=2)


def test_profiles_are_reused_by_a_later_search_of_the_same_setting(tiny, monkeypatch):
    model, make = tiny
    first = autosac.search(model, make, "1GiB", (2, 4), target=SLOW_HOST)
    calls = []
    monkeypatch.setattr("autosac.tools.search.profile", lambda *a, **k: calls.append(k) or None)
    again = autosac.search(model, make, "5MB", (2, 4), target=SLOW_HOST, reuse=first)
    assert not calls and [r.stats for r in again.rows] == [r.stats for r in first.rows]
    with pytest.raises(TypeError):  # another optimizer: profiled anew (here: the stand-in that returns None)
        autosac.search(model, make, "5MB", (2,), target=SLOW_HOST, reuse=first, optimizer="sgd")
    assert calls


@pytest.mark.parametrize("call,match", [
    (dict(memory="60%"), "give a size such as '80GiB'"),
    (dict(memory="least"), "give a size such as '80GiB'"),
    (dict(batch_sizes=(4, 0)), "batch_sizes must be positive ints, got 0"),
    (dict(batch_sizes=()), "batch_sizes must be positive ints, got none"),
    (dict(make=lambda b: rebatched(build_model("gpt-tiny")[1], 3)), r"make_inputs\(2\) returned \(3, 64\)"),
    (dict(reserve="2GiB"), "reserve is not smaller than the memory"),
])
def test_search_mistakes_are_one_line(tiny, call, match):
    model, make = tiny
    with pytest.raises(ValueError, match=match) as e:
        autosac.search(model, call.get("make", make), call.get("memory", "1GiB"), call.get("batch_sizes", (2,)),
                       target=SLOW_HOST, reserve=call.get("reserve", 0))
    assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="does not take: budget"):
        autosac.search(model, make, "1GiB", (2,), budget="1GiB")


def test_batch_option_forms():
    assert batch_sizes("auto") == [1, 2, 4, 8, 16, 32, 64]
    assert batch_sizes(None) == batch_sizes("auto")
    assert batch_sizes("1..64") == [1, 2, 4, 8, 16, 32, 64]
    assert batch_sizes("3..50") == [3, 6, 12, 24, 48]
    assert batch_sizes("4,8,16") == [4, 8, 16] and batch_sizes("12") == [12]
    assert batch_sizes("auto", global_batch=48) == [1, 2, 4, 8, 16]
    assert batch_sizes("auto", global_batch=64, world_size=8) == [1, 2, 4, 8]
    for bad in ("4..x", "8..4", "0..4", "0,4", "-2", "", "a", "1..2..4", "4;8"):
        with pytest.raises(UserError, match=re.escape(f"--batch {bad!r}")):
            batch_sizes(bad)


@pytest.mark.parametrize("argv,match", [
    (["--memory", "1GiB", "--batch", "4..x"], "--batch '4..x' is not a batch size"),
    (["--memory", "1GiB", "--batch", "8,0"], "batch sizes must be positive"),
    (["--budget", "60%", "--batch", "4,8"], "several sizes (auto, 1..64, 4,8,16) go with --memory"),
    (["--memory", "1GiB", "--budget", "60%"], "not both"),
    ([], "plan needs --budget, or --memory"),
    (["--memory", "60%"], "give a size such as '80GiB'"),
    (["--memory", "1GiB", "--global-batch", "16", "--batch", "3,4"], "batch size 3 x world size 1 does not divide"),
    (["--budget", "60%", "--global-batch", "16"], "--global-batch goes with --memory"),
    (["--memory", "1GiB", "--compile", "inductor"], "--memory searches the eager step"),
])
def test_plan_search_mistakes_are_one_line_before_any_work(argv, match, capsys, monkeypatch):
    monkeypatch.setattr("autosac.tools.search.profile", lambda *a, **k: pytest.fail("profiled"))
    assert main(["plan", "--model", "gpt-tiny", "--quiet", *argv]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and match in err and "Traceback" not in err, err
    assert not out


@pytest.mark.parametrize("memory,batches", [("80MiB", "8,16,32"), ("1GiB", "2,4")])
def test_plan_memory_writes_the_chosen_plan_that_loads_back(memory, batches, tmp_path, capsys):
    path = tmp_path / "best.json"
    assert main(["plan", "--model", "gpt-tiny", "--memory", memory, "--batch", batches, "--json", str(path),
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    best = [line for line in out.splitlines() if line.endswith("<- best")]
    assert len(best) == 1
    chosen = int(best[0].split()[0])
    assert f"plan for batch {chosen} written to {path}" in out
    plan = Plan.load(path)
    assert plan.input_shapes[0][1][0] == chosen
    assert bool(plan.decisions) == ("checkpointed" in best[0])
    model, idx = build_model("gpt-tiny", batch=chosen)
    autosac.apply(model, plan)  # a plan for this model (an empty one where nothing needs checkpointing)


def test_rebatched_cycles_the_rows_of_every_batched_tensor():
    import torch

    x = torch.arange(6).reshape(3, 2)
    inputs = {"ids": x, "mask": x > 2, "scale": torch.tensor(2.0), "n": 3}
    out = rebatched(inputs, 5)
    assert out["ids"].tolist() == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]
    assert out["mask"].shape == (5, 2) and out["scale"].dim() == 0 and out["n"] == 3
    assert rebatched(torch.zeros(3, 7, device="meta"), 2).shape == (2, 7)
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        rebatched(torch.tensor(1.0), 4)
