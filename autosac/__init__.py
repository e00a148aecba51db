"""autosac: fit a PyTorch training step into a memory budget with the least slowdown.

Pipeline: :func:`profile` (trace) -> :class:`ModelStats` -> solve -> Plan -> apply.
"""

from autosac import ops, schedule, zero3  # modules: autosac.ops.pack_downcast, autosac.schedule.memory_aware_order, ...
from autosac.api import solve
from autosac.applier import apply, unapply
from autosac.batch_search import search
from autosac.devices import DEVICES, DeviceSpec
from autosac.errors import (
    InfeasibleBudgetError,
    NothingToCheckpointError,
    PlanMismatchError,
    ProfilerBusyError,
    SolveTimeoutError,
    StatsFormatError,
    TraceError,
)
from autosac.measure import Measurement, measure
from autosac.plan import Plan
from autosac.stats import ModelStats
from autosac.trace import profile
from autosac.version import __version__

__all__ = [
    "__version__",
    "DEVICES",
    "DeviceSpec",
    "InfeasibleBudgetError",
    "Measurement",
    "ModelStats",
    "Plan",
    "NothingToCheckpointError",
    "PlanMismatchError",
    "ProfilerBusyError",
    "SolveTimeoutError",
    "StatsFormatError",
    "TraceError",
    "apply",
    "measure",
    "ops",
    "profile",
    "schedule",
    "search",
    "solve",
    "unapply",
    "zero3",
]
