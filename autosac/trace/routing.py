"""What a plan assumes about mixture-of-experts routing, and how the trace
follows it.

A fake trace has no values, but how many tokens reach each expert of an MoE
layer is a number of the data: the sizes of the tensors an expert makes, and
in eager implementations how many experts run at all, follow from it.  The
trace therefore plans for a stated :class:`Routing`:

* ``"balanced"`` (the default): tokens spread evenly, every expert gets
  ``tokens * top_k / experts`` of them;
* a capacity factor ``c >= 1`` (``routing=1.25``): the busiest experts each
  get ``c`` times the balanced load (never more than every token), filled in
  turn until all ``tokens * top_k`` assignments are placed;
* ``"worst"``: all tokens go to the first ``top_k`` experts (the capacity
  factor ``experts / top_k``).

Routing is laid out only where the step depends on it: the trace first runs
with every pick fake, and only a forward that reads the values of picks made
from activations (an eager experts loop, a capacity-limited or
sort-and-split dispatch) is traced again with them laid out -- or from the
start, when the user states a routing.  Where the router picks experts -- a
``topk``, ``max``/``argmax`` or ``sort`` over a fake floating tensor (up to
``ROUTED_NUMEL`` picks) -- the trace then hands back *real* index tensors laid
out as the routing says (each row's picks distinct, as a top-k's are).  Every
op that then reads them (``one_hot``, ``nonzero``, ``where``, ``bincount``,
``histc``, ``sort``, ``cumsum``, ``.tolist()``, a Python ``if`` on an expert
id) runs for real on those small integer tensors, so data-dependent sizes and
branches come out as that routing makes them; the expert matmuls run fake on
the sizes that follows.  :class:`RoutingTrace` does this for the recorder and
notes each routing decision (:class:`RouterCall`) for the stats.

:func:`forced` is the same assumption for a real step (tests and benchmarks:
measure the step the plan was made for), and :func:`observe` records the
routing a real step takes (``autosac verify`` reports it).
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# Tensors derived from routing decisions may be computed for real up to this
# many elements in all (one op's inputs): int64 index tensors of a 32k-token
# batch over 64 experts fit well below it.
ROUTED_NUMEL = 1 << 24


@dataclass(frozen=True)
class Routing:
    """A routing assumption: ``kind`` is ``"balanced"``, ``"capacity"`` or
    ``"worst"``; ``capacity_factor`` the busiest expert's load over the
    balanced load (1.0 for balanced, ``inf`` for worst)."""

    kind: str = "balanced"
    capacity_factor: float = 1.0

    def describe(self) -> str:
        """One phrase for tables: ``balanced``, ``capacity factor 1.25``, ``worst``."""
        return "capacity factor " + f"{self.capacity_factor:g}" if self.kind == "capacity" else self.kind

    def to_dict(self) -> dict:
        return {"kind": self.kind, "capacity_factor": None if math.isinf(self.capacity_factor)
                else self.capacity_factor}

    def loads(self, rows: int, k: int, n: int) -> list[int]:
        """Tokens per expert for ``rows`` tokens picking ``k`` of ``n`` experts each."""
        total = rows * k
        if self.kind == "balanced" or n <= k:
            return [total // n + (1 if v < total % n else 0) for v in range(n)]
        cap = rows if math.isinf(self.capacity_factor) else \
            min(rows, max(math.ceil(total / n), math.ceil(self.capacity_factor * total / n - 1e-9)))
        loads = []
        for _ in range(n):
            take = min(cap, total)
            loads.append(take)
            total -= take
        return loads


BALANCED = Routing()


def parse_routing(value) -> Routing:
    """A :class:`Routing` from what a user passes: ``"balanced"``, ``"worst"``,
    a capacity factor (a number >= 1, or its string) or a ``Routing``.

    Raises:
        ValueError: anything else.

    Example::

        >>> parse_routing(1.25).describe()
        'capacity factor 1.25'
    """
    if isinstance(value, Routing):
        return value
    if value is None or value == "balanced":
        return BALANCED
    if value == "worst":
        return Routing("worst", math.inf)
    factor = value
    if isinstance(value, str):
        try:
            factor = float(value)
        except ValueError:
            factor = None
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and 1.0 <= factor < math.inf:
        return BALANCED if factor == 1.0 else Routing("capacity", float(factor))
    raise ValueError(f"routing must be 'balanced', 'worst' or a capacity factor >= 1 (1.25, say), got {value!r}")


def routing_from_dict(d: dict | None) -> Routing:
    """The inverse of :meth:`Routing.to_dict` (``None``/empty: balanced)."""
    if not d:
        return BALANCED
    factor = d.get("capacity_factor")
    return Routing(str(d.get("kind", "balanced")), math.inf if factor is None else float(factor))


def routed_indices(shape: tuple[int, ...], dim: int, n: int, routing: Routing) -> torch.Tensor:
    """Real int64 indices of ``shape`` picking, along ``dim``, ``shape[dim]``
    distinct values of ``range(n)`` per row, each value used as often as
    ``routing`` loads it.  Filled column by column (position ``p`` is row
    ``p % rows``, pick ``p // rows``): no value's load exceeds the rows, so a
    row never gets a value twice."""
    dim = dim % len(shape) if shape else 0
    k = shape[dim] if shape else 1
    rows = math.prod(shape) // k if k else 0
    if rows == 0 or k == 0:
        return torch.zeros(shape, dtype=torch.int64)
    loads = routing.loads(rows, k, n)
    seq = torch.repeat_interleave(torch.arange(n), torch.tensor(loads))
    picks = seq.view(k, rows).t()  # (rows, k)
    other = [s for i, s in enumerate(shape) if i != dim]
    return picks.reshape(*other, k).movedim(-1, dim).contiguous()


_INDEXING = ("index", "index_put", "index_put_", "_index_put_impl_")


def with_long_indices(func, args, trace: RoutingTrace | None):
    """``args`` of an indexing op (``x[mask]``, ``x[mask] = y``) with each real
    boolean index derived from routing replaced by the long indices of its
    true elements, as ATen expands a mask itself: the fake kernel then sizes
    the result from them instead of failing on a mask it cannot read."""
    if trace is None or func.overloadpacket.__name__ not in _INDEXING or len(args) < 2:
        return args
    indices = args[1]
    if not isinstance(indices, (list, tuple)) or not any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool and trace.is_derived(i) for i in indices):
        return args
    expanded = []
    with unset_fake_temporarily():
        for i in indices:
            if isinstance(i, torch.Tensor) and i.dtype == torch.bool and trace.is_derived(i):
                expanded.extend(i.nonzero().unbind(1))
            else:
                expanded.append(i)
    return (args[0], expanded, *args[2:])


@dataclass
class RouterCall:
    """One routing decision the forward made: the op, where (module fqn),
    ``tokens`` rows each picking ``top_k`` of ``experts``."""

    op: str
    module: str
    tokens: int
    top_k: int
    experts: int


def _source(func, args, kwargs) -> tuple[torch.Tensor, int, int] | None:
    """``(scores, dim, picks per row)`` when ``func`` picks indices from scores:
    ``topk``, ``max``/``min`` over a dim, ``argmax``/``argmin`` over a dim, ``sort``."""
    name = func.overloadpacket.__name__
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if name == "topk":
        k = args[1] if len(args) > 1 else kwargs["k"]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        return x, dim, k
    if name in ("max", "min") and func._overloadname == "dim":
        return x, args[1] if len(args) > 1 else kwargs["dim"], 1
    if name in ("argmax", "argmin"):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return None if dim is None else (x, dim, 1)
    if name == "sort":
        dim = args[1] if len(args) > 1 and isinstance(args[1], int) else kwargs.get("dim", -1)
        return x, dim, x.shape[dim] if x.dim() else 1
    return None


def is_routing_source(func, args, kwargs) -> bool:
    """Whether the op picks indices from fake floating scores (a routing
    decision the trace cannot see the values of)."""
    found = _source(func, args, kwargs)
    return found is not None and isinstance(found[0], FakeTensor) and found[0].is_floating_point() \
        and found[0].dim() > 0


def _indices_slot(func) -> int | None:
    """Which output of a source op holds the indices."""
    name = func.overloadpacket.__name__
    return None if name in ("argmax", "argmin") else 1


class RoutingTrace:
    """The trace's side of routing: routing decisions over fake scores get
    real indices as :attr:`routing` lays them out, and ops reading tensors
    derived from them run for real (see the module docstring)."""

    def __init__(self, routing: Routing = BALANCED, active: bool = True) -> None:
        self.routing = routing
        self.active = active  # False: routing decisions stay fake (a forward that never reads their values)
        self.calls: list[RouterCall] = []
        self._derived: dict[int, weakref.ref] = {}

    def is_derived(self, t: torch.Tensor) -> bool:
        ref = self._derived.get(id(t))
        return ref is not None and ref() is t

    def reads_routing(self, tensors) -> bool:
        """Whether any of ``tensors`` was derived from a routing decision."""
        return any(self.is_derived(t) for t in tensors)

    def mark(self, out) -> None:
        """Note real outputs of an op that read routed tensors as routed too."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
                self._derived[id(t)] = weakref.ref(t)

    def route(self, func, args, kwargs, out, module: str):
        """``out`` with real routed indices when ``func`` picks indices from
        fake floating scores (else ``out`` unchanged)."""
        if not self.active or not is_routing_source(func, args, kwargs):
            return out
        x, dim, k = _source(func, args, kwargs)
        if math.prod(x.shape) // max(x.shape[dim], 1) * k > ROUTED_NUMEL:
            return out  # too many picks to lay out for real (a sort over a vocabulary's logits)
        slot = _indices_slot(func)
        fake_idx = out if slot is None else out[slot]
        n = x.shape[dim]
        with unset_fake_temporarily():
            shape = tuple(fake_idx.shape)
            if func.overloadpacket.__name__ in ("max", "min", "argmax", "argmin"):
                keep = len(shape) == x.dim()
                full = shape if keep else shape[: dim % x.dim()] + (1,) + shape[dim % x.dim():]
                idx = routed_indices(full, dim, n, self.routing)
                idx = idx if keep else idx.squeeze(dim)
            else:
                idx = routed_indices(shape, dim, n, self.routing)
        self.mark(idx)
        rows = idx.numel() // max(k, 1)
        self.calls.append(RouterCall(func.overloadpacket.__name__, module, rows, k, n))
        if slot is None:
            return idx
        return (*out[:slot], idx, *out[slot + 1:])


@dataclass
class ObservedRouting:
    """The routing one real forward took: per routing decision, the busiest
    expert's load over the balanced load (its capacity factor)."""

    factors: list[float]

    @property
    def capacity_factor(self) -> float:
        """The largest over all decisions (1.0 when there were none)."""
        return max(self.factors, default=1.0)


# A real step is watched and forced at the Python API (a TorchFunctionMode),
# never by a dispatch mode: a dispatch mode over the whole step would give every
# tensor of the backward a Python object, and autograd then never sums two
# gradients in place (it does when it holds the last reference), so the peak
# measured under it would not be the step's own.
_PICKS = {"topk", "max", "min", "argmax", "argmin", "sort", "argsort"}


def _api_pick(func, args, kwargs) -> tuple[str, torch.Tensor, int, int, bool] | None:
    """``(name, scores, dim, picks per row, keepdim)`` for a Python-level call
    that picks indices from floating scores, else None."""
    name = getattr(func, "__name__", "")
    if name not in _PICKS or not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if not x.is_floating_point() or x.dim() == 0:
        return None

    def arg(i, key, default=None):
        return args[i] if len(args) > i else kwargs.get(key, default)

    if name == "topk":
        return name, x, arg(2, "dim", -1) % x.dim(), arg(1, "k"), True
    if name in ("sort", "argsort"):
        dim = arg(1, "dim", -1)
        if not isinstance(dim, int):
            return None
        return name, x, dim % x.dim(), x.shape[dim], True
    dim = arg(1, "dim")
    if not isinstance(dim, int):  # max(x), max(x, other), argmax over everything: no pick per row
        return None
    return name, x, dim % x.dim(), 1, bool(arg(2, "keepdim", False))


_AS_OP = {"max": "max", "min": "min", "argmax": "argmax", "argmin": "argmin", "topk": "topk", "sort": "sort",
          "argsort": "sort"}  # the aten op (RouterCall.op) each Python call reaches


class _Observe(TorchFunctionMode):
    def __init__(self, expect: list[RouterCall]) -> None:
        super().__init__()
        self.expect = {(c.op, c.experts, c.top_k) for c in expect}
        self.factors: list[float] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        found = _api_pick(func, args, kwargs)
        if found is not None:
            name, x, dim, k, _ = found
            if (_AS_OP[name], x.shape[dim], k) in self.expect:
                idx = out if isinstance(out, torch.Tensor) else out[1]
                loads = torch.bincount(idx.detach().reshape(-1).cpu(), minlength=x.shape[dim])
                balanced = idx.numel() / x.shape[dim]
                self.factors.append(float(loads.max()) / balanced if balanced else 1.0)
        return out


@contextmanager
def observe(expect: list[RouterCall]):
    """Record the routing a real forward takes at the routing decisions a
    trace found (``expect``, matched by op, experts and picks per token);
    yields an :class:`ObservedRouting` filled as the forward runs.

    Example::

        >>> with observe(stats_router_calls) as seen:
        ...     model(x)
        >>> seen.capacity_factor   # 1.6: the busiest expert got 1.6x its share
    """
    seen = ObservedRouting([])
    mode = _Observe(expect)
    with mode:
        yield seen
    seen.factors.extend(mode.factors)


class _Force:
    """Replaces each routing decision by a gather of the scores at the routed
    indices.  The indices are made once per shape, before they are needed,
    and handed out as a copy: a forced call allocates what the call it
    replaces would (its values and its indices), so a measured peak is the
    step's own."""

    def __init__(self, routing: Routing, expect: list[RouterCall] | None) -> None:
        self.routing = routing
        self.expect = None if expect is None else {(c.op, c.experts, c.top_k) for c in expect}
        self._made: dict[tuple, torch.Tensor] = {}

    def _indices(self, shape: tuple[int, ...], dim: int, n: int, device) -> torch.Tensor:
        key = (shape, dim, n, str(device))
        if key not in self._made:
            self._made[key] = routed_indices(shape, dim, n, self.routing).to(device)
        return self._made[key]

    def call(self, func, args, kwargs):
        found = _api_pick(func, args, kwargs)
        if found is None:
            return func(*args, **kwargs)
        name, x, dim, k, keep = found
        if self.expect is not None and (_AS_OP[name], x.shape[dim], k) not in self.expect:
            return func(*args, **kwargs)
        shape = tuple(x.shape[:dim]) + (k,) + tuple(x.shape[dim + 1:])
        idx = self._indices(shape, dim, x.shape[dim], x.device).clone()
        if name in ("argmax", "argmin", "argsort"):
            return idx if keep else idx.squeeze(dim)
        values = torch.gather(x, dim, idx)
        if not keep:
            idx, values = idx.squeeze(dim), values.squeeze(dim)
        return getattr(torch.return_types, name)((values, idx))

    def wrap(self, func):
        def forced_pick(*args, **kwargs):
            return self.call(func, args, kwargs)

        forced_pick.__name__ = func.__name__
        return forced_pick


@contextmanager
def forced(routing="balanced", expect: list[RouterCall] | None = None):
    """Make real steps route as ``routing`` lays tokens out (for tests and
    benchmarks: measure the step a plan was made for).  Every routing decision
    (``topk``, ``max``/``argmax`` over a dim, ``sort``/``argsort`` of floating
    scores; only those matching ``expect`` when given) returns the routed
    indices and the scores at them, so autograd and the rest of the model see
    a consistent pick.

    While the block runs, ``torch.topk``, ``Tensor.topk`` and their kin are
    replaced by forcing wrappers (restored on exit).  That, not a mode, is
    deliberate: a checkpoint's recompute runs in the backward, where no
    ``TorchFunctionMode`` is active, and a dispatch mode over the whole step
    would change how autograd sums gradients (never in place), so the peak
    measured under it would not be the step's own.  A model that imported
    ``topk`` by name (``from torch import topk``) is not forced.

    Example::

        >>> with forced("balanced", plan_router_calls):
        ...     autosac.measure(model, x)
    """
    force = _Force(parse_routing(routing), expect)
    patched = [(owner, name, getattr(owner, name)) for owner in (torch, torch.Tensor) for name in sorted(_PICKS)
               if hasattr(owner, name)]
    try:
        for owner, name, func in patched:
            setattr(owner, name, force.wrap(func))
        yield
    finally:
        for owner, name, func in patched:
            setattr(owner, name, func)
