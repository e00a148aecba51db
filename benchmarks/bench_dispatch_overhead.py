"""Per-op Python cost of an applied plan, on this CPU: the built-in GPT (and
Llama) at width 64, where op time is negligible and a step is almost all
dispatch.  Variants measured in turn, rounds interleaved, medians:

  none                 the unmodified model
  torch ckpt           torch.utils.checkpoint of every block
  torch sac            torch's selective checkpointing of every block, recompute everything
  autosac              autosac's least-peak plan (selective where it saves calls)
  all-recompute plain  the same modules recomputed whole: the plain path (no dispatch mode)
  all-recompute modes  the same, forced through the selective path (as a module writing outside would be)

    python benchmarks/bench_dispatch_overhead.py [gpt2|llama-tiny] [rounds]
"""

from __future__ import annotations

import copy
import functools
import statistics
import sys
import time
import warnings

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import autosac
from autosac.models import build_model
from autosac.optim import default_loss
from autosac.solver import least_peak, solve_stats
from autosac.solver.problem import build_problem


def _recompute_all(ctx, func, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _blocks(m):
    return m.blocks if hasattr(m, "blocks") else m.layers


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    cfg = dict(n_layer=6, dim=64, n_head=4, seq=64, vocab=128, batch=2)
    if name.startswith("llama"):
        cfg.update(n_kv_head=4, ffn_hidden=128)
    torch.manual_seed(0)
    model, idx = build_model(name, device="cpu", **cfg)

    def step(m):
        default_loss(m(idx)).backward()
        m.zero_grad(set_to_none=True)

    ck, sac = copy.deepcopy(model), copy.deepcopy(model)
    for b in _blocks(ck):
        b.forward = functools.partial(checkpoint, b.forward, use_reentrant=False)
    for b in _blocks(sac):
        b.forward = functools.partial(checkpoint, b.forward, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, _recompute_all))
    stats = autosac.profile(model, idx, target="cpu")
    problem = build_problem(stats)
    plan = solve_stats(stats, least_peak(problem)[0], problem=problem)
    whole, forced = copy.deepcopy(plan), copy.deepcopy(plan)
    for d in whole.details.values():
        d.save = []
    for d in forced.details.values():
        d.save, d.writes_outside = [], True
    variants = [("none", model), ("torch ckpt", ck), ("torch sac", sac),
                ("autosac", autosac.apply(copy.deepcopy(model), plan)),
                ("all-recompute plain", autosac.apply(copy.deepcopy(model), whole)),
                ("all-recompute modes", autosac.apply(copy.deepcopy(model), forced))]
    times: dict[str, list[float]] = {label: [] for label, _ in variants}
    for _ in range(rounds):
        for label, m in variants:
            step(m)
            for _ in range(10):
                t = time.perf_counter()
                step(m)
                times[label].append(time.perf_counter() - t)
    base = statistics.median(times["none"])
    print(f"{name} {cfg}: plan checkpoints {len(plan.decisions)} modules "
          f"({sum(1 for d in plan.details.values() if d.save)} selectively)")
    for label, ts in times.items():
        t = statistics.median(ts)
        print(f"  {label:20s} {t * 1e3:7.2f} ms  {t / base:.2f}x")


if __name__ == "__main__":
    main()
