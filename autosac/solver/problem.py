"""The checkpointing problem, read off a ModelStats: candidate modules, their
realizable discard choices, and the step's memory timeline as the plan sees it.

Memory model (bytes alive at each event of the step):

* the traced timeline, less parameter casts (``apply`` never saves them), as
  one rank of ``world_size`` holds it under FSDP2 (:mod:`autosac.solver.sharding`);
* checkpointing module ``i`` with discard choice ``k`` frees ``bytes[i][k]``
  from the end of its forward until its backward starts, when it recomputes
  them; while it recomputes, its forward's transient working memory is live.

A choice ``k`` discards the first ``k`` saved ops in an order that adds the
least replay time per byte at each step (:func:`autosac.solver.replay.order_items`),
so every choice is a real set of ops, priced by exactly what its replay computes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

import numpy as np

from autosac.core.host import gap_roots
from autosac.core.stats import ModelStats
from autosac.solver.candidates import Candidate, Reading, module_candidates
from autosac.solver.sharding import sharded_live, unit_holders

__all__ = ["Candidate", "Problem", "SharedHold", "bits", "build_problem"]


@dataclass
class SharedHold:
    """An input several candidates' checkpoints keep (a mask passed to every
    block): the unmodified step frees it at ``freed``; checkpointed, it lives on
    until the last backward among the chosen ``holders`` ends.  Its bytes are
    in no holder's ``hold``: the peak counts it once."""

    bytes: int
    freed: int
    holders: list[int]  # candidate indices
    to_replay: bool = False  # held up to the holder's replay (a cache's hold), not through its backward

    def release(self, c: Candidate) -> int:
        """The last event holder ``c`` holds it (its replay counts it in ``work``)."""
        return c.end - 1 if self.to_replay else c.bw_end

    def until(self, candidates: list[Candidate], chosen) -> int | None:
        """The last event it is held when the candidates in ``chosen`` are checkpointed."""
        ends = [self.release(candidates[i]) for i in self.holders if i in chosen]
        return max(ends) if ends else None


@dataclass
class Problem:
    live: np.ndarray  # bytes alive per event, as the plan sees them, before any checkpointing
    made: np.ndarray  # bytes each event allocates itself (``live - made``: just before it)
    candidates: list[Candidate]
    always_ms: float  # recompute every plan pays: parameter casts, the cast hook
    baseline_peak: int  # the unconstrained peak: sharded over world_size, parameter casts saved
    linked: list[list[int]] = field(default_factory=list)  # candidates (calls of one module) that choose alike
    shared: list[SharedHold] = field(default_factory=list)
    call_gap_ms: float = 0.0  # HostCosts.call_gap_us in ms where the plan's real gaps are priced (gap_ms), else 0
    events: int = 0  # the step's trace events: one cycle of the training loop

    def group_of(self, i: int) -> list[int]:
        """Candidate ``i`` and the other calls of its module."""
        return next((g for g in self.linked if i in g), [i])

    def evaluate(self, choice: dict[int, int]) -> int:
        """Peak bytes when candidate ``i`` takes choice ``k`` (1-based) for each item."""
        mem = self.live.astype(np.int64).copy()
        for i, k in choice.items():
            c = self.candidates[i]
            mem[c.start : c.end] -= c.bytes[k - 1]
            mem[c.end : c.bw_end + 1] += c.hold
        for s in self.shared:
            until = s.until(self.candidates, choice)
            if until is not None:
                mem[s.freed : until + 1] += s.bytes
        peak = int(mem.max()) if len(mem) else 0
        for i, k in choice.items():
            c = self.candidates[i]
            if c.end < len(mem):
                peak = max(peak, int(mem[c.end] - self.made[c.end]) + c.work[k - 1])
        return peak

    def with_shared_held_by_each(self) -> Problem:
        """This problem with every shared input counted in each holder's ``hold``:
        its peaks are never below this one's, so its plans fit here too."""
        cands = [replace(c, bytes=list(c.bytes), ancestors=list(c.ancestors)) for c in self.candidates]
        for s in self.shared:
            for i in s.holders:
                if not s.to_replay:  # a cache's hold ends with the replay: no more after it
                    cands[i].hold += s.bytes
                cands[i].bytes = [b - s.bytes for b in cands[i].bytes]
        return replace(self, candidates=cands, shared=[])

    def without_shared(self) -> Problem:
        """This problem with the shared inputs counted nowhere: its peaks are
        never above this one's, so its least recompute time is a lower bound here."""
        return replace(self, shared=[])

    def objective_ms(self, choice: dict[int, int]) -> float:
        """What the solvers minimize: :meth:`recompute_ms` with every call's
        machinery priced as if the calls next to it were checkpointed too (a
        sum over the candidates; :meth:`gap_ms` is the rest)."""
        return self.always_ms + sum(self.candidates[i].ms[k - 1] for i, k in choice.items())

    def recompute_ms(self, choice: dict[int, int]) -> float:
        """Time a plan adds to the step: recomputation and checkpointing machinery."""
        return self.objective_ms(choice) + self.gap_ms(choice)

    def mechanism_ms(self, choice: dict[int, int]) -> float:
        """The part of :meth:`recompute_ms` the checkpointing machinery costs."""
        return self.gap_ms(choice) + sum(self.candidates[i].mechanism[k - 1] for i, k in choice.items())

    def gap_ms(self, choice: dict[int, int]) -> float:
        """What the plan's checkpointed calls cost beyond their candidates'
        prices for the op calls the step runs between them: the machinery,
        run at each call's forward start and replay, is colder the more ran
        since it last ran (``HostCosts.call_gap_us``).  A call alone, or the
        step's first, costs more than one right after another; eager, a CPU
        target's (on a GPU that host work hides under the kernels)."""
        if not self.call_gap_ms or not choice:
            return 0.0
        cands = [self.candidates[i] for i in choice]
        points = [p for c in cands for p in (c.window[0], c.end)]
        priced = sum(c.gap_roots for c in cands)
        return self.call_gap_ms * (gap_roots(points, self.events) - priced)


