"""Each module's forward as priced by the trace against what it runs in place,
in real training steps on this CPU (issue 32).

A plan's re-run is priced as the forward ops of the modules it checkpoints,
so a module whose forward the trace prices high makes its plans read high.
This times every module down to ``--depth`` inside real AdamW steps of
``predict_suite``'s models: this thread's CPU time between the module's
forward pre-hook and its forward hook, median over ``--steps`` steps (the
first three left out), beside the sum of the trace's op times over the
module's first forward window (``stats.timeline.ms``).  The hooks cost a few
microseconds a module, in the measured times only.  With ``--ops MODULE``
each forward op of that module is timed in place too (a dispatch mode around
each call) beside its kernel as timed alone: the trace's op time less the
host figures it adds (``untimed_op_us`` and the per-MiB extra), which the
in-place time includes but for the module's Python.

    python benchmarks/forward_in_place.py autosac-gpt2 between
    python benchmarks/forward_in_place.py zoo-gemma2 dispatch --depth 3
    python benchmarks/forward_in_place.py autosac-gpt2 between --ops blocks.1.attn

Measured on this 2-core VM (16th session): layers past the first priced
10-25 % high at widths 64-128 (Gemma 2's attention 3.20 ms priced, 2.40 run;
the built-in GPT's at width 128 3.04 against 2.17), the whole forward within
2-7 % (docs/step-time-history.md, "Forwards timed in place").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "tests"), os.path.dirname(__file__)]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import autosac  # noqa: E402
from autosac.core.host import HostCosts  # noqa: E402
from autosac.core.optim import make_optimizer  # noqa: E402


class _Clock:
    """Thread time of each call of one module's forward, by its hooks."""

    def __init__(self) -> None:
        self.started, self.took = 0.0, []

    def pre(self, module, args) -> None:
        self.started = time.thread_time()

    def post(self, module, args, out) -> None:
        self.took.append((time.thread_time() - self.started) * 1e3)


class _OpClock(TorchDispatchMode):
    """Each op call's time (perf counter, microseconds) while active: one list per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards: list[list[tuple[str, float]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.forwards[-1].append((func.overloadpacket.__name__, (time.perf_counter() - start) * 1e6))
        return out


def _steps(model, inputs, loss_fn, steps: int) -> list[float]:
    args, kwargs = (inputs, {}) if not isinstance(inputs, dict) else ((), inputs)
    args = args if isinstance(args, tuple) else (args,)
    opt = make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    took = []
    for _ in range(steps):
        start = time.thread_time()
        loss_fn(model(*args, **kwargs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        took.append((time.thread_time() - start) * 1e3)
    return took


def modules_in_place(stats, model, inputs, loss_fn, depth: int, steps: int) -> None:
    """Print each module's priced and in-place forward (see the module's docstring)."""
    fqns = [f for f, m in stats.modules.items()
            if f and f.count(".") < depth and m.fw_windows and m.fw_windows[0][1] > m.fw_windows[0][0]]
    clocks = {f: _Clock() for f in fqns}
    for f, clock in clocks.items():
        module = model.get_submodule(f)
        module.register_forward_pre_hook(clock.pre)
        module.register_forward_hook(clock.post)
    took = _steps(model, inputs, loss_fn, steps)
    print(f"step: priced {stats.step_ms:.2f} ms, measured {statistics.median(took[3:]):.2f} ms (with the hooks)")
    tl = stats.timeline
    for f in fqns:
        m = stats.modules[f]
        w0, w1 = m.fw_windows[0]
        priced = sum(tl.ms[w0:w1])
        calls = len(m.fw_windows)
        run = statistics.median(clocks[f].took[3 * calls:][::calls])  # each step's first call, as priced
        print(f"{f:50s} ops {w1 - w0:4d}  priced {priced:8.3f} ms  in place {run:8.3f} ms  "
              f"ratio {run / priced if priced else float('nan'):.2f}")


def ops_in_place(stats, model, inputs, loss_fn, fqn: str, steps: int) -> None:
    """Print each forward op of ``fqn`` making data: its kernel as timed alone and its time in place."""
    host = HostCosts.from_dict(stats.target["host"])
    clock = _OpClock()

    def enter(module, args):
        clock.forwards.append([])
        clock.__enter__()

    module = model.get_submodule(fqn)
    module.register_forward_pre_hook(enter)
    module.register_forward_hook(lambda m, a, o: clock.__exit__(None, None, None))
    _steps(model, inputs, loss_fn, steps)
    runs = clock.forwards[3:]
    tl = stats.timeline
    w0, w1 = stats.modules[fqn].fw_windows[0]
    matched = _align([tl.ops[i] for i in range(w0, w1)], [name for name, _ in runs[0]])
    if matched is None or any(len(r) != len(runs[0]) for r in runs):
        print(f"{fqn}: its ops in place are not the traced ones: not compared op by op")
        return
    for i, j in zip(range(w0, w1), matched):
        nbytes = tl.made_bytes[i]
        if not nbytes:
            continue
        extra = host.size_us(nbytes, host.untimed_us_per_mib)
        alone = tl.ms[i] * 1e3 - host.untimed_op_us - extra
        run = statistics.median(r[j][1] for r in runs)
        print(f"{tl.ops[i]:24s} makes {nbytes / 1024:7.0f} KiB  kernel alone {alone:8.1f} us  in place {run:8.1f} us  "
              f"per-MiB extra priced {extra:6.1f} us")


def _align(traced: list[str], run: list[str]) -> list[int] | None:
    """For each traced op, the index of the same op in ``run``, which may hold
    more (autograd's ``detach`` of a tensor it saves, which the trace leaves
    out); None where the traced ops are not found in order."""
    out, j = [], 0
    for name in traced:
        while j < len(run) and run[j] != name:
            j += 1
        if j == len(run):
            return None
        out.append(j)
        j += 1
    return out


def main(argv=None) -> int:
    import predict_suite as ps

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help=", ".join(ps.MODELS))
    ap.add_argument("regime", choices=ps.REGIMES)
    ap.add_argument("--depth", type=int, default=3, help="modules down to this many name parts (default 3)")
    ap.add_argument("--steps", type=int, default=30, help="training steps timed (default 30, the first 3 left out)")
    ap.add_argument("--ops", metavar="MODULE", help="also each forward op of this module, in place")
    a = ap.parse_args(argv)
    if a.model not in ps.MODELS:
        ap.error(f"unknown model {a.model!r}: use {', '.join(ps.MODELS)}")
    ps.keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, inputs, loss_fn = ps.MODELS[a.model][0](ps._sizes(a.regime))
    loss_fn = loss_fn or (lambda out: out)
    stats = autosac.profile(model, inputs, target="cpu", optimizer="adamw", loss_fn=loss_fn)
    modules_in_place(stats, model, inputs, loss_fn, a.depth, a.steps)
    if a.ops:
        ops_in_place(stats, model, inputs, loss_fn, a.ops, a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
