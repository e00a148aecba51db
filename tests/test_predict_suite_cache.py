"""``benchmarks/predict_suite.py`` compares like with like (issue 32): a
transformers decoder whose config says ``use_cache=True`` fills a key/value
cache in its training forward, which ``autosac.apply`` turns off and the trace
does not price; its measured overhead is taken against the unmodified model
run without the cache, as the applied model runs, with the overhead against the
model as given beside it.  Checked by what runs, never by timings."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from suite import A100_CPU_KERNELS
from zoo import LossWrapper

import autosac

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import predict_suite  # noqa: E402


def _gpt2(cache: bool):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=cache,
                                  attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train(), {"input_ids": torch.randint(0, 64, (2, 16))}


def _cache(model, inputs):
    out = model(**inputs)  # transformers 5 names it ``cache`` (``past_key_values`` before)
    return out.get("cache", out.get("past_key_values"))


def test_the_measured_baseline_runs_as_the_applied_model_does_without_the_cache():
    model, inputs = _gpt2(cache=True)
    stats = autosac.profile(model, inputs, target=A100_CPU_KERNELS, optimizer="adamw",
                            loss_fn=lambda out: out.logits.sum())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # apply says once that it turns the cache off
        planned = autosac.apply(copy.deepcopy(model), autosac.solve(stats, "least"))
        assert _cache(planned, inputs) is None
    base = predict_suite.without_cache(model, inputs)
    assert base is not None and base is not model
    assert _cache(base, inputs) is None  # the step the plan's baseline prices
    assert _cache(model, inputs) is not None  # the model as given keeps its cache (no hook left on it)
    # the same values: the cache changes the work, not the step's result
    assert torch.equal(base(**inputs).logits, model(**inputs).logits)


def test_a_model_that_fills_no_cache_is_its_own_baseline():
    model, inputs = _gpt2(cache=False)
    assert predict_suite.without_cache(model, inputs) is None
    model, inputs = _gpt2(cache=True)
    assert predict_suite.without_cache(model, {**inputs, "use_cache": False}) is None  # the caller turned it off
    assert predict_suite.without_cache(model.eval(), inputs) is None  # not a training forward


def test_a_cache_filled_inside_a_wrapper_is_turned_off_too():
    model, inputs = _gpt2(cache=True)
    wrapped = LossWrapper(model).train()
    base = predict_suite.without_cache(wrapped, inputs)
    assert base is not None
    assert _cache(base.model, inputs) is None
    assert _cache(wrapped.model, inputs) is not None


def test_the_table_shows_the_overhead_against_the_model_as_given():
    rows = [predict_suite.Row("zoo-t5", "dispatch", "least", predicted=0.70, measured=0.60, wall=0.61, as_given=0.51,
                              kept=True, bitwise=True),
            predict_suite.Row("mlp", "dispatch", "least", predicted=0.40, measured=0.40, wall=0.40, kept=True,
                              bitwise=True, control=-0.021)]
    lines = predict_suite.table(rows).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    t5 = [c.strip() for c in lines[2].strip("|").split("|")]
    mlp = [c.strip() for c in lines[3].strip("|").split("|")]
    col = header.index("as given")
    assert (t5[col], mlp[col]) == ("+51.0%", "-")
    assert t5[header.index("measured")] == "+60.0%" and t5[header.index("error (points)")] == "+10.0"
    # the control: an identical copy of the unmodified model, the measurement's noise
    assert (t5[header.index("control")], mlp[header.index("control")]) == ("-", "-2.1%")
    assert "measured 2.1 points at the median, 2.1 at most" in predict_suite.table(rows)
