"""A plan whose budget holds under ``torch.compile``.

The solver's memory model is the eager step's.  Compiled, the step holds other
tensors outside the checkpointed modules (the partitioner picks what the
forward saves there; inductor's fusions keep other buffers), so an eager plan
can go over its budget once compiled (on the benchmark GPT at 50 %: by 7 %
under aot_eager, 12 % under inductor).  :func:`fit_for_compile` closes the loop:
solve, apply the plan, trace the compiled step in fake mode
(:func:`autosac.compile.trace.compiled_peak`), and while that peak is over the
budget, solve again for a budget lowered by the overshoot.  Under inductor the partitioner's own
memory budget, at a fraction found the same way, is weighed against those
plans (:mod:`autosac.compile.partitioner`).  The returned plan's
``predicted_peak_bytes`` is the compiled step's; ``plan.compiled`` records
the backend, the eager prediction, the rounds taken and, for the
partitioner's plan, its fraction.

Example::

    >>> plan = autosac.solve(model, "50%", example_inputs=idx, target="cpu", compile="inductor")
    >>> compiled = torch.compile(autosac.apply(model, plan))
"""

from __future__ import annotations

import math
from dataclasses import replace as dc_replace

import torch

from autosac.applier import applied_plan, apply, unapply
from autosac.applier.partitioner import require as require_partitioner
from autosac.applier.partitioner import supported as partitioner_supported
from autosac.compile.partitioner import search_fraction
from autosac.compile.trace import CompiledPeak, compiled_peak
from autosac.core.budget import format_bytes, is_least
from autosac.core.devices import DeviceSpec
from autosac.core.errors import InfeasibleBudgetError, TraceError
from autosac.core.plan import Plan
from autosac.core.stats import ModelStats
from autosac.core.userwarn import warn_user
from autosac.solver import solve_stats, usable_budget
from autosac.solver.problem import build_problem

__all__ = ["fit_for_compile", "fused_recompute_costs", "check_backend", "check_request", "check_stats", "check_setting",
           "COMPILE_BACKENDS", "MAX_ROUNDS", "CUDA_PARTITIONER_HEADROOM"]

COMPILE_BACKENDS = ("inductor", "aot_eager")  # backends whose compiled step is traced (trace/compiled.py)
MAX_ROUNDS = 8
MIN_GAIN = 0.005  # stop refining a fit that can win at most this fraction of the step
# Headroom a partitioner plan for a CUDA target keeps: on an H100 (torch 2.11, gpt2, bf16) the traced peak of
# the partitioner's step at 0.5 was 1.53 % under the allocator's (benchmarks/results/gpu-2026-11-26-h100-s5),
# while on the CPU it is exact; until that gap is explained such plans fit a budget this much smaller
CUDA_PARTITIONER_HEADROOM = 0.02


