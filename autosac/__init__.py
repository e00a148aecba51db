"""autosac: fit a PyTorch training step into a memory budget with the least slowdown.

Pipeline: :func:`profile` (trace) -> :class:`ModelStats` -> solve -> Plan -> apply.
"""

from autosac import schedule, trace, zero3
from autosac.api import solve
from autosac.applier import apply, unapply
from autosac.core.devices import DEVICES, DeviceSpec
from autosac.core.errors import (
    InfeasibleBudgetError,
    NothingToCheckpointError,
    PlanMismatchError,
    ProfilerBusyError,
    SolveTimeoutError,
    StatsFormatError,
    TraceError,
)
from autosac.core.loop import Loop
from autosac.core.plan import Plan
from autosac.core.stats import ModelStats
from autosac.core.version import __version__
from autosac.tools.measure import Measurement, measure
from autosac.tools.search import search
from autosac.trace import profile
from autosac.zero3 import ops  # modules: autosac.ops.pack_downcast, autosac.schedule.memory_aware_order, ...

__all__ = [
    "__version__",
    "DEVICES",
    "DeviceSpec",
    "InfeasibleBudgetError",
    "Loop",
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

from autosac import _moved  # noqa: E402
from autosac.compile import CompiledPeak as _CompiledPeak  # noqa: E402
from autosac.compile import compiled_peak as _compiled_peak  # noqa: E402
from autosac.tools import calibrate as _calibrate  # noqa: E402, F401 - registers this host's calibration (core.host)

# old names: autosac.trace.compiled_peak (the compiled trace is in autosac.compile now), and the
# old module paths (autosac.plan, autosac.host, ...: autosac._moved)
trace.compiled_peak, trace.CompiledPeak = _compiled_peak, _CompiledPeak
_moved.install()


def __getattr__(name: str):
    module = _moved.module(name)
    if module is None:
        raise AttributeError(f"module 'autosac' has no attribute {name!r}")
    return module
