"""Where a plan's step spends its op time against the unmodified step's, on
this CPU (issue 32): each op call of both timed in place, summed by phase.

The time model prices a plan as the unmodified step plus its re-runs and
checkpointing machinery: the forward's and the backward's own ops as they
were.  This checks that by timing every (non-view) op call of real training
steps in place -- a dispatch mode's clock around each call -- for the
unmodified model (its cache off, as ``autosac.apply`` runs it) and the plan
applied, in interleaved rounds, and printing per phase the median over the
rounds of the sum: the forward's ops (those inside the plan's checkpointed
modules apart), the backward's (the re-runs among them), and per op name
where the two differ.  The re-run's ops are the plan's backward ops the
unmodified backward does not run (its op names with more calls).  Steps
timed without the mode give the whole step.

    python benchmarks/plan_ops.py zoo-timm-swin dispatch mid --rounds 20

Measured on this 2-core VM (23rd session): Swin at its dispatch-bound mid
plan (three MLP regions), 20 rounds, twice: the whole step +5.3 and +4.8 ms
(priced +5.6, on an unmodified step priced 60.3 ms that ran 71.1-71.5); the
plan's forward ops 0.5-3 % faster than the unmodified step's, the re-run's
calls 2.1 ms, the backward's own ops 0.4-0.6 ms faster.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import statistics
import sys
import time
import warnings

import predict_suite as ps
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autosac
from autosac.core.opkinds import is_view_op
from autosac.core.optim import make_optimizer


class _Clock(TorchDispatchMode):
    """Sums each op call's time in place by (phase, op name); ``phase`` is
    set by the step, "forward" calls inside a checkpointed module apart."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.inside = None, 0
        self.ms: dict = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.phase is None or is_view_op(func):
            return func(*args, **kwargs)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        phase = "forward, checkpointed modules" if self.phase == "forward" and self.inside else self.phase
        key = (phase, func.overloadpacket.__name__)
        self.ms[key] += (time.perf_counter() - start) * 1e3
        self.calls[key] += 1
        return out


def _watch(model: torch.nn.Module, fqns, clock: _Clock) -> None:
    for fqn in fqns:
        module = model.get_submodule(fqn)
        module.register_forward_pre_hook(lambda *_: setattr(clock, "inside", clock.inside + 1))
        module.register_forward_hook(lambda *_: setattr(clock, "inside", clock.inside - 1))


def _step(model, args, kwargs, loss_fn, opt, clock: _Clock | None) -> float:
    """One AdamW step, its output held through backward (the loop plans are
    made for); this thread's CPU ms (with ``clock``: its ops timed in place)."""
    start = time.thread_time()
    with clock if clock is not None else contextlib.nullcontext():
        if clock is not None:
            clock.phase = "forward"
        out = model(*args, **kwargs)
        loss = loss_fn(out)
        if clock is not None:
            clock.phase = "backward"
        loss.backward()
        if clock is not None:
            clock.phase = None
    del out
    opt.step()
    opt.zero_grad(set_to_none=True)
    return (time.thread_time() - start) * 1e3


def measure(name: str, regime: str, budget: str, rounds: int) -> None:
    build, _ = ps.MODELS[name]
    torch.manual_seed(0)
    model, inputs, loss_fn = build(ps._sizes(regime))
    loss_fn = loss_fn or (lambda out: out)
    stats = autosac.profile(model, inputs, target="cpu", optimizer="adamw", loss_fn=loss_fn)
    least = autosac.solve(stats, "least")
    plan = least if budget == "least" else autosac.solve(
        stats, (least.predicted_peak_bytes + least.baseline_peak_bytes) // 2)
    variants = {"unmodified": ps.without_cache(model, inputs) or copy.deepcopy(model),
                "plan": autosac.apply(copy.deepcopy(model), plan)}
    clocks = {k: _Clock() for k in variants}
    for k, m in variants.items():
        _watch(m, plan.details, clocks[k])
    opts = {k: make_optimizer("adamw", [p for p in m.parameters() if p.requires_grad]) for k, m in variants.items()}
    args, kwargs = (inputs, {}) if not isinstance(inputs, dict) else ((), inputs)
    args = args if isinstance(args, tuple) else (args,)
    steps = {k: [] for k in variants}
    sums = {k: [] for k in variants}  # per round: (ms by (phase, op), calls by (phase, op))
    order = list(variants)
    for r in range(rounds + 3):  # three warm-up rounds; the variants' order turns each round
        for k in order[r % 2:] + order[: r % 2]:
            ms = _step(variants[k], args, kwargs, loss_fn, opts[k], None)
            clocks[k].ms.clear()
            clocks[k].calls.clear()
            _step(variants[k], args, kwargs, loss_fn, opts[k], clocks[k])
            if r >= 3:
                steps[k].append(ms)
                sums[k].append((dict(clocks[k].ms), collections.Counter(clocks[k].calls)))
    _report(plan, steps, sums)


def _report(plan, steps, sums) -> None:
    def median(k, key, i=0) -> float:
        return statistics.median(s[i].get(key, 0) for s in sums[k])

    def phase_ms(k, phase) -> float:
        return statistics.median(sum(v for (p, _), v in s[0].items() if p == phase) for s in sums[k])

    print(f"{len(plan.details)} regions: {', '.join(plan.details)}")
    print(f"whole step (this thread's CPU), ms: unmodified {statistics.median(steps['unmodified']):.2f}, plan "
          f"{statistics.median(steps['plan']):.2f} (priced {plan.baseline_step_ms:.2f} and {plan.step_ms:.2f})")
    for phase in ("forward", "forward, checkpointed modules", "backward"):
        print(f"{phase:31s} ops in place (wall), ms: unmodified {phase_ms('unmodified', phase):8.3f}   "
              f"plan {phase_ms('plan', phase):8.3f}")
    print("\nby op (median over rounds of each one's summed ms; median calls per step; the re-run: the plan's "
          "backward calls the unmodified backward does not make):")
    keys = sorted({key for k in sums for s in sums[k] for key in s[1]})
    for key in keys:
        a, b = median("unmodified", key), median("plan", key)
        n_a, n_b = median("unmodified", key, 1), median("plan", key, 1)
        if n_a != n_b or abs(b - a) > 0.05:
            print(f"  {key[0]:31s} {key[1]:28s} unmodified {n_a:4g} {a:7.3f}   plan {n_b:4g} {b:7.3f}   {b - a:+.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a benchmarks/predict_suite.py model name")
    ap.add_argument("regime", choices=("dispatch", "between", "compute"))
    ap.add_argument("budget", choices=("mid", "least"))
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args(argv)
    if args.regime not in ps.MODELS[args.model][1]:
        ap.error(f"{args.model} runs in {', '.join(ps.MODELS[args.model][1])}, not {args.regime}")
    ps.keep_freed_memory()  # as predict_suite measures: glibc keeps what a step frees (no page faults a step)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    measure(args.model, args.regime, args.budget, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
