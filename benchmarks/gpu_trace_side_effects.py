"""On a machine with a CUDA GPU: does planning for a CUDA target change what a
real step in the same process computes?  Run in a fresh process per mode:

    python benchmarks/gpu_trace_side_effects.py MODE OUT.pt [--full] [--no-eager]

MODE: ``ref`` (nothing planned), ``profile`` (autosac.profile for target h100
under bf16 autocast first), ``compiled`` (autosac.compile.compiled_peak for
target h100 first).  Then an eager and a compiled step of a small gpt2 on the
GPU: gradients saved to OUT.pt, with the peak and the autograd warnings seen.
Compare the files: every mode's gradients must equal ``ref``'s.  ``--full``:
the built-in gpt2 at batch 8, seq 1024 instead; ``--no-eager``: the compiled
step only (on an H100 a wrong compiled step followed a full-size trace where no
eager step ran between: ``results/gpu-2026-11-26-h100-s5``; these two flags
tell which of the two mattered).
"""

import sys
import warnings

import torch

import autosac
from autosac.compile.trace import compiled_peak
from autosac.models import build_model

CFG = dict(batch=4, seq=256, n_layer=2, dim=256, n_head=4, vocab=2048, dropout=0.0)


def step(model, idx, compiled: bool):
    runner = torch.compile(model) if compiled else model
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = runner(idx).float().logsumexp(-1).mean()
    loss.backward()
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    cfg = dict(batch=8, seq=1024) if "--full" in sys.argv else CFG
    meta, idx_meta = build_model("gpt2", device="meta", **cfg)
    if mode == "profile":
        autosac.profile(meta, idx_meta, target="h100", autocast=torch.bfloat16)
    elif mode == "compiled":
        compiled_peak(meta, idx_meta, backend="inductor", target="h100", autocast=torch.bfloat16)
    torch.manual_seed(0)
    model, idx = build_model("gpt2", device="cuda", **cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = step(model, idx, compiled=False) if "--no-eager" not in sys.argv else {}
        compiled = step(model, idx, compiled=True)
    bad = sorted({str(w.message)[:60] for w in caught if "autograd kernel" in str(w.message)})
    torch.save({"eager": eager, "compiled": compiled, "warnings": bad}, out)
    print(mode, "autograd warnings:", bad)


if __name__ == "__main__":
    main()
