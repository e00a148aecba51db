"""On a machine with a CUDA GPU (outside CI): autosac's compiled plans against
PyTorch's own compiled memory budget, side by side in one run.

    python benchmarks/gpu_compile.py results.md [--models gpt2,llama] [--fractions 0.3,0.5,0.7] [--quick]

For each model (bf16 autocast, AdamW, the held loop): eager; ``torch.compile``;
``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` at
each fraction (its measured peak and step); then, at each of those measured
peaks and at 50 % and the least eager peak, autosac's plan fitted for inductor
(``solve(..., target="h100", compile="inductor")``, planned from a meta copy:
no GPU needed to plan; where that is the partitioner's own budget at a
fraction found in fake mode, also the best plan that checkpoints modules,
except with ``--quick``)
and its eager plan, each with predicted beside measured.  Goal: every autosac compiled row within its budget and no slower
than ``activation_memory_budget`` at the same peak.  ``--quick``: the
fractions' rows only (no plain compile, 50 %, least or second fit), gpt2 at 0.5
unless ``--models``/``--fractions`` say otherwise (``gpu_check.sh``'s
``PART=compile`` runs gpt2 at 0.5, ``PART=compile2`` the rest, each within a
600 s call).

Peaks are ``torch.cuda.max_memory_allocated`` over one steady-state step (as
:func:`autosac.measure` reads them); steps are medians of timed steps.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import time

import torch

import autosac
from autosac.compile.fit import fit_for_compile
from autosac.core.budget import format_bytes
from autosac.core.errors import InfeasibleBudgetError
from autosac.models import build_model

BF16 = torch.bfloat16
MODELS = {
    "gpt2": ("gpt2 (124M), batch 8, seq 1024", "gpt2", dict(batch=8, seq=1024)),
    "llama": ("llama 16 layers, dim 2048, GQA 16/4 heads, batch 4, seq 4096", "llama-7b",
              dict(batch=4, seq=4096, n_layer=16, dim=2048, n_head=16, n_kv_head=4, ffn_hidden=5632)),
}
STEPS = 5
DEVICE = "cuda"


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def _measure(model, idx, compiled: bool, fraction: float | None = None):
    """Peak and step of ``model`` (compiled with inductor when asked, under
    ``activation_memory_budget=fraction`` when given)."""
    _release()
    patch = torch._functorch.config.patch(activation_memory_budget=fraction) if fraction is not None else None
    with patch if patch is not None else contextlib.nullcontext():
        runner = torch.compile(model) if compiled else model
        t0 = time.perf_counter()
        m = autosac.measure(runner, idx, steps=STEPS, autocast=BF16)
    return m, time.perf_counter() - t0


VARIANTS = {  # autosac's rows: label -> how it plans
    "compiled": dict(compile="inductor"),  # what solve(..., compile="inductor") returns
    "compiled, checkpoints only": dict(compile="inductor", partitioner=False),  # the partitioner's budget not weighed
    "eager": dict(compile=None),
}


def _solve(meta, idx_meta, budget, compile=None, partitioner=None):
    if partitioner is None:
        return autosac.solve(meta, budget, idx_meta, target="h100", autocast=BF16, compile=compile)
    stats = autosac.profile(meta, idx_meta, target="h100", autocast=BF16)
    return fit_for_compile(meta, stats, budget, idx_meta, backend=compile, partitioner=partitioner)


def _plan(meta, idx_meta, budget, how: dict):
    """autosac's plan for ``budget`` bytes; under compile, the least compiled
    peak seen when ``budget`` is below every plan's."""
    try:
        return _solve(meta, idx_meta, budget, **how), None
    except InfeasibleBudgetError as e:
        if how["compile"] is None:
            return None, f"infeasible: least {format_bytes(e.min_feasible_bytes)}"
        return _solve(meta, idx_meta, e.min_feasible_bytes, **how), f"raised to {format_bytes(e.min_feasible_bytes)}"


def _row(out, label, budget, m, base_ms, plan=None, note="", seconds=0.0):
    pred_peak = format_bytes(plan.predicted_peak_bytes) if plan is not None else "-"
    err = f"{(plan.predicted_peak_bytes - m.peak_bytes) / m.peak_bytes:+.2%}" if plan is not None else "-"
    kept = ("yes" if m.peak_bytes <= budget else f"NO ({(m.peak_bytes - budget) / 2**20:.1f} MiB over)") if budget else "-"
    pred_over = f"{plan.overhead:+.1%}" if plan is not None else "-"
    out.append(f"| {label} | {format_bytes(budget) if budget else '-'} | {pred_peak} | {format_bytes(m.peak_bytes)} "
               f"| {err} | {kept} | {m.step_ms:.1f} ms | {m.step_ms / base_ms - 1:+.1%} | {pred_over} | "
               f"{len(plan.decisions) if plan is not None else '-'} | {seconds:.0f} s | {note} |")


