"""Memory of an FX graph's op order: what each node makes, reads and writes,
and the peak a given order reaches.

:func:`graph_memory` runs a ``GraphModule`` once under FakeTensorMode (no
real memory) and records, per node, the storages it creates, reads and
writes, and whether it has an effect beyond its result.  :func:`replay_peak`
replays an order as an allocator would see it: each node's new results
appear when it runs, and each intermediate is freed right after its last
use.  Bytes are counted per storage, so a view never counts twice and a
storage lives while any view of it is still needed.

Example::

    >>> gm = torch.fx.symbolic_trace(fn)
    >>> autosac.schedule.peak_bytes(gm, *inputs) / 2**20      # MiB beyond the inputs
    0.75
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch < 2.13: the node's own hint
    optimization_hint = None
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autosac.core.opkinds import op_kind

__all__ = ["GraphMemory", "graph_memory", "replay_peak", "peak_bytes"]


@dataclass
class GraphMemory:
    """What each node of a graph allocates and reads, by storage.

    ``makes[i]`` / ``reads[i]``: storage keys node ``i`` (in graph order)
    creates and reads; ``writes[i]`` those it writes in place; ``ordered[i]``
    whether it has an effect beyond its result (an in-place write, a draw from
    the RNG, a collective, a module call, a Python side effect), so such nodes
    keep their order; ``nbytes[key]`` each storage's size; ``inputs`` the
    placeholders' storages; ``outputs`` those the graph returns (never freed);
    ``held`` the module's parameters, buffers and constants the graph reads
    (``get_attr``: already there, never freed)."""

    nodes: list[fx.Node]
    makes: list[list[int]] = field(default_factory=list)
    reads: list[list[int]] = field(default_factory=list)
    writes: list[list[int]] = field(default_factory=list)
    ordered: list[bool] = field(default_factory=list)
    nbytes: dict[int, int] = field(default_factory=dict)
    inputs: set[int] = field(default_factory=set)
    outputs: set[int] = field(default_factory=set)
    held: set[int] = field(default_factory=set)  # the module's own tensors (get_attr): never made nor freed


class _OpLog(TorchDispatchMode):
    """The aten ops a node runs, and the tensors they write (batch norm's
    running stats included, which no version counter shows)."""

    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.written: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(func)
        if isinstance(func, torch._ops.OpOverload):
            self.written.extend(op_kind(func).written_tensors(args, kwargs))
        return func(*args, **kwargs)


class _Recorder(fx.Interpreter):
    """Runs the graph on fake tensors -- the module's own parameters and
    buffers too, so nothing real is written -- keeping every node's result,
    the tensors it wrote and whether it has effects."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode):
        super().__init__(gm, garbage_collect_values=False)
        self.mode = mode
        self.results: dict[fx.Node, object] = {}
        self.written: dict[fx.Node, list[torch.Tensor]] = {}
        self.effects: dict[fx.Node, bool] = {}

    def _fake(self, value):
        return self.mode.from_tensor(value) if isinstance(value, torch.Tensor) else value

    def fetch_attr(self, target: str):
        return self._fake(super().fetch_attr(target))

    def call_module(self, target, args, kwargs):
        module = super().fetch_attr(target)
        state = {k: self._fake(v) for k, v in [*module.named_parameters(), *module.named_buffers()]}
        return torch.func.functional_call(module, state, tuple(args), dict(kwargs))

    def run_node(self, n: fx.Node):
        if n.op == "call_function" and n.target is print:  # an effect: not run while measuring
            self.results[n], self.written[n], self.effects[n] = None, [], True
            return None
        before = [(t, _version(t)) for a in n.all_input_nodes for t in _tensors(self.env.get(a))]
        with _OpLog() as log:
            out = super().run_node(n)
        self.results[n] = out
        self.written[n] = [t for t, v in before if _version(t) != v] + log.written
        self.effects[n] = bool(self.written[n]) or _has_effect(n, log.ops, out)
        return out


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has none: its writes are read from the ops
        return -1


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


