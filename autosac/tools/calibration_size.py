"""``selective_us_per_mib``: what a selectively checkpointed call's per-op
work costs more where its ops are large, measured within one step.

Timed step against step at the large size (:mod:`autosac.core.hostsize`),
such a difference drowns: a checkpointed block against the same block run
twice moved by -15 to +8.6 ms from one round to the next, on a 1-2 ms
effect.  So this measures inside one step: four large regions, two of each
kind, their kinds swapped from one model copy to the other; each region's
forward and backward timed in place (thread time, its backward from its
output's gradient to its input's).  Regions side by side see the same
moment of the machine, so the drift that swamps step-to-step differences
cancels (per round, the difference moved by about +-0.4 ms here).

Until host-costs-v28 a second figure, ``checkpoint_us_per_mib`` (a plain
call's machinery per MiB its forward's ops make), was measured the same way,
regions checkpointed whole beside regions run twice.  It read 111-128 us per
MiB in four calibrations on a VM with a 260 MiB L3 cache where the
benchmarks' real models showed none of it: re-priced without it, that VM's
suite run went from 71 to 81 of 82 rows within target, its compute-bound
plans from 2-10 points high to within 3 (the previous VM's run: 76 against
75).  What the calibration model measured there did not carry over to other
models, so it is no longer measured; :class:`~autosac.core.host.HostCosts`
still prices it where a user states it.

The selective regions are checkpointed
selectively (caching their first op, a layer norm, and recomputing the
rest) side by side with regions checkpointed whole.  Step against step (the
large calibration model checkpointed selectively against it checkpointed
whole, the cached op's traced time added back) it read 115-276 us per MiB
over calibrations here, and flipped width-256 plans between selective and
plain; in place it read -15 to +12 in a quiet moment (32 rounds, five
times: at the large size a selective call's per-op work cost what the small
calibration's ``selective_op_us`` says) and 0-200 in a busier one (8-32
rounds, its even and odd rounds apart, so flagged): noisy still, but no
longer biased by a large kernel's time added back.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn

from autosac.tools.calibration_models import _Block, _Layer

_REGIONS = 4  # large regions in the model, half checkpointed in each copy


class _Timed(nn.Module):
    """A region whose call is timed in place: its forward (run twice where
    ``twice``) and, through gradient hooks on its output and its input, its
    backward, in this thread's CPU time."""

    def __init__(self, region: nn.Module) -> None:
        super().__init__()
        self.region = region
        self.twice = False
        self.timing = False
        self.times = [0.0, 0.0, 0.0]  # forward, backward start, backward end

    def forward(self, x):
        t = time.thread_time()
        if self.twice:
            self.region(x)
        y = self.region(x)
        self.times[0] = time.thread_time() - t
        if self.timing and y.requires_grad and x.requires_grad:
            y.register_hook(self._started)
            x.register_hook(self._ended)
        return y

    def _started(self, grad):
        self.times[1] = time.thread_time()

    def _ended(self, grad):
        self.times[2] = time.thread_time()

    def seconds(self) -> float:
        return self.times[0] + self.times[2] - self.times[1]


def _copies(width: int, batch: int, seq: int,
            kinds: tuple[str, str] = ("whole", "twice")) -> tuple[dict, torch.Tensor, dict]:
    """The two model copies (the regions, children 1, 3, 5 and 7, each after a
    plain layer: 1 and 5 of the first of ``kinds`` in one copy and of the
    second in the other, 3 and 7 the other way round), the input, and the
    trace's figures of one region (``autosac.trace.profile``).  A kind is
    ``"whole"`` (checkpointed), ``"twice"`` (its forward run twice) or
    ``"selective"`` (checkpointed, caching its first op's output)."""
    import autosac.applier
    import autosac.trace
    from autosac.core.devices import DEVICES
    from autosac.core.host import HostCosts
    from autosac.solver import plan_from_decisions

    x = torch.randn(batch, seq, width)
    model = nn.Sequential(*[m for _ in range(_REGIONS) for m in (_Layer(width), _Timed(_Block(width, 1)))])
    spec = replace(DEVICES["cpu"], host=HostCosts())  # zero host costs: no calibration inside the calibration
    stats = autosac.trace.profile(model, x, target=spec, optimizer="none", output_held=False)
    timed = [str(i) for i in range(1, 2 * _REGIONS, 2)]
    groups = (timed[0::2], timed[1::2])
    copies = {}
    for k, (first, second) in enumerate((groups, groups[::-1])):
        kind_of = {**dict.fromkeys(first, kinds[0]), **dict.fromkeys(second, kinds[1])}
        plan = plan_from_decisions(stats, {f"{n}.region": 1.0 for n, kind in kind_of.items() if kind != "twice"})
        for n, kind in kind_of.items():
            if kind == "selective":
                plan.details[f"{n}.region"].save, plan.details[f"{n}.region"].skip = [0], []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = autosac.applier.apply(copy.deepcopy(model), plan)
        for n, kind in kind_of.items():
            m.get_submodule(n).twice = kind == "twice"
            m.get_submodule(n).timing = True
        copies[k] = (m, first, second, plan)
    return copies, x, {"stats": stats, "fqn": f"{timed[0]}.region"}


