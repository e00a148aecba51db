"""Hand-edited or corrupted files fail at load, in one line naming the field
(plans and profiles), or are re-measured (the CPU timing cache): never later,
in a print, a solve or a forward, and never half-applied."""

import json
import math
import os
import warnings
from dataclasses import replace

import pytest
import torch
from suite import A100_CPU_KERNELS
from torch import nn

import autosac
from autosac.core.host import HostCosts
from autosac.core.plan import Plan
from autosac.core.stats import ModelStats
from autosac.tools import calibrate as host
from autosac.trace.timings import cache_path

SIGNED_CACHE_KEYS = host.SIGNED_CACHE_KEYS  # host figures that may be negative (and their last clean copies)
CPU_NO_HOST = replace(autosac.DEVICES["cpu"], host=HostCosts())  # timed ops, no host calibration


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)])


@pytest.fixture(scope="module")
def stats():
    return autosac.profile(_tiny(), torch.randn(4, 8, 16), target=A100_CPU_KERNELS, optimizer="none")


@pytest.fixture(scope="module")
def plan(stats):
    plan = autosac.solve(stats, "least")
    assert plan.decisions and plan.input_shapes  # something to break
    return plan


def _first(d: dict):
    return next(iter(d))


def _set_detail(key, value):
    def edit(d):
        d["details"][_first(d["details"])][key] = value
    return edit


def _set_op(key, value):
    def edit(d):
        d["details"][_first(d["details"])]["ops"][0][key] = value
    return edit


PLAN_EDITS = [  # (edit of the plan's JSON data, the field the message names)
    (lambda d: d.update(decisions=list(d["decisions"])), "decisions must be an object"),
    (lambda d: d.update(decisions=[list(kv) for kv in d["decisions"].items()]), "decisions must be an object"),
    (lambda d: d.update(budget_bytes="lots"), "budget_bytes must be an int, got 'lots'"),
    (lambda d: d.update(input_shapes=[["args[0]", "garbage", "float32"]]), r"input_shapes\[0\]\[1\]"),
    (lambda d: d.update(input_shapes=["garbage"]), r"input_shapes\[0\] must be a list"),
    (lambda d: d.update(input_shapes=[["args[0]", [4, 8]]]), r"input_shapes\[0\] must be \[where, shape, dtype\]"),
    (lambda d: d.update(input_shapes=[["args[0]", [4, 8, 16], "float99"]]), r"input_shapes\[0\]\[2\]"),
    (lambda d: d.update(recompute_ms=float("nan")), "recompute_ms must be a finite number, got nan"),
    (lambda d: d.update(step_ms=float("inf")), "step_ms must be a finite number, got inf"),
    (lambda d: d.update(world_size=2.0), "world_size must be an int"),
    (lambda d: d.update(world_size=0), "world_size must be an int >= 1"),
    (lambda d: d.update(predicted_peak_bytes=-5), "predicted_peak_bytes must be >= 0"),
    (lambda d: d.update(output_held="yes"), "output_held must be true or false"),
    (lambda d: d.update(zero_grad="never"), "zero_grad must be 'after_step' or 'before_backward'"),
    (lambda d: d.update(autocast="float99"), "autocast must be"),
    (lambda d: d.update(solver={"gap": float("nan")}), r"solver\['gap'\] must be a finite number"),
    (lambda d: d.update(versions={"torch": 2}), r"versions\['torch'\] must be a string"),
    (lambda d: d["decisions"].update({_first(d["decisions"]): "0.5"}), r"decisions\[.*\] must be a finite number"),
    (lambda d: d["decisions"].update({_first(d["decisions"]): 0}), r"discard ratio 0\.0 of .* is not in \(0, 1\]"),
    (_set_detail("calls", "garbage"), r"details\[.*\]\.calls must be a list"),
    (_set_detail("calls", [["addmm", ["x"]]]), r"details\[.*\]\.calls\[0\] must be \[op name"),
    (_set_detail("save", [10**6]), r"details\[.*\]\.save holds call index 1000000"),
    (_set_detail("bogus", 1), r"details\[.*\] has no field 'bogus'"),
    (_set_op("ms", "x"), r"details\[.*\]\.ops\[0\]\.ms must be a finite number"),
    (_set_op("bytes", 1.5), r"details\[.*\]\.ops\[0\]\.bytes must be an int"),
    (lambda d: d["details"][_first(d["details"])].pop("ratio"), r"details\[.*\]\.ratio is missing"),
]


