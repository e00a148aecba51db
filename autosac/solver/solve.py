"""Stage 2 of the pipeline: ModelStats + budget -> Plan, by an exact MILP."""

from __future__ import annotations

import math
from collections.abc import Callable

from autosac.core.budget import format_bytes, is_least, parse_budget
from autosac.core.dataflow import local_calls
from autosac.core.errors import InfeasibleBudgetError, SolveTimeoutError
from autosac.core.opkinds import SAC_IGNORED_NAMES
from autosac.core.plan import Decision, Plan, RecomputeOp
from autosac.core.stats import ModelStats
from autosac.solver.backends import BACKENDS, SOLVERS, Solution, check_cbc, resolve_solver
from autosac.solver.chain import NotAChain, solve_chain
from autosac.solver.milp import build_milp, decode, encode, milp_needs, with_objective_bound
from autosac.solver.problem import Problem, build_problem
from autosac.solver.replay import ModuleReplay, saved_inside
from autosac.solver.sharding import describe_units, unit_holders

__all__ = ["solve_budget", "solve_stats", "usable_budget", "check_solve_options", "least_peak", "least_peak_bytes", "plan_from_decisions"]


def solve_budget(
    stats: ModelStats,
    budget: str | int | float,
    *,
    solver: str = "auto",
    time_limit_s: float = 60,
    reserve: str | int | float = 0,
    max_choices: int = 16,
    presolve: bool = True,
) -> Plan:
    """:func:`autosac.solve` for a profiled step: the plan for ``budget``.

    Args, returns and raises as :func:`autosac.solve` (``stats`` in place of
    the model).

    Example::

        >>> plan = solve_budget(autosac.profile(model, idx), "60%")
    """
    check_solve_options(solver, time_limit_s)
    if not isinstance(stats, ModelStats):
        raise TypeError(f"solve_budget needs a ModelStats, got {type(stats).__name__}")
    problem = build_problem(stats, max_choices)
    budget_bytes = usable_budget(budget, reserve, problem.baseline_peak,
                                 least=lambda: least_peak_bytes(problem, solver=solver, time_limit_s=time_limit_s))
    return solve_stats(stats, budget_bytes, solver=solver, time_limit_s=time_limit_s, max_choices=max_choices,
                       presolve=presolve, problem=problem)


def check_solve_options(solver: str, time_limit_s) -> None:
    """Raises ValueError for an unknown solver or a time limit that is not a positive number,
    MissingExtraError for solver='cbc' where PuLP has no CBC (before a profile that may take a while)."""
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}: use one of {', '.join(SOLVERS)}")
    if solver == "cbc":
        check_cbc()
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")


def usable_budget(budget: str | int | float, reserve: str | int | float, baseline_peak: int,
                  least: Callable[[], int] | None = None) -> int:
    """The bytes a plan may use: ``budget`` (percentages of ``baseline_peak``)
    less ``reserve``; for ``"least"``, what ``least()`` finds.

    Raises:
        ValueError: a malformed budget or reserve, a percentage reserve, a
            reserve not smaller than the budget, a reserve with ``"least"``, or
            ``"least"`` where no ``least`` is given.
    """
    if is_least(budget):
        if reserve:
            raise ValueError("a reserve needs a budget in bytes or percent: 'least' is the least peak any plan "
                             "reaches, with nothing to keep free")
        if least is None:
            raise ValueError("budget 'least' is not available here: give a size like '2GiB' or '60%'")
        return least()
    budget_bytes = parse_budget(budget, baseline_peak)
    if reserve:
        if isinstance(reserve, str) and reserve.strip().endswith("%"):
            raise ValueError("reserve must be an absolute size like '2GiB', not a percentage")
        budget_bytes -= parse_budget(reserve, baseline_peak, what="reserve")
        if budget_bytes <= 0:
            raise ValueError("reserve is not smaller than the budget: nothing left to plan for")
    return budget_bytes


