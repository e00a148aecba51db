"""One point of gpu_compile.py, quickly: torch.compile under activation_memory_budget=0.5 on gpt2 (batch 8,
seq 1024, bf16, AdamW) and autosac's compiled plan for its measured peak, side by side (about 100 s on an H200)."""
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import gpu_compile as G

import autosac
from autosac.core.budget import format_bytes
from autosac.models import build_model


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_compile_point: no CUDA device here: run it on a GPU machine")
    label, name, cfg = G.MODELS["gpt2"]
    meta, idx_meta = build_model(name, device="meta", **cfg)
    torch.manual_seed(0)
    model, idx = build_model(name, device="cuda", **cfg)
    theirs, s = G._measure(model, idx, compiled=True, fraction=0.5)
    print(f"torch.compile budget=0.5: peak {format_bytes(theirs.peak_bytes)} step {theirs.step_ms:.1f} ms ({s:.0f} s)", flush=True)
    t = time.perf_counter()
    plan = autosac.solve(meta, theirs.peak_bytes, idx_meta, target="h100", autocast=G.BF16, compile="inductor")
    print(f"planned in {time.perf_counter()-t:.0f} s: {len(plan.decisions)} modules, predicted {format_bytes(plan.predicted_peak_bytes)}, overhead {plan.overhead:+.1%}, rounds {plan.compiled['rounds']}", flush=True)
    print(sorted({op.op for d in plan.details.values() for op in d.ops}))
    autosac.apply(model, plan)
    m, s = G._measure(model, idx, compiled=True)
    print(f"autosac compiled plan: peak {format_bytes(m.peak_bytes)} (budget {format_bytes(plan.budget_bytes)}, {'kept' if m.peak_bytes <= plan.budget_bytes else 'OVER'}), predicted error {(plan.predicted_peak_bytes-m.peak_bytes)/m.peak_bytes:+.2%}, step {m.step_ms:.1f} ms = {m.step_ms/theirs.step_ms:.3f}x torch's ({s:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
