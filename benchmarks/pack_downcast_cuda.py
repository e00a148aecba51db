"""pack_downcast's CUDA kernel: bitwise against Tensor.to, and its bandwidth.

On a CUDA GPU: builds autosac's native op with its CUDA kernel, checks
``autosac.ops.pack_downcast`` bitwise against each tensor's own ``.to()``
(bf16 and fp16; special values, odd sizes, misaligned sources and
destinations, strided tensors, more tensors than one launch takes), then times
64M float32 in 100 tensors -> one flat bf16 buffer against

  cast + cat     per-tensor .to(bfloat16) then torch.cat into the buffer
  fsdp2 copy-in  each tensor cast, then torch._foreach_copy_ into the buffer
  copy fp32      one 64M-element float32 copy: the bandwidth reference
  native op only torch.ops.autosac.pack_downcast.out called directly, without
                 autosac.ops.pack_downcast's Python checks (host time differs)

Bandwidth counts bytes read plus written: 6 per element for the casts, 8 for
the copy (as ../shared/gpu/2026-11-25/pack_downcast_cuda.py).  Two timings,
medians of --rounds, methods interleaved:

  device   the GPU's time alone: a sleep kernel queued first lets the host
           queue the call before the timed span starts
  call     one call from an idle GPU, host work included (what the 2026-11-25
           script measured; here the host's time per call counts)

Writes benchmarks/results/pack_downcast_cuda_<date>.json and .txt (device,
torch version, date); exits 1 on a bitwise mismatch.  Without CUDA it checks
the CPU op bitwise, says in one line that the CUDA part was skipped, and
writes nothing.

    python benchmarks/pack_downcast_cuda.py [--rounds 15] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from autosac.zero3 import native, ops

N, K = 64 * 2**20, 100
BF16 = torch.bfloat16
RESULTS = Path(__file__).resolve().parent / "results"


def _special_values(device) -> torch.Tensor:
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x477FF000, 0x477FE000], dtype=torch.int32)
    nans = torch.tensor([0x7F800001, 0x7FC00001, -1, 0xFF800001 - 2**32], dtype=torch.int32)  # NaN payloads, both signs
    plain = torch.tensor([0.0, -0.0, 1.0, -1.5, 65504.0, 65520.0, 1e9, -1e9, 1e-40, -1e-45, 5.96e-8, 3e-8,
                          3.4e38, float("inf"), float("-inf"), float("nan")])
    return torch.cat([plain, ties.view(torch.float32), nans.view(torch.float32)]).to(device)


def _odd_tensors(device) -> list[torch.Tensor]:
    """Sizes around the kernel's vector width (4) and chunk (4096), sources at
    every 4-byte offset from a 16-byte boundary, strided and empty tensors."""
    g = torch.Generator(device="cpu").manual_seed(3)
    out = [_special_values(device)]
    for i, n in enumerate((0, 1, 2, 3, 5, 7, 33, 1025, 4095, 4097, 4099, 8193, 12291, 100_003)):
        base = torch.randn(n + 4, generator=g).to(device) * 1e3
        out.append(base[i % 4: i % 4 + n])  # misaligned by i % 4 floats
    out.append(torch.randn(37, 129, generator=g).to(device).t())  # strided
    out.append(torch.randn(5, 2, generator=g).to(device)[:, 1])
    return out


def _bits(t):
    return t.view(torch.int16)


def _same(got, tensors, dtype) -> bool:
    ref = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    return bool(torch.equal(_bits(got), _bits(ref)))


def bitwise_checks(device) -> dict:
    """name -> True when pack_downcast is bitwise each tensor's own cast."""
    res = {}
    torch.manual_seed(0)
    sizes = [N // K] * (K - 1) + [N - (N // K) * (K - 1)] if device == "cuda" else [1000] * 10
    big = [torch.randn(n, device=device) for n in sizes]
    big[3][:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, 3.4e38])
    odd = _odd_tensors(device)
    many = [torch.randn(int(n), device=device) for n in torch.randint(0, 300, (300,))]  # > 128: several launches
    for dtype in (BF16, torch.float16):
        name = str(dtype).split(".")[-1]
        res[f"{name} 100 tensors"] = _same(ops.pack_downcast(big, dtype), big, dtype)
        res[f"{name} odd sizes and alignments"] = _same(ops.pack_downcast(odd, dtype), odd, dtype)
        res[f"{name} 300 tensors"] = _same(ops.pack_downcast(many, dtype), many, dtype)
        total = sum(t.numel() for t in odd)
        for shift in (1, 2, 3):  # into a buffer slice that starts 2, 4 or 6 bytes past an 8-byte boundary
            buf = torch.full((total + 8,), 7.0, dtype=dtype, device=device)
            ops.pack_downcast(odd, dtype, out=buf[shift: shift + total])
            kept = bool((buf[:shift] == 7).all() and (buf[shift + total:] == 7).all())
            res[f"{name} out= shifted by {shift}"] = kept and _same(buf[shift: shift + total], odd, dtype)
    return res