def _adjusted_live(stats: ModelStats, drop_casts: bool = True) -> np.ndarray:
    tl = stats.timeline
    live = np.asarray(tl.live_bytes, dtype=np.int64).copy()
    n = len(live)
    # Parameter casts are re-made on use, never saved.  Autocast's weight cache
    # still holds them until its region exits, with the forward or (as
    # ``profile(autocast=)`` traces it, and as a training loop usually runs)
    # after the loss, which is often the step's peak: count them gone from the
    # backward's first event.
    forward_end = next((i for i, ph in enumerate(tl.phases) if ph not in ("forward", "loss")), n)
    # The backward that uses one makes it again (the cast hook's unpack) and
    # holds it until that backward step ends, where the unmodified step frees it.
    for op in stats.saved_ops:
        if op.param_cast and op.param in stats.gathered_dtypes:
            # gathered already cast (autosac.zero3): the cast is the gathered
            # parameter itself, which sharded_live counts
            live[op.event : op.freed_event] -= op.bytes
        elif op.param_cast and drop_casts:
            until = op.freed_event if op.remade_at < 0 else min(op.freed_event, op.remade_at)
            live[max(forward_end, op.event + 1) : until] -= op.bytes
    return sharded_live(stats, live)


def bits(mask: int):
    """Indices of the set bits of ``mask``, lowest first."""
    i = 0
    while mask:
        if mask & 1:
            yield i
        mask >>= 1
        i += 1


def _set_ancestors(stats: ModelStats, candidates: list[Candidate]) -> None:
    """A candidate's ancestors are the candidates whose call contains its call
    (checkpoints never nest).  This is the module tree for modules called once;
    a shared module called from inside another module's call (``a(b(a(x)))``
    with ``a.inner`` shared by ``b``) gets the module whose call it runs in."""
    by_start = sorted(range(len(candidates)), key=lambda i: candidates[i].window[0])
    starts = [candidates[i].window[0] for i in by_start]
    for c in candidates:
        lo, hi = c.window
        for i in by_start[: bisect.bisect_right(starts, lo)]:
            a = candidates[i]
            if a is c or a.window[1] < hi:
                continue
            if a.window == c.window and not _is_fqn_ancestor(a.fqn, c.fqn):
                continue  # the same span: only the outer module of the two contains the other
            c.ancestors.append(i)


