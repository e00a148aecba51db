"""What a checkpointed module's replay computes, read off the trace's op graph.

In the backward, a checkpoint re-runs its module's forward.  Kept op calls come
from the cache; every other call would run again -- but most of them only feed
kept calls, whose cached results ignore their inputs.  The applier skips those
(it hands back an empty tensor of the right shape instead), so the replay
computes only what the discarded activations need:

* the discarded op calls and their in-place writers;
* random ops and in-place ops that are not kept (always run: the RNG must
  advance as it did, and an in-place op must write its real input);
* transitively, the calls whose results those read, up to kept calls and the
  module's inputs.

Everything else in the window is *dead* in the replay.  Views always run (they
cost nothing and must alias their base).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from autosac.core.opkinds import SAC_IGNORED_NAMES
from autosac.core.stats import ModelStats, SavedOp


def saved_inside(savers: list[str], fqn: str) -> bool:
    """Whether an op inside module ``fqn`` saved the output (``savers`` as in SavedOp)."""
    return any(fqn == "" or s == fqn or s.startswith(fqn + ".") for s in savers)


@dataclass
class ModuleReplay:
    """The op graph of one module's forward window, ready for replay questions."""

    start: int
    end: int
    kept: frozenset[int]  # calls the checkpoint keeps unless it discards them
    forced: frozenset[int]  # random and in-place calls: run whenever they are not kept
    inputs: list[list[int]]
    ms: list[float]
    free: frozenset[int]  # views and parameter casts: no replay cost here
    saved_ops: list[SavedOp]

    @classmethod
    def of(cls, stats: ModelStats, fqn: str) -> ModuleReplay:
        start, end = stats.modules[fqn].fw_windows[0]
        tl = stats.timeline
        kept: set[int] = set()
        casts: set[int] = set()
        # saved ops are in event order: only the window's are read
        events = [op.event for op in stats.saved_ops]
        for op in stats.saved_ops[bisect.bisect_left(events, start) : bisect.bisect_left(events, end)]:
            chain = (op.event, *op.writer_events)
            if op.param_cast:
                casts.update(chain)
            elif saved_inside(op.savers, fqn):
                kept.update(e for e in chain if e < end)
        views = tl.views or [False] * len(tl)
        # random and in-place calls after the replay's early stop (ModuleStats.replay_stops) never re-run
        stop = stats.modules[fqn].replay_end()
        forced = {e for e in range(start, stop) if not views[e] and (tl.random[e] or tl.writes[e])}
        free = {e for e in range(start, end) if views[e]} | casts
        inputs = tl.inputs or [[] for _ in range(len(tl))]
        return cls(start, end, frozenset(kept), frozenset(forced), inputs, tl.ms, frozenset(free), stats.saved_ops)

    def signature(self, items: list[list[int]], first: list[int] | None) -> tuple:
        """Everything :func:`order_items` reads, relative to the window: equal
        for the identical layers of a model, whose orders are then computed once."""
        s = self.start

        def rel(events) -> tuple:
            return tuple(sorted(e - s for e in events))

        window = range(self.start, self.end)
        graph = tuple(tuple(p - s if self.start <= p < self.end else -1 for p in self.inputs[e]) for e in window)
        return (
            graph, tuple(self.ms[self.start : self.end]), rel(self.kept), rel(self.forced), rel(self.free),
            tuple((rel(self.events(it)), sum(self.saved_ops[i].bytes for i in it)) for it in items),
            rel(self.events(first or [])),
        )

    def events(self, op_ids) -> set[int]:
        """The window's events of saved ops ``op_ids``: each op and its in-place writers."""
        return {
            e for i in op_ids for e in (self.saved_ops[i].event, *self.saved_ops[i].writer_events) if e < self.end
        }

    def roots(self, discarded: set[int]) -> set[int]:
        return set(discarded) | {e for e in self.forced if e not in self.kept or e in discarded}

    def closure(self, roots: set[int], discarded: set[int], have: set[int] | None = None) -> set[int]:
        """Calls the replay must compute to make ``roots``: walk back through
        inputs, stopping at kept calls (not ``discarded``) and at ``have``."""
        have = have if have is not None else set()
        out: set[int] = set()
        todo = [e for e in roots if e not in have]
        while todo:
            e = todo.pop()
            if e in out or e in have:
                continue
            out.add(e)
            for p in self.inputs[e]:
                if self.start <= p < self.end and p not in out and p not in have and (
                    p not in self.kept or p in discarded
                ):
                    todo.append(p)
        return out

    def cost(self, events: set[int]) -> float:
        return sum(self.ms[e] for e in events if e not in self.free)

    def needed(self, discarded: set[int]) -> set[int]:
        """All calls the replay computes when ``discarded`` are recomputed."""
        return self.closure(self.roots(discarded), discarded)

    def dead(self, discarded: set[int], ops: list[str]) -> list[int]:
        """Calls the replay may skip: not kept, not needed, not a view, random or in-place."""
        needed = self.needed(discarded)
        return [
            e for e in range(self.start, self.end)
            if e not in needed and (e not in self.kept or e in discarded) and e not in self.forced
            and e not in self.free and ops[e] not in SAC_IGNORED_NAMES
        ]


