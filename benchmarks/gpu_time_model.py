"""On a machine with a CUDA GPU (issue 32, deliverable 4): what the GPU time
model assumes, measured.  Three questions, each answered by variants of one
model timed side by side in interleaved rounds (every variant resident, one
warm-up step then one timed step each, in turn; medians over rounds):

1. **Do launches overlap kernels?**  Per variant: the step's wall time (CUDA
   events), its host time (``perf_counter`` until ``opt.step()`` returns,
   before synchronizing) and the GPU's busy time (the sum of its kernels and
   copies over one profiled step, ``torch.profiler``).  Run one after the
   other, host and kernels would take ``host + gpu``; fully overlapped,
   ``max(host, gpu)``.  ``overlap`` is the share of the shorter one hidden:
   ``(host + gpu - wall) / min(host, gpu)``.  The time model prices each op
   as the longer of its host work and its kernel (``autosac.core.host``), and
   a checkpointed region as the longer of its re-run and its machinery.
2. **What does autosac's plain path cost per checkpointed call on this
   host?**  A host-bound stack of small blocks on the GPU (microsecond
   kernels), unplanned, checkpointed block by block with
   ``torch.utils.checkpoint`` and with autosac's plain plan of every block:
   ``(variant - unplanned) / blocks`` per call, wall and host, beside the plan's
   predicted recompute per call and the calibrated figures.
3. **Why is transformers' ``gradient_checkpointing`` faster than autosac's
   plan at its peak on GPT-2** (1.057x on an H100, 2026-11-25)?  transformers
   GPT-2 (batch 8, seq 1024): unplanned, HF's switch, autosac planned at HF's
   measured peak, autosac's least plan and that plan with no Python-state
   capture, with the built-in gpt2 (unplanned and least) beside them.  Per
   variant also the time one step spends in Python's garbage collector and in
   autosac's state captures (timed in place).

    python benchmarks/gpu_time_model.py out.md            # CUDA, about a minute and a half
    python benchmarks/gpu_time_model.py out.md --smoke    # tiny models on the CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_hf_gpt2 import _Capture, _config, _inputs  # noqa: E402
from gpu_verify import gpu_target  # noqa: E402

import autosac  # noqa: E402
from autosac.core.host import host_costs  # noqa: E402
from autosac.core.optim import default_loss  # noqa: E402
from autosac.models import build_model  # noqa: E402
from autosac.solver import least_peak, plan_from_decisions, solve_stats  # noqa: E402
from autosac.solver.problem import build_problem  # noqa: E402

BF16 = torch.bfloat16
MIB = 2**20
ROUNDS = 12


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


class Variant:
    """One model with its optimizer and the step that trains it (output held
    until the next step, AdamW, bf16 autocast); ``capture`` is a
    :class:`_Capture` mode for autosac's state capture during its steps."""

    def __init__(self, model, batch, device, loss, capture="asis", predicted=None):
        self.model, self.batch, self.device, self.loss = model, batch, device, loss
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.capture, self.predicted, self.held = capture, predicted, None

    def step(self):
        with _Capture(self.capture):
            with torch.autocast(self.device, dtype=BF16):
                out = self.model(**self.batch) if isinstance(self.batch, dict) else self.model(self.batch)
                self.held = out
                loss = self.loss(out)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)


def _rounds(variants: dict, device: str) -> dict:
    """{label: (wall ms list, host ms list)} over interleaved rounds."""
    order = list(variants)
    for label in order:
        variants[label].step()
        variants[label].step()
    times = {k: ([], []) for k in order}
    for r in range(ROUNDS):
        for label in order[r % len(order):] + order[:r % len(order)]:
            v = variants[label]
            v.step()  # warm after the others ran
            _sync(device)
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            v.step()
            host = (time.perf_counter() - t0) * 1e3
            if device == "cuda":
                end.record()
                torch.cuda.synchronize()
                wall = start.elapsed_time(end)
            else:
                wall = host
            times[label][0].append(wall)
            times[label][1].append(host)
    return times


def _gpu_busy_ms(variant, device) -> tuple[float, int]:
    """The GPU's busy time over one profiled step (kernels, copies, sets) and their count."""
    if device != "cuda":
        return float("nan"), 0
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    variant.step()
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        variant.step()
        _sync(device)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, reach = 0, None
    for s, e in spans:  # the union of the intervals: kernels on several streams counted once
        if reach is None or s >= reach:
            busy += e - s
            reach = e
        elif e > reach:
            busy += e - reach
            reach = e
    return busy / 1e3, len(spans)


