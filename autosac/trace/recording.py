"""What one traced step recorded: the ops in order and the storages they made,
saved and freed.  :mod:`autosac.trace.recorder` fills a :class:`Recording`;
:mod:`autosac.trace.aggregate` turns it into ModelStats."""

from __future__ import annotations

from dataclasses import dataclass, field

Stack = tuple[str, ...]


@dataclass
class StorageRecord:
    nbytes: int
    kind: str  # param | buffer | input | optim | act | temp | grad
    created: int  # event index; -1 when it existed before the step
    producer: int = -1  # event index of the op that allocated it
    freed: int | None = None  # first event index at which it is no longer live
    saver_stack: Stack | None = None  # common ancestor stack of the ops that saved it
    saver_stacks: set[Stack] = field(default_factory=set)  # each distinct stack that saved it
    param_cast: bool = False
    cast_of: str = ""  # param_cast: the parameter's fqn
    writers: list[int] = field(default_factory=list)  # forward in-place ops that wrote it later
    saved_as_view: bool = False  # autograd saved a view of it, not the base tensor


@dataclass(slots=True)
class OpRecord:
    """One op of the step as the recorder saw it; :meth:`Recording.add_op` files it."""

    name: str  # the op's overload packet (``mm``, ``add_``)
    phase: str  # forward | loss | backward | optimizer
    stack: Stack  # the module stack it ran in (a backward op: its node's forward stack)
    ms: float
    flops: int
    view: bool  # a view op, or one returning only tensors it was given (``_unsafe_view``)
    random: bool  # draws from the RNG
    writes: bool  # writes an input in place (and is not a view)
    origin: int = -1  # a backward op: the forward event that made its autograd node


@dataclass
class Recording:
    """Raw facts of one step; :mod:`autosac.trace.aggregate` turns them into ModelStats.

    The ops are kept by column (``ops[e]``, ``stacks[e]``, ``ms[e]`` ... for
    event ``e``), as the aggregation reads them; :meth:`add_op` files one
    :class:`OpRecord` into them."""

    ops: list[str] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    stacks: list[Stack] = field(default_factory=list)
    ms: list[float] = field(default_factory=list)
    flops: list[int] = field(default_factory=list)
    views: list[bool] = field(default_factory=list)
    random: list[bool] = field(default_factory=list)  # draws from the RNG
    writes: list[bool] = field(default_factory=list)  # writes an input in place
    transient: dict[int, int] = field(default_factory=dict)  # event -> scratch bytes inside the op
    inputs: dict[int, list[int]] = field(default_factory=dict)  # forward event -> events that made its inputs
    written: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # event -> [(producer, storage, bytes)]
    storages: list[StorageRecord] = field(default_factory=list)
    fw_windows: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    fw_pre_order: list[str] = field(default_factory=list)
    fw_post_order: list[str] = field(default_factory=list)
    io_bytes: dict[str, list[int]] = field(default_factory=dict)  # fqn -> [inputs, outputs]
    input_storages: dict[str, list[list[int]]] = field(default_factory=dict)  # fqn -> per call, storage records
    state_items: dict[str, int] = field(default_factory=dict)  # fqn -> what its first call's state capture holds
    # fqns whose forward drew from Python's or NumPy's generator; None: not watched (compiled code runs no hooks)
    host_rng: set[str] | None = None
    origins: dict[int, int] = field(default_factory=dict)  # backward event -> forward event that made its node
    output_storages: dict[str, set[int]] = field(default_factory=dict)  # fqn -> storage records it returned
    param_dtypes: dict[str, set[str]] = field(default_factory=dict)
    unknown_ops: set[str] = field(default_factory=set)
    # each tensor autograd saved in the forward: (ops recorded before the save, module stack at the save);
    # an op's inputs are saved before it runs, its outputs after, so the stack tells whose call it was
    save_points: list[tuple[int, Stack]] = field(default_factory=list)
    # per save point, the call (fw_windows index) of each module of its stack that saved it
    save_calls: list[tuple[int, ...]] = field(default_factory=list)
    # each read of a saved tensor in the backward: (ops recorded before the read, its save_points index)
    unpacks: list[tuple[int, int]] = field(default_factory=list)
    # forward events that read a tensor derived from an MoE routing decision (or make one:
    # autosac.trace.routing); their number and sizes follow the routing assumed
    routed: set[int] = field(default_factory=set)
    routers: list = field(default_factory=list)  # the routing decisions the forward made (RouterCall)

    def add_op(self, op: OpRecord) -> int:
        """File ``op`` as the next event (one entry in each per-op column); return its index."""
        idx = len(self.ops)
        if op.origin >= 0:
            self.origins[idx] = op.origin
        self.ops.append(op.name)
        self.phases.append(op.phase)
        self.stacks.append(op.stack)
        self.ms.append(op.ms)
        self.flops.append(op.flops)
        self.views.append(op.view)
        self.random.append(op.random)
        self.writes.append(op.writes)
        return idx


def common_prefix(a: Stack, b: Stack) -> Stack:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def stack_of(fqn: str) -> tuple[str, ...]:
    """The module stack of ``fqn``: root ``""`` first, then each enclosing module."""
    if fqn == "":
        return ("",)
    parts = fqn.split(".")
    return ("",) + tuple(".".join(parts[: i + 1]) for i in range(len(parts)))
