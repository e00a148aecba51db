"""autosac: fit a PyTorch training step into a memory budget with the least slowdown.

Pipeline: :func:`profile` (trace) -> :class:`ModelStats` -> solve -> Plan -> apply.
"""

__version__ = "0.1.0"

from autosac.applier import apply, unapply  # noqa: E402
from autosac.devices import DEVICES, DeviceSpec  # noqa: E402
from autosac.errors import (  # noqa: E402
    InfeasibleBudgetError,
    NothingToCheckpointError,
    PlanMismatchError,
    SolveTimeoutError,
    StatsFormatError,
    TraceError,
)
from autosac.measure import Measurement, measure  # noqa: E402
from autosac.plan import Plan  # noqa: E402
from autosac.solver import solve  # noqa: E402
from autosac.stats import ModelStats  # noqa: E402
from autosac.trace import profile  # noqa: E402

__all__ = [
    "DEVICES",
    "DeviceSpec",
    "InfeasibleBudgetError",
    "Measurement",
    "ModelStats",
    "Plan",
    "NothingToCheckpointError",
    "PlanMismatchError",
    "SolveTimeoutError",
    "StatsFormatError",
    "TraceError",
    "apply",
    "measure",
    "profile",
    "solve",
    "unapply",
]