def _mechanism_ms(copies: dict, x: torch.Tensor, rounds: int) -> list[float]:
    """Each of ``rounds`` rounds' first-kind region's time less the
    second-kind one's, in ms (both copies, a step of each, in turn)."""
    per_round = []
    for r in range(rounds + 1):
        diffs = []
        for k in ((0, 1) if r % 2 else (1, 0)):
            m, first, second, _ = copies[k]
            m(x).sum().backward()
            t = {name: m.get_submodule(name).seconds() for name in first + second}
            diffs.append(statistics.mean(t[n] for n in first) - statistics.mean(t[n] for n in second))
        if r:  # the first round warms up
            per_round.append(statistics.mean(diffs) * 1e3)
    return per_round


class SizeFigure(NamedTuple):
    """What :func:`selective_us_per_mib` measured: the figure, the share of a core its thread had while timing
    (below :data:`autosac.core.noise.MIN_SHARE`: measured beside other work),
    and whether the medians of its even and its odd rounds agree within
    :data:`autosac.core.noise.TOLERANCE` of the call's measured cost (on a
    quiet machine here they differed by 0.05-0.2 ms on about 2.2)."""

    us_per_mib: float
    share: float
    steady: bool = True


def _measured(kinds: tuple[str, str], rounds: int) -> tuple[float, float, float, dict, dict]:
    """Over ``rounds`` rounds at the large size: the median of the first of
    ``kinds``' region's time less the second's (us), how far the medians of
    the even and the odd rounds lie apart (us), the timing thread's share of a
    core, the copies (:func:`_copies`) and the trace's figures."""
    from autosac.core.hostsize import LARGE_BATCH, LARGE_SEQ, LARGE_WIDTH
    from autosac.core.noise import share_meter

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        copies, x, traced = _copies(LARGE_WIDTH, LARGE_BATCH, LARGE_SEQ, kinds)
    share = share_meter()
    per_round = _mechanism_ms(copies, x, rounds)
    share = share()
    halves_us = abs(statistics.median(per_round[0::2]) - statistics.median(per_round[1::2])) * 1e3 \
        if len(per_round) >= 2 else 0.0
    return statistics.median(per_round) * 1e3, halves_us, share, copies, traced


def _weighted_mib(stats, fqn: str, figures: dict) -> float:
    """The MiB a region's forward ops make, each weighted as the machinery's
    per-MiB figures weigh it (:func:`autosac.core.hostsize.machinery_us`)."""
    from autosac.core.hostsize import machinery_us

    w0, w1 = stats.modules[fqn].fw_windows[0]
    small, large = figures.get("small_op_bytes", 0.0), figures.get("large_op_bytes", 0.0)
    return sum(machinery_us(b, small, large, 1.0) for b in stats.timeline.made_bytes[w0:w1])


def _host(figures: dict):
    from autosac.core.host import HostCosts

    return HostCosts(**{k: v for k, v in figures.items() if k in HostCosts.__dataclass_fields__})


def selective_us_per_mib(figures: dict, rounds: int = 8) -> SizeFigure:
    """``selective_us_per_mib`` (see the module's docstring), never below 0: what
    a selectively checkpointed call's per-op work costs beyond the small
    calibration's ``selective_op_us`` per op call, in its forward and its
    replay, per weighted MiB its forward's ops make.  ``figures``: the small
    calibration's (``selective_op_us``, ``untimed_op_us``,
    ``untimed_us_per_mib``, ``small_op_bytes``, ``large_op_bytes``).  About
    5 s on this 2-core machine.

    Example::

        >>> selective_us_per_mib(calibrate().to_dict())
        SizeFigure(us_per_mib=0.0, share=0.99, steady=True)
    """
    from autosac.core.noise import TOLERANCE

    diff_us, halves_us, share, _, traced = _measured(("selective", "whole"), rounds)
    stats, fqn = traced["stats"], traced["fqn"]
    w0, w1 = stats.modules[fqn].fw_windows[0]
    tl = stats.timeline
    # the selective replay does not run the cached op, which the whole one does: its time added back
    cached_us = _host(figures).op_ms(tl.ms[w0], "cpu", timed=True, nbytes=tl.made_bytes[w0]) * 1e3
    measured_us = diff_us + cached_us  # both passes' per-op work
    mib = _weighted_mib(stats, fqn, figures)
    rate = round(max(0.0, (measured_us / 2 - (w1 - w0) * figures["selective_op_us"]) / mib), 3) if mib > 0 else 0.0
    return SizeFigure(rate, share, halves_us <= TOLERANCE * abs(measured_us))


__all__ = ["SizeFigure", "selective_us_per_mib"]
