"""The once-per-step extra of a checkpointed step (``HostCosts.first_call_us``,
issue 32), measured on real models beside the calibration's own figure, on
this CPU, in one run.

For each model (predict_suite's dispatch-bound sizes, AdamW, thread CPU
time), four variants are stepped in interleaved rounds:

  one        its middle block checkpointed alone (autosac's applier)
  all        every block checkpointed
  twice_one  the middle block's forward run twice, no checkpoint
  twice_all  every block's forward run twice

A block's machinery is its checkpointed step less its run-twice step; the
extra of a block checkpointed alone over each of ``k`` is
``(one - twice_one) - (all - twice_all) / k``, scaled by ``k / (k - 1)`` as the
calibration scales it (:func:`autosac.tools.calibrate._first_call_us`, whose
figure on its own micro-benchmark is printed beside).  Medians of the
rounds' differences.

    python benchmarks/bench_first_call.py [rounds]
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
from autosac.tools import calibrate  # noqa: E402

MODELS = {"mlp": "blocks", "autosac-llama": "layers", "hf-llama": "model.layers", "hf-gpt2": "transformer.h"}


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


def first_call_extra(name: str, rounds: int) -> tuple[int, float, float, float]:
    """``(blocks, machinery per call with all, with one alone, first-call extra)`` in us."""
    build, _ = predict_suite.MODELS[name]
    model, inputs, loss_fn = build(predict_suite._sizes("dispatch"))
    stats = autosac.profile(model, inputs, loss_fn=loss_fn, target="cpu")
    blocks = sorted((f for f in stats.modules if f.rpartition(".")[0] == MODELS[name]),
                    key=lambda f: int(f.rsplit(".", 1)[1]))
    k, mid = len(blocks), blocks[len(blocks) // 2]
    variants = {
        "one": autosac.apply(copy.deepcopy(model), plan_from_decisions(stats, {mid: 1.0})),
        "all": autosac.apply(copy.deepcopy(model), plan_from_decisions(stats, dict.fromkeys(blocks, 1.0))),
        "twice_one": _twice(model, [mid]), "twice_all": _twice(model, blocks),
    }
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
    per_all, per_one, extra = [], [], []
    for _ in range(rounds):
        t = {n: step(n) for n in variants}
        per_all.append((t["all"] - t["twice_all"]) / k)
        per_one.append(t["one"] - t["twice_one"])
        extra.append(per_one[-1] - per_all[-1])
    return k, statistics.median(per_all), statistics.median(per_one), statistics.median(extra) * k / (k - 1)


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv else 30
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    print(f"first-call extra per step, {rounds} rounds, this CPU, torch {torch.__version__}")
    for name in MODELS:
        k, per_all, per_one, extra = first_call_extra(name, rounds)
        print(f"{name:14s} {k} blocks  machinery per call: all {per_all:6.0f} us, one alone {per_one:6.0f} us;  "
              f"first-call extra {extra:5.0f} us", flush=True)
    models, _, inputs = calibrate._benchmark()
    figures = [calibrate._first_call_us(models["shallow"], inputs[("shallow", "none")]) for _ in range(3)]
    print("the calibration's first_call_us, three measurements:", ", ".join(f"{f:.0f}" for f in figures), "us")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