def fit_for_compile(model, stats: ModelStats, budget, example_inputs, *, backend: str,
                    loss_fn=None, optimizer="adamw", reserve=0, max_choices: int = 16,
                    partitioner: bool | None = None, **solve_kwargs) -> Plan:
    """The plan found whose compiled step's peak fits ``budget`` with the least recomputation.

    The compiled step without a plan is traced first: if it fits, nothing is
    checkpointed.  Then plans that checkpoint modules: the eager optimum for
    the budget is tried first, then the eager budget is lowered by the
    compiled overshoot until a plan fits -- down to the eager least-peak plan,
    whose compiled step may still fit: compiled and eager peaks differ both
    ways, and are not monotone in the eager budget (with dropout, discarding
    more in eager can keep more compiled), so once the least plan has been
    tried the widest untried range of eager budgets is probed -- and after a
    fit, raised again by bisection to recompute less; :data:`MAX_ROUNDS`
    such plans at most.  Under inductor the partitioner's own budget is
    weighed first (:mod:`autosac.compile.partitioner`): the fraction whose
    compiled step fits, kept where its step runs no more matmul work than the
    checkpointing plan's (ties go to the partitioner, whose recomputation is
    fused pointwise work; where the matmul work it adds is under
    :data:`MIN_GAIN` of the step, no checkpointing plan is tried: none could
    win more).  For a CUDA target the partitioner's plan keeps
    :data:`CUDA_PARTITIONER_HEADROOM` of the budget free (its traced peak read
    1.5 % under an H100's allocator).

    Args:
        model: the model ``stats`` was profiled from, without a plan applied: each
            candidate plan is applied while its compiled step is traced, and removed.
        stats: its profile (one process; a CPU or CUDA target, autocast or not: the
            compiled step is traced on its target and autocast,
            :func:`autosac.compile.trace.compiled_peak`).
        budget, reserve: as :func:`autosac.solve` takes them.
        example_inputs, loss_fn, optimizer: as given to the profile.
        backend: one of :data:`COMPILE_BACKENDS`.
        max_choices, solve_kwargs: passed to the solver (``solver``, ``time_limit_s``, ``presolve``).
        partitioner: weigh the partitioner's budget (None: under inductor, whose
            partitioner takes one, where this torch can scope it to the model:
            :func:`autosac.applier.partitioner.supported`, torch >= 2.13; where
            torch refuses the budget region for this step -- a batch norm's
            running statistics written after it -- with one warning, not).

    Returns:
        Plan with ``predicted_peak_bytes`` the compiled step's peak and
        ``compiled`` = {backend, eager_peak_bytes, eager_budget_bytes, rounds}
        (and ``partitioner_budget``, the fraction, where the partitioner's plan was kept).

    Raises:
        InfeasibleBudgetError: no plan tried had a compiled step that fits;
            ``min_feasible_bytes`` is the least compiled peak seen.
        TraceError: the step could not be traced compiled (with ``partitioner=True``:
            not under the partitioner's budget either).
        ValueError: another backend, target, autocast or world size, a model
            that already has a plan applied, or ``partitioner=True`` with torch < 2.13.
    """
    check_backend(backend)
    check_stats(stats)
    if applied_plan(model) is not None:
        raise ValueError("the model already has a plan applied: call autosac.unapply(model) before fitting another")
    if backend == "inductor":  # aot_eager runs every op as it is: no fusion
        stats = fused_recompute_costs(stats)
    # under compile, random ops' outputs are always saved (autosac.applier.compiled): never offered as discards
    problem = build_problem(stats, max_choices, keep_random=True)
    if is_least(budget):
        raise ValueError("under torch.compile give the budget as a size or a percentage: 'least' is the least "
                         "eager peak, which the compiled step need not reach")
    budget_bytes = usable_budget(budget, reserve, problem.baseline_peak)
    solve_kwargs.update(max_choices=max_choices, problem=problem)
    empty = solve_stats(stats, problem.baseline_peak, **solve_kwargs)  # no module checkpointed
    tracer = _Tracer(model, example_inputs, loss_fn, optimizer, backend, stats, empty)
    plain = tracer.plan(empty)
    if plain.peak_bytes <= budget_bytes:  # the compiled step fits as it is
        return _finish(empty, plain, budget_bytes, backend, problem.baseline_peak, 1)
    asked = bool(partitioner)
    if partitioner is None:
        partitioner = backend == "inductor" and partitioner_supported()
    elif partitioner:
        require_partitioner()
    headroom = CUDA_PARTITIONER_HEADROOM if stats.target.get("device_type") == "cuda" else 0.0
    best, tried = (_partitioner_fits(tracer, int(budget_bytes * (1 - headroom)), asked) if partitioner
                   else (None, []))
    # a checkpointing plan's step runs at least the matmuls of the step without a plan: against the partitioner's
    # best fit it can win at most what that fit adds to them -- not worth its traces when under MIN_GAIN of the step
    if best is not None and best.peak.kernel_ms - plain.kernel_ms <= MIN_GAIN * stats.step_ms:
        search = _EagerBudgets(budget_bytes)
    else:
        search = _fit_checkpoints(stats, budget_bytes, solve_kwargs, tracer, {applied_key(empty): plain})
    rounds = 1 + len(search.peaks) + len(tried)  # plans tried: a plan proposed again counts, though traced once
    if best is not None and (not search.fits or best.peak.kernel_ms <= search.best_fit()[1].kernel_ms):
        plan = _partitioner_plan(empty, best.fraction, best.peak, plain)
        return _finish(plan, best.peak, budget_bytes, backend, problem.baseline_peak, rounds)
    if not search.fits:  # (a fraction fits a budget its peak is under by the headroom)
        peaks = [plain.peak_bytes, *search.peaks, *(math.ceil(t.peak.peak_bytes / (1 - headroom)) for t in tried)]
        raise InfeasibleBudgetError(
            f"under torch.compile(backend={backend!r}) no plan found fits {format_bytes(budget_bytes)}: the least "
            f"compiled peak among the {len(peaks)} plans traced was {format_bytes(min(peaks))} -- raise the budget "
            "to at least that",
            min(peaks),
        )
    plan, peak, inner = search.best_fit()
    return _finish(plan, peak, budget_bytes, backend, inner, rounds)


