"""A ``benchmarks/predict_suite.py`` run's plans priced with other host
figures, against that run's measured overheads: how much of a run's error is
its calibration's, in about two minutes instead of a 20-minute run (issue 32).

A run measures its overheads side by side, in interleaved rounds: a ratio
this VM's drift (``benchmarks/machine_drift.py``: the same work at two speeds
1.6-2x apart, switching every few seconds) moves little.  Its predictions
come from one calibration, taken at some moment of that drift.  This script
re-solves each row's plan with the run's own host figures (read from the
foot of its table, or ``--run-figures``), checks that they give back the
run's predictions, then prices the same plans (``plan_from_decisions``)
with each other set of figures: ``--calibrations N`` fresh ones measured now
(:func:`autosac.tools.calibrate.measure_once`) and any ``--figures``.  Each
set's count of rows within target (``paired_rounds.within``) and its mean
error say what that calibration would have scored in that run.

The op timings are this machine's cached ones, as the run's (taken again
where they expired: a row's prediction with the run's own figures may then
move a little -- printed beside the run's).  Run it on the machine and
glibc setting of the run (it sets ``predict_suite``'s, re-executing itself).

    python benchmarks/reprice_suite.py benchmarks/results/predict_suite_s20_v26.md --calibrations 3
    python benchmarks/reprice_suite.py RUN.md --figures "HostCosts(op_us=11.4, checkpoint_call_us=190.0, ...)"
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

import predict_suite as ps
import torch
from paired_rounds import within
from predict_suite_runs import read_rows

import autosac  # noqa: E402  (predict_suite put tests/ on the path)
from autosac.core.devices import DEVICES
from autosac.core.host import HostCosts
from autosac.solver import plan_from_decisions
from autosac.tools.calibrate import measure_once


def read_run(path: Path) -> tuple[dict[tuple[str, str, str], tuple[float, float]], str | None]:
    """(model, regime, budget) -> (predicted, measured) overheads (fractions) of a
    result file's table (:func:`predict_suite_runs.read_rows`), and the
    ``HostCosts(...)`` at its foot (None: not there)."""
    rows = {k: (p / 100, m / 100) for k, (p, m, _) in read_rows(path).items()}
    feet = re.findall(r"^host figures: (HostCosts\(.*\))\s*$", path.read_text(), flags=re.M)
    return rows, feet[-1] if feet else None


def parse_figures(text: str) -> HostCosts:
    """``HostCosts(name=value, ...)`` as printed, back into figures."""
    inner = re.fullmatch(r"\s*HostCosts\((.*)\)\s*", text)
    if inner is None:
        raise ValueError(f"not HostCosts(...): {text[:60]!r}")
    pairs = [p.split("=", 1) for p in inner.group(1).split(",") if p.strip()]
    return HostCosts(**{k.strip(): None if v.strip() == "None" else float(v) for k, v in pairs})


def price(name: str, regime: str, figures: dict[str, HostCosts]) -> dict[str, dict[str, float]]:
    """budget -> figures' label -> predicted overhead of the run's plan for one model
    and regime (the plan solved as predict_suite solves it, with the figures labelled "run")."""
    build, _ = ps.MODELS[name]
    torch.manual_seed(0)
    model, inputs, loss_fn = build(ps._sizes(regime))
    loss_fn = loss_fn or (lambda out: out)
    stats = {k: autosac.profile(model, inputs, target=dataclasses.replace(DEVICES["cpu"], host=h),
                                optimizer="adamw", loss_fn=loss_fn) for k, h in figures.items()}
    least = autosac.solve(stats["run"], "least")
    plans = {"mid": autosac.solve(stats["run"], (least.predicted_peak_bytes + least.baseline_peak_bytes) // 2),
             "least": least}
    out = {}
    for budget, plan in plans.items():
        out[budget] = {}
        for k, s in stats.items():
            p = plan_from_decisions(s, plan.decisions) if plan.decisions else None
            out[budget][k] = p.step_ms / p.baseline_step_ms - 1 if p is not None else 0.0
    return out


def report(rows: dict, priced: dict, labels: list[str]) -> list[str]:
    """The table (each set's prediction, ``!`` outside target) and each set's score."""
    lines = ["| model | regime | budget | measured | the run's | " + " | ".join(labels[1:]) + " |",
             "|---|---|---|---:|---:|" + "---:|" * len(labels[1:])]
    for key, (predicted, measured) in rows.items():
        got = priced.get(key)
        if got is None:
            continue
        cells = [f"{got[k]:+.1%}{'' if within(got[k], measured) else ' !'}" for k in labels]
        lines.append(f"| {' | '.join(key)} | {measured:+.1%} | {predicted:+.1%} / {cells[0]} | "
                     + " | ".join(cells[1:]) + " |")
    lines.append("")
    for k in labels:
        pairs = [(priced[key][k], m) for key, (_, m) in rows.items() if key in priced]
        inside = sum(within(p, m) for p, m in pairs)
        lines.append(f"{k}: {inside} of {len(pairs)} within target, mean error "
                     f"{statistics.mean(p - m for p, m in pairs) * 100:+.1f} points, mean |error| "
                     f"{statistics.mean(abs(p - m) for p, m in pairs) * 100:.1f}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a predict_suite result file (--out)")
    ap.add_argument("--run-figures", help="the run's HostCosts(...), where its table's foot lacks them")
    ap.add_argument("--calibrations", type=int, default=0, help="fresh calibrations to measure now and compare")
    ap.add_argument("--figures", action="append", default=[], help="another HostCosts(...) to compare")
    a = ap.parse_args(argv)
    if not a.run.is_file():
        ap.error(f"no such file: {a.run}")
    rows, at_foot = read_run(a.run)
    if not rows:
        ap.error(f"no predict_suite table in {a.run}")
    if (a.run_figures or at_foot) is None:
        ap.error(f"{a.run} names no host figures at its foot: give them with --run-figures 'HostCosts(...)'")
    ps.keep_freed_memory()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    figures = {"run": parse_figures(a.run_figures or at_foot)}
    figures.update({f"given {i + 1}": parse_figures(f) for i, f in enumerate(a.figures)})
    for i in range(a.calibrations):
        figures[f"calibration {i + 1}"] = measure_once()
        print(f"calibration {i + 1}: {figures[f'calibration {i + 1}']}", file=sys.stderr, flush=True)
    started, priced = time.perf_counter(), {}
    for name, regime in dict.fromkeys((m, r) for m, r, _ in rows):
        for budget, got in price(name, regime, figures).items():
            priced[(name, regime, budget)] = got
    print("\n".join(report(rows, priced, list(figures))))
    print(f"\n(the run's column: as its table printed it / as priced now; {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
