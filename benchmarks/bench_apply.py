"""Plans applied for real on this CPU (issue: apply + verify).

GPT (6 layers, dim 512, 8 heads, seq 512, batch 8, vocab 8192, dropout 0.1),
budgets from the least feasible peak to 90% of the unconstrained one, all in one
run so the ratios are measured side by side:

  (a) autosac's plan (profiled with target="cpu", ops timed on this machine)
  (b) full activation checkpointing of every block (torch.utils.checkpoint)
  (c) PyTorch's own sac_milp decisions (torch.distributed._tools), applied by autosac
  (d) torch.compile(backend="aot_eager_decomp_partition") (or --backend inductor) with
      torch._functorch.config.activation_memory_budget at the same fraction
  (e) no checkpointing
  (f) with --compiled-plan: autosac's plan applied, then torch.compile(backend="aot_eager")
      (or --backend inductor): the decisions as the partitioner's recompute tags
  (g) with --fit-compile: a plan fitted to the compiled step
      (autosac.solve(..., compile=BACKEND)), applied, then torch.compile(backend=BACKEND)

Peaks come from the profiler's allocator events (autosac.measure).  Step times
are medians of --rounds steps, taken in turn across the methods of one budget
(and an unmodified model among them), so drift on this shared machine hits all
alike.  Overhead is step time over (e)'s in the same group -- and for (d) also
over its own unbudgeted compiled step (and (f), (g) over that step too: "vs own").

    python benchmarks/bench_apply.py [--rounds 3] [--skip-compile] [--skip-torch-sac] [--compiled-plan] [--fit-compile]
        [--fracs 0.5] [--backend aot_eager|inductor]
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
import warnings

import torch

import autosac
from autosac.core.optim import make_optimizer
from autosac.models import build_model
from autosac.solver import least_peak, plan_from_decisions
from autosac.solver.problem import build_problem

MIB = 2**20
# --model gpt2 (the default: attention written out, dropout 0.1) or llama
# (SDPA attention, no dropout), at the same width, depth and sequence
MODELS = {
    "gpt2": dict(n_layer=6, dim=512, n_head=8, seq=512, vocab=8192, dropout=0.1),
    "llama-tiny": dict(n_layer=6, dim=512, n_head=8, n_kv_head=8, ffn_hidden=1376, seq=512, vocab=8192),
}
NAME = "gpt2"
CFG = MODELS[NAME]
BATCH = 8


def build():
    torch.manual_seed(0)
    return build_model(NAME, device="cpu", batch=BATCH, **CFG)


def full_ac(model):
    from torch.utils.checkpoint import checkpoint

    for block in getattr(model, "blocks", None) or model.layers:
        inner = type(block).forward.__get__(block)
        block.forward = lambda *a, inner=inner, **kw: checkpoint(inner, *a, use_reentrant=False, **kw)
    return model


def torch_sac_decisions(frac: float) -> dict[str, float]:
    """PyTorch's pipeline on the same GPT under FakeTensorMode: MemTracker,
    RuntimeEstimator and SACEstimator, aggregate_stats, sac_milp at ``frac`` of
    its own baseline peak.  Its roofline needs CUDA, so it is handed an H100's
    peak FLOP/s and bandwidth (its decisions are made for that device)."""
    import torch.utils._runtime_estimation as rte
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.ilp_utils import aggregate_stats, get_peak_memory_runtime_baseline, parse_module_info
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator
    from torch.distributed._tools.sac_ilp import sac_milp

    rte.get_device_tflops = lambda dtype: 989.0 if dtype in (torch.float16, torch.bfloat16) else 67.0
    rte.get_gpu_dram_gbps = lambda: 3350.0
    real_available = torch.cuda.is_available
    dev = torch.device("cpu")
    try:
        torch.cuda.is_available = lambda: True
        with FakeTensorMode():
            model, idx = build_model(NAME, device="cpu", batch=BATCH, **CFG)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

            def step():
                model(idx).float().sum().backward()
                opt.step()
                opt.zero_grad()

            mem = MemTracker()
            mem.track_external(model, opt)
            with mem:
                for it in range(2):
                    step()
                    if it == 0:
                        mem.reset_mod_stats()
            runtime = RuntimeEstimator()
            with runtime("operator-level-cost-model"):
                step()
            sac = SACEstimator()
            with sac("operator-level-cost-model"):
                model(idx).float().sum().backward()
            graph = parse_module_info(aggregate_stats(model, mem, runtime, sac, dev))
            base, _ = get_peak_memory_runtime_baseline(graph)
            decisions, _, _ = sac_milp(graph, memory_budget=frac * base / 2**30)
    finally:
        torch.cuda.is_available = real_available
    # "GPT.blocks.0" -> "blocks.0"
    return {k.split(".", 1)[1] if "." in k else "": float(v) for k, v in decisions.items()}


class UnderBudget(torch.nn.Module):
    """A compiled model whose calls (where compilation happens) run with
    torch._functorch.config.activation_memory_budget = frac."""

    def __init__(self, compiled, frac: float):
        super().__init__()
        self.compiled, self.frac = compiled, frac

    def forward(self, *args, **kwargs):
        import torch._functorch.config as fconfig

        with fconfig.patch(activation_memory_budget=self.frac):
            return self.compiled(*args, **kwargs)


BACKEND = "aot_eager"  # --backend: what (f) and (g) compile with; (d) uses its decomposing twin for aot_eager
BUDGETED_BACKEND = {"aot_eager": "aot_eager_decomp_partition", "inductor": "inductor"}


def compiled(model, frac: float):
    import torch._dynamo

    torch._dynamo.reset()
    return UnderBudget(torch.compile(model, backend=BUDGETED_BACKEND[BACKEND]), frac)


class Stepper:
    """One method's model with its own AdamW, stepped one training step at a time."""

    def __init__(self, label, model, budget=None, plan=None, reference=None):
        self.label, self.model, self.budget, self.plan, self.reference = label, model, budget, plan, reference
        self.opt = make_optimizer("adamw", list(model.parameters()))
        self.times: list[float] = []
        self.peak = 0

    def step(self, idx) -> None:
        t0 = time.perf_counter()
        self.model(idx).float().sum().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.times.append((time.perf_counter() - t0) * 1e3)

    @property
    def ms(self) -> float:
        return statistics.median(self.times)


