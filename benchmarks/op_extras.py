"""What each op costs in a real training step beyond its kernel timed alone,
measured in the same round, on this CPU (issue 32; autosac.core.hostsize).

A CPU target prices each op as its kernel timed alone plus host figures, one
of which grows with the bytes the op makes (``untimed_us_per_mib``,
``backward_untimed_us_per_mib``: fitted on the calibration's large model).
This script measures that extra directly: it runs real steps of a model with
a dispatch mode timing every forward and backward op call in place (the
optimizer's are left out), and right after each step times each of those
calls alone on inputs of its shapes, as the trace does
(:func:`autosac.trace.costs.real_inputs`, least of three calls).  Per op it
keeps the median over the rounds of (in place - alone); per phase it prints
the sum beside the MiB the ops touched (inputs and outputs, as the
roofline counts them: :func:`autosac.trace.costs.op_bytes`) and made
(outputs, as :func:`autosac.core.hostsize.made_bytes` counts them), and
with ``--fit`` how well each way of weighing an op's bytes, fitted on the
calibration's large model, prices the model's sum.

    python benchmarks/op_extras.py calib
    python benchmarks/op_extras.py autosac-llama compute --fit

Measured on this 2-core VM (22nd session): per MiB made, the calibration
model's forward ops ran 150 us over alone, autosac-llama's 136, hf-llama's
(width 256) about the same; backward 107 against 97.  Weighed as the
calibration priced them (capped at its typical op, 0.74 MiB) the fit read
253 and priced the Llamas' forward extras 39-55 % high; capped at its
largest op, within 6 %.  The in-place times include the dispatch mode's
own few microseconds an op.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "tests"), os.path.dirname(__file__)]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from autosac.core.hostsize import LARGE_BATCH, LARGE_REGIONS, LARGE_SEQ, LARGE_WIDTH, made_bytes  # noqa: E402
from autosac.core.noise import best_ms  # noqa: E402
from autosac.core.opkinds import is_view_op  # noqa: E402
from autosac.core.optim import make_optimizer  # noqa: E402
from autosac.trace.costs import op_bytes, real_inputs  # noqa: E402

PHASES = ("forward", "backward")


class _Calls(TorchDispatchMode):
    """Records each op call of a phase (``record``) or times it in place."""

    def __init__(self, record: bool) -> None:
        super().__init__()
        self.record, self.phase = record, "forward"
        self.calls = {p: [] for p in PHASES}  # (op, real inputs or None, name, touched, made)
        self.times = {p: [] for p in PHASES}  # microseconds in place

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.phase not in PHASES or is_view_op(func):
            return func(*args, **kwargs)
        inputs = None
        if self.record:
            try:
                inputs = real_inputs(args, kwargs)
            except RuntimeError:  # inputs that cannot be made: not timed alone, as the trace does not
                pass
        start = time.perf_counter()
        out = func(*args, **kwargs)
        took = (time.perf_counter() - start) * 1e6
        if self.record:
            self.calls[self.phase].append((func, inputs, func.overloadpacket.__name__,
                                           op_bytes(args, kwargs, out), made_bytes(func, args, kwargs, out)))
        else:
            self.times[self.phase].append(took)
        return out


def _model(name: str, regime: str):
    import predict_suite as ps

    if name == "calib":
        from autosac.tools.calibration_models import _Block

        model = torch.nn.Sequential(*[_Block(LARGE_WIDTH, 1) for _ in range(LARGE_REGIONS)])
        return model, torch.randn(LARGE_BATCH, LARGE_SEQ, LARGE_WIDTH), (lambda out: out.sum()), None
    model, inputs, loss_fn = ps.MODELS[name][0](ps._sizes(regime))
    opt = make_optimizer("adamw", [p for p in model.parameters() if p.requires_grad])
    return model, inputs, loss_fn or (lambda out: out), opt


def measure(name: str, regime: str, rounds: int) -> dict[str, list[tuple]]:
    """Per phase, per op call: (op, touched bytes, made bytes, median us in place less alone)."""
    model, inputs, loss_fn, opt = _model(name, regime)
    args, kwargs = (inputs, {}) if not isinstance(inputs, dict) else ((), inputs)
    args = args if isinstance(args, tuple) else (args,)

    def step(mode: _Calls) -> None:
        with mode:
            mode.phase = "forward"
            loss = loss_fn(model(*args, **kwargs))
            mode.phase = "backward"
            loss.backward()
            mode.phase = "optimizer"
            if opt is not None:
                opt.step()
        model.zero_grad(set_to_none=True)

    recorded = _Calls(record=True)
    step(recorded)
    diffs = {p: [[] for _ in recorded.calls[p]] for p in PHASES}
    for _ in range(rounds):
        clock = _Calls(record=False)
        step(clock)
        for p in PHASES:
            if len(clock.times[p]) != len(recorded.calls[p]):
                raise RuntimeError(f"{name}'s {p} ran other ops than the first step's")
            for k, (func, inp, *_rest) in enumerate(recorded.calls[p]):
                if inp is not None:
                    alone = best_ms(lambda f=func, i=inp: f(*i[0], **i[1]), repeats=3, max_repeats=3)[0] * 1e3
                    diffs[p][k].append(clock.times[p][k] - alone)
    return {p: [(c[2], c[3], c[4], statistics.median(d)) for c, d in zip(recorded.calls[p], diffs[p]) if d]
            for p in PHASES}


def report(rows: dict[str, list[tuple]]) -> None:
    for p, ops in rows.items():
        touched, made, extra = (sum(r[i] for r in ops) for i in (1, 2, 3))
        if not ops or not touched:
            print(f"{p}: no op timed")
            continue
        print(f"{p}: {len(ops)} ops, {extra / 1e3:.2f} ms beyond their kernels alone; "
              f"{extra / (touched / 2**20):.1f} us per MiB touched, {extra / max(made / 2**20, 1e-9):.1f} per MiB made")
        kinds = collections.defaultdict(lambda: [0, 0, 0, 0.0])
        for op, t, m, d in ops:
            k = kinds[op]
            k[0], k[1], k[2], k[3] = k[0] + 1, k[1] + t, k[2] + m, k[3] + d
        for op, (n, t, m, d) in sorted(kinds.items(), key=lambda kv: -kv[1][3])[:10]:
            print(f"   {op:40s} x{n:<4d} touched {t / n / 1024:6.0f} KiB  made {m / n / 1024:6.0f} KiB  "
                  f"beyond alone {d / n:7.1f} us")


def fit(calib: dict[str, list[tuple]], rows: dict[str, list[tuple]]) -> None:
    """Each weighing fitted on the calibration model's sums, applied to the model's ops."""
    from autosac.core.hostsize import extra_us
    from autosac.tools.calibrate import calibrate

    made = [m for _, _, m, _ in calib["forward"] if m > 1024]  # the loss's scalar left out, as anchor_bytes does
    small = calibrate().small_op_bytes  # the small calibration's typical op (this machine's, cached)
    large = statistics.geometric_mean(made)  # the large one's (autosac.core.hostsize.anchor_bytes)
    largest = max(made)
    weighings = {
        "capped at the typical op": lambda t, m: extra_us(min(m, large), small, large, 1.0),
        "capped at the largest op": lambda t, m: extra_us(min(m, largest), small, large, 1.0),
        "per MiB made": lambda t, m: m / 2**20,
        "per MiB touched": lambda t, m: t / 2**20,
    }
    for p in PHASES:
        for label, w in weighings.items():
            weight = sum(w(r[1], r[2]) for r in calib[p])
            if not weight or not rows[p]:
                continue
            rate = sum(r[3] for r in calib[p]) / weight
            priced = rate * sum(w(r[1], r[2]) for r in rows[p]) / 1e3
            got = sum(r[3] for r in rows[p]) / 1e3
            print(f"{p:8s} {label:26s} {rate:6.1f} us/MiB: priced {priced:6.2f} ms, measured {got:6.2f} "
                  f"({priced / got - 1:+.0%})")


def main(argv=None) -> int:
    import predict_suite as ps

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="calib (the calibration's large model) or " + ", ".join(ps.MODELS))
    ap.add_argument("regime", nargs="?", default="compute", choices=ps.REGIMES)
    ap.add_argument("--rounds", type=int, default=8, help="steps timed, each followed by its ops alone (default 8)")
    ap.add_argument("--fit", action="store_true", help="also fit each weighing on the calibration model and price this one")
    ap.add_argument("--json", help="write the per-op rows here")
    a = ap.parse_args(argv)
    if a.model != "calib" and a.model not in ps.MODELS:
        ap.error(f"unknown model {a.model!r}: use calib or {', '.join(ps.MODELS)}")
    ps.keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = measure(a.model, a.regime, a.rounds)
    report(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f)
    if a.fit and a.model != "calib":
        torch.manual_seed(0)
        fit(measure("calib", a.regime, a.rounds), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