def order_items(
    rp: ModuleReplay, items: list[list[int]], first: list[int] | None = None, cache: dict | None = None
) -> tuple[list[list[int]], list[float]]:
    """Order discard items so each prefix is a good choice, and give each
    prefix's exact replay ms.  ``first`` (saved ops every choice discards)
    joins the first item.

    Greedy by marginal replay ms per byte (an item shares the calls it needs
    with items already chosen), for modules with up to 200 items; larger ones
    are ordered once by each item's replay ms alone per byte.  With ``cache``,
    a module whose :meth:`ModuleReplay.signature` was seen reuses that order.
    """
    key = rp.signature(items, first) if cache is not None else None
    if key is not None and key in cache:
        order, costs = cache[key]
        return _merged([list(items[i]) for i in order], first), list(costs)
    out, costs, order = _order_items(rp, items, first)
    if key is not None:
        cache[key] = (order, costs)
    return out, costs


def _merged(out: list[list[int]], first: list[int] | None) -> list[list[int]]:
    if first:
        return [list(first) + (out[0] if out else [])] + out[1:]
    return out


def _order_items(rp: ModuleReplay, items: list[list[int]], first: list[int] | None):
    def bytes_of(item: list[int]) -> int:
        return sum(rp.saved_ops[i].bytes for i in item)

    events_of = rp.events
    discarded: set[int] = events_of(first or [])
    have = rp.needed(discarded)
    remaining = list(range(len(items)))
    order: list[int] = []

    def marginal(i: int) -> float:
        evs = events_of(items[i])
        d = discarded | evs
        return rp.cost(rp.closure(rp.roots(d) - have, d, have))

    if len(items) > 200:
        alone = {i: rp.cost(rp.needed(events_of(items[i]))) / max(1, bytes_of(items[i])) for i in remaining}
        order = sorted(remaining, key=lambda i: (alone[i], i))
    else:
        while remaining:
            best = min(remaining, key=lambda i: (marginal(i) / max(1, bytes_of(items[i])), items[i][0]))
            order.append(best)
            remaining.remove(best)
            discarded |= events_of(items[best])
            have |= rp.closure(rp.roots(discarded) - have, discarded, have)
    # each prefix's replay: what the one before needed, and what the new item
    # adds to it (the replay only grows as more is discarded)
    out, costs, discarded = _merged([list(items[i]) for i in order], first), [], set()
    have, ms = set(), 0.0
    for it in out:
        discarded |= events_of(it)
        new = rp.closure(rp.roots(discarded) - have, discarded, have)
        have |= new
        ms += rp.cost(new)
        costs.append(ms)
    return out, costs, order