def _methods(ts, sizes, flat, src, dst) -> dict:
    def fsdp():
        torch._foreach_copy_(list(flat.split(sizes)), [t.to(BF16) for t in ts])

    op = torch.ops.autosac.pack_downcast.out
    return {"native": lambda: ops.pack_downcast(ts, BF16, out=flat),
            "native op only": lambda: op(ts, BF16, out=flat),
            "cast + cat": lambda: torch.cat([t.to(BF16) for t in ts], out=flat),
            "fsdp2 copy-in": fsdp,
            "copy fp32": lambda: dst.copy_(src)}


def _timed(f, hide_host: bool) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if hide_host:
        torch.cuda._sleep(10_000_000)  # ~5 ms of GPU work: the call is queued before `s` is reached
    s.record()
    f()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3


def bandwidth(rounds: int) -> dict:
    sizes = [N // K] * (K - 1) + [N - (N // K) * (K - 1)]
    ts = [torch.randn(n, device="cuda") for n in sizes]
    flat = torch.empty(N, dtype=BF16, device="cuda")
    src, dst = torch.randn(N, device="cuda"), torch.empty(N, device="cuda")
    methods = _methods(ts, sizes, flat, src, dst)
    times = {(k, mode): [] for k in methods for mode in ("device", "call")}
    for f in methods.values():
        for _ in range(3):
            f()
    for _ in range(rounds):
        for k, f in methods.items():
            for mode in ("device", "call"):
                times[k, mode].append(_timed(f, mode == "device"))
    res = {}
    for (k, mode), v in times.items():
        m = statistics.median(v)
        byts = N * (8 if k == "copy fp32" else 6)
        res.setdefault(k, {})[mode] = dict(ms=round(m * 1e3, 4), GBps=round(byts / m / 1e9, 1))
    for k in ("native", "native op only"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            methods[k]()
        res[k]["host_us_per_call"] = round((time.perf_counter() - t0) / 20 * 1e6, 1)
    torch.cuda.synchronize()
    for mode in ("device", "call"):
        res[f"native / copy fp32 bandwidth ({mode})"] = round(res["native"][mode]["GBps"]
                                                              / res["copy fp32"][mode]["GBps"], 3)
    return res


def _report(res: dict) -> str:
    lines = [f"pack_downcast on {res['device']}, torch {res['torch']}, {res['date']}; native build {res['build_s']} s",
             "bitwise against Tensor.to: " + ", ".join(f"{k} {'ok' if v else 'MISMATCH'}"
                                                       for k, v in res["bitwise"].items())]
    lines.append(f"{N} float32 in {K} tensors -> bf16 (GB/s count bytes read + written; medians of {res['rounds']})")
    lines.append(f"{'method':<16}{'device ms':>11}{'GB/s':>9}{'call ms':>10}{'GB/s':>9}")
    for k in ("native", "native op only", "cast + cat", "fsdp2 copy-in", "copy fp32"):
        d, c = res[k]["device"], res[k]["call"]
        lines.append(f"{k:<16}{d['ms']:>11.4f}{d['GBps']:>9.1f}{c['ms']:>10.4f}{c['GBps']:>9.1f}")
    lines.append(f"host time per call: native {res['native']['host_us_per_call']} us, of which the op itself "
                 f"(torch.ops.autosac.pack_downcast.out, no Python checks) {res['native op only']['host_us_per_call']} us")
    for mode in ("device", "call"):
        r = res[f"native / copy fp32 bandwidth ({mode})"]
        lines.append(f"native / copy bandwidth, {mode}: {r:.1%} ({'meets' if r >= 0.8 else 'misses'} the 80 % goal)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    t0 = time.perf_counter()
    try:
        native.build(verbose=False)
    except native.NativeBuildError as e:
        print(f"native build FAILED after {time.perf_counter() - t0:.1f} s: {e}")
        return 2
    build_s = round(time.perf_counter() - t0, 1)
    if not torch.cuda.is_available():
        bits = bitwise_checks("cpu")
        print("CUDA not available: skipped the CUDA kernel's checks and timings; the CPU op checked bitwise: "
              + ("ok" if all(bits.values()) else f"MISMATCH in {[k for k, v in bits.items() if not v]}"))
        return 0 if all(bits.values()) else 1
    if not native.has_cuda_kernel():
        print("the native op was built without its CUDA kernel (PyTorch or nvcc without CUDA): nothing to time")
        return 2
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
               date=datetime.date.today().isoformat(), build_s=build_s, rounds=args.rounds,
               bitwise=bitwise_checks("cuda"))
    res.update(bandwidth(args.rounds))
    text = _report(res)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"pack_downcast_cuda_{res['date']}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    stem.with_suffix(".txt").write_text(text + "\n")
    print(f"wrote {stem}.json and .txt")
    return 0 if all(res["bitwise"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
