"""The MILP against exhaustive search, across backends and budgets."""

import itertools
import math

import pytest
import torch
from torch import nn

import autosac
from autosac.solver import least_peak, solve_stats
from autosac.solver.problem import build_problem


class Block(nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.drop = nn.Dropout(p)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(self.drop(self.act(self.up(x))))


def _stats(n_blocks=3, d=32, p=0.1, batch=64):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(d, p) for _ in range(n_blocks)], nn.LayerNorm(d))
    return autosac.profile(model, torch.randn(batch, d), optimizer="adamw", target="a100")


def _exhaustive(problem, budget):
    cands = problem.candidates
    best = (math.inf, None)
    options = [range(len(c.bytes) + 1) for c in cands]
    for combo in itertools.product(*options):
        choice = {i: k for i, k in enumerate(combo) if k}
        if any(a in choice for i in choice for a in cands[i].ancestors):
            continue  # nested checkpoints are not allowed
        if any(len({combo[i] for i in group}) > 1 for group in problem.linked):
            continue  # the calls of one module choose alike
        if problem.evaluate(choice) <= budget:
            ms = problem.objective_ms(choice)
            if ms < best[0]:
                best = (ms, choice)
    return best


@pytest.fixture(scope="module")
def small():
    stats = _stats()
    problem = build_problem(stats, max_choices=2)
    return stats, problem


def test_small_tree_is_small_enough_to_enumerate(small):
    _, problem = small
    assert 4 <= len(problem.candidates) <= 12
    assert math.prod(len(c.bytes) + 1 for c in problem.candidates) < 200_000


@pytest.mark.parametrize("presolve", [False, True])
@pytest.mark.parametrize("backend", ["cbc", "highs"])
@pytest.mark.parametrize("frac", [0.0, 0.2, 0.45, 0.7, 0.9])
def test_milp_equals_exhaustive_search(small, backend, frac, presolve):
    stats, problem = small
    low, _ = least_peak(problem, solver=backend)
    top = int(problem.live.max())
    budget = int(low + frac * (top - low))
    best_ms, _ = _exhaustive(problem, budget)
    plan = solve_stats(stats, budget, solver=backend, max_choices=2, problem=problem, presolve=presolve)
    assert (plan.solver.get("presolve") == "chain") == presolve
    assert plan.predicted_peak_bytes <= budget
    assert math.isclose(plan.recompute_ms, best_ms, rel_tol=1e-4, abs_tol=1e-9)
    assert plan.solver["status"] == "optimal" and plan.solver["gap"] <= 1e-4


@pytest.mark.parametrize("frac", [0.0, 0.3, 0.6, 0.95])
def test_chain_dp_equals_exhaustive_search(small, frac):
    from autosac.solver.chain import is_chain, solve_chain
    from autosac.solver.milp import milp_needs

    _, problem = small
    assert is_chain(problem)
    low, _ = least_peak(problem)
    budget = int(low + frac * (int(problem.live.max()) - low))
    best_ms, _ = _exhaustive(problem, budget)
    result = solve_chain(problem, budget, milp_needs(problem, budget))
    assert math.isclose(result.objective + problem.always_ms, best_ms, rel_tol=1e-9, abs_tol=1e-12)
    assert problem.evaluate(result.choice) <= budget
    assert solve_chain(problem, low - 1, milp_needs(problem, low - 1)) is None


def test_chain_dp_agrees_with_plain_milp_on_a_transformer():
    from autosac.models import build_model

    model, idx = build_model("seed-transformer", n_layer=6)
    stats = autosac.profile(model, idx)
    problem = build_problem(stats)
    for frac in (0.35, 0.5, 0.75):
        budget = int(stats.peak_bytes * frac)
        fast = solve_stats(stats, budget, problem=problem, solver="highs")
        plain = solve_stats(stats, budget, problem=problem, solver="highs", presolve=False)
        assert math.isclose(fast.recompute_ms, plain.recompute_ms, rel_tol=1e-4)
        assert fast.predicted_peak_bytes <= budget and plain.predicted_peak_bytes <= budget


def test_least_peak_equals_exhaustive_minimum(small):
    _, problem = small
    low, choice = least_peak(problem)
    cands = problem.candidates
    brute = min(
        problem.evaluate({i: k for i, k in enumerate(combo) if k})
        for combo in itertools.product(*[range(len(c.bytes) + 1) for c in cands])
        if not any(a in {i for i, k in enumerate(combo) if k} for i, k in enumerate(combo) if k for a in cands[i].ancestors)
    )
    assert low == brute == problem.evaluate(choice)


