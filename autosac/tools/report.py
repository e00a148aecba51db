"""Human-readable tables for plans and sweeps (display only; no logic)."""

from __future__ import annotations

from autosac.core.budget import format_bytes
from autosac.core.plan import plan_table, routing_line  # noqa: F401 - the plan's table, kept importable here as before


def sweep_table(result) -> str:
    """A :class:`autosac.tools.sweep.Sweep` as rows: each budget's plan, then
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
