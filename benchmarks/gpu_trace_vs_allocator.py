"""On a GPU (outside CI): the trace's peak of an unplanned step against the
CUDA allocator's own record of the same step, part by part.

    python benchmarks/gpu_trace_vs_allocator.py [gpt2|llama-7b]

1. Library memory first, in this fresh process: what ``memory_allocated``
   grows by at the first bf16 matmul without a bias, then with one (cuBLASLt's
   bias epilogue), forward and backward (autograd's thread has its own handle).
2. The step traced for target h100 (bf16 autocast, AdamW, the held loop):
   its peak, the op there, and the state it counts as alive before the step.
3. The real step, recorded by the allocator from the process's start: the
   blocks alive before the measured step grouped by the line that made them,
   what the step makes and still holds at its peak against the trace's
   (sizes rounded as the allocator rounds them), and ``max_memory_allocated``
   against the record replayed.

On 2026-11-27 (H100, torch 2.11) gpt2's step held 16.6 MiB more than its
trace: 6.1 MiB before the step and 10.5 MiB at the peak outside the record
(``benchmarks/results/gpu-2026-11-27-0604/README.md``).
"""

from __future__ import annotations

import collections
import sys

import torch
import torch.nn.functional as F
from gpu_peak_snapshot import held_loop_step  # this folder is on the path when run as a script

from autosac.core.devices import resolve_target
from autosac.core.loop import DEFAULT_LOOP
from autosac.models import build_model
from autosac.trace.aggregate import memory_timeline
from autosac.trace.costs import CostModel
from autosac.trace.step import trace_step

BF16 = torch.bfloat16
MIB = 2**20
CONFIGS = {"gpt2": dict(batch=8, seq=1024),
           "llama-7b": dict(batch=4, seq=4096, n_layer=16, dim=2048, n_head=16, n_kv_head=4, ffn_hidden=5632)}
STATE = ("param", "optim", "buffer", "input", "workspace")


def rounded(n: int) -> int:
    """The caching allocator's size for a request of ``n`` bytes."""
    return max(512, (n + 511) // 512 * 512)


def library_memory() -> None:
    """memory_allocated's growth at each first kind of matmul in the process."""
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    w = torch.randn(512, 512, device="cuda", requires_grad=True)
    b = torch.randn(512, device="cuda", requires_grad=True)
    for name, bias in (("no bias", None), ("bias", b)):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=BF16):
            y = F.linear(x, w, bias)
        torch.cuda.synchronize()
        fw = torch.cuda.memory_allocated() - base - y.untyped_storage().nbytes()
        y.float().sum().backward()
        del y
        x.grad = w.grad = b.grad = None
        torch.cuda.synchronize()
        bw = torch.cuda.memory_allocated() - base
        print(f"first bf16 linear, {name}: forward kept {fw / MIB:.2f} MiB, after its backward {bw / MIB:.2f} MiB")


def traced(name: str) -> list[tuple[int, str, str]]:
    """The trace's storages alive at its peak: (bytes, kind, producing op)."""
    meta, idx = build_model(name, device="meta", **CONFIGS[name])
    cost = CostModel(resolve_target("h100"))
    try:
        step = trace_step(meta, idx, cost_model=cost, autocast=BF16, loop=DEFAULT_LOOP)
    finally:
        cost.finish()
    rec = step.recording
    live, _ = memory_timeline(rec)
    n, pk = len(rec.ops), int(live.argmax())
    print(f"trace: peak {live[pk] / MIB:.1f} MiB at op {pk} of {n} ({rec.ops[pk]}, {rec.phases[pk]})")
    alive = [(r.nbytes, r.kind, rec.ops[r.producer] if r.producer >= 0 else "-") for r in rec.storages
             if max(r.created, 0) <= pk < (r.freed if r.freed is not None else n)]
    kinds = collections.Counter()
    for nbytes, kind, _ in alive:
        kinds[kind] += nbytes
    print("trace, alive at the peak by kind (MiB):", {k: round(v / MIB, 2) for k, v in kinds.items()})
    return alive


def _where(frames) -> str:
    out = [f"{f['filename'].split('/')[-1]}:{f.get('line')} {f.get('name')}" for f in frames
           if ("autosac" in f.get("filename", "") or "torch/" in f.get("filename", ""))
           and "cuda/memory" not in f.get("filename", "")]
    return " < ".join(out[:3]) or "(no Python frame: library)"


def real_step(name: str):
    """Three steps of the held loop; the allocator's events from the process's
    start; returns (events, index of the third step's first event)."""
    torch.manual_seed(0)
    model, idx = build_model(name, device="cuda", **CONFIGS[name])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    held: list = []
    held_loop_step(model, idx, opt, held)
    held_loop_step(model, idx, opt, held)
    torch.cuda.synchronize()
    start = len(_events(torch.cuda.memory._snapshot()))
    torch.cuda.reset_peak_memory_stats()
    held_loop_step(model, idx, opt, held)
    torch.cuda.synchronize()
    events = _events(torch.cuda.memory._snapshot())
    print(f"real: max_memory_allocated {torch.cuda.max_memory_allocated() / MIB:.1f} MiB")
    return events, start


def _events(snap) -> list[dict]:
    return [e for trace in snap["device_traces"] for e in trace if e["action"] in ("alloc", "free_completed")]


def compare(alive_traced, events, start) -> None:
    live: dict[int, tuple[int, str, bool]] = {}  # addr -> (size, where, made in the measured step)
    total = best = 0
    best_live: dict = {}
    before: dict = {}  # alive when the measured step starts
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])), i >= start)
            total += e["size"]
        elif e["addr"] in live:
            total -= live.pop(e["addr"])[0]
        if i == start - 1:
            before = dict(live)
        if i >= start and total > best:
            best, best_live = total, dict(live)
    print(f"real: the record replayed peaks at {best / MIB:.1f} MiB")
    groups = collections.Counter()
    for size, where, _ in before.values():
        groups[where] += size
    state = sum(n for n, k, _ in alive_traced if k in STATE)
    print(f"\nalive before the step: real {sum(groups.values()) / MIB:.2f} MiB (the previous output included), "
          f"trace's state {state / MIB:.2f} MiB; by line:")
    for where, size in groups.most_common(15):
        print(f"  {size / MIB:10.2f} MiB  {where}")
    made = collections.Counter(s for s, _, new in best_live.values() if new)
    want = collections.Counter(rounded(n) for n, k, _ in alive_traced if k not in STATE)
    print(f"\nmade in the step and alive at the peak: real {sum(made.elements()) / MIB:.2f} MiB, "
          f"trace {sum(want.elements()) / MIB:.2f} MiB")
    extra, missing = made - want, want - made
    for size, where, new in sorted(best_live.values()):
        if new and extra[size] > 0:
            extra[size] -= 1
            print(f"  real only: {size} bytes  {where}")
    for n, kind, op in sorted(alive_traced):
        if kind not in STATE and missing[rounded(n)] > 0:
            missing[rounded(n)] -= 1
            print(f"  trace only: {n} bytes {kind} ({op})")


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    torch.cuda.memory._record_memory_history(max_entries=4_000_000)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {name} {CONFIGS[name]}")
    library_memory()
    alive = traced(name)
    events, start = real_step(name)
    compare(alive, events, start)


if __name__ == "__main__":
    main()
