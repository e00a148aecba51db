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
  right after another (:func:`autosac.tools.calibration_figures._gap_us`); eager, a CPU target's.
  ``checkpoint_call_us`` and ``saved_tensor_us`` are a call's with no gap.
* ``state_item_us``: each container and entry of Python state a
  checkpointed call captures, swaps in for its replay and puts back
  (:mod:`autosac.core.pystate`; :func:`autosac.tools.calibration_apart._state_burst_us`): a transformers
  block's attributes and config cost more than a small block's.
* ``host_rng_us``: Python's and NumPy's generator states, which a
  checkpointed call of a module whose forward draws from them captures,
  swaps in for its replay and puts back (:class:`autosac.core.rng.HostRng`;
  :func:`autosac.tools.calibration_apart._host_rng_burst_us`).

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

Here: the cache and the noise policy, the micro-benchmark's rounds
(:func:`_measure`); from timed rounds to figures,
:mod:`autosac.tools.calibration_figures`; the figures timed apart,
:mod:`autosac.tools.calibration_apart`.

This module measures the applier (stage 3) for the trace (stage 1): it imports
the pipeline only inside :func:`calibrate`, and no stage imports it back but
the trace, for its figures.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import time
import warnings
from typing import NamedTuple

import torch

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
from autosac.tools.calibration_apart import apart_figures, cold_read_us_per_mib
from autosac.tools.calibration_figures import estimate, scale, without_gaps
from autosac.tools.calibration_history import median_costs, recalled, remember
from autosac.tools.calibration_models import _Block, _calibration_models, _gap_roots, _large_models, _tiny
from autosac.tools.calibration_size import selective_us_per_mib

_CALIBRATED: HostCosts | None = None


class Measured(NamedTuple):
    """What :func:`_measure` found: the figures, why they are noisy (empty:
    clean), after how many rounds, and whether the machine was seen busy (its
    thread short of a core, other processes on the cores it needed) -- noisy
    without that, the figures only did not settle (on a quiet 2-core VM, 5 of
    5 calibrations of the 24th session: each one's figures drift between rounds)."""

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
    own samples, then each figure's median over the rounds (:func:`autosac.tools.calibration_figures.estimate`);
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
        "this machine's host costs did not measure cleanly", "; ".join(got.noisy), got.rounds,
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
    they were not measured cleanly (a busy or drifting machine); None where they are clean or none
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
    against = functools.partial(scale, gap_roots=models["tiny"]["gap_roots"])
    got = steady(lambda: _take_round(variants, inputs, kernels=kernels), lambda taken: estimate(models, taken), against,
                 rounds=rounds, max_rounds=max_rounds, deadline_s=deadline_s)
    reasons, busy = [], []
    if got.disagreeing:
        reasons.append(f"{', '.join(got.disagreeing)} varied by more than {TOLERANCE:.0%} between rounds")
    if got.share < MIN_SHARE:
        busy.append(f"the measuring thread had {got.share:.0%} of a core")
    cores, threads = others(), torch.get_num_threads()
    if contended(threads, cores):
        busy.append(f"other processes kept {cores:.1f} of {os.cpu_count()} cores busy beside {threads} torch threads")
    figures = {**got.figures, **apart_figures(models, inputs[("shallow", "none")])}
    figures = without_gaps(figures, models)
    if figures.get("large_op_bytes"):
        figures["cold_read_us_per_mib"] = cold_read_us_per_mib(figures["small_op_bytes"], figures["large_op_bytes"])
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
