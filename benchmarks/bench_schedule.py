"""autosac.schedule on this machine: the seed's two functions (10 paths of
256x256 float32) and forward+backward joint graphs of the built-in GPT
(make_fx of a step computing the loss's gradients), peaks before and after
memory_aware_order and the time it takes.

    python benchmarks/bench_schedule.py [--layers 1 6 60]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_schedule import (  # noqa: E402
    measured_peak,
    memory_peak_efficient_func,
    memory_peak_inefficient_func,
    seed_graph,
    seed_inputs,
)

from autosac import schedule  # noqa: E402
from autosac.models import build_model  # noqa: E402

MiB = 2**20


def gpt_joint(layers: int):
    model, idx = build_model("gpt2", device="cpu", batch=2, n_layer=layers, dim=64, n_head=4, seq=64, vocab=256,
                             dropout=0.0)
    params = dict(model.named_parameters())

    def step(p, idx):
        loss = torch.func.functional_call(model, p, (idx,)).float().sum()
        return torch.autograd.grad(loss, list(p.values()))

    return make_fx(step)(params, idx), (params, idx)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 6, 60])
    args = ap.parse_args()
    print("| graph | nodes | peak before | peak after | lower bound | method | reorder s | measured after |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for fn in (memory_peak_efficient_func, memory_peak_inefficient_func):
        gm, inputs = seed_graph(fn), seed_inputs()
        t = time.perf_counter()
        better = schedule.memory_aware_order(gm, *inputs)
        s = time.perf_counter() - t
        r = better.meta["memory_order"]
        assert torch.equal(better(*inputs), gm(*inputs))
        print(f"| seed {fn.__name__} | {len(gm.graph.nodes)} | {r.peak_before / MiB:.2f} MiB | "
              f"{r.peak_after / MiB:.2f} MiB | {r.lower_bound / MiB:.2f} MiB | {r.method} | {s:.2f} | "
              f"{measured_peak(better, inputs) / MiB:.2f} MiB |")
    for layers in args.layers:
        gm, inputs = gpt_joint(layers)
        t = time.perf_counter()
        better = schedule.memory_aware_order(gm, *inputs)
        s = time.perf_counter() - t
        r = better.meta["memory_order"]
        same = all(torch.equal(a, b) for a, b in zip(gm(*inputs), better(*inputs)))
        assert same, "values differ"
        print(f"| GPT {layers}-layer fwd+bwd | {len(gm.graph.nodes)} | {r.peak_before / MiB:.3f} MiB | "
              f"{r.peak_after / MiB:.3f} MiB ({1 - r.peak_after / r.peak_before:.1%} less) | "
              f"{r.lower_bound / MiB:.3f} MiB | {r.method} | {s:.2f} | - |", flush=True)


if __name__ == "__main__":
    main()
