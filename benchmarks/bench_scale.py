"""Planning at scale, on this CPU, in fake mode (no real memory):

1. a Llama-2-70B shape (80 layers, dim 8192, 64 heads / 8 KV heads, FFN 28672,
   vocab 32000, seq 4096, batch 1) in bf16 for 64 FSDP2 ranks on H100: profile
   and solve times, and the per-rank breakdown at each plan's peak;
2. planning time of the seed Transformer against depth (16 to 128 layers).

    python benchmarks/bench_scale.py > benchmarks/results/bench_scale.md
"""

from __future__ import annotations

import statistics
import time
import warnings

import numpy as np
import torch

import autosac
from autosac.core.budget import format_bytes
from autosac.models import build_model
from autosac.solver import least_peak
from autosac.solver.problem import build_problem
from autosac.solver.sharding import gathered_params

GIB = 1 << 30


def peak_event(problem, plan) -> int:
    """The event of the plan's peak, in the solver's memory model."""
    mem = problem.live.astype(np.int64).copy()
    for c in problem.candidates:
        d = plan.details.get(c.fqn)
        if d is None:
            continue
        k = next(k for k, b in enumerate(c.discarded, start=1) if b >= d.discard_bytes)
        mem[c.start : c.end] -= c.bytes[k - 1]
        mem[c.end : c.bw_end + 1] += c.hold
    return int(mem.argmax())


def llama70b() -> None:
    world = 64
    model, idx = build_model("llama-7b", device="meta", batch=1, seq=4096, n_layer=80, dim=8192, n_head=64,
                             n_kv_head=8, ffn_hidden=28672)
    model = model.to(torch.bfloat16)
    t0 = time.perf_counter()
    stats = autosac.profile(model, idx, target="h100", world_size=world)
    t1 = time.perf_counter()
    problem = build_problem(stats)
    least, _ = least_peak(problem)
    t2 = time.perf_counter()
    print(f"## Llama-2-70B shape, bf16, {world} ranks, H100\n")
    print(f"profile {t1 - t0:.1f} s; least peak {t2 - t1:.1f} s; per-rank baseline "
          f"{format_bytes(problem.baseline_peak)}, least feasible {format_bytes(least)} "
          f"({least / problem.baseline_peak:.1%} of baseline)\n")
    print("| budget | solve | modules | peak | params | grads | optimizer | gathered | activations and the rest "
          "| recompute |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    gathered = gathered_params(stats)
    shard = {k: v / world for k, v in (("params", stats.param_bytes), ("grads", stats.grad_bytes),
                                       ("optimizer", stats.optimizer_bytes))}
    for label, budget in (("50%", "50%"), ("35%", "35%"), ("least", least)):
        t = time.perf_counter()
        plan = autosac.solve(stats, budget)
        solve_s = time.perf_counter() - t
        e = peak_event(problem, plan)
        rest = plan.predicted_peak_bytes - sum(shard.values()) - gathered[e]
        print(f"| {label} | {solve_s:.1f} s | {len(plan.decisions)} | {plan.predicted_peak_bytes / GIB:.1f} GiB "
              f"| {shard['params'] / GIB:.2f} | {shard['grads'] / GIB:.2f} | {shard['optimizer'] / GIB:.2f} "
              f"| {gathered[e] / GIB:.2f} | {rest / GIB:.1f} | {plan.overhead:+.1%} |")
    print("\n(per-rank GiB; grads shown as shards: whole gradients of the unit in its backward are in the last "
          "column; the optimizer's temporaries are shards of the optimizer's.)\n")


def depth() -> None:
    print("## Seed Transformer: planning time against depth (H100, 60 % budget)\n")
    print("Medians of 3 runs each (this machine's timings vary by about 10 %); ratio: total against")
    print("the depth before.\n")
    print("| layers | profile | solve | total | ratio | modules |")
    print("|---:|---:|---:|---:|---:|---:|")
    before = None
    for n in (16, 32, 64, 128):
        model, idx = build_model("seed-transformer", device="meta", n_layer=n)
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            stats = autosac.profile(model, idx, target="h100")
            t1 = time.perf_counter()
            plan = autosac.solve(stats, "60%")
            runs.append((t1 - t0, time.perf_counter() - t1))
        prof, solve = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        total = statistics.median(r[0] + r[1] for r in runs)
        ratio = f"{total / before:.2f}x" if before else "-"
        print(f"| {n} | {prof:.2f} s | {solve:.2f} s | {total:.2f} s | {ratio} | {len(plan.decisions)} |")
        before = total


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    llama70b()
    depth()


if __name__ == "__main__":
    main()
