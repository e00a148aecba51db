"""On a GPU (outside CI): what stays allocated on the device after a model's
training steps are over and the model is gone, with and without a plan, and
what a planned step holds beyond the model itself.

    python benchmarks/gpu_residue.py
"""

from __future__ import annotations

import gc

import torch

import autosac
from autosac.core.budget import format_bytes
from autosac.core.optim import default_loss
from autosac.models import build_model
from autosac.solver import least_peak, solve_stats
from autosac.solver.problem import build_problem

BF16 = torch.bfloat16
CONFIGS = {
    "gpt2": ("gpt2", dict(batch=8, seq=1024, n_layer=4)),
    "llama": ("llama-7b", dict(batch=4, seq=4096, n_layer=4, dim=2048, n_head=16, n_kv_head=4, ffn_hidden=5632)),
}


def _steps(model, idx, n=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(n):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=BF16):
            loss = default_loss(model(idx))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        torch.cuda.synchronize()
    own = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    own += sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values())
    return start, own, torch.cuda.max_memory_allocated()


def run(label, name, cfg, plan=None):
    gc.collect()
    torch.cuda.empty_cache()
    empty = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model, idx = build_model(name, device="cuda", **cfg)
    if plan is not None:
        autosac.apply(model, plan)
    start, own, peak = _steps(model, idx)
    del model, idx
    gc.collect()
    residue = torch.cuda.memory_allocated() - empty
    print(f"{label:28s} before step {format_bytes(start - empty):>11} (model+optimizer {format_bytes(own):>11}) "
          f"peak {format_bytes(peak - empty):>11}  left after del {format_bytes(residue):>11}", flush=True)


def main():
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    for key, (name, cfg) in CONFIGS.items():
        meta, idx = build_model(name, device="meta", **cfg)
        stats = autosac.profile(meta, idx, target="h100", autocast=BF16)
        problem = build_problem(stats)
        least = least_peak(problem, solver="highs")[0]
        plan = solve_stats(stats, least, solver="highs", problem=problem)
        print(f"{key}: predicted baseline {format_bytes(stats.peak_bytes)}, least {format_bytes(least)}", flush=True)
        run(f"{key} unplanned", name, cfg)
        run(f"{key} unplanned again", name, cfg)
        run(f"{key} least plan", name, cfg, plan)
        run(f"{key} unplanned after plan", name, cfg)


if __name__ == "__main__":
    main()
