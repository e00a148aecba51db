"""The step's memory on one rank of FSDP2 (``fully_shard``, PyTorch's ZeRO-3).

The trace records the unsharded step.  With ``world_size = w`` ranks, FSDP2
changes what one rank holds at each event:

* parameters and optimizer state live as local shards: ``1/w`` of them;
* the optimizer steps those shards, so its temporaries are ``1/w`` too;
* a unit's parameters are gathered whole -- a separate buffer beside the shard
  -- for its forward and again for its backward; in the backward the next unit
  to run is gathered ahead of time (FSDP2's prefetch; the root's backward
  prefetches the first unit);
* gathering copies a flat all-gather buffer out into the parameters: both are
  alive for a moment at the unit's first forward and first backward op;
* the root unit (parameters outside every unit: embeddings, final norm, head)
  stays gathered from the forward's start to the backward's end (FSDP2 does
  not reshard the root after its forward: the backward needs it at once);
* a unit's gradients are whole until its backward ends; then a reduce-scatter
  leaves each rank its ``1/w`` shard.  Its input, a flat copy of the whole
  gradients, stays alive until the next unit's reduce-scatter replaces it, and
  on a rank that runs ahead of the others (the collective still in flight)
  until the one after; the model counts the longer of the two.

Parameters gathered already cast (``stats.gathered_dtypes``, :mod:`autosac.zero3`)
are whole in their gathered dtype, and autocast's casts of them are no copies.

With FSDP2's mixed precision (``profile(param_dtype=...)``) the trace ran in
``param_dtype``: gathered parameters and whole gradients are in it, shards,
sharded gradients and the optimizer in the parameters' own dtype, and the
reduce-scatter's input in ``reduce_dtype``.

Units are the modules named by ``profile(shard_units=...)`` -- the modules
the user passes to ``fully_shard`` -- or, by default, the children of
``ModuleList``/``Sequential`` containers (the usual ``for block in
model.layers: fully_shard(block)``); and the root.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autosac.core.stats import ModelStats

CONTAINERS = ("ModuleList", "Sequential", "ModuleDict")
BOOKKEEPING_BYTES = 64


@dataclass
class Unit:
    fqn: str
    param_bytes: int  # gathered: in the dtype each parameter is gathered in
    grad_bytes: int
    forward: tuple[int, int]  # first and last forward event
    backward: tuple[int, int] | None  # first and last backward event


def fsdp_units(stats: ModelStats) -> list[Unit]:
    """The units (``stats.shard_units``, else one per block), in forward order
    (the root is not among them)."""
    if stats.shard_units:
        return sorted((_unit(stats, fqn) for fqn in stats.shard_units if stats.modules[fqn].fw_windows),
                      key=lambda u: u.forward[0])
    units = []
    for fqn in stats.subtree(stats.root):  # pre-order: outer units are found first
        m = stats.modules[fqn]
        parent = stats.modules.get(m.parent) if m.parent is not None else None
        if parent is None or parent.type not in CONTAINERS or any(fqn.startswith(u.fqn + ".") for u in units):
            continue
        if not m.fw_windows or m.param_bytes_total == 0:
            continue
        units.append(_unit(stats, fqn))
    return sorted(units, key=lambda u: u.forward[0])


def unit_holders(stats: ModelStats) -> set[str]:
    """The modules that hold an FSDP2 unit inside them (the root among them):
    never checkpoint regions of a sharded plan.  Re-running one in the
    backward would run its units' forward hooks again -- a parameter gather
    the sharded step does not make, on the ranks whose plan re-runs it only
    (a hang where the ranks' plans differ); the applier refuses such a
    replay, as its ops are not the forward's."""
    holders: set[str] = set()
    for unit in fsdp_units(stats):
        parent = stats.modules[unit.fqn].parent
        while parent is not None and parent not in holders:
            holders.add(parent)
            parent = stats.modules[parent].parent
    return holders


def _unit(stats: ModelStats, fqn: str) -> Unit:
    m = stats.modules[fqn]
    forward = (m.fw_windows[0][0], m.fw_windows[-1][1] - 1)
    backward = tuple(m.bw_window) if m.bw_window else None
    return Unit(fqn, gathered_bytes(stats, fqn), m.grad_bytes_total, forward, backward)


def gathered_bytes(stats: ModelStats, fqn: str | None = None) -> int:
    """Bytes of the parameters under module ``fqn`` (the whole model for None)
    as FSDP2 gathers them: in ``stats.gathered_dtypes`` where listed."""
    whole = stats.modules[fqn].param_bytes_total if fqn else stats.param_bytes
    prefix = f"{fqn}." if fqn else ""
    saved = 0.0
    for name, low in stats.gathered_dtypes.items():
        p = stats.params.get(name)
        if p is not None and name.startswith(prefix):
            saved += p.bytes * (1.0 - _ITEMSIZE[low] / _ITEMSIZE[p.dtype])
    return whole - int(saved)


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def describe_units(stats: ModelStats) -> str:
    """How the plan's FSDP2 units were chosen, for the plan's summary."""
    n = len(fsdp_units(stats))
    how = "as given (shard_units)" if stats.shard_units else "one per block"
    return f"{n} units {how}, and the root"


def sharded_live(stats: ModelStats, live: np.ndarray) -> np.ndarray:
    """``live`` (the unsharded step's bytes per event) as one rank of
    ``stats.world_size`` holds them under FSDP2 (see the module docstring)."""
    w = stats.world_size
    if w <= 1:
        return live
    tl = stats.timeline
    phases = tl.phases
    bw = [i for i, ph in enumerate(phases) if ph == "backward"]
    bw_end = bw[-1] if bw else len(live) - 1
    units = fsdp_units(stats)

    # with mixed precision the trace ran in param_dtype: shards (and the
    # optimizer's state and work) are in the parameters' own dtype, the
    # reduce-scatter in reduce_dtype
    master = stats.mixed_precision.get("master_ratio", 1.0)
    reduce = stats.mixed_precision.get("reduce_ratio", 1.0)
    shard = master / w  # a shard's bytes per traced byte
    out = live.astype(np.float64) - (1.0 - shard) * (stats.param_bytes + stats.optimizer_bytes)
    # gradients: whole until their unit's backward ends, then a shard
    unit_grads = sum(u.grad_bytes for u in units)
    root_grads = max(0, stats.grad_bytes - unit_grads)
    done = sorted((u for u in units if u.backward is not None), key=lambda u: u.backward[1])
    for i, u in enumerate(done):
        out[u.backward[1] + 1 :] -= (1.0 - shard) * u.grad_bytes
        # the reduce-scatter's flat input stays alive until the next unit's
        # reduce-scatter -- or, on a rank that runs ahead while the collective is
        # still in flight, until the one after that
        until = done[i + 2].backward[1] if i + 2 < len(done) else bw_end
        out[u.backward[1] : until + 1] += reduce * u.grad_bytes
    if bw:
        out[bw_end + 1 :] -= (1.0 - shard) * root_grads
    out += gathered_params(stats, units)
    # small host tensors FSDP2 keeps per unit (sizes, flags): at most 156 bytes
    # were seen with five units, allowed as 64 bytes per unit
    out += BOOKKEEPING_BYTES * (len(units) + 1)
    # the optimizer steps the local shards: its temporaries are a shard's too
    opt = [i for i, ph in enumerate(phases) if ph == "optimizer"]
    if opt:
        before = live[opt[0]] - (tl.made_bytes[opt[0]] if tl.made_bytes else 0)
        extra = np.clip(live[opt[0] : opt[-1] + 1] - before, 0, None)
        out[opt[0] : opt[-1] + 1] -= (1.0 - shard) * extra
    return out.astype(np.int64)

def gathered_params(stats: ModelStats, units: list[Unit] | None = None) -> np.ndarray:
    """Bytes of gathered (whole) parameters one rank holds at each event, beside
    its shards: each unit in its forward and backward, the next one ahead in
    the backward, the root throughout, and the all-gather buffers' copy-out."""
    units = fsdp_units(stats) if units is None else units
    phases = stats.timeline.phases
    n = len(phases)
    fw_end = next((i for i, ph in enumerate(phases) if ph != "forward"), n)
    bw = [i for i, ph in enumerate(phases) if ph == "backward"]
    bw_start, bw_end = (bw[0], bw[-1]) if bw else (n, n - 1)
    gathered = np.zeros(n)
    root = max(0, gathered_bytes(stats) - sum(u.param_bytes for u in units))
    gathered[: max(fw_end, bw_end + 1)] += root  # FSDP2 keeps the root gathered from forward to backward
    for u in units:
        gathered[u.forward[0] : u.forward[1] + 1] += u.param_bytes
    by_backward = sorted((u for u in units if u.backward is not None), key=lambda u: u.backward[0])
    if by_backward:  # the root's backward prefetches the first unit's parameters
        gathered[bw_start : by_backward[0].backward[0]] += by_backward[0].param_bytes
    for i, u in enumerate(by_backward):
        gathered[u.backward[0] : u.backward[1] + 1] += u.param_bytes
        if i + 1 < len(by_backward):
            gathered[u.backward[0] : u.backward[1] + 1] += by_backward[i + 1].param_bytes
    # gathering copies a flat all-gather buffer out into the unit's parameters:
    # for a moment both are alive, at the unit's first forward and backward op
    for u in units:
        gathered[u.forward[0]] += u.param_bytes
        if u.backward is not None:
            gathered[u.backward[0]] += u.param_bytes
    return gathered
