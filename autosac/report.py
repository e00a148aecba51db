"""Human-readable tables for plans and sweeps (display only; no logic)."""

from __future__ import annotations

from autosac.budget import format_bytes


def plan_table(plan) -> str:
    lines = []
    if plan.details:
        width = max(len("module"), *(len(f or "(root)") for f in plan.details))
        lines.append(f"{'module':<{width}}  {'discard':>7}  {'freed':>11}  {'recompute':>11}  ops")
        for fqn, d in plan.details.items():  # as the solver ordered them: the model's order
            ops = _op_list([o.label for o in d.ops])
            lines.append(
                f"{fqn or '(root)':<{width}}  {d.ratio:>7.1%}  {format_bytes(d.discard_bytes):>11}"
                f"  {d.recompute_ms:>8.2f} ms  {ops}"
            )
    else:
        lines.append("no activation checkpointing needed: the step fits the budget as it is")
    s = plan.solver
    lines += [
        "",
        f"model            {plan.model} ({plan.fingerprint}), target {plan.target}, world size {plan.world_size}",
        *([f"FSDP2 units      {plan.sharding}"] if plan.sharding else []),
        *([f"downcast gather  {len(plan.gathered_dtypes)} parameters gathered in "
           f"{', '.join(sorted(set(plan.gathered_dtypes.values())))} (autosac.zero3.install_downcast_gather)"]
          if plan.gathered_dtypes else []),
        *([f"MoE routing      {routing_line(plan.routing)}"] if plan.routing else []),
        *([f"accumulation     {plan.grad_accumulation} micro-batches per optimizer step (peak and times per "
           "micro-batch, gradients alive throughout)"] if plan.grad_accumulation > 1 else []),
        *(["loop             zero_grad() before backward: the previous step's gradients alive through the "
            "forward"] if plan.zero_grad == "before_backward" and plan.grad_accumulation == 1 else []),
        f"baseline peak    {format_bytes(plan.baseline_peak_bytes)}",
        f"planned peak     {format_bytes(plan.predicted_peak_bytes)}"
        + (f" under torch.compile(backend={plan.compiled.get('backend')!r}); eager "
           f"{format_bytes(plan.compiled.get('eager_peak_bytes', 0))}" if plan.compiled else ""),
        f"budget           {format_bytes(plan.budget_bytes)}",
        f"recompute        {plan.recompute_ms:.2f} ms on a {plan.baseline_step_ms:.2f} ms step "
        f"(+{plan.overhead:.1%}), of which checkpointing machinery {plan.mechanism_ms:.2f} ms",
        f"solver           {s.get('backend')} {s.get('status')}, gap {_gap(s.get('gap'))}, "
        f"{s.get('seconds') or 0:.2f} s",
    ]
    return "\n".join(lines)


def routing_line(routing: dict) -> str:
    """``balanced, 4 routing decisions (2 of 8 experts per token, 1024 tokens)``."""
    a = routing.get("assumption", {})
    kind = a.get("kind", "balanced")
    factor = a.get("capacity_factor")
    what = f"capacity factor {factor:g}" if kind == "capacity" else kind
    calls = routing.get("routers", [])
    shapes = sorted({(c["top_k"], c["experts"], c["tokens"]) for c in calls})
    each = "; ".join(f"{k} of {n} experts per token, {t} tokens" for k, n, t in shapes)
    return f"{what}, assumed at {len(calls)} routing decision{'s' if len(calls) != 1 else ''} ({each})"


def _op_list(labels: list[str], shown: int = 4) -> str:
    """``a, b ×2, c and 3 more``: repeats of one label counted, the first few shown."""
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    items = [f"{k} ×{n}" if n > 1 else k for k, n in counts.items()]
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _gap(gap) -> str:
    return "-" if gap is None else f"{gap:.1e}"


def sweep_table(result) -> str:
    """A :class:`autosac.sweep.Sweep` as rows: each budget's plan, then
    checkpointing every block whole and no checkpointing; measured columns
    when the sweep was measured."""
    measured = result.measured_baseline_peak_bytes is not None
    head = f"{'budget':>11}  {'planned peak':>12}  {'recompute':>11}  {'overhead':>8}  {'modules':>7}"
    if measured:
        head += f"  {'measured peak':>13}  {'measured ovh':>12}  {'kept':>4}"
    out = [head + "  status"]
    for p in result.points:
        if p.plan is None:
            least = format_bytes(p.min_feasible_bytes) if p.min_feasible_bytes is not None else "?"
            out.append(f"{format_bytes(p.budget_bytes):>11}  {'-':>12}  {'-':>11}  {'-':>8}  {'-':>7}"
                       + (f"  {'-':>13}  {'-':>12}  {'-':>4}" if measured else "") + f"  infeasible (least peak {least})")
            continue
        kept = "" if not measured else f"  {('yes' if p.measured_peak_bytes <= p.budget_bytes else 'NO'):>4}"
        out.append(_row(format_bytes(p.budget_bytes), p, measured) + kept + f"  {p.status}")
    out.append("")
    if result.full_ac is not None:
        out.append(_row("every block", result.full_ac, measured) + (f"  {'-':>4}" if measured else "")
                   + f"  {result.full_ac.status}")
    t = result.torch_checkpoint
    if t is not None:
        out.append(f"{'torch ckpt':>11}  {'-':>12}  {'-':>11}  {'-':>8}  {t.modules:>7}  "
                   f"{format_bytes(t.measured_peak_bytes):>13}  {t.measured_overhead:>12.1%}  {'-':>4}"
                   "  torch.utils.checkpoint of every block, measured")
    none_row = f"{'none':>11}  {format_bytes(result.baseline_peak_bytes):>12}  {0.0:>8.2f} ms  {0.0:>8.1%}  {0:>7}"
    if measured:
        none_row += f"  {format_bytes(result.measured_baseline_peak_bytes):>13}  {0.0:>12.1%}  {'-':>4}"
    out.append(none_row + "  no checkpointing")
    if result.least_peak_bytes is not None:
        out.append(f"least feasible budget {format_bytes(result.least_peak_bytes)}")
    return "\n".join(out)


def _row(label: str, p, measured: bool) -> str:
    row = (f"{label:>11}  {format_bytes(p.peak_bytes):>12}  {p.recompute_ms:>8.2f} ms  "
           f"{p.overhead:>8.1%}  {p.modules:>7}")
    if measured:
        mp = format_bytes(p.measured_peak_bytes) if p.measured_peak_bytes is not None else "-"
        mo = f"{p.measured_overhead:.1%}" if p.measured_overhead is not None else "-"
        row += f"  {mp:>13}  {mo:>12}"
    return row
