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


def _real_backward_detaches(model, x) -> int:
    """The ``aten.detach`` calls a real backward makes (grads None, as after
    ``zero_grad(set_to_none=True)``), counted by torch's profiler."""
    from torch.profiler import profile

    loss = model(x).sum()
    model.zero_grad(set_to_none=True)
    with profile() as prof:
        loss.backward()
    return sum(1 for e in prof.events() if e.name == "aten::detach")


def test_the_backward_holds_the_real_steps_detaches_not_autograds_copies_of_saved_tensors():
    # autograd copies each saved tensor it unpacks; for a fake tensor that copy is an aten.detach
    # the trace saw (6 of the 12 detaches here), for a real one a C++ copy no dispatcher sees
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    real = _real_backward_detaches(model, x)
    rec = trace_step(model, x, cost_model=CostModel(resolve_target("h100"))).recording
    traced = sum(1 for op, phase in zip(rec.ops, rec.phases) if op == "detach" and phase == "backward")
    assert real == len(list(model.parameters())) == 6  # AccumulateGrad's, one per parameter
    assert traced == real
