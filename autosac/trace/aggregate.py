"""Turn a raw step :class:`Recording` into :class:`ModelStats`: the memory
timeline and its peak, per-module memory and runtime, and the saved ops with
each module's exact recompute tradeoff curve."""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from autosac.core.curves import exact_curve
from autosac.core.stats import ModelStats, ModuleStats, SavedOp, Timeline
from autosac.trace.recording import StorageRecord, common_prefix, stack_of
from autosac.trace.step import TracedStep


def _live_timeline(storages: list[StorageRecord], n: int, kind: str | None = None) -> np.ndarray:
    delta = np.zeros(n + 1, dtype=np.int64)
    for r in storages:
        if kind is not None and r.kind != kind:
            continue
        start = max(r.created, 0)
        end = min(r.freed if r.freed is not None else n, n)
        if end > start:
            delta[start] += r.nbytes
            delta[end] -= r.nbytes
    return np.cumsum(delta)[:n]


def _order(keys: dict[str, int]) -> dict[str, int]:
    return {fqn: i for i, fqn in enumerate(sorted(keys, key=keys.__getitem__))}


@dataclass
class _Saved:
    """The saved ops of a step and what each module may discard of them."""

    ops: list[SavedOp]
    groups: dict[int, list[StorageRecord]]
    own: dict[str, int]
    total: dict[str, int]
    discardable: dict[str, list[int]]
    param_cast_bytes: int


@dataclass
class _Times:
    fw_ms: dict[str, float]
    bw_ms: dict[str, float]
    bw_first: dict[str, int]
    bw_last: dict[str, int]
    phases: dict[str, float]


def aggregate(
    step: TracedStep,
    *,
    model_name: str,
    fingerprint: str,
    target: dict,
    world_size: int,
    optimizer: str,
    versions: dict[str, str],
) -> ModelStats:
    """Plain statistics of one traced step (see :class:`ModelStats`)."""
    rec = step.recording
    n = len(rec.ops)
    live, made = memory_timeline(rec)
    peak_event = int(np.argmax(live)) if n else 0
    peak_bytes = int(live[peak_event]) if n else sum(r.nbytes for r in rec.storages if r.created < 0)
    times = _module_times(rec)
    saved = _saved_ops(rec)
    modules = _module_stats(step, live, times, saved)
    return ModelStats(
        model=model_name, fingerprint=fingerprint, target=target, world_size=world_size,
        optimizer=optimizer, peak_bytes=peak_bytes, peak_event=peak_event,
        peak_module=(rec.stacks[peak_event][-1] if n and rec.stacks[peak_event] else None),
        peak_phase=rec.phases[peak_event] if n else "forward", peak_breakdown=peak_breakdown(rec, peak_event),
        param_bytes=sum(ps.bytes for ps in step.params.values()), buffer_bytes=step.buffer_bytes,
        grad_bytes=sum(ps.grad_bytes for ps in step.params.values()),
        optimizer_bytes=sum(ps.optimizer_bytes for ps in step.params.values()),
        input_bytes=step.input_bytes, param_cast_bytes=saved.param_cast_bytes,
        step_ms=float(sum(rec.ms)), forward_ms=times.phases["forward"] + times.phases["loss"],
        backward_ms=times.phases["backward"], optimizer_ms=times.phases["optimizer"],
        root="", modules=modules, params=step.params, saved_ops=saved.ops,
        timeline=Timeline(
            ops=list(rec.ops), phases=list(rec.phases),
            modules=[s[-1] if s else None for s in rec.stacks],
            live_bytes=[int(x) for x in live],
            grad_bytes=[int(x) for x in _live_timeline(rec.storages, n, "grad")], ms=list(rec.ms),
            made_bytes=[int(x) for x in made],
            inputs=[rec.inputs.get(i, []) for i in range(n)], views=list(rec.views),
            random=list(rec.random), writes=list(rec.writes),
        ),
        unknown_flop_ops=sorted(rec.unknown_ops), versions=versions,
    )


def memory_timeline(rec) -> tuple[np.ndarray, np.ndarray]:
    """Bytes alive at each event (op scratch included), and bytes each event allocates."""
    n = len(rec.ops)
    live = _live_timeline(rec.storages, n)
    made = np.zeros(n, dtype=np.int64)
    for r in rec.storages:
        if 0 <= r.created < n and (r.freed is None or r.freed > r.created):
            made[r.created] += r.nbytes
    for ev, scratch in rec.transient.items():
        live[ev] += scratch
        made[ev] += scratch
    return live, made


