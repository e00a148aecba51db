"""Which decisions of a plan does the memory model get wrong?  Applies each
decision alone, then each pair, and prints predicted vs measured peak
(allocator events).  A pair that is off while both singles are exact points at
an interaction between two checkpoints.

    python benchmarks/diagnose_decisions.py --budget least   # the least feasible plan
    python benchmarks/diagnose_decisions.py --budget 50%

Found this way: the checkpoint's cache held the dropout's output (kept because
the next matmul saves it) past that matmul's backward, 25 MiB over the
prediction for blocks.1.attn.attn_dropout + blocks.1.mlp; ops saved only
outside a checkpointed module are now re-run, not cached.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import warnings
from dataclasses import replace

import torch

import autosac
from autosac.core.devices import DEVICES
from autosac.models import build_model
from autosac.solver import least_peak, plan_from_decisions
from autosac.solver.problem import build_problem

MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="least")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model, idx = build_model("gpt2", device="cpu", batch=8, n_layer=args.layers, dim=512, n_head=8, seq=512,
                             vocab=8192, dropout=0.1)
    # an A100's roofline with the CPU's kernels: measured on this CPU
    stats = autosac.profile(model, idx, target=replace(DEVICES["a100"], name="a100-cpu-kernels", device_type="cpu"))
    budget = least_peak(build_problem(stats))[0] if args.budget == "least" else args.budget
    plan = autosac.solve(stats, budget)
    names = list(plan.decisions)
    print(f"plan at {args.budget}: {plan.decisions}\n")
    groups = [(n,) for n in names] + list(itertools.combinations(names, 2)) + [tuple(names)]
    for group in groups:
        sub = plan_from_decisions(stats, {n: plan.decisions[n] for n in group})
        measured = autosac.measure(autosac.apply(copy.deepcopy(model), sub), idx, steps=1).peak_bytes
        print(f"{' + '.join(group):<70} predicted {sub.predicted_peak_bytes / MIB:8.1f} MiB  measured "
              f"{measured / MIB:8.1f} MiB  off {(measured - sub.predicted_peak_bytes) / MIB:+6.1f} MiB", flush=True)


if __name__ == "__main__":
    main()
