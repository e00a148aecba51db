"""How the host's per-op time grows with the size of the ops' data, on a CPU
target (:mod:`autosac.tools.calibrate`).

Where the kernels run on the CPU, an op whose data is large (hundreds of KiB
and more) evicts the caches: the Python, autograd and dispatcher work of the
ops around it runs cache-cold, and the op's own output lands in memory the
step has not touched lately.  Timing each op alone, on the same memory over
and over, sees neither.  Measured on this 2-core machine, at width 256
(outputs of 0.5-2 MiB) a forward op cost 33 us beyond its own timing, 4 us
at width 64.  Priced at the small figures, compute-bound steps were
predicted 25-35 % short (``benchmarks/predict_suite.py``).

:func:`autosac.tools.calibrate.calibrate` therefore runs its micro-benchmark at two
sizes: the small one gives the host figures, the large one how much more
an op costs per MiB it makes (:func:`extra_us`; an op writing in place
makes nothing: AdamW's foreach ops pay for what they read cold instead,
:mod:`autosac.core.coldread`).  An op
between the two sizes pays a share of that, by the logarithm of its bytes
(:func:`share`); ops no larger than the small calibration's pay nothing
more, ops larger than the large calibration's largest op what that one
does (:func:`op_extra_us`; the checkpointing machinery's extra stops at its
typical op, :func:`machinery_us`).  The op figures are fitted so that the large
calibration model is priced what it measured (:func:`fit_extras`); a
selective call's (``selective_us_per_mib``) is measured with regions side
by side in one step (:mod:`autosac.tools.calibration_size`), a plain call's
(``checkpoint_us_per_mib``) only priced where stated.
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_leaves

from autosac.core.dataflow import arg_storages, storage_of
from autosac.core.opkinds import is_view_op, writes_input

# the large calibration: a step of compute-bound size (outputs of 0.5-2 MiB per op)
LARGE_WIDTH, LARGE_BATCH, LARGE_SEQ, LARGE_REGIONS = 256, 4, 128, 2


MIB = 1 << 20


def extra_us(nbytes: float, small: float, large: float, us_per_mib: float) -> float:
    """What an op making ``nbytes`` adds to a per-op host figure: ``us_per_mib``
    per MiB it makes, times its :func:`share`."""
    return share(nbytes, small, large) * nbytes / MIB * us_per_mib if us_per_mib else 0.0


def machinery_us(nbytes: float, small: float, large: float, us_per_mib: float) -> float:
    """What an op making ``nbytes`` adds to the checkpointing machinery's
    per-call figure: as :func:`extra_us`, but an op larger than the large
    calibration's typical op (``large``) adds what that one does.  The
    machinery's extra is Python, dispatcher and autograd work run after the
    op's kernel, cold once the kernel has evicted the caches: more bytes do
    not make it colder (an op's own extra, mostly its kernel on cold data,
    runs on further: :func:`op_extra_us`).  Priced per MiB without that cap, a selective region
    around transformers GPT-2's tanh GELU (eight elementwise ops making 2 MiB
    each at width 256) came to 5.2 ms of machinery, where the ViTs' regions
    around an exact GELU (one op) were priced 1.8 ms; transformers Phi's MLP
    forward was priced 14.2 ms and ran 9.9 (its 2 MiB elementwise ops 10-164
    us over their kernels alone, priced 321 us each); and a width-4096
    model's 64 MiB ops would pay 64 times the calibrated figure each
    (docs/step-time-history.md)."""
    return extra_us(min(nbytes, large), small, large, us_per_mib)


def op_extra_us(nbytes: float, small: float, large: float, largest: float, us_per_mib: float) -> float:
    """What an op making ``nbytes`` adds to its own per-op host figure: as
    :func:`extra_us`, up to the large calibration's largest op (``largest``
    bytes; 0: its typical op, ``large``), beyond which the figure was not
    measured.  The extra is mostly the op's kernel run on data the step let
    go cold, 30-60 us per MiB it reads and writes (each op timed in the step
    and alone in the same round: ``benchmarks/op_extras.py``).  Capped at the
    typical op, as the machinery is, the large calibration's 1-2 MiB matmuls
    and GELU weighed as 0.74 MiB ops: the fitted figure came to 250 us per
    MiB against 150 uncapped, and Llamas, whose ops are mostly 0.25-0.5 MiB,
    were priced 40-55 % over what their forwards and backwards spent beyond
    their kernels (within 7 % uncapped)."""
    return extra_us(min(nbytes, largest or large), small, large, us_per_mib)


def share(nbytes: float, small: float, large: float) -> float:
    """The share (0 to 1) of the large calibration's extra per-op cost an op
    making ``nbytes`` pays: 0 up to ``small`` bytes, 1 from ``large`` on,
    linear in log(bytes) between; 0 where no large figures were measured."""
    if nbytes <= small or small <= 0 or large <= small:
        return 0.0
    if nbytes >= large:
        return 1.0
    return math.log(nbytes / small) / math.log(large / small)


def made_bytes(func, args, kwargs, out) -> int:
    """Bytes an op call makes: its outputs; none for a view or an op that
    writes its input in place (an optimizer's foreach ops: their memory is
    not fresh, and pricing what they write by this figure put the
    dispatch-bound steps' AdamW 1-1.5 ms high), nor for an output on an
    input's storage (``_unsafe_view``, which every ``nn.Linear`` on a 3-D
    input ends in, is no view op by its schema: priced as making its output,
    transformers' forwards at width 256 came out 3-8 % higher).  The size
    by which its host cost is priced, as the trace's ``made_bytes`` counts it."""
    if is_view_op(func) or writes_input(func):
        return 0
    inputs = {id(st) for st in arg_storages(args, kwargs)}
    return sum(t.numel() * t.element_size() for t in tree_leaves(out)
               if isinstance(t, torch.Tensor) and ((st := storage_of(t)) is None or id(st) not in inputs))


def anchor_bytes(stats) -> float:
    """A calibration model's typical op size: the geometric mean of the bytes
    its forward's op calls make (views and in-place ops, which make none, left out)."""
    tl = stats.timeline
    sizes = [b for b, ph, v in zip(tl.made_bytes, tl.phases, tl.views) if ph == "forward" and not v and b > 0]
    return math.exp(sum(math.log(b) for b in sizes) / len(sizes)) if sizes else 0.0


def largest_bytes(stats) -> float:
    """A calibration model's largest op: the most bytes one of its forward's
    op calls makes (the cap :func:`fit_extras` weighs the backward's by too;
    a backward makes gradients of the forward's sizes)."""
    tl = stats.timeline
    return float(max((b for b, ph in zip(tl.made_bytes, tl.phases) if ph == "forward"), default=0))


def fit_extras(small: dict, large: dict, stats, small_bytes: float, large_bytes: float,
               largest: float = 0.0) -> dict[str, float]:
    """The large-size extras, microseconds per MiB an op makes, from
    both calibrations' figures (:func:`autosac.tools.calibration_figures.model_figures`; ``small`` as
    estimated, ``large`` raw) and the large model's trace: each such that
    the small figure on every op plus its :func:`op_extra_us` (up to
    ``largest`` bytes) gives the large model's measured total."""
    tl = stats.timeline
    shares = [op_extra_us(b, small_bytes, large_bytes, largest, 1.0) for b in tl.made_bytes]  # MiB weighted, capped
    forward = [s for s, ph in zip(shares, tl.phases) if ph != "backward"]
    backward = [s for s, ph in zip(shares, tl.phases) if ph == "backward"]

    def extra(total_us: float, small_us: float, ops: int, weight: float) -> float:
        return round(max(0.0, (total_us - small_us * ops) / weight), 3) if weight > 0 else 0.0

    return {
        "untimed_us_per_mib": extra(large["untimed_op_us"] * len(forward), small["untimed_op_us"], len(forward),
                                  sum(forward)),
        "backward_untimed_us_per_mib": extra(large["backward_untimed_us"] * len(backward),
                                           small["backward_untimed_us"], len(backward), sum(backward)),
    }


__all__ = ["anchor_bytes", "extra_us", "fit_extras", "largest_bytes", "machinery_us", "made_bytes", "op_extra_us",
           "share"]
