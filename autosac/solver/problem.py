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

from autosac.core.host import HostCosts
from autosac.core.stats import ModelStats
from autosac.solver.replay import ModuleReplay, order_items, saved_inside
from autosac.solver.sharding import sharded_live


@dataclass
class Candidate:
    """A module the plan may checkpoint.  Choosing it with choice ``k``:

    * from ``start`` (its forward's end) to ``end`` (its backward's start) the
      step holds ``bytes[k]`` less: the discarded activations, less the
      ``hold`` bytes the checkpoint keeps (inputs that would have died, RNG state);
    * from ``end`` to ``bw_end`` (its backward) it holds ``hold`` more (with
      the parameter casts its replay makes again);
    * at ``end``, while it recomputes -- before the first backward op there
      allocates anything -- ``work[k]`` more on top of that.
    """

    fqn: str
    start: int
    end: int
    bw_end: int
    bytes: list[int]  # per choice k (k = 1..K): net bytes saved, > 0
    discarded: list[int]  # per choice: activation bytes discarded
    ms: list[float]  # per choice: recompute ms, fixed part included, the mechanism's too
    mechanism: list[float]  # per choice: what the checkpointing machinery adds (in ``ms``)
    n_items: list[int]  # per choice: how many of ``items`` are discarded
    items: list[list[int]]  # groups of saved op ids discarded together, cheapest ms/byte first
    discardable_bytes: int
    hold: int
    work: list[int]  # per choice: transient bytes of the recompute
    ancestors: list[int] = field(default_factory=list)  # candidate indices above it
    call: int = 0  # which forward call of the module (a module called n times has n candidates)
    window: tuple[int, int] = (0, 0)  # that call's forward events
    retained: list[tuple[int, int, int]] = field(default_factory=list)  # (storage, bytes, freed) in ``hold``


@dataclass
class SharedHold:
    """An input several candidates' checkpoints keep (a mask passed to every
    block): the unmodified step frees it at ``freed``; checkpointed, it lives on
    until the last backward among the chosen ``holders`` ends.  Its bytes are
    in no holder's ``hold``: the peak counts it once."""

    bytes: int
    freed: int
    holders: list[int]  # candidate indices

    def until(self, candidates: list[Candidate], chosen) -> int | None:
        """The last event it is held when the candidates in ``chosen`` are checkpointed."""
        ends = [candidates[i].bw_end for i in self.holders if i in chosen]
        return max(ends) if ends else None


@dataclass
class Problem:
    live: np.ndarray  # bytes alive per event, as the plan sees them, before any checkpointing
    made: np.ndarray  # bytes each event allocates itself (``live - made``: just before it)
    candidates: list[Candidate]
    always_ms: float  # recompute every plan pays: parameter casts
    baseline_peak: int  # the unconstrained peak: sharded over world_size, parameter casts saved
    linked: list[list[int]] = field(default_factory=list)  # candidates (calls of one module) that choose alike
    shared: list[SharedHold] = field(default_factory=list)

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
                cands[i].hold += s.bytes
                cands[i].bytes = [b - s.bytes for b in cands[i].bytes]
        return replace(self, candidates=cands, shared=[])

    def without_shared(self) -> Problem:
        """This problem with the shared inputs counted nowhere: its peaks are
        never above this one's, so its least recompute time is a lower bound here."""
        return replace(self, shared=[])

    def recompute_ms(self, choice: dict[int, int]) -> float:
        """Time a plan adds to the step: recomputation and checkpointing machinery."""
        return self.always_ms + sum(self.candidates[i].ms[k - 1] for i, k in choice.items())

    def mechanism_ms(self, choice: dict[int, int]) -> float:
        """The part of :meth:`recompute_ms` the checkpointing machinery costs."""
        return sum(self.candidates[i].mechanism[k - 1] for i, k in choice.items())


