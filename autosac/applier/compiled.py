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
stands for that result in what later calls read.  Before torch 2.13 the
policy is not given a call's output; it takes it from the store the two
contexts share, where the forward context puts every output under compile.  The
policy is built from plain tuples so Dynamo can take the
``functools.partial`` holding it as a constant.

Example::

    >>> autosac.apply(model, plan)
    >>> compiled = torch.compile(model)       # each checkpointed module keeps its decision
"""

from __future__ import annotations

import functools
import inspect
from collections import deque

import torch
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from autosac.core.dataflow import DataflowTracker
from autosac.core.opkinds import op_kind

_POLICY_SEES_OUTPUTS = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


class CallMatcher:
    """Matches a compiled region's op calls, in order, to the plan's calls
    (``calls``: (op name, the calls it reads)), by op name and the plan calls
    whose results they read."""

    def __init__(self, calls: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        self.flow = DataflowTracker()
        self.n = 0  # compiled calls seen
        self.running: tuple = (None, None, (), {})  # the call matched last, until its output is known
        self.plan_call: dict[int, int | None] = {}  # compiled call -> the plan call it is (or stands for)
        self.waiting: dict[tuple[str, tuple[int, ...]], deque[int]] = {}
        for i, (name, deps) in enumerate(calls):
            self.waiting.setdefault((name, tuple(deps)), deque()).append(i)
        # a plan call no other reads, though it has one input, made no storage of its own
        # at run time (``_unsafe_view``, an alias): where compiled it makes one, it stands for its input
        read = {d for _, deps in calls for d in deps}
        self.stands_for = {i: deps[0] for i, (_, deps) in enumerate(calls) if len(deps) == 1 and i not in read}

    def match(self, func, args, kwargs) -> int | None:
        """The plan call this compiled call is, or None; :meth:`produced`
        takes its output once it has run."""
        c = self.n
        self.n = c + 1
        read = self.flow.reads(args, kwargs)
        self.running = (c, func, args, kwargs)
        mapped = sorted({self.plan_call.get(d) for d in read} - {None})
        unknown = any(self.plan_call.get(d) is None for d in read)
        queue = self._resync(_name(func), mapped) if unknown else self.waiting.get((_name(func), tuple(mapped)))
        if queue:
            i = queue.popleft()
            self.plan_call[c] = self.stands_for.get(i, i)
            return i
        # a call the plan never made: a copy of one result stands for it, anything else (a random
        # draw included: compiled dropout is one call, eager dropout four) for nothing
        copy = len(mapped) == 1 and not unknown and not _random(func)
        self.plan_call[c] = mapped[0] if copy else None
        return None

    def _resync(self, name: str, mapped: list[int]) -> deque[int] | None:
        """For a call reading a result the plan never made (compiled dropout
        is one ``native_dropout`` where the eager step made several calls):
        the first waiting plan call of that name that reads at least the plan
        calls it reads, so the calls after it are matched again."""
        best = None
        for (n, deps), queue in self.waiting.items():
            if n == name and queue and set(mapped) <= set(deps) and (best is None or queue[0] < best[0]):
                best = queue
        return best

    def produced(self, out) -> None:
        """The output of the call :meth:`match` took last."""
        c, func, args, kwargs = self.running
        self.flow.record(c, func, args, kwargs, out)


def _random(func) -> bool:
    return isinstance(func, torch._ops.OpOverload) and op_kind(func).random


def _name(func) -> str:
    return getattr(func, "overloadpacket", func).__name__


def compiled_contexts(calls: tuple[tuple[str, tuple[int, ...]], ...], save: frozenset[int] | tuple[int, ...]):
    """Selective-checkpoint contexts whose policy saves exactly the compiled
    calls that match ``calls`` at an index in ``save``."""
    save = frozenset(save)
    matchers: dict[bool, CallMatcher] = {}
    running: list = []  # torch without op_output: the matcher whose call's output comes next

    def policy(ctx, func, *args, **kwargs):
        matcher = matchers.get(ctx.is_recompute)
        if matcher is None:
            matcher = matchers[ctx.is_recompute] = CallMatcher(calls)
        i = matcher.match(func, args, kwargs)
        if _POLICY_SEES_OUTPUTS:
            matcher.produced(ctx.op_output)
        else:  # the output comes when the contexts store it (_see_outputs)
            running[:] = [matcher]
        if _random(func):
            return CheckpointPolicy.MUST_SAVE  # a replay would draw other numbers
        return CheckpointPolicy.MUST_SAVE if i is not None and i in save else CheckpointPolicy.MUST_RECOMPUTE

    contexts = create_selective_checkpoint_contexts(policy)
    if not _POLICY_SEES_OUTPUTS:
        _see_outputs(contexts, running)
    return contexts


class _Outputs(dict):
    """The store the two selective-checkpoint contexts share (a dict of
    lists by op), which hands each output stored to the matcher whose call
    made it: under compile the forward context stores every call's output
    right after asking the policy about it."""

    def __init__(self, running: list) -> None:
        super().__init__()
        self.running = running

    def __missing__(self, func):
        self[func] = stored = _Stored(self.running)
        return stored


class _Stored(list):
    def __init__(self, running: list) -> None:
        super().__init__()
        self.running = running

    def append(self, entry) -> None:
        super().append(entry)
        if self.running:
            self.running.pop().produced(tree_map(lambda w: getattr(w, "val", w), entry))


def _see_outputs(contexts, running: list) -> None:
    """On a torch whose policy is not given op outputs (before 2.13): have
    the contexts' shared store pass each stored output to the matcher."""
    store = _Outputs(running)
    for mode in contexts:
        if not isinstance(getattr(mode, "storage", None), dict):
            raise RuntimeError("autosac: this torch's selective checkpointing keeps no output store; "
                               "upgrade torch to 2.13 or newer to compile checkpointed modules")
        mode.storage = store


def compiled_context_fn(calls: list[tuple[str, tuple[int, ...]]], save: frozenset[int]):
    """``context_fn`` for ``torch.utils.checkpoint`` under Dynamo: the policy
    of :func:`compiled_contexts`, from plain tuples."""
    frozen = tuple((str(name), tuple(int(d) for d in deps)) for name, deps in calls)
    return functools.partial(compiled_contexts, frozen, tuple(sorted(save)))
