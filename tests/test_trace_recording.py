"""The recording's op records: one OpRecord per op, filed into the per-op
columns the aggregation reads (issue 34: the recorder no longer appends to
eight parallel lists by hand)."""

import torch

from autosac.core.devices import resolve_target
from autosac.models import build_model
from autosac.trace.costs import CostModel
from autosac.trace.recording import OpRecord, Recording
from autosac.trace.step import trace_step

COLUMNS = ("ops", "phases", "stacks", "ms", "flops", "views", "random", "writes")


def test_add_op_files_one_record_into_every_column_and_its_origin():
    rec = Recording()
    first = rec.add_op(OpRecord("mm", "forward", ("", "fc"), 1.5, 64, False, False, False))
    second = rec.add_op(OpRecord("mm", "backward", ("", "fc"), 3.0, 128, False, False, False, origin=first))
    assert (first, second) == (0, 1)
    assert [getattr(rec, c)[1] for c in COLUMNS] == ["mm", "backward", ("", "fc"), 3.0, 128, False, False, False]
    assert rec.origins == {1: 0}  # a forward op has no origin


def test_a_traced_step_files_every_op_in_every_column():
    torch.manual_seed(0)
    model, idx = build_model("gpt-tiny", device="cpu")
    rec = trace_step(model, idx, cost_model=CostModel(resolve_target("h100"))).recording
    n = len(rec.ops)
    assert n > 100 and all(len(getattr(rec, c)) == n for c in COLUMNS)
    assert {"forward", "loss", "backward", "optimizer"} <= set(rec.phases)
    assert not any(v and w for v, w in zip(rec.views, rec.writes))  # an op writing in place is no view
    assert rec.origins and all(
        rec.phases[e] == "backward" and rec.phases[o] == "forward" and o < e for e, o in rec.origins.items()
    )
