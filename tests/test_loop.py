"""The training loop as one object (autosac.Loop): built and checked once,
carried by ModelStats and Plan, taken by profile, solve and measure in place
of the four keywords, which stay as a convenience."""

import json

import pytest
from suite import gpt

import autosac

CFG = dict(n_layer=2, dim=64, n_head=4, seq=256, vocab=128, dropout=0.0)
LOOP = autosac.Loop(output_held=False, grad_accumulation=2, zero_grad="after_step", batches_ahead=1)


def test_a_loop_profiles_exactly_as_its_keywords_and_stats_and_plans_carry_it():
    model, idx = gpt(CFG, device="meta", batch=2)
    by_loop = autosac.profile(model, idx, optimizer="sgd", target="a100", loop=LOOP)
    by_keywords = autosac.profile(model, idx, optimizer="sgd", target="a100", output_held=False,
                                  grad_accumulation=2, batches_ahead=1)
    assert by_loop.loop == by_keywords.loop == LOOP
    plain = autosac.profile(model, idx, optimizer="sgd", target="a100")
    assert plain.loop == autosac.Loop() and plain.peak_bytes != by_loop.peak_bytes  # the loop changes the peak
    assert by_loop.peak_bytes == by_keywords.peak_bytes
    assert json.loads(by_loop.to_json())["modules"] == json.loads(by_keywords.to_json())["modules"]
    plan = autosac.solve(by_loop, "least")
    assert plan.loop == LOOP
    assert autosac.Plan.from_json(plan.to_json()).loop == LOOP  # the JSON keeps the four fields, no new key
    assert "loop" not in json.loads(plan.to_json())


def test_solve_takes_a_loop_and_measure_runs_the_plans():
    model, idx = gpt(CFG, batch=2)
    plan = autosac.solve(model, "70%", idx, optimizer="sgd", target="cpu", loop=LOOP)
    assert plan.loop == LOOP
    autosac.apply(model, plan)
    by_loop = autosac.measure(model, idx, steps=0, optimizer="sgd", loop=plan.loop)
    by_keywords = autosac.measure(model, idx, steps=0, optimizer="sgd", output_held=False, grad_accumulation=2,
                                  batches_ahead=1)
    assert by_loop.peak_bytes == by_keywords.peak_bytes
    assert by_loop.peak_bytes <= plan.budget_bytes


@pytest.mark.parametrize("settings, message", [
    (dict(grad_accumulation=0), "grad_accumulation must be a positive int"),
    (dict(grad_accumulation=True), "grad_accumulation must be a positive int"),
    (dict(zero_grad="never"), "zero_grad must be"),
    (dict(output_held="yes"), "output_held must be True"),
    (dict(batches_ahead=-1), "batches_ahead must be an int >= 0"),
])
def test_a_bad_loop_is_refused_when_built(settings, message):
    with pytest.raises(ValueError, match=message):
        autosac.Loop(**settings)


def test_a_loop_and_its_keywords_together_are_refused_before_anything_runs():
    model, idx = gpt(CFG, device="meta", batch=2)
    with pytest.raises(ValueError, match="not both: drop grad_accumulation"):
        autosac.profile(model, idx, loop=LOOP, grad_accumulation=4)
    with pytest.raises(ValueError, match="not both: drop output_held"):
        autosac.solve(model, "70%", idx, loop=LOOP, output_held=False)
    with pytest.raises(TypeError, match="loop must be an autosac.Loop"):
        autosac.profile(model, idx, loop={"output_held": False})


def test_measuring_an_accumulating_loop_runs_two_micro_batches():
    assert autosac.Loop(grad_accumulation=8).measuring() == autosac.Loop(grad_accumulation=2)
    assert LOOP.measuring() == LOOP
    assert autosac.Loop(grad_accumulation=4).grads_alive == "step"
    assert autosac.Loop(zero_grad="before_backward").grads_alive == "forward"
    assert autosac.Loop().grads_alive == "" and autosac.Loop(output_held=False).is_plain
