"""Stage 2 of the pipeline: ModelStats + budget -> Plan, by an exact MILP."""

from __future__ import annotations

import math

from autosac.budget import format_bytes, parse_budget
from autosac.errors import InfeasibleBudgetError, SolveTimeoutError
from autosac.plan import Decision, Plan, RecomputeOp
from autosac.solver.backends import BACKENDS, Solution
from autosac.solver.chain import NotAChain, solve_chain
from autosac.solver.milp import build_milp, decode, encode, milp_needs, with_objective_bound
from autosac.solver.problem import Problem, build_problem
from autosac.solver.replay import ModuleReplay, saved_inside
from autosac.stats import ModelStats

__all__ = ["solve", "solve_stats", "least_peak", "plan_from_decisions"]


def solve(
    model_or_stats,
    budget: str | int | float,
    example_inputs=None,
    *,
    loss_fn=None,
    optimizer="adamw",
    target="h100",
    world_size: int = 1,
    solver: str = "cbc",
    time_limit_s: float = 60,
    reserve: str | int | float = 0,
    max_choices: int = 16,
    presolve: bool = True,
) -> Plan:
    """Pick which modules to checkpoint, and how much of each one's activations
    to discard, so the step's peak fits ``budget`` with the least recompute time.

    Args:
        model_or_stats: an ``nn.Module`` (profiled here with ``example_inputs``,
            ``loss_fn``, ``optimizer``, ``target``, ``world_size``) or a
            :class:`ModelStats` from :func:`autosac.profile` (profile once, solve many).
        budget: ``"8GiB"``, ``"500MB"``, ``"60%"`` of the unconstrained peak,
            an ``int`` of bytes or a ``float`` of GiB.
        solver: ``"cbc"`` (PuLP) or ``"highs"`` (SciPy); both reach the same optimum.
        time_limit_s: on hitting it the best feasible plan found is returned,
            flagged ``plan.solver["status"] == "time_limit"``.
        reserve: headroom kept free for allocator overheads, same forms as ``budget``
            (no percentages); subtracted from the budget.
        max_choices: discard choices offered per module (breakpoints of its curve).
        presolve: when module intervals nest (sequential models), solve exactly by
            the chain DP first and hand its optimum to the MILP as bound and start.

    Returns:
        Plan: decisions {fqn: discard ratio}, the ops each recomputes, predicted peak.

    Raises:
        InfeasibleBudgetError: no plan reaches the budget; ``.min_feasible_bytes`` says what does.
        SolveTimeoutError: the solver found no plan at all within ``time_limit_s``.
        ValueError: a malformed budget, an unknown solver, or a model without example_inputs.

    Example::

        >>> plan = autosac.solve(model, "60%", example_inputs=idx, target="h100")
        >>> plan.decisions
        {'blocks.0': 1.0, 'blocks.1.attn': 0.73, ...}
    """
    if solver not in BACKENDS:
        raise ValueError(f"unknown solver {solver!r}: use one of {', '.join(BACKENDS)}")
    if isinstance(model_or_stats, ModelStats):
        stats = model_or_stats
    elif not hasattr(model_or_stats, "named_modules"):
        raise TypeError(f"solve needs an nn.Module or a ModelStats, got {type(model_or_stats).__name__}")
    else:
        if example_inputs is None:
            raise ValueError("solve(model, ...) needs example_inputs= to profile the model (or pass a ModelStats)")
        from autosac.trace import profile

        stats = profile(model_or_stats, example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                        target=target, world_size=world_size)
    problem = build_problem(stats, max_choices)
    budget_bytes = parse_budget(budget, problem.baseline_peak)
    if reserve:
        if isinstance(reserve, str) and reserve.strip().endswith("%"):
            raise ValueError("reserve must be an absolute size like '2GiB', not a percentage")
        budget_bytes -= parse_budget(reserve, problem.baseline_peak)
        if budget_bytes <= 0:
            raise ValueError("reserve is not smaller than the budget: nothing left to plan for")
    return solve_stats(stats, budget_bytes, solver=solver, time_limit_s=time_limit_s, max_choices=max_choices,
                       presolve=presolve, problem=problem)