def solve_stats(
    stats: ModelStats, budget_bytes: int, *, solver: str = "auto", time_limit_s: float = 60,
    max_choices: int = 16, problem: Problem | None = None, presolve: bool = True,
) -> Plan:
    """:func:`solve` for a budget already in bytes (``problem`` may be reused across budgets)."""
    problem = problem or build_problem(stats, max_choices)
    if int(problem.live.max(initial=0)) <= budget_bytes:
        return _make_plan(stats, problem, {}, budget_bytes, _trivial(solver))
    feasible, chain, bound, start = True, None, None, None
    if presolve:
        feasible, chain, bound = _presolve_chain(problem, budget_bytes)
        if chain is not None and chain.objective <= bound * (1 + 1e-9) + 1e-9:
            # the chain DP's plan (which fits: shared inputs counted in every holder) reaches the proven bound
            # (without shared inputs the bound is its own optimum): no MILP needed (nor building one)
            info = {"backend": "chain DP", "status": "optimal", "gap": 0.0, "seconds": 0.0,
                    "objective": chain.objective, "bound": chain.objective, "presolve": "chain"}
            return _make_plan(stats, problem, chain.choice, budget_bytes, info)
    milp = build_milp(problem, budget_bytes) if feasible else None
    if milp is not None and bound is not None:
        milp = with_objective_bound(milp, bound * (1 - 1e-9) - 1e-9)
        start = encode(milp, chain.choice) if chain is not None else None
    sol = BACKENDS[resolve_solver(solver)](milp, time_limit_s, start) if milp is not None else Solution(
        None, "infeasible", math.inf, math.nan, math.inf, 0.0, solver)
    if sol.x is None and chain is not None and problem.evaluate(chain.choice) <= budget_bytes:
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
                f"budget {_pair(budget_bytes, best_peak)[0]} is below the least reachable peak "
                f"{_pair(budget_bytes, best_peak)[1]}: {_remedy(stats, budget_bytes, best_peak)}",
                min_feasible_bytes=best_peak,
            )
        return _make_plan(stats, problem, best_choice, budget_bytes, {**_info(sol), "status": "time_limit_fallback"})
    choice = decode(milp, sol.x)
    info = _info(sol)
    info["presolve"] = "chain" if start is not None else None
    return _make_plan(stats, problem, choice, budget_bytes, info)


def _presolve_chain(problem: Problem, budget_bytes: int):
    """The exact chain DP where intervals nest.  Returns ``(feasible, chain,
    bound)``: False when the DP proved the budget infeasible; the DP's plan
    (None where intervals do not nest, or no plan was found); a proven lower
    bound on the optimal recompute time (None where intervals do not nest).

    Without shared inputs the DP's plan is the optimum.  Otherwise its
    optimum becomes a proven lower bound on the MILP's objective and its plan
    the starting solution.  With inputs several checkpoints keep
    (``problem.shared``) the DP cannot count them once; it runs twice instead:
    counting them in every holder (a plan that surely fits: the start) and not
    at all (a relaxation: its optimum is still a lower bound)."""
    try:
        if not problem.shared:
            chain = solve_chain(problem, budget_bytes, milp_needs(problem, budget_bytes))
            if chain is None:
                return False, None, None
            return True, chain, chain.objective
        held = problem.with_shared_held_by_each()
        chain = solve_chain(held, budget_bytes, milp_needs(held, budget_bytes))
        free = problem.without_shared()
        relaxed = solve_chain(free, budget_bytes, milp_needs(free, budget_bytes))
        if relaxed is None:
            return False, None, None
        return True, chain, relaxed.objective
    except NotAChain:
        return True, None, None


def _not_candidate_because(stats: ModelStats, fqn: str) -> str:
    """Why module ``fqn`` offers no checkpointing candidate (for the error naming it)."""
    m = stats.modules.get(fqn)
    if m is None:
        return "the model has no such module"
    if stats.world_size > 1 and fqn in unit_holders(stats):
        return "it holds an FSDP2 unit inside it, whose parameters its re-run would gather again"
    if m.inputs_written_later:
        return "the step writes its input in place after the call, so its re-run would not see the input it ran on"
    if m.discardable_bytes <= 0:
        return "no discardable activations"
    hold = m.retained_input_bytes + stats.checkpoint_state_bytes + m.outside_write_bytes
    if m.discardable_bytes <= hold:
        return (f"its {m.discardable_bytes} discardable bytes are no more than the {hold} its checkpoint would "
                f"hold: inputs kept alive, the RNG state ({stats.checkpoint_state_bytes} bytes a call), copies "
                "of what it writes in place")
    return "no discard choice of it can be replayed exactly or frees memory at the step's peak"


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
    index = {c.fqn: i for i, c in enumerate(problem.candidates) if c.call == 0}
    choice = {}
    for fqn, ratio in decisions.items():
        if fqn not in index:
            why = _not_candidate_because(stats, fqn)
            raise ValueError(f"module {fqn!r} is not a checkpointing candidate ({why})")
        if not 0 < ratio <= 1:
            raise ValueError(f"discard ratio {ratio!r} of {fqn!r} is not in (0, 1]")
        cand = problem.candidates[index[fqn]]
        want = ratio * cand.discardable_bytes
        k = next((k for k, b in enumerate(cand.discarded, start=1) if b >= want - 1e-9), len(cand.discarded))
        for i in problem.group_of(index[fqn]):  # every call of the module alike
            choice[i] = k
    for i in choice:
        if any(a in choice for a in problem.candidates[i].ancestors):
            raise ValueError(f"{problem.candidates[i].fqn!r} is nested inside another checkpointed module")
    info = {"backend": "given", "status": "given", "gap": None, "seconds": 0.0, "objective": None, "bound": None}
    budget = budget_bytes if budget_bytes is not None else problem.evaluate(choice)
    return _make_plan(stats, problem, choice, budget, info)


