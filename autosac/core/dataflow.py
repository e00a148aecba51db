"""Which earlier op calls each op call reads: one definition, used by the trace
(for the plan) and by the applier (at run time), so the two can be compared.

An op call *reads* the calls that produced the storages of its tensor
arguments, and the calls that wrote those storages in place since.  A call
*produces* the storages of its outputs that no argument already had (views and
other aliases produce nothing), and *writes* the arguments its schema marks as
written.  Storages made outside the tracked span have no producer; writes to
them inside it still count.

Example::

    >>> flow = DataflowTracker()
    >>> deps = flow.reads(args, kwargs); flow.record(i, func, args, kwargs, out)
"""

from __future__ import annotations

import weakref

import torch

from autosac.core.opkinds import op_kind

_TENSOR = torch.Tensor
_SEQ = (list, tuple)


def tensors_in(*trees) -> list[torch.Tensor]:
    """The tensors in op arguments or outputs: tensors, and lists, tuples and
    dicts of them (all a dispatched op takes or returns); faster than pytree."""
    out: list[torch.Tensor] = []
    for x in trees:
        _collect(x, out)
    return out


def _collect(x, out: list) -> None:
    if isinstance(x, _TENSOR):
        out.append(x)
    elif isinstance(x, _SEQ):
        for v in x:  # an op's arguments: mostly tensors and numbers, a list of tensors at most
            if isinstance(v, _TENSOR):
                out.append(v)
            elif isinstance(v, (list, tuple, dict)):
                _collect(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _collect(v, out)


def storage_of(t: torch.Tensor):
    """``t``'s storage, or None for a tensor without one (some subclasses)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (some subclasses)
        return None


class DataflowTracker:
    """Follows storages through op calls; remembers, per live storage, its
    producer call and the calls that wrote it since.

    Entries are keyed by the storage's ``id`` and hold a weak reference to
    it: an entry whose storage has died (its ``id`` free for another) is
    ignored and replaced, never read."""

    def __init__(self) -> None:
        # id(storage) -> [producer call or None, [calls that wrote it], weak reference]
        self._flow: dict[int, list] = {}

    def _entry(self, st) -> list | None:
        entry = self._flow.get(id(st))
        return entry if entry is not None and entry[2]() is st else None

    def reads(self, args, kwargs, storages: list | None = None) -> list[int]:
        """Sorted calls whose results a call with these arguments reads
        (``storages``: their tensors' storages, if the caller has them)."""
        return sorted(self._deps(storages if storages is not None else arg_storages(args, kwargs)))

    def _deps(self, storages: list) -> set[int]:
        flow = self._flow
        deps: set[int] = set()
        for st in storages:
            entry = flow.get(id(st))
            if entry is not None and entry[2]() is st:
                if entry[0] is not None:
                    deps.add(entry[0])
                deps.update(entry[1])
        return deps

    def step(self, idx: int, kind, storages: list, out, written) -> tuple[int, ...]:
        """:meth:`reads` then :meth:`record` for call ``idx``, which has run
        (``kind``: its :class:`~autosac.core.opkinds.OpKind`; ``storages``: its
        arguments'): the applier's one call per op, written for speed.
        Returns the calls it read, sorted."""
        flow = self._flow
        deps = self._deps(storages)
        if not kind.view:
            for t in written:
                st = storage_of(t)
                if st is not None:
                    entry = self._entry(st)
                    if entry is None:
                        entry = flow[id(st)] = [None, [], weakref.ref(st)]
                    entry[1].append(idx)
            for t in (out,) if isinstance(out, _TENSOR) else tensors_in(out):
                st = storage_of(t)
                if st is None:
                    continue
                entry = flow.get(id(st))
                if entry is not None and entry[2]() is st:
                    continue
                for s in storages:
                    if s is st:
                        break
                else:
                    flow[id(st)] = [idx, [], weakref.ref(st)]
        return tuple(sorted(deps)) if len(deps) > 1 else tuple(deps)

    def alias(self, src, dst) -> None:
        """Make storage ``dst`` stand for storage ``src``: the same producer, and
        the writes of either (the trace's fake twin of a real tensor a fake op
        wrote, :mod:`autosac.trace.recorder`)."""
        entry = self._entry(src)
        if entry is not None:
            self._flow[id(dst)] = [entry[0], entry[1], weakref.ref(dst)]

    def produced_here(self, t: torch.Tensor) -> bool:
        """Whether a tracked call produced ``t``'s storage (rather than it coming from outside)."""
        st = storage_of(t)
        entry = self._entry(st) if st is not None else None
        return entry is not None and entry[0] is not None

    def record(self, idx: int, func, args, kwargs, out, storages: list | None = None,
               written: list | None = None) -> None:
        """Note what call ``idx`` produced and wrote (``storages``: as in
        :meth:`reads`; ``written``: the tensors it wrote, if the caller has them)."""
        kind = op_kind(func)
        if kind.view:
            return
        self.step(idx, kind, storages if storages is not None else arg_storages(args, kwargs), out,
                  written if written is not None else kind.written_tensors(args, kwargs))


def arg_storages(args, kwargs) -> list:
    """The storages of a call's tensor arguments (tensors without one left out)."""
    out = []
    try:  # the common case, inline: tensors and numbers, a list of tensors at most
        for a in args:
            if isinstance(a, _TENSOR):
                out.append(a.untyped_storage())
            elif isinstance(a, _SEQ):
                out.extend(t.untyped_storage() for t in tensors_in(a))
        if kwargs:
            out.extend(t.untyped_storage() for t in tensors_in(kwargs))
        return out
    except (RuntimeError, NotImplementedError):  # tensors without a storage (some subclasses)
        return [st for st in map(storage_of, tensors_in(args, kwargs)) if st is not None]


def local_calls(ops: list[str], inputs: list[list[int]], window: tuple[int, int], ignored) -> tuple[list[int], list]:
    """The calls of one forward window as a plan stores them.

    Returns ``(events, calls)``: the window's events less ``ignored`` op names
    (those PyTorch's checkpointing never shows a policy), and per event
    ``[op name, [indices into events of the calls it reads]]``.
    """
    start, end = window
    events = [e for e in range(start, end) if ops[e] not in ignored]
    local = {e: i for i, e in enumerate(events)}
    calls = [[ops[e], sorted({local[d] for d in inputs[e] if d in local})] for e in events]
    return events, calls