def peak_breakdown(rec, peak_event: int) -> dict[str, int]:
    """Bytes alive at the peak, by kind (param, grad, act, ... and op scratch)."""
    n = len(rec.ops)
    out: dict[str, int] = defaultdict(int)
    for r in rec.storages:
        if max(r.created, 0) <= peak_event < (r.freed if r.freed is not None else n):
            out[r.kind] += r.nbytes
    if rec.transient.get(peak_event):
        out["scratch"] = rec.transient[peak_event]
    return dict(out)


def _module_times(rec) -> _Times:
    """Per module forward and backward ms, and its backward's first and last event."""
    t = _Times(defaultdict(float), defaultdict(float), {}, {}, defaultdict(float))
    for i, (phase, stack, ms) in enumerate(zip(rec.phases, rec.stacks, rec.ms)):
        t.phases[phase] += ms
        if phase == "forward":
            for fqn in stack:
                t.fw_ms[fqn] += ms
        elif phase == "backward":
            for fqn in stack:
                t.bw_ms[fqn] += ms
                t.bw_first.setdefault(fqn, i)
                t.bw_last[fqn] = i
    return t


def _saved_ops(rec) -> _Saved:
    """Forward-made storages autograd keeps, grouped by the op that made them,
    and for each module the ones it may discard: those saved and written only
    inside it, and not among what it returns (its caller holds those)."""
    groups: dict[int, list[StorageRecord]] = defaultdict(list)
    storage_ids = {id(r): i for i, r in enumerate(rec.storages)}
    for r in rec.storages:
        if r.kind == "act" and r.saver_stack is not None and r.producer >= 0 and r.nbytes > 0:
            groups[r.producer].append(r)
    out = _Saved([], groups, defaultdict(int), defaultdict(int), defaultdict(list), 0)
    consumers: dict[int, list[int]] = defaultdict(list)  # forward event -> forward events reading it
    for e, deps in rec.inputs.items():
        for d in deps:
            consumers[d].append(e)
    backward_of: dict[int, int] = {}  # forward event -> first backward event of the node it made
    for b, origin in sorted(rec.origins.items()):
        backward_of.setdefault(origin, b)
    for ev in sorted(groups):
        stack, recs = rec.stacks[ev], groups[ev]
        nbytes = sum(r.nbytes for r in recs)
        writers = sorted({w for r in recs for w in r.writers})
        chain = [ev, *writers]
        scope_stack = stack
        for r in recs:
            scope_stack = common_prefix(scope_stack, r.saver_stack)
        for w in writers:
            scope_stack = common_prefix(scope_stack, rec.stacks[w])
        for fqn in stack:
            out.total[fqn] += nbytes
        if stack:
            out.own[stack[-1]] += nbytes
        if not scope_stack:
            continue  # saved across the model boundary (e.g. the loss): nothing inside can discard it
        op = SavedOp(
            id=len(out.ops), op=rec.ops[ev], module=stack[-1], scope=scope_stack[-1], event=ev,
            freed_event=max(r.freed for r in recs), bytes=nbytes, ms=sum(rec.ms[i] for i in chain),
            random=any(rec.random[i] for i in chain), view=any(r.saved_as_view for r in recs),
            inplace=bool(writers), param_cast=any(r.param_cast for r in recs),
            param=next((r.cast_of for r in recs if r.cast_of), ""), writer_events=writers,
            savers=sorted({st[-1] for r in recs for st in r.saver_stacks if st}),
        )
        out.ops.append(op)
        if op.param_cast:
            uses = [backward_of[c] for c in consumers.get(ev, ()) if c in backward_of]
            op.remade_at = min(uses) if uses else -1
            out.param_cast_bytes += nbytes
            continue
        ids = {storage_ids[id(r)] for r in recs}
        for fqn in scope_stack:
            if not ids & rec.output_storages.get(fqn, set()):
                out.discardable[fqn].append(op.id)
    return out


def _call_bw_windows(rec, fqn: str, windows: list, times: _Times) -> list[list[int] | None]:
    """Per forward call, the first and last backward event of the autograd
    nodes that call created (a module called once: its whole backward)."""
    if len(windows) <= 1:
        return [[times.bw_first[fqn], times.bw_last[fqn]] if fqn in times.bw_first else None for _ in windows]
    spans: list[list[int] | None] = [None] * len(windows)
    starts = [w[0] for w in windows]
    for e, origin in rec.origins.items():
        if fqn not in rec.stacks[e]:
            continue
        j = bisect.bisect_right(starts, origin) - 1
        if j < 0 or not windows[j][0] <= origin < windows[j][1]:
            continue
        span = spans[j]
        spans[j] = [e, e] if span is None else [min(span[0], e), max(span[1], e)]
    return spans