def solve_stats(
    stats: ModelStats, budget_bytes: int, *, solver: str = "cbc", time_limit_s: float = 60,
    max_choices: int = 16, problem: Problem | None = None, presolve: bool = True,
) -> Plan:
    """:func:`solve` for a budget already in bytes (``problem`` may be reused across budgets)."""
    problem = problem or build_problem(stats, max_choices)
    if int(problem.live.max(initial=0)) <= budget_bytes:
        return _make_plan(stats, problem, {}, budget_bytes, _trivial(solver))
    milp = build_milp(problem, budget_bytes)
    start = chain = None
    if presolve:
        # Nested intervals: the exact chain DP gives the optimum; the MILP gets it
        # as a proven lower bound and (CBC) as its starting solution.
        try:
            chain = solve_chain(problem, budget_bytes, milp_needs(problem, budget_bytes))
        except NotAChain:
            pass
        else:
            if chain is None:
                milp = None
            else:
                milp = with_objective_bound(milp, chain.objective * (1 - 1e-9) - 1e-9)
                start = encode(milp, chain.choice)
    sol = BACKENDS[solver](milp, time_limit_s, start) if milp is not None else Solution(
        None, "infeasible", math.inf, math.nan, math.inf, 0.0, solver)
    if sol.x is None and chain is not None:
        # The MILP ran out of time before confirming it: the chain optimum stands, flagged.
        info = {**_info(sol), "status": "time_limit_presolve", "objective": chain.objective, "presolve": "chain"}
        return _make_plan(stats, problem, chain.choice, budget_bytes, info)
    if sol.x is None:
        # No plan of its own: either the budget is below the least peak, or the
        # time limit hit first.  The least-peak problem settles it (and, within
        # budget, is a plan to fall back on); it gets some time of its own.
        least = least_peak(problem, solver=solver, time_limit_s=time_limit_s)
        if least is None:
            raise SolveTimeoutError(
                f"the {solver} solver found no plan within time_limit_s={time_limit_s:g}: raise the time limit"
            )
        best_peak, best_choice = least
        if best_peak > budget_bytes:
            raise InfeasibleBudgetError(
                f"budget {format_bytes(budget_bytes)} is below the least reachable peak "
                f"{format_bytes(best_peak)}: raise the budget to at least that",
                min_feasible_bytes=best_peak,
            )
        return _make_plan(stats, problem, best_choice, budget_bytes, {**_info(sol), "status": "time_limit_fallback"})
    choice = decode(milp, sol.x)
    info = _info(sol)
    info["presolve"] = "chain" if start is not None else None
    return _make_plan(stats, problem, choice, budget_bytes, info)


def plan_from_decisions(
    stats: ModelStats, decisions: dict[str, float], budget_bytes: int | None = None, *, max_choices: int = 16
) -> Plan:
    """A Plan for discard ratios chosen elsewhere (by hand, or by another planner).

    Each ratio is rounded up to the next discard choice the module offers, so the
    plan discards at least that share of the module's discardable activations;
    its predicted peak and recompute time come from the same model as solved plans.

    Raises:
        ValueError: a module that is not a checkpointing candidate, a ratio outside
            (0, 1], or nested decisions.

    Example::

        >>> plan = plan_from_decisions(stats, {"blocks.0": 1.0, "blocks.1.attn": 0.5})
    """
    problem = build_problem(stats, max_choices)
    index = {c.fqn: i for i, c in enumerate(problem.candidates)}
    choice = {}
    for fqn, ratio in decisions.items():
        if fqn not in index:
            raise ValueError(f"module {fqn!r} is not a checkpointing candidate (called once, with discardable activations)")
        if not 0 < ratio <= 1:
            raise ValueError(f"discard ratio {ratio!r} of {fqn!r} is not in (0, 1]")
        cand = problem.candidates[index[fqn]]
        want = ratio * cand.discardable_bytes
        k = next((k for k, b in enumerate(cand.discarded, start=1) if b >= want - 1e-9), len(cand.discarded))
        choice[index[fqn]] = k
    for i in choice:
        if any(a in choice for a in problem.candidates[i].ancestors):
            raise ValueError(f"{problem.candidates[i].fqn!r} is nested inside another checkpointed module")
    info = {"backend": "given", "status": "given", "gap": None, "seconds": 0.0, "objective": None, "bound": None}
    budget = budget_bytes if budget_bytes is not None else problem.evaluate(choice)
    return _make_plan(stats, problem, choice, budget, info)


