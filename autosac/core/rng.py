"""Random generators left as they were around work that must not move them.

Planning runs real ops (timing on this machine) and the user's forward (under
fake tensors, but Python code in it may draw from ``random``); drawing a
trainer's first batch may seed a sampler from torch's generator.  A seeded
run after planning must draw exactly what it would have drawn without it.
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def generators_kept():
    """Python's, NumPy's and torch's generators (CPU, and CUDA where it is in
    use) restored on exit.

    Example::

        >>> with generators_kept():
        ...     torch.randn(3)      # the next draw outside is the same as without this
    """
    py, npstate, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npstate)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
