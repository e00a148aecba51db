"""The host figures of one calibration from its timed rounds (:mod:`autosac.tools.calibrate`
takes the rounds): each round's figures from differences of its variants' times,
brought to the rounds' typical speed, then each figure's median over the rounds;
the per-call figures set free of the gaps and Python state the rounds' calls had.
Arithmetic only: nothing here times anything.
"""

from __future__ import annotations

import statistics

from autosac.core.host import _PER_OP
from autosac.tools.calibration_models import _gap_roots, replay_skips

# the most of the tiny model's each-of-all call its gap may take: more leaves no fixed cost, a split
# only noise gives (a machine busy beside the calibration read call_gap_us 38 us, checkpoint_call_us 0)
_GAP_SHARE = 0.9


def without_gaps(figures: dict, models: dict) -> dict:
    """``checkpoint_call_us`` and ``saved_tensor_us`` as a call costs with no
    op calls between it and the machinery's last run and no Python state to
    capture: the rounds fit them to the tiny and the deep model's calls
    (:func:`round_figures`), each at its own gaps and with its own state;
    ``call_gap_us`` and ``state_item_us`` price those (:meth:`HostCosts.checkpoint_ms`)."""
    k, q = figures.get("call_gap_us", 0.0), figures.get("state_item_us", 0.0)
    tiny = models["tiny"]
    per_call = _gap_roots(tiny, tiny["regions"]) / tiny["blocks"]
    own = figures["checkpoint_call_us"] + tiny["stats"].modules["0"].saved_tensors[0] * figures["saved_tensor_us"]
    own -= q * tiny["stats"].modules["0"].state_items
    if k * per_call > _GAP_SHARE * own > 0:  # a lone call measured slow beyond what its calls' sum allows
        k = figures["call_gap_us"] = round(_GAP_SHARE * own / per_call, 3)
    parts = {}
    for name in ("tiny", "deep"):
        setup = models[name]
        m = setup["stats"].modules["0"]
        n = m.saved_tensors[0]
        whole = figures["checkpoint_call_us"] + n * figures["saved_tensor_us"]  # its call, as the rounds fit it
        known = (k * _gap_roots(setup, setup["regions"]) / setup["blocks"] if k else 0.0) + q * m.state_items
        parts[name] = (n, whole - known)
    (n_t, tiny), (n_d, deep) = parts["tiny"], parts["deep"]
    saved = max(0.0, (deep - tiny) / max(1, n_d - n_t))
    return {**figures, "saved_tensor_us": round(saved, 3), "checkpoint_call_us": round(max(0.0, tiny - n_t * saved), 2)}


def estimate(models: dict, taken: list[dict]) -> dict[str, float]:
    """The figures over the rounds ``taken``: each round's figures from the
    least sample of each variant in it (:func:`round_figures`), then each
    figure's median over the rounds.  On this 2-core VM a step's time
    drifts by 20-40 % over seconds, alike for the variants run next to each
    other (lag-one correlation 0.55, between two variants 0.73): the least
    time of each variant over all rounds came from different moments, and
    figures made of their differences moved by up to 2x between
    calibrations; a difference within one round, then the median, moved by
    about 5 %.  A median is also what a step costs as measured (medians of
    steps), where the least is one lucky moment.  Each round's figures are
    first brought to the rounds' typical speed (:func:`at_typical_speed`)."""
    per_round = at_typical_speed([round_figures(models, samples) for samples in taken],
                                  [round_ms(samples) for samples in taken])
    return {k: round(statistics.median(f[k] for f in per_round), 3) for k in per_round[0]}


def round_ms(samples: dict) -> float:
    """A round's speed: the sum over its variants of each one's least step (ms)."""
    return sum(min(s[1] for s in v) for v in samples.values())


