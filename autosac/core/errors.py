"""Errors a user can cause, each with a message that names the fix."""


class TraceError(RuntimeError):
    """The model's training step could not be traced (its forward raised, or inputs don't fit)."""


class NothingToCheckpointError(ValueError):
    """The step has no gradient to compute, so there is no activation to checkpoint."""


class StatsFormatError(ValueError):
    """A ModelStats or Plan file is malformed or from an incompatible version."""


class InfeasibleBudgetError(ValueError):
    """No plan reaches the budget; ``min_feasible_bytes`` is the least budget that works."""

    def __init__(self, message: str, min_feasible_bytes: int) -> None:
        super().__init__(message)
        self.min_feasible_bytes = min_feasible_bytes


class SolveTimeoutError(RuntimeError):
    """The solver found no plan within its time limit (the budget may still be feasible)."""


class PlanMismatchError(ValueError):
    """A plan does not fit the model it is applied to."""


class ProfilerBusyError(RuntimeError):
    """autosac needs torch.profiler's allocator events while another profiler session is running."""


class UserError(Exception):
    """A mistake in the command line or its inputs (a model spec, an option): reported in one line."""


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""
