"""The host figures :mod:`autosac.tools.calibrate` measures apart from its main
rounds: ``call_gap_us``, ``state_item_us`` and ``host_rng_us`` in rounds of their own
(:func:`apart_figures`), and ``cold_read_us_per_mib`` on a real AdamW step
(:func:`cold_read_us_per_mib`).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


def apart_figures(models: dict, x: torch.Tensor, rounds: int = 40) -> dict[str, float]:
    """``call_gap_us`` (:func:`_call_gap_round`), ``state_item_us``
    (:func:`_state_burst_us`) and ``host_rng_us`` (:func:`_host_rng_burst_us`), measured apart from the main rounds but in
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
    gap(), _state_burst_us(region, x), _host_rng_burst_us()  # warm-up
    taken = [(gap(), _state_burst_us(region, x), _host_rng_burst_us()) for _ in range(rounds)]
    roots = tiny["gap_roots"]
    extra = statistics.median(g for g, _, _ in taken)
    return {"call_gap_us": round(max(0.0, extra / roots), 3) if roots > 0 else 0.0,
            "state_item_us": round(statistics.median(s for _, s, _ in taken), 4),
            "host_rng_us": round(statistics.median(r for _, _, r in taken), 3)}


def _call_gap_round(setup: dict, x: torch.Tensor):
    """One round of ``call_gap_us`` (:meth:`HostCosts.gap_us`), made for
    ``setup``, the tiny calibration model (24 small regions, each followed
    by a transformer block): each call returns what its middle region
    checkpointed alone costs beyond each call of all of them checkpointed,
    each set against its forward run twice, in us (:func:`apart_figures`
    divides the median by the square roots of op calls more that run between
    the machinery's runs, :func:`autosac.core.host.gap_roots`: one call
    alone finds it colder).  Measured here: 9-19 us per root (the shallow
    model's six blocks, 32 roots apart against the tiny model's 65, read
    2.5-8.6 us).  The figure used: the main rounds' own estimate of it
    (:func:`autosac.tools.calibration_figures._gap_us`, 12 rounds) checks it for noise, but beside a busy
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
    swapped in for the replay as the applier does (:meth:`State.swap_in`),
    put back after -- ``repeats`` times back to back (warm: the cold part is
    in the other per-call figures)."""
    from autosac.core.pystate import capture

    args: tuple = (x,)
    t = time.thread_time()
    for _ in range(repeats):
        state = capture(region, args, {})
        state.swap_in().install()
    return (time.thread_time() - t) / repeats * 1e6 / max(1, state.items())


def _host_rng_burst_us(repeats: int = 5) -> float:
    """``host_rng_us`` in one burst: Python's and NumPy's generator states as
    a checkpointed call of a module that draws from them handles them --
    captured at its forward, captured again and swapped in for the replay,
    put back after -- ``repeats`` times back to back, per call in us."""
    from autosac.core.rng import HostRng

    t = time.thread_time()
    for _ in range(repeats):
        state = HostRng.now()
        after = HostRng.now()
        state.install()
        after.install()
    return (time.thread_time() - t) / repeats * 1e6


def cold_read_us_per_mib(small: float, large: float, tensors: int = 16, numel: int = 128 << 10,
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

__all__ = ["apart_figures", "cold_read_us_per_mib"]
