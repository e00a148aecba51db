"""Gathering sharded float32 parameters for a bfloat16 step, on gloo ranks of
this machine: 64M float32 parameters in 100 tensors, each rank holding its
1/world shard of each.

  gather then cast   FSDP2 without mixed precision, then autocast: shards copied
                     into the float32 gather buffer, gathered, the result cast
  fsdp2 param_dtype  FSDP2 with MixedPrecisionPolicy(param_dtype=bf16): each shard
                     cast (a new tensor each), copied into the bf16 gather
                     buffer, gathered
  fused              autosac.ops.allgather_downcast: one pass casting the shards
                     straight into this rank's slice of the bf16 gather buffer,
                     gathered

Every method makes its gather buffer anew per call, as each FSDP2 gather
does.  Times are medians over --rounds of the slowest rank, methods
interleaved; bytes are what one rank hands the collective.

    python benchmarks/bench_allgather_downcast.py [--worlds 2 4] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from suite import gloo_group, run_ranks  # noqa: E402

N = 64 * 2**20
K = 100
BF16 = torch.bfloat16


def _methods(shards, world, rank):
    import torch.distributed as dist

    from autosac.zero3 import ops

    n = sum(s.numel() for s in shards)
    sizes = [s.numel() for s in shards]

    def gather_then_cast():
        out = torch.empty(world * n)
        mine = out[rank * n : (rank + 1) * n]
        torch._foreach_copy_(list(mine.split(sizes)), shards)
        dist.all_gather_single(out, mine)
        return out.to(BF16), mine.numel() * 4

    def fsdp2_param_dtype():
        casts = [s.to(BF16) for s in shards]
        out = torch.empty(world * n, dtype=BF16)
        mine = out[rank * n : (rank + 1) * n]
        torch._foreach_copy_(list(mine.split(sizes)), casts)
        dist.all_gather_single(out, mine)
        return out, mine.numel() * 2

    def fused():
        rows = ops.allgather_downcast(shards, BF16)
        return rows, n * 2

    return {"gather then cast": gather_then_cast, "fsdp2 param_dtype": fsdp2_param_dtype, "fused": fused}


def _worker(rank, world, port, rounds, out_dir):
    from autosac.zero3 import native

    torch.set_num_threads(1)
    with gloo_group(rank, world, port):
        import torch.distributed as dist

        assert native.available()
        torch.manual_seed(rank)
        per = N // K // world
        shards = [torch.randn(per) for _ in range(K)]
        methods = _methods(shards, world, rank)
        # same values from every method
        ref = methods["gather then cast"]()[0].view(world, -1)
        fused = methods["fused"]()[0]
        flat = torch.cat([f.reshape(world, -1) for f in fused], dim=1)
        assert torch.equal(flat.view(torch.int16), ref.view(torch.int16))
        times = {k: [] for k in methods}
        handed = {}
        for _ in range(rounds):
            for k, fn in methods.items():
                dist.barrier()
                t = time.perf_counter()
                _, handed[k] = fn()
                times[k].append(time.perf_counter() - t)
        lines = [f"{k} {handed[k]} {' '.join(str(x) for x in ts)}" for k, ts in times.items()]
        (Path(out_dir) / f"rank{rank}").write_text("\n".join(lines))


def run(world: int, rounds: int) -> dict:
    """method -> (bytes one rank hands the collective, median seconds of the slowest rank)."""
    with tempfile.TemporaryDirectory() as d:
        run_ranks(_worker, world, rounds, d, timeout_s=600)
        per_rank = []
        for r in range(world):
            rows = {}
            for line in (Path(d) / f"rank{r}").read_text().splitlines():
                name, rest = line.rsplit(" ", rounds + 1)[0], line.rsplit(" ", rounds + 1)[1:]
                rows[name] = (int(rest[0]), [float(x) for x in rest[1:]])
            per_rank.append(rows)
    result = {}
    for k in per_rank[0]:
        slowest = [max(rank[k][1][i] for rank in per_rank) for i in range(rounds)]
        result[k] = (per_rank[0][k][0], statistics.median(slowest))
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    from autosac.zero3 import native

    assert native.available(), "the native op did not build"
    print(f"{N:,} float32 parameters in {K} tensors, sharded over gloo ranks; median of {args.rounds}, slowest rank\n")
    print("| ranks | method | bytes handed per rank | ms | vs gather then cast |")
    print("|---:|---|---:|---:|---:|")
    for world in args.worlds:
        res = run(world, args.rounds)
        base_b, base_ms = res["gather then cast"]
        for k, (b, ms) in res.items():
            print(f"| {world} | {k} | {b:,} ({b / base_b:.2f}x) | {ms * 1e3:.1f} | {ms / base_ms:.2f}x |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
