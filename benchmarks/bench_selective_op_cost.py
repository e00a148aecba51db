"""What selective checkpointing costs the host per op call, autosac's against
PyTorch's, on this CPU, measured side by side in one run.

A region of many cheap ops (a Linear, then ``OPS`` elementwise ops on a small
tensor: a step that is almost all dispatch) is run forward and backward:

  plain ckpt     torch.utils.checkpoint, no selective contexts (the baseline:
                 the same re-run, no per-op modes)
  torch sac      torch's create_selective_checkpoint_contexts, a trivial policy
                 (cache the Linear's matmul, recompute the rest)
  autosac        autosac's applier, a plan caching the same matmul and
                 recomputing the rest (its selective path)

The per-op cost of a selective variant is its step time less plain ckpt's,
over the op calls that ran under its modes (each in the forward and again in
the replay).  Medians of interleaved rounds.

    python benchmarks/bench_selective_op_cost.py [rounds]
"""

from __future__ import annotations

import copy
import functools
import statistics
import sys
import time
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import autosac
from autosac.core.devices import DEVICES
from autosac.core.host import HostCosts
from autosac.solver import plan_from_decisions

OPS = 60  # elementwise ops per region
REGIONS = 4


class Chain(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        x = self.lin(x)
        for _ in range(OPS // 2):
            x = torch.sin(x) * 1.0001
        return x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Chain() for _ in range(REGIONS)])


def _torch_variant(model, context_fn=None):
    m = copy.deepcopy(model)
    for region in m:
        kw = {"context_fn": context_fn} if context_fn else {}
        region.forward = functools.partial(checkpoint, region.forward, use_reentrant=False, **kw)
    return m


def _cache_matmul(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func is torch.ops.aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE


def _autosac_variant(model, x):
    from dataclasses import replace

    spec = replace(DEVICES["cpu"], host=HostCosts())
    stats = autosac.profile(model, x, target=spec, optimizer="none", output_held=False)
    plan = plan_from_decisions(stats, {str(i): 1.0 for i in range(REGIONS)})
    for d in plan.details.values():
        d.save = [next(i for i, (op, _) in enumerate(d.calls) if op == "addmm")]
        d.skip = []
    ops = len(plan.details["0"].calls)
    return autosac.apply(copy.deepcopy(model), plan), ops


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model = _model()
    x = torch.randn(4, 16, requires_grad=True)
    ours, ops = _autosac_variant(model, x)
    variants = {
        "plain ckpt": _torch_variant(model),
        "torch sac": _torch_variant(model, functools.partial(create_selective_checkpoint_contexts, _cache_matmul)),
        "autosac": ours,
    }
    # the same gradients, or the comparison means nothing
    grads = {}
    for name, m in variants.items():
        m(x).sum().backward()
        grads[name] = [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
    for name in variants:
        assert all(torch.equal(a, b) for a, b in zip(grads[name], grads["plain ckpt"])), name
    samples = {k: [] for k in variants}
    for _ in range(rounds):
        for name, m in variants.items():
            for _ in range(5):
                t = time.perf_counter()
                m(x).sum().backward()
                m.zero_grad(set_to_none=True)
                samples[name].append((time.perf_counter() - t) * 1e6)
    med = {k: statistics.median(v) for k, v in samples.items()}
    calls = 2 * ops * REGIONS  # each op call under the modes twice: forward and replay
    print(f"{REGIONS} regions of {ops} op calls each (a Linear and {OPS} elementwise ops on a 4x16 tensor), "
          f"{rounds} rounds of 5 steps, torch {torch.__version__}")
    print()
    print("| variant | step us | per op call beyond plain ckpt, us |")
    print("|---|---:|---:|")
    for name, us in med.items():
        extra = "-" if name == "plain ckpt" else f"{(us - med['plain ckpt']) / calls:.2f}"
        print(f"| {name} | {us:.0f} | {extra} |")
    ratio = (med["autosac"] - med["plain ckpt"]) / max(1e-9, med["torch sac"] - med["plain ckpt"])
    print()
    print(f"autosac's selective path costs {ratio:.2f}x torch's per op call")


if __name__ == "__main__":
    main()
