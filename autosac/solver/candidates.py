"""The candidates of the checkpointing problem (:mod:`autosac.solver.problem`):
for each module whose subtree saves discardable activations, one
:class:`Candidate` per forward call, with its realizable discard choices --
the first ``k`` saved ops in the order :func:`autosac.solver.replay.order_items`
gives, each priced by what its replay computes and what the checkpointing
machinery costs -- and what the checkpoint holds and works in while it replays.

:func:`module_candidates` reads one module's; :class:`Reading` is what every
module's reading shares (the stats, the host's costs, caches).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

from autosac.core.host import HostCosts
from autosac.core.stats import ModelStats
from autosac.solver.replay import ModuleReplay, order_items, saved_inside


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
    late_holds: list[tuple[int, int]] = field(default_factory=list)  # (bytes, freed): held from freed, any choice
    gap_roots: float = 0.0  # the gaps its mechanism is priced with before the plan is known (own_gap_roots)


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


class _ReplayCasts:
    """Bytes of the parameter casts (autocast's weight copies) a module's
    forward call makes, per window of events.  Its replay in the backward
    makes them again, and the re-run ops that save them keep them until their
    own backward -- unlike the unmodified step, whose saved casts are re-made
    only at their use -- so a checkpointed module holds them from its replay
    to its backward's end."""

    def __init__(self, stats: ModelStats):
        # saved ops are in event order; a cast gathered as such is no copy (autosac.zero3)
        self.casts = [op for op in stats.saved_ops if op.param_cast and op.param not in stats.gathered_dtypes]
        self.events = [op.event for op in self.casts]
        self.cum = np.concatenate([[0], np.cumsum([op.bytes for op in self.casts], dtype=np.int64)])

    def __call__(self, window: tuple[int, int], remade_after: int | None = None) -> int:
        """Bytes of the casts made in ``window``; with ``remade_after``, only
        those the unmodified step has not re-made for their use by that event
        (the others are in its live bytes there already)."""
        lo, hi = bisect.bisect_left(self.events, window[0]), bisect.bisect_left(self.events, window[1])
        if remade_after is None:
            return int(self.cum[hi] - self.cum[lo])
        return sum(op.bytes for op in self.casts[lo:hi] if not 0 <= op.remade_at <= remade_after)


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


def _cache_held(m, stats: ModelStats, items: list[list[int]], n: int, window,
                late: frozenset = frozenset()) -> tuple[int, list[tuple[int, int]]]:
    """For the choice discarding ``items[:n]`` in the call ``window``: bytes the
    checkpoint's cache holds for the kept op calls (but the ``late`` ones:
    ``(event, freed)`` pairs counted from their free, see :func:`_late_holds`),
    and ``(event, bytes)`` of those outputs that the discarded calls make again
    instead."""
    discarded = {stats.saved_ops[i].event for it in items[:n] for i in it}
    holds = [(e, b, f) for e, b, f in m.cache_holds if window[0] <= e < window[1]]
    held = sum(b for e, b, f in holds if e not in discarded and (e, f) not in late)
    return held, [(e, b) for e, b, _ in holds if e in discarded]


def _late_holds(m, stats: ModelStats, items: list[list[int]], window) -> list[tuple[int, int, int]]:
    """``(event, bytes, freed)`` of the cache's holds that every choice keeps
    (an op no item discards: a post-norm block's last layer norm, whose mean
    and inverse std are saved inside and whose output the next block saves)
    and that the unmodified step frees after the call's forward ends: alive
    there anyway until ``freed``, the cache adds them only from then to the
    replay (counted over the whole interval, each post-norm layer of a
    checkpointed BERT was over-predicted by one hidden state)."""
    in_items = {stats.saved_ops[i].event for it in items for i in it}
    return [(e, b, f) for e, b, f in m.cache_holds
            if window[0] <= e < window[1] and e not in in_items and f > window[1]]


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
               kept_anyway: bool, roots: float) -> tuple[list[float], float | None]:
    """Per choice, what checkpointing one call of ``fqn`` costs the host
    (:mod:`autosac.tools.calibrate`), and the recompute time of the choice that discards
    everything when it runs plainly (None when it cannot).

    A choice that discards every saved op of the module, in a module that
    writes nothing made outside it, is checkpointed plainly (the applier's
    plain path): the call's mechanism (per call and per tensor it saves) and
    its whole forward re-run.  Any other choice is selective: the same, plus
    the dispatch modes' cost on every op call of the forward, there and again
    in the replay.  ``kept_anyway``: the module has saved ops no choice
    discards (:func:`_kept_anyway`), so no choice runs plainly.  ``roots``:
    the gaps its machinery is priced with (:func:`own_gap_roots`)."""
    can_be_plain = not m.writes_outside and not kept_anyway
    ops = window[1] - window[0]
    saved = m.saved_tensors[0] if m.saved_tensors else 0  # the first call's; the calls run alike
    # where the kernels run on this CPU, large ops cost a selective call's per-op work more (autosac.core.hostsize)
    made = stats.timeline.made_bytes[window[0] : window[1]] if stats.target.get("device_type") == "cpu" else ()
    mechanism = [host.checkpoint_ms(saved, ops, selective=not (can_be_plain and k == n_items), op_bytes=made,
                                    roots=roots, state_items=m.state_items, host_rng=bool(m.host_rng)) for k in picks]
    # the re-run is priced as the unmodified forward was, its per-MiB extras included (autosac.core.hostsize):
    # crediting a plain call's saved outputs with memory just freed (until session 13) put 6 of 10 models'
    # overheads further from measured, 10 of 20 rows within target against 16 without (docs/step-time-history.md);
    # up to where PyTorch's checkpoint stops re-running it (ModuleStats.replay_stops): priced to the call's
    # end, a plain MLP block's re-run was over-predicted by its last matmul (7.2 against 4.6 ms measured)
    whole_ms = float(sum(stats.timeline.ms[window[0] : m.replay_end()])) if can_be_plain else None
    return mechanism, whole_ms


