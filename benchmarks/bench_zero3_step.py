"""A whole training step of the built-in GPT under FSDP2 (per-block
``fully_shard``) and bf16 autocast on 2 gloo ranks of this machine, float32
parameters, AdamW:

  fp32 gather        FSDP2 without mixed precision (the autocast baseline)
  downcast gather    the same, after autosac.zero3.install_downcast_gather
                     (bitwise the baseline's step)
  fsdp2 param_dtype  FSDP2 with MixedPrecisionPolicy(param_dtype=bf16), for
                     reference: its numerics differ (norm weights in bf16)

Step time is autosac.measure's median over --steps steps, per-rank peak its
allocator peak (the larger rank's); predicted peaks are the planner's for
the same step (with_downcast_gather stats for the install).

    python benchmarks/bench_zero3_step.py [--steps 5] [--layers 4] [--dim 512]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from suite import gloo_group, run_ranks  # noqa: E402

BF16 = torch.bfloat16


def _cfg(args) -> dict:
    return dict(n_layer=args.layers, dim=args.dim, n_head=8, seq=args.seq, vocab=8192, dropout=0.0)


def _worker(rank, world, port, how, cfg, batch, steps, out_dir):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import autosac
    from autosac import zero3
    from autosac.models import build_model

    torch.set_num_threads(1)
    with gloo_group(rank, world, port):
        torch.manual_seed(0)
        model, idx = build_model("gpt2", device="cpu", batch=batch, **cfg)
        if how == "downcast gather":
            zero3.install_downcast_gather(model, autosac.profile(model, idx, autocast=BF16))
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=BF16)} if how == "fsdp2 param_dtype" else {}
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        m = autosac.measure(model, idx, optimizer="adamw", steps=steps, autocast=BF16)
        (Path(out_dir) / f"rank{rank}").write_text(f"{m.peak_bytes} {m.step_ms} {m.loss}")


def run(how: str, cfg: dict, batch: int, steps: int, world: int = 2) -> tuple[int, float, float]:
    """(per-rank peak bytes, step ms, loss) of the slower rank."""
    with tempfile.TemporaryDirectory() as d:
        run_ranks(_worker, world, how, cfg, batch, steps, d, timeout_s=1200)
        rows = [(Path(d) / f"rank{r}").read_text().split() for r in range(world)]
    return max(int(r[0]) for r in rows), max(float(r[1]) for r in rows), float(rows[0][2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    import autosac
    from autosac import zero3
    from autosac.core.devices import DEVICES
    from autosac.models import build_model

    cfg = _cfg(args)
    model, idx = build_model("gpt2", device="meta", batch=args.batch, **cfg)
    target = replace(DEVICES["a100"], name="a100-cpu-kernels", device_type="cpu")  # the CPU's op set
    stats = autosac.profile(model, idx, optimizer="adamw", target=target, world_size=2, autocast=BF16)
    predicted = {
        "fp32 gather": autosac.solve(stats, "100%").predicted_peak_bytes,
        "downcast gather": autosac.solve(zero3.with_downcast_gather(stats), "100%").predicted_peak_bytes,
    }
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {args.layers}x{args.dim}, seq {args.seq}, batch {args.batch} ({params / 1e6:.1f}M params), "
          f"FSDP2 on 2 gloo ranks, bf16 autocast, AdamW; step median of {args.steps}\n")
    print("| gather | step ms | vs fp32 | per-rank peak MiB | predicted MiB | loss |")
    print("|---|---:|---:|---:|---:|---:|")
    base_ms = None
    for how in ("fp32 gather", "downcast gather", "fsdp2 param_dtype"):
        peak, ms, loss = run(how, cfg, args.batch, args.steps)
        base_ms = base_ms or ms
        pred = f"{predicted[how] / 2**20:.1f}" if how in predicted else "-"
        print(f"| {how} | {ms:.0f} | {ms / base_ms:.2f}x | {peak / 2**20:.1f} | {pred} | {loss:.6f} |", flush=True)


if __name__ == "__main__":
    main()
