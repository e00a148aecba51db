"""The batch-size search (``autosac.search``, issue 33), checked against real steps.

CPU (default): for a GPT, a Llama (global batch kept by accumulation) and a
small ResNet-style CNN, search the batch sizes on this machine (target
``cpu``), then run every candidate that fits for real -- its plan applied to
a copy of the model -- in interleaved rounds, and set predicted beside
measured samples/s and peaks.  Checked per model: every measured peak within
the memory, and the chosen candidate's measured samples/s at least 0.9x the
best measured.  Then the planning time of the Llama-2-70B shape for 64
FSDP2 ranks on an H100 over 6 batch sizes (target: 60 s).

    python benchmarks/bench_search.py > benchmarks/results/bench_search.md
    python benchmarks/bench_search.py --rounds 5 --skip-70b      # or --only-70b

GPU (``--gpu``): the built-in gpt2 (GPT-2 small, seq 1024) under bf16
autocast, memory 20 GiB, batch sizes 4 to 64, target the GPU's own table entry
(h100 or h200), every candidate that fits run on the GPU:

    python benchmarks/bench_search.py --gpu > gpu_search.md

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext

import torch
from torch import nn

import autosac
from autosac.core.budget import format_bytes
from autosac.core.optim import default_loss, make_optimizer
from autosac.models import build_model
from autosac.tools.search import rebatched

ROUNDS = 5
STEPS = 3  # timed steps per candidate and round (after one untimed one)


class ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class SmallResNet(nn.Module):
    """A ResNet-style image classifier: 32x32 RGB images, 10 classes."""

    def __init__(self, width: int = 32, blocks: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(*(ResBlock(width) for _ in range(blocks)))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def cpu_cases():
    """``(label, model, make_inputs, memory, batch sizes, search options)``: memories where the
    smaller batches fit as they are, the larger need a plan, the largest does not fit."""
    torch.manual_seed(0)
    gpt, idx = build_model("gpt2", n_layer=4, dim=256, n_head=4, vocab=4096, seq=128, device="cpu", batch=2)
    llama, lidx = build_model("llama-7b", n_layer=4, dim=256, n_head=4, n_kv_head=2, ffn_hidden=688, vocab=4096,
                              seq=128, device="cpu", batch=2)
    cnn = SmallResNet(width=64)
    images = torch.randn(4, 3, 32, 32)
    return [
        ("GPT 4x256, seq 128", gpt, lambda b: rebatched(idx, b), "200MiB", (2, 4, 8, 16, 32), {}),
        ("Llama 4x256 GQA, seq 128, global batch 32", llama, lambda b: rebatched(lidx, b), "192MiB",
         (2, 4, 8, 16, 32), dict(global_batch=32)),
        ("ResNet-style CNN 4 blocks x 64 ch, 32x32", cnn, lambda b: rebatched(images, b), "160MiB",
         (8, 16, 32, 64, 128), {}),
    ]


def timed_steps(model, inputs, *, accum: int, optimizer: str, autocast, steps: int, device: str):
    """Median wall and CPU (this process's) ms of ``steps`` optimizer steps, each ``accum`` micro-batches
    (after one untimed step that makes the optimizer state).  On a shared machine the wall time also counts
    the time other processes held the core; the CPU time is the step's own work."""
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
    amp = (lambda: torch.autocast(device, dtype=autocast)) if autocast is not None else nullcontext

    def step():
        for _ in range(accum):
            with amp():
                loss = default_loss(model(inputs))
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    walls, cpus = [], []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        walls.append((time.perf_counter() - w0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
    return statistics.median(walls), statistics.median(cpus)


def measure_rows(result, model, make_inputs, *, device="cpu", autocast=None, rounds=ROUNDS, steps=STEPS):
    """Each feasible row run for real, its plan applied to a copy of ``model``: the peak of one step
    (``autosac.measure``, the loop the plan was made for), and samples/s in ``rounds`` interleaved rounds
    (the order turning each round).  ``{batch: (peak, median wall samples/s, median CPU samples/s)}``."""
    rows = [r for r in result.rows if r.feasible]
    peaks, wall, cpu = {}, {r.batch_size: [] for r in rows}, {r.batch_size: [] for r in rows}

    def twin(row):
        copied = copy.deepcopy(model).to(device)
        return autosac.apply(copied, row.plan) if row.plan is not None else copied

    def inputs(row):
        x = make_inputs(row.batch_size)
        return x.to(device) if isinstance(x, torch.Tensor) else x

    for row in rows:
        plan = row.plan_to_save()
        peaks[row.batch_size] = autosac.measure(twin(row), inputs(row), steps=0, optimizer=plan.optimizer,
                                                autocast=autocast, output_held=plan.output_held,
                                                grad_accumulation=min(row.grad_accumulation, 2)).peak_bytes
    for k in range(rounds):
        for row in rows[k % len(rows):] + rows[: k % len(rows)]:
            w, c = timed_steps(twin(row), inputs(row), accum=row.grad_accumulation, optimizer=row.plan_to_save(
                ).optimizer, autocast=autocast, steps=steps, device=device)
            wall[row.batch_size].append(row.samples_per_step / (w / 1e3))
            cpu[row.batch_size].append(row.samples_per_step / (c / 1e3))
            if device == "cuda":
                gc.collect()  # the copy just run, before the next one is made
                torch.cuda.empty_cache()
    return {b: (peaks[b], statistics.median(wall[b]), statistics.median(cpu[b])) for b in peaks}


def report(label: str, result, measured: dict, plan_s: float, clock: str) -> bool:
    """The side-by-side table for one model; True when its checks hold.  ``clock``: which measured
    samples/s the check compares, ``"cpu"`` (this process's CPU time) or ``"wall"``."""
    print(f"### {label}\n")
    print(f"memory {format_bytes(result.memory_bytes)}, target {result.target}, search {plan_s:.1f} s"
          + (f", global batch {result.global_batch}" if result.global_batch else "") + "\n")
    print("| batch | accum | plan | predicted peak | measured peak | within memory | predicted samples/s "
          f"| measured samples/s, CPU time | measured, wall | {clock} / best {clock} |")
    print("|---:|---:|---|---:|---:|---|---:|---:|---:|---:|")
    pick = 2 if clock == "cpu" else 1
    top = max((m[pick] for m in measured.values()), default=0.0)
    for row in result.rows:
        if not row.feasible:
            print(f"| {row.batch_size} | {row.grad_accumulation} | {row.note} | - | - | - | - | - | - | - |")
            continue
        peak, wall, cpu = measured[row.batch_size]
        mark = " **chosen**" if row is result.best else ""
        how = "none" if row.plan is None else f"{len(row.plan.decisions)} checkpointed, +{row.plan.overhead:.1%}"
        print(f"| {row.batch_size}{mark} | {row.grad_accumulation} | {how} | {format_bytes(row.predicted_peak_bytes)} "
              f"| {format_bytes(peak)} | {'yes' if peak <= result.memory_bytes else '**NO**'} "
              f"| {row.predicted_samples_per_s:.1f} | {cpu:.1f} | {wall:.1f} "
              f"| {measured[row.batch_size][pick] / top:.2f} |")
    best = result.best
    ratio = measured[best.batch_size][pick] / top if best is not None else 0.0
    within = all(m[0] <= result.memory_bytes for m in measured.values())
    print(f"\nchosen batch {best.batch_size if best else '-'}: measured {ratio:.2f}x the best measured candidate's "
          f"samples/s ({'ok' if ratio >= 0.9 else 'BELOW 0.9x'}); every measured peak within the memory: "
          f"{'yes' if within else 'NO'}\n")
    return within and ratio >= 0.9


def cpu(rounds: int) -> bool:
    print(f"## On this CPU (target cpu, {torch.get_num_threads()} thread), {rounds} interleaved rounds of "
          f"{STEPS} timed steps per candidate\n")
    print(f"Load average at the start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (the machine is shared): "
          "the check compares samples/s by this process's CPU time, which time-sharing with other processes "
          "does not inflate; wall-clock figures beside them.\n")
    ok = True
    for label, model, make, memory, sizes, options in cpu_cases():
        t0 = time.perf_counter()
        result = autosac.search(model, make, memory, sizes, target="cpu", **options)
        plan_s = time.perf_counter() - t0
        ok &= report(label, result, measure_rows(result, model, make, rounds=rounds), plan_s, "cpu")
    return ok


def llama70b(runs: int) -> bool:
    """Planning time of the Llama-2-70B shape in bf16 for 64 FSDP2 ranks on an H100, 6 batch sizes: wall and
    CPU time of each run (the machine is shared: the wall time also counts other processes' turns)."""
    model, idx = build_model("llama-7b", device="meta", batch=1, seq=4096, n_layer=80, dim=8192, n_head=64,
                             n_kv_head=8, ffn_hidden=28672)
    model = model.to(torch.bfloat16)
    sizes = (1, 2, 4, 8, 16, 32)
    print(f"## Planning time: Llama-2-70B shape, bf16, seq 4096, 64 ranks, H100, 80 GiB, batch sizes "
          f"{', '.join(map(str, sizes))}\n")
    print("| run | wall | CPU time | load average at the start (2 cores) |\n|---:|---:|---:|---:|")
    cpu_times = []
    for run in range(runs):
        load = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        result = autosac.search(model, lambda b: rebatched(idx, b), "80GiB", sizes, target="h100", world_size=64)
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        cpu_times.append(cpu_s)
        print(f"| {run + 1} | {seconds:.1f} s | {cpu_s:.1f} s | {load:.1f} |")
    worst = max(cpu_times)
    print(f"\ntarget at most 60 s: CPU time {'within' if worst <= 60 else 'OVER'} it in every run (the search's own "
          f"work, what it takes on a machine to itself); the last run's table:\n\n```\n{result}\n```\n")
    return worst <= 60


def gpu(rounds: int) -> bool:
    """gpt2 (GPT-2 small, seq 1024), bf16 autocast, 20 GiB, batch sizes 4 to 64, on this GPU."""
    name = torch.cuda.get_device_name()
    target = "h200" if "H200" in name else "h100"
    meta, idx = build_model("gpt2", batch=4)
    torch.manual_seed(0)
    real, real_idx = build_model("gpt2", batch=4, device="cpu")
    t0 = time.perf_counter()
    result = autosac.search(meta, lambda b: rebatched(idx, b), "20GiB", (4, 8, 16, 32, 64), target=target,
                            autocast=torch.bfloat16)
    plan_s = time.perf_counter() - t0
    print(f"## {name}: gpt2, bf16 autocast, 20 GiB, {rounds} interleaved rounds of {STEPS} timed steps\n")
    # the model stays on the CPU: each candidate's copy alone is on the GPU while it runs (its peak is the copy's)
    measured = measure_rows(result, real, lambda b: rebatched(real_idx, b), device="cuda",
                            autocast=torch.bfloat16, rounds=rounds)
    return report(f"gpt2 on {target}", result, measured, plan_s, "wall")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help=f"default {ROUNDS} (--gpu: 3)")
    parser.add_argument("--skip-70b", action="store_true", help="CPU mode without the 70B planning time")
    parser.add_argument("--only-70b", action="store_true", help="the 70B planning time alone")
    parser.add_argument("--runs-70b", type=int, default=2, help="searches of the 70B shape timed (default 2)")
    parser.add_argument("--gpu", action="store_true", help="the GPU variant (needs CUDA)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"# autosac.search against real steps ({time.strftime('%Y-%m-%d')}, torch {torch.__version__})\n")
    if args.gpu:
        return 0 if gpu(args.rounds or 3) else 1
    torch.set_num_threads(1)
    # op timings and host costs measured in this run, under the load the candidates then run under (a cache
    # from a quieter or busier hour would skew predicted against measured); AUTOSAC_CACHE_DIR= keeps yours
    os.environ.setdefault("AUTOSAC_CACHE_DIR", tempfile.mkdtemp(prefix="bench-search-cache-"))
    ok = True if args.only_70b else cpu(args.rounds or ROUNDS)
    if not args.skip_70b:
        ok &= llama70b(args.runs_70b)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