def _partitioner_fits(tracer: _Tracer, budget_bytes: int, asked: bool) -> tuple:
    """:func:`search_fraction` over the partitioner's budget.  Where the step
    cannot be traced under that budget and the caller did not ask for it
    (``partitioner=True``), no fraction: the checkpointing route plans alone,
    with one warning.  torch refuses a budget region that leaves forward ops
    outside it, and a batch norm's running statistics are written back after
    the region (a conv + BatchNorm net under inductor: "6 forward op(s) are
    unannotated")."""
    try:
        return search_fraction(tracer.fraction, budget_bytes)
    except TraceError as e:
        if asked:
            raise
        warn_user(f"autosac: torch.compile's partitioner budget could not be traced for this model ({e}); "
                  "planned with checkpointed modules only")
        return None, []


def _fit_checkpoints(stats: ModelStats, budget_bytes: int, solve_kwargs: dict, tracer: _Tracer,
                     traced: dict) -> _EagerBudgets:
    """The checkpointing plans :func:`fit_for_compile` traces, eager budget by
    eager budget; ``traced``: applied_key -> CompiledPeak, filled as it goes."""
    search = _EagerBudgets(budget_bytes, min_gain_ms=MIN_GAIN * stats.step_ms)
    inner = budget_bytes
    while len(search.peaks) < MAX_ROUNDS and inner not in search.tried:
        search.tried.add(inner)
        try:
            plan = solve_stats(stats, inner, **solve_kwargs)
        except InfeasibleBudgetError as e:
            if search.lowest is not None:
                break
            search.lowest = inner = e.min_feasible_bytes  # try the least-peak plan itself
            continue
        key = applied_key(plan)
        if key not in traced:  # neighbouring eager budgets often give the same plan: its compiled step is traced once
            traced[key] = tracer.plan(plan)
        inner = search.next(plan, traced[key], inner)
        if inner is None:
            break
    return search


def _partitioner_plan(empty: Plan, fraction: float, peak: CompiledPeak, plain: CompiledPeak) -> Plan:
    """``empty`` (no module checkpointed) made the partitioner's plan at
    ``fraction``: its recomputation is the matmul work its compiled step adds
    to the step without a budget (fused pointwise work counted free)."""
    plan = dc_replace(empty, decisions={}, details={})
    plan.recompute_ms = max(0.0, peak.kernel_ms - plain.kernel_ms)
    plan.step_ms = plan.baseline_step_ms + plan.recompute_ms
    plan.compiled = {"partitioner_budget": fraction}
    return plan


def _finish(plan: Plan, peak: CompiledPeak, budget_bytes: int, backend: str, inner: int, rounds: int) -> Plan:
    """``plan`` as :func:`fit_for_compile` returns it: the compiled peak predicted."""
    plan.compiled = {"backend": backend, "eager_peak_bytes": plan.predicted_peak_bytes, "eager_budget_bytes": inner,
                     "rounds": rounds, **plan.compiled}
    plan.predicted_peak_bytes = peak.peak_bytes
    plan.budget_bytes = budget_bytes
    return plan