def test_backends_agree_and_recompute_never_rises_with_budget():
    stats = _stats(n_blocks=4, batch=128)
    problem = build_problem(stats)
    low, _ = least_peak(problem)
    top = int(problem.live.max())
    previous = math.inf
    for frac in [0.0, 0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 1.0]:
        budget = int(low + frac * (top - low))
        cbc = solve_stats(stats, budget, solver="cbc", problem=problem)
        highs = solve_stats(stats, budget, solver="highs", problem=problem)
        assert math.isclose(cbc.recompute_ms, highs.recompute_ms, rel_tol=2e-4, abs_tol=1e-9)
        for plan in (cbc, highs):
            assert plan.predicted_peak_bytes <= budget
        assert cbc.recompute_ms <= previous * (1 + 2e-4)
        previous = cbc.recompute_ms
    assert previous <= problem.always_ms + 1e-12  # at the unconstrained peak nothing is recomputed


def test_no_nested_decisions_and_ratios_in_range():
    stats = _stats(n_blocks=4, batch=128)
    problem = build_problem(stats)
    low, _ = least_peak(problem)
    for frac in (0.0, 0.3, 0.7):
        plan = solve_stats(stats, int(low + frac * (int(problem.live.max()) - low)), problem=problem)
        assert plan.decisions
        names = list(plan.decisions)
        for a in names:
            assert 0 < plan.decisions[a] <= 1
            for b in names:
                assert a == b or not (b.startswith(a + ".") or a == "")


def test_infeasible_budget_reports_the_least_feasible():
    stats = _stats()
    with pytest.raises(autosac.InfeasibleBudgetError) as info:
        autosac.solve(stats, 1000)
    err = info.value
    assert isinstance(err, ValueError)
    assert "is below the least reachable peak" in str(err)
    # the reported minimum is itself feasible, and one byte less is not
    plan = autosac.solve(stats, err.min_feasible_bytes)
    assert plan.predicted_peak_bytes <= err.min_feasible_bytes
    with pytest.raises(autosac.InfeasibleBudgetError):
        autosac.solve(stats, err.min_feasible_bytes - 1)


def test_budget_above_peak_needs_no_checkpointing():
    stats = _stats()
    plan = autosac.solve(stats, "100%")
    assert plan.decisions == {} and plan.recompute_ms == 0
    assert "no activation checkpointing needed" in str(plan)


def test_solve_profiles_a_model_directly_and_needs_inputs():
    model = nn.Sequential(*[Block(64, 0.0) for _ in range(6)])
    plan = autosac.solve(model, "70%", example_inputs=torch.randn(4096, 64))
    assert plan.decisions
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    with pytest.raises(ValueError, match="needs example_inputs"):
        autosac.solve(model, "90%")
    with pytest.raises(ValueError, match="unknown solver 'gurobi'"):
        autosac.solve(model, "90%", example_inputs=torch.randn(2, 8), solver="gurobi")


@pytest.mark.parametrize("backend", ["cbc", "highs"])
def test_time_limit_returns_a_feasible_plan_or_says_so(backend):
    from autosac.models import build_model

    model, idx = build_model("seed-transformer", n_layer=8)
    stats = autosac.profile(model, idx)
    try:
        plan = autosac.solve(stats, "45%", time_limit_s=0.01, solver=backend, presolve=False)
    except autosac.SolveTimeoutError as e:
        assert "raise the time limit" in str(e)
    else:
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        assert plan.solver["status"] in ("optimal", "time_limit", "time_limit_fallback")
        assert "solver" in str(plan)  # renders whatever the gap