_COLLECTIVES = ("c10d", "_c10d_functional", "c10d_functional")


def _has_effect(n: fx.Node, ops: list, out) -> bool:
    """Whether the node must keep its place among the graph's effects."""
    if n.op in ("placeholder", "output", "call_module"):
        return True
    if n.op == "get_attr":
        return False
    if n.is_impure():
        return True
    for func in ops:
        if not isinstance(func, torch._ops.OpOverload):
            return True  # a higher-order op or anything else we cannot read
        kind = op_kind(func)
        if kind.random or kind.written or func.namespace in _COLLECTIVES:
            return True
    # a call that ran no tensor op did something else (a print, torch.get_rng_state, a log)
    return not ops and n.target is not operator.getitem


def graph_memory(gm: fx.GraphModule, *example_inputs) -> GraphMemory:
    """Run ``gm`` once under FakeTensorMode and record what each node makes,
    reads and writes (see :class:`GraphMemory`).  Without ``example_inputs``
    the placeholders' ``meta["val"]`` (as Dynamo and AOTAutograd leave them)
    are used.

    Raises:
        ValueError: no example inputs and a placeholder without ``meta["val"]``.
    """
    if not example_inputs:
        example_inputs = tuple(_example_of(n) for n in gm.graph.nodes if n.op == "placeholder")
    mode, fake = _fake_inputs(example_inputs)
    with torch.random.fork_rng(devices=[]), mode:  # a seed set in the graph does not reach the caller's RNG
        rec = _Recorder(gm, mode)
        rec.run(*fake)
    mem = GraphMemory(list(gm.graph.nodes))
    keys: dict[StorageWeakRef, int] = {}

    def storages(value) -> list[int]:
        out = []
        for t in _tensors(value):
            key = keys.setdefault(StorageWeakRef(t.untyped_storage()), len(keys))
            mem.nbytes[key] = t.untyped_storage().nbytes()
            if key not in out:
                out.append(key)
        return out

    held = {n: storages(rec.results.get(n)) for n in mem.nodes}
    seen: set[int] = set()
    for n in mem.nodes:
        reads = sorted({k for a in n.all_input_nodes for k in held[a]})
        makes = [k for k in held[n] if k not in seen]
        seen.update(makes)
        mem.makes.append(makes)
        mem.reads.append(reads)
        mem.writes.append(storages(rec.written.get(n, [])))
        mem.ordered.append(rec.effects.get(n, True))
        if n.op == "placeholder":
            mem.inputs.update(held[n])
        if n.op == "get_attr":
            mem.held.update(held[n])
        if n.op == "output":
            mem.outputs.update(reads)
    if any(n.op == "call_module" for n in mem.nodes):  # a module call may write the state get_attr reads
        mem.ordered = [o or n.op == "get_attr" for o, n in zip(mem.ordered, mem.nodes)]
    return mem


def _example_of(node: fx.Node):
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is None:
        raise ValueError(f"the graph's input {node.name!r} carries no example value (meta['val']): pass example inputs")
    return val


def _fake_inputs(values: tuple) -> tuple[FakeTensorMode, list]:
    """``values`` as fake tensors of one FakeTensorMode, with concrete sizes.

    Fake values of one mode (the caller's or the ambient one) keep it, and so
    their aliasing.  Values of several modes -- ``make_fx(tracing_mode="real")``
    gives each placeholder's ``meta["val"]`` a mode of its own -- are copied
    into a new one.  Symbolic sizes (``tracing_mode="symbolic"``, dynamic
    shapes) are taken at their hints: the peak is a number of bytes, and the
    caller's ShapeEnv gets no guards from comparing peaks.
    """
    from torch._guards import detect_fake_mode

    if any(_symbolic(v) for v in values):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            bases: dict[StorageWeakRef, torch.Tensor] = {}
            return mode, [_at_hints(v, bases) if isinstance(v, torch.Tensor) else _hint(v) for v in values]
    modes = {id(m): m for m in (detect_fake_mode(), *(_mode_of(v) for v in values)) if m is not None}
    mode = next(iter(modes.values())) if len(modes) == 1 else FakeTensorMode(allow_non_fake_inputs=True)
    return mode, [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values]


