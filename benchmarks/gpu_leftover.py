"""On a GPU (outside CI): where ``gpu_verify.py``'s Llama plans' 0.17 GiB comes from.

``gpu_peak_snapshot.py`` measured the 16-layer Llama's 70 % plan at its prediction to the byte in a
process of its own (29.50 GiB, 2026-11-26), while ``gpu_verify.py`` read 29.67 GiB for the same plan in a
process that had run the SDPA table, GPT-2 and the unplanned steps first.  This script measures the plan
first, in a fresh process, then runs that earlier work phase by phase, printing what each leaves
allocated on the device once its tensors are gone, measures the plan again, and lists what is alive
beyond the model by the source line that allocated it.

    python benchmarks/gpu_leftover.py
"""

from __future__ import annotations

import collections
import functools
import gc
import sys
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_verify import check_sdpa  # noqa: E402

import autosac  # noqa: E402
from autosac.core.budget import format_bytes, parse_budget  # noqa: E402
from autosac.models import build_model  # noqa: E402
from autosac.solver import solve_stats  # noqa: E402

BF16 = torch.bfloat16
NAME, CFG = "llama-7b", dict(batch=4, seq=4096, n_layer=16, dim=2048, n_head=16, n_kv_head=4, ffn_hidden=5632)


def _left(label: str) -> int:
    gc.collect()
    torch.cuda.empty_cache()
    n = torch.cuda.memory_allocated()
    print(f"{label}: {format_bytes(n)} allocated", flush=True)
    return n


def _measure_plan(plan, state, label: str) -> None:
    work, idx = build_model(NAME, device="cuda", **CFG)
    work.load_state_dict(state)
    autosac.apply(work, plan)
    held = torch.cuda.memory_allocated()
    m = autosac.measure(work, idx, steps=1, autocast=BF16)
    print(f"{label}: before {format_bytes(held)}, peak {format_bytes(m.peak_bytes)}, predicted "
          f"{format_bytes(plan.predicted_peak_bytes)} ({(plan.predicted_peak_bytes - m.peak_bytes) / m.peak_bytes:+.2%})",
          flush=True)
    del work, idx, m


def _alive_by_line(snapshot) -> collections.Counter:
    groups = collections.Counter()
    for seg in snapshot["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] != "active_allocated":
                continue
            frames = blk.get("frames", [])
            where = next((f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}" for f in frames
                          if "torch/nn/modules" not in f["filename"]), "no Python frame (a library's own)")
            groups[where] += blk["size"]
    return groups


def main() -> None:
    torch.cuda.memory._record_memory_history(max_entries=1, stacks="python")  # live blocks keep their stacks
    meta, idx_meta = build_model(NAME, device="meta", **CFG)
    stats = autosac.profile(meta, idx_meta, target="h100", autocast=BF16)
    plan = solve_stats(stats, parse_budget("70%", stats.peak_bytes), solver="highs")
    torch.manual_seed(0)
    model, _ = build_model(NAME, device="cpu", **CFG)
    state = model.state_dict()
    del model
    _left("fresh process")
    _measure_plan(plan, state, "70% plan, first thing in the process")
    _left("after it")
    check_sdpa([])
    _left("after gpu_verify's SDPA table")
    base, idx = build_model(NAME, device="cuda", **CFG)
    base.load_state_dict(state)
    m = autosac.measure(base, idx, steps=1, autocast=BF16)
    print(f"unplanned: peak {format_bytes(m.peak_bytes)}, predicted {format_bytes(stats.peak_bytes)}", flush=True)
    del base, m
    _left("after the unplanned step")
    plain, idx = build_model(NAME, device="cuda", **CFG)
    plain.load_state_dict(state)
    for blk in plain.layers if hasattr(plain, "layers") else plain.blocks:
        blk.forward = functools.partial(checkpoint, blk.forward, use_reentrant=False)
    autosac.measure(plain, idx, steps=1, autocast=BF16)
    del plain, blk
    _left("after torch.utils.checkpoint of every block")
    _measure_plan(plan, state, "70% plan again")
    _left("after it")
    for where, size in _alive_by_line(torch.cuda.memory._snapshot()).most_common(12):
        print(f"{format_bytes(size):>12}  {where}")


if __name__ == "__main__":
    main()