def _assert_one_line_error(call, match):
    with pytest.raises(autosac.StatsFormatError, match=match) as info:
        call()
    assert "\n" not in str(info.value) and len(str(info.value)) < 300, str(info.value)[:500]


@pytest.mark.parametrize("edit,match", PLAN_EDITS)
def test_malformed_plan_fails_at_load_naming_the_field(plan, tmp_path, edit, match):
    data = json.loads(plan.to_json())
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    _assert_one_line_error(lambda: Plan.load(path), match)
    _assert_one_line_error(lambda: Plan.from_json(path.read_text()), match)


def test_plans_of_the_last_format_load_and_other_formats_are_refused(plan):
    """Format 7 added each decision's ``host_rng``: an autosac reading only 6
    refuses a plan written now (one line, not a field it does not know), and
    format-5 and -6 plans, which mean the same today, still load with it
    unknown -- every checkpointed call then captures the host generators,
    which ``apply`` says once."""
    data = json.loads(plan.to_json())
    assert data["format"] == 7 and plan.decisions
    for older in (5, 6):
        old_data = {**data, "format": older,
                    "details": {f: {k: v for k, v in d.items() if k != "host_rng"} for f, d in data["details"].items()}}
        old = Plan.from_json(json.dumps(old_data))
        assert old.decisions == plan.decisions and old.format == 7  # written again as this version's plan
        assert all(d.host_rng is None for d in old.details.values())
    for found in (4, 8, True, "7", None, 5.0):
        _assert_one_line_error(lambda f=found: Plan.from_json(json.dumps({**data, "format": f})),
                               f"plan format {found!r} is not 7: re-plan with this autosac version")
    # JSON that is no plan at all (another tool's file) is said to be none, not an old format
    for other in ({"model": "x", "layers": 3}, [1, 2], {}):
        _assert_one_line_error(lambda o=other: Plan.from_json(json.dumps(o)), "not an autosac plan")