class _Tracer:
    """Traces compiled steps for :func:`fit_for_compile`."""

    def __init__(self, model, example_inputs, loss_fn, optimizer, backend: str, stats: ModelStats,
                 empty: Plan) -> None:
        self.model, self.example_inputs, self.loss_fn = model, example_inputs, loss_fn
        self.optimizer, self.backend, self.stats, self.empty = optimizer, backend, stats, empty

    def plan(self, plan: Plan) -> CompiledPeak:
        """The compiled step's peak with ``plan`` applied (and the RNG state each
        of its checkpointed modules keeps when a region is graph-broken)."""
        peak = _compiled_peak_of(self.model, plan, self.example_inputs, self.loss_fn, self.optimizer,
                                 self.backend, self.stats)
        peak.peak_bytes += self.stats.checkpoint_state_bytes * len(plan.decisions)
        return peak

    def fraction(self, fraction: float) -> CompiledPeak:
        """The compiled step's peak with the partitioner's plan at ``fraction``
        applied (:mod:`autosac.applier.partitioner`)."""
        return self.plan(dc_replace(self.empty, compiled={"partitioner_budget": fraction}))


def applied_key(plan: Plan) -> tuple:
    """What the applied model runs, for telling plans apart: per checkpointed
    module, the calls its policy saves and skips (two plans with equal keys
    compile to the same step)."""
    return tuple(sorted((fqn, len(d.calls), tuple(d.save), tuple(d.skip)) for fqn, d in plan.details.items()))


