"""The table of a batch-size search (display only; the logic is :mod:`autosac.tools.search`)."""

from __future__ import annotations

from autosac.core.budget import format_bytes


def search_table(result) -> str:
    """A :class:`autosac.tools.search.SearchResult` as a table, one row per batch
    size, the choice marked ``<- best``, and a closing line (the choice, or why
    nothing fits).

    Example::

        >>> print(search_table(result))
        batch  accum  samples/step   peak/rank    step ms  samples/s  plan
            8      1             8    14.02 GiB     412.31      19.40  fits without checkpointing
           16      1            16    19.87 GiB     790.02      20.25  7 modules checkpointed, recompute +3.1%  <- best
    """
    best = result.best
    head = (f"{'batch':>5}  {'accum':>5}  {'samples/step':>12}  {'peak/rank':>11}  {'step ms':>10}  "
            f"{'samples/s':>10}  plan")
    lines = [head]
    for row in result.rows:
        peak = format_bytes(row.predicted_peak_bytes) if row.predicted_peak_bytes is not None else "-"
        step = f"{row.predicted_step_ms:.2f}" if row.predicted_step_ms is not None else "-"
        rate = format_rate(row.predicted_samples_per_s) if row.predicted_samples_per_s is not None else "-"
        mark = "  <- best" if row is best else ""
        lines.append(f"{row.batch_size:>5}  {row.grad_accumulation:>5}  {row.samples_per_step:>12}  {peak:>11}  "
                     f"{step:>10}  {rate:>10}  {row.note}{mark}")
    where = f" over {result.world_size} ranks" if result.world_size > 1 else ""
    lines += ["", f"{result.model} on {result.target}{where}, memory per rank {format_bytes(result.memory_bytes)}"
                  + (f", global batch {result.global_batch}" if result.global_batch else ""),
              search_message(result)]
    return "\n".join(lines)


def format_rate(samples_per_s: float) -> str:
    """``12,345``, ``19.40``, ``0.0312``: samples per second for tables and messages."""
    if samples_per_s >= 100:
        return f"{samples_per_s:,.0f}"
    return f"{samples_per_s:.2f}" if samples_per_s >= 1 else f"{samples_per_s:.3g}"


def batch_words(row) -> str:
    """``8`` or ``8 x 4 micro-batches``."""
    if row.grad_accumulation > 1:
        return f"{row.batch_size} x {row.grad_accumulation} micro-batches"
    return str(row.batch_size)


def search_message(result) -> str:
    """One line: the choice, or why there is none and what would help."""
    best = result.best
    if best is not None:
        n = 0 if best.plan is None else len(best.plan.decisions)
        how = "no checkpointing" if not n else f"{n} module{'s' if n > 1 else ''} checkpointed"
        return (f"best: batch {batch_words(best)}, {format_rate(best.predicted_samples_per_s)} samples/s predicted, "
                f"with {how} (peak {format_bytes(best.predicted_peak_bytes)} of {format_bytes(result.memory_bytes)})")
    first = result.rows[0]
    return (f"nothing fits in {format_bytes(result.memory_bytes)} per rank: the smallest batch, {batch_words(first)}, "
            f"needs at least {format_bytes(first.min_feasible_bytes)}; {first.remedy}")
