"""Where a predicted overhead goes wrong: the parts of the least (or mid) plan's step,
predicted beside measured, on this CPU (issue 32).

For each model (``benchmarks/predict_suite.py``'s names), the least plan is
solved and four variants run in interleaved rounds (medians of this thread's
CPU time, one torch thread):

* ``as given``: the unmodified model (a transformers decoder with
  ``use_cache=True`` fills its key/value cache);
* ``base``: the unmodified model as the plan's baseline is priced, its cache
  off as ``autosac.apply`` turns it off (the same model where it fills none);
* ``twice``: ``base`` with each of the plan's regions running its forward
  twice (the first result dropped): the plan's re-run without the
  checkpointing machinery;
* ``plan``: the applied plan.

Printed per model, predicted / measured, in ms: the unmodified step
(``plan.baseline_step_ms`` / ``base``), the cache's work (not priced /
``as given - base``), the re-run (the plan's recompute less its machinery /
``twice - base``), the machinery (``plan.mechanism_ms`` / ``plan - twice``),
the whole increment (``plan.step_ms - plan.baseline_step_ms`` /
``plan - base``), and the overhead (against ``base``).  The re-run of a
region is a second forward back to back in ``twice``, warm in the caches,
and in the backward in ``plan``: the split between re-run and machinery is
only as good as that stand-in; their sum is measured as it is.

    python benchmarks/bench_overhead_parts.py --models zoo-gemma2,zoo-t5,hf-llama
    python benchmarks/bench_overhead_parts.py --models hf-opt,mlp --budget mid --regime dispatch
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings

import predict_suite as ps
import torch

import autosac  # noqa: E402  (predict_suite put tests/ on the path)


class _Twice:
    """Stands in a region's forward: runs it twice, returns the second result
    (no ``nn.Module``: one set as ``forward`` would be registered as a child
    and the class's own ``forward`` found first)."""

    def __init__(self, forward) -> None:
        self._forward = forward

    def __call__(self, *args, **kwargs):
        self._forward(*args, **kwargs)
        return self._forward(*args, **kwargs)


def twice(model, fqns):
    """A copy of ``model`` whose modules ``fqns`` run their forward twice."""
    out = copy.deepcopy(model)
    mods = dict(out.named_modules())
    for fqn in fqns:
        mod = mods[fqn]
        mod.forward = _Twice(mod.forward)
    return out


def parts(name: str, rounds: int, steps: int, budget: str = "least", regime: str | None = None) -> dict:
    build, regimes = ps.MODELS[name]
    regime = regime or regimes[0]
    torch.manual_seed(0)
    model, inputs, loss_fn = build(ps._sizes(regime))
    loss_fn = loss_fn or (lambda out: out)
    stats = autosac.profile(model, inputs, target="cpu", optimizer="adamw", loss_fn=loss_fn)
    plan = autosac.solve(stats, "least")
    if budget == "mid":  # halfway between the least and the unmodified peak, as predict_suite's mid
        plan = autosac.solve(stats, (plan.predicted_peak_bytes + plan.baseline_peak_bytes) // 2)
    base = ps.without_cache(model, inputs)
    variants = {"given": model, "base": base if base is not None else model}
    variants["twice"] = twice(variants["base"], list(plan.decisions))
    variants["plan"] = autosac.apply(copy.deepcopy(model), plan)
    if base is None:
        variants.pop("given")
    timed = ps._timed(variants, inputs, loss_fn, rounds, steps)

    def diff(a: str, b: str) -> float:  # round by round (ps.paired)
        return ps.paired(timed.rounds, a, b, ratio=False)

    rerun = plan.recompute_ms - plan.mechanism_ms
    return {
        "model": f"{name} ({regime}, {budget}, {len(plan.decisions)} regions)",
        "step": (plan.baseline_step_ms, timed.cpu["base"]),
        "cache": (None, diff("given", "base")) if "given" in timed.cpu else None,  # None: it fills no cache
        "rerun": (rerun, diff("twice", "base")),
        "machinery": (plan.mechanism_ms, diff("plan", "twice")),
        "increment": (plan.recompute_ms, diff("plan", "base")),
        "overhead": (plan.step_ms / plan.baseline_step_ms - 1, ps.paired(timed.rounds, "plan", "base")),
    }


def _cell(pair, pct=False) -> str:
    if pair is None:
        return "-"
    fmt = (lambda x: f"{x:+.1%}") if pct else (lambda x: f"{x:.2f}")
    return " / ".join("not priced" if x is None else fmt(x) for x in pair)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="zoo-t5,zoo-whisper,zoo-gemma2,zoo-clip,hf-llama,hf-gpt2",
                    help="comma-separated predict_suite names (their first regime)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--budget", choices=("least", "mid"), default="least")
    ap.add_argument("--regime", choices=("dispatch", "compute"), help="default: each model's first")
    a = ap.parse_args(argv)
    ps.keep_freed_memory()  # measured as predict_suite measures
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    print("| model | unmodified step | cache | re-run | machinery | increment | overhead |")
    print("|---|---|---|---|---|---|---|")
    for name in a.models.split(","):
        r = parts(name, a.rounds, 5, a.budget, a.regime)
        print(f"| {r['model']} | {_cell(r['step'])} | {_cell(r['cache'])} | {_cell(r['rerun'])} "
              f"| {_cell(r['machinery'])} | {_cell(r['increment'])} | {_cell(r['overhead'], pct=True)} |", flush=True)
    print(f"\n(predicted / measured, ms of this thread's CPU time; {a.rounds} rounds, "
          f"{time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
