"""On a machine with a CUDA GPU (outside CI): the compiled step's peak under
``torch._functorch.config.activation_memory_budget`` at several fractions,
traced in fake mode for target h100 (what ``solve(..., compile="inductor")``
predicts for the partitioner's plan) beside the CUDA allocator's measure.

    python benchmarks/gpu_partitioner_peaks.py results.md [--fractions 1.0,0.5] [--smoke]

Built-in gpt2 (124M), batch 8, seq 1024, bf16 autocast, AdamW, the held loop.
The trace runs on this machine's torch (the partitioner's choices differ
between torch versions); the traced peak's phase and what is alive there by
kind come with it.  The real step's warnings of ops run without an autograd
formula, and Dynamo's counters, are kept: in a fresh process on an H100 the
real step after the trace was wrong once (``results/gpu-2026-11-26-h100-s5``),
and this script is that defect's reproduction.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import time
import warnings

import torch
import torch._functorch.config as functorch_config

import autosac
from autosac.compile.trace import compiled_peak
from autosac.models import build_model

BF16 = torch.bfloat16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--fractions", default="1.0,0.5")
    p.add_argument("--smoke", action="store_true", help="a tiny gpt2 on the CPU: checks the script runs")
    args = p.parse_args()
    cfg = dict(batch=8, seq=1024)
    device = "cuda"
    if args.smoke:
        cfg, device = dict(batch=2, seq=128, n_layer=2, dim=128, n_head=4, vocab=512), "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("gpu_partitioner_peaks: no CUDA device here: run it on a GPU machine")
    meta, idx_meta = build_model("gpt2", device="meta", **cfg)
    torch.manual_seed(0)
    model, idx = build_model("gpt2", device=device, **cfg)
    rows = [f"# partitioner fractions: traced against measured ({datetime.date.today()})", "",
            f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, gpt2 {cfg}, "
            "bf16 autocast, AdamW, held loop", "",
            "| fraction | traced peak | measured peak | error | traced phase | traced breakdown (MiB) | "
            "traced kernel ms | step | trace s | ops without autograd (a wrong step) | Dynamo counters |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in [float(x) for x in args.fractions.split(",")]:
        t0 = time.perf_counter()
        with functorch_config.patch(activation_memory_budget=f):
            traced = compiled_peak(meta, idx_meta, backend="inductor", target="h100", autocast=BF16)
            seconds = time.perf_counter() - t0
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            torch._dynamo.reset()
            counters = torch._dynamo.utils.counters
            counters.clear()
            with warnings.catch_warnings(record=True) as caught:  # a wrong step warns (results/gpu-2026-11-26-h100-s5)
                warnings.simplefilter("always")
                m = autosac.measure(torch.compile(model), idx, steps=5, autocast=BF16)
        unregistered = sorted({str(w.message).split(":")[0] for w in caught if "autograd kernel" in str(w.message)})
        dynamo = {k: dict(v) for k, v in counters.items() if k in ("graph_break", "stats", "unimplemented")}
        err = (traced.peak_bytes - m.peak_bytes) / m.peak_bytes
        kinds = {k: round(v / 2**20) for k, v in traced.breakdown.items() if v >= 2**20}
        rows.append(f"| {f} | {traced.peak_bytes / 2**20:.1f} MiB | {m.peak_bytes / 2**20:.1f} MiB | {err:+.2%} | "
                    f"{traced.peak_phase} | {kinds} | {traced.kernel_ms:.2f} | {m.step_ms:.1f} ms | {seconds:.0f} | "
                    f"{unregistered or '-'} | {str(dynamo)[:400]} |")
        print(rows[-1], flush=True)
        with open(args.out, "w") as fh:
            fh.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