def test_deeply_nested_plan_and_stats_are_one_clear_error(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "plan.json"
    path.write_text(deep)
    _assert_one_line_error(lambda: Plan.load(path), "nested too deeply")
    _assert_one_line_error(lambda: Plan.from_json(f'{{"format": 5, "solver": {deep}}}'), "nested too deeply")
    _assert_one_line_error(lambda: ModelStats.from_json(deep), "nested too deeply")


def _applied_state(model: nn.Module) -> list:
    """Everything apply changes: instance attributes and hooks of every module."""
    return [(name, sorted(m.__dict__), dict(m._forward_pre_hooks), dict(m._forward_hooks))
            for name, m in model.named_modules()]


@pytest.mark.parametrize("field,value,match", [
    ("decisions", ["0"], "decisions must be an object"),
    ("budget_bytes", "lots", "budget_bytes must be an int"),
    ("input_shapes", "garbage", "input_shapes must be a list"),
    ("input_shapes", [["args[0]", [4, "x", 16], "float32"]], r"input_shapes\[0\]\[1\]"),
    ("recompute_ms", float("inf"), "recompute_ms must be a finite number"),
])
def test_malformed_plan_in_memory_is_refused_by_apply_with_nothing_applied(plan, field, value, match):
    model = _tiny()
    before = _applied_state(model)
    bad = replace(plan, **{field: value})
    _assert_one_line_error(lambda: autosac.apply(model, bad), match)
    assert _applied_state(model) == before
    model(torch.randn(4, 8, 16)).sum().backward()  # the plain model still runs


def test_valid_plan_round_trips_and_applies(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    assert str(again) == str(plan)
    model = _tiny()
    autosac.apply(model, again)
    x = torch.randn(4, 8, 16)
    model(x).sum().backward()


STATS_EDITS = [
    (lambda d: d.update(peak_bytes="x"), "peak_bytes must be an int"),
    (lambda d: d.update(step_ms=float("nan")), "step_ms must be a finite number, got nan"),
    (lambda d: d.update(input_shapes=[[0, [1], "float32"]]), r"input_shapes\[0\]\[0\] must be a string"),
    (lambda d: d.update(modules=[]), "modules must be an object"),
    (lambda d: d.update(root="nowhere"), "root 'nowhere' is not one of modules"),
    (lambda d: d["modules"][d["root"]].update(children=["nowhere"]), "children names 'nowhere'"),
    (lambda d: d["modules"][d["root"]].update(fw_windows="x"), r"modules\[''\]\.fw_windows must be a list"),
    (lambda d: d["modules"][d["root"]].update(bw_window=None), None),  # None is allowed there
    (lambda d: d["saved_ops"][0].update(bytes=1.5), r"saved_ops\[0\]\.bytes must be an int"),
    (lambda d: d["timeline"]["ms"].__setitem__(3, float("inf")), r"timeline\.ms\[3\] must be a finite number"),
    (lambda d: d["timeline"]["ops"].pop(), "timeline.phases has .* entries for .* ops"),
    (lambda d: d["timeline"].update(views=[]), None),  # an optional column may be empty
    (lambda d: d.update(target={"name": "h100", "bandwidth": float("inf")}), r"target\['bandwidth'\]"),
    (lambda d: d.update(grad_accumulation=0), "grad_accumulation must be an int >= 1"),
]


@pytest.mark.parametrize("edit,match", STATS_EDITS)
def test_malformed_stats_fail_at_load_naming_the_field(stats, edit, match):
    data = json.loads(stats.to_json())
    edit(data)
    text = json.dumps(data)
    if match is None:
        ModelStats.from_json(text)
    else:
        _assert_one_line_error(lambda: ModelStats.from_json(text), match)


def test_valid_stats_round_trip(stats):
    assert ModelStats.from_json(stats.to_json()) == stats


# --- the CPU timing cache -------------------------------------------------------------------------

BAD_VALUES = [float("nan"), -1.0, float("inf"), "x", None, [1.0], True, float("-inf")]


@pytest.fixture
def fresh_roofline(monkeypatch):
    """The CPU roofline read from the cache as a new process would (it is kept for the process)."""
    from functools import lru_cache

    from autosac.trace import costs

    fresh = lru_cache(maxsize=1)(costs.local_cpu_spec.__wrapped__)
    monkeypatch.setattr(costs, "local_cpu_spec", fresh)
    return fresh


def _profile_cpu(tmp_path, monkeypatch, name: str):
    monkeypatch.setenv("AUTOSAC_CACHE_DIR", str(tmp_path / name))
    return autosac.profile(_tiny(), torch.randn(4, 8, 16), target=CPU_NO_HOST, optimizer="none"), cache_path()


def _assert_finite(stats):
    assert all(math.isfinite(ms) and ms >= 0 for ms in stats.timeline.ms)
    assert math.isfinite(stats.step_ms) and stats.step_ms > 0
    plan = autosac.solve(stats, "least")
    assert plan.decisions and math.isfinite(plan.recompute_ms) and math.isfinite(plan.step_ms)


def _assert_clean_file(path, keys):
    def refuse(token):
        raise AssertionError(f"{path} holds {token}")

    data = json.loads(path.read_text(), parse_constant=refuse)
    assert isinstance(data, dict) and keys <= set(data)
    for k, v in data.items():
        assert type(v) in (int, float) and (v >= 0 or k in SIGNED_CACHE_KEYS), (k, v)


def _profile_warned(tmp_path, monkeypatch, name: str, roofline):
    """Profile with the cache dir ``name`` as a new process would; the one warning it gives, naming the file."""
    roofline.cache_clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        stats, path = _profile_cpu(tmp_path, monkeypatch, name)
        _assert_finite(stats)
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in seen]
    ours = [str(w.message) for w in seen if str(path) in str(w.message)]
    assert len(ours) == 1 and "timing again and rewriting it" in ours[0], [str(w.message) for w in seen]
    return stats, path


def test_bad_timing_entries_are_retimed_and_rewritten(tmp_path, monkeypatch, fresh_roofline):
    _, good = _profile_cpu(tmp_path, monkeypatch, "good")
    table = json.loads(good.read_text())
    assert len(table) >= len(BAD_VALUES)
    corrupt = {k: BAD_VALUES[i % len(BAD_VALUES)] for i, k in enumerate(table)}
    corrupt["unused op"] = float("nan")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / good.name).write_text(json.dumps(corrupt))
    _, path = _profile_warned(tmp_path, monkeypatch, "bad", fresh_roofline)
    assert path == tmp_path / "bad" / good.name
    _assert_clean_file(path, set(table))
    assert "unused op" not in json.loads(path.read_text())