def _choice_indices(cum_bytes: np.ndarray, cum_ms: np.ndarray, max_choices: int) -> list[int]:
    """Prefix lengths worth offering: where the curve's slope changes (plus the
    end), thinned to ``max_choices`` by keeping the breakpoints farthest above
    the chords -- chords of a convex curve over-estimate, never under-estimate."""
    n = len(cum_bytes)
    xs = np.concatenate(([0], cum_bytes))
    ys = np.concatenate(([0.0], cum_ms))
    keep = [0]
    for j in range(1, n):
        (x0, y0), (x1, y1), (x2, y2) = (xs[keep[-1]], ys[keep[-1]]), (xs[j], ys[j]), (xs[j + 1], ys[j + 1])
        if abs((y1 - y0) * (x2 - x1) - (y2 - y1) * (x1 - x0)) > 1e-12 * max(1.0, y2) * max(1, x2):
            keep.append(j)
    keep.append(n)
    if len(keep) - 1 > max_choices:
        from autosac.core.curves import compress_curve

        pts = [[float(xs[j]), float(ys[j])] for j in keep]
        kept = {tuple(p) for p in compress_curve(pts, max_choices + 1)}
        keep = [j for j in keep if (float(xs[j]), float(ys[j])) in kept]
    return keep[1:]


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


class _ReplayCasts:
    """Bytes of the parameter casts (autocast's weight copies) a module's
    forward call makes, per window of events.  Its replay in the backward
    makes them again, and the re-run ops that save them keep them until their
    own backward -- unlike the unmodified step, whose saved casts are re-made
    only at their use -- so a checkpointed module holds them from its replay
    to its backward's end."""

    def __init__(self, stats: ModelStats):
        # saved ops are in event order; a cast gathered as such is no copy (autosac.zero3)
        casts = [op for op in stats.saved_ops if op.param_cast and op.param not in stats.gathered_dtypes]
        self.events = [op.event for op in casts]
        self.cum = np.concatenate([[0], np.cumsum([op.bytes for op in casts], dtype=np.int64)])

    def __call__(self, window: tuple[int, int]) -> int:
        lo, hi = bisect.bisect_left(self.events, window[0]), bisect.bisect_left(self.events, window[1])
        return int(self.cum[hi] - self.cum[lo])


def bits(mask: int):
    """Indices of the set bits of ``mask``, lowest first."""
    i = 0
    while mask:
        if mask & 1:
            yield i
        mask >>= 1
        i += 1


def _discard_items(stats: ModelStats, op_ids: list[int], window,
                   keep_random: bool = False) -> tuple[list[list[int]], list[int]]:
    """A module's saved ops as discard items, cheapest ms per byte first (the
    starting order; :func:`order_items` settles the final one), and the saved
    ops every choice must discard.

    Random ops form one item: a recompute replays the RNG from the start of the
    module, so it can only reproduce a random op if every random op before it is
    re-run too -- a module recomputes all its random ops or none.  With
    ``keep_random`` (plans for ``torch.compile``, whose regions always save
    random ops' outputs) that item is never offered.

    A kept output that the forward later writes in place is cached as the
    written tensor, so a call the replay re-runs that read it *before* the write
    would read the wrong value (an in-place SiLU and autograd's copy of its
    input).  Such a reader, if it is itself a saved op, is discarded together
    with the written output; any other reader (re-run whenever the module is)
    makes the written output one that every choice discards.
    """
    by_event = {stats.saved_ops[i].event: i for i in op_ids}
    group = {i: i for i in op_ids}

    def root(i):
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    tl = stats.timeline
    mandatory: set[int] = set()
    for i in op_ids:
        op = stats.saved_ops[i]
        writes = [w for w in op.writer_events if w < window[1]]
        if not writes:
            continue
        chain = {op.event, *writes}
        for r in range(op.event + 1, max(writes)):
            if r in chain or tl.views[r] or op.event not in tl.inputs[r]:
                continue
            if r in by_event:
                group[root(by_event[r])] = root(i)
            else:
                mandatory.add(i)
    rnd = [i for i in op_ids if stats.saved_ops[i].random]
    for i in rnd[1:]:
        group[root(i)] = root(rnd[0])
    members: dict[int, list[int]] = {}
    for i in op_ids:
        members.setdefault(root(i), []).append(i)
    items = list(members.values())
    forced = sorted({j for it in items if any(root(i) == root(m) for i in it for m in mandatory) for j in it})
    items = [it for it in items if not set(it) & set(forced)]
    if keep_random:
        items = [it for it in items if not any(stats.saved_ops[i].random for i in it)]

    def key(it):
        return (sum(stats.saved_ops[i].ms for i in it) / sum(stats.saved_ops[i].bytes for i in it), it[0])

    return sorted(items, key=key), forced