def test_world_size_shards_params_grads_and_optimizer_state():
    from autosac.models import build_model

    model, idx = build_model("llama-tiny", n_layer=4, dim=256, n_head=4, n_kv_head=2, ffn_hidden=688, seq=64, vocab=4096)
    one = build_problem(autosac.profile(model, idx, world_size=1))
    eight = build_problem(autosac.profile(model, idx, world_size=8))
    stats = autosac.profile(model, idx)
    state = stats.param_bytes + stats.optimizer_bytes
    # Every rank keeps 1/8 of params and optimizer state; the root unit (every
    # param outside the blocks) is gathered whole from the first op on, beside
    # its shard, plus FSDP2's few bytes of per-unit bookkeeping.
    from autosac.solver.sharding import BOOKKEEPING_BYTES

    assert stats.timeline.modules[0] == ""
    root_unit = sum(p.bytes for p in stats.params.values() if not p.module.startswith("layers."))
    books = BOOKKEEPING_BYTES * (4 + 1)
    diff = int(one.live[0]) - int(eight.live[0])
    assert abs(diff - (state * 7 / 8 - root_unit - books)) <= 16
    # inside block 2's forward the root and that block are gathered
    t = stats.timeline.modules.index("layers.2.attention.wq")
    block = sum(p.bytes for p in stats.params.values() if p.module.startswith("layers.2."))
    diff = int(one.live[t]) - int(eight.live[t])
    assert abs(diff - (state * 7 / 8 - root_unit - block - books)) <= 16
    assert eight.live.max() < one.live.max()


def test_time_limit_with_presolve_returns_the_chain_optimum():
    from autosac.models import build_model

    model, idx = build_model("seed-transformer", n_layer=8)
    stats = autosac.profile(model, idx)
    full = autosac.solve(stats, "45%")
    rushed = autosac.solve(stats, "45%", time_limit_s=0.001, solver="highs")
    assert rushed.solver["status"] in ("optimal", "time_limit_presolve", "time_limit")
    assert rushed.predicted_peak_bytes <= rushed.budget_bytes
    assert math.isclose(rushed.recompute_ms, full.recompute_ms, rel_tol=1e-4)


class Shared(nn.Module):
    """One block applied three times beside two blocks applied once."""

    def __init__(self, d=32):
        super().__init__()
        self.first, self.shared, self.last = Block(d, 0.0), Block(d, 0.0), Block(d, 0.0)

    def forward(self, x):
        x = self.first(x)
        for _ in range(3):
            x = self.shared(x)
        return self.last(x)


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_linked_calls_of_a_shared_module_match_exhaustive_search(solver):
    torch.manual_seed(0)
    stats = autosac.profile(Shared(), torch.randn(256, 32), target="a100", optimizer="none")
    problem = build_problem(stats, max_choices=2)
    assert problem.linked and len(problem.linked[0]) == 3
    low, _ = least_peak(problem, solver=solver)
    high = int(problem.live.max())
    for frac in (0.0, 0.3, 0.7):
        budget = int(low + frac * (high - low))
        best_ms, _ = _exhaustive(problem, budget)
        plan = solve_stats(stats, budget, solver=solver, problem=problem, max_choices=2)
        assert plan.predicted_peak_bytes <= budget
        assert math.isclose(plan.recompute_ms, best_ms, rel_tol=1e-6, abs_tol=1e-9), (frac, plan.recompute_ms, best_ms)