def own_gap_roots(m, window) -> float:
    """The gaps a call's machinery is priced with before the plan is known
    (:func:`autosac.core.host.gap_roots`): as if the calls next to it were
    checkpointed too, right beside it -- in the forward, the op calls since
    the machinery last ran are the call's own forward; in the backward, the
    neighbour's backward, as long as its own (:meth:`Problem.gap_ms` prices
    the plan's real gaps)."""
    span = m.bw_windows[0] if m.bw_windows else None
    backward = 0 if span is None else max(0, span[1] - _recompute_start(m, 0, span))
    return math.sqrt(window[1] - window[0]) + math.sqrt(backward)


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


@dataclass
class Reading:
    """What reading every module's candidates shares.

    ``host``: what checkpointing costs the host (nothing under ``torch.compile``,
    ``keep_random``, where the machinery is compiled away).  ``overlap``: on a
    GPU the host queues kernels ahead, so a region's machinery (Python work
    per call, per saved tensor, per op under a policy) overlaps its re-run's
    kernels and a choice costs max(re-run, machinery); on an H100 the re-run
    alone matched the measured overheads (benchmarks/check_gpu_time_model.py).
    ``keep_random``: never discard the outputs of ops that draw random numbers,
    as a plan under ``torch.compile`` keeps them (:mod:`autosac.applier.compiled`).
    ``cast_hooks``: a plan for this step runs the parameter-cast hook on every
    tensor the forward saves outside checkpointed calls (it makes parameter
    casts; eager, on a CPU -- on a GPU that host work hides under kernels)."""

    stats: ModelStats
    max_choices: int = 16
    keep_random: bool = False
    host: HostCosts = field(default_factory=HostCosts)
    overlap: bool = False
    events: list[int] = field(default_factory=list)
    orders: dict = field(default_factory=dict)  # identical layers share their discard order
    replay_casts: _ReplayCasts | None = None
    cast_hooks: bool = False

    @classmethod
    def of(cls, stats: ModelStats, max_choices: int = 16, keep_random: bool = False) -> Reading:
        host = HostCosts.from_dict(stats.target["host"]) if stats.target.get("host") and not keep_random else HostCosts()
        overlap = stats.target.get("device_type") == "cuda"
        casts = not overlap and any(op.param_cast for op in stats.saved_ops)
        return cls(stats=stats, max_choices=max_choices, keep_random=keep_random, host=host, overlap=overlap,
                   events=[op.event for op in stats.saved_ops], replay_casts=_ReplayCasts(stats), cast_hooks=casts)

    def call_gap_ms(self) -> float:
        """``HostCosts.call_gap_us`` in ms, where the plan's real gaps between
        checkpointed calls are priced (:meth:`Problem.gap_ms`): eager on a CPU
        target; on a GPU that host work hides under kernels."""
        return 0.0 if self.overlap or self.keep_random else self.host.call_gap_us / 1e3

    def cast_hook_ms(self, saved: int, casts: int = 0) -> float:
        """What the parameter-cast hook costs ``saved`` saved tensors, ``casts``
        of them parameter casts it makes again in the backward (0 without it)."""
        if not self.cast_hooks:
            return 0.0
        return (saved * self.host.cast_hook_us + casts * self.host.cast_remake_us) / 1e3