def _hook_orders(rec, times: _Times) -> tuple[dict[str, int], ...]:
    """Each module's place in the order of the forward's pre-hooks and
    post-hooks (first call) and of the backward's first and last ops."""
    fw_pre: dict[str, int] = {}
    for i, fqn in enumerate(rec.fw_pre_order):
        fw_pre.setdefault(fqn, i)
    fw_post: dict[str, int] = {}
    for i, fqn in enumerate(rec.fw_post_order):
        fw_post.setdefault(fqn, i)
    return _order(fw_pre), _order(fw_post), _order(times.bw_first), _order(times.bw_last)


def _module_stats(step: TracedStep, live: np.ndarray, times: _Times, saved: _Saved) -> dict[str, ModuleStats]:
    rec = step.recording
    fw_pre_pos, fw_post_pos, bw_pre_pos, bw_post_pos = _hook_orders(rec, times)
    parent_of = {c: p for p, cs in step.module_children.items() for c in cs}
    param_own: dict[str, list] = defaultdict(list)
    for ps in step.params.values():
        param_own[ps.module].append(ps)
    kept = _kept_events(rec, saved.ops, saved.groups)
    saved_tensors = _saved_tensors_per_call(rec)
    recompute_starts = _recompute_starts(rec)
    stops = _replay_ends(rec)
    work, profiles, cache_holds = _recompute_work(rec, kept, times.bw_first, stops)
    last_write = _last_writes(rec)
    modules: dict[str, ModuleStats] = {}
    for fqn, mtype in step.module_types.items():
        stack = stack_of(fqn)
        sub_params = [ps for m in stack_subtree(fqn, step.module_children) for ps in param_own[m]]
        ids = saved.discardable.get(fqn, [])
        windows = [list(w) for w in rec.fw_windows.get(fqn, [])]
        bw = [times.bw_first[fqn], times.bw_last[fqn]] if fqn in times.bw_first else None
        bw_calls = _call_bw_windows(rec, fqn, windows, times)
        act_grad = 0
        if bw is not None:
            before = int(live[bw[0] - 1]) if bw[0] > 0 else 0
            act_grad = max(0, int(live[bw[0] : bw[1] + 1].max()) - before)
        io = rec.io_bytes.get(fqn, [0, 0])
        retained = [
            _retained_inputs(rec, inputs, span)
            for inputs, span in zip(rec.input_storages.get(fqn, []), bw_calls)
        ]
        outside = [_outside_writes(rec, w) for w in windows]  # per call: (bytes, whether any)
        curve = exact_curve([(saved.ops[i].bytes, saved.ops[i].ms) for i in ids if _in_first(saved.ops[i], windows)])
        modules[fqn] = ModuleStats(
            fqn=fqn, type=mtype, parent=parent_of.get(fqn), children=list(step.module_children[fqn]),
            depth=len(stack) - 1, calls=len(windows),
            fw_pre_order=fw_pre_pos.get(fqn, -1), fw_post_order=fw_post_pos.get(fqn, -1),
            bw_pre_order=bw_pre_pos.get(fqn, -1), bw_post_order=bw_post_pos.get(fqn, -1),
            fw_windows=windows, bw_window=bw, bw_windows=bw_calls,
            param_bytes=sum(ps.bytes for ps in param_own[fqn]),
            param_bytes_total=sum(ps.bytes for ps in sub_params),
            grad_bytes_total=sum(ps.grad_bytes for ps in sub_params),
            optimizer_bytes_total=sum(ps.optimizer_bytes for ps in sub_params),
            saved_bytes=saved.own.get(fqn, 0), saved_bytes_total=saved.total.get(fqn, 0),
            act_grad_bytes=act_grad, input_bytes=io[0], output_bytes=io[1],
            fw_ms=times.fw_ms.get(fqn, 0.0), bw_ms=times.bw_ms.get(fqn, 0.0),
            recompute_work_bytes=work.get(fqn, 0),
            recompute_profile=profiles.get(fqn, []),
            retained_input_bytes=sum(b for _, b, _ in retained[0]) if retained else 0,
            retained_input_calls=[sum(b for _, b, _ in call) for call in retained], retained_inputs=retained,
            outside_write_bytes=outside[0][0] if outside else 0, outside_write_calls=[b for b, _ in outside],
            writes_outside=any(any_write for _, any_write in outside),
            saved_op_ids=ids, discardable_bytes=sum(saved.ops[i].bytes for i in ids if _in_first(saved.ops[i], windows)),
            cache_holds=sorted([e, b, f] for (e, f), b in cache_holds.get(fqn, {}).items()),
            tradeoff=curve, tradeoff_exact_points=len(curve),
            saved_tensors=saved_tensors.get(fqn, [0] * len(windows)),
            recompute_starts=recompute_starts.get(fqn, [-1] * len(windows)),
            replay_stops=stops.get(fqn, [w[1] for w in windows]),
            routed=any(_has_event_in(rec.routed, w) for w in windows),
            state_items=rec.state_items.get(fqn, 0),
            host_rng=None if rec.host_rng is None else fqn in rec.host_rng,
            inputs_written_later=any(last_write.get(sid, -1) >= w[1]
                                     for found, w in zip(rec.input_storages.get(fqn, []), windows) for sid in found),
        )
    return modules


