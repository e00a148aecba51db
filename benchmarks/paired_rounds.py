"""How one variant's training step compares with another's, from interleaved
rounds of both, and how sure that comparison is -- the statistics of
``benchmarks/predict_suite.py``.

A round times one step of each variant, moments apart.  This VM's speed
drifts by 20-40 % over tens of seconds, alike for variants run moments apart,
and single steps jitter by 5-10 % (hf GPT-2 at width 256: 198-278 ms over 60
steps of one model, lag-1 autocorrelation 0.33): a round's ratio is the unit,
and the median over the rounds the estimate.  Its interval is the
distribution-free one of a median (order statistics of the sorted ratios,
the binomial's tails), so no noise model is assumed.

    >>> median_interval([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2])
    (0.3, 1.0)
"""

from __future__ import annotations

import statistics
from math import comb

TARGET_REL, TARGET_POINTS = 0.20, 0.03  # within 20 % of the measured overhead, relative, or 3 points
LEVEL = 0.90  # the measured overhead's interval covers the true median ratio at least this often


def ratios(rounds: dict, k: str, ref: str) -> list[float]:
    """Each round's step of ``k`` over ``ref``'s, less one."""
    return [a / b - 1 for a, b in zip(rounds[k], rounds[ref])]


def paired(rounds: dict, k: str, ref: str, ratio: bool = True) -> float:
    """The median over the rounds of ``k``'s step over ``ref``'s less one
    (``ratio``), or of their difference in ms."""
    return statistics.median(ratios(rounds, k, ref) if ratio else [a - b for a, b in zip(rounds[k], rounds[ref])])


def median_interval(xs: list[float], level: float = LEVEL) -> tuple[float, float]:
    """An interval covering the median of ``xs``'s distribution with at least
    ``level`` confidence: the j-th least and j-th greatest of the sorted
    values, j the largest for which the binomial(n, 1/2) tails outside hold at
    most 1 - ``level``.  With too few values for ``level`` (n < 5 at 0.9):
    their least and greatest.

    Raises ValueError on no values."""
    if not xs:
        raise ValueError("median_interval needs at least one value")
    s, n = sorted(xs), len(xs)
    j, below = 0, 0.0  # j values cut from each end covers the median with 1 - 2 P(Binomial(n, 1/2) <= j)
    for cut in range(n // 2):
        below += comb(n, cut) / 2 ** n
        if 2 * below > 1 - level:
            break
        j = cut
    return s[j], s[n - 1 - j]


def tolerance(measured: float) -> float:
    """How far a prediction may be from ``measured`` and be within target."""
    return max(TARGET_REL * abs(measured), TARGET_POINTS)


def within(predicted: float, measured: float) -> bool:
    """Whether ``predicted`` is within target of ``measured`` (overheads as fractions)."""
    return abs(predicted - measured) <= tolerance(measured) + 1e-12


def verdict(predicted: float, lo: float, hi: float) -> str:
    """"in" where ``predicted`` is within target of every overhead in the
    measured interval [lo, hi], "out" where of none, "noise" where of some:
    the measurement cannot tell."""
    candidates = {lo, hi, min(max(predicted, lo), hi)} | ({0.0} if lo < 0.0 < hi else set())
    # the measured values m it is within target of form one interval around it: its ends, as fractions
    ends = sorted({predicted - TARGET_POINTS, predicted + TARGET_POINTS, predicted / (1 + TARGET_REL),
                   predicted / (1 - TARGET_REL)})
    candidates |= {e for e in ends if lo < e < hi}
    hits = [within(predicted, m) for m in candidates]
    return "in" if all(hits) else "out" if not any(hits) else "noise"