class MaskedBlock(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.inner = Block(d, 0.0)

    def forward(self, x, mask):
        return self.inner(x) + mask  # add keeps nothing: only a checkpoint keeps the mask


class SharedMask(nn.Module):
    """A mask made once and passed to every block: every checkpoint keeps it."""

    def __init__(self, d=32, n=3):
        super().__init__()
        self.blocks = nn.ModuleList(MaskedBlock(d) for _ in range(n))

    def forward(self, x):
        mask = (x.detach().abs() > 0.1).to(x.dtype) * 2.0
        for b in self.blocks:
            x = b(x, mask)
        return x


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_an_input_every_checkpoint_keeps_counts_once_and_matches_exhaustive_search(solver):
    torch.manual_seed(0)
    stats = autosac.profile(SharedMask(), torch.randn(256, 32), target="a100", optimizer="none")
    problem = build_problem(stats, max_choices=2)
    mask_bytes = 256 * 32 * 4
    assert [s.bytes for s in problem.shared] == [mask_bytes]
    assert len(problem.shared[0].holders) >= 3
    # two checkpoints keeping the mask cost one mask, not two
    a, b = (i for i, c in enumerate(problem.candidates) if c.fqn in ("blocks.0", "blocks.1"))
    both = problem.evaluate({a: 1, b: 1})
    naive = problem.with_shared_held_by_each().evaluate({a: 1, b: 1})
    assert naive - both == mask_bytes
    low, _ = least_peak(problem, solver=solver)
    high = int(problem.live.max())
    for frac in (0.0, 0.2, 0.5, 0.8):
        budget = int(low + frac * (high - low))
        best_ms, _ = _exhaustive(problem, budget)
        for presolve in (True, False):
            plan = solve_stats(stats, budget, solver=solver, problem=problem, max_choices=2, presolve=presolve)
            assert plan.predicted_peak_bytes <= budget
            assert math.isclose(plan.recompute_ms, best_ms, rel_tol=1e-6, abs_tol=1e-9), (frac, presolve)


def test_an_infeasible_budget_below_the_optimizer_state_names_the_remedy():
    from autosac.models import build_model

    model, idx = build_model("llama-7b", device="meta", batch=1, seq=256, n_layer=4)  # 7B's layers, 4 of 32
    stats = autosac.profile(model, idx, optimizer="adamw")
    floor = stats.param_bytes + stats.grad_bytes + stats.optimizer_bytes
    with pytest.raises(autosac.InfeasibleBudgetError) as e:
        autosac.solve(stats, floor // 2)
    text = str(e.value)
    assert "optimizer step and cuBLAS's workspaces alone hold" in text and "world_size" in text and "lighter optimizer" in text
    assert e.value.min_feasible_bytes > floor
    # a budget above that floor and below the least peak: the rest is what no plan frees, said so
    # (a new user's ViT-MAE was told its optimizer step alone held less than the budget it asked)
    fixed = floor + stats.peak_breakdown["workspace"]
    between = (fixed + e.value.min_feasible_bytes) // 2
    with pytest.raises(autosac.InfeasibleBudgetError) as e2:
        autosac.solve(stats, between)
    rest = autosac.core.budget.format_bytes(e.value.min_feasible_bytes - fixed)
    assert f"workspaces hold {autosac.core.budget.format_bytes(fixed)} per rank" in str(e2.value)
    assert f"what no plan frees (activations, the step's inputs and output, temporaries) the other {rest}" \
        in str(e2.value)
    assert "alone" not in str(e2.value)
    # sharded over enough ranks, the same budget is a matter of checkpointing
    sharded = autosac.profile(model, idx, optimizer="adamw", world_size=64)
    assert autosac.solve(sharded, floor // 2).predicted_peak_bytes <= floor // 2


def _without_cbc(monkeypatch, pulp4: bool):
    """PuLP as a fresh install on Python >= 3.12 has it: PuLP 4 bundles no CBC
    (no PULP_CBC_CMD; COIN_CMD finds no binary) and has a new result API."""
    import pulp

    monkeypatch.delattr(pulp, "PULP_CBC_CMD")
    monkeypatch.setattr(pulp.COIN_CMD, "available", lambda self: False)
    if pulp4:
        monkeypatch.delattr(pulp, "LpSolutionOptimal")
        monkeypatch.setattr(pulp, "__version__", "4.2.0")


@pytest.fixture(scope="module")
def shared_mask():
    """A model the chain DP does not solve alone (a mask every checkpoint keeps): the MILP runs
    (without the chain presolve, whose plan reaches its bound here and would stand alone)."""
    torch.manual_seed(0)
    stats = autosac.profile(SharedMask(), torch.randn(256, 32), target="a100", optimizer="none")
    problem = build_problem(stats)
    low, _ = least_peak(problem, solver="highs")
    budget = int(low + 0.3 * (int(problem.live.max()) - low))
    cbc = autosac.solve(stats, budget, solver="cbc", presolve=False)
    assert cbc.solver["backend"] == "cbc" and cbc.solver["status"] == "optimal"
    assert autosac.solve(stats, budget).recompute_ms == pytest.approx(cbc.recompute_ms, rel=1e-6)
    return stats, budget, cbc


@pytest.mark.parametrize("pulp4", [False, True])
def test_without_cbc_the_default_solver_reaches_the_same_optimum_with_highs(shared_mask, monkeypatch, pulp4):
    """Issue 30 item 11: every MILP solve raised AttributeError: module 'pulp'
    has no attribute 'PULP_CBC_CMD'."""
    stats, budget, cbc = shared_mask
    _without_cbc(monkeypatch, pulp4)
    with pytest.warns(UserWarning, match=r"HiGHS \(SciPy\) in place of CBC.*pip install 'pulp>=3.3.1,<4'"
                      if pulp4 else r"HiGHS \(SciPy\) in place of CBC.*no CBC binary"):
        plan = autosac.solve(stats, budget, presolve=False)
    assert plan.solver["backend"] == "highs" and plan.solver["status"] == "optimal"
    assert plan.predicted_peak_bytes <= budget
    assert math.isclose(plan.recompute_ms, cbc.recompute_ms, rel_tol=1e-6, abs_tol=1e-9)
    with pytest.warns(UserWarning, match="in place of CBC"):  # the least-peak MILP too
        assert autosac.solve(stats, "least", presolve=False).solver["backend"] == "highs"


def test_an_explicit_cbc_without_cbc_is_one_line_naming_the_fix(shared_mask, monkeypatch):
    from autosac.core.errors import MissingExtraError

    stats, budget, _ = shared_mask
    _without_cbc(monkeypatch, pulp4=True)
    with pytest.raises(MissingExtraError, match=r"solver='cbc' cannot run: .*PuLP 4.2.0.*pip install 'pulp>=3.3.1,<4'"
                       r".*solver='highs'") as err:
        autosac.solve(stats, budget, solver="cbc", presolve=False)
    assert "\n" not in str(err.value)
    with pytest.raises(MissingExtraError, match="solver='cbc'"):  # before profiling: this input cannot be traced
        autosac.solve(nn.Linear(4, 4), "60%", torch.randn(2, 5), solver="cbc")


def test_an_infeasible_budget_names_the_cublas_workspaces_no_plan_lowers():
    """A small model on an H100: 66 MiB of its least peak is cuBLAS's
    workspaces (and cuBLASLt's, for its biased Linears), which the message
    names beside the optimizer state."""
    from autosac.models import build_model

    model, idx = build_model("gpt2", device="meta", batch=2, n_layer=2, dim=64, n_head=4, seq=64, vocab=128)
    stats = autosac.profile(model, idx, target="h100")
    with pytest.raises(autosac.InfeasibleBudgetError, match=r"cuBLAS's workspaces on the target 66(\.00)? MiB") as e:
        autosac.solve(stats, "50%")
    assert "\n" not in str(e.value)


def test_on_a_gpu_a_regions_machinery_hides_under_its_rerun():
    """On a CUDA target a choice costs the longer of its re-run and its
    checkpointing machinery (host work while the GPU runs queued kernels: the
    H100's measured overheads matched the re-run alone); on the CPU, their sum."""
    from dataclasses import replace

    from autosac.core.host import HostCosts
    from autosac.models import build_model
    from autosac.solver.problem import build_problem

    model, idx = build_model("gpt2", device="meta", batch=2, n_layer=2, dim=128, n_head=4, seq=128, vocab=256)
    host = HostCosts(op_us=8.0, checkpoint_call_us=300.0, saved_tensor_us=20.0, selective_op_us=15.0)
    stats = autosac.profile(model, idx, target=replace(autosac.core.devices.DEVICES["h100"], host=host))
    gpu = build_problem(stats)
    cpu = build_problem(replace(stats, target={**stats.target, "device_type": "cpu"}))
    hidden = 0
    for g, c in zip(gpu.candidates, cpu.candidates, strict=True):
        for k in range(len(c.ms)):
            rerun, machinery = c.ms[k] - c.mechanism[k], c.mechanism[k]
            assert g.ms[k] == pytest.approx(max(rerun, machinery), rel=1e-9, abs=1e-12)
            assert g.mechanism[k] == pytest.approx(max(0.0, machinery - rerun), rel=1e-9, abs=1e-12)
            hidden += machinery > 0 and g.mechanism[k] < machinery
    assert hidden  # some machinery was hidden


def test_a_module_that_is_no_candidate_is_refused_naming_why():
    # a tiny block frees less than its checkpoint would hold (CPU checkpoints stash the RNG state, 5 KB)
    from suite import A100_CPU_KERNELS

    from autosac.solver import plan_from_decisions

    def block(d):
        return nn.Sequential(nn.Linear(d, 2 * d), nn.LeakyReLU(0.2), nn.Linear(2 * d, d), nn.Tanh())

    torch.manual_seed(0)
    model, x = nn.Sequential(block(16), block(16), nn.Linear(16, 1)), torch.randn(8, 16)
    stats = autosac.profile(model, x, target=A100_CPU_KERNELS)
    hold = stats.checkpoint_state_bytes
    assert hold > 2048
    for fqn, why in (("0", f"its 2048 discardable bytes are no more than the {hold} its checkpoint would hold"),
                     ("0.1", "no discardable activations"), ("nope", "the model has no such module")):
        with pytest.raises(ValueError, match=rf"module '{fqn}' is not a checkpointing candidate \({why}"):
            plan_from_decisions(stats, {fqn: 1.0})
