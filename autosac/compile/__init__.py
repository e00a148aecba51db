"""Plans for ``torch.compile``: the compiled step's traced peak (:mod:`autosac.compile.trace`,
inductor's code on fake tensors in :mod:`autosac.compile.inductor`) and a plan fitted to it
(:mod:`autosac.compile.fit`).  The applier's part, run inside compiled regions, is
:mod:`autosac.applier.compiled`."""

from autosac.compile.fit import (
    COMPILE_BACKENDS,
    MAX_ROUNDS,
    check_backend,
    check_setting,
    check_stats,
    fit_for_compile,
    fused_recompute_costs,
)
from autosac.compile.trace import TRACED_AS, CompiledPeak, compiled_peak

__all__ = ["fit_for_compile", "fused_recompute_costs", "check_backend", "check_stats", "check_setting", "COMPILE_BACKENDS", "MAX_ROUNDS", "CompiledPeak", "compiled_peak", "TRACED_AS"]