def _host_parts(variant, device) -> tuple[float, float, int]:
    """Over one step: ms in Python's garbage collector, ms in autosac's state
    captures (the forward's, timed in place) and how many there were."""
    from autosac.applier import region

    gc_ms, started, cap = [0.0], [0.0], [0.0, 0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            gc_ms[0] += (time.perf_counter() - started[0]) * 1e3

    inner = region.capture

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            cap[0] += (time.perf_counter() - t) * 1e3
            cap[1] += 1

    _sync(device)
    gc.callbacks.append(on_gc)
    region.capture = timed
    try:
        variant.step()
    finally:
        region.capture = inner
        gc.callbacks.remove(on_gc)
    _sync(device)
    return gc_ms[0], cap[0], cap[1]


def _table(variants: dict, device: str, out: list, base: str) -> dict:
    times = _rounds(variants, device)
    out.append(f"\n{ROUNDS} interleaved rounds; overhead: the median of each round's ratio to `{base}`.\n")
    out.append("| variant | predicted overhead | measured overhead | wall | host | GPU busy (kernels) | "
               "host + GPU | overlap | peak | in GC | in state capture (calls) |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {}
    for label, v in variants.items():
        walls, hosts = times[label]
        wall, host = statistics.median(walls), statistics.median(hosts)
        gpu, kernels = _gpu_busy_ms(v, device)
        ratio = statistics.median(a / b - 1 for a, b in zip(walls, times[base][0]))
        overlap = (host + gpu - wall) / min(host, gpu) if device == "cuda" and min(host, gpu) > 0 else float("nan")
        peak = _peak_mib(v, device)
        gc_ms, cap_ms, caps = _host_parts(v, device)
        pred = "-" if v.predicted is None else f"{v.predicted:+.1%}"
        out.append(f"| {label} | {pred} | {ratio:+.1%} | {wall:.2f} ms | {host:.2f} ms | {gpu:.2f} ms ({kernels}) | "
                   f"{host + gpu:.2f} ms | {overlap:.0%} | {peak:.0f} MiB | {gc_ms:.2f} ms | {cap_ms:.2f} ms ({caps}) |")
        rows[label] = dict(wall=wall, host=host, gpu=gpu, ratio=ratio)
    print("\n".join(out[-len(variants) - 3:]), flush=True)
    return rows


def _peak_mib(variant, device) -> float:
    """The step's own peak: the most allocated during it beyond what was allocated before it, plus the
    variant's parameters and optimizer state (its gradients are freed between steps)."""
    if device != "cuda":
        return float("nan")
    _sync(device)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    variant.step()
    _sync(device)
    own = sum(p.numel() * p.element_size() for p in variant.model.parameters())
    own += sum(t.numel() * t.element_size() for s in variant.opt.state.values() for t in s.values()
               if torch.is_tensor(t))
    return (torch.cuda.max_memory_allocated() - before + own) / MIB


# -- 2. the plain path's per-call cost on a host-bound model ------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Stack(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _square_loss(out):
    return out.float().pow(2).mean()


def per_call(device: str, target: str, out: list, n: int = 24, d: int = 256) -> None:
    shape = (8, 128, d)
    with torch.device("meta"):
        meta = Stack(d, n).train()
    stats = autosac.profile(meta, (torch.empty(shape, device="meta"),), loss_fn=_square_loss, target=target,
                            autocast=BF16)
    plan = plan_from_decisions(stats, {f"blocks.{i}": 1.0 for i in range(n)})
    torch.manual_seed(0)
    state = Stack(d, n).state_dict()
    x = torch.randn(shape, device=device)

    def made(how):
        m = Stack(d, n).train()
        m.load_state_dict(state)
        m.to(device)
        if how == "torch":
            for b in m.blocks:
                b.forward = _checkpointed(b.forward)
        elif how == "autosac":
            autosac.apply(m, plan)
        return m

    variants = {"none": Variant(made(None), x, device, _square_loss),
                "torch ckpt": Variant(made("torch"), x, device, _square_loss),
                "autosac plain": Variant(made("autosac"), x, device, _square_loss, predicted=plan.overhead)}
    out.append(f"\n## 2. Per checkpointed call: {n} blocks LayerNorm-Linear({d},{4 * d})-GELU-Linear, "
               f"input {list(shape)}, bf16 autocast\n")
    out.append(f"predicted: unplanned step {stats.step_ms:.2f} ms (forward {stats.forward_ms:.2f}); the plan "
               f"re-runs {plan.recompute_ms / n * 1e3:.0f} us a call, of which machinery "
               f"{plan.mechanism_ms / n * 1e3:.0f} us; host figures: {host_costs(None)}")
    rows = _table(variants, device, out, "none")
    for label in ("torch ckpt", "autosac plain"):
        extra = rows[label]["wall"] - rows["none"]["wall"]
        extra_host = rows[label]["host"] - rows["none"]["host"]
        out.append(f"- {label}: {extra / n * 1e3:.0f} us a call more (wall), {extra_host / n * 1e3:.0f} us (host); "
                   f"predicted {plan.recompute_ms / n * 1e3:.0f} us for autosac's")


def _checkpointed(fn):
    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return run


# -- 1 and 3. transformers GPT-2 and the built-in gpt2 ------------------------------------------------------

def _hf_variants(device, target, smoke, out):
    import transformers

    cfg, shape = _config(smoke)  # gpu_hf_gpt2's model and batch
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(cfg).train()
    stats = autosac.profile(meta, _inputs(shape, cfg.vocab_size, "meta"), loss_fn=lambda o: o.loss, target=target,
                            autocast=BF16)
    problem = build_problem(stats)
    least = solve_stats(stats, least_peak(problem, solver="highs")[0], solver="highs", problem=problem)
    torch.manual_seed(0)
    state = transformers.GPT2LMHeadModel(cfg).train().state_dict()
    batch = _inputs(shape, cfg.vocab_size, device)

    def made(plan=None, hf=False):
        m = transformers.GPT2LMHeadModel(cfg).train()
        m.load_state_dict(state)
        m.to(device)
        if hf:
            m.gradient_checkpointing_enable()
        if plan is not None:
            autosac.apply(m, plan)
        return m

    loss = lambda o: o.loss  # noqa: E731
    hf = Variant(made(hf=True), batch, device, loss)
    hf_peak = _peak_mib(hf, device)  # alone on the GPU: its peak is the budget autosac is given
    budget = least.predicted_peak_bytes if smoke else int(hf_peak * MIB)
    at_hf = solve_stats(stats, budget, solver="highs", problem=problem)
    out.append(f"transformers GPT-2 {shape}: HF's peak {hf_peak:.0f} MiB; plan there: {len(at_hf.decisions)} "
               f"modules {sorted(at_hf.decisions)}; least: {len(least.decisions)} modules, machinery "
               f"{least.mechanism_ms:.2f} ms of {least.recompute_ms:.2f} recomputed; unplanned predicted "
               f"{stats.step_ms:.1f} ms")
    return {"hf none": Variant(made(), batch, device, loss),
            "hf gradient_checkpointing": hf,
            "hf autosac @HF peak": Variant(made(at_hf), batch, device, loss, predicted=at_hf.overhead),
            "hf autosac least": Variant(made(least), batch, device, loss, predicted=least.overhead),
            "hf autosac least -capture": Variant(made(least), batch, device, loss, capture="none",
                                                 predicted=least.overhead)}


def _builtin_variants(device, target, smoke, out):
    cfg = dict(batch=2, seq=64, n_layer=4, dim=64, n_head=4, vocab=256) if smoke else dict(batch=8, seq=1024)
    meta, idx_meta = build_model("gpt2", device="meta", **cfg)
    stats = autosac.profile(meta, idx_meta, target=target, autocast=BF16)
    problem = build_problem(stats)
    least = solve_stats(stats, least_peak(problem, solver="highs")[0], solver="highs", problem=problem)
    torch.manual_seed(0)
    base, idx = build_model("gpt2", device=device, **cfg)
    state = base.state_dict()

    def made(plan=None):
        m, _ = build_model("gpt2", device=device, **cfg)
        m.load_state_dict(state)
        if plan is not None:
            autosac.apply(m, plan)
        return m

    out.append(f"built-in gpt2: unplanned predicted {stats.step_ms:.1f} ms; least: {len(least.decisions)} modules")
    return {"gpt2 none": Variant(base, idx, device, default_loss),
            "gpt2 least": Variant(made(least), idx, device, default_loss, predicted=least.overhead)}


def models(device, target, smoke, out):
    out.append("\n## 1 and 3. Overlap, and transformers' gradient_checkpointing against autosac's plans\n")
    variants = _hf_variants(device, target, smoke, out)
    _table(variants, device, out, "hf none")
    variants.clear()
    if device == "cuda":
        torch.cuda.empty_cache()
    _table(_builtin_variants(device, target, smoke, out), device, out, "gpt2 none")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the script runs")
    args = ap.parse_args()
    global ROUNDS
    device = "cpu" if args.smoke else "cuda"
    ROUNDS = 2 if args.smoke else ROUNDS
    target = "cpu" if args.smoke else gpu_target()
    warnings.simplefilter("ignore")
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    out = [f"# The GPU time model, measured: {where}, torch {torch.__version__}, target {target}\n"]
    for part in (lambda: per_call(device, target, out, *((4, 32) if args.smoke else ())),
                 lambda: models(device, target, args.smoke, out)):
        try:
            part()
        except Exception:
            out.append(f"\nFAILED\n```\n{traceback.format_exc()[-2000:]}\n```")
            traceback.print_exc()
        Path(args.out).write_text("\n".join(out) + "\n")  # after each part: a run cut short keeps what it has
    print("\n".join(out))


if __name__ == "__main__":
    main()
