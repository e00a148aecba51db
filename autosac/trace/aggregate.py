"""Turn a raw step :class:`Recording` into :class:`ModelStats`: the memory
timeline and its peak, per-module memory and runtime, and the saved ops with
each module's exact recompute tradeoff curve."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from autosac.curves import exact_curve
from autosac.stats import ModelStats, ModuleStats, SavedOp, Timeline
from autosac.trace.recorder import StorageRecord, common_prefix
from autosac.trace.step import TracedStep, stack_of


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
    rec = step.recording
    n = len(rec.ops)
    live = _live_timeline(rec.storages, n)
    made = np.zeros(n, dtype=np.int64)
    for r in rec.storages:
        if 0 <= r.created < n and (r.freed is None or r.freed > r.created):
            made[r.created] += r.nbytes
    for ev, scratch in rec.transient.items():
        live[ev] += scratch
        made[ev] += scratch
    peak_event = int(np.argmax(live)) if n else 0
    peak_bytes = int(live[peak_event]) if n else sum(r.nbytes for r in rec.storages if r.created < 0)

    breakdown: dict[str, int] = defaultdict(int)
    for r in rec.storages:
        if max(r.created, 0) <= peak_event < (r.freed if r.freed is not None else n):
            breakdown[r.kind] += r.nbytes
    if rec.transient.get(peak_event):
        breakdown["scratch"] = rec.transient[peak_event]

    # ---- per-module runtime and windows
    fw_ms: dict[str, float] = defaultdict(float)
    bw_ms: dict[str, float] = defaultdict(float)
    bw_first: dict[str, int] = {}
    bw_last: dict[str, int] = {}
    for i in range(n):
        phase, stack, ms = rec.phases[i], rec.stacks[i], rec.ms[i]
        if phase == "forward":
            for fqn in stack:
                fw_ms[fqn] += ms
        elif phase == "backward":
            for fqn in stack:
                bw_ms[fqn] += ms
                bw_first.setdefault(fqn, i)
                bw_last[fqn] = i

    # ---- saved ops: forward-made storages autograd keeps, grouped by producing op
    groups: dict[int, list[StorageRecord]] = defaultdict(list)
    storage_ids = {id(r): i for i, r in enumerate(rec.storages)}
    for r in rec.storages:
        if r.kind == "act" and r.saver_stack is not None and r.producer >= 0 and r.nbytes > 0:
            groups[r.producer].append(r)
    saved_ops: list[SavedOp] = []
    own_saved: dict[str, int] = defaultdict(int)
    total_saved: dict[str, int] = defaultdict(int)
    discardable: dict[str, list[int]] = defaultdict(list)
    param_cast_bytes = 0
    for ev in sorted(groups):
        stack = rec.stacks[ev]
        recs = groups[ev]
        nbytes = sum(r.nbytes for r in recs)
        writers = sorted({w for r in recs for w in r.writers})
        chain = [ev, *writers]
        scope_stack = stack
        for r in recs:
            scope_stack = common_prefix(scope_stack, r.saver_stack)
        for w in writers:
            scope_stack = common_prefix(scope_stack, rec.stacks[w])
        for fqn in stack:
            total_saved[fqn] += nbytes
        if stack:
            own_saved[stack[-1]] += nbytes
        if not scope_stack:
            continue  # saved across the model boundary (e.g. the loss): nothing inside can discard it
        op = SavedOp(
            id=len(saved_ops), op=rec.ops[ev], module=stack[-1], scope=scope_stack[-1], event=ev,
            freed_event=max(r.freed for r in recs), bytes=nbytes, ms=sum(rec.ms[i] for i in chain),
            random=any(rec.random[i] for i in chain), view=any(r.saved_as_view for r in recs),
            inplace=bool(writers), param_cast=any(r.param_cast for r in recs), writer_events=writers,
            savers=sorted({st[-1] for r in recs for st in r.saver_stacks if st}),
        )
        saved_ops.append(op)
        if op.param_cast:
            param_cast_bytes += nbytes
        else:
            # a module cannot free what it returns: its caller holds it
            ids = {storage_ids[id(r)] for r in recs}
            for fqn in scope_stack:
                if not ids & rec.output_storages.get(fqn, set()):
                    discardable[fqn].append(op.id)

    # ---- module tree
    modules: dict[str, ModuleStats] = {}
    fw_pre = {}
    for i, fqn in enumerate(rec.fw_pre_order):
        fw_pre.setdefault(fqn, i)
    fw_post = {}
    for i, fqn in enumerate(rec.fw_post_order):
        fw_post.setdefault(fqn, i)
    fw_pre_pos, fw_post_pos = _order(fw_pre), _order(fw_post)
    bw_pre_pos, bw_post_pos = _order(bw_first), _order(bw_last)
    parent_of = {c: p for p, cs in step.module_children.items() for c in cs}
    param_own: dict[str, list] = defaultdict(list)
    for ps in step.params.values():
        param_own[ps.module].append(ps)
    kept = _kept_events(rec, saved_ops, groups)
    work, profiles, cache_holds = _recompute_work(rec, kept, bw_first)

    for fqn, mtype in step.module_types.items():
        stack = stack_of(fqn)
        sub_params = [ps for m in stack_subtree(fqn, step.module_children) for ps in param_own[m]]
        ids = discardable.get(fqn, [])
        bw = [bw_first[fqn], bw_last[fqn]] if fqn in bw_first else None
        act_grad = 0
        if bw is not None:
            before = int(live[bw[0] - 1]) if bw[0] > 0 else 0
            act_grad = max(0, int(live[bw[0] : bw[1] + 1].max()) - before)
        io = rec.io_bytes.get(fqn, [0, 0])
        modules[fqn] = ModuleStats(
            fqn=fqn, type=mtype, parent=parent_of.get(fqn), children=list(step.module_children[fqn]),
            depth=len(stack) - 1, calls=len(rec.fw_windows.get(fqn, [])),
            fw_pre_order=fw_pre_pos.get(fqn, -1), fw_post_order=fw_post_pos.get(fqn, -1),
            bw_pre_order=bw_pre_pos.get(fqn, -1), bw_post_order=bw_post_pos.get(fqn, -1),
            fw_windows=[list(w) for w in rec.fw_windows.get(fqn, [])], bw_window=bw,
            param_bytes=sum(ps.bytes for ps in param_own[fqn]),
            param_bytes_total=sum(ps.bytes for ps in sub_params),
            grad_bytes_total=sum(ps.grad_bytes for ps in sub_params),
            optimizer_bytes_total=sum(ps.optimizer_bytes for ps in sub_params),
            saved_bytes=own_saved.get(fqn, 0), saved_bytes_total=total_saved.get(fqn, 0),
            act_grad_bytes=act_grad, input_bytes=io[0], output_bytes=io[1],
            fw_ms=fw_ms.get(fqn, 0.0), bw_ms=bw_ms.get(fqn, 0.0),
            recompute_work_bytes=work.get(fqn, 0),
            recompute_profile=profiles.get(fqn, []),
            retained_input_bytes=sum(
                rec.storages[i].nbytes for i in rec.input_storages.get(fqn, ())
                if rec.storages[i].kind in ("act", "temp") and bw is not None and rec.storages[i].freed <= bw[0]
            ),
            outside_write_bytes=_outside_writes(rec, rec.fw_windows.get(fqn, [])),
            saved_op_ids=ids, discardable_bytes=sum(saved_ops[i].bytes for i in ids),
            cache_holds=sorted([e, b] for e, b in cache_holds.get(fqn, {}).items()),
        )
        curve = exact_curve([(saved_ops[i].bytes, saved_ops[i].ms) for i in ids])
        modules[fqn].tradeoff = curve
        modules[fqn].tradeoff_exact_points = len(curve)

    phases_ms: dict[str, float] = defaultdict(float)
    for phase, ms in zip(rec.phases, rec.ms):
        phases_ms[phase] += ms
    return ModelStats(
        model=model_name, fingerprint=fingerprint, target=target, world_size=world_size,
        optimizer=optimizer, peak_bytes=peak_bytes, peak_event=peak_event,
        peak_module=(rec.stacks[peak_event][-1] if n and rec.stacks[peak_event] else None),
        peak_phase=rec.phases[peak_event] if n else "forward", peak_breakdown=dict(breakdown),
        param_bytes=sum(ps.bytes for ps in step.params.values()), buffer_bytes=step.buffer_bytes,
        grad_bytes=sum(ps.grad_bytes for ps in step.params.values()),
        optimizer_bytes=sum(ps.optimizer_bytes for ps in step.params.values()),
        input_bytes=step.input_bytes, param_cast_bytes=param_cast_bytes,
        step_ms=float(sum(rec.ms)), forward_ms=phases_ms["forward"] + phases_ms["loss"],
        backward_ms=phases_ms["backward"], optimizer_ms=phases_ms["optimizer"],
        root="", modules=modules, params=step.params, saved_ops=saved_ops,
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


def _outside_writes(rec, windows) -> int:
    """Bytes the first forward call writes in place into tensors made before it
    (buffers, parameters, inputs): a checkpoint keeps their prior values until
    its replay, so that the replay does not write them again."""
    if not windows:
        return 0
    start, end = windows[0]
    return sum(b for e, items in rec.written.items() if start <= e < end for p, b in items if p < start)


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


def _recompute_work(rec, kept: dict[str, set[int]], bw_first: dict[str, int]):
    """Per module, what re-running its forward in the backward allocates besides
    the saved activations it re-makes: every tensor made by an op it does not
    keep -- the short-lived ones for their forward lifetime, the ones that
    outlive the forward (its output, say) until the replay ends -- plus op
    scratch.  Returns their peak, their live bytes over the forward as
    ``[event, bytes]`` change points, and per kept op the bytes of its other
    outputs that the checkpoint's cache holds from their free until the backward."""
    windows = {fqn: [tuple(w) for w in ws] for fqn, ws in rec.fw_windows.items()}
    deltas: dict[str, list[tuple[int, int]]] = defaultdict(list)
    holds: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for r in rec.storages:
        if r.kind != "act" or r.producer < 0 or r.freed is None:
            continue
        p = r.producer
        for fqn in rec.stacks[p]:
            for start, end in windows.get(fqn, ()):
                if not start <= p < end:
                    continue
                if not r.param_cast and p in kept.get(fqn, ()):
                    saved_inside = any(fqn in st for st in r.saver_stacks)
                    if not saved_inside and fqn in bw_first and r.freed < bw_first[fqn]:
                        holds[fqn][p] += r.nbytes
                    continue
                deltas[fqn] += [(p, r.nbytes), (min(r.freed, end), -r.nbytes)]
    for ev, scratch in rec.transient.items():
        if rec.phases[ev] == "forward":
            for fqn in rec.stacks[ev]:
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
