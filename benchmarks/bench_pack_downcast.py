"""pack_downcast on this CPU: 64M float32 parameters in 100 tensors cast to one
flat bfloat16 buffer.

  native         autosac.ops.pack_downcast (the C++ op, one pass, parallel)
  cast + cat     per-tensor .to(bfloat16) then torch.cat (two passes, a temporary per tensor)
  fsdp2 copy-in  FSDP2's MixedPrecisionPolicy path: each shard cast to bf16 (a new
                 tensor each), then torch._foreach_copy_ into one flat buffer
  copy           one plain 64M-element float32 -> float32 copy: this machine's
                 bandwidth reference (reads 4 B and writes 4 B per element; the
                 cast reads 4 and writes 2)

Each method runs twice: writing its flat output into a buffer that already
exists (as on a GPU, where the caching allocator hands back the previous
step's memory, and as allgather_downcast writes into its gather buffer), and
into a fresh allocation, where on this CPU the first touch of 128 MB of new
pages costs more than the conversion itself.

Bandwidth counts bytes read plus written.  Medians of --rounds, methods
interleaved.

    python benchmarks/bench_pack_downcast.py [--rounds 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from autosac.zero3 import native, ops

N = 64 * 2**20
K = 100
BF16 = torch.bfloat16


def methods(tensors, sizes, big_src, big_dst):
    """name -> (into an existing buffer, into a fresh buffer)."""
    flat = torch.empty(N, dtype=BF16)

    def fsdp_copy_in(out):
        casts = [t.to(BF16) for t in tensors]
        torch._foreach_copy_(list(out.split(sizes)), casts)
        return out

    return {
        "native": (lambda: ops.pack_downcast(tensors, BF16, out=flat), lambda: ops.pack_downcast(tensors, BF16)),
        "cast + cat": (lambda: torch.cat([t.to(BF16) for t in tensors], out=flat),
                       lambda: torch.cat([t.to(BF16) for t in tensors])),
        "fsdp2 copy-in": (lambda: fsdp_copy_in(flat), lambda: fsdp_copy_in(torch.empty(N, dtype=BF16))),
        "copy": (lambda: big_dst.copy_(big_src), lambda: big_src.clone()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert native.available(), "the native op did not build"
    torch.manual_seed(0)
    sizes = [N // K] * (K - 1) + [N - (N // K) * (K - 1)]
    tensors = [torch.randn(n) for n in sizes]
    big_src, big_dst = torch.randn(N), torch.empty(N)
    table = methods(tensors, sizes, big_src, big_dst)
    ref = torch.cat([t.to(BF16) for t in tensors]).view(torch.int16)
    for name, fns in table.items():
        if name != "copy":
            assert all(torch.equal(fn().view(torch.int16), ref) for fn in fns), name
    times = {(k, i): [] for k in table for i in (0, 1)}
    for _ in range(args.rounds):
        for k, fns in table.items():
            for i, fn in enumerate(fns):
                t = time.perf_counter()
                fn()
                times[k, i].append(time.perf_counter() - t)
    med = {key: statistics.median(ts) for key, ts in times.items()}
    moved = {"copy": 8 * N}
    print(f"{N:,} float32 elements in {K} tensors -> bfloat16, {args.threads} threads, median of {args.rounds}\n")
    print("| method | existing buffer ms | GB/s | fresh buffer ms | GB/s |")
    print("|---|---:|---:|---:|---:|")
    for k in table:
        b = moved.get(k, 6 * N)
        print(f"| {k} | {med[k, 0] * 1e3:.1f} | {b / med[k, 0] / 1e9:.1f} | {med[k, 1] * 1e3:.1f} | {b / med[k, 1] / 1e9:.1f} |")
    for i, where in enumerate(("existing buffer", "fresh buffer")):
        native_gbs, copy_gbs = 6 * N / med["native", i], 8 * N / med["copy", i]
        print(f"\n{where}: native at {native_gbs / copy_gbs:.0%} of the copy's bandwidth, "
              f"{med['cast + cat', i] / med['native', i]:.2f}x faster than cast + cat, "
              f"{med['fsdp2 copy-in', i] / med['native', i]:.2f}x faster than FSDP2's copy-in", end="")
    print()


if __name__ == "__main__":
    main()
