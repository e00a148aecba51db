"""Step time of plans against the alternatives, on this CPU, side by side in one
run: where a step is almost all dispatch (the built-in GPT or Llama at width
64) and where it is compute (the benchmark GPT, 6 x 512).

Variants, measured in turn with rounds interleaved (medians of the timed steps):

  none                  the unmodified model (where it fits the budget)
  torch ckpt            torch.utils.checkpoint of every block
  torch sac matmuls     torch's selective checkpointing of every block, matmuls and attention saved
  autosac <budget>      autosac's plan for 90 %, 70 %, 50 % and the least feasible budget
  autosac = <variant>   autosac's plan for the measured peak of torch ckpt / torch sac matmuls:
                        the same memory, the step time side by side

Each row gives the measured peak (profiler allocator events, the held-output
loop autosac plans for, no optimizer) and whether it is within the budget,
the step time and its ratio to the unmodified step, and for autosac's plans
the predicted overhead (recompute and checkpointing machinery, the host costs
calibrated on this machine: autosac.tools.calibrate) beside the measured one.  Under each
budget: autosac against torch ckpt, and against the fastest variant within
that budget.

    python benchmarks/bench_dispatch_overhead.py [gpt2|llama-tiny|gpt2-512] [rounds]
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
from autosac.core.optim import default_loss
from autosac.models import build_model

CONFIGS = {
    "gpt2": ("gpt2", dict(n_layer=6, dim=64, n_head=4, seq=64, vocab=128, batch=2)),
    "llama-tiny": ("llama-tiny", dict(n_layer=6, dim=64, n_head=4, seq=64, vocab=128, batch=2, n_kv_head=4,
                                      ffn_hidden=128)),
    "gpt2-512": ("gpt2", dict(n_layer=6, dim=512, n_head=8, seq=512, vocab=4096, batch=4, dropout=0.0)),
}
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default}


def _save_matmuls(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _blocks(m):
    return m.blocks if hasattr(m, "blocks") else m.layers


def _wrapped(model, context_fn=None):
    m = copy.deepcopy(model)
    for b in _blocks(m):
        kw = {"context_fn": context_fn} if context_fn else {}
        b.forward = functools.partial(checkpoint, b.forward, use_reentrant=False, **kw)
    return m


def setup(default: str, default_rounds: int):
    """The model named on the command line (``argv[1]``), built and profiled
    for this CPU on one thread: ``(name, rounds, cfg, model, idx, stats)``."""
    name = sys.argv[1] if len(sys.argv) > 1 else default
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else default_rounds
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    builder, cfg = CONFIGS[name]
    torch.manual_seed(0)
    model, idx = build_model(builder, device="cpu", **cfg)
    return name, rounds, cfg, model, idx, autosac.profile(model, idx, target="cpu", optimizer="none")


def main() -> None:
    name, rounds, cfg, model, idx, stats = setup("gpt2", 8)
    plans = {}
    for budget in ("90%", "70%", "50%", "least"):
        try:
            plans[budget] = autosac.solve(stats, budget)
        except autosac.InfeasibleBudgetError:
            pass
    variants = {"none": model, "torch ckpt": _wrapped(model),
                "torch sac matmuls": _wrapped(model, functools.partial(create_selective_checkpoint_contexts,
                                                                        _save_matmuls))}
    peaks = {k: autosac.measure(m, idx, steps=0, optimizer="none").peak_bytes for k, m in variants.items()}
    for theirs in ("torch ckpt", "torch sac matmuls"):  # autosac at the same memory as each alternative
        try:
            plans[f"= {theirs}"] = autosac.solve(stats, peaks[theirs])
        except autosac.InfeasibleBudgetError:
            pass
    for budget, plan in plans.items():
        variants[f"autosac {budget}"] = autosac.apply(copy.deepcopy(model), plan)
        peaks[f"autosac {budget}"] = autosac.measure(variants[f"autosac {budget}"], idx, steps=0,
                                                     optimizer="none").peak_bytes
    times = _timed(variants, idx, rounds)
    base = times["none"]
    host = stats.target["host"]
    print(f"{name} {cfg}, {rounds} rounds of 5 steps; host costs {host}")
    print(f"predicted unmodified step {stats.step_ms:.2f} ms, measured {base:.2f} ms\n")
    print("| variant | peak MiB | step ms | x none | predicted overhead | measured overhead | plan |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for k, t in times.items():
        plan = plans.get(k.removeprefix("autosac ")) if k.startswith("autosac") else None
        pred = f"{plan.overhead:+.1%}" if plan else "-"
        what = "-"
        if plan:
            sel = sum(1 for d in plan.details.values() if d.save or d.writes_outside)
            what = f"{len(plan.decisions)} modules, {sel} selective; machinery {plan.mechanism_ms:.2f} ms"
        print(f"| {k} | {peaks[k] / 2**20:.2f} | {t:.2f} | {t / base:.2f} | {pred} | {t / base - 1:+.1%} | {what} |")
    print()
    for budget, plan in plans.items():
        ours = times[f"autosac {budget}"]
        within = {k: t for k, t in times.items() if peaks[k] <= plan.budget_bytes and not k.startswith("autosac")}
        best = min(within.items(), key=lambda kv: kv[1]) if within else None
        kept = peaks[f"autosac {budget}"] <= plan.budget_bytes
        line = (f"{budget} (budget {plan.budget_bytes / 2**20:.2f} MiB, kept: {'yes' if kept else 'NO'}): autosac "
                f"{ours:.2f} ms, {ours / times['torch ckpt']:.2f}x torch ckpt")
        if best:
            line += f", {ours / best[1]:.2f}x the fastest alternative within the budget ({best[0]})"
        else:
            line += ", no alternative within the budget"
        err = plan.overhead - (ours / base - 1)
        line += f"; overhead predicted {plan.overhead:+.1%}, measured {ours / base - 1:+.1%} ({err:+.1%} points)"
        print(line)


def _timed(variants: dict, idx, rounds: int) -> dict[str, float]:
    held = []

    def step(m):
        out = m(idx)
        held[:] = [out]  # the loop autosac plans for: the output kept through backward
        default_loss(out).backward()
        m.zero_grad(set_to_none=True)

    samples: dict[str, list[float]] = {k: [] for k in variants}
    for m in variants.values():
        step(m)
    for _ in range(rounds):
        for k, m in variants.items():
            step(m)
            for _ in range(5):
                t = time.perf_counter()
                step(m)
                samples[k].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


if __name__ == "__main__":
    main()