def _has_event_in(events: set[int], window) -> bool:
    return any(window[0] <= e < window[1] for e in events)


def _saves(rec):
    """Each save point as ``(position, module, call)`` for every module on its
    stack (``call``: which of the module's forward calls saved it, as recorded
    at the save: position alone cannot tell a call's last output from the next
    call's first input when the calls run back to back)."""
    for (position, stack), calls in zip(rec.save_points, rec.save_calls):
        for fqn, j in zip(stack, calls):
            yield position, fqn, j


def _saved_tensors_per_call(rec) -> dict[str, list[int]]:
    """Per module, per forward call: how many tensors autograd saved inside it."""
    out = {fqn: [0] * len(ws) for fqn, ws in rec.fw_windows.items()}
    for _, fqn, j in _saves(rec):
        out[fqn][j] += 1
    return out


def _replay_stops(rec) -> dict[str, list[int]]:
    """Per module, per forward call: the event its replay stops before -- the
    one after its last saved tensor (an op's inputs are saved before it runs,
    its outputs after); the call's start where it saved none."""
    out = {fqn: [w[0] for w in ws] for fqn, ws in rec.fw_windows.items()}
    for position, fqn, j in _saves(rec):
        out[fqn][j] = max(out[fqn][j], min(position, rec.fw_windows[fqn][j][1]))
    return out


def _replay_ends(rec) -> dict[str, list[int]]:
    """Per module, per forward call: the event a replay of it stops before
    (:func:`_replay_stops`), but the call's end where it reads routing values:
    its ops and saved tensors follow a routing the trace only assumed."""
    stops = _replay_stops(rec)
    return {fqn: [stop if not _has_event_in(rec.routed, w) else w[1] for w, stop in zip(ws, stops[fqn])]
            for fqn, ws in rec.fw_windows.items()}


def _recompute_starts(rec) -> dict[str, list[int]]:
    """Per module, per forward call: the backward event a checkpoint of that
    call re-runs its forward at -- the first read of a tensor saved inside it
    (-1: none is read).  Backward ops of the call that read nothing saved (an
    add's, a cast's) run before it, and what they make is alive meanwhile."""
    out = {fqn: [-1] * len(ws) for fqn, ws in rec.fw_windows.items()}
    for event, point in rec.unpacks:  # in event order: the first read of each call's tensors wins
        for fqn, j in zip(rec.save_points[point][1], rec.save_calls[point]):
            if out[fqn][j] < 0:
                out[fqn][j] = event
    return out


def _in_first(op: SavedOp, windows: list) -> bool:
    """Whether ``op`` ran in the module's first call (per-call figures describe that call)."""
    return not windows or windows[0][0] <= op.event < windows[0][1]


def _retained_inputs(rec, inputs: list[int], bw_span) -> list[list[int]]:
    """One call's inputs that a checkpoint keeps alive although the unmodified
    step frees them before that call's backward: ``[storage, bytes, freed event]``."""
    if bw_span is None:
        return []
    return [
        [i, rec.storages[i].nbytes, rec.storages[i].freed] for i in sorted(set(inputs))
        if rec.storages[i].kind in ("act", "temp") and rec.storages[i].freed <= bw_span[0]
    ]


def _outside_writes(rec, window) -> tuple[int, bool]:
    """Bytes of the storages one forward call writes in place that were made
    before it (buffers, parameters, inputs): a checkpoint keeps a copy of each
    as it was until its replay, which reads and writes that copy instead; and
    whether it writes any such tensor (tensors the trace never saw made count,
    with no bytes)."""
    start, end = window
    storages = {sid: b for e, items in rec.written.items() if start <= e < end for p, sid, b in items if p < start}
    return sum(storages.values()), bool(storages)


