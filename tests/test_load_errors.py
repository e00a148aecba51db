"""Hand-edited or corrupted plans and profiles fail at load, in one line naming
the field: never later, in a print, a solve or a forward, and never half-applied."""

import json
from dataclasses import replace

import pytest
import torch
from suite import A100_CPU_KERNELS
from torch import nn

import autosac
from autosac.plan import Plan
from autosac.stats import ModelStats


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
