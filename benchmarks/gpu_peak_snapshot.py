"""On a GPU (outside CI): what is alive at the peak of one planned step --
the CUDA allocator's own record of every allocation, grouped by the source
line that made it -- to compare with the plan's prediction.  The step runs
twice: as ``out = model(x)`` loops do (the previous output alive until the
next forward returns, the loop plans assume) and with the output dropped at
once; what differs at the two peaks is printed by source line.

    python benchmarks/gpu_peak_snapshot.py [least|70%|...]   # the plan's budget; least when not given
"""

from __future__ import annotations

import collections
import sys

import torch

import autosac
from autosac.core.budget import format_bytes, parse_budget
from autosac.core.optim import default_loss
from autosac.models import build_model
from autosac.solver import least_peak, solve_stats
from autosac.solver.problem import build_problem

BF16 = torch.bfloat16
NAME, CFG = "llama-7b", dict(batch=4, seq=4096, n_layer=16, dim=2048, n_head=16, n_kv_head=4, ffn_hidden=5632)


def _where(frames) -> str:
    for f in frames:
        name = f.get("filename", "")
        if any(k in name for k in ("autosac", "torch/utils/checkpoint", "torch/optim", "torch/autograd", "torch/amp")):
            return f"{name.split('/')[-1]}:{f.get('line')} {f.get('name')}"
    return "?"


def live_at_peak(snapshot) -> tuple[int, dict[str, int]]:
    events = [e for trace in snapshot["device_traces"] for e in trace if e["action"] in ("alloc", "free_completed")]
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    best_live = {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
            total += e["size"]
        elif e["addr"] in live:
            total -= live.pop(e["addr"])[0]
        if total > best:
            best, best_live = total, dict(live)
    groups = collections.Counter()
    for size, where in best_live.values():
        groups[where] += size
    return best, groups


def held_loop_step(model, idx, opt, held: list | None) -> None:
    """One bf16-autocast AdamW step as ``out = model(x)`` loops run it: the
    output kept in ``held`` (the previous one alive until the forward returns);
    ``held=None``: dropped once the loss exists."""
    with torch.autocast("cuda", dtype=BF16):
        out = model(idx)
        if held is not None:
            held[:] = [out]
        loss = default_loss(out)
        del out
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main():
    meta, idx = build_model(NAME, device="meta", **CFG)
    stats = autosac.profile(meta, idx, target="h100", autocast=BF16)
    problem = build_problem(stats)
    which = sys.argv[1] if len(sys.argv) > 1 else "least"
    budget = least_peak(problem, solver="highs")[0] if which == "least" else parse_budget(which, stats.peak_bytes)
    plan = solve_stats(stats, budget, solver="highs", problem=problem)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; budget {which}: "
          f"{format_bytes(plan.budget_bytes)}, {len(plan.decisions)} modules checkpointed")
    print(f"predicted {format_bytes(plan.predicted_peak_bytes)} (baseline {format_bytes(stats.peak_bytes)})")
    torch.manual_seed(0)
    model, idx = build_model(NAME, device="cuda", **CFG)
    autosac.apply(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    held: list = []  # the loop's `out`: the previous step's output lives until the next forward returns

    def step(hold: bool):
        held_loop_step(model, idx, opt, held if hold else None)

    seen = {}
    for hold in (False, True, True):  # the second held step is the steady one: an output held from before
        step(hold)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
        step(hold)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, groups = live_at_peak(snap)
        seen[hold] = groups
        print(f"\noutput held: {hold}: measured peak {format_bytes(torch.cuda.max_memory_allocated())} "
              f"(predicted {format_bytes(plan.predicted_peak_bytes)}); alive before the step "
              f"{format_bytes(before)}; made during the step and alive at its peak {format_bytes(peak)}")
        for where, size in groups.most_common(25):
            print(f"{format_bytes(size):>12}  {where}")
    held.clear()
    print("\nat the peak, held output's step less the plain one's, by source line:")
    for where in sorted(set(seen[True]) | set(seen[False])):
        if seen[True][where] != seen[False][where]:
            print(f"{format_bytes(seen[True][where] - seen[False][where]):>12}  {where}")
    opt.state.clear()  # its AdamW state would add to measure's own (6.35 GiB on this Llama)
    m = autosac.measure(model, idx, steps=0, autocast=BF16)
    print(f"\nautosac.measure (the default loop, output held): {format_bytes(m.peak_bytes)}")

if __name__ == "__main__":
    main()
