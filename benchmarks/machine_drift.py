"""How far this machine's speed moves on its own, minute to minute (issue 32).

The same work, timed again and again in this thread's CPU time (one torch
thread, the least of a few samples each time, half a second apart): a Python
loop and a small transformer model's training step (six pre-norm blocks at
width 64, the calibration's shallow model).  On the 2-core VM the project is
developed on, both ran at two speeds 1.6-2x apart, switching every few
seconds -- CPU time, so not another process's time slices: the host's
frequency or a sibling hardware thread.  Every host figure
(:mod:`autosac.tools.calibrate`) and every op timing (:mod:`autosac.trace.timings`)
is taken at some moment of this; a measured overhead, a ratio of steps run
side by side, is not.

    python benchmarks/machine_drift.py               # three minutes
    python benchmarks/machine_drift.py --seconds 60
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from autosac.tools.calibration_models import _Block


def _python_ms(n: int = 100_000) -> float:
    t = time.thread_time()
    s = 0
    for i in range(n):
        s += i
    return (time.thread_time() - t) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=180.0)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(64, 1) for _ in range(6)])
    x = torch.randn(2, 32, 64)

    def step_ms() -> float:
        t = time.thread_time()
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)
        return (time.thread_time() - t) * 1e3

    step_ms()
    taken, start = [], time.time()
    while time.time() - start < a.seconds:
        taken.append((time.time() - start, min(step_ms() for _ in range(5)), min(_python_ms() for _ in range(3))))
        time.sleep(0.5)
    print("| s | model step, ms | Python loop, ms |\n|---:|---:|---:|")
    for s, step, py in taken[:: max(1, len(taken) // 30)]:
        print(f"| {s:.0f} | {step:.2f} | {py:.2f} |")
    for name, col in (("model step", 1), ("Python loop", 2)):
        v = [t[col] for t in taken]
        print(f"\n{name}: least {min(v):.2f} ms, median {statistics.median(v):.2f}, most {max(v):.2f} "
              f"({max(v) / min(v):.2f}x the least), {len(v)} samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
