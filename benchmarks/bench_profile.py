"""Profile time and process memory of autosac.profile (issue: the trace).

Seed Transformer shape (dim 768, 12 heads, seq 1024, batch 8, vocab 8192) at
4/16/32/64 layers, and the built-in Llama at 7B shape (32 layers, dim 4096,
seq 4096, batch 1), all on ``meta``.  Each figure is the median of --repeats
runs, each in a fresh subprocess so peak RSS belongs to that profile alone.

    python benchmarks/bench_profile.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
import autosac
from autosac.models import build_model
name, layers = sys.argv[1], int(sys.argv[2])
model, idx = build_model(name, n_layer=layers)
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
stats = autosac.profile(model, idx, target="h100")
dt = time.perf_counter() - t0
print(json.dumps({"s": dt, "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "rss_before_gib": rss0 / 2**20, "ops": len(stats.timeline), "peak_gib": stats.peak_bytes / 2**30,
                  "step_ms": stats.step_ms}))
"""


def run(name: str, layers: int, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", CHILD, name, str(layers)], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return {
        "s": statistics.median(r["s"] for r in runs),
        "rss_gib": max(r["rss_gib"] for r in runs),
        **{k: runs[0][k] for k in ("ops", "peak_gib", "step_ms", "rss_before_gib")},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = [("seed-transformer", n) for n in (4, 16, 32, 64)] + [("llama-7b", 32)]
    print(f"{'model':<18}{'layers':>7}{'ops':>8}{'profile s':>11}{'peak RSS GiB':>14}{'step peak GiB':>15}{'step ms (h100)':>16}")
    results = {}
    for name, layers in rows:
        r = run(name, layers, args.repeats)
        results[(name, layers)] = r
        print(f"{name:<18}{layers:>7}{r['ops']:>8}{r['s']:>11.2f}{r['rss_gib']:>14.2f}{r['peak_gib']:>15.2f}{r['step_ms']:>16.1f}")
    t32, t64 = results[("seed-transformer", 32)]["s"], results[("seed-transformer", 64)]["s"]
    print(f"\n64-layer / 32-layer profile time: {t64 / t32:.2f}x (target <= 2.2x)")
    print(f"32-layer seed Transformer: {t32:.2f} s (target <= 5 s)")
    r7 = results[("llama-7b", 32)]
    print(f"7B Llama on meta: {r7['s']:.2f} s, {r7['rss_gib']:.2f} GiB peak RSS (target <= 20 s, < 2 GiB)")


if __name__ == "__main__":
    main()