class _EagerBudgets:
    """The eager budgets :func:`fit_for_compile` tries, and what each gave:
    the plans that fit (plan, compiled peak, eager budget), every compiled
    peak, the budgets tried, the least eager peak once known."""

    def __init__(self, budget_bytes: int, min_gain_ms: float = 0.0) -> None:
        self.budget = budget_bytes
        self.tolerance = max(budget_bytes // 200, 1)  # stop refining when the eager budgets tried are 0.5 % apart
        # ... or when what is left to win is this little: a plan for an eager budget between a fit and
        # a failure recomputes at least what the failure's does (the eager optimum only falls as the
        # budget grows), so the fit's recompute less the failure's bounds the gain
        self.min_gain_ms = min_gain_ms
        self.fail_ms: float | None = None  # the recompute of the plan at fail_at
        self.fits: list[tuple[Plan, CompiledPeak, int]] = []
        self.peaks: list[int] = []
        self.tried: set[int] = set()
        self.lowest: int | None = None  # the least eager peak any plan reaches, once known
        self.fit_at: int | None = None  # the highest eager budget whose plan fit
        self.fail_at: int | None = None  # the lowest whose plan did not

    def best_fit(self) -> tuple[Plan, CompiledPeak, int]:
        """The fit that recomputes least: (plan, its compiled peak, its eager budget)."""
        return min(self.fits, key=lambda f: (f[0].recompute_ms, f[1].peak_bytes))

    def next(self, plan: Plan, compiled: CompiledPeak, inner: int) -> int | None:
        """Record ``plan`` (solved for eager budget ``inner``, compiled step
        ``compiled``); the eager budget to try next, or None to stop."""
        peak = compiled.peak_bytes
        self.peaks.append(peak)
        if peak <= self.budget:
            self.fits.append((plan, compiled, inner))
            self.fit_at = max(self.fit_at or 0, inner)
            if inner == self.budget:
                return None  # the eager optimum fits: no plan recomputes less
        elif self.fail_at is None or inner < self.fail_at:
            self.fail_at, self.fail_ms = inner, plan.recompute_ms
        if self.fit_at is not None:  # bisect between a fit and a failure
            if self.fail_at is None or self.fail_at - self.fit_at <= self.tolerance:
                return None
            best = min(p.recompute_ms for p, _, _ in self.fits)
            if best - self.fail_ms <= self.min_gain_ms:
                return None
            return (self.fit_at + self.fail_at) // 2
        # lower the eager budget by the overshoot, not below the least eager peak
        inner = plan.predicted_peak_bytes - (peak - self.budget)
        if self.lowest is not None:
            inner = max(inner, self.lowest)
        if inner in self.tried and self.lowest is not None:
            # compiled peaks are not monotone in the eager budget: probe the widest untried gap
            return _widest_gap_middle(sorted(self.tried | {self.budget}), self.tolerance)
        return inner


_FUSED_NON_POINTWISE = {"_to_copy", "_unsafe_view", "alias", "detach"}  # a cast, aliases


def _fused(name: str, view: bool) -> bool:
    """Whether inductor fuses a recomputed forward op into the kernel that reads
    it: pointwise ops (op tag), views and casts; a matmul, attention or a
    reduction is a kernel of its own, re-run at its cost."""
    if view or name in _FUSED_NON_POINTWISE:
        return True
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def fused_recompute_costs(stats: ModelStats) -> ModelStats:
    """``stats`` as a compiled step recomputes: a forward op inductor fuses into
    the kernel that reads its result (:func:`_fused`) costs nothing to
    recompute, so the solver discards pointwise results before a matmul's, as
    PyTorch's partitioner does; other ops keep their times.  A copy; the
    baseline step's time is unchanged (``step_ms``)."""
    tl = stats.timeline
    views = tl.views or [False] * len(tl.ops)
    fused = {e for e, (name, phase) in enumerate(zip(tl.ops, tl.phases))
             if phase == "forward" and _fused(name, views[e])}
    if not fused:
        return stats
    ms = [0.0 if e in fused else t for e, t in enumerate(tl.ms)]
    ops = [dc_replace(op, ms=0.0) if op.event in fused and all(w in fused for w in op.writer_events) else op
           for op in stats.saved_ops]
    return dc_replace(stats, timeline=dc_replace(tl, ms=ms), saved_ops=ops)


def _widest_gap_middle(points: list[int], tolerance: int) -> int | None:
    """The middle of the widest gap between sorted ``points``, if wider than ``tolerance``."""
    gaps = [(b - a, (a + b) // 2) for a, b in zip(points, points[1:])]
    width, middle = max(gaps, default=(0, None))
    return middle if width > tolerance else None


def _compiled_peak_of(model, plan: Plan, example_inputs, loss_fn, optimizer, backend: str,
                      stats: ModelStats) -> CompiledPeak:
    """The compiled step's peak with ``plan`` applied, on the profile's target
    and autocast; the model is left without a plan."""
    target = DeviceSpec.from_dict(stats.target)
    autocast = getattr(torch, stats.autocast) if stats.autocast else None
    apply(model, plan)
    try:
        return compiled_peak(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, backend=backend,
                             output_held=plan.output_held, target=target, autocast=autocast)
    finally:
        unapply(model)


def check_backend(backend) -> None:
    """Raises ValueError unless plans can be fitted under ``torch.compile(backend=backend)``."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile= must be one of {', '.join(repr(b) for b in COMPILE_BACKENDS)}, not {backend!r}")


def check_stats(stats: ModelStats) -> None:
    """Raises ValueError unless the profile is one compiled plans can be traced for."""
    check_setting(stats.target.get("device_type"), stats.world_size, bool(stats.autocast))


def check_request(backend, budget, device_type: str | None, world_size: int, autocast: bool,
                  default_loop: bool = True) -> None:
    """Raises ValueError unless a plan for ``torch.compile(backend=backend)``
    can be fitted for this request -- before anything is profiled.
    ``default_loop``: the training loop is the default one (no gradient
    accumulation, ``zero_grad`` after the step, no batches held ahead), the
    only one a compiled step is traced for.  :func:`autosac.solve` and the
    CLI's ``plan --compile`` both ask here."""
    check_backend(backend)
    if is_least(budget):
        raise ValueError("under torch.compile give the budget as a size or a percentage: 'least' is the least "
                         "eager peak, which the compiled step need not reach")
    check_setting(device_type, world_size, autocast)
    if not default_loop:
        raise ValueError("plans for torch.compile are traced for the default loop: leave grad_accumulation at 1, "
                         "zero_grad at 'after_step' and batches_ahead at 0")


def check_setting(device_type: str | None, world_size: int, autocast: bool) -> None:
    """Raises ValueError unless ``target``'s device type, ``world_size`` and
    ``autocast`` allow plans for compile: one process, on a CPU or CUDA target,
    with or without autocast."""
    if device_type not in ("cpu", "cuda") or world_size != 1:
        raise ValueError(
            "compile= plans are traced for one process (world_size=1) on a cpu or CUDA target: FSDP2's "
            "collectives are not reproduced in a compiled fake-mode trace"
        )
