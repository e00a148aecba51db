"""Random generators left as they were around work that must not move them,
and the host's generators a checkpoint's replay must draw from again.

Planning runs real ops (timing on this machine) and the user's forward (under
fake tensors, but Python code in it may draw from ``random``); drawing a
trainer's first batch may seed a sampler from torch's generator.  A seeded
run after planning must draw exactly what it would have drawn without it
(:func:`generators_kept`).

A forward may also draw from Python's or NumPy's global generator (a
SpecAugment mask from ``np.random``, a layer dropped on ``random.random()``),
or from a ``torch.Generator`` of its own.
``torch.utils.checkpoint`` restores only torch's generators for its replay, so
a replay of such a module would draw other values and compute other
gradients, silently.  :class:`HostRng` is what the trace compares around each
module's forward and what the applier swaps in for the replay of a module
that drew.
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import numpy as np
import torch


class HostRng:
    """The states of Python's ``random``, NumPy's global generator and some
    ``torch.Generator`` objects (a module's own) at one moment.  Equality
    compares the global generators only (what the trace can see move).

    Example::

        >>> before = HostRng.now(); np.random.rand(); HostRng.now() == before
        False
        >>> before.install()      # the next np.random draw repeats the one above
    """

    __slots__ = ("py", "np", "torch")

    def __init__(self, py, npstate, generators=()) -> None:
        self.py, self.np = py, npstate
        self.torch = [(g, g.get_state()) for g in generators]

    @classmethod
    def now(cls, generators=()) -> HostRng:
        """The states now, with those of ``generators`` (``torch.Generator`` objects)."""
        # legacy=False: a dict for any bit generator (np.random.set_bit_generator), which set_state takes
        return cls(random.getstate(), np.random.get_state(legacy=False), generators)

    def generators(self) -> list[torch.Generator]:
        return [g for g, _ in self.torch]

    def install(self) -> None:
        random.setstate(self.py)
        np.random.set_state(self.np)
        for g, state in self.torch:
            g.set_state(state)

    def __eq__(self, other) -> bool:
        if not isinstance(other, HostRng):
            return NotImplemented
        return _same(self.np, other.np) and self.py == other.py

    __hash__ = None


def _same(a, b) -> bool:
    """Two NumPy generator states alike (nested dicts of numbers and arrays;
    the small entries first: a draw moves the position, rarely the key)."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return False
        keys = sorted(a, key=lambda k: isinstance(a[k], (dict, np.ndarray)))
        return all(_same(a[k], b[k]) for k in keys)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and bool(np.array_equal(a, b))
    return type(a) is type(b) and a == b


@contextmanager
def generators_kept():
    """Python's, NumPy's and torch's generators (CPU, and CUDA where it is in
    use) restored on exit.

    Example::

        >>> with generators_kept():
        ...     torch.randn(3)      # the next draw outside is the same as without this
    """
    host, cpu = HostRng.now(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        host.install()
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