@pytest.mark.parametrize("content", [bytes(range(256)), b"[1, 2]", b'"timings"', b'{"a": ', b"[" * 100_000],
                         ids=["binary", "list", "string", "truncated", "deep"])
def test_unreadable_timing_cache_is_remeasured_and_rewritten(tmp_path, monkeypatch, content, fresh_roofline):
    _, good = _profile_cpu(tmp_path, monkeypatch, "good")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / good.name).write_bytes(content)
    _, path = _profile_warned(tmp_path, monkeypatch, "bad", fresh_roofline)
    _assert_clean_file(path, set(json.loads(good.read_text())))


def test_bad_host_figures_are_remeasured_not_raised(tmp_path, monkeypatch):
    """NaN or negative host figures in the cache raised ``HostCosts.op_us must be
    a number of microseconds, got nan``, naming no file: now measured again."""
    measured = HostCosts(op_us=10.0, checkpoint_call_us=100.0, saved_tensor_us=5.0, selective_op_us=20.0,
                         untimed_op_us=3.0, backward_op_us=8.0, backward_untimed_us=-1.5)
    calls = []
    monkeypatch.setattr(host, "_measure", lambda: calls.append(1) or measured)
    monkeypatch.setattr(host, "_CALIBRATED", None)
    monkeypatch.setenv("AUTOSAC_CACHE_DIR", str(tmp_path))
    path = cache_path()
    fields = list(measured.to_dict())
    bad = {f"{host.CACHE_KEY}:{f}": BAD_VALUES[i % 3] for i, f in enumerate(fields)}  # nan, -1, inf
    path.write_text(json.dumps(bad))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert host.calibrate() == measured
    assert calls == [1]
    assert [str(w.message) for w in seen if str(path) in str(w.message)]
    _assert_clean_file(path, set(bad))
    assert json.loads(path.read_text())[f"{host.CACHE_KEY}:backward_untimed_us"] == -1.5  # signed: kept
    # the next process reads them back, negative signed figure included, and measures nothing
    monkeypatch.setattr(host, "_CALIBRATED", None)
    monkeypatch.setattr(autosac.trace.timings.TimingCache, "_loaded", {})
    assert host.calibrate() == measured and calls == [1]


def test_a_signed_host_figure_of_an_earlier_calibration_version_is_no_bad_entry(tmp_path):
    """After an upgrade bumped the calibration version, the file's earlier
    negative ``backward_untimed_us`` (a signed figure) was read as a bad entry:
    a repair warning at the first profile of every upgraded install (new-user trial)."""
    from autosac.trace.timings import _read

    path = tmp_path / "cpu-timings.json"
    path.write_text(json.dumps({"host-costs-v1:backward_untimed_us": -0.223,
                                "host-costs-v1:history:0:backward_untimed_us": -0.1, "mm|x": 1.5}))
    assert _read(path) == ({"host-costs-v1:backward_untimed_us": -0.223,
                            "host-costs-v1:history:0:backward_untimed_us": -0.1, "mm|x": 1.5}, "")
    path.write_text(json.dumps({"host-costs-v1:op_us": -1.0, "mm|x": -2.0}))
    assert "holds 2 entries" in _read(path)[1]


def test_host_costs_refuse_infinity():
    with pytest.raises(ValueError, match="op_us must be a number of microseconds, got inf"):
        HostCosts(op_us=float("inf"))


def test_the_timing_cache_folder_is_private_under_a_group_writable_umask(tmp_path, monkeypatch, fresh_roofline):
    """Made 0700 whatever the umask (002 on many systems): a group-writable
    cache folder would turn the native op's build cache off (autosac.zero3.native)."""
    old = os.umask(0o002)
    try:
        _, path = _profile_cpu(tmp_path, monkeypatch, "umask-002")
    finally:
        os.umask(old)
    assert path.exists() and path.parent.stat().st_mode & 0o777 == 0o700
