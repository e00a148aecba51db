"""Timing on a busy machine: what :mod:`autosac.tools.calibrate` and the CPU op timings
(:mod:`autosac.trace.timings`) use to notice noise, retry, and say so.

Another process on the machine (a test suite, a build) only ever adds time
to a measurement.  Three defences, each bounded in time:

* the clock: with one intra-op thread the CPU time of the measuring thread
  (:func:`clock`), which does not count the time the thread waited while
  another process ran -- a wall clock does;
* the least of several samples, and a check that it has settled: the two
  least samples of an op agree (:func:`best_ms`), or the figures estimated
  from two halves of interleaved rounds agree (:func:`steady`), and the
  measuring thread had at least :data:`MIN_SHARE` of a core (beside another
  process even CPU time grows, through shared caches); where not, more
  samples are taken, up to a bound, and the result is marked noisy;
* what a noisy measurement gives is not kept as if clean: noisy op timings
  and host figures are kept :data:`NOISY_LIFETIME_S` seconds, then measured
  again.

``AUTOSAC_REMEASURE=1`` makes a process ignore the cached figures and
timings and measure them again (and rewrite the cache).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

NOISY_LIFETIME_S = 3600.0  # noisy host figures and op timings are measured again after this
TOLERANCE = 0.10  # how far two estimates of one figure may be apart, relative
MIN_SHARE = 0.9  # the least share of a core a measuring thread may have had for a clean figure
REMEASURE_ENV = "AUTOSAC_REMEASURE"


def remeasure_requested() -> bool:
    """Whether ``AUTOSAC_REMEASURE`` asks to ignore cached figures ("1", "true", "yes")."""
    return os.environ.get(REMEASURE_ENV, "").strip().lower() in ("1", "true", "yes")


def clock() -> Callable[[], float]:
    """Seconds of this thread's CPU time where torch runs ops on one thread
    (another process's time slices are not counted), else the wall clock
    (ops run on other threads too)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def settled(samples: Sequence[float], tolerance: float = TOLERANCE, slack: float = 0.0) -> bool:
    """Whether the two least samples agree within ``tolerance`` of the least
    (or ``slack``): the least is then the floor, not one lucky sample."""
    if len(samples) < 2:
        return False
    a, b = sorted(samples)[:2]
    return b <= a * (1 + tolerance) + slack + 1e-12


def _machine_busy_s() -> float | None:
    """CPU seconds every process on this machine has run (Linux's /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def others_meter() -> Callable[[], float]:
    """A meter: called later, how many cores other processes kept busy on
    average since (the machine's CPU time less this process's, over the wall
    time); 0.0 where the machine's is not known.  With several intra-op
    threads a thread's own share misses that contention: a starved worker
    leaves the others spinning, which counts as their CPU time."""
    wall, busy, mine = time.perf_counter(), _machine_busy_s(), sum(os.times()[:4])
    if busy is None:
        return lambda: 0.0

    def cores() -> float:
        now = _machine_busy_s() or busy
        return max(0.0, (now - busy) - (sum(os.times()[:4]) - mine)) / max(time.perf_counter() - wall, 1e-9)
    return cores


def contended(threads: int, others_cores: float, cpus: int | None = None) -> bool:
    """Whether ``threads`` intra-op threads lacked cores: other processes kept
    more cores busy than the ``cpus`` (``os.cpu_count()``) left them free,
    by more than a quarter of a core."""
    cpus = cpus or os.cpu_count() or 1
    return threads > 1 and others_cores > max(0, cpus - threads) + 0.25


def share_meter() -> Callable[[], float]:
    """A meter: called later, the share of a core this thread has had since
    (its CPU time over the wall time)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    return lambda: (time.thread_time() - cpu) / max(time.perf_counter() - wall, 1e-9)


def best_ms(call: Callable[[], object], repeats: int = 3, max_repeats: int = 12,
            deadline_s: float = 2.0) -> tuple[float, bool]:
    """(least ms of ``call()``, noisy) after one warm-up call: ``repeats``
    timed calls, then more while the two least disagree (:func:`settled`,
    within 10 % or a microsecond) or, timed in CPU time, the thread had less
    than :data:`MIN_SHARE` of a core, up to ``max_repeats`` calls or
    ``deadline_s`` seconds; noisy where that never came right."""
    tick = clock()
    call()  # warm-up
    start = time.monotonic()
    share = share_meter() if tick is time.thread_time else (lambda: 1.0)
    samples: list[float] = []
    while len(samples) < max_repeats:
        t0 = tick()
        call()
        samples.append((tick() - t0) * 1e3)
        clean = settled(samples, slack=1e-3) and share() >= MIN_SHARE
        if len(samples) >= repeats and (clean or time.monotonic() - start > deadline_s):
            break
    return min(samples), not clean


@dataclass(frozen=True)
class Steady:
    """Figures estimated from all the rounds taken; those whose two halves
    still disagreed when sampling stopped; the median share of a core the
    measuring thread had in a round (another process running beside it
    slows even its CPU time, through shared caches and cores)."""

    figures: dict[str, float]
    disagreeing: tuple[str, ...]
    share: float
    rounds: int
    seconds: float

    @property
    def noisy(self) -> bool:
        return bool(self.disagreeing) or self.share < MIN_SHARE


def steady(take_round: Callable[[], tuple[object, float]], estimate: Callable[[list], dict[str, float]],
           scale: Callable[[dict[str, float], str], float] | None = None, rounds: int = 4,
           max_rounds: int = 32, deadline_s: float = 30.0, tolerance: float = TOLERANCE,
           now: Callable[[], float] = time.monotonic) -> Steady:
    """Take ``rounds`` rounds (``take_round()`` -> (samples, share of a core
    it had)) and estimate the figures (``estimate(list of samples)``) from
    the even and the odd rounds apart; while some figure differs between the
    halves by more than ``tolerance`` of ``scale(figures, name)`` (default:
    the larger of the two), or the median round had less than
    :data:`MIN_SHARE` of a core, double the rounds -- up to ``max_rounds``,
    or while that fits in ``deadline_s`` seconds.  The figures returned are
    estimated from all rounds.  ``now``: the clock the deadline is kept by."""
    start = now()
    taken = [take_round() for _ in range(rounds)]
    while True:
        samples = [s for s, _ in taken]
        got = Steady(estimate(samples), disagreeing(estimate(samples[0::2]), estimate(samples[1::2]), scale, tolerance),
                     statistics.median(share for _, share in taken), len(taken), now() - start)
        # the next doubling takes about as long as everything so far
        if not got.noisy or 2 * len(taken) > max_rounds or 2 * got.seconds > deadline_s:
            return got
        taken += [take_round() for _ in range(len(taken))]


def disagreeing(a: dict[str, float], b: dict[str, float], scale=None, tolerance: float = TOLERANCE) -> tuple[str, ...]:
    """The figures of ``a`` and ``b`` further apart than ``tolerance`` of their scale."""
    out = []
    for name in a:
        ref = max(abs(a[name]), abs(b[name]), scale(a, name) if scale else 0.0)
        if abs(a[name] - b[name]) > tolerance * ref + 1e-9:
            out.append(name)
    return tuple(out)


__all__ = ["NOISY_LIFETIME_S", "Steady", "best_ms", "clock", "remeasure_requested", "settled", "share_meter", "steady"]
