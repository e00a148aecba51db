"""A checkpointed call's machinery against the op calls run since the last
one (``HostCosts.call_gap_us``, issue 32): predicted beside measured on real
models, on this CPU, in one run.

For each model (predict_suite's dispatch-bound sizes, AdamW, thread CPU
time), four variants are stepped in interleaved rounds:

  one        its middle block checkpointed alone (autosac's applier)
  all        every block checkpointed
  twice_one  the middle block's forward run twice, no checkpoint
  twice_all  every block's forward run twice

A plan's machinery is its checkpointed step less its run-twice step (medians
of the rounds' differences), printed per call beside the plan's own
``mechanism_ms`` per call: a block alone runs the machinery after the whole
step's other op calls, each of all blocks after one block's, and costs more.
The calibration's ``call_gap_us`` (three measurements) closes the table.

    python benchmarks/bench_call_gap.py [rounds]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

import predict_suite  # noqa: E402

import autosac  # noqa: E402
from autosac.solver import plan_from_decisions  # noqa: E402
from autosac.tools import calibrate, calibration_apart  # noqa: E402

MODELS = {"mlp": "blocks", "autosac-gpt2": "blocks", "autosac-llama": "layers", "hf-llama": "model.layers", "hf-gpt2": "transformer.h"}


class _Twice(nn.Module):
    """Runs the wrapped block's forward twice (any arguments), the first result dropped."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        self.block(*args, **kwargs)
        return self.block(*args, **kwargs)


def _twice(model: nn.Module, fqns: list[str]) -> nn.Module:
    out = copy.deepcopy(model)
    for fqn in fqns:
        parent, _, name = fqn.rpartition(".")
        setattr(out.get_submodule(parent), name, _Twice(out.get_submodule(fqn)))
    return out


def machinery(name: str, rounds: int) -> dict:
    """Per call, in us: the ``all`` and ``one`` plans' machinery, measured and predicted."""
    build, _ = predict_suite.MODELS[name]
    model, inputs, loss_fn = build(predict_suite._sizes("dispatch"))
    stats = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu")
    blocks = sorted((f for f in stats.modules if f.rpartition(".")[0] == MODELS[name]),
                    key=lambda f: int(f.rsplit(".", 1)[1]))
    k, mid = len(blocks), blocks[len(blocks) // 2]
    plans = {"one": plan_from_decisions(stats, {mid: 1.0}), "all": plan_from_decisions(stats, dict.fromkeys(blocks, 1.0))}
    variants = {n: autosac.apply(copy.deepcopy(model), p) for n, p in plans.items()}
    variants.update(twice_one=_twice(model, [mid]), twice_all=_twice(model, blocks))
    opts = {n: torch.optim.AdamW(m.parameters()) for n, m in variants.items()}

    def step(n: str) -> float:
        t = time.thread_time()
        out = variants[n](**inputs) if isinstance(inputs, dict) else variants[n](inputs)
        loss_fn(out).backward()
        opts[n].step()
        opts[n].zero_grad(set_to_none=True)
        return (time.thread_time() - t) * 1e6

    for n in variants:  # warm-up: optimizer state, first-call caches
        step(n), step(n)
    per_all, per_one = [], []
    for _ in range(rounds):
        t = {n: step(n) for n in variants}
        per_all.append((t["all"] - t["twice_all"]) / k)
        per_one.append(t["one"] - t["twice_one"])
    return {"blocks": k, "all": statistics.median(per_all), "one": statistics.median(per_one),
            "all_predicted": plans["all"].mechanism_ms * 1e3 / k, "one_predicted": plans["one"].mechanism_ms * 1e3}


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv else 30
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(f"machinery per checkpointed call, measured / predicted, {rounds} rounds, this CPU, torch {torch.__version__}")
    for name in MODELS:
        r = machinery(name, rounds)
        print(f"{name:14s} {r['blocks']} blocks  all: {r['all']:5.0f} / {r['all_predicted']:5.0f} us   "
              f"one alone: {r['one']:5.0f} / {r['one_predicted']:5.0f} us", flush=True)
    models, _, inputs = calibrate._benchmark()
    x = inputs[("shallow", "none")]
    figures = [calibration_apart.apart_figures(models, x)["call_gap_us"] for _ in range(3)]
    print("the calibration's call_gap_us, three measurements:", ", ".join(f"{f:.1f}" for f in figures), "us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