def least_peak_bytes(problem: Problem, *, solver: str = "auto", time_limit_s: float = 60) -> int:
    """The least peak any plan reaches (the budget ``"least"`` means).

    Raises:
        SolveTimeoutError: the solver found no plan within ``time_limit_s``.
    """
    found = least_peak(problem, solver=solver, time_limit_s=time_limit_s)
    if found is None:
        raise SolveTimeoutError(
            f"the {solver} solver found no least-peak plan within time_limit_s={time_limit_s:g}: raise the time limit"
        )
    return found[0]


def least_peak(
    problem: Problem, *, solver: str = "auto", time_limit_s: float = 60
) -> tuple[int, dict[int, int]] | None:
    """The least peak any plan reaches and a plan that reaches it (candidate ->
    choice), or ``None`` when the solver found no plan in time.

    Example::

        >>> peak, choice = least_peak(build_problem(stats))
    """
    milp = build_milp(problem, None)
    sol = BACKENDS[resolve_solver(solver)](milp, time_limit_s)
    if sol.x is None:
        return None
    choice = decode(milp, sol.x)
    return problem.evaluate(choice), choice


def _remedy(stats: ModelStats, budget_bytes: int, least: int) -> str:
    """What to do about an infeasible budget.  When the parameters, gradients
    and optimizer state (per rank) fill most of the least peak, checkpointing
    cannot help: say so and name what can."""
    w = stats.world_size
    state = (stats.param_bytes + stats.grad_bytes + stats.optimizer_bytes) / w
    workspace = stats.peak_breakdown.get("workspace", 0)  # a CUDA target's cuBLAS workspaces (autosac.core.devices)
    if state + workspace < 0.5 * least:
        return "raise the budget to at least that (budget 'least' plans there)"
    parts = f"params {format_bytes(stats.param_bytes / w)}, grads {format_bytes(stats.grad_bytes / w)}, " \
            f"{stats.optimizer} state {format_bytes(stats.optimizer_bytes / w)}"
    if workspace:
        parts += f", cuBLAS's workspaces on the target {format_bytes(workspace)}"
    what = "the optimizer step and cuBLAS's workspaces" if workspace else "the optimizer step"
    hold = "hold" if workspace else "holds"
    if budget_bytes >= state + workspace:  # the budget is above them: what no plan frees is the rest
        return (f"of the least peak {what} {hold} {format_bytes(state + workspace)} per rank ({parts}) and what no "
                f"plan frees (activations, the step's inputs and output, temporaries) the other "
                f"{format_bytes(least - state - workspace)} -- raise the budget to at least the least peak (budget "
                "'least' plans there), or lower the fixed part: shard over more ranks (world_size), use a lighter "
                "optimizer (sgd, or none)")
    return (f"{what} alone {hold} {format_bytes(state + workspace)} per rank ({parts}), "
            "which no checkpointing lowers -- shard over more ranks (world_size), use a lighter optimizer (sgd, "
            "or none), or raise the budget to at least the least peak (budget 'least' plans there)")