def _cache_held(m, stats: ModelStats, items: list[list[int]], n: int, window) -> tuple[int, list[tuple[int, int]]]:
    """For the choice discarding ``items[:n]`` in the call ``window``: bytes the
    checkpoint's cache holds for the kept op calls, and ``(event, bytes)`` of
    those outputs that the discarded calls make again instead."""
    discarded = {stats.saved_ops[i].event for it in items[:n] for i in it}
    holds = [(e, b) for e, b in m.cache_holds if window[0] <= e < window[1]]
    held = sum(b for e, b in holds if e not in discarded)
    return held, [(e, b) for e, b in holds if e in discarded]


def _recompute_extra(stats: ModelStats, m, items: list[list[int]], picks: list[int], window) -> list[int]:
    """Per choice, how far above ``live - discarded`` memory rises while the module
    recomputes: the forward is replayed in order, so at each replayed event the
    discarded activations re-made so far (with their ops' other outputs) plus
    the short-lived tensors alive then, while the cache still holds what it keeps.
    The result is at least 0 and at most the discarded bytes plus the work peak."""
    profile = [p for p in m.recompute_profile if window[0] <= p[0] < window[1]]
    out = []
    for n in picks:
        held, remade = _cache_held(m, stats, items, n, window)
        discarded = [(stats.saved_ops[i].event, stats.saved_ops[i].bytes) for it in items[:n] for i in it]
        made = sorted(discarded + remade)
        total = sum(b for _, b in discarded)
        events = sorted({e for e, _ in made} | {e for e, _ in profile})
        best, j, k, remade, short = 0, 0, 0, 0, 0
        for e in events:
            while j < len(made) and made[j][0] <= e:
                remade += made[j][1]
                j += 1
            while k < len(profile) and profile[k][0] <= e:
                short = profile[k][1]
                k += 1
            best = max(best, remade + short)
        # the recompute also stashes the current RNG state while it replays the forward's
        out.append(max(0, best - total) + held + stats.checkpoint_state_bytes)
    return out


def _mechanism(stats: ModelStats, m, window, n_items: int, picks: list[int], host: HostCosts,
               kept_anyway: bool) -> tuple[list[float], float | None]:
    """Per choice, what checkpointing one call of ``fqn`` costs the host
    (:mod:`autosac.tools.calibrate`), and the recompute time of the choice that discards
    everything when it runs plainly (None when it cannot).

    A choice that discards every saved op of the module, in a module that
    writes nothing made outside it, is checkpointed plainly (the applier's
    plain path): the call's mechanism (per call and per tensor it saves) and
    its whole forward re-run.  Any other choice is selective: the same, plus
    the dispatch modes' cost on every op call of the forward, there and again
    in the replay.  ``kept_anyway``: the module has saved ops no choice
    discards (:func:`_kept_anyway`), so no choice runs plainly."""
    can_be_plain = not m.writes_outside and not kept_anyway
    ops = window[1] - window[0]
    saved = m.saved_tensors[0] if m.saved_tensors else 0  # the first call's; the calls run alike
    # where the kernels run on this CPU, large ops cost a selective call's per-op work more (autosac.core.hostsize)
    made = stats.timeline.made_bytes[window[0] : window[1]] if stats.target.get("device_type") == "cpu" else ()
    warm = _warm_ms(stats, window, host) if can_be_plain else 0.0
    mechanism = [host.checkpoint_ms(saved, ops, selective=not (can_be_plain and k == n_items), op_bytes=made)
                 for k in picks]
    mechanism = [max(0.0, mech - warm) if can_be_plain and k == n_items else mech for mech, k in zip(mechanism, picks)]
    whole_ms = max(0.0, float(sum(stats.timeline.ms[window[0] : window[1]])) - warm) if can_be_plain else None
    return mechanism, whole_ms


def _warm_ms(stats: ModelStats, window, host: HostCosts) -> float:
    """What a plainly checkpointed call saves, in each of its two forwards, of
    the host's per-MiB extra its ops were priced with (:mod:`autosac.core.hostsize`;
    a CPU target's): the outputs the unmodified forward saves for the backward
    fill fresh, cold memory; the checkpointed forward keeps none of them and the
    re-run's are freed by the backward right after, so they land in memory just
    freed, still in the caches.  Only the saved ops' extra: a temporary lands in
    freed memory either way.  Measured on zoo-gemma2 (width 64), four layers
    checkpointed: machinery 4.68 ms priced at full extras, 1.05 measured."""
    if stats.target.get("device_type") != "cpu" or not stats.target.get("measured") or not host.untimed_us_per_mib:
        return 0.0
    made = stats.timeline.made_bytes
    saved = {op.event for op in stats.saved_ops if window[0] <= op.event < window[1]}
    return sum(host.size_us(made[e], host.untimed_us_per_mib) for e in saved) / 1e3


