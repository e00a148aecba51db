"""Plan JSON files: the round trip, corrupted or edited plans refused, the
nesting checks, a binary file, the plan table's order, and plans made from
given decisions."""

import dataclasses
import json

import pytest

import autosac
from autosac.core.host import HostCosts
from autosac.core.plan import Plan
from autosac.models import build_model


@pytest.fixture(scope="module")
def plan():
    model, idx = build_model("seed-transformer", n_layer=2, seq=256)
    return autosac.solve(model, "78%", example_inputs=idx)


def test_plan_json_round_trip(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    assert again.decisions and all(0 < r <= 1 for r in again.decisions.values())
    assert again.predicted_peak_bytes <= again.budget_bytes < again.baseline_peak_bytes
    ops = [o for d in again.details.values() for o in d.ops]
    assert ops and all(o.occurrence >= 0 and o.bytes > 0 for o in ops)
    # the table names every decision
    text = str(again)
    for fqn in again.decisions:
        assert fqn in text
    assert "planned peak" in text and "budget" in text


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: d.update(format=8), "plan format 8"),
        (lambda d: d.pop("decisions"), "malformed plan"),
        (lambda d: d["decisions"].update({k: 1.5 for k in d["decisions"]}), r"not in \(0, 1\]"),
        (lambda d: d["decisions"].update({"extra": 0.5}), "different modules"),
    ],
)
def test_corrupted_or_edited_plan_is_refused(plan, tmp_path, edit, match):
    data = json.loads(plan.to_json())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(autosac.StatsFormatError, match=match):
        Plan.load(path)
    path.write_text(plan.to_json()[:100])
    with pytest.raises(autosac.StatsFormatError, match="not a plan JSON"):
        Plan.load(path)


def test_nesting_is_checked_for_every_prefix(plan):
    data = json.loads(plan.to_json())
    fqn, detail = next(iter(data["details"].items()))
    for name in ("blocks.0", "blocks.0-x", "blocks.0.attn"):
        data["decisions"][name] = 0.5
        data["details"][name] = {**detail, "fqn": name}
    for name in list(data["decisions"]):
        if name not in ("blocks.0", "blocks.0-x", "blocks.0.attn"):
            data["decisions"].pop(name)
            data["details"].pop(name)
    with pytest.raises(autosac.StatsFormatError, match="'blocks.0.attn' is nested inside checkpointed 'blocks.0'"):
        Plan.from_json(json.dumps(data))


def test_plan_from_given_decisions_renders_and_round_trips(plan):
    from autosac.solver import plan_from_decisions

    model, idx = build_model("seed-transformer", n_layer=2, seq=256)
    stats = autosac.profile(model, idx)
    given = plan_from_decisions(stats, {"blocks.0": 1.0, "blocks.1.attn": 0.5})
    assert given.decisions["blocks.0"] == 1.0 and given.decisions["blocks.1.attn"] >= 0.5
    assert "given" in str(given)
    assert Plan.from_json(given.to_json()) == given
    with pytest.raises(ValueError, match="nested inside"):
        plan_from_decisions(stats, {"blocks.0": 1.0, "blocks.0.attn": 1.0})


def test_binary_plan_file_is_one_clear_error(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(autosac.StatsFormatError, match="not UTF-8 text"):
        Plan.load(path)


def test_the_plan_table_lists_modules_in_model_order_and_names_where_ops_ran():
    model, idx = build_model("gpt2", device="meta", batch=8, n_layer=12, dim=128, n_head=4, seq=256, vocab=512)
    # kernels alone (no host costs, which this machine's calibration sets): the same plan in every run
    h100 = dataclasses.replace(autosac.DEVICES["h100"], host=HostCosts())
    plan = autosac.solve(model, "50%", idx, target=h100)
    rows = [line.split()[0] for line in str(plan).splitlines()[1:] if line.startswith("blocks.")]
    assert len(rows) >= 11 and rows.index("blocks.2") < rows.index("blocks.10")
    assert rows == sorted(rows, key=lambda f: int(f.split(".")[1]))
    assert list(plan.decisions) == list(plan.details) == rows
    labels = [o.label for d in plan.details.values() for o in d.ops]
    assert "mlp.fc:addmm" in labels and "ln_1:layer_norm" in labels  # the submodule, and aten's name without native_
    assert Plan.from_json(plan.to_json()).details == plan.details  # the order survives JSON
