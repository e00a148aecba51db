"""Why the per-MiB host figures move between calibrations (issue 32), on this CPU.

The calibration (``autosac.tools.calibrate``) takes ``untimed_us_per_mib`` and
its kin from the large calibration model's step less the kernel timings the
trace took of its ops at profile time (cached).  This script takes sets of
24 calibration rounds in one process and prints, per set, the median of each
per-MiB figure two ways:

* ``raw``: as the calibration computes it, against the cached kernel timings;
* ``scaled``: those timings scaled, in each round, by the speed of the same
  kernels timed again in that round (forward and backward apart: the least of
  two calls of each of the large model's timed ops, over their cached timings).

Run it in several processes (``AUTOSAC_REMEASURE=1`` for fresh kernel
timings): if the scaled figures agree across processes where the raw ones do
not, the spread is the kernel timings' moment; if neither agrees, it is the
step's own host time.  2026-11-26 on the 2-core VM: raw 141-205, scaled
101-154 over seven sets in three processes; within one process raw 192-205.
So the scaling was not adopted (``docs/step-time-history.md``).

    python benchmarks/check_calibration_drift.py [sets]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from autosac.core.opkinds import is_view_op
from autosac.tools import calibrate, calibration_figures
from autosac.trace.costs import real_inputs, timing_key
from autosac.trace.timings import TimingCache

FIGURES = ("untimed_us_per_mib", "backward_untimed_us_per_mib", "selective_us_per_mib")


def timed_ops(model, x) -> dict[str, list]:
    """The large model's timed op calls of one step, by phase: (cached ms, op, real args, real kwargs)."""
    calls = []

    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not is_view_op(func):
                calls.append((func, *tree_map(meta, (args, kwargs)), torch._C._current_autograd_node() is not None))
            return func(*args, **kwargs)

    with Record():
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    cache, ops = TimingCache(), {"forward": [], "backward": []}
    for func, args, kwargs, backward in calls:
        ms = cache.get(timing_key(func, args, kwargs))
        if not ms:
            continue
        try:
            real_args, real_kwargs = real_inputs(args, kwargs)
        except RuntimeError:  # inputs that cannot be made: the trace priced it on the roofline
            continue
        ops["backward" if backward else "forward"].append((ms, func, real_args, real_kwargs))
    return ops


def speed(ops: dict[str, list]) -> dict[str, float]:
    """Per phase: the ops' time now (the least of two calls each) over their cached timings."""
    out = {}
    for phase, calls in ops.items():
        now = 0.0
        for _, func, args, kwargs in calls:
            least = float("inf")
            for _ in range(2):
                t0 = time.thread_time()
                func(*args, **kwargs)
                least = min(least, time.thread_time() - t0)
            now += least * 1e3
        out[phase] = now / sum(c[0] for c in calls)
    return out


def main(sets: int = 2) -> None:
    torch.set_num_threads(1)
    models, variants, inputs = calibrate._benchmark()
    ops = timed_ops(models["large"]["variants"]["none"], inputs[("large", "none")])
    print("timed ops:", {k: len(v) for k, v in ops.items()})
    speed(ops)  # each op called once: first calls are slow
    timeline = models["large"]["stats"].timeline
    cached = list(timeline.ms)

    def scaled_figures(samples, ratio):
        timeline.ms[:] = [ms * ratio[phase if phase == "backward" else "forward"]
                          for ms, phase in zip(cached, timeline.phases)]
        try:
            return calibration_figures.round_figures(models, samples)
        finally:
            timeline.ms[:] = cached

    calibrate._take_round(variants, inputs)  # warm-up
    for s in range(sets):
        raw, scaled, ratios = [], [], []
        for _ in range(24):
            samples, _ = calibrate._take_round(variants, inputs)
            ratio = speed(ops)
            ratios.append(ratio["forward"])
            raw.append(calibration_figures.round_figures(models, samples))
            scaled.append(scaled_figures(samples, ratio))

        def med(rows, k):
            return round(statistics.median(r[k] for r in rows), 1)
        print(f"set {s}: kernel speed {min(ratios):.2f}-{max(ratios):.2f} | raw "
              + " ".join(f"{k} {med(raw, k)}" for k in FIGURES) + " | scaled "
              + " ".join(f"{k} {med(scaled, k)}" for k in FIGURES), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
