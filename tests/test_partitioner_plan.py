"""Compiled plans kept by torch.compile's own partitioner at a fraction found
in fake mode (autosac.compile.partitioner, autosac.applier.partitioner)."""

import copy
import pickle
from dataclasses import replace

import pytest
import torch
import torch._functorch.config as functorch_config
from suite import A100_CPU_KERNELS  # an A100's op times, the CPU's kernels: plans free of timing noise

import autosac
from autosac.applier.partitioner import BudgetedForward, supported
from autosac.compile.fit import fit_for_compile
from autosac.compile.partitioner import search_fraction
from autosac.compile.trace import CompiledPeak
from autosac.core.errors import StatsFormatError
from autosac.models import build_model

CFG = dict(n_layer=2, dim=128, n_head=4, seq=256, vocab=4096, dropout=0.0)
needs_region_api = pytest.mark.skipif(not supported(), reason="torch < 2.13: no region_activation_memory_budget")


def _model():
    torch.manual_seed(0)
    return build_model("gpt2", device="cpu", batch=4, **CFG)


def _step(model, idx):
    torch._dynamo.reset()
    compiled = torch.compile(model)
    compiled(idx).float().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def fitted():
    model, idx = _model()
    stats = autosac.profile(model, idx, optimizer="sgd", target=A100_CPU_KERNELS)
    if not supported():  # torch < 2.13 makes no such plans: one by hand, for the tests of refusing it
        return model, idx, replace(autosac.solve(stats, stats.peak_bytes), compiled={"partitioner_budget": 0.5})
    # between the unbudgeted compiled peak (67.3 MiB) and the partitioner's at 0.75 (63.1 MiB)
    plan = fit_for_compile(model, stats, 65 << 20, idx, backend="inductor", optimizer="sgd")
    return model, idx, plan


@needs_region_api
def test_the_partitioner_plan_is_the_global_setting_for_this_model_alone(fitted):
    """Applied, the plan's fraction reaches this model's compiled graphs and no
    other: gradients bitwise those of ``torch.compile`` under the process-wide
    ``activation_memory_budget`` at that fraction, the measured peak within
    the budget and as predicted, the process-wide setting untouched, and a
    model compiled beside it gets the default partitioner."""
    model, idx, plan = fitted
    fraction = plan.compiled["partitioner_budget"]
    assert not plan.decisions and 0 < fraction < 1 and plan.compiled["backend"] == "inductor"
    reference = copy.deepcopy(model)
    with functorch_config.patch(activation_memory_budget=fraction):
        expected = _step(reference, idx)
        budgeted = autosac.measure(torch.compile(reference), idx, optimizer="sgd", steps=1).peak_bytes
    planned = autosac.apply(copy.deepcopy(model), plan)
    got = _step(planned, idx)
    assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got)
    torch._dynamo.reset()
    measured = autosac.measure(torch.compile(planned), idx, optimizer="sgd", steps=1).peak_bytes
    assert measured == budgeted and measured <= plan.budget_bytes, (measured, budgeted, plan.budget_bytes)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.005 * measured, (measured, plan.predicted_peak_bytes)
    assert functorch_config.activation_memory_budget == 1.0
    torch._dynamo.reset()
    beside = autosac.measure(torch.compile(copy.deepcopy(model)), idx, optimizer="sgd", steps=1).peak_bytes
    torch._dynamo.reset()
    plain = autosac.measure(torch.compile(reference), idx, optimizer="sgd", steps=1).peak_bytes
    assert beside == plain > plan.budget_bytes


@needs_region_api
def test_the_partitioner_plan_runs_eager_as_the_model_and_comes_off(fitted):
    """Eager, the wrapped forward is the model's own (bitwise); the plan
    prints what it is, survives a save and load, pickles and deep-copies with
    the model (each copy's forward is its own), and unapply puts back a
    forward the instance had before."""
    model, idx, plan = fitted
    assert "torch.compile's partitioner recomputes, at activation_memory_budget=" in str(plan)
    again = autosac.Plan.from_json(plan.to_json())
    assert again.compiled == plan.compiled
    m = copy.deepcopy(model)
    own = m.forward  # a forward set on the instance before apply
    m.forward = own
    expected = m(idx)
    autosac.apply(m, again)
    assert type(m.__dict__["forward"]) is BudgetedForward
    assert torch.equal(m(idx), expected)
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert c.__dict__["forward"].ref() is c and torch.equal(c(idx), expected)
    autosac.unapply(m)
    assert m.__dict__["forward"] is own


def test_where_torch_cannot_scope_the_budget_apply_refuses_and_solve_never_offers_it(fitted, monkeypatch):
    """Before torch 2.13 (no ``region_activation_memory_budget``: removed here)
    the process-wide setting is read when Dynamo compiles and not guarded: a
    graph compiled for another instance of the class would be reused with its
    budget.  So applying such a plan raises one line naming the fix and
    changes nothing, and the fit does not offer the partitioner."""
    model, idx, plan = fitted
    monkeypatch.delattr(torch.autograd.graph, "region_activation_memory_budget", raising=False)
    assert not supported()
    m = copy.deepcopy(model)
    with pytest.raises(ValueError, match=r"activation_memory_budget=.*torch >= 2.13"):
        autosac.apply(m, plan)
    assert "forward" not in m.__dict__ and autosac.applier.applied_plan(m) is None
    assert not m._forward_pre_hooks and not m._forward_hooks
    stats = autosac.profile(model, idx, optimizer="sgd", target=A100_CPU_KERNELS)
    with pytest.raises(ValueError, match=r"partitioner=True plans by .*torch >= 2.13"):
        fit_for_compile(model, stats, "90%", idx, backend="inductor", optimizer="sgd", partitioner=True)


