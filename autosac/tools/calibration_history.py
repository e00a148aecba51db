"""The host figures of the last few calibrations on a busy machine, and their
median (:mod:`autosac.tools.calibrate`).

A calibration on a busy or drifting machine is flagged noisy and kept an
hour only (:mod:`autosac.core.noise`); where no calibration was ever clean
(a shared VM whose speed drifts by tens of percent: every one is flagged),
each hour's figures replaced the last, and plans' predicted times jumped
with them (``checkpoint_call_us`` 101-556 us, ``untimed_us_per_mib`` 0-481
over six calibrations within an hour on this 2-core VM).  So the figures of
the last :data:`KEPT` noisy calibrations are kept in the cache beside the
figures in use, and where no clean figures exist the figures used are each
one's median over them: one wild calibration moves none of them further
than the middle of the others.
"""

from __future__ import annotations

import statistics

from autosac.core.host import _FIELDS, HISTORY_KEPT, HISTORY_KEY, HostCosts

KEPT = HISTORY_KEPT  # noisy calibrations whose figures are kept for the median
_NEXT = f"{HISTORY_KEY}next"  # the slot the next calibration's figures go in (0 .. KEPT-1)


def remember(cache, costs: HostCosts) -> None:
    """Keep ``costs`` in ``cache`` (a :class:`autosac.trace.timings.TimingCache`)
    as the latest noisy calibration, in place of the oldest of :data:`KEPT`."""
    slot = int(cache.get(_NEXT) or 0) % KEPT
    for name, value in costs.to_dict().items():
        if value is not None:
            cache.put(f"{HISTORY_KEY}{slot}:{name}", value)
    cache.put(_NEXT, (slot + 1) % KEPT)


def recalled(cache) -> list[HostCosts]:
    """The figures of the noisy calibrations kept in ``cache`` (slots missing a figure are left out)."""
    out = []
    for slot in range(KEPT):
        found = {f: cache.get(f"{HISTORY_KEY}{slot}:{f}") for f in _FIELDS}
        if all(v is not None for v in found.values()):
            try:
                out.append(HostCosts(**found))
            except ValueError:  # a figure HostCosts refuses: left out
                continue
    return out


def median_costs(measured: list[HostCosts]) -> HostCosts:
    """Each figure's median over ``measured`` (at least one)."""
    dicts = [m.to_dict() for m in measured]
    figures = {}
    for name in dicts[0]:
        values = [d[name] for d in dicts if d[name] is not None]
        figures[name] = round(statistics.median(values), 4) if values else None
    return HostCosts(**figures)


__all__ = ["KEPT", "median_costs", "recalled", "remember"]
