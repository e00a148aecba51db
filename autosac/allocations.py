"""What the CPU allocator did while a function ran, read off the PyTorch
profiler's allocator events: the peak of bytes allocated above the level at
the start, and the net bytes left allocated at the end.

Used by :func:`autosac.measure` (a real step's peak on the cpu) and by the
trace (working memory a CPU kernel allocates and frees inside one call).

Example::

    >>> peak, net = allocation_peak(lambda: torch.randn(1024) * 2.0)
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

import torch


@contextlib.contextmanager
def _native_stderr_quiet():
    """Silence what the profiler's native code prints on stderr (a line at each
    start and stop, which no setting turns off) while it starts and stops.

    The file descriptor is pointed at ``/dev/null`` for that time only and
    restored after; Python's own ``sys.stderr`` is flushed first, so nothing
    written before is lost."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (notebooks, captured streams)
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


class AllocationCounter:
    """The profiler's allocator events between :meth:`start` and :meth:`stop`,
    for code that cannot be wrapped in one call (a trainer's callbacks start and
    stop it).  ``stop()`` returns ``(peak, net)`` as :func:`allocation_peak` does.

    Example::

        >>> counter = AllocationCounter(); counter.start()
        >>> y = torch.randn(1024) * 2.0
        >>> peak, net = counter.stop()
    """

    def __init__(self) -> None:
        self._profiler = None

    def start(self) -> None:
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with _native_stderr_quiet():
            self._profiler.start()

    def stop(self, after: str | None = None) -> tuple[int, int]:
        """Stop counting; ``(peak, net)`` from the start (or from the first
        ``record_function(after)`` block, as in :func:`allocation_peak`)."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            raise RuntimeError("AllocationCounter.stop() without start()")
        with _native_stderr_quiet():
            profiler.stop()
        events = profiler.profiler.kineto_results.events()
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        first = min((e.start_ns() for e in events if after is not None and e.name() == after), default=None)
        if after is not None and first is None:
            raise RuntimeError(f"allocation_peak: fn never entered record_function({after!r})")
        level = peak = 0
        for at, nbytes in memory:
            if first is not None and at < first:
                continue
            level += nbytes
            peak = max(peak, level)
        return peak, level


def allocation_peak(fn: Callable[[], object], after: str | None = None) -> tuple[int, int]:
    """Run ``fn`` once under the profiler; return ``(peak, net)``: the most
    bytes the CPU allocator had allocated above its level at the start, and
    the bytes still allocated at the end (what ``fn`` returned, say; the
    result is dropped only after the count).

    ``after``: count from where ``fn`` first enters a
    ``torch.profiler.record_function(after)`` block instead of from the start
    (the profiler reports no free of memory allocated before it started, so a
    step that frees what an earlier step made is measured after that step,
    under the same profile).

    Raises whatever ``fn`` raises."""
    counter = AllocationCounter()
    counter.start()
    try:
        out = fn()
    except BaseException:
        counter.stop()
        raise
    result = counter.stop(after)
    del out
    return result
