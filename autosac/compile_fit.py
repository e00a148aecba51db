"""A plan whose budget holds under ``torch.compile``.

The solver's memory model is the eager step's.  Compiled, the step holds other
tensors outside the checkpointed modules (the partitioner picks what the
forward saves there), so an eager plan can go over its budget once compiled
(by 6-9 % on the benchmark GPT).  :func:`fit_for_compile` closes the loop:
solve, apply the plan, trace the compiled step in fake mode
(:func:`autosac.trace.compiled.compiled_peak`), and while that peak is over the
budget, solve again for a budget lowered by the overshoot.  The returned
plan's ``predicted_peak_bytes`` is the compiled step's; ``plan.compiled``
records the backend, the eager prediction and the rounds taken.

Example::

    >>> plan = autosac.solve(model, "50%", example_inputs=idx, target="cpu", compile="aot_eager")
    >>> compiled = torch.compile(autosac.apply(model, plan), backend="aot_eager")
"""

from __future__ import annotations

from autosac.applier import apply, unapply
from autosac.errors import InfeasibleBudgetError
from autosac.plan import Plan
from autosac.solver import solve_stats
from autosac.stats import ModelStats
from autosac.trace.compiled import compiled_peak

__all__ = ["fit_for_compile", "check_backend", "COMPILE_BACKENDS", "MAX_ROUNDS"]

COMPILE_BACKENDS = ("aot_eager",)  # backends whose compiled step the trace reproduces exactly
MAX_ROUNDS = 8


def fit_for_compile(model, stats: ModelStats, budget_bytes: int, example_inputs, *, backend: str,
                    loss_fn=None, optimizer="adamw", **solve_kwargs) -> Plan:
    """The least-recompute plan whose compiled step's peak fits ``budget_bytes``.

    Args:
        model: the model ``stats`` was profiled from (no plan applied); a plan is
            applied to it while its compiled step is traced, and removed again.
        stats: its profile (``target="cpu"``, one process, no autocast).
        budget_bytes: the budget, reserve already taken off.
        example_inputs, loss_fn, optimizer: as given to the profile.
        backend: one of :data:`COMPILE_BACKENDS`.
        solve_kwargs: passed to the solver (``solver``, ``time_limit_s``, ...).

    Returns:
        Plan with ``predicted_peak_bytes`` the compiled step's peak and
        ``compiled`` = {backend, eager_peak_bytes, eager_budget_bytes, rounds}.

    Raises:
        InfeasibleBudgetError: no plan's compiled step fits; ``min_feasible_bytes``
            estimates what would (the eager least budget plus the compiled overshoot
            last seen), or the loop did not converge in :data:`MAX_ROUNDS` rounds.
        ValueError: another backend, target, autocast or world size.
    """
    check_backend(backend)
    _check_stats(stats)
    inner = budget_bytes
    overshoot = 0
    for rounds in range(1, MAX_ROUNDS + 1):
        try:
            plan = solve_stats(stats, inner, **solve_kwargs)
        except InfeasibleBudgetError as e:
            if rounds == 1:
                raise  # the eager step does not fit either; the compiled one needs at least as much
            least = e.min_feasible_bytes + overshoot
            raise InfeasibleBudgetError(
                f"under torch.compile(backend={backend!r}) no plan fits {budget_bytes / 2**20:.1f} MiB: the compiled "
                f"step holds about {overshoot / 2**20:.1f} MiB more than the eager plan's, so the least budget that "
                f"works is about {least / 2**20:.1f} MiB",
                least,
            ) from None
        peak = _compiled_peak_of(model, plan, example_inputs, loss_fn, optimizer, backend)
        if peak <= budget_bytes:
            plan.compiled = {"backend": backend, "eager_peak_bytes": plan.predicted_peak_bytes,
                             "eager_budget_bytes": inner, "rounds": rounds}
            plan.predicted_peak_bytes = peak
            plan.budget_bytes = budget_bytes
            return plan
        overshoot = peak - plan.predicted_peak_bytes
        inner = plan.predicted_peak_bytes - (peak - budget_bytes)  # the eager peak, lowered by the overshoot
        if inner <= 0:
            break
    raise InfeasibleBudgetError(
        f"under torch.compile(backend={backend!r}) no plan was found to fit {budget_bytes / 2**20:.1f} MiB in "
        f"{MAX_ROUNDS} rounds (the last one's compiled step peaked at {peak / 2**20:.1f} MiB): "
        f"try a larger budget",
        peak,
    )


def _compiled_peak_of(model, plan: Plan, example_inputs, loss_fn, optimizer, backend: str) -> int:
    """The compiled step's peak with ``plan`` applied; the model is left without a plan."""
    apply(model, plan)
    try:
        return compiled_peak(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                             backend=backend).peak_bytes
    finally:
        unapply(model)


def check_backend(backend) -> None:
    """Raises ValueError unless plans can be fitted under ``torch.compile(backend=backend)``."""
    if backend == "inductor":
        raise ValueError(
            "compile='inductor' is not supported: inductor's kernels allocate buffers a fake-mode trace cannot "
            "follow (measured up to 32% over an aot_eager-traced peak); plan with compile='aot_eager', or keep "
            "a reserve= under inductor and check with autosac.measure"
        )
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile= must be one of {', '.join(repr(b) for b in COMPILE_BACKENDS)}, not {backend!r}")


def _check_stats(stats: ModelStats) -> None:
    if stats.target.get("device_type") != "cpu" or stats.world_size != 1 or stats.autocast:
        raise ValueError(
            "compile= plans are traced for target='cpu', world_size=1 and no autocast: a GPU target's kernels and "
            "FSDP2's collectives are not reproduced in a compiled fake-mode trace"
        )