def _written_after_read(stats: ModelStats, window) -> set[int]:
    """Events inside the forward ``window`` whose result a later call of it
    writes in place after another call read it (a router's ``w /= w.sum()``
    on its top-k weights).  A replay that cached such a result but re-ran
    the reader would hand the reader the written value (the applier refuses
    that call at run time): a plan either re-runs the maker with its writers,
    or checkpoints the module plainly."""
    tl = stats.timeline
    read: set[int] = set()  # events made inside whose result a call has read so far
    found: set[int] = set()
    for e in range(window[0], window[1]):
        made_inside = [p for p in tl.inputs[e] if window[0] <= p < e]
        if tl.writes[e]:  # a writer's own read of what it writes is part of the write
            found.update(p for p in made_inside if p in read)
        else:
            read.update(made_inside)
    return found


def _kept_anyway(stats: ModelStats, fqn: str, window, op_ids: list[int], events: list[int]) -> list[int]:
    """Saved ops of ``fqn``'s forward that no choice discards (their output is
    also the module's): every checkpoint of it keeps them."""
    ids = set(op_ids)
    inside = stats.saved_ops[bisect.bisect_left(events, window[0]) : bisect.bisect_left(events, window[1])]
    return [op.id for op in inside if not op.param_cast and op.id not in ids and saved_inside(op.savers, fqn)]


def _calls(stats: ModelStats, m) -> list[tuple[list[int], list[int]]] | None:
    """``(forward window, backward span)`` of each call of module ``m``, or None
    when it cannot be a checkpoint region: a call without a backward, a backward
    that starts before its forward ends, or calls whose op sequences differ."""
    if len(m.bw_windows) != len(m.fw_windows) or any(span is None for span in m.bw_windows):
        return None
    ops = stats.timeline.ops
    first = m.fw_windows[0]
    calls = []
    for window, span in zip(m.fw_windows, m.bw_windows):
        if window[1] > span[0] or ops[window[0] : window[1]] != ops[first[0] : first[1]]:
            return None
        calls.append((window, span))
    return calls