def at_typical_speed(per_round: list[dict], round_ms: list[float]) -> list[dict]:
    """Each round's time figures scaled by the rounds' median ``round_ms`` over
    its own (byte figures as they are): this VM runs the same work at two
    speeds 1.6-2x apart, switching every few seconds
    (``benchmarks/machine_drift.py``), so a round is mostly at one of them,
    and the figures' medians were a mix that moved between calibrations --
    the figures of one calibration then no longer fit each other."""
    typical = statistics.median(round_ms)
    return [{k: v if k.endswith("_bytes") else v * typical / ms for k, v in f.items()}
            for f, ms in zip(per_round, round_ms)]


def round_figures(models: dict, samples: dict) -> dict[str, float]:
    """One round's figures from the least sample of each of its variants."""
    least = {k: min(s[1] for s in v) for k, v in samples.items()}
    least_fw = {k: min(s[0] for s in v) for k, v in samples.items()}
    got = {size: model_figures(setup, {k: t for (s, k), t in least.items() if s == size},
                          {k: t for (s, k), t in least_fw.items() if s == size})
           for size, setup in models.items()}
    shallow, deep, tiny, large = got["shallow"], got["deep"], got["tiny"], got.get("large")
    for f in (deep, tiny):  # the host time of the op calls a replay skips (see model_figures)
        f["mechanism_us"] += f["skipped_ops"] * shallow["op_us"]
    if "alone_us" in tiny:
        tiny["alone_us"] += tiny["skipped_ops"] * shallow["op_us"]
    # per call: mechanism = call + saved * saved_tensor; the tiny call is nearly all
    # per-call cost, the deep one saves many tensors
    saved_us = max(0.0, (deep["mechanism_us"] - tiny["mechanism_us"]) / max(1, deep["saved"] - tiny["saved"]))
    call_us = max(0.0, tiny["mechanism_us"] - tiny["saved"] * saved_us)
    selective_us = max(0.0, shallow["selective_us"] / (2 * shallow["ops"]))
    small = {"op_us": round(shallow["op_us"], 3), "checkpoint_call_us": round(call_us, 2),
             "call_gap_us": round(_gap_us(models["tiny"], tiny), 3) if "alone_us" in tiny else 0.0,
             "saved_tensor_us": round(saved_us, 3), "selective_op_us": round(selective_us, 3),
             "untimed_op_us": round(shallow["untimed_op_us"], 3), "backward_op_us": round(shallow["backward_op_us"], 3),
             "backward_untimed_us": round(shallow["backward_untimed_us"], 3),
             "cast_hook_us": round(shallow.get("cast_us", 0.0), 3), "cast_remake_us": round(shallow.get("remake_us", 0.0), 3)}
    return small if large is None else {**small, **_large_figures(models, small, large)}


def _gap_us(setup: dict, tiny: dict) -> float:
    """``call_gap_us`` (:meth:`HostCosts.gap_us`) in one round: what the tiny
    model's middle region checkpointed alone (``setup["alone"]``) costs
    beyond each call of all of them checkpointed (``tiny``: its round's
    figures, each set against its forward run twice), per square root of the
    op calls more that run between the machinery's runs
    (:func:`autosac.core.host.gap_roots`): one call alone finds it colder.
    Measured here: 9-19 us per root (may be negative in one round)."""
    roots = setup["gap_roots"]
    return (tiny["alone_us"] - tiny["mechanism_us"]) / roots if roots > 0 else 0.0


def _large_figures(models: dict, small: dict, large: dict) -> dict[str, float]:
    """The large-size extras, both sizes' typical op bytes and the large
    size's largest op (:func:`autosac.core.hostsize.fit_extras`)."""
    from autosac.core.hostsize import anchor_bytes, fit_extras, largest_bytes

    stats = models["large"]["stats"]
    small_bytes, large_bytes, largest = anchor_bytes(models["shallow"]["stats"]), anchor_bytes(stats), largest_bytes(stats)
    extras = fit_extras(small, large, stats, small_bytes, large_bytes, largest)
    return {"small_op_bytes": round(small_bytes), "large_op_bytes": round(large_bytes), "largest_op_bytes": largest,
            **extras}


