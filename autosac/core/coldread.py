"""What an optimizer step's foreach ops read from memory the step let go cold,
on a CPU target (:mod:`autosac.tools.calibrate` measures the figure).

The op timings (:mod:`autosac.trace.costs`) call each op over and over on the
same tensors; AdamW's foreach ops in a training step run once, after the
forward and backward have passed through the caches, each over whole lists
of parameters, gradients and optimizer state.  Measured on this 2-core
machine in transformers Qwen3 at width 256 (7.3 MiB of parameters, 47
tensors), the eight foreach ops of AdamW's step took 8.0 ms in the step
against 4.5 ms each called back to back; an op's excess follows the lists it
reads that the op before it did not touch (``lerp_(exp_avg, grad)``: 0.82 ms
over, ``add_`` on the list the op before it wrote: 0.04).  So a foreach op
pays :attr:`~autosac.core.host.HostCosts.cold_read_us_per_mib` per MiB of the
tensors it is passed that the previous foreach op was not passed and did not
make (:func:`cold_bytes`), each by its size's share between the two
calibrated op sizes (:func:`autosac.core.hostsize.share`: small tensors stay in
the caches), and the calibration measures the figure as the same count on a
real AdamW step, run after other work against run back to back.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from autosac.core.hostsize import MIB, share


def is_foreach(func) -> bool:
    """An op over lists of tensors (``torch._foreach_*``)."""
    return func.overloadpacket.__name__.startswith("_foreach_")


def tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def cold_bytes(inputs: list[torch.Tensor], recent: list[torch.Tensor], small: float, large: float) -> float:
    """Share-weighted bytes of ``inputs`` not in ``recent`` (by identity): the
    tensors the previous foreach op was passed or made."""
    seen = {id(t) for t in recent}
    out, counted = 0.0, set()
    for t in inputs:
        if id(t) in seen or id(t) in counted:
            continue
        counted.add(id(t))
        b = t.numel() * t.element_size()
        out += share(b, small, large) * b
    return out


class ColdReads:
    """Follows the foreach ops of a step in order: :meth:`mib` gives each call's
    share-weighted MiB read cold and remembers its tensors for the next one."""

    def __init__(self) -> None:
        self.recent: list[torch.Tensor] = []  # held: ids stay theirs until the next foreach op

    def mib(self, func, args, kwargs, out, small: float, large: float) -> float:
        """``small``, ``large``: the calibrated op sizes (:func:`autosac.core.hostsize.share`)."""
        if not is_foreach(func):
            return 0.0
        inputs = tensors((args, kwargs))
        got = cold_bytes(inputs, self.recent, small, large) / MIB
        self.recent = inputs + tensors(out)
        return got


__all__ = ["ColdReads", "cold_bytes", "is_foreach"]