def run_group(steppers, base, idx, rounds, rows, title):
    """Peak of each method (profiler allocator events), then ``rounds`` rounds
    of one step per method in turn, each round opened by an unmodified step
    and the last one closed by one.  A method's overhead is the median over
    rounds of its step over the mean of the two unmodified steps around it:
    this shared machine drifts by 10-20% over tens of seconds, which such
    adjacent ratios cancel."""
    print(title, flush=True)
    none = Stepper("(e) none", base())
    for s in [none, *steppers]:
        s.peak = autosac.measure(s.model, idx, steps=1).peak_bytes
        s.step(idx)  # this stepper's own warm-up (optimizer state)
        s.times.clear()
    for _ in range(rounds):
        none.step(idx)
        for s in steppers:
            s.step(idx)
    none.step(idx)
    for s in [none, *steppers]:
        ratios = [t / ((none.times[r] + none.times[r + 1]) / 2) for r, t in enumerate(s.times[:rounds])]
        row = dict(method=s.label, budget=s.budget, peak=s.peak, ms=s.ms, base_ms=none.ms,
                   overhead=statistics.median(ratios) - 1, spread=max(ratios) - min(ratios))
        if s.plan is not None:
            row.update(pred_peak=s.plan.predicted_peak_bytes, pred_ms=s.plan.step_ms)
        if s.reference is not None:
            row["ref"] = s.reference.label
            row["vs_ref"] = s.ms / s.reference.ms - 1
        rows.append(row)
        b = f"{s.budget / MIB:8.1f}" if s.budget else "       -"
        print(f"  {s.label:<14} budget {b} MiB  peak {s.peak / MIB:8.1f} MiB  step {s.ms:8.1f} ms "
              f"overhead {row['overhead']:+6.1%} (steps {', '.join(f'{t:.0f}' for t in s.times)})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per method, interleaved")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--skip-torch-sac", action="store_true")
    ap.add_argument("--compiled-plan", action="store_true", help="also (f): the plan under torch.compile")
    ap.add_argument("--fit-compile", action="store_true",
                    help="also (g): a plan fitted to the compiled step (solve(..., compile=BACKEND)), compiled")
    ap.add_argument("--backend", choices=sorted(BUDGETED_BACKEND), default="aot_eager",
                    help="the torch.compile backend of (d), (f) and (g)")
    ap.add_argument("--fracs", default=None, help="budgets as fractions of the peak, e.g. 0.5,0.7")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    args = ap.parse_args()
    global NAME, CFG, BACKEND
    NAME, CFG, BACKEND = args.model, MODELS[args.model], args.backend
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)

    base_model, idx = build()
    stats = autosac.profile(base_model, idx, target="cpu")
    problem = build_problem(stats)
    low, _ = least_peak(problem)
    peak = stats.peak_bytes
    fracs = sorted({math.ceil(1000 * low / peak) / 1000, 0.5, 0.6, 0.7, 0.8, 0.9})
    fracs = [f for f in fracs if f * peak >= low]
    if args.fracs:
        fracs = [float(f) for f in args.fracs.split(",")]
    print(f"{NAME} {CFG}, batch {BATCH}: traced peak {peak / MIB:.1f} MiB, least feasible {low / MIB:.1f} MiB "
          f"({low / peak:.1%}), predicted step {stats.step_ms:.0f} ms\n")

    rows: list[dict] = []
    def fresh():
        return copy.deepcopy(base_model)

    group = [Stepper("(b) full AC", full_ac(fresh()))]
    compile_ref = None
    if not args.skip_compile:
        compile_ref = Stepper("(d) compile", compiled(copy.deepcopy(base_model), 1.0))
        group.append(compile_ref)
    run_group(group, fresh, idx, args.rounds, rows, "no budget")
    for frac in fracs:
        budget = int(frac * peak)
        plan = autosac.solve(stats, budget)
        group = [Stepper("(a) autosac", autosac.apply(copy.deepcopy(base_model), plan), budget, plan)]
        if not args.skip_torch_sac:
            try:
                decisions = torch_sac_decisions(frac)
                usable = {k: v for k, v in decisions.items() if k in {c.fqn for c in problem.candidates}}
                tplan = plan_from_decisions(stats, usable, budget)
                group.append(Stepper("(c) torch sac", autosac.apply(copy.deepcopy(base_model), tplan), budget, tplan))
            except Exception as e:  # noqa: BLE001 - report, do not invent numbers
                print(f"  (c) torch sac    failed: {type(e).__name__}: {str(e)[:120]}")
        if not args.skip_compile:
            group.append(Stepper("(d) compile", compiled(copy.deepcopy(base_model), frac), budget,
                                 reference=compile_ref))
        if args.compiled_plan:
            torch._dynamo.reset()
            planned = torch.compile(autosac.apply(copy.deepcopy(base_model), plan), backend=BACKEND)
            group.append(Stepper("(f) autosac+cc", UnderBudget(planned, 1.0), budget, plan, reference=compile_ref))
        if args.fit_compile:
            t0 = time.perf_counter()
            try:
                fitted = autosac.solve(base_model, budget, idx, target="cpu", compile=BACKEND)
            except autosac.InfeasibleBudgetError as e:
                print(f"  (g) no plan fits under torch.compile ({time.perf_counter() - t0:.1f} s): {e}", flush=True)
                run_group(group, fresh, idx, args.rounds, rows, f"budget {frac:.1%} of the peak")
                continue
            print(f"  (g) fitted for compile in {time.perf_counter() - t0:.1f} s, {fitted.compiled['rounds']} rounds: "
                  f"predicted {fitted.predicted_peak_bytes / MIB:.1f} MiB compiled "
                  f"({fitted.compiled['eager_peak_bytes'] / MIB:.1f} MiB eager)", flush=True)
            torch._dynamo.reset()
            planned = torch.compile(autosac.apply(copy.deepcopy(base_model), fitted), backend=BACKEND)
            group.append(Stepper("(g) cc-fitted", UnderBudget(planned, 1.0), budget, fitted, reference=compile_ref))
        run_group(group, fresh, idx, args.rounds, rows, f"budget {frac:.1%} of the peak")

    print("\noverhead: median over rounds of step / mean of the unmodified steps just before and after it;")
    print(f"spread: max - min of those ratios; vs own: (d), (f), (g)'s step over the unbudgeted compiled step "
          f"({BUDGETED_BACKEND[BACKEND]})")
    print("method          budget   measured peak  <=budget  step ms  overhead  spread  vs own  pred peak err"
          "  pred step err")
    for r in rows:
        b = r["budget"]
        own = f"{r['vs_ref']:+7.1%}" if "vs_ref" in r else "      -"
        ok = "-" if b is None else ("yes" if r["peak"] <= b else "NO")
        pe = f"{(r['pred_peak'] - r['peak']) / r['peak']:+13.1%}" if "pred_peak" in r else f"{'-':>13}"
        se = f"{(r['pred_ms'] - r['ms']) / r['ms']:+13.1%}" if "pred_ms" in r else f"{'-':>13}"
        bstr = f"{b / peak:6.1%}" if b else "     -"
        print(f"{r['method']:<14} {bstr}  {r['peak'] / MIB:10.1f} MiB  {ok:>8}  {r['ms']:7.0f}  {r['overhead']:+8.1%}"
              f"  {r['spread']:6.1%}  {own}  {pe}  {se}")

if __name__ == "__main__":
    main()