def scale(figures: dict[str, float], name: str, gap_roots: float = 0.0) -> float:
    """What a figure's noise is measured against: an op call's host time for
    the per-op figures (a small or signed part of it need not agree to 10 %
    of itself); for ``call_gap_us``, the lone call it prices, per root of its
    gap (``gap_roots``: how many more than each call of all); else the
    figure itself."""
    if name in _PER_OP:
        return figures["op_us"]
    if name == "call_gap_us" and gap_roots > 0:
        return figures["checkpoint_call_us"] / gap_roots + abs(figures["call_gap_us"])
    return 0.0


def model_figures(setup: dict, times: dict[str, float], forwards: dict[str, float]) -> dict:
    """One calibration model's figures from its timed variants: the host time
    per op, and per checkpointed call what the checkpoint adds beyond
    re-running the forward (whole: against running each forward twice) and
    what the selective path adds beyond that (against the whole path, less
    the cached matmul it does not re-run).  ``times``: forward and backward;
    ``forwards``: the forward alone.  Only differences of measured times, but
    for that one matmul's traced time."""
    stats, blocks = setup["stats"], setup["blocks"]
    tl = stats.timeline
    w0, w1 = stats.modules["0"].fw_windows[0]
    # the replay skips what the forward run twice runs (:func:`replay_skips`): no part of the machinery; the
    # host time of the skipped op calls ``skipped_ops`` is priced by :func:`round_figures`
    skipped_ms, skipped_ops = replay_skips(stats, "0")
    out = {"ops": w1 - w0, "saved": stats.modules["0"].saved_tensors[0], "skipped_ops": skipped_ops,
           "mechanism_us": (times["whole"] - times["twice"]) / blocks * 1e3 + skipped_ms * 1e3}
    if "one" in times:  # the middle region's call alone among plain layers
        out["alone_us"] = (times["one"] - times["twice_one"]) * 1e3 + replay_skips(stats, setup["alone"])[0] * 1e3
    if "none" in times:
        # the blocks are narrow: their kernels' compute is a small part of the step,
        # which is nearly all host time (a slight overestimate of the host's part)
        forward = [ms for ms, phase in zip(tl.ms, tl.phases) if phase != "backward"]
        backward = [ms for ms, phase in zip(tl.ms, tl.phases) if phase == "backward"]
        fw_ms, bw_ms = forwards["none"], times["none"] - forwards["none"]
        # each phase's ops timed alone in this round (the large model), or as traced
        kernels_ms = forwards.get("kernels", sum(forward))
        backward_kernels_ms = times["kernels"] - forwards["kernels"] if "kernels" in times else sum(backward)
        out["op_us"] = fw_ms * 1e3 / len(forward)
        out["untimed_op_us"] = untimed_us = max(0.0, (fw_ms - kernels_ms) * 1e3 / len(forward))
        out["backward_op_us"] = bw_ms * 1e3 / len(backward)
        # negative where timing an op from Python counts more than the engine pays; bounded,
        # so that kernel timings taken in a slow moment cannot make backward ops free
        out["backward_untimed_us"] = max(-0.5 * out["backward_op_us"], (bw_ms - backward_kernels_ms) * 1e3 / len(backward))
    if "casts" in times:  # every tensor the model's forward saves, packed and unpacked by the hook
        saves = stats.modules[stats.root].saved_tensors[0]
        out["cast_us"] = max(0.0, (times["casts"] - times["none"]) * 1e3 / max(1, saves))
        ac_saves, ac_casts = setup["autocast_saves"]
        remake = (times["ac_casts"] - times["ac_none"]) * 1e3 - ac_saves * out["cast_us"]
        out["remake_us"] = max(0.0, remake / max(1, ac_casts) - setup["cast_op_us"])
    if "selective" in times:  # its replay: the whole forward but the cached matmul
        kept = next(e for e in range(w0, w1) if tl.ops[e] == "addmm")
        kept_us = tl.ms[kept] * 1e3 + untimed_us
        out["selective_us"] = (times["selective"] - times["whole"]) / blocks * 1e3 + kept_us
    return out

__all__ = ["at_typical_speed", "estimate", "model_figures", "round_figures", "round_ms", "scale", "without_gaps"]
