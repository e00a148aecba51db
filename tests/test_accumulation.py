"""Gradient accumulation: the step is planned for the micro-batch that runs
with every gradient already alive, and measured by running micro-batches for
real (autosac.measure's own loop, profiler allocator events)."""

import copy

import pytest
import torch
from suite import A100_CPU_KERNELS

import autosac
from autosac.models import build_model
from autosac.tools.measure import measure


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return build_model("gpt2", device="cpu", n_layer=3, dim=64, n_head=4, seq=32, vocab=128, batch=2)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "none"])
@pytest.mark.parametrize("held", [True, False])
def test_accumulating_peak_is_the_measured_one_and_plans_keep_their_budget(gpt, optimizer, held):
    model, idx = gpt
    one = autosac.profile(model, idx, optimizer=optimizer, target=A100_CPU_KERNELS, output_held=held)
    stats = autosac.profile(model, idx, optimizer=optimizer, target=A100_CPU_KERNELS, output_held=held,
                            grad_accumulation=4)
    assert stats.grad_accumulation == 4
    loop = dict(steps=0, optimizer=optimizer, output_held=held)
    assert stats.peak_bytes == measure(copy.deepcopy(model), idx, grad_accumulation=4, **loop).peak_bytes
    # the gradients alive from the start are what accumulation adds (here the peak is in the backward)
    assert stats.peak_bytes > one.peak_bytes
    for budget in ("95%", "least"):
        plan = autosac.solve(stats, budget)
        assert plan.grad_accumulation == 4
        got = measure(autosac.apply(copy.deepcopy(model), plan), idx, grad_accumulation=2, **loop).peak_bytes
        assert got <= plan.budget_bytes
        assert abs(got - plan.predicted_peak_bytes) <= 0.03 * got


def test_accumulated_step_with_a_plan_is_bitwise_the_unmodified_one(gpt):
    model, idx = gpt
    plan = autosac.solve(model, "least", example_inputs=idx, target=A100_CPU_KERNELS, grad_accumulation=3)
    assert plan.decisions

    def accumulated(m):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
        torch.manual_seed(7)
        losses = []
        for _ in range(3):
            loss = m(idx).float().sum() / 3
            loss.backward()
            losses.append(loss.detach())
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        opt.step()
        return losses, grads, {n: p.detach().clone() for n, p in m.named_parameters()}

    ref = accumulated(copy.deepcopy(model))
    got = accumulated(autosac.apply(copy.deepcopy(model), plan))
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0]))
    for r, g in zip(ref[1:], got[1:]):
        assert r.keys() == g.keys() and all(torch.equal(r[k], g[k]) for k in r)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_grad_accumulation_is_one_clear_error(gpt, bad):
    model, idx = gpt
    with pytest.raises(ValueError, match="grad_accumulation must be a positive int"):
        autosac.profile(model, idx, target=A100_CPU_KERNELS, grad_accumulation=bad)
    with pytest.raises(ValueError, match="grad_accumulation must be a positive int"):
        measure(model, idx, grad_accumulation=bad)


def test_accumulation_over_several_ranks_is_refused(gpt):
    model, idx = gpt
    with pytest.raises(ValueError, match="one process only"):
        autosac.profile(model, idx, target=A100_CPU_KERNELS, world_size=2, grad_accumulation=2)


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("held", [True, False])
def test_zero_grad_before_backward_peak_is_the_measured_one(gpt, held, accumulation):
    # Lightning's order: the previous step's gradients are alive through the forward
    model, idx = gpt
    loop = dict(output_held=held, grad_accumulation=accumulation, zero_grad="before_backward")
    stats = autosac.profile(model, idx, target=A100_CPU_KERNELS, **loop)
    assert stats.zero_grad == "before_backward"
    assert stats.peak_bytes == measure(copy.deepcopy(model), idx, steps=0, **loop).peak_bytes
    if accumulation == 1:  # the old gradients add to the forward's peak
        assert stats.peak_bytes > autosac.profile(model, idx, target=A100_CPU_KERNELS, output_held=held).peak_bytes
    plan = autosac.solve(stats, "95%")
    assert plan.zero_grad == "before_backward"
    got = measure(autosac.apply(copy.deepcopy(model), plan), idx, steps=0, **loop).peak_bytes
    assert got <= plan.budget_bytes and abs(got - plan.predicted_peak_bytes) <= 0.03 * got


def test_an_unknown_zero_grad_is_one_clear_error(gpt):
    model, idx = gpt
    for call in (lambda: autosac.profile(model, idx, target=A100_CPU_KERNELS, zero_grad="never"),
                 lambda: measure(model, idx, zero_grad="never")):
        with pytest.raises(ValueError, match="zero_grad must be 'after_step'"):
            call()


@pytest.mark.parametrize("held", [True, False])
def test_batches_fetched_ahead_are_counted_as_measured(gpt, held):
    model, idx = gpt
    one = autosac.profile(model, idx, target=A100_CPU_KERNELS, output_held=held)
    two = autosac.profile(model, idx, target=A100_CPU_KERNELS, output_held=held, batches_ahead=2)
    assert two.batches_ahead == 2 and two.peak_bytes == one.peak_bytes + 2 * idx.numel() * idx.element_size()
    measured = [measure(copy.deepcopy(model), idx, steps=0, output_held=held, batches_ahead=n).peak_bytes
                for n in (0, 2)]
    assert measured[1] - measured[0] == two.peak_bytes - one.peak_bytes
    assert abs(measured[1] - two.peak_bytes) <= 16
    with pytest.raises(ValueError, match="batches_ahead must be an int >= 0"):
        autosac.profile(model, idx, target=A100_CPU_KERNELS, batches_ahead=-1)