@dataclass
class _Choices:
    """One module's discard choices, read off its first call: ``picks`` (how
    many of ``items`` each choice discards) and what each costs."""

    calls: list
    items: list[list[int]]
    picks: list[int]
    rerun: list[float]
    mechanism: list[float]
    gap_roots: float = 0.0  # the gaps its mechanism is priced with (own_gap_roots of its first call)


def module_candidates(r: Reading, fqn: str) -> list[Candidate]:
    """Module ``fqn``'s candidates, one per forward call (a module called
    several times per step is a shared block: its calls take the same
    choice), each with only the choices that save more than the checkpoint
    holds; none where no choice is realizable or worth taking."""
    m = r.stats.modules[fqn]
    if not m.saved_op_ids or m.bw_window is None or m.discardable_bytes <= 0:
        return []
    choices = _choices(r, fqn, m)
    if choices is None:
        return []
    group = []
    for j, (window, span) in enumerate(choices.calls):
        first = choices.calls[0][0]
        mine = choices.items if j == 0 else _mapped_items(r.stats, choices.items, first, window)
        if mine is None:
            return []
        group.append(_call_candidate(r, fqn, m, choices, j, window, span, mine))
    # a choice that saves no more than the checkpoint holds, in every call, is never worth taking
    useful = [k for k in range(len(choices.picks)) if sum(c.bytes[k] for c in group) > 0]
    for c in group:
        c.bytes, c.discarded, c.ms, c.mechanism, c.n_items, c.work = (
            [getattr(c, f)[k] for k in useful] for f in ("bytes", "discarded", "ms", "mechanism", "n_items", "work")
        )
    return group if useful else []


def _choices(r: Reading, fqn: str, m) -> _Choices | None:
    """The module's discard choices and their costs, or None where no
    checkpoint of it is sound (it would cache a result it writes after its
    re-run calls read it) or none is left to offer."""
    stats = r.stats
    calls = _calls(stats, m)
    if calls is None:
        return None
    first = calls[0][0]
    op_ids = [i for i in m.saved_op_ids if first[0] <= stats.saved_ops[i].event < first[1]]
    items, forced = _discard_items(stats, op_ids, first, r.keep_random)
    if not items:  # its only discards were random ops, kept
        return None
    items, costs = order_items(ModuleReplay.of(stats, fqn), items, first=forced, cache=r.orders)
    cum_t = np.asarray(costs)
    cum_first = np.cumsum([sum(stats.saved_ops[i].bytes for i in it) for it in items])
    picks = _choice_indices(cum_first, cum_t, r.max_choices)
    written = _written_after_read(stats, first)
    kept = _kept_anyway(stats, fqn, first, op_ids, r.events)
    if any(stats.saved_ops[i].event in written for i in kept):
        return None  # any checkpoint of it would cache a result it writes after re-run calls read it
    if m.routed:  # its op calls follow the data's routing: only whole, plain checkpointing matches none
        picks = [len(items)]
    if written:  # choices that keep such a result (cache it) while re-running its reader are not offered
        risky = {i for i in op_ids if stats.saved_ops[i].event in written}
        picks = [k for k in picks if risky <= {i for it in items[:k] for i in it}] or [len(items)]
    roots = own_gap_roots(m, first)
    mechanism, whole_ms = _mechanism(stats, m, first, len(items), picks, r.host, bool(kept), roots)
    if r.keep_random:  # compiled regions recompute what their graph needs: no plain path
        whole_ms = None
    if m.routed and whole_ms is None:
        return None
    rerun = [whole_ms if whole_ms is not None and k == len(items) else float(cum_t[k - 1]) for k in picks]
    # the call's saved tensors go through the checkpoint's hooks instead of the model-wide cast hook
    credit = r.cast_hook_ms(m.saved_tensors[0] if m.saved_tensors else 0)
    mechanism = [max(0.0, mech - credit) for mech in mechanism]
    if r.overlap:  # the host's checkpointing work hides under the kernels it queues: only its excess shows
        mechanism = [max(0.0, mech - t) for mech, t in zip(mechanism, rerun)]
    return _Choices(calls=calls, items=items, picks=picks, rerun=rerun, mechanism=list(mechanism), gap_roots=roots)