def _mode_of(value) -> FakeTensorMode | None:
    return value.fake_mode if isinstance(value, FakeTensor) else None


def _symbolic(value) -> bool:
    if isinstance(value, torch.Tensor):
        sizes = [*value.shape, value.storage_offset(), *(value.stride() if value.layout == torch.strided else ())]
        return any(isinstance(s, torch.SymInt) for s in sizes)
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _hint(value):
    """A symbolic number's value in the trace (no guard is added); others as they are."""
    if isinstance(value, torch.SymInt) and optimization_hint is not None:
        return optimization_hint(value)
    if isinstance(value, torch.SymInt):
        return value.node.hint
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        return value.node.hint
    return value


def _at_hints(t: torch.Tensor, bases: dict) -> torch.Tensor:
    """A fake tensor like ``t`` at its hinted sizes, sharing a storage with
    the others made from ``t``'s storage (views of one input stay views)."""
    storage = t.untyped_storage()
    key = StorageWeakRef(storage)
    if key not in bases:
        bases[key] = torch.empty(_hint(storage.nbytes()), dtype=torch.uint8, device=t.device)
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(bases[key].untyped_storage(), _hint(t.storage_offset()), [_hint(s) for s in t.shape],
             [_hint(s) for s in t.stride()])
    return out.requires_grad_(t.requires_grad)


def replay_peak(mem: GraphMemory, order: list[int], free_inputs: bool = False) -> int:
    """The peak of live bytes beyond the inputs when the nodes run in ``order``
    (indices into ``mem.nodes``, a topological order)."""
    last: dict[int, int] = {}
    for pos, i in enumerate(order):
        for k in (*mem.makes[i], *mem.reads[i]):
            last[k] = pos
    base = sum(mem.nbytes[k] for k in mem.inputs) if free_inputs else 0
    keep = mem.outputs | mem.held | (set() if free_inputs else mem.inputs)
    live = peak = base
    for pos, i in enumerate(order):
        live += sum(mem.nbytes[k] for k in mem.makes[i] if k not in mem.inputs and k not in mem.held)
        peak = max(peak, live)
        for k in {*mem.makes[i], *mem.reads[i]}:
            if last[k] == pos and k not in keep:
                live -= mem.nbytes[k]
    return peak - base


def peak_bytes(gm: fx.GraphModule, *example_inputs, free_inputs: bool = False) -> int:
    """The most tensor bytes alive at once, beyond the inputs, when ``gm`` runs
    its nodes in graph order and frees each intermediate after its last use.

    Args:
        gm: an FX ``GraphModule``.
        example_inputs: its inputs (real or fake tensors: it runs under
            FakeTensorMode, so only shapes, dtypes and aliasing matter);
            without them, the placeholders' ``meta["val"]``.
        free_inputs: count the inputs as freed after their last use (a graph
            that owns its inputs, like a compiled backward's saved tensors);
            the result is then the peak above the inputs' total.

    Returns:
        Bytes, counted per storage (views of one storage count once).  What a
        node holds inside itself while it runs is not seen: a graph of
        composite calls (``F.cross_entropy`` as one node) under-counts their
        scratch memory; aten-level graphs (``make_fx``, AOTAutograd) have one
        op per node.  The module's own tensors (``get_attr``) are not counted.

    Raises:
        TypeError: ``gm`` is not a GraphModule.
        ValueError: no example inputs and the graph carries none.

    Example::

        >>> gm = torch.fx.symbolic_trace(lambda x: (x.relu() @ x).relu())
        >>> autosac.schedule.peak_bytes(gm, torch.randn(256, 256))
        524288
    """
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"peak_bytes needs a torch.fx.GraphModule, got {type(gm).__name__}")
    mem = graph_memory(gm, *example_inputs)
    return replay_peak(mem, list(range(len(mem.nodes))), free_inputs)
