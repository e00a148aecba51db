"""A plan under ``torch.compile``: the checkpointed module's decision as the
recompute tags PyTorch's min-cut partitioner honours.

Dynamo traces a checkpointed module as one region and, at AOT tracing, asks
a selective-checkpoint policy about each op in it.  The policy here answers
from the decision by op name and occurrence (the eager applier matches op
calls by position, which compiled graphs do not keep): the calls the
decision saves are ``MUST_SAVE``, every other op ``MUST_RECOMPUTE`` --
parameter casts included -- except ops that draw random numbers (dropout),
always ``MUST_SAVE``: a recompute would draw others.  It is built from plain tuples so Dynamo can take
the ``functools.partial`` holding it as a constant.

Example::

    >>> autosac.apply(model, plan)
    >>> compiled = torch.compile(model)       # each checkpointed module keeps its decision
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autosac.opkinds import op_kind


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


def compiled_contexts(saved: tuple[tuple[str, int], ...]):
    """Selective-checkpoint contexts whose policy saves exactly ``saved``."""
    wanted = frozenset(saved)
    counts: dict[tuple[bool, str], int] = {}

    def policy(ctx, func, *args, **kwargs):
        if isinstance(func, torch._ops.OpOverload) and op_kind(func).random:
            return CheckpointPolicy.MUST_SAVE  # a replay would draw other numbers
        name = getattr(func, "overloadpacket", func).__name__
        key = (ctx.is_recompute, name)
        occurrence = counts.get(key, 0)
        counts[key] = occurrence + 1
        return CheckpointPolicy.MUST_SAVE if (name, occurrence) in wanted else CheckpointPolicy.MUST_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def compiled_context_fn(saved: tuple[tuple[str, int], ...]):
    """``context_fn`` for ``torch.utils.checkpoint`` under Dynamo."""
    return functools.partial(compiled_contexts, saved)
