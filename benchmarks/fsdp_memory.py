"""Per-rank peak of real FSDP2 training steps against the plan's prediction.

Each case spawns ``world`` gloo processes on this CPU; each builds the same
GPT, optionally applies a plan, wraps every block and the root with
``fully_shard`` (with and without a ``MixedPrecisionPolicy``), and measures one
AdamW step with :func:`autosac.measure` (the profiler's allocator events, the
local shards of parameters and optimizer state as the base).  The prediction
comes from ``autosac.profile(..., world_size=world)`` of the unsharded model.

    python benchmarks/fsdp_memory.py > benchmarks/results/fsdp_memory.md
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import warnings
from dataclasses import replace

import torch
import torch.multiprocessing as mp

import autosac
from autosac.core.devices import DEVICES
from autosac.models import build_model
from autosac.solver import least_peak
from autosac.solver.problem import build_problem

CFG = dict(n_layer=4, dim=256, n_head=4, seq=256, vocab=2048, dropout=0.0)
BATCH = 4
# times from an A100's roofline, kernels as this CPU runs them (the step is measured here)
TARGET = replace(DEVICES["a100"], name="a100-cpu-kernels", device_type="cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _policy(mixed):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=mixed[0], reduce_dtype=mixed[1]) if mixed else None


def _worker(rank, world, port, plan_json, mixed, out_dir):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    try:
        torch.manual_seed(0)
        model, idx = build_model("gpt2", device="cpu", batch=BATCH, **CFG)
        if plan_json:
            autosac.apply(model, autosac.Plan.from_json(plan_json))
        kw = {"mp_policy": _policy(mixed)} if mixed else {}
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        peak = autosac.measure(model, idx, optimizer="adamw", steps=1).peak_bytes
        with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
            f.write(str(peak))
        dist.barrier()  # every rank done before any tears its gloo pairs down
    finally:
        dist.destroy_process_group()


def measure_fsdp(world: int, plan=None, mixed=None) -> int:
    """The largest per-rank peak of one FSDP2 step over ``world`` gloo ranks."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        port = _free_port()
        plan_json = plan.to_json() if plan is not None else None
        procs = [ctx.Process(target=_worker, args=(r, world, port, plan_json, mixed, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
            if p.exitcode != 0:
                raise RuntimeError(f"rank exited with {p.exitcode}")
        return max(int(open(os.path.join(out, f"rank{r}")).read()) for r in range(world))


def predict(world: int, budget, mixed=None) -> tuple[int, object]:
    """The predicted per-rank peak, and the plan (None: no checkpointing)."""
    model, idx = build_model("gpt2", device="meta", batch=BATCH, **CFG)
    dtypes = {"param_dtype": mixed[0], "reduce_dtype": mixed[1]} if mixed else {}
    stats = autosac.profile(model, idx, optimizer="adamw", target=TARGET, world_size=world, **dtypes)
    problem = build_problem(stats)
    if budget is None:
        return problem.baseline_peak, None
    if budget == "least":
        budget = least_peak(problem)[0]
    plan = autosac.solve(stats, budget)
    return plan.predicted_peak_bytes, plan


def main() -> None:
    warnings.simplefilter("ignore")
    print("| ranks | mixed precision | budget | plan | predicted | measured | error | within budget |")
    print("|---:|---|---|---|---:|---:|---:|---|")
    for world in (2, 4):
        for mixed in (None, (torch.bfloat16, torch.float32), (torch.bfloat16, None)):
            label = "-" if mixed is None else f"bf16 params, {'fp32' if mixed[1] else 'bf16'} reduce"
            for budget in (None, "70%", "50%", "least"):
                try:
                    predicted, plan = predict(world, budget, mixed)
                except autosac.InfeasibleBudgetError:
                    print(f"| {world} | {label} | {budget} | infeasible | - | - | - | - |")
                    continue
                measured = measure_fsdp(world, plan, mixed)
                what = f"{len(plan.decisions)} modules" if plan else "none"
                kept = "-" if plan is None else ("yes" if measured <= plan.budget_bytes else "NO")
                print(f"| {world} | {label} | {budget or '-'} | {what} | {predicted:,} | {measured:,} | "
                      f"{(predicted - measured) / measured:+.2%} | {kept} |")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