@needs_region_api
def test_a_forward_set_after_apply_stops_the_budget_with_unapply(fitted):
    """A forward set on the model after apply (accelerate's hooks) calls ours:
    after unapply the compiled step is the default partitioner's again, and
    the root keeps its own signature while applied."""
    import inspect

    model, idx, plan = fitted
    m = copy.deepcopy(model)
    autosac.apply(m, plan)
    assert inspect.signature(m.forward) == inspect.signature(model.forward)
    inner = m.forward
    m.forward = lambda *a, **k: inner(*a, **k)  # set after apply
    autosac.unapply(m)
    torch._dynamo.reset()
    after = autosac.measure(torch.compile(m), idx, optimizer="sgd", steps=1).peak_bytes
    torch._dynamo.reset()
    plain = autosac.measure(torch.compile(copy.deepcopy(model)), idx, optimizer="sgd", steps=1).peak_bytes
    assert after == plain > plan.budget_bytes


def test_a_hand_edited_partitioner_budget_is_refused(fitted):
    _, _, plan = fitted
    for bad in (1.5, -0.1, "half", True):
        edited = copy.deepcopy(plan)
        edited.compiled["partitioner_budget"] = bad
        with pytest.raises(StatsFormatError, match="partitioner_budget"):
            edited.validate()
    mixed = copy.deepcopy(plan)
    mixed.decisions = {"blocks.0": 1.0}
    mixed.details = {}
    with pytest.raises(StatsFormatError):
        mixed.validate()


def _peak(peak_bytes: int, kernel_ms: float) -> CompiledPeak:
    return CompiledPeak(peak_bytes, "backward", {}, "inductor", 0, kernel_ms)


def test_the_fraction_search_keeps_the_cheapest_fit_though_peaks_are_not_monotone():
    """Peaks as torch's partitioner gave them on a gpt2 (MiB: 0.3 above 0.5):
    the bisection traces 0.5, 0.75, 0.625, 0.6875 and keeps, among the fits,
    the one whose step runs the least matmul work -- ties to the higher fraction."""
    table = {0.5: (213, 2.0), 0.75: (250, 0.0), 0.625: (230, 1.0), 0.6875: (231, 1.0)}
    seen = []

    def trace(f):
        seen.append(f)
        return _peak(*table[f])

    best, tried = search_fraction(trace, budget_bytes=231)
    assert seen == [0.5, 0.75, 0.625, 0.6875] and [t.fraction for t in tried] == seen
    assert best.fraction == 0.6875
    best, _ = search_fraction(lambda f: _peak(300, 0.0), budget_bytes=231)
    assert best is None


@needs_region_api
def test_where_the_partitioner_re_runs_no_matmul_no_checkpointing_plan_is_traced(fitted):
    """Between the unbudgeted compiled peak (67.3 MiB) and the partitioner's at
    0.75 (63.1 MiB, the same matmuls) the partitioner's plan adds no matmul
    work: no checkpointing plan could run less, so none is traced -- the step
    without a plan and four fractions, five rounds -- and its predicted
    recompute is nothing."""
    _, _, plan = fitted
    assert plan.compiled["partitioner_budget"] >= 0.75 and plan.compiled["rounds"] == 5
    assert plan.recompute_ms == 0 and plan.predicted_peak_bytes <= 65 << 20


@needs_region_api
def test_a_step_torch_will_not_budget_whole_is_planned_with_checkpoints_alone():
    """A conv + BatchNorm net under inductor: torch refuses the partitioner's
    budget region (the norms' running statistics are written back after it:
    "forward op(s) are unannotated").  Solve warns once and goes on with
    checkpointed modules alone -- here none fits, so the error is that
    route's, naming the least compiled peak, not the refused trace; asked
    for the partitioner outright, the refusal is the error."""
    import warnings

    from torch import nn

    from autosac.core.errors import InfeasibleBudgetError, TraceError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    x = torch.rand(4, 3, 32, 32)
    stats = autosac.profile(model, x, optimizer="sgd", target=A100_CPU_KERNELS)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(InfeasibleBudgetError, match="least compiled peak among the 2 plans traced"):
            fit_for_compile(model, stats, "50%", x, backend="inductor", optimizer="sgd")
    said = [str(w.message) for w in caught if "partitioner budget could not be traced" in str(w.message)]
    assert len(said) == 1 and "unannotated" in said[0], [str(w.message) for w in caught]
    with pytest.raises(TraceError, match="region_activation_memory_budget"):
        fit_for_compile(model, stats, "50%", x, backend="inductor", optimizer="sgd", partitioner=True)
    # nothing left half-done: no plan applied, parameters and running statistics as they were
    assert autosac.applier.applied_plan(model) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
