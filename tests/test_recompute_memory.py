"""A checkpointed module's replay, predicted to the byte against a real CPU
step: where in the backward it runs and what is alive then (found by a
new-user trial on transformers models, 2026-11-26)."""

import copy
import warnings

import pytest
import torch

import autosac
from autosac.solver import plan_from_decisions, solve_budget

transformers = pytest.importorskip("transformers")


def _llama(attention_dropout: float):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attention_dropout=attention_dropout, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (8, 64))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_a_replay_runs_at_its_first_read_of_a_saved_tensor(dropout):
    """Under bf16 autocast the decoder layer's last op adds its float32
    residual to a bf16 result; that add's backward casts the gradient to bf16
    (8 KiB a sample) and reads nothing saved, so it runs before the layer's
    replay, and its gradient is alive all through it.  Predicted as if the
    replay ran at the layer's first backward op, the last layer's plan measured
    65,536 B over its prediction, and over its least budget with LoRA.  The
    parameter casts the unmodified step re-makes by then are counted once
    (the attention alone: its output projection's).  Without dropout the
    attention is one fused kernel and the layer's replay peaks late: PyTorch's
    checkpoint stops the replay at the last saved tensor (its early stop), and
    counting the rest of the forward over-predicted it by 119,744 B."""
    model, inputs = _llama(attention_dropout=dropout)
    loss_fn = lambda out: out.loss  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu", autocast=torch.bfloat16)
        for fqn in ("model.layers.1", "model.layers.1.self_attn")[: 2 if dropout else 1]:
            plan = plan_from_decisions(stats, {fqn: 1.0})
            planned = autosac.apply(copy.deepcopy(model), plan)
            # the applier keeps early stop on in its regions, as the plan counts it, whatever the global says
            with torch.utils.checkpoint.set_checkpoint_early_stop(bool(dropout)):
                real = autosac.measure(planned, inputs, loss_fn=loss_fn, steps=0, autocast=torch.bfloat16)
            assert real.peak_bytes == plan.predicted_peak_bytes, fqn


def _rwkv():
    cfg = transformers.RwkvConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
                                  intermediate_size=128, context_length=128, use_cache=False)
    torch.manual_seed(0)
    model = transformers.RwkvForCausalLM(cfg)
    ids = torch.randint(0, 256, (8, 24))  # a Python loop over time: 24 steps of ~40 ops per layer
    return model, {"input_ids": ids, "labels": ids}


def test_saved_tensors_the_forward_already_dropped_are_not_counted_as_freed():
    """RWKV's attention (CPU path) loops over time; its last state update
    makes three [batch, hidden] tensors that autograd saves, and the forward
    drops them with the final state (no cache in training).  Checkpointing the
    module whole frees nothing of them, yet they were counted as discarded: the
    plan measured 3 x batch x hidden x 4 B over its prediction at the loss.  A
    selective plan that keeps them caches them until the replay: counted too.

    The same loop writes each step into a view (``output[:, t] = ...``).  Under
    the fake trace autograd rebuilt the written view's node by running the
    view op again, an op the real forward does not run: every call of a
    selective plan departed from it (warned, recomputed whole)."""
    model, inputs = _rwkv()
    loss_fn = lambda out: out.loss  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu")
    for ratio in (1.0, 0.5):
        plan = plan_from_decisions(stats, {"rwkv.blocks.0.attention": ratio, "rwkv.blocks.1.attention": ratio})
        assert all(d.ratio < 1 for d in plan.details.values()) == (ratio < 1)
        planned = autosac.apply(copy.deepcopy(model), plan)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            real = autosac.measure(planned, inputs, loss_fn=loss_fn, steps=0)
        assert not [w for w in said if str(w.message).startswith("autosac: module")], [str(w.message) for w in said]
        assert real.peak_bytes == plan.predicted_peak_bytes, ratio


