"""Mixture-of-experts models: traced for a stated routing, checkpointed whole,
bitwise unchanged, and within budget for the routing the plan assumed.

transformers' Mixtral and Qwen3-MoE (both experts implementations: the
default grouped matmul and the eager per-expert loop) and a hand-written top-2
MoE with a capacity limit and router jitter.  Each at 70 %, 50 % and the least
feasible budget: one training step bitwise equal to the unmodified model's
(real, data-dependent routing), and the measured peak -- with the step forced
to route as the plan assumed (:func:`autosac.trace.routing.forced`) -- within
the budget and within 3 % of the prediction.  With the routing random weights
really take, a plan made for the capacity factor measured on that step keeps
its budget.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from suite import assert_same_step, check_model, hf_loss, lm_inputs, seeded
from torch import nn

import autosac
from autosac.trace.routing import BALANCED, ObservedRouting, RouterCall, Routing, observe, parse_routing, routed_indices

# ------------------------------------------------------------ the routing itself


@pytest.mark.parametrize("rows,k,n", [(16, 2, 4), (30, 2, 8), (7, 3, 5), (64, 1, 8), (9, 4, 4)])
@pytest.mark.parametrize("routing", ["balanced", 1.25, 2.0, "worst"])
def test_routed_indices_give_each_expert_its_load_and_each_token_distinct_experts(rows, k, n, routing):
    r = parse_routing(routing)
    idx = routed_indices((rows, k), -1, n, r)
    assert idx.shape == (rows, k) and idx.dtype == torch.int64
    assert all(len(set(row.tolist())) == k for row in idx), "a token picked one expert twice"
    loads = torch.bincount(idx.reshape(-1), minlength=n).tolist()
    assert loads == r.loads(rows, k, n) and sum(loads) == rows * k
    balanced = rows * k / n
    if r.kind == "balanced":
        assert max(loads) - min(loads) <= 1
    elif r.kind == "worst":
        assert sorted(loads, reverse=True)[:k] == [rows] * k  # every token on the first top_k experts
    else:
        assert max(loads) == min(rows, max(math.ceil(balanced), math.ceil(r.capacity_factor * balanced - 1e-9)))


def test_routed_indices_along_another_dim_and_for_argmax_shapes():
    idx = routed_indices((4, 6, 2), 1, 6, BALANCED)  # picks along dim 1: 6 of 6 per (row, col)
    assert sorted(idx[0, :, 0].tolist()) == list(range(6))
    one = routed_indices((12, 1), -1, 4, BALANCED)
    assert torch.bincount(one.reshape(-1), minlength=4).tolist() == [3, 3, 3, 3]


@pytest.mark.parametrize("bad", ["even", 0.5, -1, True, float("inf"), "1.x", [1.5]])
def test_a_malformed_routing_is_one_clear_error(bad):
    with pytest.raises(ValueError, match="routing must be 'balanced', 'worst' or a capacity factor"):
        parse_routing(bad)


def test_routing_parses_its_forms():
    assert parse_routing("balanced") == BALANCED == parse_routing(1) == parse_routing("1.0")
    assert parse_routing("worst").kind == "worst" and math.isinf(parse_routing("worst").capacity_factor)
    assert parse_routing("1.25") == Routing("capacity", 1.25) == parse_routing(1.25)


# --------------------------------------------------------------- the models


class Top2MoE(nn.Module):
    """GShard-style top-2 experts with a capacity limit: assignments beyond
    an expert's capacity are dropped; a dispatch buffer of (experts,
    capacity, d) is filled by index, the experts run as batched matmuls, the
    results are combined back with the routing weights.  Multiplicative
    router jitter in training draws from the RNG."""

    def __init__(self, d: int, hidden: int, experts: int, capacity_factor: float = 1.25, jitter: float = 0.05):
        super().__init__()
        self.experts, self.capacity_factor, self.jitter = experts, capacity_factor, jitter
        self.gate = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d, hidden) / d**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, d) / hidden**0.5)

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        n = tokens.shape[0]
        logits = self.gate(tokens)
        if self.training and self.jitter:
            logits = logits * torch.empty_like(logits).uniform_(1 - self.jitter, 1 + self.jitter)
        weights, idx = F.softmax(logits, dim=-1).topk(2, dim=-1)  # (n, 2)
        capacity = math.ceil(n * 2 / self.experts * self.capacity_factor)
        onehot = F.one_hot(idx, self.experts).permute(1, 0, 2).reshape(2 * n, self.experts)  # first picks first
        position = (torch.cumsum(onehot, dim=0) - 1) * onehot
        kept = (onehot > 0) & (position < capacity)
        assignment, expert = kept.nonzero(as_tuple=True)
        slot = position[assignment, expert]
        token = assignment % n
        dispatch = tokens.new_zeros(self.experts, capacity, shape[-1])
        dispatch = dispatch.index_put((expert, slot), tokens[token])
        h = F.gelu(torch.bmm(dispatch, self.w_in))
        out = torch.bmm(h, self.w_out)
        gathered = out[expert, slot] * weights.t().reshape(-1)[assignment].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, token, gathered).reshape(shape)


class SortedSplitMoE(nn.Module):
    """Token dispatch as DeepSeek-V3-style code writes it: tokens sorted by
    expert (``argsort``), per-expert counts read into Python
    (``bincount().tolist()``), ``split`` into groups, a Python loop that skips
    empty experts, ``unique`` for the experts hit, and a boolean mask for the
    tokens of the first expert -- every size and branch a number of the data."""

    def __init__(self, d: int, hidden: int, experts: int, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden), nn.SiLU(), nn.Linear(hidden, d)) for _ in range(experts))

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, idx = F.softmax(self.gate(tokens), dim=-1).topk(self.top_k, dim=-1)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        hit = set(torch.unique(flat).tolist())
        first = torch.masked_select(flat, flat == 0).numel()  # tokens of expert 0, by a mask
        assert first == counts[0]
        groups = tokens[order // self.top_k].split(counts)
        outs = []
        for e, (group, n) in enumerate(zip(groups, counts)):
            if n == 0:
                assert e not in hit
                continue
            outs.append(self.experts[e](group))
        out = torch.cat(outs)
        out = out * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, order // self.top_k, out).reshape(shape)


class MoEBlock(nn.Module):
    def __init__(self, d: int, experts: int, moe: str = "top2"):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.moe = Top2MoE(d, 2 * d, experts) if moe == "top2" else SortedSplitMoE(d, 2 * d, experts)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class TinyMoELM(nn.Module):
    def __init__(self, vocab: int = 128, d: int = 64, layers: int = 3, experts: int = 8, moe: str = "top2"):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MoEBlock(d, experts, moe) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _top2():
    return TinyMoELM(layers=4).train(), torch.randint(0, 128, (8, 128))


def _sorted_split():
    return TinyMoELM(layers=4, moe="sorted-split").train(), torch.randint(0, 128, (8, 128))


def _mixtral(impl: str, jitter: float = 0.0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
        router_jitter_noise=jitter, use_cache=False)
    cfg._experts_implementation = impl
    return lambda: (transformers.MixtralForCausalLM(cfg).train(), lm_inputs(128, 8, 64))


def _qwen3_moe(impl: str):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128, use_cache=False)
    cfg._experts_implementation = impl
    return lambda: (transformers.Qwen3MoeForCausalLM(cfg).train(), lm_inputs(128, 8, 64))


def _token_loss(out):
    return out.float().pow(2).mean()


MOE = {
    "mixtral-grouped_mm": (_mixtral("grouped_mm"), hf_loss),
    "mixtral-eager-jitter": (_mixtral("eager", jitter=0.1), hf_loss),
    "qwen3_moe-grouped_mm": (_qwen3_moe("grouped_mm"), hf_loss),
    "qwen3_moe-eager": (_qwen3_moe("eager"), hf_loss),
    "top2-capacity": (_top2, _token_loss),
    "sorted-split": (_sorted_split, _token_loss),
}


@pytest.mark.parametrize("name", list(MOE))
def test_moe_model_plans_bitwise_and_within_budget_for_its_routing(name):
    make, loss_fn = MOE[name]
    rows = check_model(name, seeded(make), loss_fn=loss_fn, routing="balanced")
    assert [r.budget for r in rows if r.bitwise] == ["70%", "50%", "least"], rows


def _observed(model, inputs, stats) -> ObservedRouting:
    args, kwargs = (inputs,), {}
    if isinstance(inputs, dict):
        args, kwargs = (), inputs
    with torch.no_grad(), observe([RouterCall(**c) for c in stats.routing["routers"]]) as seen:
        model(*args, **kwargs)
    return seen


@pytest.mark.parametrize("name", ["mixtral-grouped_mm", "qwen3_moe-grouped_mm"])
def test_grouped_experts_read_no_routing_values_and_plan_without_an_assumption(name):
    """The default experts path sizes everything by ``tokens * top_k``: no value
    of the routing is read, so none is assumed, and the plan (per-op choices
    allowed) holds for whatever routing the data takes."""
    make, loss_fn = MOE[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model, inputs = seeded(make)()
        stats = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu", optimizer="sgd")
    assert stats.routing == {} and not any(m.routed for m in stats.modules.values())
    rows = check_model(name, seeded(make), loss_fn=loss_fn, labels=("70%", "least"))
    assert [r.budget for r in rows if r.bitwise] == ["70%", "least"], rows


@pytest.mark.parametrize("name", ["top2-capacity", "mixtral-eager-jitter"])
def test_real_routing_keeps_a_budget_planned_for_the_capacity_factor_it_measures(name):
    make, loss_fn = MOE[name]
    build = seeded(make)
    model, inputs = build()
    balanced = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu", optimizer="sgd", routing="balanced")
    seen = _observed(copy.deepcopy(model).eval(), inputs, balanced)
    assert len(seen.factors) == len(balanced.routing["routers"])
    assert seen.capacity_factor > 1.0  # random weights route unevenly
    factor = math.ceil(seen.capacity_factor * 100) / 100
    stats = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu", optimizer="sgd", routing=factor)
    assert stats.routing["assumption"] == {"kind": "capacity", "capacity_factor": factor}
    for budget in ("70%", "least"):
        plan = autosac.solve(stats, budget)
        fresh, inputs = build()
        autosac.apply(fresh, plan)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            measured = autosac.measure(fresh, inputs, loss_fn=loss_fn, steps=0, optimizer="sgd").peak_bytes
        assert measured <= plan.budget_bytes, (budget, measured, plan.budget_bytes)


def test_worst_routing_plans_for_every_token_on_top_k_experts():
    make, loss_fn = MOE["top2-capacity"]
    model, inputs = seeded(make)()
    worst = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu", optimizer="sgd", routing="worst")
    routers = worst.routing["routers"]
    assert len(routers) == 4 and all(c["top_k"] == 2 and c["experts"] == 8 and c["tokens"] == 1024 for c in routers)
    # capacity-limited: worst routing drops tokens, so the step holds no more than balanced's
    balanced = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu", optimizer="sgd", routing="balanced")
    assert worst.peak_bytes <= balanced.peak_bytes


def test_routed_modules_are_checkpointed_only_whole_and_plainly():
    make, loss_fn = MOE["mixtral-eager-jitter"]
    model, inputs = seeded(make)()
    stats = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu", optimizer="sgd", routing="balanced")
    routed = {f for f, m in stats.modules.items() if m.routed}
    assert "model.layers.0.mlp.experts" in routed and "model.layers.0.mlp.gate" in routed
    assert "model.layers.0.self_attn" not in routed
    for budget in ("90%", "70%", "least"):
        plan = autosac.solve(stats, budget)
        for fqn, d in plan.details.items():
            if fqn in routed:
                assert d.ratio == 1.0 and not d.save, (budget, fqn, d.ratio)


def test_the_plan_records_shows_and_keeps_its_routing(tmp_path):
    make, loss_fn = MOE["qwen3_moe-grouped_mm"]
    model, inputs = seeded(make)()
    plan = autosac.solve(model, "70%", inputs, loss_fn=loss_fn, target="cpu", optimizer="sgd", routing=1.5)
    assert plan.routing["assumption"] == {"kind": "capacity", "capacity_factor": 1.5}
    assert [(c["module"], c["top_k"], c["experts"], c["tokens"]) for c in plan.routing["routers"]] == [
        (f"model.layers.{i}.mlp.gate", 2, 8, 512) for i in range(4)]
    assert "MoE routing      capacity factor 1.5, assumed at 4 routing decisions (2 of 8 experts per token, " \
           "512 tokens)" in str(plan)
    plan.save(tmp_path / "p.json")
    assert autosac.Plan.load(tmp_path / "p.json").routing == plan.routing


def test_a_model_without_routing_records_none():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    stats = autosac.profile(model, torch.randn(4, 8), target="cpu")
    assert stats.routing == {} and not any(m.routed for m in stats.modules.values())


class _MaxPooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.proj(x).max(dim=1).values)  # a max over a dim whose indices nothing reads


def test_picks_whose_values_nothing_reads_are_not_routing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no routing warning either
        stats = autosac.profile(_MaxPooled(), torch.randn(4, 8, 16), target="cpu")
    assert stats.routing == {} and not any(m.routed for m in stats.modules.values())
    assert "MoE routing" not in str(autosac.solve(stats, "least"))


class _KeepsClassZero(nn.Module):
    """Not an MoE: keeps the tokens whose predicted class is 0 -- a number of the data."""

    def __init__(self):
        super().__init__()
        self.cls, self.big = nn.Linear(32, 4), nn.Linear(32, 64)

    def forward(self, x):
        keep = torch.nonzero(self.cls(x).argmax(-1) == 0).squeeze(-1)
        return self.big(x[keep]).sum() + self.cls(x).sum()


def test_values_read_from_picks_are_planned_for_balanced_picks_and_said_so():
    with pytest.warns(UserWarning, match=r"autosac: the forward reads values picked by argmax from activations "
                                         r"\(1 picks, in \(root\)\): planned for balanced picks"):
        stats = autosac.profile(_KeepsClassZero(), torch.randn(64, 32), target="cpu")
    assert stats.routing["assumption"] == {"kind": "balanced", "capacity_factor": 1.0}
    assert [(c["op"], c["tokens"], c["top_k"], c["experts"]) for c in stats.routing["routers"]] == [("argmax", 64, 1, 4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stated: no warning
        stated = autosac.profile(_KeepsClassZero(), torch.randn(64, 32), target="cpu", routing="worst")
    assert stated.peak_bytes > stats.peak_bytes  # every token of class 0: the big layer sees all 64


def test_a_huge_pick_is_not_laid_out_for_real():
    class SortsLogits(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            logits = self.lin(x).repeat(1, 1, 1 << 17)  # 2 x 16 x 2**20 scores
            return logits.sort(dim=-1).values[..., :4].sum()

    stats = autosac.profile(SortsLogits(), torch.randn(2, 16, 8), target="cpu", routing="balanced")
    assert stats.routing == {}  # 2**25 picks: left fake, as nothing reads them


def test_verify_reports_a_busier_routing_than_planned_and_the_assumption_that_covers_it():
    from autosac.tools.verify import routing_report

    plan = autosac.Plan.__new__(autosac.Plan)
    plan.routing = {"assumption": {"kind": "balanced", "capacity_factor": 1.0},
                    "routers": [{"op": "topk", "module": "m.gate", "tokens": 256, "top_k": 2, "experts": 8}] * 2}
    text = routing_report(plan, ObservedRouting([1.3, 1.612]), kept=False)
    assert "the busiest expert got 1.61x its balanced share" in text
    assert "re-plan with --routing 1.62" in text
    assert "re-plan" not in routing_report(plan, ObservedRouting([1.3, 1.612]), kept=True)


def test_the_default_experts_path_traces_float32_grouped_matmuls():
    """transformers' default MoE path runs torch's grouped matmul, whose fake
    kernel refuses float32 that the CPU kernel runs: the trace follows the real
    kernel (the predicted peak is checked against measurement above)."""
    make, loss_fn = MOE["mixtral-grouped_mm"]
    model, inputs = seeded(make)()
    stats = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu", optimizer="sgd")
    assert "_grouped_mm" in stats.timeline.ops
    assert "_grouped_mm" not in stats.unknown_flop_ops


def test_a_value_branch_outside_routing_still_names_the_module():
    class Thresholded(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return h[h > 0].sum()  # a boolean mask of activations: its size is data

    with pytest.raises(autosac.TraceError, match=r"forward of module '\(root\)' \(Thresholded\) branches on tensor "
                                                 r"values"):
        autosac.profile(Thresholded(), torch.randn(4, 8), target="cpu")


def test_steps_stay_bitwise_when_the_jitter_draws_from_the_rng_in_the_recompute():
    make, loss_fn = MOE["top2-capacity"]
    build = seeded(make)
    model, inputs = build()
    stats = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu", optimizer="sgd", routing="balanced")
    plan = autosac.solve(stats, "least")
    assert any(".moe" in f or f.startswith("blocks.") for f in plan.decisions)
    ref, _ = build()
    work, _ = build()
    autosac.apply(work, plan)
    assert_same_step(ref, work, inputs, loss_fn)


def test_a_plan_for_worst_routing_holds_when_the_step_routes_so():
    """Worst routing leaves experts without tokens (the dispatch's ``if n == 0``
    branch): the trace takes that branch, and the measured peak of a step forced
    to route so is the predicted one.  No optimizer: in training every expert
    has optimizer state from the steps that did route to it, which a measurement
    whose every step is forced to the worst routing would not build."""
    make, loss_fn = MOE["sorted-split"]
    rows = check_model("sorted-split-worst", seeded(make), loss_fn=loss_fn, routing="worst", labels=("70%", "least"),
                       optimizer="none")
    assert [r.budget for r in rows if r.bitwise] == ["70%", "least"], rows


class _MaskDispatch(nn.Module):
    """Top-1 routing dispatched by boolean masks: ``out[mask] = expert(x[mask])``."""

    def __init__(self, d: int = 32, experts: int = 4):
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                     for _ in range(experts))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        pick = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            mask = pick == i
            out[mask] = expert(x[mask])
        return self.head(out + x).pow(2).mean()


def test_boolean_mask_dispatch_is_sized_by_the_routing():
    build = seeded(lambda: (_MaskDispatch(), torch.randn(512, 32)))
    stats = autosac.profile(*build(), target="cpu", routing="balanced")
    assert [(c["op"], c["top_k"], c["experts"]) for c in stats.routing["routers"]] == [("argmax", 1, 4)]
    rows = check_model("mask-dispatch", build, routing="balanced", labels=("70%", "least"))
    assert [r.budget for r in rows if r.bitwise] == ["70%", "least"], rows


def test_the_blocks_of_a_mixture_of_experts_are_its_layers_not_one_layers_experts():
    import torch
    from torch import nn

    from autosac.tools.sweep import repeated_blocks

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(Expert() for _ in range(4))

        def forward(self, x):
            return x + sum(e(x) for e in self.experts)

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    stats = autosac.profile(MoE(), torch.randn(64, 32), target="cpu")
    assert repeated_blocks(stats) == ["layers.0", "layers.1"]
