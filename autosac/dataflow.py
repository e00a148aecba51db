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

from autosac.opkinds import op_kind


def tensors_in(*trees) -> list[torch.Tensor]:
    """The tensors in op arguments or outputs: tensors, and lists, tuples and
    dicts of them (all a dispatched op takes or returns); faster than pytree."""
    out: list[torch.Tensor] = []
    todo = list(trees)
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
    return out


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (some subclasses)
        return None


class DataflowTracker:
    """Follows storages through op calls; remembers, per live storage, its
    producer call and the calls that wrote it since."""

    def __init__(self) -> None:
        self._flow: dict[int, tuple[int | None, list[int]]] = {}
        self._refs: dict[int, weakref.ref] = {}

    def _key(self, st) -> int:
        key = id(st)
        if key not in self._refs:
            self._refs[key] = weakref.ref(st, lambda _r, k=key: self._forget(k))
        return key

    def _forget(self, key: int) -> None:
        self._flow.pop(key, None)
        self._refs.pop(key, None)

    def reads(self, args, kwargs, storages: list | None = None) -> list[int]:
        """Sorted calls whose results a call with these arguments reads
        (``storages``: their tensors' storages, if the caller has them)."""
        deps: set[int] = set()
        flow = self._flow
        for st in storages if storages is not None else arg_storages(args, kwargs):
            entry = flow.get(id(st))
            if entry is not None:
                if entry[0] is not None:
                    deps.add(entry[0])
                deps.update(entry[1])
        return sorted(deps)

    def produced_here(self, t: torch.Tensor) -> bool:
        """Whether a tracked call produced ``t``'s storage (rather than it coming from outside)."""
        st = _storage(t)
        entry = self._flow.get(id(st)) if st is not None else None
        return entry is not None and entry[0] is not None

    def record(self, idx: int, func, args, kwargs, out, storages: list | None = None,
               written: list | None = None) -> None:
        """Note what call ``idx`` produced and wrote (``storages``: as in
        :meth:`reads`; ``written``: the tensors it wrote, if the caller has them)."""
        kind = op_kind(func)
        if kind.view:
            return
        ins = {id(st) for st in (storages if storages is not None else arg_storages(args, kwargs))}
        for t in written if written is not None else kind.written_tensors(args, kwargs):
            st = _storage(t)
            if st is not None:
                key = self._key(st)
                self._flow.setdefault(key, (None, []))[1].append(idx)
        for t in tensors_in(out):
            st = _storage(t)
            if st is not None and id(st) not in ins and id(st) not in self._flow:
                self._flow[self._key(st)] = (idx, [])


def arg_storages(args, kwargs) -> list:
    """The storages of a call's tensor arguments (tensors without one left out)."""
    return [st for st in map(_storage, tensors_in(args, kwargs)) if st is not None]


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
