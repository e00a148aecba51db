"""What the host -- the CPU running Python -- spends on a training step besides
the kernels, and what checkpointing adds to it.

On a fast GPU an eager step is often bound by the host: every op costs Python,
autograd and dispatcher time before its kernel launches, and a short kernel
finishes before the next op is issued.  Checkpointing adds host work of its
own, whatever the kernels cost:

* ``op_us``: one eager op call in the forward (the loss and the optimizer
  step too), Python, autograd and the dispatcher included: the module code
  between ops is in it.  On a GPU it overlaps the kernels (an op costs the
  longer of its kernel and this); on a CPU target priced by a roofline it
  adds to them.
* ``backward_op_us``: one op call the autograd engine makes in the backward:
  no Python runs between them, so they cost the host less (about 12 against
  21 us here).  ``None``: ``op_us``.
* ``untimed_op_us``: the part of a forward op's host time that timing the op
  alone does not see (autograd, module Python): what each forward op adds to
  its measured time on a CPU target whose ops are timed for real
  (``target="cpu"``).
* ``backward_untimed_us``: the same for a backward op, which may be negative:
  timing an op by calling it from Python counts a dispatch the engine does
  not pay.  ``None``: ``untimed_op_us``.
* ``checkpoint_call_us``: one checkpointed call, forward and backward
  together, beyond re-running its ops: ``torch.utils.checkpoint``'s frame,
  RNG state, and autosac's state swap around the replay (a module recomputed
  whole takes this path);
* ``saved_tensor_us``: each tensor autograd saves inside a checkpointed call:
  the checkpoint's saved-tensor hooks pack it in the forward and in the
  recompute and unpack it in the backward.
* ``selective_op_us``: each op call inside a selectively checkpointed call
  (some outputs cached, some recomputed), in the forward and again in the
  recompute: autosac's dispatch mode and its per-call checks.
* ``untimed_us_per_mib``, ``backward_untimed_us_per_mib`` (with
  ``small_op_bytes``, ``large_op_bytes`` and ``largest_op_bytes``): where
  the kernels run on this CPU, what an op making large data adds to
  ``untimed_op_us`` and ``backward_untimed_us`` per MiB it makes, up to the
  large calibration's largest op (:mod:`autosac.core.hostsize`).
* ``selective_us_per_mib``: where the kernels run on this CPU, what a
  selective call's per-op work costs more per MiB its forward's ops make:
  its Python runs cache-cold after large kernels; measured inside one step
  at the large size, regions side by side (:mod:`autosac.tools.calibration_size`).
  ``checkpoint_us_per_mib``, the same for a plain call's machinery, is no
  longer measured (0; priced where a user states it): the calibration model's
  figure did not carry over to real models (that module says how).
* ``cold_read_us_per_mib``: where the kernels run on this CPU, what an
  optimizer's foreach op adds per MiB it reads that the foreach op before it
  did not touch (:mod:`autosac.core.coldread`).
* ``cast_hook_us``: each tensor autograd saves outside checkpointed calls in a
  plan with parameter casts (autocast): the model-wide saved-tensor hook that
  keeps casts from being saved (:mod:`autosac.applier.casts`) packs it in the
  forward and unpacks it in the backward, with or without a plan's regions.
* ``cast_remake_us``: each parameter cast that hook packs as its parameter
  and makes again in the backward, beyond a tensor's ``cast_hook_us`` and
  the cast op itself, which plans price as an op (measured under CPU autocast).
* ``call_gap_us``: what a checkpointed call costs more, where it runs the
  machinery (its forward start and its replay), per square root of the op
  calls run since the machinery last ran (:func:`autosac.core.host.gap_roots`):
  its code and data go cold in between, so a call alone costs more than one
  right after another (:func:`_gap_us`); eager, a CPU target's.
  ``checkpoint_call_us`` and ``saved_tensor_us`` are a call's with no gap.
* ``state_item_us``: each container and entry of Python state a
  checkpointed call captures, swaps in for its replay and puts back
  (:mod:`autosac.core.pystate`; :func:`_state_burst_us`): a transformers
  block's attributes and config cost more than a small block's.

:func:`calibrate` measures them on this machine with a micro-benchmark
(small transformer blocks run plain, with each forward run twice,
checkpointed whole and checkpointed selectively through autosac's own
applier: each figure a difference of measured times), once per machine: the
figures are cached with the CPU op timings (:mod:`autosac.trace.timings`).
Measured on a busy machine they are retried and, where they never settle,
kept an hour only (:mod:`autosac.core.noise`), each figure the median over
the last five such calibrations (:mod:`autosac.tools.calibration_history`);
:func:`remeasure` or
``AUTOSAC_REMEASURE=1`` measure them again.  A plan for another host
states its figures: ``DeviceSpec(..., host=HostCosts(op_us=..., ...))``.

This module measures the applier (stage 3) for the trace (stage 1): it imports
the pipeline only inside :func:`calibrate`, and no stage imports it back but
the trace, for its figures.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import statistics
import time
import warnings
from typing import NamedTuple

import torch
from torch import nn

from autosac.core.cache import machine_lock
from autosac.core.host import (  # noqa: F401 - the data, kept importable here as before
    _FIELDS,
    _PER_OP,
    _SIGNED,
    CACHE_KEY,
    NOISY_KEY,
    SIGNED_CACHE_KEYS,
    HostCosts,
    host_costs,
    register_calibration,
)
from autosac.core.noise import (
    MIN_SHARE,
    NOISY_LIFETIME_S,
    TOLERANCE,
    contended,
    others_meter,
    remeasure_requested,
    share_meter,
    steady,
)
from autosac.tools.calibration_history import median_costs, recalled, remember
from autosac.tools.calibration_models import _Block, _calibration_models, _gap_roots, _large_models, _tiny, replay_skips
from autosac.tools.calibration_size import selective_us_per_mib

_CALIBRATED: HostCosts | None = None


class Measured(NamedTuple):
    """What :func:`_measure` found: the figures, why they are noisy (empty:
    clean), after how many rounds, and whether the machine was seen busy (its
    thread short of a core, other processes on the cores it needed) -- noisy
    without that, the figures only did not settle (on a quiet 2-core VM, 4 of
    4 calibrations of the 24th session: each one's figures drift between rounds)."""

    costs: HostCosts
    noisy: tuple[str, ...] = ()
    rounds: int = 0
    busy: bool = False


def calibrate(force: bool = False) -> HostCosts:
    """This machine's :class:`HostCosts`, measured once and cached (on disk
    with the CPU op timings, in memory for the process).

    The micro-benchmark, on a 2x32 batch of width 64, forward and backward:
    6 regions of one small pre-norm transformer block (attention and MLP)
    timed plain, with every region checkpointed whole, and with every region
    checkpointed selectively (its first matmul cached, the rest recomputed);
    6 regions of three such blocks and 24 regions of one Linear each (two
    sizes of checkpointed call, which tell the per-call cost from the
    per-saved-tensor one), checkpointed whole, and the tiny model's middle
    region checkpointed alone (``call_gap_us``); each model also with each
    region's forward run twice (what a checkpoint re-runs, without its
    machinery); and the shallow model again at width 256 (4x128, two regions),
    for the per-MiB figures (:mod:`autosac.core.hostsize`).  Rounds of one
    CPU-time sample of each variant in turn; each round's figures from its
    own samples, then each figure's median over the rounds (:func:`_estimate`);
    then, apart, the per-MiB machinery figure inside one step
    (:mod:`autosac.tools.calibration_size`, about 5 s); 25-35 s on this
    2-core machine.

    On a busy machine (:mod:`autosac.core.noise`): while the figures of the even
    and the odd rounds differ by more than 10 %, or the measuring thread had
    less than 90 % of a core, the rounds are doubled, from 12 up to 48 rounds
    or about 20 s.  Figures that never settled, or were measured with several torch
    threads while other processes kept the cores they needed busy, are noisy:
    where this machine's figures were measured clean before, those are kept;
    else each figure's median over the last five noisy calibrations (this
    one's included) is used, with one logged warning, and kept on disk for
    an hour only.  ``force=True``, ``AUTOSAC_REMEASURE=1``
    or :func:`remeasure` measure them again.  Processes sharing a cache
    directory measure one at a time (:func:`autosac.core.cache.machine_lock`):
    a second waits and takes the first one's figures from disk.

    Example::

        >>> autosac.tools.calibrate.calibrate()
        HostCosts(op_us=11.9, checkpoint_call_us=440.0, saved_tensor_us=38.3, selective_op_us=24.9, untimed_op_us=4.6)
    """
    global _CALIBRATED
    if _CALIBRATED is not None and not force:
        return _CALIBRATED
    from autosac.trace.timings import TimingCache

    cache = TimingCache()
    again = force or remeasure_requested()
    cached = None if again else _cached(cache)
    if cached is None:
        # one process of this machine measures at a time: a second one (another rank, another
        # test worker) waits, then takes the first one's figures from disk
        with machine_lock("host-costs") as held:
            if held and not again:
                cache.refresh(f"{CACHE_KEY}:")
                cached = _cached(cache)
            if cached is None:
                cached = _measured(cache)
    _CALIBRATED = cached
    return cached


def _measured(cache, measure=None) -> HostCosts:
    """The figures :func:`_measure` (or ``measure``, a stand-in: the test
    suite's stated figures) takes now, settled (:func:`_settled`) and written to ``cache``."""
    try:
        got = (measure or _measure)()
    except Exception as e:  # noqa: BLE001 - a plan priced by its kernels alone beats no plan
        warnings.warn(f"autosac: could not measure this host's costs ({type(e).__name__}: {e}); plans are priced "
                      "by their kernels alone -- state them with DeviceSpec(host=HostCosts(...))", stacklevel=4)
        return HostCosts()
    if isinstance(got, HostCosts):  # a stand-in measurement (tests): clean
        got = Measured(got)
    costs, clean = _settled(cache, got)
    for name, value in costs.to_dict().items():
        cache.put(f"{CACHE_KEY}:{name}", value)
        if not got.noisy:  # the last clean figures, which a noisy measurement later does not replace
            cache.put(f"{_CLEAN}{name}", value)
    cache.put(NOISY_KEY, time.time() + NOISY_LIFETIME_S if got.noisy and clean is None else 0.0)
    cache.save()
    return costs


_CLEAN = f"{CACHE_KEY}:clean:"  # the last figures measured on a quiet machine


def _settled(cache, got: Measured) -> tuple[HostCosts, HostCosts | None]:
    """The figures to use after measuring ``got``, and the clean ones kept
    from before (None: none, or ``got`` is clean).  Noisy: the clean ones
    where there are some, else each figure's median over the last noisy
    calibrations, ``got``'s included (:mod:`autosac.tools.calibration_history`),
    with one logged line -- not a warning: a busy machine is no error a
    warnings filter should raise."""
    if not got.noisy:
        return got.costs, None
    clean = _cached(cache, prefix=_CLEAN)
    kept: list[HostCosts] = []
    if clean is None:
        remember(cache, got.costs)
        kept = recalled(cache) or [got.costs]
    logging.getLogger("autosac").warning(
        "autosac: %s (%s, after %d rounds): %s",
        "this machine was busy while measuring its host costs" if got.busy else
        "this machine's host costs did not settle while measuring them", "; ".join(got.noisy), got.rounds,
        "the figures measured on a quiet machine before are kept" if clean is not None else
        f"plans use each figure's median over the last {len(kept)} such measurements, and they are measured "
        f"again after {NOISY_LIFETIME_S / 3600:g} h, or at once with AUTOSAC_REMEASURE=1 or "
        "autosac.tools.calibrate.remeasure()")
    return (clean, clean) if clean is not None else (median_costs(kept), None)


def _cached(cache, prefix: str = f"{CACHE_KEY}:") -> HostCosts | None:
    """The host figures in ``cache`` (the last clean ones with ``prefix=_CLEAN``),
    or None: missing, refused by :class:`HostCosts`, or measured under noise and expired."""
    found = {f: cache.get(f"{prefix}{f}") for f in _FIELDS}
    if any(v is None for v in found.values()):
        return None
    noisy_until = 0.0 if prefix == _CLEAN else cache.get(NOISY_KEY)
    if noisy_until is None:
        return None
    if noisy_until and not 0 <= noisy_until - time.time() <= NOISY_LIFETIME_S:  # expired (or a clock gone back)
        return None
    try:
        return HostCosts(**found)
    except ValueError:  # a figure HostCosts refuses: measured again
        return None


def noisy_until() -> float | None:
    """When this machine's cached host figures expire (epoch seconds) where
    they were measured on a busy machine; None where they are clean or none
    are cached."""
    from autosac.trace.timings import TimingCache

    until = TimingCache().get(NOISY_KEY)
    return until or None


def remeasure(ops: bool = True) -> HostCosts:
    """Measure this machine's host figures again now (and rewrite the cache);
    with ``ops``, also forget its cached CPU op timings and roofline, which
    the next profile with ``target="cpu"`` measures again.  For figures taken
    while the machine was busy.  ``AUTOSAC_REMEASURE=1`` does the same for
    one process, lazily.

    Example::

        >>> autosac.tools.calibrate.remeasure()
        HostCosts(op_us=11.9, ...)
    """
    if ops:
        from autosac.trace import costs
        from autosac.trace.timings import TimingCache

        TimingCache().forget()
        costs.local_cpu_spec.cache_clear()
    return calibrate(force=True)


def measure_once() -> HostCosts:
    """One calibration's figures, measured now: neither cached nor combined
    with earlier calibrations (:func:`calibrate` does both).  For comparing
    calibrations with each other (``benchmarks/reprice_suite.py``); a
    plan uses :func:`calibrate`'s.  25-40 s on a 2-core machine.

    Example::

        >>> spread = [autosac.tools.calibrate.measure_once() for _ in range(3)]
    """
    return _measure().costs


def _measure(regions: int = 6, width: int = 64, batch: int = 2, seq: int = 32, rounds: int = 12,
             max_rounds: int = 48, deadline_s: float = 20.0) -> Measured:
    """This machine's figures (see :func:`calibrate`), measured until two
    halves of the rounds agree (:func:`autosac.core.noise.steady`), bounded.
    The models' op timings are taken again first (:func:`autosac.trace.timings.retimed`):
    the figures are measured steps less those timings, which must be of the
    same minute (cached ones from an hour before, on this VM, gave
    ``untimed_us_per_mib`` 110-481 where timings taken anew gave 0-179), and
    the large model's, whose step is mostly kernels, are timed again in each
    round (:class:`~autosac.tools.calibration_models.StepKernels`): over
    seven calibrations each, ``untimed_us_per_mib`` read 158-305 (six of
    them 158-250) against 0-254 with the timings taken before the rounds;
    the backward's, timed before the rounds, left ``backward_untimed_us_per_mib``
    at 0-259."""
    from autosac.trace.timings import retimed

    with retimed():
        models, variants, inputs = _benchmark(regions, width, batch, seq)
    kernels = models["large"].get("kernels")
    _take_round(variants, inputs, kernels=kernels)  # warm-up
    others = others_meter()
    scale = functools.partial(_scale, gap_roots=models["tiny"]["gap_roots"])
    got = steady(lambda: _take_round(variants, inputs, kernels=kernels), lambda taken: _estimate(models, taken), scale,
                 rounds=rounds, max_rounds=max_rounds, deadline_s=deadline_s)
    reasons, busy = [], []
    if got.disagreeing:
        reasons.append(f"{', '.join(got.disagreeing)} varied by more than {TOLERANCE:.0%} between rounds")
    if got.share < MIN_SHARE:
        busy.append(f"the measuring thread had {got.share:.0%} of a core")
    cores, threads = others(), torch.get_num_threads()
    if contended(threads, cores):
        busy.append(f"other processes kept {cores:.1f} of {os.cpu_count()} cores busy beside {threads} torch threads")
    figures = {**got.figures, **_apart_figures(models, inputs[("shallow", "none")])}
    figures = _without_gaps(figures, models)
    if figures.get("large_op_bytes"):
        figures["cold_read_us_per_mib"] = _cold_read_us_per_mib(figures["small_op_bytes"], figures["large_op_bytes"])
        figures["selective_us_per_mib"] = _size_figure("selective_us_per_mib", selective_us_per_mib, figures, reasons,
                                                       busy)
    return Measured(HostCosts(**figures), (*reasons, *busy), got.rounds, busy=bool(busy))


def _size_figure(name: str, measure, figures: dict, reasons: list[str], busy: list[str]) -> float:
    """A per-MiB machinery figure measured in place (:mod:`autosac.tools.calibration_size`),
    with why it is noisy added to ``reasons`` (to ``busy``: its thread short of a core);
    0 where it could not be measured."""
    try:
        size = measure(figures)
    except Exception as e:  # noqa: BLE001 - one figure lost, not every figure: priced without it
        reasons.append(f"{name} could not be measured ({type(e).__name__}: {e})")
        return 0.0
    if 0 < size.share < MIN_SHARE:  # its rounds are its own: beside other work it read 0-150 us/MiB, 102-115 alone
        busy.append(f"the thread timing {name} had {size.share:.0%} of a core")
    if not size.steady:
        reasons.append(f"{name}'s even and odd rounds differed by more than {TOLERANCE:.0%}")
    return size.us_per_mib


def _benchmark(regions: int = 6, width: int = 64, batch: int = 2, seq: int = 32) -> tuple[dict, dict, dict]:
    """The micro-benchmark (see :func:`calibrate`): its models by size, every
    variant to time keyed (size, variant), and each variant's input."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        x = torch.randn(batch, seq, width)
        models = {
            "shallow": _calibration_models(lambda: _Block(width, 1), regions, x, selective=True, casts=True),
            "deep": _calibration_models(lambda: _Block(width, 3), regions, x),
            "tiny": _calibration_models(lambda: _tiny(width), 4 * regions, x, alone=True),
        }
        models["large"], x_large = _large_models()
    tiny = models["tiny"]
    # how many more roots of gap the lone call's machinery runs at than each call of all of them
    tiny["gap_roots"] = _gap_roots(tiny, [tiny["alone"]]) - _gap_roots(tiny, tiny["regions"]) / tiny["blocks"]
    # rounds interleaved across the models: drift hits them alike
    variants = {(size, k): m for size, setup in models.items() for k, m in setup["variants"].items()}
    inputs = {key: x_large if key[0] == "large" else x for key in variants}
    return models, variants, inputs


def _apart_figures(models: dict, x: torch.Tensor, rounds: int = 40) -> dict[str, float]:
    """``call_gap_us`` (:func:`_call_gap_round`) and ``state_item_us``
    (:func:`_state_burst_us`), measured apart from the main rounds but in
    rounds of their own, one sample of each per round: on this VM the same
    work ran at two speeds, 1.6-2x apart, switching every few seconds (a
    Python loop 2.5-5.5 ms, a small model's step 4.3-11 ms over three
    minutes, ``benchmarks/machine_drift.py``), so a figure timed in one
    burst of a second read one speed (``state_item_us`` 0.24-0.42 us over
    five calibrations of one hour, the other figures as the main rounds'
    mix); spread over the rounds, each is the median over the same mix."""
    tiny, deep = models["tiny"], models["deep"]
    gap = _call_gap_round(tiny, x)
    region = deep["variants"]["twice"][0].region
    gap(), _state_burst_us(region, x)  # warm-up
    taken = [(gap(), _state_burst_us(region, x)) for _ in range(rounds)]
    roots = tiny["gap_roots"]
    extra = statistics.median(g for g, _ in taken)
    return {"call_gap_us": round(max(0.0, extra / roots), 3) if roots > 0 else 0.0,
            "state_item_us": round(statistics.median(s for _, s in taken), 4)}


def _call_gap_round(setup: dict, x: torch.Tensor):
    """One round of ``call_gap_us`` (:meth:`HostCosts.gap_us`), made for
    ``setup``, the tiny calibration model (24 small regions, each followed
    by a transformer block): each call returns what its middle region
    checkpointed alone costs beyond each call of all of them checkpointed,
    each set against its forward run twice, in us (:func:`_apart_figures`
    divides the median by the square roots of op calls more that run between
    the machinery's runs, :func:`autosac.core.host.gap_roots`: one call
    alone finds it colder).  Measured here: 9-19 us per root (the shallow
    model's six blocks, 32 roots apart against the tiny model's 65, read
    2.5-8.6 us).  The figure used: the main rounds' own estimate of it
    (:func:`_gap_us`, 12 rounds) checks it for noise, but beside a busy
    machine it read 29-38 us and left ``checkpoint_call_us`` 0."""
    import copy

    blocks, made = setup["blocks"], setup["variants"]  # copies of the rounds' variants: their own warm state
    variants = {"all": copy.deepcopy(made["whole"]), "twice_all": copy.deepcopy(made["twice"]),
                "one": copy.deepcopy(made["one"]), "twice_one": copy.deepcopy(made["twice_one"])}

    def step(k: str) -> float:  # as the main rounds: forward and backward, no optimizer (as the trace)
        t = time.thread_time()
        variants[k](x).sum().backward()
        variants[k].zero_grad(set_to_none=True)
        return (time.thread_time() - t) * 1e6

    def one_round() -> float:  # each round's own difference: the VM's drift moves a round's variants alike
        t = {k: step(k) for k in variants}
        return (t["one"] - t["twice_one"]) - (t["all"] - t["twice_all"]) / blocks

    return one_round


def _state_burst_us(region, x: torch.Tensor, repeats: int = 25) -> float:
    """``state_item_us`` in one burst: what a checkpointed call's Python state
    costs per item (:meth:`autosac.core.pystate.State.items`), timed on a
    calibration model's ``region`` -- captured at its forward, captured
    again and swapped in for the replay, put back after -- ``repeats`` times
    back to back (warm: the cold part is in the other per-call figures)."""
    from autosac.core.pystate import capture

    args: tuple = (x,)
    t = time.thread_time()
    for _ in range(repeats):
        state = capture(region, args, {})
        after = state.recapture()
        state.install()
        after.install()
    return (time.thread_time() - t) / repeats * 1e6 / max(1, state.items())


# the most of the tiny model's each-of-all call its gap may take: more leaves no fixed cost, a split
# only noise gives (a machine busy beside the calibration read call_gap_us 38 us, checkpoint_call_us 0)
_GAP_SHARE = 0.9


def _without_gaps(figures: dict, models: dict) -> dict:
    """``checkpoint_call_us`` and ``saved_tensor_us`` as a call costs with no
    op calls between it and the machinery's last run and no Python state to
    capture: the rounds fit them to the tiny and the deep model's calls
    (:func:`_round_figures`), each at its own gaps and with its own state;
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


def _cold_read_us_per_mib(small: float, large: float, tensors: int = 16, numel: int = 128 << 10,
                          rounds: int = 9) -> float:
    """``cold_read_us_per_mib`` (:mod:`autosac.core.coldread`): a real AdamW
    step over ``tensors`` parameters of ``numel`` floats (8 MiB), timed after
    writing a 128 MiB buffer (as a step's forward and backward pass through
    the caches: at width 256 they write 80-145 MiB here, the built-in Llama
    and transformers Qwen3) against run back to back (as the op timings call the ops),
    per share-weighted MiB :class:`autosac.core.coldread.ColdReads` counts in
    the ops it calls; medians of ``rounds``."""
    import statistics

    from torch.utils._python_dispatch import TorchDispatchMode

    from autosac.core.coldread import ColdReads
    from autosac.core.hostsize import MIB
    from autosac.core.optim import make_optimizer

    params = [nn.Parameter(torch.rand(numel)) for _ in range(tensors)]
    opt = make_optimizer("adamw", params)
    evict = torch.empty(128 * MIB, dtype=torch.uint8)
    counted = ColdReads()
    mib = [0.0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            mib[0] += counted.mib(func, args, kwargs or {}, out, small, large)
            return out

    def step(cold: bool) -> float:
        for p in params:
            p.grad = torch.rand_like(p)
        if cold:
            evict.fill_(1)
        t = time.thread_time()
        opt.step()
        return time.thread_time() - t

    step(False)
    with Count():
        step(False)
    cold, hot = [], []
    for _ in range(rounds):
        cold.append(step(True))
        hot.append(min(step(False) for _ in range(3)))
    extra_us = (statistics.median(cold) - statistics.median(hot)) * 1e6
    return round(max(0.0, extra_us / mib[0]), 3) if mib[0] > 0 else 0.0


def _estimate(models: dict, taken: list[dict]) -> dict[str, float]:
    """The figures over the rounds ``taken``: each round's figures from the
    least sample of each variant in it (:func:`_round_figures`), then each
    figure's median over the rounds.  On this 2-core VM a step's time
    drifts by 20-40 % over seconds, alike for the variants run next to each
    other (lag-one correlation 0.55, between two variants 0.73): the least
    time of each variant over all rounds came from different moments, and
    figures made of their differences moved by up to 2x between
    calibrations; a difference within one round, then the median, moved by
    about 5 %.  A median is also what a step costs as measured (medians of
    steps), where the least is one lucky moment.  Each round's figures are
    first brought to the rounds' typical speed (:func:`_at_typical_speed`)."""
    per_round = _at_typical_speed([_round_figures(models, samples) for samples in taken],
                                  [_round_ms(samples) for samples in taken])
    return {k: round(statistics.median(f[k] for f in per_round), 3) for k in per_round[0]}


def _round_ms(samples: dict) -> float:
    """A round's speed: the sum over its variants of each one's least step (ms)."""
    return sum(min(s[1] for s in v) for v in samples.values())


def _at_typical_speed(per_round: list[dict], round_ms: list[float]) -> list[dict]:
    """Each round's time figures scaled by the rounds' median ``round_ms`` over
    its own (byte figures as they are): this VM runs the same work at two
    speeds 1.6-2x apart, switching every few seconds
    (``benchmarks/machine_drift.py``), so a round is mostly at one of them,
    and the figures' medians were a mix that moved between calibrations --
    the figures of one calibration then no longer fit each other."""
    typical = statistics.median(round_ms)
    return [{k: v if k.endswith("_bytes") else v * typical / ms for k, v in f.items()}
            for f, ms in zip(per_round, round_ms)]


def _round_figures(models: dict, samples: dict) -> dict[str, float]:
    """One round's figures from the least sample of each of its variants."""
    least = {k: min(s[1] for s in v) for k, v in samples.items()}
    least_fw = {k: min(s[0] for s in v) for k, v in samples.items()}
    got = {size: _figures(setup, {k: t for (s, k), t in least.items() if s == size},
                          {k: t for (s, k), t in least_fw.items() if s == size})
           for size, setup in models.items()}
    shallow, deep, tiny, large = got["shallow"], got["deep"], got["tiny"], got.get("large")
    for f in (deep, tiny):  # the host time of the op calls a replay skips (see _figures)
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


def _scale(figures: dict[str, float], name: str, gap_roots: float = 0.0) -> float:
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


def _figures(setup: dict, times: dict[str, float], forwards: dict[str, float]) -> dict:
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
    # host time of the skipped op calls ``skipped_ops`` is priced by :func:`_round_figures`
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


def _take_round(variants: dict, x: torch.Tensor, repeats: int = 1, kernels=None) -> dict:
    """One round: ``repeats`` passes over the variants, one (forward ms,
    forward-and-backward ms) sample of each per pass (on ``x``, or
    ``x[name]`` where it is a dict) -- variants a figure compares run moments
    apart -- and, with ``kernels`` (:class:`~autosac.tools.calibration_models.StepKernels`),
    the large model's forward ops, then those and its backward's, timed alone
    (``("large", "kernels")``, as a step's two samples), in
    CPU time of this thread (the calibration's ops are too small to run on
    other threads, and another process's time slices are not counted), and
    the share of a core the thread had meanwhile."""
    tick = time.thread_time
    share = share_meter()

    def step(m, x) -> tuple[float, float]:
        t0 = tick()
        loss = m(x).sum()
        t1 = tick()
        loss.backward()
        m.zero_grad(set_to_none=True)
        return (t1 - t0) * 1e3, (tick() - t0) * 1e3

    samples = {name: [] for name in variants}
    collecting = gc.isenabled()
    gc.disable()  # a collection of the whole heap inside one timed step is no host cost of it (as timeit)
    try:
        for _ in range(repeats):
            for name, m in variants.items():
                for _ in range(_SAMPLES.get(name, 1)):
                    samples[name].append(step(m, x[name] if isinstance(x, dict) else x))
            if kernels is not None:
                fw_ms, bw_ms = kernels.ms()
                samples.setdefault(("large", "kernels"), []).append((fw_ms, fw_ms + bw_ms))
    finally:
        if collecting:
            gc.enable()
    return samples, share()


# variants sampled more than once a round (the least taken): the lone call's figure is one call's
# difference on a 10 ms step, where the others are six or more calls'
_SAMPLES = {("tiny", "one"): 5, ("tiny", "twice_one"): 5}


__all__ = ["HostCosts", "calibrate", "host_costs", "measure_once", "noisy_until", "remeasure"]

# a target that states no host figures is priced with this machine's: measured here, asked for by the data module
register_calibration(calibrate)
