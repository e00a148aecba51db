"""The partitioner's own budget as a compiled plan: which fraction fits the bytes.

``torch.compile``'s partitioner takes a memory budget as a fraction
(``activation_memory_budget``: 1.0 saves what its min-cut saves by default,
0.0 the least it can), which users bisect by compiling and measuring.  Here
the fraction is found in fake mode: each candidate's compiled step is traced
(:func:`autosac.compile.trace.compiled_peak`) and the highest fraction whose
peak fits the bytes asked for is kept.  Compiled peaks are not monotone in
the fraction (recomputing more can hold more temporaries at the backward's
peak), so this bisects as if they were and keeps every fit seen: the cheapest
of them, by the matmul work its step runs (``CompiledPeak.kernel_ms``), is
the candidate :func:`autosac.compile.fit.fit_for_compile` weighs against
checkpointing modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autosac.compile.trace import CompiledPeak

__all__ = ["FractionFit", "search_fraction", "TRACES"]

TRACES = 4  # fractions traced: the bisection's resolution is 1/16


@dataclass
class FractionFit:
    """One fraction whose compiled step was traced."""

    fraction: float
    peak: CompiledPeak


def search_fraction(trace: Callable[[float], CompiledPeak], budget_bytes: int,
                    traces: int = TRACES) -> tuple[FractionFit | None, list[FractionFit]]:
    """The best fraction found whose compiled peak fits ``budget_bytes``, and every one traced.

    Args:
        trace: the compiled step's peak at a fraction (1.0 is known not to fit:
            the caller traced the step without a budget first).
        budget_bytes: the peak to fit.
        traces: how many fractions to trace.

    Returns:
        (best, tried): ``best`` is the fit with the least ``kernel_ms`` (ties: the
        highest fraction), None when none fits.

    Example::

        >>> best, tried = search_fraction(lambda f: trace_at(f), budget_bytes=8 << 30)
    """
    lo, hi = 0.0, 1.0
    tried: list[FractionFit] = []
    for _ in range(traces):
        f = (lo + hi) / 2
        fit = FractionFit(f, trace(f))
        tried.append(fit)
        if fit.peak.peak_bytes <= budget_bytes:
            lo = f
        else:
            hi = f
    fits = [t for t in tried if t.peak.peak_bytes <= budget_bytes]
    best = min(fits, key=lambda t: (t.peak.kernel_ms, -t.fraction), default=None)
    return best, tried
