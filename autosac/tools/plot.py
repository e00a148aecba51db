"""The tradeoff of a :class:`autosac.tools.sweep.Sweep` as a picture (display only).

Needs matplotlib, the ``plot`` extra: ``pip install 'autosac[plot]'``.

Example::

    >>> result = autosac.tools.sweep.sweep(stats, ["90%", "70%", "50%", "40%"])
    >>> autosac.tools.plot.pareto_plot(result, "pareto.png")
"""

from __future__ import annotations

from autosac.core.errors import MissingExtraError

__all__ = ["pareto_plot"]

_GIB = 2**30


def pareto_plot(result, path: str | None = None, ax=None):
    """Budget against predicted recompute overhead: autosac's plans as a curve,
    no checkpointing and checkpointing every block as single points, the least
    feasible budget as a dashed line; measured points (from
    :func:`autosac.tools.sweep.measure_sweep`) beside the predicted ones.

    Args:
        result: a Sweep.
        path: write the figure there (png, svg, pdf: by the extension); None to keep it open.
        ax: a matplotlib Axes to draw into (a new figure when None).

    Returns:
        The matplotlib Figure.

    Raises:
        MissingExtraError: matplotlib is not installed.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtraError("plots need matplotlib: pip install 'autosac[plot]'") from None
    if ax is None:
        if path is not None:  # drawn straight to a file: no pyplot, no GUI backend, nothing process-wide
            fig = Figure(figsize=(7, 4.5))
            ax = fig.add_subplot()
        else:  # shown where pyplot shows figures (inline in a notebook)
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4.5))
    fig = ax.figure
    unit, scale = ("GiB", _GIB) if result.baseline_peak_bytes >= _GIB else ("MiB", 2**20)
    ok = sorted((p for p in result.points if p.plan is not None), key=lambda p: p.budget_bytes)
    ax.plot([p.budget_bytes / scale for p in ok], [100 * p.overhead for p in ok], "o-", color="C0",
            label="autosac plan (predicted)")
    measured = [p for p in ok if p.measured_overhead is not None]
    if measured:
        ax.plot([p.budget_bytes / scale for p in measured], [100 * p.measured_overhead for p in measured], "s",
                mfc="none", color="C0", label="autosac plan (measured)")
    ax.plot([result.baseline_peak_bytes / scale], [0], "D", color="C2", label="no checkpointing")
    if result.full_ac is not None:
        f = result.full_ac
        ax.plot([f.peak_bytes / scale], [100 * f.overhead], "^", color="C3",
                label=f"checkpoint every block ({len(result.blocks)})")
        if f.measured_overhead is not None:
            ax.plot([f.peak_bytes / scale], [100 * f.measured_overhead], "^", mfc="none", color="C3",
                    label="every block (measured)")
    t = result.torch_checkpoint
    if t is not None:
        ax.plot([t.measured_peak_bytes / scale], [100 * t.measured_overhead], "v", mfc="none", color="C1",
                label="torch.utils.checkpoint, every block (measured)")
    if result.least_peak_bytes is not None:
        ax.axvline(result.least_peak_bytes / scale, ls="--", color="0.5",
                   label=f"least feasible budget {result.least_peak_bytes / scale:.2f} {unit}")
    ax.set_xlabel(f"budget ({unit}); a point of checkpointing every block or none: its peak")
    ax.set_ylabel("recompute overhead (% of the step)")
    ax.set_title(f"{result.model} on {result.target}: memory budget vs recompute")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
    return fig