def _discard_bytes(op, window) -> int:
    """What discarding saved op ``op`` frees until the backward: nothing where
    the unmodified step frees it before the call's forward ends (its saving
    node died with a result the forward dropped: RWKV's last state update)."""
    return op.bytes if op.freed_event >= window[1] else 0


def _recompute_start(m, j: int, span) -> int:
    """Where call ``j``'s replay runs: at its first backward read of a tensor
    saved inside it (``ModuleStats.recompute_starts``), within its backward ``span``."""
    starts = m.recompute_starts
    first = starts[j] if j < len(starts) else -1
    return min(max(first, span[0]), span[1])


def _call_candidate(r: Reading, fqn: str, m, choices: _Choices, j: int, window, span, mine) -> Candidate:
    """The candidate of the module's ``j``-th call (forward events ``window``,
    backward ``span``), discarding ``mine`` (its first call's items, mapped)."""
    stats, picks = r.stats, choices.picks
    freed = [sum(_discard_bytes(stats.saved_ops[i], window) for i in it) for it in mine]
    cum_b = np.cumsum(freed)
    retained = m.retained_input_calls[j] if j < len(m.retained_input_calls) else m.retained_input_bytes
    parts = [tuple(x) for x in m.retained_inputs[j]] if j < len(m.retained_inputs) else []
    outside = m.outside_write_calls[j] if j < len(m.outside_write_calls) else m.outside_write_bytes
    hold = retained + stats.checkpoint_state_bytes + outside
    # what the cache holds for kept ops is not saved either: over the whole interval, but the late holds,
    # counted from their free to the replay (one-holder SharedHolds, built from ``late_holds``);
    # saved ops the forward itself drops (see _discard_bytes) that a choice keeps: the cache holds them to the replay
    dead = np.cumsum([0] + [sum(stats.saved_ops[i].bytes for i in it) - f for it, f in zip(mine, freed)])
    end = _recompute_start(m, j, span)
    late = _late_holds(m, stats, mine, window)
    skip = frozenset((e, f) for e, _, f in late)
    net = [int(cum_b[k - 1]) - hold - _cache_held(m, stats, mine, k, window, skip)[0] - int(dead[-1] - dead[k])
           for k in picks]
    casts = r.replay_casts(window)
    return Candidate(
        fqn=fqn, start=window[1], end=end, bw_end=span[1], bytes=net,
        discarded=[int(cum_b[k - 1]) for k in picks],
        ms=[t + mech for t, mech in zip(choices.rerun, choices.mechanism)], mechanism=list(choices.mechanism),
        n_items=list(picks), items=mine, discardable_bytes=int(cum_b[-1]),
        hold=hold + r.replay_casts(window, remade_after=end),
        # the replay also works on its own copy of what the call writes outside itself;
        # its parameter casts are in ``hold`` from the replay on (or in the live bytes, re-made there for their use)
        work=[max(0, w + outside - casts) for w in _recompute_extra(stats, m, mine, picks, window)], call=j,
        window=tuple(window), retained=parts, late_holds=[(b, f) for _, b, f in late if f < end],
        gap_roots=choices.gap_roots,
    )
