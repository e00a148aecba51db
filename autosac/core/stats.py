"""ModelStats: everything the solver needs about one training step, as plain data.

Produced by :func:`autosac.profile`, read by :func:`autosac.solve`.  Nothing in
here refers to torch objects, so a profile can be saved, shipped and solved for
many budgets without the model.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields

from autosac.core.errors import StatsFormatError
from autosac.core.loop import Loop
from autosac.core.schema import build, check_common, parse

STATS_FORMAT = 9  # 9: ModuleStats.host_rng, inputs_written_later

@dataclass
class SavedOp:
    """One forward op whose output autograd keeps for backward.

    ``module`` is the innermost module the op ran in; ``scope`` the innermost
    module that contains the op, every in-place op that later wrote its output
    (``writer_events``, e.g. dropout's ``bernoulli_`` on CPU) and every op that
    saved it, so checkpointing any module at or above ``scope`` may discard it.
    ``ms`` is the recompute cost of the op and its writers together;
    ``savers`` the innermost module of each op that saved it.
    """

    id: int
    op: str
    module: str
    scope: str
    event: int
    freed_event: int
    bytes: int
    ms: float
    random: bool = False
    view: bool = False
    inplace: bool = False
    param_cast: bool = False
    param: str = ""  # param_cast: the fqn of the parameter it is a cast of
    writer_events: list[int] = field(default_factory=list)
    savers: list[str] = field(default_factory=list)  # innermost module of each op that saved it
    remade_at: int = -1  # parameter casts: the first backward event of the ops that saved it


@dataclass
class ModuleStats:
    """Per-module memory, runtime and recompute tradeoff (bytes and ms).

    ``*_total`` fields cover the module's whole subtree; others the module alone.
    A module called more than once per step (a shared block) has one forward
    window per call and, in ``bw_windows``, the backward span of each call's
    nodes; per-call figures (``discardable_bytes``, ``tradeoff``, ...) describe
    its first call, and ``*_calls`` lists give the others.
    ``tradeoff`` is the exact convex curve of ``[bytes discarded, ms of the
    discarded ops]`` points from ``[0, 0]``, cheapest ms/byte first (the solver
    prices a choice by everything its replay must compute, from the op graph in
    the timeline); ``recompute_work_bytes`` the memory those short-lived tensors (born and dead
    inside its forward, matmul scratch included) need at once when it recomputes.
    A checkpoint holds its module's inputs until the backward re-runs it:
    ``retained_input_bytes`` are those the unmodified step frees earlier.  It
    keeps (caches) the op calls with an output saved inside the module, unless
    it discards them, and re-runs all others: ``cache_holds`` lists, per kept
    op call, the bytes of its other outputs that the unmodified step frees
    (at the event given) before the module's backward but the cache holds until then.
    """

    fqn: str
    type: str
    parent: str | None
    children: list[str]
    depth: int
    calls: int
    fw_pre_order: int
    fw_post_order: int
    bw_pre_order: int
    bw_post_order: int
    fw_windows: list[list[int]]
    bw_window: list[int] | None
    param_bytes: int
    param_bytes_total: int
    grad_bytes_total: int
    optimizer_bytes_total: int
    saved_bytes: int
    saved_bytes_total: int
    act_grad_bytes: int
    input_bytes: int
    output_bytes: int
    fw_ms: float
    bw_ms: float
    recompute_work_bytes: int  # most bytes of its forward's short-lived tensors alive at once
    recompute_profile: list[list[int]]  # [event, short-lived bytes alive] wherever that changes
    retained_input_bytes: int  # inputs a checkpoint keeps alive that would die before its backward
    cache_holds: list[list[int]] = field(default_factory=list)  # [op event, bytes, freed at]: see above
    outside_write_bytes: int = 0  # written in place but made before the call: kept as they were until the replay
    bw_windows: list = field(default_factory=list)  # per forward call: [first, last] backward event of its nodes
    retained_input_calls: list[int] = field(default_factory=list)  # retained_input_bytes per call
    # per call, what makes up retained_input_bytes: [storage, bytes, event the unmodified step frees it];
    # storage numbers are shared across modules, so a tensor several checkpoints keep (a mask passed
    # to every block) is counted once
    retained_inputs: list[list[list[int]]] = field(default_factory=list)
    outside_write_calls: list[int] = field(default_factory=list)  # outside_write_bytes per call
    # whether a forward call writes in place any tensor made before it (those
    # outside_write_bytes counts, and tensors the trace never saw made); True when unknown
    writes_outside: bool = True
    saved_op_ids: list[int] = field(default_factory=list)
    discardable_bytes: int = 0
    tradeoff: list[list[float]] = field(default_factory=list)
    tradeoff_exact_points: int = 0
    # per forward call: tensors autograd saved inside it (each costs a checkpoint's hooks, autosac.tools.calibrate)
    saved_tensors: list[int] = field(default_factory=list)
    # per forward call: the backward event a checkpoint of it re-runs the forward at, its first read of a
    # tensor saved inside it (-1: none); backward ops before it read nothing saved (autosac.trace.aggregate)
    recompute_starts: list[int] = field(default_factory=list)
    # per forward call: the event its replay stops before -- PyTorch's checkpoint stops re-running once
    # the last tensor saved inside the call is made again (an op's inputs are saved before it runs, its
    # outputs after), so a transformer block's last matmul and residual add never re-run; the call's end
    # where it reads routing values (autosac.trace.aggregate)
    replay_stops: list[int] = field(default_factory=list)
    # its forward reads tensors derived from an MoE routing decision (autosac.trace.routing): how many
    # op calls it runs, and their sizes, follow the routing, so it is checkpointed only whole and plainly
    routed: bool = False
    # what a checkpoint of it captures of the Python state its forward may change, at each call
    # (autosac.core.pystate: containers and entries; a call's host cost, HostCosts.state_item_us)
    state_items: int = 0
    # its forward drew from Python's or NumPy's global generator (a mask from np.random, a layer dropped
    # on random.random()) or a torch.Generator passed to a random op: a checkpoint of it swaps their
    # states in for the replay (autosac.core.rng); None: not watched (a compiled trace runs no module hooks)
    host_rng: bool | None = None
    # a forward op after one of its calls writes that call's input in place (``x += block(x)``): its
    # checkpoint would re-run on the changed input (autograd refuses the backward), so it is no candidate
    inputs_written_later: bool = False

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def replay_end(self, call: int = 0) -> int:
        """The event a checkpoint's replay of forward call ``call`` stops before
        (``replay_stops``; the call's end in stats that do not record it)."""
        return self.replay_stops[call] if call < len(self.replay_stops) else self.fw_windows[call][1]


@dataclass
class ParamStats:
    fqn: str
    module: str
    shape: list[int]
    dtype: str
    bytes: int
    requires_grad: bool
    grad_bytes: int
    optimizer_bytes: int
    consumed_dtypes: list[str]


@dataclass
class Timeline:
    """Columnar per-op record of the step: op name, phase, innermost module
    (``None`` outside the model), live bytes during the op (its inputs, outputs
    and internal scratch), of which gradients, its ms, and the bytes the op
    itself allocates (outputs and scratch: ``live - made`` is what was live
    just before it ran).  For forward ops, ``inputs`` lists the earlier events
    whose results the op reads (producers and in-place writers of its inputs'
    storages, as :mod:`autosac.core.dataflow` defines them); ``views`` marks ops
    that alias their input, ``random`` ops that draw from the RNG and
    ``writes`` ops that write an input in place (:mod:`autosac.core.opkinds`)."""

    ops: list[str]
    phases: list[str]
    modules: list[str | None]
    live_bytes: list[int]
    grad_bytes: list[int]
    ms: list[float]
    made_bytes: list[int] = field(default_factory=list)
    inputs: list[list[int]] = field(default_factory=list)
    views: list[bool] = field(default_factory=list)
    random: list[bool] = field(default_factory=list)
    writes: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ops)


@dataclass
class ModelStats:
    """One training step, profiled.  ``peak_bytes`` is the unconstrained peak
    of the traced step.  With ``world_size > 1`` the trace is of the whole
    (unsharded) model; one rank's unconstrained peak, which budget
    percentages are of, is a plan's ``baseline_peak_bytes`` (and a sweep's).

    Example::

        >>> stats = autosac.profile(model, inputs, target="h100")
        >>> stats.peak_bytes, stats.modules["blocks.0"].saved_bytes_total
        >>> same = ModelStats.from_json(stats.to_json())
    """

    model: str
    fingerprint: str
    target: dict
    world_size: int
    optimizer: str
    peak_bytes: int
    peak_event: int
    peak_module: str | None
    peak_phase: str
    peak_breakdown: dict[str, int]
    param_bytes: int
    buffer_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    input_bytes: int
    param_cast_bytes: int
    step_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    root: str
    modules: dict[str, ModuleStats]
    params: dict[str, ParamStats]
    saved_ops: list[SavedOp]
    timeline: Timeline
    unknown_flop_ops: list[str]
    versions: dict[str, str]
    input_shapes: list[list] = field(default_factory=list)  # autosac.core.inputs.input_signature of the traced step
    # FSDP2 mixed precision (profile's param_dtype): {"param_dtype", "reduce_dtype", "master_ratio",
    # "reduce_ratio"}; the trace then ran in param_dtype, and the ratios scale its parameter bytes
    mixed_precision: dict = field(default_factory=dict)
    autocast: str = ""  # the dtype the forward was traced under torch.autocast in ("bfloat16"), or ""
    shard_units: list[str] = field(default_factory=list)  # FSDP2 units as given to profile; [] = one per block
    checkpoint_state_bytes: int = 0  # what each checkpoint call keeps besides inputs: the saved RNG state
    # parameters FSDP2 gathers in another dtype than their own (autosac.zero3's downcast gather): fqn -> dtype
    gathered_dtypes: dict[str, str] = field(default_factory=dict)
    # the loop traced (autosac.core.loop): the model's output alive to the step's end (True) or dropped at the loss
    output_held: bool = True
    # micro-batches per optimizer step (gradient accumulation); above 1 the trace ran the worst
    # micro-step: every gradient alive from its start (left by the micro-batches before), then the update
    grad_accumulation: int = 1
    batches_ahead: int = 0  # inputs' worth of batches a data loader holds besides the step's (autosac.core.loop)
    zero_grad: str = "after_step"  # where the loop sets gradients to None (autosac.core.loop): or "before_backward"
    # mixture-of-experts routing the trace assumed (autosac.trace.routing): {"assumption": {"kind",
    # "capacity_factor"}, "routers": [{"op", "module", "tokens", "top_k", "experts"}, ...]}; {} without routing
    routing: dict = field(default_factory=dict)
    format: int = STATS_FORMAT

    @property
    def loop(self) -> Loop:
        """The training loop traced (``output_held``, ``grad_accumulation``,
        ``zero_grad``, ``batches_ahead``) as one :class:`autosac.Loop`."""
        return Loop.of(self)

    def to_json(self) -> str:
        """Serialise to a JSON string (no pickle; loads with :meth:`from_json`)."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ModelStats:
        """Parse :meth:`to_json` output.

        Every field is type-checked against its annotation (ints, finite
        numbers, ...) and the module tree and timeline checked to hold together.

        Raises:
            StatsFormatError: the text is not a ModelStats of this format version, or
                a field is missing, mistyped or not finite (one line naming it).
        """
        data = parse(text, "a ModelStats")
        if not isinstance(data, dict) or data.get("format") != STATS_FORMAT:
            found = data.get("format") if isinstance(data, dict) else None
            raise StatsFormatError(
                f"ModelStats format {found!r} is not {STATS_FORMAT}: re-run autosac.profile with this version"
            )
        names = {f.name for f in fields(cls)}
        try:
            stats = build(cls, {k: v for k, v in data.items() if k in names}, "", strict=False)
            check_common(stats)
            stats._check_structure()
        except StatsFormatError as e:
            raise StatsFormatError(f"malformed ModelStats JSON: {e}") from None
        return stats

    def _check_structure(self) -> None:
        """The module tree and the timeline's columns hold together."""
        if self.root not in self.modules:
            raise StatsFormatError(f"root {self.root!r} is not one of modules")
        for fqn, m in self.modules.items():
            for child in m.children:
                if child not in self.modules:
                    raise StatsFormatError(f"modules[{fqn!r}].children names {child!r}, which is not one of modules")
        n = len(self.timeline)
        for f in fields(Timeline):
            column = getattr(self.timeline, f.name)
            optional = f.default_factory is not MISSING  # a column older profiles lack: empty
            if len(column) != n and not (optional and not column):
                raise StatsFormatError(f"timeline.{f.name} has {len(column)} entries for {n} ops")

    def subtree(self, fqn: str) -> list[str]:
        """``fqn`` and all its descendants, in forward pre-order."""
        out, todo = [], [fqn]
        while todo:
            m = todo.pop()
            out.append(m)
            todo.extend(reversed(self.modules[m].children))
        return out
