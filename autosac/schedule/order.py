"""An order of an FX graph's nodes with the least peak memory.

The order must compute the same values: every node after the nodes it reads;
nodes with effects (:attr:`GraphMemory.ordered`: in-place writes, RNG draws,
collectives, module calls, prints) in their original order; and a node that
reads a storage some node writes in place stays on its side of that write.

Small graphs are searched exactly (dynamic programming over the sets of
nodes already run).  Larger ones take the best of a few orders -- the input
order, demand-driven orders (each result computed just before it is
needed, the operand that needs more work first) and a greedy one -- so the
result is never worse than the input order; a lower bound (the bytes some
node needs at once, whatever the order) says how far from optimal it may be.

Example::

    >>> better = autosac.schedule.memory_aware_order(gm, *inputs)
    >>> better.meta["memory_order"]
    OrderReport(peak_before=2883584, peak_after=786432, lower_bound=786432, exact=False, ...)
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

from torch import fx

from autosac.schedule.memory import GraphMemory, graph_memory, replay_peak

__all__ = ["OrderReport", "memory_aware_order", "memory_aware_backend", "dependencies", "best_order"]

EXACT_NODES = 22  # graphs up to this many movable nodes are searched exactly
EXACT_STATES = 200_000  # ... unless the search meets more sets of run nodes than this
GREEDY_NODES = 3_000  # the greedy order is O(n^2): tried up to this size


@dataclass
class OrderReport:
    """``peak_before``/``peak_after``: bytes beyond the inputs in the input
    order and in the chosen one; ``lower_bound``: no order can peak lower;
    ``exact``: the chosen order was proven least; ``method`` which order won;
    ``seconds`` the time taken."""

    peak_before: int
    peak_after: int
    lower_bound: int
    exact: bool
    method: str
    seconds: float


def dependencies(mem: GraphMemory) -> list[set[int]]:
    """For each node (graph order), the nodes that must run before it."""
    n = len(mem.nodes)
    index = {node: i for i, node in enumerate(mem.nodes)}
    preds = [{index[a] for a in node.all_input_nodes} for node in mem.nodes]
    placeholders = [i for i, node in enumerate(mem.nodes) if node.op == "placeholder"]
    prev = None
    for i in range(n):
        if mem.ordered[i]:  # effects keep their order
            if prev is not None:
                preds[i].add(prev)
            prev = i
        if placeholders and mem.nodes[i].op != "placeholder":
            preds[i].add(placeholders[-1])  # inputs first
    users: dict[int, list[int]] = {}
    for i in range(n):
        for k in {*mem.reads[i], *mem.makes[i]}:
            users.setdefault(k, []).append(i)
    for w in range(n):  # readers of a storage stay on their side of a write to it
        for k in mem.writes[w]:
            for j in users.get(k, ()):
                if j < w:
                    preds[w].add(j)
                elif j > w:
                    preds[j].add(w)
    return preds


def _output_last(preds: list[set[int]]) -> list[set[int]]:
    """``preds`` where the output node (the graph's last) also waits for every
    other node, unused ones included."""
    n = len(preds)
    return [*preds[:-1], preds[-1] | set(range(n - 1))]


def lower_bound(mem: GraphMemory, free_inputs: bool = False) -> int:
    """Bytes beyond the inputs that some moment of every order holds: a node's
    inputs and results together, or everything the graph returns."""
    counted = (lambda k: k not in mem.held) if free_inputs else (lambda k: k not in mem.inputs and k not in mem.held)
    need = [sum(mem.nbytes[k] for k in {*mem.reads[i], *mem.makes[i]} if counted(k)) for i in range(len(mem.nodes))]
    outputs = sum(mem.nbytes[k] for k in mem.outputs if counted(k))
    base = sum(mem.nbytes[k] for k in mem.inputs) if free_inputs else 0
    return max(0, max([*need, outputs], default=0) - base)


def _demand_order(mem: GraphMemory, preds: list[set[int]], larger_first: bool) -> list[int]:
    """Each node computed just before the first node that needs it: a
    post-order walk from the output (then from nodes nothing needs), visiting
    the operand with more work behind it first when ``larger_first``."""
    n = len(preds)
    if larger_first:
        behind = [0] * n  # ancestors as bit masks: how much work a node needs first
        for i in _topological(preds):
            mask = 0
            for p in preds[i]:
                mask |= behind[p] | (1 << p)
            behind[i] = mask
        weight = [m.bit_count() for m in behind]
        key = lambda p: (-weight[p], p)  # noqa: E731
    else:
        key = lambda p: p  # noqa: E731
    out_node = n - 1
    order: list[int] = []
    done = [False] * n
    done[out_node] = True  # the output goes last
    # what the output reads first, then the nodes nothing needs
    for root in [*sorted(preds[out_node], key=key), *range(n - 1)]:
        if done[root]:
            continue
        done[root] = True
        stack = [(root, iter(sorted(preds[root], key=key)))]
        while stack:
            node, todo = stack[-1]
            nxt = next((p for p in todo if not done[p]), None)
            if nxt is None:
                order.append(node)
                stack.pop()
            else:
                done[nxt] = True
                stack.append((nxt, iter(sorted(preds[nxt], key=key))))
    return [*order, out_node]


def _topological(preds: list[set[int]]) -> list[int]:
    n = len(preds)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [len(p) for p in preds]
    for i, ps in enumerate(preds):
        for p in ps:
            succ[p].append(i)
    ready = [i for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                heapq.heappush(ready, j)
    return order


class _Live:
    """Live bytes as nodes run, for the greedy and exact searches."""

    def __init__(self, mem: GraphMemory, free_inputs: bool):
        self.keep = mem.outputs | mem.held | (set() if free_inputs else mem.inputs)
        self.counted = {k for k in mem.nbytes if k not in mem.held and (free_inputs or k not in mem.inputs)}
        self.users: dict[int, int] = {}  # storage -> bit mask of the nodes that make or read it
        for i in range(len(mem.nodes)):
            for k in {*mem.reads[i], *mem.makes[i]}:
                self.users[k] = self.users.get(k, 0) | (1 << i)
        self.made = [sum(mem.nbytes[k] for k in mem.makes[i] if k not in mem.inputs and k not in mem.held)
                     for i in range(len(mem.nodes))]
        self.producer = {k: i for i in range(len(mem.nodes)) for k in mem.makes[i]}
        self.mem = mem
        self.base = sum(mem.nbytes[k] for k in mem.inputs) if free_inputs else 0

    def live(self, state: int) -> int:
        total = 0
        for k, users in self.users.items():
            if k not in self.counted:
                continue
            made = k in self.mem.inputs or (state >> self.producer.get(k, 0)) & 1
            if made and (k in self.keep or users & ~state):
                total += self.mem.nbytes[k]
        return total - self.base


def _greedy_order(mem: GraphMemory, preds: list[set[int]], free_inputs: bool) -> list[int]:
    """Run, among the nodes ready, the one that frees the most net bytes
    (earliest in the graph on ties)."""
    n = len(preds)
    left = {k: 0 for k in mem.nbytes}
    for i in range(n):
        for k in {*mem.reads[i], *mem.makes[i]}:
            left[k] += 1
    keep = mem.outputs | mem.held | (set() if free_inputs else mem.inputs)
    waiting = [set(p) for p in preds]
    succ: list[list[int]] = [[] for _ in range(n)]
    for i, ps in enumerate(preds):
        for p in ps:
            succ[p].append(i)
    ready = {i for i in range(n) if not waiting[i]}
    order = []
    while ready:
        def gain(i):
            freed = sum(mem.nbytes[k] for k in {*mem.reads[i], *mem.makes[i]} if left[k] == 1 and k not in keep)
            made = sum(mem.nbytes[k] for k in mem.makes[i] if k not in mem.inputs and k not in mem.held)
            return (made - freed, i)

        i = min(ready, key=gain)
        ready.discard(i)
        order.append(i)
        for k in {*mem.reads[i], *mem.makes[i]}:
            left[k] -= 1
        for j in succ[i]:
            waiting[j].discard(i)
            if not waiting[j]:
                ready.add(j)
    return order


def _exact_order(mem: GraphMemory, preds: list[set[int]], free_inputs: bool, bound: int) -> list[int] | None:
    """The least-peak order by dynamic programming over the sets of nodes run,
    pruning sets already above ``bound``; None when they grow past EXACT_STATES."""
    n = len(preds)
    live = _Live(mem, free_inputs)
    need = [sum(1 << p for p in preds[i]) for i in range(n)]
    layer = {0: 0}
    parent: dict[int, tuple[int, int]] = {}
    full = (1 << n) - 1
    for _ in range(n):
        nxt: dict[int, int] = {}
        for state, cost in layer.items():
            here = live.live(state)
            for i in range(n):
                if (state >> i) & 1 or need[i] & ~state:
                    continue
                c = max(cost, here + live.made[i])
                if c > bound:
                    continue
                s = state | (1 << i)
                if c < nxt.get(s, bound + 1):
                    nxt[s] = c
                    parent[s] = (state, i)
        if not nxt or len(parent) > EXACT_STATES:
            return None
        layer = nxt
    if full not in layer:
        return None
    order, state = [], full
    while state:
        state, i = parent[state]
        order.append(i)
    return order[::-1]


def best_order(mem: GraphMemory, free_inputs: bool = False) -> tuple[list[int], OrderReport]:
    """The order of least peak found for ``mem``'s graph, and its report."""
    t0 = time.perf_counter()
    preds = dependencies(mem)
    n = len(preds)
    given = list(range(n))
    candidates = {"input order": given,
                  "demand, larger operand first": _demand_order(mem, preds, True),
                  "demand, graph order": _demand_order(mem, preds, False)}
    if n <= GREEDY_NODES:
        candidates["greedy"] = _greedy_order(mem, _output_last(preds), free_inputs)
    peaks = {name: replay_peak(mem, order, free_inputs) for name, order in candidates.items()}
    method = min(peaks, key=lambda name: (peaks[name], name != "input order"))
    order, peak = candidates[method], peaks[method]
    bound = lower_bound(mem, free_inputs)
    exact = peak == bound
    if not exact and n <= EXACT_NODES:
        found = _exact_order(mem, _output_last(preds), free_inputs, peak)
        if found is not None:
            exact = True
            found_peak = replay_peak(mem, found, free_inputs)
            if found_peak < peak:
                order, peak, method = found, found_peak, "exact search"
    report = OrderReport(peaks["input order"], peak, bound, exact, method, time.perf_counter() - t0)
    return order, report


def memory_aware_order(gm: fx.GraphModule, *example_inputs, free_inputs: bool = False) -> fx.GraphModule:
    """The same graph with its nodes in an order of least peak memory.

    Values are unchanged: nodes still follow what they read, nodes with
    effects keep their order, and readers of a storage written in place stay
    on their side of the write.  The result's peak is never above the input
    order's.

    Args:
        gm: an FX ``GraphModule``.
        example_inputs: its inputs (real or fake tensors); without them, the
            placeholders' ``meta["val"]``.
        free_inputs: as in :func:`autosac.schedule.peak_bytes`.

    Returns:
        A new ``GraphModule`` (``gm`` is not changed) whose
        ``meta["memory_order"]`` is an :class:`OrderReport`.

    Raises:
        TypeError: ``gm`` is not a GraphModule.
        ValueError: no example inputs and the graph carries none.

    Example::

        >>> better = autosac.schedule.memory_aware_order(gm, *inputs)
        >>> better.meta["memory_order"].peak_after <= better.meta["memory_order"].peak_before
        True
    """
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"memory_aware_order needs a torch.fx.GraphModule, got {type(gm).__name__}")
    mem = graph_memory(gm, *example_inputs)
    order, report = best_order(mem, free_inputs)
    graph = fx.Graph()
    graph.set_codegen(gm.graph._codegen)  # e.g. make_fx's pytree inputs and outputs
    env: dict[fx.Node, fx.Node] = {}
    for i in order:
        node = mem.nodes[i]
        env[node] = graph.node_copy(node, lambda a: env[a])
    out = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    out.meta.update(gm.meta)
    out.meta["memory_order"] = report
    return out


def memory_aware_backend(gm: fx.GraphModule, example_inputs):
    """A ``torch.compile`` backend: AOTAutograd's forward and backward graphs,
    each run in :func:`memory_aware_order` (otherwise as ``aot_eager`` runs them).

    Example::

        >>> compiled = torch.compile(model, backend=autosac.schedule.memory_aware_backend)
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def reorder(graph: fx.GraphModule, inputs):
        return make_boxed_func(memory_aware_order(graph, *inputs))

    return aot_autograd(fw_compiler=reorder, bw_compiler=reorder)(gm, example_inputs)