def _last_writes(rec) -> dict[int, int]:
    """Storage record -> the last forward event that writes it in place (a
    module whose call's inputs are written after the call ends is
    ``ModuleStats.inputs_written_later``)."""
    last: dict[int, int] = {}
    for e, items in rec.written.items():
        for _, sid, _ in items:
            last[sid] = max(e, last.get(sid, -1))
    return last


def stack_subtree(fqn: str, children: dict[str, list[str]]) -> list[str]:
    out, todo = [], [fqn]
    while todo:
        m = todo.pop()
        out.append(m)
        todo.extend(children.get(m, ()))
    return out


def _kept_events(rec, saved_ops: list[SavedOp], groups) -> dict[str, set[int]]:
    """Per module, the forward op calls its checkpoint keeps when it does not
    discard them: those with an output that an op inside the module saves (and
    their in-place writers).  Outputs saved only by ops outside it are not kept:
    caching them would hold them past their consumers' backward."""
    kept: dict[str, set[int]] = defaultdict(set)
    for op in saved_ops:
        if op.param_cast:
            continue
        chain = (op.event, *op.writer_events)
        for r in groups[op.event]:
            for st in r.saver_stacks:
                for fqn in common_prefix(rec.stacks[op.event], st):
                    kept[fqn].update(chain)
    return kept


def _recompute_work(rec, kept: dict[str, set[int]], bw_first: dict[str, int], ends: dict[str, list[int]]):
    """Per module, what re-running its forward in the backward allocates besides
    the saved activations it re-makes: every tensor made by an op it does not
    keep -- the short-lived ones for their forward lifetime, the ones that
    outlive the forward (its output, say) until the replay ends -- plus op
    scratch.  Returns their peak, their live bytes over the forward as
    ``[event, bytes]`` change points, and per kept op the bytes of its other
    outputs that the checkpoint's cache holds from their free until the backward.

    A number autograd keeps (``x * 0.5``: made by no op, ``producer`` -1) is
    made and kept again by the replay's own graph, kept or re-run op alike,
    until the replay ends.

    The replay ends where the forward saved its last tensor: PyTorch's
    checkpoint stops re-running once every saved tensor is made again (its
    early stop, which the applier keeps on), so nothing after it is made --
    except in a call that reads routing values, whose ops and saved tensors
    follow a routing the trace only assumed: its whole forward is counted
    (``ends``: :func:`_replay_ends`)."""
    windows = {fqn: [(w[0], stop) for w, stop in zip(ws, ends[fqn])] for fqn, ws in rec.fw_windows.items()}
    deltas: dict[str, list[tuple[int, int]]] = defaultdict(list)
    holds: dict[str, dict[tuple[int, int], int]] = defaultdict(lambda: defaultdict(int))
    for r in rec.storages:
        if r.kind != "act" or r.freed is None or r.created < 0:
            continue
        p = r.producer
        if p < 0:  # a number autograd keeps
            for fqn in rec.stacks[r.created]:
                for start, end in windows.get(fqn, ()):
                    if start <= r.created < end:
                        deltas[fqn] += [(r.created, r.nbytes), (min(r.freed, end), -r.nbytes)]
            continue
        for fqn in rec.stacks[p]:
            for start, end in windows.get(fqn, ()):
                if not start <= p < end:
                    continue
                if not r.param_cast and p in kept.get(fqn, ()):
                    saved_inside = any(fqn in st for st in r.saver_stacks)
                    if not saved_inside and fqn in bw_first and r.freed < bw_first[fqn]:
                        holds[fqn][p, r.freed] += r.nbytes
                    continue
                deltas[fqn] += [(p, r.nbytes), (min(r.freed, end), -r.nbytes)]
    for ev, scratch in rec.transient.items():
        if rec.phases[ev] == "forward":
            for fqn in rec.stacks[ev]:
                if any(start <= ev < end for start, end in windows.get(fqn, ())):
                    deltas[fqn] += [(ev, scratch), (ev + 1, -scratch)]
    peaks, profiles = {}, {}
    for fqn, items in deltas.items():
        items.sort(key=lambda x: (x[0], x[1]))  # frees before allocations at the same event
        cur = best = 0
        profile: list[list[int]] = []
        for ev, b in items:
            cur += b
            best = max(best, cur)
            if profile and profile[-1][0] == ev:
                profile[-1][1] = cur
            else:
                profile.append([ev, cur])
        peaks[fqn], profiles[fqn] = best, profile
    return peaks, profiles, holds