def _pair(a: int, b: int) -> tuple[str, str]:
    """Two sizes for one message, with byte counts where the short forms look alike."""
    exact = format_bytes(a) == format_bytes(b)
    return format_bytes(a, exact), format_bytes(b, exact)


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
    details = {}
    for i, k in sorted(choice.items()):
        cand = problem.candidates[i]
        if cand.call == 0:  # one decision per module: every call runs the same policy
            details[cand.fqn] = _decision(stats, cand, k)
    # in the order the modules first run: the model's order (blocks.2 before blocks.10)
    details = dict(sorted(details.items(), key=lambda kv: stats.modules[kv[0]].fw_windows[0][0]))
    peak = problem.evaluate(choice)
    recompute = problem.recompute_ms(choice)
    return Plan(
        model=stats.model, fingerprint=stats.fingerprint, target=stats.target.get("name", "?"),
        world_size=stats.world_size, optimizer=stats.optimizer, budget_bytes=int(budget_bytes),
        baseline_peak_bytes=problem.baseline_peak, predicted_peak_bytes=peak, recompute_ms=recompute,
        baseline_step_ms=stats.step_ms, step_ms=stats.step_ms + recompute,
        decisions={f: d.ratio for f, d in details.items()}, details=details, solver=info,
        versions=dict(stats.versions), input_shapes=[list(x) for x in stats.input_shapes],
        device=stats.target.get("device_type", ""), autocast=stats.autocast,
        sharding=describe_units(stats) if stats.world_size > 1 else "",
        gathered_dtypes=dict(stats.gathered_dtypes), output_held=stats.output_held,
        grad_accumulation=stats.grad_accumulation, zero_grad=stats.zero_grad,
        batches_ahead=stats.batches_ahead,
        mechanism_ms=problem.mechanism_ms(choice), param_casts=any(op.param_cast for op in stats.saved_ops),
        routing=dict(stats.routing), frozen=sorted(f for f, p in stats.params.items() if not p.requires_grad),
    )


def _relative(module: str, outer: str) -> str:
    """``module``'s name inside ``outer`` ("" when it is ``outer`` itself)."""
    if module == outer:
        return ""
    return module[len(outer) + 1:] if outer and module.startswith(outer + ".") else module


def _decision(stats: ModelStats, cand, k: int) -> Decision:
    """The run-time form of candidate ``cand`` taking choice ``k``: its traced
    calls with their dataflow, and which of them to recompute, keep and skip."""
    tl = stats.timeline
    window = stats.modules[cand.fqn].fw_windows[0]
    events, calls = local_calls(tl.ops, tl.inputs, window, SAC_IGNORED_NAMES)
    local = {e: i for i, e in enumerate(events)}
    occ = _occurrences(tl.ops, window)
    op_ids = [op_id for item in cand.items[: cand.n_items[k - 1]] for op_id in item]
    ops = []
    for op_id in op_ids:
        op = stats.saved_ops[op_id]
        ops.append(RecomputeOp(
            op=op.op, call=local[op.event], occurrence=occ[op.event], bytes=op.bytes, ms=op.ms,
            random=op.random, writers=[local[w] for w in op.writer_events if w in local],
            module=_relative(op.module, cand.fqn),
        ))
    ops.sort(key=lambda o: o.call)
    chosen = {stats.saved_ops[i].event for i in op_ids}
    # every other op with an output saved inside the module is kept (with its
    # in-place writers); one saved only outside is re-run, since caching it
    # would hold it past its consumers' backward
    save = set()
    for op in stats.saved_ops:
        if window[0] <= op.event < window[1] and op.event not in chosen and not op.param_cast \
                and saved_inside(op.savers, cand.fqn):
            save.update(local[x] for x in (op.event, *op.writer_events) if x in local)
    replay = ModuleReplay.of(stats, cand.fqn)
    skip = [local[e] for e in replay.dead(replay.events(op_ids), tl.ops) if e in local]
    return Decision(
        fqn=cand.fqn, ratio=min(1.0, cand.discarded[k - 1] / cand.discardable_bytes),
        discard_bytes=cand.discarded[k - 1], discardable_bytes=cand.discardable_bytes,
        recompute_ms=cand.ms[k - 1], ops=ops, calls=calls, save=sorted(save), skip=sorted(skip),
        writes_outside=stats.modules[cand.fqn].writes_outside, host_rng=stats.modules[cand.fqn].host_rng,
        mechanism_ms=cand.mechanism[k - 1],
    )


def _occurrences(ops: list[str], window: list[int]) -> dict[int, int]:
    """Event index -> how many earlier calls of the same op the window holds."""
    seen: dict[str, int] = {}
    out = {}
    for e in range(window[0], window[1]):
        out[e] = seen.get(ops[e], 0)
        seen[ops[e]] = out[e] + 1
    return out


