"""Stage 2 of the pipeline: ModelStats + budget -> Plan, by an exact MILP.

The code is in :mod:`autosac.solver.solve`; this package re-exports it."""

from autosac.solver.solve import (
    check_solve_options,
    least_peak,
    least_peak_bytes,
    plan_from_decisions,
    solve_budget,
    solve_stats,
    usable_budget,
)

__all__ = ["solve_budget", "solve_stats", "usable_budget", "check_solve_options", "least_peak", "least_peak_bytes", "plan_from_decisions"]
