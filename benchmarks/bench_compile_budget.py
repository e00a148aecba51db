"""On this CPU under inductor: autosac's compiled plans against PyTorch's own
compiled memory budget (``torch._functorch.config.activation_memory_budget``),
side by side in one run -- the CPU half of issue 31's compiled comparison.

    python benchmarks/bench_compile_budget.py [--out benchmarks/results/bench_compile_budget.txt]
        [--rounds 3] [--steps 3] [--fractions 0.3,0.5,0.7] [--smoke]

A gpt2-shaped model sized for two cores (4 layers, dim 256, 4 heads, seq 256,
batch 8, vocab 4096, no dropout), fp32, AdamW, the held loop
(:func:`autosac.measure`).  Variants, each on its own copy of the same weights:

- eager (reference) and ``torch.compile`` (inductor) unbudgeted;
- ``torch.compile`` with ``activation_memory_budget`` at each fraction (the patch
  around the compile and the measured steps): its measured peak and step;
- at each of those measured peaks, autosac's compiled plan
  (``autosac.solve(model, peak, idx, target="cpu", compile="inductor")``),
  applied and compiled: predicted beside measured peak, budget kept, step, and
  step over torch's at that budget.  An ``InfeasibleBudgetError`` records the
  least compiled peak it names.

Goal (issue 31): every autosac row within its budget and no slower than
torch's at the same peak.  Timing on a shared CPU is noisy: the variants are
measured in interleaved rounds (each round measures every variant once, in
turn) and the table gives per-variant medians over rounds.  Between variants
``torch._dynamo.reset()`` drops dynamo's cache (two compiles of the same model
class would otherwise share one compiled graph whatever the budget), so each
measurement compiles anew; inductor's and AOTAutograd's on-disk caches (keyed
on the functorch config, budget included) make the rounds after the first
cheap.  Peaks come from the profiler's allocator events, not from autosac's
tracer.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import time

import torch

import autosac
from autosac.core.budget import format_bytes
from autosac.core.errors import InfeasibleBudgetError
from autosac.models import build_model

CFG = dict(n_layer=4, dim=256, n_head=4, seq=256, vocab=4096, dropout=0.0)
BATCH = 8
SMOKE_CFG = dict(n_layer=2, dim=64, n_head=2, seq=64, vocab=256, dropout=0.0)


class Variant:
    """One measured configuration: a model copy, an optional budget fraction
    patched around compile and steps, and the measurements of each round."""

    def __init__(self, name: str, model, compiled: bool = True, fraction: float | None = None):
        self.name, self.model, self.compiled, self.fraction = name, model, compiled, fraction
        self.peaks: list[int] = []
        self.steps: list[float] = []
        self.plan = None
        self.budget: int | None = None
        self.torch_ref: Variant | None = None  # torch's variant at the same budget
        self.note = ""

    def measure(self, idx, steps: int) -> None:
        torch._dynamo.reset()
        patch = (torch._functorch.config.patch(activation_memory_budget=self.fraction)
                 if self.fraction is not None else contextlib.nullcontext())
        with patch:
            runner = torch.compile(self.model) if self.compiled else self.model
            m = autosac.measure(runner, idx, steps=steps)
        self.peaks.append(m.peak_bytes)
        self.steps.append(m.step_ms)

    @property
    def peak(self) -> int:
        return int(statistics.median(self.peaks))

    @property
    def step(self) -> float:
        return statistics.median(self.steps)


def _copy(cfg, state):
    model, _ = build_model("gpt2", device="cpu", batch=BATCH, **cfg)
    model.load_state_dict(state)
    return model


def _plan_variant(theirs: Variant, cfg, state, idx) -> Variant | str:
    """autosac's compiled plan at ``theirs``' measured peak, applied to a fresh
    copy of the weights; or the note an ``InfeasibleBudgetError`` leaves."""
    model = _copy(cfg, state)
    budget = theirs.peaks[0]
    t0 = time.perf_counter()
    try:
        plan = autosac.solve(model, budget, idx, target="cpu", compile="inductor")
    except InfeasibleBudgetError as e:
        return (f"autosac at {theirs.name}'s peak {format_bytes(budget)}: infeasible, least compiled peak "
                f"{format_bytes(e.min_feasible_bytes)} ({time.perf_counter() - t0:.0f} s)")
    autosac.apply(model, plan)
    v = Variant(f"autosac @ {theirs.name.split(' ', 1)[1]}", model)
    v.plan, v.budget, v.torch_ref = plan, budget, theirs
    kind = (f"the partitioner at {plan.compiled['partitioner_budget']:.4g}" if "partitioner_budget" in plan.compiled
            else f"{len(plan.decisions)} modules")
    v.note = f"{kind}, {plan.compiled.get('rounds')} traced rounds, planned in {time.perf_counter() - t0:.0f} s"
    return v


def _spread(v: Variant) -> str:
    return f"{min(v.steps):.0f}-{max(v.steps):.0f}"


def _paired(v: Variant) -> str:
    """autosac's step over torch's measured in the same round."""
    ratios = [a / b for a, b in zip(v.steps, v.torch_ref.steps)]
    return f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})"


def _table(variants: list[Variant], unbudgeted: Variant) -> list[str]:
    rows = ["| variant | budget | predicted peak | measured peak | pred. error | kept | step (median) | "
            "rounds' range | vs torch.compile | autosac / torch at budget | same round's ratio: median (range) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in variants:
        pred = format_bytes(v.plan.predicted_peak_bytes) if v.plan else "-"
        err = f"{(v.plan.predicted_peak_bytes - v.peak) / v.peak:+.2%}" if v.plan else "-"
        kept = ("yes" if max(v.peaks) <= v.budget else "NO") if v.budget else "-"
        ratio = f"{v.step / v.torch_ref.step:.3f}x" if v.torch_ref else "-"
        paired = _paired(v) if v.torch_ref else "-"
        peak = format_bytes(v.peak) + ("" if len(set(v.peaks)) == 1 else f" (max {format_bytes(max(v.peaks))})")
        rows.append(f"| {v.name} | {format_bytes(v.budget) if v.budget else '-'} | {pred} | {peak} | {err} | {kept} "
                    f"| {v.step:.1f} ms | {_spread(v)} ms | {v.step / unbudgeted.step:.3f}x | {ratio} | {paired} |")
    return rows


def _header(cfg, args) -> list[str]:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return [f"# autosac compiled plans against activation_memory_budget on the CPU ({datetime.date.today()})", "",
            f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} torch threads (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
            f"load average at start {load:.2f}",
            f"gpt2 {cfg}, batch {BATCH}, fp32, AdamW, held loop; inductor; {args.rounds} interleaved rounds "
            f"of {args.steps} timed steps per variant (step = median over rounds of each round's median)", ""]


def run(args) -> list[str]:
    cfg = SMOKE_CFG if args.smoke else CFG
    torch.manual_seed(0)
    base, idx = build_model("gpt2", device="cpu", batch=BATCH, **cfg)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    fractions = [float(f) for f in args.fractions.split(",")]
    t_start = time.perf_counter()
    unbudgeted = Variant("torch.compile", _copy(cfg, state))
    theirs = [Variant(f"torch.compile budget={f}", _copy(cfg, state), fraction=f) for f in fractions]
    variants = [Variant("eager", _copy(cfg, state), compiled=False), unbudgeted, *theirs]
    for v in variants:  # the first round: torch's peaks, which autosac's plans are made for
        v.measure(idx, args.steps)
        print(f"{v.name}: peak {format_bytes(v.peaks[-1])}, step {v.steps[-1]:.1f} ms", flush=True)
    notes = []
    for t in theirs:
        planned = _plan_variant(t, cfg, state, idx)
        if isinstance(planned, str):
            notes.append(planned)
            print(planned, flush=True)
            continue
        planned.measure(idx, args.steps)
        print(f"{planned.name}: {planned.note}; peak {format_bytes(planned.peaks[-1])}, step {planned.steps[-1]:.1f} ms",
              flush=True)
        variants.append(planned)
    for r in range(1, args.rounds):
        for v in variants:
            v.measure(idx, args.steps)
        print(f"round {r + 1} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    out = _header(cfg, args) + _table(variants, unbudgeted) + [""]
    out += [f"- {v.name}: {v.note}; eager plan predicted {format_bytes(v.plan.compiled['eager_peak_bytes'])}, "
            f"predicted overhead {v.plan.overhead:+.1%}" for v in variants if v.plan]
    out += [f"- {n}" for n in notes]
    out.append(f"\nwhole run {time.perf_counter() - t_start:.0f} s")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/bench_compile_budget.txt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fractions", default="0.3,0.5,0.7")
    p.add_argument("--smoke", action="store_true", help="a tiny model, one round of one step: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 1
    out = run(args)
    text = "\n".join(out) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