def least_peak(
    problem: Problem, *, solver: str = "cbc", time_limit_s: float = 60
) -> tuple[int, dict[int, int]] | None:
    """The least peak any plan reaches and a plan that reaches it (candidate ->
    choice), or ``None`` when the solver found no plan in time.

    Example::

        >>> peak, choice = least_peak(build_problem(stats))
    """
    milp = build_milp(problem, None)
    sol = BACKENDS[solver](milp, time_limit_s)
    if sol.x is None:
        return None
    choice = decode(milp, sol.x)
    return problem.evaluate(choice), choice


def _trivial(backend: str) -> dict:
    return {"backend": backend, "status": "optimal", "gap": 0.0, "seconds": 0.0, "objective": 0.0, "bound": 0.0}


def _finite(x: float) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _info(sol: Solution) -> dict:
    return {
        "backend": sol.backend, "status": sol.status, "gap": _finite(sol.gap),
        "seconds": sol.seconds, "objective": _finite(sol.objective), "bound": _finite(sol.bound),
    }


def _make_plan(stats: ModelStats, problem: Problem, choice: dict[int, int], budget_bytes: int, info: dict) -> Plan:
    tl = stats.timeline
    details: dict[str, Decision] = {}
    saved_events = {op.event: op for op in stats.saved_ops}
    for i, k in sorted(choice.items()):
        cand = problem.candidates[i]
        window = stats.modules[cand.fqn].fw_windows[0]
        occ = _occurrences(tl.ops, window)
        ops = []
        chosen = set()
        for item in cand.items[: cand.n_items[k - 1]]:
            for op_id in item:
                op = stats.saved_ops[op_id]
                chosen.add(op.event)
                ops.append(RecomputeOp(
                    op=op.op, occurrence=occ[op.event], bytes=op.bytes, ms=op.ms, random=op.random,
                    writers=[[tl.ops[w], occ[w]] for w in op.writer_events],
                ))
        ops.sort(key=lambda o: (o.op, o.occurrence))
        # every other op with an output saved inside the module is kept (with its
        # in-place writers); one saved only outside is re-run, since caching it
        # would hold it past its consumers' backward
        save = []
        for e in range(window[0], window[1]):
            op = saved_events.get(e)
            if op is not None and e not in chosen and not op.param_cast and saved_inside(op.savers, cand.fqn):
                save += [[tl.ops[x], occ[x]] for x in (e, *op.writer_events) if x < window[1]]
        counts: dict[str, int] = {}
        for e in range(window[0], window[1]):
            counts[tl.ops[e]] = counts.get(tl.ops[e], 0) + 1
        replay = ModuleReplay.of(stats, cand.fqn)
        discarded = replay.events(i for item in cand.items[: cand.n_items[k - 1]] for i in item)
        skip = [[tl.ops[e], occ[e]] for e in replay.dead(discarded, tl.ops)]
        details[cand.fqn] = Decision(
            fqn=cand.fqn, ratio=min(1.0, cand.discarded[k - 1] / cand.discardable_bytes),
            discard_bytes=cand.discarded[k - 1], discardable_bytes=cand.discardable_bytes,
            recompute_ms=cand.ms[k - 1], ops=ops, save_ops=save, skip_ops=skip, op_counts=counts,
        )
    peak = problem.evaluate(choice)
    recompute = problem.recompute_ms(choice)
    from autosac import __version__

    return Plan(
        model=stats.model, fingerprint=stats.fingerprint, target=stats.target.get("name", "?"),
        world_size=stats.world_size, optimizer=stats.optimizer, budget_bytes=int(budget_bytes),
        baseline_peak_bytes=problem.baseline_peak, predicted_peak_bytes=peak, recompute_ms=recompute,
        baseline_step_ms=stats.step_ms, step_ms=stats.step_ms + recompute,
        decisions={f: d.ratio for f, d in details.items()}, details=details, solver=info,
        versions={"autosac": __version__, **{k: v for k, v in stats.versions.items() if k != "autosac"}},
    )


def _occurrences(ops: list[str], window: list[int]) -> dict[int, int]:
    """Event index -> how many earlier calls of the same op the window holds."""
    seen: dict[str, int] = {}
    out = {}
    for e in range(window[0], window[1]):
        out[e] = seen.get(ops[e], 0)
        seen[ops[e]] = out[e] + 1
    return out