def _mapped_items(stats: ModelStats, items: list[list[int]], first, window) -> list[list[int]] | None:
    """``items`` (saved op ids of the first call) as the same ops of another call."""
    by_event = {op.event: op.id for op in stats.saved_ops}
    out = []
    for item in items:
        mapped = []
        for i in item:
            j = by_event.get(stats.saved_ops[i].event - first[0] + window[0])
            if j is None or stats.saved_ops[j].op != stats.saved_ops[i].op:
                return None
            mapped.append(j)
        out.append(mapped)
    return out


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
    offers at most ``max_choices`` discard choices.  A module called several
    times per step (a shared block) gives one candidate per call, linked to
    take the same choice: every call is a checkpoint region with the same policy.
    """
    live = _adjusted_live(stats)
    # what checkpointing costs the host; under torch.compile (keep_random) the machinery is compiled away
    host = HostCosts(**stats.target["host"]) if stats.target.get("host") and not keep_random else HostCosts()
    # On a GPU the host queues kernels ahead: a region's machinery (Python work per call, per saved tensor,
    # per op under a policy) overlaps its re-run's kernels, so a choice costs max(re-run, machinery).
    # On an H100 the re-run alone matched the measured overheads (benchmarks/check_gpu_time_model.py).
    overlap = stats.target.get("device_type") == "cuda"
    events = [op.event for op in stats.saved_ops]
    orders: dict = {}  # identical layers share their discard order
    replay_casts = _ReplayCasts(stats)
    candidates: list[Candidate] = []
    linked: list[list[Candidate]] = []
    for fqn in stats.subtree(stats.root):
        m = stats.modules[fqn]
        if not m.saved_op_ids or m.bw_window is None or m.discardable_bytes <= 0:
            continue
        calls = _calls(stats, m)
        if calls is None:
            continue
        first = calls[0][0]
        op_ids = [i for i in m.saved_op_ids if first[0] <= stats.saved_ops[i].event < first[1]]
        items, forced = _discard_items(stats, op_ids, first, keep_random)
        if not items:  # its only discards were random ops, kept
            continue
        items, costs = order_items(ModuleReplay.of(stats, fqn), items, first=forced, cache=orders)
        cum_t = np.asarray(costs)
        cum_first = np.cumsum([sum(stats.saved_ops[i].bytes for i in it) for it in items])
        picks = _choice_indices(cum_first, cum_t, max_choices)
        written = _written_after_read(stats, first)
        kept = _kept_anyway(stats, fqn, first, op_ids, events)
        if any(stats.saved_ops[i].event in written for i in kept):
            continue  # any checkpoint of it would cache a result it writes after re-run calls read it
        whole_only = m.routed
        if whole_only:  # its op calls follow the data's routing: only whole, plain checkpointing matches none
            picks = [len(items)]
        if written:  # choices that keep such a result (cache it) while re-running its reader are not offered
            risky = {i for i in op_ids if stats.saved_ops[i].event in written}
            picks = [k for k in picks if risky <= {i for it in items[:k] for i in it}] or [len(items)]
        mechanism, whole_ms = _mechanism(stats, m, first, len(items), picks, host, bool(kept))
        if keep_random:  # compiled regions recompute what their graph needs: no plain path
            whole_ms = None
        rerun = [whole_ms if whole_ms is not None and k == len(items) else float(cum_t[k - 1]) for k in picks]
        if overlap:  # the host's checkpointing work hides under the kernels it queues: only its excess shows
            mechanism = [max(0.0, mech - r) for mech, r in zip(mechanism, rerun)]
        if whole_only and whole_ms is None:
            continue
        group = []
        for j, (window, span) in enumerate(calls):
            mine = items if j == 0 else _mapped_items(stats, items, first, window)
            if mine is None:
                group = []
                break
            cum_b = np.cumsum([sum(stats.saved_ops[i].bytes for i in it) for it in mine])
            retained = m.retained_input_calls[j] if j < len(m.retained_input_calls) else m.retained_input_bytes
            parts = [tuple(r) for r in m.retained_inputs[j]] if j < len(m.retained_inputs) else []
            outside = m.outside_write_calls[j] if j < len(m.outside_write_calls) else m.outside_write_bytes
            hold = retained + stats.checkpoint_state_bytes + outside
            # what the cache holds for kept ops is not saved either (conservatively
            # over the whole interval: it is held from its consumers' backward on)
            net = [int(cum_b[k - 1]) - hold - _cache_held(m, stats, mine, k, window)[0] for k in picks]
            casts = replay_casts(window)
            group.append(Candidate(
                fqn=fqn, start=window[1], end=span[0], bw_end=span[1], bytes=net,
                discarded=[int(cum_b[k - 1]) for k in picks],
                ms=[r + mech for r, mech in zip(rerun, mechanism)], mechanism=list(mechanism),
                n_items=list(picks), items=mine, discardable_bytes=int(cum_b[-1]), hold=hold + casts,
                # the replay also works on its own copy of what the call writes outside itself;
                # its parameter casts are in ``hold`` from the replay on
                work=[max(0, w + outside - casts) for w in _recompute_extra(stats, m, mine, picks, window)], call=j,
                window=tuple(window), retained=parts,
            ))
        if not group:
            continue
        # a choice that saves no more than the checkpoint holds, in every call, is never worth taking
        useful = [k for k in range(len(picks)) if sum(c.bytes[k] for c in group) > 0]
        if not useful:
            continue
        for c in group:
            c.bytes, c.discarded, c.ms, c.mechanism, c.n_items, c.work = (
                [getattr(c, f)[k] for k in useful] for f in ("bytes", "discarded", "ms", "mechanism", "n_items", "work")
            )
        candidates += group
        if len(group) > 1:
            linked.append(group)
    # order by forward end (children before parents); in sequential models this
    # makes the intervals nest, which the chain solver exploits
    candidates.sort(key=lambda c: (c.start, -c.end, -stats.modules[c.fqn].depth))
    _set_ancestors(stats, candidates)
    shared = _share_retained(candidates)
    always = sum(op.ms for op in stats.saved_ops if op.param_cast)
    baseline = int(_adjusted_live(stats, drop_casts=False).max(initial=0)) if stats.world_size > 1 else stats.peak_bytes
    made = np.asarray(stats.timeline.made_bytes or np.zeros(len(live)), dtype=np.int64)
    position = {id(c): i for i, c in enumerate(candidates)}
    groups = [sorted(position[id(c)] for c in g) for g in linked]
    return Problem(live=live, made=made, candidates=candidates, always_ms=always, baseline_peak=baseline, linked=groups,
                   shared=shared)
