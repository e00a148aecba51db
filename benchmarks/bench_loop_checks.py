"""What the applied model's run-time checks cost on this host, per training forward.

Two checks run on the common path since 2026-11-29:

  (a) the parameter watch (autosac.applier.param_watch.ParamWatch.check): one
      tuple of (requires_grad, dtype) over the parameters each training forward;
  (b) the saved-tensor hook of autocast plans (autosac.applier.casts): each
      saved tensor packed with its version and checked at unpacking, against
      what packing an activation did before (find the parameter behind it, detach).

Timed as medians of 9 rounds of many calls, in the thread's CPU time, for the
parameter counts of GPT-2 small (148), a 32-layer Llama (291) and an 80-layer
Llama (723), and for one activation through pack and unpack.

    python benchmarks/bench_loop_checks.py [--out benchmarks/results/bench_loop_checks.md]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch._ops import _len_torch_dispatch_stack_pre_dispatch

from autosac.applier.casts import _param_behind, pack_cast, unpack_cast
from autosac.applier.param_watch import ParamWatch
from autosac.core.plan import Plan


def _per_call_us(fn, calls: int, rounds: int = 9) -> float:
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        times.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(times)


def _model(n_params: int) -> nn.Module:
    return nn.ParameterList(nn.Parameter(torch.zeros(4)) for _ in range(n_params))


def _watch_row(n_params: int) -> str:
    model = _model(n_params)
    plan = Plan.__new__(Plan)  # only what the watch reads when nothing changed
    plan.frozen, plan.model = [], "bench"
    from autosac.core.fingerprint import model_fingerprint

    plan.fingerprint = model_fingerprint(model)
    watch = ParamWatch(plan)
    watch.check(model)
    us = _per_call_us(lambda: watch.check(model), 2000)
    return f"| parameter watch, {n_params} parameters | {us:.1f} | {us / n_params * 1000:.0f} ns a parameter |"


def _pack_before(t):
    """The hook's pack as it was before 2026-11-29, for an activation: no version kept."""
    if torch.compiler.is_compiling():
        return t
    if t.requires_grad and t.grad_fn is not None:
        _param_behind(t)
        if not torch._C._len_torch_dispatch_stack() and not _len_torch_dispatch_stack_pre_dispatch():
            return t.detach()
    return t


def _unpack_before(packed):
    if isinstance(packed, tuple) and packed and packed[0] == "autosac-cast":
        raise AssertionError("not a cast here")
    return packed


def _hook_rows() -> list[str]:
    w = torch.randn(64, 64, requires_grad=True)
    act = torch.randn(8, 64) @ w  # an activation with a node
    bare = _per_call_us(lambda: _unpack_before(_pack_before(act)), 20000)
    hooked = _per_call_us(lambda: unpack_cast(pack_cast(act)), 20000)
    return [f"| pack + unpack of one activation as before (no version) | {bare:.2f} | |",
            f"| pack + unpack of one activation, versions checked | {hooked:.2f} | "
            f"+{hooked - bare:.2f} us a saved tensor |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/bench_loop_checks.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = ["| check | us a call | |", "|---|---:|---|"]
    rows += [_watch_row(n) for n in (148, 291, 723)]
    rows += _hook_rows()
    text = "\n".join([f"# Run-time checks of an applied model ({time.strftime('%Y-%m-%d')}, torch {torch.__version__})",
                      "", *rows, ""])
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