def compare_model(key: str, fractions: list[float], out: list[str], quick: bool = False) -> None:
    label, name, cfg = MODELS[key]
    meta, idx_meta = build_model(name, device="meta", **cfg)
    torch.manual_seed(0)
    model, idx = build_model(name, device=DEVICE, **cfg)
    state = {k: v.cpu() for k, v in model.state_dict().items()}  # off the GPU: only the measured model there
    out.append(f"\n### {label}\n")
    out.append("| variant | budget | predicted peak | measured peak | error | kept | step | vs eager | "
               "predicted overhead | modules | time | note |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    eager, s = _measure(model, idx, compiled=False)
    _row(out, "eager", 0, eager, eager.step_ms, seconds=s)
    plain = None  # --quick: no plain compile (40 s of a cold machine's compile)
    if not quick:
        plain, s = _measure(model, idx, compiled=True)
        _row(out, "torch.compile", 0, plain, eager.step_ms, seconds=s)
    budgets = []
    for f in fractions:
        m, s = _measure(model, idx, compiled=True, fraction=f)
        _row(out, f"torch.compile, activation_memory_budget={f}", 0, m, eager.step_ms,
             note=f"{m.step_ms / plain.step_ms:.3f}x compiled" if plain else "", seconds=s)
        budgets.append((f"at budget={f}'s peak", m.peak_bytes, m))
    if not quick:
        stats = autosac.profile(meta, idx_meta, target="h100", autocast=BF16)
        least = autosac.solve(stats, "least").predicted_peak_bytes
        budgets += [("at 50 %", stats.peak_bytes // 2, None), ("at least", least, None)]
    for what, budget, theirs in budgets:
        for label, how in VARIANTS.items():
            if quick and label == "compiled, checkpoints only":
                continue  # a second fit: minutes
            model.load_state_dict(state)
            t0 = time.perf_counter()
            plan, note = _plan(meta, idx_meta, budget, how)
            if plan is None:
                out.append(f"| autosac {label} plan {what} | {format_bytes(budget)} "
                           f"| - | - | - | - | - | - | - | - | - | {note} |")
                continue
            autosac.apply(model, plan)
            m, _ = _measure(model, idx, compiled=how["compile"] is not None)
            autosac.unapply(model)
            vs = f"{m.step_ms / theirs.step_ms:.3f}x theirs" if theirs is not None else ""
            kind = (f"partitioner at {plan.compiled['partitioner_budget']:.4g}"
                    if "partitioner_budget" in plan.compiled else "")
            _row(out, f"autosac {label} plan {what}", plan.budget_bytes, m, eager.step_ms, plan,
                 "; ".join(x for x in (kind, note, vs) if x), time.perf_counter() - t0)
    del model
    _release()


class _Saved(list):
    """Rows, written to ``path`` after each one (a run cut short keeps what it measured)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def append(self, row: str) -> None:
        super().append(row)
        with open(self.path, "w") as f:
            f.write("\n".join(self) + "\n")
        print(row, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--models", help="default gpt2,llama (--quick: gpt2)")
    p.add_argument("--fractions", help="default 0.3,0.5,0.7 (--quick: 0.5)")
    p.add_argument("--quick", action="store_true",
                   help="the fractions' rows only: no plain torch.compile, 50 %%, least or second fit")
    p.add_argument("--smoke", action="store_true", help="a tiny gpt2 on the CPU: checks the script runs")
    args = p.parse_args()
    if args.smoke:
        global DEVICE, STEPS
        DEVICE, STEPS = "cpu", 1
        MODELS["gpt2"] = ("tiny gpt2 on the cpu (smoke)", "gpt2", dict(batch=2, seq=128, n_layer=2, dim=128,
                                                                         n_head=4, vocab=512))
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_compile: no CUDA device here: run it on a GPU machine (benchmarks/gpu_check.sh)")
    models = (args.models or ("gpt2" if args.quick else "gpt2,llama")).split(",")
    fractions = [float(f) for f in (args.fractions or ("0.5" if args.quick else "0.3,0.5,0.7")).split(",")]
    out = _Saved(args.out)
    out += [f"# autosac compiled plans against activation_memory_budget ({datetime.date.today()})\n",
           f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}, torch {torch.__version__}, bf16 autocast, AdamW, held loop\n"]
    for key in models:
        try:
            compare_model(key, fractions, out, quick=args.quick)
        except Exception as e:  # noqa: BLE001 - one model's failure is a row, the others still run
            out.append(f"\n{key}: FAILED {type(e).__name__}: {str(e)[:300]}\n")
            _release()
    out.append(f"\n(finished {datetime.datetime.now():%H:%M:%S})")


if __name__ == "__main__":
    main()
