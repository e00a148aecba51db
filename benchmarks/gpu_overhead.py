"""On a machine with a CUDA GPU (outside CI): where does an applied plan's step
time go?  For the built-in GPT-2 (124M) and a 16-layer Llama under bf16
autocast, one run measures side by side:

  none          the unmodified model
  torch ckpt    torch.utils.checkpoint of every block
  torch sac     torch's selective checkpointing of every block, a policy that recomputes everything
  autosac       autosac's least-peak plan
  autosac -rb   the same plan with autosac's per-op bookkeeping replaced by pass-through
                (its two dispatch modes still entered): the cost of the bookkeeping
  autosac -m    the same plan with no autosac dispatch mode at all (torch's SAC
                with a recompute-everything policy, autosac's Python state capture kept)

Per variant: the step's wall time (CUDA events, median of 7) and its CPU time
(time until ``backward()`` returns, before synchronizing): where the CPU time
is close to the wall time, the step is bound by Python dispatch, not the GPU.

    python benchmarks/gpu_overhead.py [--models gpt2,llama]
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
import warnings

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import autosac
from autosac.applier import region
from autosac.core.optim import default_loss
from autosac.models import build_model
from autosac.solver import least_peak, solve_stats
from autosac.solver.problem import build_problem

BF16 = torch.bfloat16
MODELS = {
    "gpt2": ("gpt2", dict(batch=8, seq=1024)),
    "llama": ("llama-7b", dict(batch=4, seq=4096, n_layer=16, dim=2048, n_head=16, n_kv_head=4, ffn_hidden=5632)),
}


def _recompute_all(ctx, func, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _timed_steps(model, idx, n=7):
    walls, cpus = [], []
    for i in range(n + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        with torch.autocast("cuda", dtype=BF16):
            loss = default_loss(model(idx))
        loss.backward()
        cpu = time.perf_counter() - t0
        end.record()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        if i >= 2:
            walls.append(start.elapsed_time(end))
            cpus.append(cpu * 1e3)
    return statistics.median(walls), statistics.median(cpus)


def _blocks(model):
    return model.blocks if hasattr(model, "blocks") else model.layers


class _Patched:
    """Replace RegionCall methods for one measurement."""

    def __init__(self, **methods):
        self.methods = methods
        self.saved = {}

    def __enter__(self):
        for k, v in self.methods.items():
            self.saved[k] = getattr(region.RegionCall, k)
            setattr(region.RegionCall, k, v)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(region.RegionCall, k, v)


def _pass_forward(self, func, kind, args, kwargs):
    self.n += 1
    self.funcs.append(func)  # the replay checks it runs the same ops
    return func(*args, **kwargs)


def _pass_replay(self, func, kind, args, kwargs, k, local, keep):
    return func(*args, **kwargs)


def _no_modes(self):
    return create_selective_checkpoint_contexts(_recompute_all, allow_cache_entry_mutation=True)


def run(name, cfg):
    meta, idx_meta = build_model(name, device="meta", **cfg)
    stats = autosac.profile(meta, idx_meta, target="h100", autocast=BF16)
    problem = build_problem(stats)
    plan = solve_stats(stats, least_peak(problem, solver="highs")[0], solver="highs", problem=problem)
    torch.manual_seed(0)
    model, idx = build_model(name, device="cuda", **cfg)
    rows = [("none", model, None)]
    ck = copy.deepcopy(model)
    for b in _blocks(ck):
        b.forward = functools.partial(checkpoint, b.forward, use_reentrant=False)
    rows.append(("torch ckpt", ck, None))
    sac = copy.deepcopy(model)
    for b in _blocks(sac):
        b.forward = functools.partial(checkpoint, b.forward, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, _recompute_all))
    rows.append(("torch sac", sac, None))
    ours = autosac.apply(copy.deepcopy(model), plan)
    rows.append(("autosac", ours, None))
    rows.append(("autosac -rb", ours, dict(forward_op=_pass_forward, replay_op=_pass_replay)))
    rows.append(("autosac -m", ours, dict(contexts=_no_modes)))
    print(f"\n{name} {cfg}: plan checkpoints {len(plan.decisions)} modules, predicted overhead {plan.overhead:+.1%}")
    base = None
    for label, m, patch in rows:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _Patched(**(patch or {})):
                wall, cpu = _timed_steps(m, idx)
        base = base or wall
        print(f"  {label:12s} wall {wall:8.1f} ms ({wall / base - 1:+6.1%})  cpu {cpu:8.1f} ms", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,llama")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for key in args.models.split(","):
        name, cfg = MODELS[key]
        run(name, cfg)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
