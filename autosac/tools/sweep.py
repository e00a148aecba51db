"""The memory/recompute tradeoff of one profiled step: plans for many budgets
from one profile, beside the two obvious alternatives -- no checkpointing, and
checkpointing every block whole -- and the least budget any plan reaches.

Plain data, like a :class:`Plan`; :mod:`autosac.tools.plot` draws it, and
:func:`measure_sweep` adds measured points.

Example::

    >>> stats = autosac.profile(model, idx, target="cpu")
    >>> result = autosac.tools.sweep.sweep(stats, ["90%", "70%", "50%"])
    >>> [(p.budget_bytes, p.overhead) for p in result.points]
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from autosac.core.errors import InfeasibleBudgetError, SolveTimeoutError
from autosac.core.plan import Plan
from autosac.core.stats import ModelStats
from autosac.solver import least_peak, plan_from_decisions, solve_stats, usable_budget
from autosac.solver.problem import build_problem

__all__ = ["SweepPoint", "Sweep", "sweep", "repeated_blocks", "measure_sweep"]


@dataclass
class SweepPoint:
    """One budget's plan: predicted peak, recompute ms and overhead (recompute
    over the unmodified step), or, when no plan fits, ``status`` "infeasible"
    and ``min_feasible_bytes`` the least budget that works; ``measured_*``
    after :func:`measure_sweep`."""

    budget_bytes: int
    peak_bytes: int | None = None
    recompute_ms: float | None = None
    overhead: float | None = None
    modules: int = 0
    status: str = ""
    min_feasible_bytes: int | None = None
    plan: Plan | None = None
    measured_peak_bytes: int | None = None
    measured_overhead: float | None = None


@dataclass
class Sweep:
    """Plans for several budgets from one profile, and what to compare them with.

    ``full_ac`` is the plan that recomputes every block of ``blocks`` whole
    (``torch.utils.checkpoint`` around each), predicted by the same model;
    ``least_peak_bytes`` the least peak any plan reaches (None if the solver
    found none in time).  :func:`measure_sweep` fills the measured figures
    and ``torch_checkpoint``: ``torch.utils.checkpoint`` itself around every
    block, measured in the same run (no prediction)."""

    model: str
    target: str
    baseline_peak_bytes: int  # the unconstrained step's (per rank), as Plan.baseline_peak_bytes
    step_ms: float
    least_peak_bytes: int | None
    points: list[SweepPoint]
    blocks: list[str] = field(default_factory=list)
    full_ac: SweepPoint | None = None
    measured_baseline_peak_bytes: int | None = None
    torch_checkpoint: SweepPoint | None = None


def repeated_blocks(stats: ModelStats) -> list[str]:
    """The model's blocks: the group of two or more same-typed siblings that
    together hold the most activations to discard (a transformer's layers,
    not the experts or norms inside one layer), in model order; ``[]`` when no
    module has two such children of one type.

    Example::

        >>> repeated_blocks(stats)
        ['blocks.0', 'blocks.1', ...]
    """
    def weight(group: list[str]) -> tuple[int, int]:
        return sum(stats.modules[c].discardable_bytes for c in group), len(group)

    best: list[str] = []
    for mod in stats.modules.values():
        kids = [c for c in mod.children if c in stats.modules and stats.modules[c].discardable_bytes > 0]
        for kind in Counter(stats.modules[c].type for c in kids):
            group = [c for c in kids if stats.modules[c].type == kind]
            if len(group) >= 2 and weight(group) > weight(best):
                best = group
    return sorted(best, key=lambda f: stats.modules[f].fw_pre_order)


def sweep(
    stats: ModelStats,
    budgets: list,
    *,
    solver: str = "auto",
    time_limit_s: float = 60,
    reserve: str | int | float = 0,
    on_point: Callable[[int, int], None] | None = None,
) -> Sweep:
    """Solve ``stats`` for each budget.

    Args:
        stats: from :func:`autosac.profile`.
        budgets: budgets in any form :func:`autosac.solve` takes (``"60%"``, ``"8GiB"``, ``"least"``, bytes).
        solver, time_limit_s, reserve: as :func:`autosac.solve` (percentages are of the
            same unconstrained per-rank peak, and the reserve comes off every budget).
        on_point: called as ``on_point(done, total)`` after each budget (progress display).

    Returns:
        Sweep, its points in the order of ``budgets``; a budget no plan reaches
        is a point with ``status`` "infeasible" and no plan, not an exception.

    Raises:
        ValueError: a malformed budget or reserve (before anything is solved).
    """
    problem = build_problem(stats)
    for b in budgets:  # every budget checked before anything is solved
        usable_budget(b, reserve, problem.baseline_peak, least=lambda: 0)
    least = least_peak(problem, solver=solver, time_limit_s=time_limit_s)

    def least_bytes() -> int:  # the budget "least"
        if least is None:
            raise SolveTimeoutError(f"the {solver} solver found no least-peak plan within "
                                    f"time_limit_s={time_limit_s:g}: raise the time limit")
        return least[0]

    parsed = [usable_budget(b, reserve, problem.baseline_peak, least=least_bytes) for b in budgets]
    points = []
    for i, budget in enumerate(parsed):
        try:
            plan = solve_stats(stats, budget, solver=solver, time_limit_s=time_limit_s, problem=problem)
        except InfeasibleBudgetError as e:
            points.append(SweepPoint(budget, status="infeasible", min_feasible_bytes=e.min_feasible_bytes))
        else:
            points.append(_point(plan, budget))
        if on_point is not None:
            on_point(i + 1, len(parsed))
    blocks = repeated_blocks(stats)
    full = None
    if blocks:
        full_plan = plan_from_decisions(stats, {b: 1.0 for b in blocks})
        full = _point(full_plan, full_plan.predicted_peak_bytes)
        full.status = f"every block ({len(blocks)}) whole"
    return Sweep(stats.model, stats.target.get("name", "?"), problem.baseline_peak, stats.step_ms,
                 None if least is None else least[0], points, blocks, full)


def _point(plan: Plan, budget: int) -> SweepPoint:
    return SweepPoint(budget, plan.predicted_peak_bytes, plan.recompute_ms, plan.overhead, len(plan.decisions),
                      plan.solver.get("status", ""), plan=plan)


def measure_sweep(result: Sweep, model, example_inputs, *, steps: int = 2, rounds: int = 3,
                  optimizer: str | None = None) -> Sweep:
    """Run each point's plan for real on this machine (a copy of ``model`` per
    plan) and fill its ``measured_peak_bytes`` and ``measured_overhead``; and
    measure ``torch.utils.checkpoint`` (non-reentrant) around every block, the
    usual alternative, as ``result.torch_checkpoint``.

    Step times on a busy machine drift by more than the differences between
    plans, so the variants run in ``rounds`` interleaved rounds (the
    unmodified model, each plan, torch's checkpoint, then again, each round
    starting one further along): a variant's
    overhead is the median over rounds of its step time over the unmodified
    model's in the same round.  Its peak is the most any round measured.

    Args:
        result: from :func:`sweep` on this model's profile.
        model: the model with real weights, on the device the plans were made for.
        example_inputs: as profiled.
        steps: timed steps per plan and round (after one untimed step).
        rounds: interleaved rounds.
        optimizer: as profiled (default: the plan's).

    Returns:
        ``result``, filled in.

    Raises:
        ValueError: ``steps < 1`` (the overheads need timed steps) or ``rounds < 1``.

    Example::

        >>> result = measure_sweep(sweep(stats, ["70%", "least"]), model, idx)
        >>> [p.measured_overhead for p in result.points]
    """
    import statistics

    from autosac.applier import apply
    from autosac.tools.measure import in_rounds, measure

    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"measure_sweep needs steps >= 1 (timed steps give the overheads), got {steps!r}")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"measure_sweep needs rounds >= 1, got {rounds!r}")
    plans = [p for p in [*result.points, result.full_ac] if p is not None and p.plan is not None]
    if not plans:
        return result
    opt = optimizer or plans[0].plan.optimizer
    # the loop the plans were made for
    loop = dict(steps=steps, optimizer=opt, loop=plans[0].plan.loop.measuring())
    variants = [(p, lambda p=p: apply(copy.deepcopy(model), p.plan)) for p in plans]
    if result.blocks:
        result.torch_checkpoint = SweepPoint(0, status="torch.utils.checkpoint", modules=len(result.blocks))
        variants.append((result.torch_checkpoint, lambda: _torch_checkpointed(model, result.blocks)))
    runs = [(None, lambda: copy.deepcopy(model)), *variants]  # None: the unmodified model
    # one copy alive at a time (a large model's copies need not fit together), built afresh each round
    got = in_rounds([(id(point), lambda build=build: measure(build(), example_inputs, **loop))
                     for point, build in runs], rounds)
    base = got[id(None)]
    result.measured_baseline_peak_bytes = max(m.peak_bytes for m in base)
    for point, _ in variants:
        point.measured_peak_bytes = max(m.peak_bytes for m in got[id(point)])
        point.measured_overhead = statistics.median(m.step_ms / b.step_ms for m, b in zip(got[id(point)], base)) - 1
    if result.torch_checkpoint is not None:
        result.torch_checkpoint.budget_bytes = result.torch_checkpoint.measured_peak_bytes
    return result


def _torch_checkpointed(model, blocks: list[str]):
    """A copy of ``model`` with ``torch.utils.checkpoint`` (non-reentrant) around each of ``blocks``."""
    import functools

    from torch.utils.checkpoint import checkpoint

    twin = copy.deepcopy(model)
    for fqn in blocks:
        block = twin.get_submodule(fqn)
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return twin
