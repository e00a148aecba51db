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

from autosac.core.errors import ProfilerBusyError


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


_COLLECTIVE = "c10d::"  # torch.distributed's in-place collectives (the ops behind dist.all_gather_into_tensor & co.)


def _memory_with_unseen_frees(roots, since: int | None = None) -> list[tuple[int, int]]:
    """``(time, bytes)`` of the allocator events in the profiler's event tree
    ``roots``, sorted, with the frees the profiler did not see added back --
    but not for memory allocated before ``since`` (where a count starts, see
    :meth:`AllocationCounter.stop`): when such an unseen free happened is not
    known, and placing it after ``since`` would lower the level counted from
    there below the truth.

    The profiler records an allocation or a free only on a thread that carries
    its thread-local state.  A collective's backend thread does not once it has
    run the collective: gloo's worker (``ProcessGroupGloo::runLoop``) drops its
    reference to a finished Work after it signalled completion, racing the
    caller, and when it drops the last one the tensors the Work held are freed
    unseen.  Gloo's ``reduce_scatter_tensor`` works on a whole copy of its input
    (``reduce_scatter_tensor_coalesced``: ``inputTensors[i].clone()``, then an
    all-reduce of it), so in some runs a rank appeared to hold one FSDP unit's
    gradients in ``reduce_dtype`` until the step's end.  Two frees are added:

    * memory allocated inside a ``c10d::`` collective on the calling thread is
      the backend's working memory (the op's outputs are the caller's, made
      before): counted freed when that op returns, the caller then only
      waiting for the collective;
    * any other allocation whose address the allocator hands out again with no
      free seen in between was freed before that: counted freed there.
    """
    from torch._C._profiler import _ExtraFields_Allocation

    allocations = []  # (time, ptr, bytes, end of the enclosing collective or None)
    todo = [(root, None) for root in roots]
    while todo:
        event, collective_end = todo.pop()
        if collective_end is None and event.name.startswith(_COLLECTIVE):
            collective_end = event.end_time_ns
        fields = event.extra_fields
        if isinstance(fields, _ExtraFields_Allocation):
            allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size, collective_end))
        todo.extend((child, collective_end) for child in event.children)
    allocations.sort(key=lambda a: (a[0], a[2]))
    memory, alive = [], {}  # alive: ptr -> (bytes, end of the collective that made it, when made)
    for at, ptr, nbytes, collective_end in allocations:
        if nbytes > 0:
            unseen = alive.pop(ptr, None)  # its address handed out again: freed, unseen
            if unseen is not None and (since is None or unseen[2] >= since):
                memory.append((at if unseen[1] is None else min(unseen[1], at), -unseen[0]))
            alive[ptr] = (nbytes, collective_end, at)
        else:
            alive.pop(ptr, None)
        memory.append((at, nbytes))
    memory += [(end, -nbytes) for nbytes, end, made in alive.values()
               if end is not None and (since is None or made >= since)]
    return sorted(memory)


def refuse_running_profiler() -> None:
    """Raise :class:`ProfilerBusyError` when a profiler session is running.

    autosac reads memory off a profiler of its own, and the profiler does not
    nest: starting a second session ends the user's and empties what it had
    recorded.  (Ops timed under a profiler are slower than they run, too.)"""
    if torch.autograd.profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled():
        raise ProfilerBusyError(
            "autosac measures memory with torch.profiler, and another profiler session is running (a second would "
            "end it and empty what it recorded): plan and measure before starting your profiler, or give its "
            "schedule a wait step before the step autosac plans on")


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
        """Start counting.

        Raises:
            ProfilerBusyError: a profiler session (``torch.profiler.profile``,
                ``torch.autograd.profiler.profile``) is already running: a second
                one would stop it and empty what it recorded.
        """
        refuse_running_profiler()
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
        first = min((e.start_ns() for e in events if after is not None and e.name() == after), default=None)
        if after is not None and first is None:
            raise RuntimeError(f"allocation_peak: fn never entered record_function({after!r})")
        if any(e.name().startswith(_COLLECTIVE) for e in events):
            memory = _memory_with_unseen_frees(profiler.profiler.kineto_results.experimental_event_tree(), first)
        else:
            memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
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
