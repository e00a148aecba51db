"""``benchmarks/predict_suite.py``'s rows and its report: a row per plan,
predicted beside measured overhead, and the table of them with the worst
row, the intervals' verdicts (:mod:`paired_rounds`) and the control's noise."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from paired_rounds import LEVEL, tolerance, verdict, within


@dataclass
class Row:
    model: str
    regime: str
    budget: str
    predicted: float | None = None
    measured: float | None = None
    wall: float | None = None
    as_given: float | None = None  # against the unmodified model with its cache on (None: it builds none)
    control: float | None = None  # a second copy of the unmodified model, measured as the plans are: the noise
    measured_lo: float | None = None  # the measured overhead's interval (paired_rounds.LEVEL): how sure it is
    measured_hi: float | None = None
    kept: bool | None = None
    bitwise: bool | None = None
    plan: str = ""
    note: str = ""
    per_round: dict | None = None  # each round's CPU ms of this plan, the reference and the control (--json)

    @property
    def error(self) -> float | None:
        return None if self.predicted is None or self.measured is None else self.predicted - self.measured

    @property
    def within(self) -> bool | None:
        if self.error is None:
            return None
        return within(self.predicted, self.measured)

    @property
    def verdict(self) -> str | None:
        """"in" / "out": within target of every / no overhead in the measured
        interval; "noise": of some -- the measurement cannot tell."""
        if self.error is None or self.measured_lo is None:
            return None
        return verdict(self.predicted, self.measured_lo, self.measured_hi)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _interval(r: Row) -> str:
    """The measured overhead's interval and what it says of the prediction."""
    if r.verdict is None:
        return "-"
    says = {"in": "within", "out": "OUTSIDE", "noise": "cannot tell"}[r.verdict]
    return f"{100 * r.measured_lo:+.1f} to {100 * r.measured_hi:+.1f}: {says}"


def _verdicts(rows: list[Row]) -> str:
    """How many predictions the measurement shows within target, outside it, or cannot tell."""
    got = [r for r in rows if r.verdict]
    count = {v: sum(r.verdict == v for r in got) for v in ("in", "out", "noise")}
    widths = sorted(100 * (r.measured_hi - r.measured_lo) for r in got)
    out = "; ".join(f"{r.model} {r.regime} {r.budget}" for r in got if r.verdict == "out") or "none"
    return (f"Against each measured overhead's {LEVEL:.0%} interval (the rounds' ratios, order statistics of "
            f"their median; {widths[len(widths) // 2]:.1f} points wide at the median, {widths[-1]:.1f} at most): "
            f"{count['in']} of {len(got)} predictions within target of every overhead in it, {count['out']} of "
            f"none ({out}), {count['noise']} of some -- there the measurement cannot tell.")


def table(rows: list[Row]) -> str:
    lines = ["| model | regime | budget | predicted | measured | error (points) | within target "
             f"| measured, {LEVEL:.0%} interval: the target | control | wall | as given | kept | bitwise "
             "| plan; unmodified step |",
             "|---|---|---|---:|---:|---:|---|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        within = "-" if r.within is None else ("yes" if r.within else "NO")
        yn = {True: "yes", False: "NO", None: "-"}
        lines.append(f"| {r.model} | {r.regime} | {r.budget} | {_pct(r.predicted)} | {_pct(r.measured)} "
                     f"| {'-' if r.error is None else f'{100 * r.error:+.1f}'} | {within} | {_interval(r)} "
                     f"| {_pct(r.control)} "
                     f"| {_pct(r.wall)} "
                     f"| {_pct(r.as_given)} | {yn[r.kept]} | {yn[r.bitwise]} | {r.plan}; {r.note} |")
    done = [r for r in rows if r.error is not None]
    if done:
        worst = max(done, key=lambda r: abs(r.error) / tolerance(r.measured))
        held = sum(1 for r in done if r.within)
        lines.append("")
        lines.append(f"{held} of {len(done)} rows within target; worst (against its tolerance): {worst.model}, "
                     f"{worst.regime}, {worst.budget}: predicted {_pct(worst.predicted)}, measured "
                     f"{_pct(worst.measured)} ({100 * worst.error:+.1f} points). Every plan kept its budget: "
                     f"{'yes' if all(r.kept for r in done) else 'NO'}; every step bitwise: "
                     f"{'yes' if all(r.bitwise for r in done) else 'NO'}.")
        lines += ["", _verdicts(done)] if any(r.verdict for r in done) else []
        noise = sorted(abs(r.control) for r in done if r.control is not None)
        if noise:
            lines.append("")
            lines.append(f"The control (the unmodified model in a second copy, timed as the plans are) measured "
                         f"{100 * statistics.median(noise):.1f} points at the median, {100 * noise[-1]:.1f} at most: "
                         "the measurement's noise in this run.")
    return "\n".join(lines)
