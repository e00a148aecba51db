"""A plan under torch.compile: the checkpointed modules are traced (no graph
break), their decisions become the partitioner's recompute tags, gradients
equal eager's and the measured peak keeps the budget."""

import copy

import torch

import autosac
from autosac.applier.compiled import save_keys
from autosac.models import build_model

CFG = dict(n_layer=2, dim=64, n_head=4, seq=256, vocab=128, dropout=0.0)


def test_saved_calls_are_named_by_op_and_occurrence():
    calls = [("mm", ()), ("relu", ()), ("mm", ()), ("view", ()), ("mm", ())]
    assert save_keys(calls, frozenset({2, 3})) == (("mm", 1), ("view", 0))


def test_a_planned_model_compiles_whole_and_keeps_its_gradients_and_budget(monkeypatch):
    from autosac.applier import compiled as compiled_path
    from autosac.applier.region import RegionPolicy

    used = {"compiled": 0, "eager": 0}
    real_contexts, real_start = compiled_path.compiled_contexts, RegionPolicy.start

    def counting_contexts(saved):
        used["compiled"] += 1
        return real_contexts(saved)

    def counting_start(self, *args, **kwargs):
        used["eager"] += 1
        return real_start(self, *args, **kwargs)

    monkeypatch.setattr(compiled_path, "compiled_contexts", counting_contexts)
    monkeypatch.setattr(RegionPolicy, "start", counting_start)
    torch.manual_seed(0)
    model, idx = build_model("gpt2", device="cpu", batch=2, **CFG)
    stats = autosac.profile(model, idx, optimizer="sgd", target="cpu")
    plan = autosac.solve(stats, "70%")
    assert plan.decisions
    reference = copy.deepcopy(model)
    expect = reference(idx).float().sum()
    expect.backward()
    autosac.apply(model, plan)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(idx)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    used.update(compiled=0, eager=0)
    compiled = torch.compile(model, backend="aot_eager")
    loss = compiled(idx).float().sum()
    loss.backward()
    assert used["compiled"] >= 1 and used["eager"] == 0  # the region was traced with the plan's tags
    assert torch.equal(loss, expect)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    model.zero_grad(set_to_none=True)
    measured = autosac.measure(torch.compile(model, backend="aot_eager"), idx, optimizer="sgd", steps=1).peak_bytes
    assert measured <= plan.budget_bytes, (measured, plan.budget_bytes)


def test_the_memory_aware_backend_reorders_forward_and_backward_with_the_same_gradients():
    from autosac import schedule

    torch.manual_seed(0)
    model, idx = build_model("gpt2", device="cpu", batch=2, **CFG)
    stats = autosac.profile(model, idx, optimizer="sgd", target="cpu")
    plan = autosac.solve(stats, "70%")
    reference = copy.deepcopy(model)
    expect = reference(idx).float().sum()
    expect.backward()
    autosac.apply(model, plan)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=schedule.memory_aware_backend)
    loss = compiled(idx).float().sum()
    loss.backward()
    assert torch.equal(loss, expect)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_with_dropout_the_compiled_plan_draws_the_same_numbers():
    """Random ops are saved, never replayed: the planned compiled step equals
    the unplanned compiled one under the same seed."""
    torch.manual_seed(0)
    model, idx = build_model("gpt2", device="cpu", batch=2, **{**CFG, "dropout": 0.1})
    plan = autosac.solve(autosac.profile(model, idx, optimizer="sgd", target="cpu"), "70%")
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    torch.manual_seed(1)
    expect = torch.compile(reference, backend="aot_eager")(idx).float().sum()
    expect.backward()
    autosac.apply(model, plan)
    torch._dynamo.reset()
    torch.manual_seed(1)
    loss = torch.compile(model, backend="aot_eager")(idx).float().sum()
    loss.backward()
    assert torch.equal(loss, expect)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_under_inductor_the_plan_keeps_its_budget_and_gradients_to_rounding():
    """Inductor fuses the planned and the unplanned graphs differently, so
    gradients agree to float rounding, not bit for bit."""
    torch.manual_seed(0)
    model, idx = build_model("gpt2", device="cpu", batch=2, **CFG)
    plan = autosac.solve(autosac.profile(model, idx, optimizer="sgd", target="cpu"), "70%")
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    torch.compile(reference, backend="inductor")(idx).float().sum().backward()
    autosac.apply(model, plan)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor")
    compiled(idx).float().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4 * q.grad.abs().max().item(), msg=name)
    model.zero_grad(set_to_none=True)
    measured = autosac.measure(compiled, idx, optimizer="sgd", steps=1).peak_bytes
    assert measured <= plan.budget_bytes, (measured, plan.budget_bytes)