def test_a_module_called_twice_back_to_back_replays_each_call_as_far_as_it_ran():
    """A call's last output and the next call's first input are saved at one
    position when the calls follow each other with no op between: told apart
    by position, the first call's replay was modelled as ending one saved
    tensor early (its ReLU/Tanh tail left out) and the plan under-predicted
    (by 267,200 B here; found by a review)."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(2048, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2048), torch.nn.Tanh())
    head = torch.nn.Linear(2048, 2048)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.head = block, head

        def forward(self, x):
            return self.head(self.block(self.block(x)))

    model, x = Twice(), torch.randn(256, 2048)
    loss_fn = lambda out: out.square().sum()  # noqa: E731
    stats = autosac.profile(model, x, loss_fn=loss_fn, target="cpu", optimizer="sgd")
    plan = plan_from_decisions(stats, {"block": 1.0})
    real = autosac.measure(autosac.apply(copy.deepcopy(model), plan), x, loss_fn=loss_fn, steps=0, optimizer="sgd")
    assert real.peak_bytes == plan.predicted_peak_bytes


def test_a_post_norm_layer_s_cached_output_is_counted_from_its_free():
    """A post-norm block (BERT) ends in a layer norm whose mean and inverse std
    are saved inside the block and whose output the next block saves: every
    checkpoint of the block keeps (caches) that op call, and its output stays
    alive to the block's replay.  The unmodified step frees that output just
    before, at the next block's backward: the cache adds it from there only.
    Counted from the block's forward end, each checkpointed layer was
    over-predicted by one hidden state (262,144 B here) and the least plan of
    four layers by 1 MiB."""
    cfg = transformers.BertConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(cfg)
    ids = torch.randint(0, 1024, (8, 128))
    inputs = {"input_ids": ids, "labels": ids}
    loss_fn = lambda out: out.loss  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu")
        for plan in (plan_from_decisions(stats, {"bert.encoder.layer.2": 1.0}), autosac.solve(stats, "least")):
            real = autosac.measure(autosac.apply(copy.deepcopy(model), plan), inputs, loss_fn=loss_fn, steps=0)
            assert real.peak_bytes == plan.predicted_peak_bytes, plan.decisions
    # these holds make the problem's chain DP a bound, not an answer; where its plan reaches the bound it
    # stands without the MILP, and the MILP finds no faster plan
    backends = set()
    for budget in ("50%", "60%", "70%", "80%", "90%"):
        plan, milp = solve_budget(stats, budget), solve_budget(stats, budget, presolve=False)
        backends.add(plan.solver["backend"])
        # the solvers' objective: each call at its own price (plans of equal objective may differ in
        # the gaps between their calls, which the plans' recompute_ms counts besides)
        own = [sum(d.recompute_ms for d in p.details.values()) for p in (plan, milp)]
        assert own[0] == pytest.approx(own[1], rel=1e-6)
        assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert "chain DP" in backends


class _WritesThroughViews(torch.nn.Module):
    """Scales part of a projection in place through a chain of views (as Funnel's attention does)."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.out = (torch.nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        h = self.mid(torch.tanh(self.inp(x))) + 1.0  # a tensor of its own, not a view
        h.view(8, 32, 4, 16).permute(0, 2, 1, 3)[..., :8].mul_(0.5)
        return self.out(h)


def test_a_write_through_a_chain_of_views_matches_its_trace():
    """Under the fake trace autograd re-makes a written view's node by running
    every view op from its base again (a tensor subclass has no
    ``as_strided``); the real step runs none of them.  Only the last of such a
    chain was left out of the trace: Funnel Transformer's selective plans
    departed from their trace at every call (a new-user trial)."""
    torch.manual_seed(0)
    model, x = _WritesThroughViews(), torch.randn(8, 32, 64)
    stats = autosac.profile(model, x, target="cpu")
    ops = stats.timeline.ops
    write = ops.index("mul_")
    assert ops[write - 3: write] == ["view", "permute", "slice"] and ops[write + 1] == "view"  # the Linear's own
    assert stats.timeline.modules[write + 1] == "out"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a departure from the trace warns
        planned = autosac.apply(copy.deepcopy(model), autosac.solve(stats, "least"))
        real = autosac.measure(planned, x, steps=0)
    assert real.peak_bytes <= autosac.solve(stats, "least").budget_bytes
