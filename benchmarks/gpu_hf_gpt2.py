"""On a machine with a CUDA GPU: why is autosac's plan for transformers'
GPT2LMHeadModel slower than transformers' own ``gradient_checkpointing_enable()``
at the same memory (issue 31: 1.057x on an H100)?

Both checkpoint the same 12 GPT2Block's plainly and run the same kernels (on
the CPU one step's ATen ops differ by one weight cast, ``benchmarks/bench_hf_checkpoint_host.py``);
what differs is host work per checkpointed call: autosac's Python-state
capture and swap.  One run, same weights, side by side:

  none            the unmodified model
  hf              ``gradient_checkpointing_enable()`` (torch.utils.checkpoint of each block)
  autosac least   autosac's least-peak plan (the 12 blocks and ln_f, all plain)
  autosac @hf     autosac planned at the peak ``hf`` measured here
  least -own      the least plan, its state capture skipping autosac's own objects
                  (the policy and forward partial it puts on each module)
  least -cap      the least plan with no state capture at all (an upper bound of what capture costs)

Per variant: wall time (CUDA events, median of 7 steps), host time (until
``opt.step()`` returns, before synchronizing: close to the wall time means
the step is bound by Python, not the GPU) and the peak.  Also this host's
calibrated HostCosts and one capture's time.  About a minute on an H100.

    python benchmarks/gpu_hf_gpt2.py            # CUDA
    python benchmarks/gpu_hf_gpt2.py --smoke    # a tiny model on the CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import warnings

import torch

import autosac
import autosac.core.pystate as pystate
from autosac.applier import region
from autosac.applier.region import RegionPolicy
from autosac.solver import least_peak, solve_stats
from autosac.solver.problem import build_problem
from autosac.tools.calibrate import calibrate

BF16 = torch.bfloat16
MIB = 2**20


def _config(smoke: bool):
    import transformers

    size = dict(n_layer=12, n_embd=64, n_head=4, vocab_size=256, n_positions=128) if smoke else \
        dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    return transformers.GPT2Config(**size, attn_implementation="sdpa", use_cache=False), \
        (2, 64) if smoke else (8, 1024)


def _inputs(shape, vocab, device):
    ids = torch.randint(0, vocab, shape, device=device)
    return {"input_ids": ids, "labels": ids}


class _Capture:
    """Patch autosac's Python-state capture for one measurement: ``asis``,
    ``own`` (skip autosac's policy and forward partial) or ``none``."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __enter__(self):
        self.saved = region.capture
        if self.mode == "own":
            pystate._LAYOUTS.clear()
            pystate._KINDS[RegionPolicy] = pystate._SKIP
            pystate._KINDS[functools.partial] = pystate._SKIP
        elif self.mode == "none":
            region.capture = lambda module, args, kwargs, host_rng=False: pystate.State([], [])

    def __exit__(self, *exc):
        region.capture = self.saved
        if self.mode == "own":
            pystate._LAYOUTS.clear()  # layouts sorted under the patched kinds
        pystate._KINDS.pop(RegionPolicy, None)
        pystate._KINDS.pop(functools.partial, None)


def _steps(model, batch, device, n=7):
    """Median wall ms, median host ms, peak MiB of a held-output AdamW loop."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = device == "cuda"
    walls, hosts, out, peak = [], [], None, 0.0
    for i in range(n + 3):
        if cuda:
            torch.cuda.synchronize()
            if i == n + 2:
                torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=BF16):
            out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        host = (time.perf_counter() - t0) * 1e3
        if cuda:
            end.record()
            torch.cuda.synchronize()
            wall = start.elapsed_time(end)
            if i == n + 2:
                peak = torch.cuda.max_memory_allocated() / MIB
        else:
            wall = host
        if 2 <= i < n + 2:
            walls.append(wall)
            hosts.append(host)
    return statistics.median(walls), statistics.median(hosts), peak


def _capture_us(model, batch, device) -> float:
    """One capture of the first block's state, with the arguments it runs with."""
    blk = model.transformer.h[0]
    seen = {}
    original = region.capture

    def spy(module, args, kwargs, host_rng=False):
        if module is blk:
            seen.update(args=args, kwargs=kwargs)
        return original(module, args, kwargs, host_rng)

    region.capture = spy
    try:
        with torch.autocast(device, dtype=BF16):
            model(**batch).loss.backward()
    finally:
        region.capture = original
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for _ in range(200):
        pystate.capture(blk, seen["args"], seen["kwargs"])
    return (time.perf_counter() - t0) / 200 * 1e6


def main() -> None:
    import transformers

    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    warnings.simplefilter("ignore")
    cfg, shape = _config(args.smoke)
    where = f"{torch.cuda.get_device_name()}, " if device == "cuda" else ""
    print(f"{where}torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"this host: {calibrate()}")
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(cfg).train()
    target = "cpu" if args.smoke else "h100"
    stats = autosac.profile(meta, _inputs(shape, cfg.vocab_size, "meta"), loss_fn=lambda o: o.loss,
                            target=target, autocast=BF16)
    problem = build_problem(stats)
    least = solve_stats(stats, least_peak(problem, solver="highs")[0], solver="highs", problem=problem)
    torch.manual_seed(0)
    state = transformers.GPT2LMHeadModel(cfg).train().state_dict()  # on the CPU: one model at a time on the GPU
    batch = _inputs(shape, cfg.vocab_size, device)

    def run(label, plan=None, mode="asis", hf=False):
        model = transformers.GPT2LMHeadModel(cfg).train()
        model.load_state_dict(state)
        model.to(device)
        if hf:
            model.gradient_checkpointing_enable()
        if plan is not None:
            autosac.apply(model, plan)
        with _Capture(mode):
            results[label] = _steps(model, batch, device)
        if label == "autosac least":
            results["capture_us"] = _capture_us(model, batch, device)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()

    results = {}
    run("none")
    run("hf", hf=True)
    hf_peak = int(results["hf"][2] * MIB) or least.predicted_peak_bytes  # no peak on the CPU (--smoke)
    at_hf = solve_stats(stats, hf_peak, solver="highs", problem=problem)
    run("autosac least", least)
    run("autosac @hf", at_hf)
    run("least -own", least, "own")
    run("least -cap", least, "none")
    capture_us = results.pop("capture_us")
    print(f"least plan: {len(least.decisions)} modules, predicted {least.predicted_peak_bytes / MIB:.1f} MiB, "
          f"{least.overhead:+.1%} (machinery {least.mechanism_ms:.2f} ms of a {stats.step_ms:.1f} ms step)")
    print(f"plan at hf's peak: {sorted(at_hf.decisions)}, predicted {at_hf.overhead:+.1%}")
    print(f"one capture of transformer.h.0: {capture_us:.1f} us")
    none = results["none"][0]
    for label, (wall, host, peak) in results.items():
        print(f"  {label:14s} wall {wall:8.2f} ms ({wall / none - 1:+6.1%})  host {host:8.2f} ms  peak {peak:9.1f} MiB")


if __name__ == "__main__":
    main()
