"""Downcast gathers for FSDP2 (ZeRO-3): gather float32 parameters already cast
to bfloat16 (or float16) where the step only ever uses them cast.

Training with float32 parameters under ``torch.autocast(dtype=torch.bfloat16)``
and ``fully_shard`` without a ``param_dtype``, every FSDP2 all-gather moves
float32 -- and autocast casts the gathered weights to bfloat16 right after.
For a parameter whose *every* use in the traced step is that cast, gathering
the local shard already cast moves half the bytes and gives the same bfloat16
values: the step is bitwise the autocast baseline.

:func:`install_downcast_gather` marks exactly those parameters (read from the
trace's per-parameter consuming dtypes) with FSDP2's own extension points,
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``: each rank casts its shard
in one pass (the native :func:`autosac.ops.pack_downcast`), FSDP2 gathers the
bfloat16 shards, and the gathered parameter keeps its float32 type outside --
so autograd, the reduce-scatter of its gradient and the optimizer run in
float32 exactly as before -- while holding only the bfloat16 data.  Autocast's
cast of it is that data itself: no copy is made, none is kept for the
backward (FSDP2 frees and re-gathers it), and the planner counts it that way
(:func:`with_downcast_gather`).

Every other parameter (norm weights autocast runs in float32, an embedding
table, anything used once without a cast) stays float32.  If a downcast
parameter is used in float32 after all -- a call the trace did not see -- the
op raises one clear error instead of computing with rounded values.

Example::

    >>> stats = autosac.profile(model, batch, world_size=8, autocast=torch.bfloat16)
    >>> stats = autosac.zero3.with_downcast_gather(stats)      # the planner counts bf16 gathers
    >>> plan = autosac.solve(stats, "60GiB")
    >>> autosac.apply(model, plan)
    >>> autosac.zero3.install_downcast_gather(model, plan)      # before fully_shard, or after it before the first step
    >>> for block in model.blocks: fully_shard(block)
    >>> fully_shard(model)

The code is in :mod:`autosac.zero3.gathers`; this package re-exports it."""

from autosac.zero3.gathers import (
    DowncastGathered,
    DowncastShard,
    downcast_params,
    install_downcast_gather,
    with_downcast_gather,
)

__all__ = ["downcast_params", "with_downcast_gather", "install_downcast_gather", "DowncastShard", "DowncastGathered"]