def _is_fqn_ancestor(a: str, c: str) -> bool:
    return a == "" and c != "" or c.startswith(a + ".")


def _share_retained(candidates: list[Candidate]) -> list[SharedHold]:
    """Take the inputs that several candidates keep out of their ``hold`` into
    shared holds, counted once.  Only inputs the unmodified step frees after
    every holder's forward ends: then, whichever holders are chosen, the input
    lives from its free to the last of their backwards."""
    holders: dict[int, list[int]] = {}
    size: dict[int, tuple[int, int]] = {}
    for i, c in enumerate(candidates):
        for sid, nbytes, freed in c.retained:
            holders.setdefault(sid, []).append(i)
            size[sid] = (nbytes, freed)
    shared = []
    for sid, idx in holders.items():
        nbytes, freed = size[sid]
        if len(idx) < 2 or any(candidates[i].start > freed for i in idx):
            continue
        if all(a in candidates[b].ancestors or b in candidates[a].ancestors for a in idx for b in idx if a < b):
            continue  # a module and the modules inside it: at most one is checkpointed, its hold counts it
        for i in idx:
            c = candidates[i]
            c.hold -= nbytes
            c.bytes = [b + nbytes for b in c.bytes]
        shared.append(SharedHold(bytes=nbytes, freed=freed, holders=idx))
    return shared


def build_problem(stats: ModelStats, max_choices: int = 16, keep_random: bool = False) -> Problem:
    """Read the checkpointing problem off ``stats``.

    ``keep_random``: never discard the outputs of ops that draw random numbers,
    as a plan under ``torch.compile`` keeps them (:mod:`autosac.applier.compiled`).

    Candidates are modules whose subtree saves discardable activations; each
    offers at most ``max_choices`` discard choices.  Sharded over FSDP2
    (``world_size > 1``), no module that holds a shard unit inside it is one
    (:func:`autosac.solver.sharding.unit_holders`), nor is a module whose input
    the step writes in place after the call (``ModuleStats.inputs_written_later``).
    A module called several
    times per step (a shared block) gives one candidate per call, linked to
    take the same choice: every call is a checkpoint region with the same policy.
    """
    live = _adjusted_live(stats)
    reading = Reading.of(stats, max_choices, keep_random)
    candidates: list[Candidate] = []
    linked: list[list[Candidate]] = []
    holders = unit_holders(stats) if stats.world_size > 1 else set()  # sharded: no region holds a unit
    for fqn in stats.subtree(stats.root):
        skip = fqn in holders or stats.modules[fqn].inputs_written_later
        group = [] if skip else module_candidates(reading, fqn)
        candidates += group
        if len(group) > 1:
            linked.append(group)
    # order by forward end (children before parents); in sequential models this
    # makes the intervals nest, which the chain solver exploits
    candidates.sort(key=lambda c: (c.start, -c.end, -stats.modules[c.fqn].depth))
    _set_ancestors(stats, candidates)
    shared = _share_retained(candidates)
    # what the cache holds past its free in the unmodified step: from that free on, once
    shared += [SharedHold(bytes=b, freed=f, holders=[i], to_replay=True)
               for i, c in enumerate(candidates) for b, f in c.late_holds]
    # every plan re-makes the parameter casts, and packs what the forward saves through the cast hook
    always = sum(op.ms for op in stats.saved_ops if op.param_cast)
    casts = sum(len(op.savers) or 1 for op in stats.saved_ops if op.param_cast)
    always += reading.cast_hook_ms((stats.modules[stats.root].saved_tensors or [0])[0], casts)
    baseline = int(_adjusted_live(stats, drop_casts=False).max(initial=0)) if stats.world_size > 1 else stats.peak_bytes
    made = np.asarray(stats.timeline.made_bytes or np.zeros(len(live)), dtype=np.int64)
    position = {id(c): i for i, c in enumerate(candidates)}
    groups = [sorted(position[id(c)] for c in g) for g in linked]
    return Problem(live=live, made=made, candidates=candidates, always_ms=always, baseline_peak=baseline, linked=groups,
                   shared=shared, call_gap_ms=reading.call_gap_ms(), events=len(stats.timeline.ops))
