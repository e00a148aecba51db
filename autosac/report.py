"""Human-readable tables for plans and sweeps (display only; no logic)."""

from __future__ import annotations

from autosac.budget import format_bytes


def plan_table(plan) -> str:
    lines = []
    if plan.details:
        width = max(len("module"), *(len(f or "(root)") for f in plan.details))
        lines.append(f"{'module':<{width}}  {'discard':>7}  {'freed':>11}  {'recompute':>11}  ops")
        for fqn, d in plan.details.items():  # as the solver ordered them: the model's order
            ops = ", ".join(o.label for o in d.ops[:4]) + (f" and {len(d.ops) - 4} more" if len(d.ops) > 4 else "")
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
        f"baseline peak    {format_bytes(plan.baseline_peak_bytes)}",
        f"planned peak     {format_bytes(plan.predicted_peak_bytes)}"
        + (f" under torch.compile(backend={plan.compiled.get('backend')!r}); eager "
           f"{format_bytes(plan.compiled.get('eager_peak_bytes', 0))}" if plan.compiled else ""),
        f"budget           {format_bytes(plan.budget_bytes)}",
        f"recompute        {plan.recompute_ms:.2f} ms on a {plan.baseline_step_ms:.2f} ms step "
        f"(+{plan.overhead:.1%})",
        f"solver           {s.get('backend')} {s.get('status')}, gap {_gap(s.get('gap'))}, "
        f"{s.get('seconds') or 0:.2f} s",
    ]
    return "\n".join(lines)


def _gap(gap) -> str:
    return "-" if gap is None else f"{gap:.1e}"


def sweep_table(rows: list[dict]) -> str:
    out = [f"{'budget':>11}  {'planned peak':>12}  {'recompute':>11}  {'overhead':>8}  {'modules':>7}  status"]
    for r in rows:
        if r.get("error"):
            out.append(f"{format_bytes(r['budget']):>11}  {'-':>12}  {'-':>11}  {'-':>8}  {'-':>7}  {r['error']}")
            continue
        out.append(
            f"{format_bytes(r['budget']):>11}  {format_bytes(r['peak']):>12}  {r['ms']:>8.2f} ms  "
            f"{r['overhead']:>8.1%}  {r['modules']:>7}  {r['status']}"
        )
    return "\n".join(out)
