"""A plan under ``torch.compile``: the checkpointed module's decision as the
recompute tags PyTorch's min-cut partitioner honours.

Dynamo traces a checkpointed module as one region and, at AOT tracing, asks
a selective-checkpoint policy about each op in it.  The compiled region's op
calls are not the eager ones the plan lists: ``dropout(p=0)`` becomes a
``clone``, decompositions differ.  So the policy matches each compiled call
to the plan's calls by what it is and what it reads (:class:`CallMatcher`:
op name and the plan calls whose results it reads, through
:mod:`autosac.core.dataflow`), not by position.  A matched call the decision saves
is ``MUST_SAVE``, every other op ``MUST_RECOMPUTE`` -- parameter casts and
calls the eager step never made included -- except ops that draw random
numbers (dropout), always ``MUST_SAVE``: a recompute would draw others.  A
call the plan never made but that reads one plan call's result alone (a copy)
stands for that result in what later calls read.  On a torch whose policy
does not see op outputs, calls are matched by op name and occurrence.  The
policy is built from plain tuples so Dynamo can take the
``functools.partial`` holding it as a constant.

Example::

    >>> autosac.apply(model, plan)
    >>> compiled = torch.compile(model)       # each checkpointed module keeps its decision
"""

from __future__ import annotations

import functools
from collections import deque

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autosac.core.dataflow import DataflowTracker
from autosac.core.opkinds import op_kind


def save_keys(calls: list[tuple[str, tuple[int, ...]]], save: frozenset[int]) -> tuple[tuple[str, int], ...]:
    """The saved calls as (op name, occurrence among calls of that op)."""
    seen: dict[str, int] = {}
    keys = []
    for i, (name, _) in enumerate(calls):
        occurrence = seen.get(name, 0)
        seen[name] = occurrence + 1
        if i in save:
            keys.append((name, occurrence))
    return tuple(keys)


class CallMatcher:
    """Matches a compiled region's op calls, in order, to the plan's calls
    (``calls``: (op name, the calls it reads)), by op name and the plan calls
    whose results they read."""

    def __init__(self, calls: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        self.flow = DataflowTracker()
        self.n = 0  # compiled calls seen
        self.plan_call: dict[int, int | None] = {}  # compiled call -> the plan call it is (or stands for)
        self.waiting: dict[tuple[str, tuple[int, ...]], deque[int]] = {}
        for i, (name, deps) in enumerate(calls):
            self.waiting.setdefault((name, tuple(deps)), deque()).append(i)
        # a plan call no other reads, though it has one input, made no storage of its own
        # at run time (``_unsafe_view``, an alias): where compiled it makes one, it stands for its input
        read = {d for _, deps in calls for d in deps}
        self.stands_for = {i: deps[0] for i, (_, deps) in enumerate(calls) if len(deps) == 1 and i not in read}

    def match(self, func, args, kwargs, out) -> int | None:
        """The plan call this compiled call (which has run, giving ``out``) is, or None."""
        c = self.n
        self.n = c + 1
        read = self.flow.reads(args, kwargs)
        self.flow.record(c, func, args, kwargs, out)
        mapped = sorted({self.plan_call.get(d) for d in read} - {None})
        unknown = any(self.plan_call.get(d) is None for d in read)
        queue = None if unknown else self.waiting.get((_name(func), tuple(mapped)))
        if queue:
            i = queue.popleft()
            self.plan_call[c] = self.stands_for.get(i, i)
            return i
        # a call the plan never made: a copy of one result stands for it, anything else for nothing
        self.plan_call[c] = mapped[0] if len(mapped) == 1 and not unknown else None
        return None


def _name(func) -> str:
    return getattr(func, "overloadpacket", func).__name__


def compiled_contexts(calls: tuple[tuple[str, tuple[int, ...]], ...], save: frozenset[int] | tuple[int, ...]):
    """Selective-checkpoint contexts whose policy saves exactly the compiled
    calls that match ``calls`` at an index in ``save``."""
    save = frozenset(save)
    wanted = frozenset(save_keys(list(calls), save))
    matchers: dict[bool, CallMatcher] = {}
    counts: dict[tuple[bool, str], int] = {}

    def policy(ctx, func, *args, **kwargs):
        if isinstance(func, torch._ops.OpOverload) and op_kind(func).random:
            return CheckpointPolicy.MUST_SAVE  # a replay would draw other numbers
        if hasattr(ctx, "op_output"):
            matcher = matchers.get(ctx.is_recompute)
            if matcher is None:
                matcher = matchers[ctx.is_recompute] = CallMatcher(calls)
            i = matcher.match(func, args, kwargs, ctx.op_output)
            return CheckpointPolicy.MUST_SAVE if i is not None and i in save else CheckpointPolicy.MUST_RECOMPUTE
        name = _name(func)  # a torch whose policy sees no outputs: by name and occurrence
        key = (ctx.is_recompute, name)
        occurrence = counts.get(key, 0)
        counts[key] = occurrence + 1
        return CheckpointPolicy.MUST_SAVE if (name, occurrence) in wanted else CheckpointPolicy.MUST_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def compiled_context_fn(calls: list[tuple[str, tuple[int, ...]]], save: frozenset[int]):
    """``context_fn`` for ``torch.utils.checkpoint`` under Dynamo: the policy
    of :func:`compiled_contexts`, from plain tuples."""
    frozen = tuple((str(name), tuple(int(d) for d in deps)) for name, deps in calls)
    return functools.partial(compiled_contexts, frozen, tuple(sorted(save)))
