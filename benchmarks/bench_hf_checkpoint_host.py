"""transformers' GPT-2 checkpointed by its own switch and by autosac's plain
path, on this CPU (issue 31: autosac ran 1.057x HF's step on an H100 at the
same memory).  Two questions:

1. Do the two run the same kernels?  The ATen ops of one training step
   (forward, loss, backward with its recompute), counted under a dispatch mode.
2. What does each cost the host?  A 12-layer model of width 64, where a step
   is nearly all host work: ``gradient_checkpointing_enable()`` against
   autosac's plan checkpointing the same 12 blocks whole (plain), with its
   Python-state capture as is, skipping autosac's own objects on each module
   (the policy and the forward partial), and skipped entirely.  Least times of
   interleaved rounds.

    python benchmarks/bench_hf_checkpoint_host.py [rounds]
"""

from __future__ import annotations

import copy
import functools
import sys
import time
import warnings
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autosac
import autosac.core.pystate as pystate
from autosac.applier import region
from autosac.applier.region import RegionPolicy
from autosac.solver import plan_from_decisions

LAYERS = 12


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _step(model, inputs) -> tuple[float, float]:
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**inputs)
    t1 = time.perf_counter()
    out.loss.backward()
    t2 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def _ops(model, inputs) -> Counter:
    _step(model, inputs)
    log = _Ops()
    with log:
        _step(model, inputs)
    return log.ops


def _capture_mode(mode: str) -> None:
    """``asis``, ``own`` (skip autosac's policy and forward partial) or ``none`` (no capture)."""
    pystate._KINDS.pop(RegionPolicy, None)
    pystate._KINDS.pop(functools.partial, None)
    region.capture = pystate.capture
    pystate._LAYOUTS.clear()  # layouts sorted under the kinds patched before
    if mode == "own":
        pystate._KINDS[RegionPolicy] = pystate._SKIP
        pystate._KINDS[functools.partial] = pystate._SKIP
    elif mode == "none":
        region.capture = lambda module, args, kwargs, host_rng=False: pystate.State([], [])


def main() -> None:
    import transformers

    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=64, n_head=4, vocab_size=256, n_positions=128,
                                  attn_implementation="sdpa", use_cache=False)
    base = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 256, (2, 64))
    inputs = {"input_ids": ids, "labels": ids}
    stats = autosac.profile(base, inputs, loss_fn=lambda o: o.loss, target="cpu", autocast=torch.bfloat16)
    plan = plan_from_decisions(stats, {f"transformer.h.{i}": 1.0 for i in range(LAYERS)})
    hf = copy.deepcopy(base)
    hf.gradient_checkpointing_enable()
    ours = autosac.apply(copy.deepcopy(base), plan)
    a, b = _ops(hf, inputs), _ops(ours, inputs)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; GPT-2 {LAYERS} x 64, batch 2 x 64")
    print(f"\nATen ops of one step: hf {sum(a.values())}, autosac {sum(b.values())}; where they differ:")
    for name in sorted(set(a) | set(b)):
        if a[name] != b[name]:
            print(f"  {name:40s} hf {a[name]:5d}  autosac {b[name]:5d}")
    variants = {"none": (base, "asis"), "hf": (hf, "asis"), "autosac": (ours, "asis"),
                "autosac, capture w/o own objects": (ours, "own"), "autosac, no capture": (ours, "none")}
    times: dict[str, list] = {k: [] for k in variants}
    for r in range(rounds + 2):
        for label, (model, mode) in variants.items():
            _capture_mode(mode)
            t = _step(model, inputs)
            if r >= 2:
                times[label].append(t)
    _capture_mode("asis")
    ref = min(f + w for f, w in times["hf"])
    print(f"\nhost time per step (least of {rounds} interleaved rounds):")
    for label, ts in times.items():
        total = min(f + w for f, w in ts)
        print(f"  {label:34s} forward {min(f for f, _ in ts):6.2f}  backward {min(w for _, w in ts):6.2f}  "
              f"step {total:6.2f} ms   vs hf {total - ref:+6.2f} ms ({(total - ref) / LAYERS * 1e3:+5.0f} us per block)")


if __name__ == "__main__":
    main()
