"""pack_downcast on this CPU: 64M float32 parameters in 100 tensors cast to one
flat bfloat16 buffer.

  native         autosac.ops.pack_downcast (the C++ op, one pass, parallel)
  cast + cat     per-tensor .to(bfloat16) then torch.cat (two passes, a temporary per tensor)
  fsdp2 copy-in  FSDP2's MixedPrecisionPolicy path: each shard cast to bf16 (a new
                 tensor each), then torch._foreach_copy_ into one flat buffer
  copy           one plain 64M-element float32 -> float32 copy into an existing
                 buffer: this machine's bandwidth reference (reads 4 B and writes
                 4 B per element; the cast reads 4 and writes 2)
  clone          the same copy into a new buffer, as every method above makes
                 its output (a fresh large allocation pays its page faults here)

Bandwidth counts bytes read plus written.  Medians of --rounds, methods
interleaved.

    python benchmarks/bench_pack_downcast.py [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from autosac import native, ops

N = 64 * 2**20
K = 100


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert native.available(), "the native op did not build"
    torch.manual_seed(0)
    sizes = [N // K] * (K - 1) + [N - (N // K) * (K - 1)]
    tensors = [torch.randn(n) for n in sizes]
    big_src, big_dst = torch.randn(N), torch.empty(N)

    def fsdp_copy_in():
        casts = [t.to(torch.bfloat16) for t in tensors]
        flat = torch.empty(N, dtype=torch.bfloat16)  # FSDP2 allocates its all-gather input per gather
        torch._foreach_copy_(list(flat.split(sizes)), casts)
        return flat

    methods = {
        "native": lambda: ops.pack_downcast(tensors, torch.bfloat16),
        "cast + cat": lambda: torch.cat([t.to(torch.bfloat16) for t in tensors]),
        "fsdp2 copy-in": fsdp_copy_in,
        "copy": lambda: big_dst.copy_(big_src),
        "clone": lambda: big_src.clone(),
    }
    ref = methods["cast + cat"]()
    assert torch.equal(methods["native"]().view(torch.int16), ref.view(torch.int16))
    assert torch.equal(fsdp_copy_in().view(torch.int16), ref.view(torch.int16))
    times = {k: [] for k in methods}
    for _ in range(args.rounds):
        for k, fn in methods.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    moved = {"copy": 8 * N, "clone": 8 * N}
    print(f"{N:,} float32 elements in {K} tensors -> bfloat16, {args.threads} threads, median of {args.rounds}\n")
    print("| method | ms | GB/s (read + written) | vs native |")
    print("|---|---:|---:|---:|")
    native_s = statistics.median(times["native"])
    for k, ts in times.items():
        s = statistics.median(ts)
        gbs = moved.get(k, 6 * N) / s / 1e9
        print(f"| {k} | {s * 1e3:.1f} | {gbs:.1f} | {s / native_s:.2f}x |")
    native_gbs = 6 * N / native_s / 1e9
    for ref in ("copy", "clone"):
        ref_gbs = 8 * N / statistics.median(times[ref]) / 1e9
        print(f"\nnative at {native_gbs / ref_gbs:.0%} of the {ref}'s bandwidth", end="")
    print()


if __name__ == "__main__":
    main()
