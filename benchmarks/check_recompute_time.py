"""Is the time model right about what recomputing costs, op by op?  On this
CPU, for one model: the unmodified step and every block checkpointed whole
(autosac's plain path), each timed for real, against the trace's prediction;
then torch.profiler's per-op self times for the forward of one block, against
the trace's timings of the same ops (the kernels a replay re-runs).

    python benchmarks/check_recompute_time.py [gpt2-512|gpt2|llama-tiny] [rounds]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections import defaultdict

import torch

import autosac
from autosac.core.optim import default_loss
from autosac.solver import plan_from_decisions

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_dispatch_overhead import setup  # noqa: E402


def _step(m, idx):
    default_loss(m(idx)).backward()
    m.zero_grad(set_to_none=True)


def main() -> None:
    name, rounds, cfg, model, idx, stats = setup("gpt2-512", 3)
    blocks = [f for f in stats.modules if f.count(".") == 1 and f.split(".")[0] in ("blocks", "layers")]
    plan = plan_from_decisions(stats, dict.fromkeys(blocks, 1.0))
    whole = autosac.apply(copy.deepcopy(model), plan)
    variants = {"none": model, "every block": whole}
    samples = defaultdict(list)
    for m in variants.values():
        _step(m, idx)
    for _ in range(rounds):
        for k, m in variants.items():
            for _ in range(3):
                t = time.perf_counter()
                _step(m, idx)
                samples[k].append((time.perf_counter() - t) * 1e3)
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"{name}: predicted step {stats.step_ms:.1f} ms, measured {med['none']:.1f} ms "
          f"(x{stats.step_ms / med['none']:.2f})")
    print(f"every block whole: predicted recompute {plan.recompute_ms:.1f} ms (machinery {plan.mechanism_ms:.1f}), "
          f"measured {med['every block'] - med['none']:.1f} ms")

    # per op: the first block's forward, traced against torch.profiler's self CPU time
    m = stats.modules[blocks[0]]
    w0, w1 = m.fw_windows[0]
    traced = defaultdict(float)
    for e in range(w0, w1):
        traced[stats.timeline.ops[e]] += stats.timeline.ms[e]
    block = model.get_submodule(blocks[0])
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["dim"], requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            block(x)
    real = defaultdict(float)
    for ev in prof.key_averages():
        if ev.key.startswith("aten::"):
            real[ev.key.removeprefix("aten::")] += ev.self_cpu_time_total / 1e3 / 5
    print(f"\n{blocks[0]} forward, per op (ms): traced vs profiler self time")
    for op, ms in sorted(traced.items(), key=lambda kv: -kv[1]):
        print(f"  {op:40s} {ms:8.3f} {real.get(op, float('nan')):8.3f}")
    print(f"  {'total':40s} {sum(traced.values()):8.3f} {sum(real.values()):8.3f}")


if __name__ == "__main__":
    main()
