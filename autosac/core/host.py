"""Host costs as data: what the host -- the CPU running Python -- spends per op
call and per checkpointed call (:class:`HostCosts`; the figures are described in
:mod:`autosac.tools.calibrate`, which measures them on this machine).

A :class:`~autosac.core.devices.DeviceSpec` with ``host=None`` is priced with
this machine's figures: :func:`host_costs` asks the calibration registered by
:mod:`autosac.tools.calibrate` (``import autosac`` registers it), so this data
module imports nothing above it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

CACHE_KEY = "host-costs-v33"  # bump when the micro-benchmark changes (v12: a large size too, autosac.core.hostsize;
# v13: cold_read_us_per_mib, autosac.core.coldread; v14: cast_hook_us; v15: figures as medians of per-round figures;
# v16: first_call_us; v17: call_gap_us in its place, checkpoint_call_us and saved_tensor_us at no gap;
# state_item_us; v18: call_gap_us in the rounds, the models' op timings taken anew, medians over noisy calibrations;
# v19: the trace no longer counts autograd's copies of unpacked saved tensors as backward ops;
# v20: the ops a checkpoint's replay skips after its last saved tensor added back to the machinery's figures;
# v21: checkpoint_us_per_mib, autosac.tools.calibration_size; v22: the large model's kernels timed in each round;
# v23: the machinery's per-MiB figures weigh an op no more than the large calibration's typical one;
# v24: selective_us_per_mib measured in place, autosac.tools.calibration_size;
# v25: the op figures' per-MiB extras capped as the machinery's, fitted so;
# v26: state_item_us timed in bursts spread over call_gap_us's rounds, autosac.tools.calibration_apart.apart_figures;
# v27: each round's figures brought to the rounds' typical speed, autosac.tools.calibration_figures.at_typical_speed;
# v28: checkpoint_us_per_mib no longer measured, autosac.tools.calibration_size;
# v29: the large model's backward kernels timed in each round; an op's per-MiB extra capped at the large
# calibration's largest op, largest_op_bytes, not at its typical one;
# v30: ops on an expanded input (a sum's gradient) timed, not priced by the roofline, autosac.trace.costs.real_inputs;
# v31: host_rng_us; v32: the cast hook checks saved tensors' versions, cast_hook_us measures it;
# v33: the state capture sorts a table's values once per layout and a replay copies nothing where nothing changed
# (autosac.core.pystate); state_item_us measures both)
_FIELDS = ("op_us", "checkpoint_call_us", "saved_tensor_us", "selective_op_us", "untimed_op_us", "backward_op_us",
           "backward_untimed_us", "small_op_bytes", "large_op_bytes", "largest_op_bytes", "untimed_us_per_mib", "backward_untimed_us_per_mib",
           "selective_us_per_mib", "cold_read_us_per_mib", "cast_hook_us", "cast_remake_us", "call_gap_us",
           "state_item_us", "checkpoint_us_per_mib", "host_rng_us")
_SIGNED = ("backward_untimed_us",)
_PER_OP = ("op_us", "selective_op_us", "untimed_op_us", "backward_op_us", "backward_untimed_us", "cast_hook_us",
           "cast_remake_us")
NOISY_KEY = f"{CACHE_KEY}:noisy_until"  # 0: measured clean; else when the noisy figures expire (epoch seconds)
# the figures of the last HISTORY_KEPT noisy calibrations, slot i's as f"{HISTORY_KEY}{i}:{figure}"
# (autosac.tools.calibration_history)
HISTORY_KEY, HISTORY_KEPT = f"{CACHE_KEY}:history:", 5
# cached figures that may be negative (the figures, the last clean ones and the kept noisy ones:
# autosac.tools.calibrate)
SIGNED_CACHE_KEYS = frozenset(
    [f"{CACHE_KEY}:{kind}{f}" for f in _SIGNED for kind in ("", "clean:")]
    + [f"{HISTORY_KEY}{i}:{f}" for f in _SIGNED for i in range(HISTORY_KEPT)])


def signed_cache_key(key: str) -> bool:
    """Whether the timing cache's ``key`` holds a figure that may be negative:
    one of :data:`SIGNED_CACHE_KEYS`, or the same figure of an earlier
    calibration version (a file written before an upgrade keeps them; read as
    bad, each upgrade warned of a repair)."""
    return key in SIGNED_CACHE_KEYS or (key.startswith("host-costs-v") and key.rsplit(":", 1)[-1] in _SIGNED)


@dataclass(frozen=True)
class HostCosts:
    """Host time in microseconds (see the module's docstring).

    Example::

        >>> HostCosts(op_us=12.0, checkpoint_call_us=100.0, saved_tensor_us=12.0, selective_op_us=40.0)
    """

    op_us: float = 0.0
    checkpoint_call_us: float = 0.0
    saved_tensor_us: float = 0.0
    selective_op_us: float = 0.0
    untimed_op_us: float = 0.0
    backward_op_us: float | None = None
    backward_untimed_us: float | None = None
    # CPU kernels: what a large op adds to the per-op figures per MiB it makes, and the two
    # calibrations' typical op sizes in bytes (autosac.core.hostsize; 0: none measured)
    small_op_bytes: float = 0.0
    large_op_bytes: float = 0.0
    untimed_us_per_mib: float = 0.0
    backward_untimed_us_per_mib: float = 0.0
    selective_us_per_mib: float = 0.0
    # CPU kernels: the large calibration's largest op in bytes: an op's own per-MiB extra is priced up to
    # it (autosac.core.hostsize.op_extra_us; 0: up to large_op_bytes, as the machinery's)
    largest_op_bytes: float = 0.0
    # CPU kernels: what a foreach op (an optimizer's) adds per MiB it reads that the op before
    # it did not touch (autosac.core.coldread; 0: none measured)
    cold_read_us_per_mib: float = 0.0
    # each tensor autograd saves outside checkpointed calls in a plan with parameter casts (autocast):
    # the model-wide hook that keeps casts from being saved packs and unpacks it (autosac.applier.casts)
    cast_hook_us: float = 0.0
    # each parameter cast that hook packs as its parameter and makes again in the backward, beyond that
    cast_remake_us: float = 0.0
    # what a checkpointed call costs more, at each point it runs the machinery (its forward, its replay),
    # per square root of the op calls the step ran since the machinery last ran there: its code and data
    # go cold in between (gap_roots; autosac.tools.calibrate); 0: every call costs checkpoint_call_us and
    # its saved tensors' share
    call_gap_us: float = 0.0
    # each container and entry of the Python state a checkpointed call captures (ModuleStats.state_items:
    # its subtree's attribute tables, what its arguments reach), captured, swapped in for the replay and
    # put back: 0.19-0.20 us each here, warm (a transformers GPT-2 block's capture holds 311 entries,
    # a small MLP block's 93)
    state_item_us: float = 0.0
    # CPU kernels: what a checkpointed call's machinery costs more per MiB its forward's ops make
    # (weighted as the per-MiB figures above): it runs cache-cold after large kernels; not measured
    # since host-costs-v28, priced where stated (autosac.tools.calibration_size says why)
    checkpoint_us_per_mib: float = 0.0
    # a checkpointed call of a module whose forward draws from Python's or NumPy's global generator or a
    # torch.Generator of its own (ModuleStats.host_rng): their states captured at its forward, swapped in
    # for the replay and put back (autosac.core.rng.HostRng; 0: not measured)
    host_rng_us: float = 0.0

    def size_us(self, nbytes: float, us_per_mib: float) -> float:
        """What an op making ``nbytes`` adds to the checkpointing machinery's
        per-call figure, at ``us_per_mib``: no more than
        the large calibration's typical op (:func:`autosac.core.hostsize.machinery_us`)."""
        from autosac.core.hostsize import machinery_us

        return machinery_us(nbytes, self.small_op_bytes, self.large_op_bytes, us_per_mib)

    def op_extra_us(self, nbytes: float, us_per_mib: float) -> float:
        """What an op making ``nbytes`` adds to its own per-op figure at
        ``us_per_mib``: no more than the large calibration's largest op
        (:func:`autosac.core.hostsize.op_extra_us`)."""
        from autosac.core.hostsize import op_extra_us

        return op_extra_us(nbytes, self.small_op_bytes, self.large_op_bytes, self.largest_op_bytes, us_per_mib)

    def op_ms(self, kernel_ms: float, device_type: str, timed: bool, backward: bool = False, nbytes: int = 0) -> float:
        """One op call's time from its kernel's: on a GPU the longer of the
        two (the host issues the next op while the kernel runs); on the CPU
        their sum, where ``timed`` (the kernel time was measured by calling
        the op) only the host time that measurement does not see (never
        below zero).  ``backward``: an op the autograd engine calls.
        ``nbytes``: what the op makes; on a CPU whose kernels were timed, a
        large op costs more per MiB it makes (:mod:`autosac.core.hostsize`)."""
        whole, untimed = self.op_us, self.untimed_op_us
        if backward:
            whole = whole if self.backward_op_us is None else self.backward_op_us
            untimed = untimed if self.backward_untimed_us is None else self.backward_untimed_us
        if device_type != "cpu":
            return max(kernel_ms, whole / 1e3)
        if timed and nbytes:
            untimed += self.op_extra_us(nbytes, self.backward_untimed_us_per_mib if backward else self.untimed_us_per_mib)
        return max(0.0, kernel_ms + (untimed if timed else whole) / 1e3)

    def checkpoint_ms(self, saved_tensors: int, ops: int, selective: bool, op_bytes=(), roots: float = 0.0,
                      state_items: int = 0, host_rng: bool = False) -> float:
        """What checkpointing one call costs the host: per call, per tensor its
        forward saves, per item of Python state it captures, the host
        generators' states where ``host_rng`` (:attr:`host_rng_us`), (selectively) per
        op call, in the forward and the replay, and :meth:`gap_us` of ``roots``
        for the op calls run since the machinery last ran.  ``op_bytes``: what each op call makes,
        where its kernels run on this CPU: large ones cost the call's machinery
        (``checkpoint_us_per_mib``) and a selective call's per-op work more per
        MiB they make, up to the large calibration's typical op
        (:func:`autosac.core.hostsize.machinery_us`)."""
        us = self.checkpoint_call_us + saved_tensors * self.saved_tensor_us + self.gap_us(roots)
        us += state_items * self.state_item_us + (self.host_rng_us if host_rng else 0.0)
        if self.checkpoint_us_per_mib:
            us += sum(self.size_us(b, self.checkpoint_us_per_mib) for b in op_bytes)
        if selective:
            us += 2 * ops * self.selective_op_us
            us += 2 * sum(self.size_us(b, self.selective_us_per_mib) for b in op_bytes)
        return us / 1e3

    def gap_us(self, roots: float) -> float:
        """What a checkpointed call costs for the op calls the step ran since the
        machinery last ran, at each point the call runs it (its forward, its
        replay): ``call_gap_us`` times ``roots``, the sum of the square roots
        of those gaps in trace events (:func:`gap_roots`)."""
        return self.call_gap_us * roots

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is None and name.startswith("backward_"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"HostCosts.{name} must be a number of microseconds, got {value!r}")
            if name not in _SIGNED and value < 0:
                raise ValueError(f"HostCosts.{name} must be a number of microseconds >= 0, got {value!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> HostCosts:
        """The figures in ``data`` (a stats file's ``target["host"]``); figures a
        newer autosac added are left out (priced as this version prices)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def gap_roots(points, cycle: int) -> float:
    """The sum, over ``points`` (the trace events where a plan's checkpointed
    calls run the checkpointing machinery: each call's forward start and its
    replay), of the square root of the events since the point before it; the
    step repeats every ``cycle`` events, so the first point's gap runs from the
    last one round the step's end.

    On this 2-core VM a small region's call cost 250 us with another one right
    before it, 430 us with a transformer block between (36 op calls), 700 us
    alone in a model of six blocks, 1400 us alone in one of 48: near ``a + b *
    sqrt(gap)``, the machinery's code and data evicted by what runs between.

    Example::

        >>> gap_roots([10, 90], cycle=100)  # one call: forward at 10, replay at 90
        13.41...
    """
    pts = sorted(points)
    if not pts:
        return 0.0
    roots = math.sqrt(max(0, cycle - pts[-1] + pts[0]))
    return roots + sum(math.sqrt(b - a) for a, b in zip(pts, pts[1:]))


def host_costs(given: HostCosts | dict | None) -> HostCosts:
    """``given`` as :class:`HostCosts`, or this machine's (the registered calibration) when None."""
    if given is None:
        if _calibrate is None:
            raise RuntimeError("autosac: no host calibration registered: import autosac (autosac.tools.calibrate "
                               "registers it), or state the figures with DeviceSpec(host=HostCosts(...))")
        return _calibrate()
    return given if isinstance(given, HostCosts) else HostCosts.from_dict(given)


_calibrate: Callable[[], HostCosts] | None = None


def register_calibration(calibrate: Callable[[], HostCosts]) -> None:
    """What measures this machine's figures when a target states none: set by
    :mod:`autosac.tools.calibrate` (which runs the trace, the solver and the
    applier, all above this module)."""
    global _calibrate
    _calibrate = calibrate

__all__ = ["HostCosts", "host_costs", "register_calibration"]
