"""Several runs of ``benchmarks/predict_suite.py`` side by side: which rows
miss the target in every run (the time model's), and which in some only
(this machine's noise: on the 2-core VM of the 17th session a run's count
moved from 68 to 81 of 82 within three hours, its predictions within about
a point of each other).

    python benchmarks/predict_suite_runs.py benchmarks/results/predict_suite_s17_*.md

Prints, per row, each run's predicted/measured overhead and whether it was
within target, then how many runs each row was within; exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def read_rows(path: Path) -> dict[tuple[str, str, str], tuple[float, float, bool]]:
    """(model, regime, budget) -> (predicted %, measured %, within target) of one result file's table."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 8 and cells[3] in ("mid", "least") and cells[4].endswith("%") and cells[5].endswith("%"):
            rows[(cells[1], cells[2], cells[3])] = (float(cells[4][:-1]), float(cells[5][:-1]), cells[7] == "yes")
    return rows


def compare(runs: list[dict]) -> list[str]:
    """Lines: each row's runs, then the rows outside in every run that has them."""
    keys = list(dict.fromkeys(k for run in runs for k in run))
    lines, always = [], []
    for k in keys:
        got = [run.get(k) for run in runs]
        cells = ["" if g is None else f"{g[0]:+6.1f}/{g[1]:+6.1f} {'in ' if g[2] else 'OUT'}" for g in got]
        seen = [g for g in got if g is not None]
        inside = sum(g[2] for g in seen)
        lines.append(f"{k[0]:22s} {k[1]:8s} {k[2]:5s} " + " | ".join(f"{c:18s}" for c in cells)
                     + f"  within {inside} of {len(seen)}")
        if seen and not inside:
            always.append(k)
    lines.append("")
    for i, run in enumerate(runs):
        n = len(run)
        lines.append(f"run {i + 1}: {sum(v[2] for v in run.values())} of {n} within target, mean error "
                     f"{sum(v[0] - v[1] for v in run.values()) / max(1, n):+.2f} points")
    lines.append("outside in every run: " + (", ".join(" ".join(k) for k in always) if always else "none"))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="predict_suite result files (--out), oldest first")
    a = ap.parse_args(argv)
    missing = [str(f) for f in a.files if not f.is_file()]
    if missing:
        ap.error(f"no such file: {', '.join(missing)}")
    runs = [read_rows(f) for f in a.files]
    empty = [str(f) for f, r in zip(a.files, runs) if not r]
    if empty:
        ap.error(f"no predict_suite table in: {', '.join(empty)}")
    print("\n".join(compare(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
