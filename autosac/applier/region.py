"""One checkpointed module at run time: its selective checkpointing, the
checks that keep it correct, and what its replay does.

Each forward call of a decided module is a :class:`RegionCall`, run under
``torch.utils.checkpoint`` (non-reentrant) with one dispatch mode of ours in
the forward and one in the replay -- not PyTorch's two selective-checkpoint
modes with ours beneath them: a Python dispatch mode costs every op call it
sees, and this path costs less per op than PyTorch's
(``benchmarks/bench_selective_op_cost.py``).  Op calls are matched to the
plan's :attr:`~autosac.core.plan.Decision.calls` by position:

* **Forward.**  Every op call is run and checked: which earlier calls it reads
  (:mod:`autosac.core.dataflow`), and, when it writes a tensor made outside the
  region (batch norm's running stats, a counter buffer, a parameter), a copy
  of that tensor as it was.  The plan's ``save`` calls have their outputs
  cached (new aliases, no autograd history); all other calls are recomputed.
* **Checks, per call.**  An op that differs from the traced one at the same
  position (another branch, other shapes, ``eval()``), or that reads other
  results than traced, makes this call recompute everything from there on and
  skip nothing.  That warns once per module and kind, pointing at the user's
  code; the next call that matches is checkpointed as planned again.  Should a
  call write in place into an output the cache holds after a re-run op read it
  (the plan never lets that happen; a call that departs from it might), its
  replay raises instead of computing a wrong gradient.
* **Replay.**  The same op calls again, in order, each checked to be the op
  the forward ran at that position (global state changed between forward and
  backward raises rather than handing a cached output to the wrong op); the
  one extra op allowed is autocast casting a weight the forward found in
  autocast's weight cache (a module called twice in one autocast region).
  Cached calls return their outputs; calls the plan marks dead (and only
  while the call matched the plan) return an empty tensor of the recorded
  shape; views, writes and random ops always run.  Outside tensors the region
  writes are read and written, in the replay, in a copy of them as they were
  when the region started, and the Python state the forward started from is
  swapped in for the replay (:mod:`autosac.core.pystate`; with Python's and
  NumPy's global generators and the module's own ``torch.Generator`` where
  the traced forward drew from them): recomputation never updates anything
  twice, and draws what the forward drew.  A replay in a backward that frees
  the graph hands each cached output over and drops it (as early as PyTorch's
  own SAC frees it); one that retains the graph (``retain_graph=True``, ``create_graph=True``)
  hands out new aliases and keeps the cache for the next backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from autosac.applier.compiled import compiled_context_fn
from autosac.core.dataflow import DataflowTracker, arg_storages, tensors_in
from autosac.core.opkinds import op_kind
from autosac.core.plan import Decision
from autosac.core.pystate import State, capture
from autosac.core.userwarn import warn_user


@dataclass
class RegionPolicy:
    """Plan-derived answers for one decided module, and what it has warned about."""

    fqn: str
    calls: list[tuple[str, tuple[int, ...]]]
    save: frozenset[int]
    skip: frozenset[int]
    # recompute everything, and the trace saw no write to a tensor made outside:
    # plain checkpointing does it, with no per-op work (see RegionCall.contexts)
    plain: bool = False
    # its forward draws from Python's or NumPy's global generator or a torch.Generator (or may: unknown):
    # their states are captured per call
    host_rng: bool = True
    warned: set[str] = field(default_factory=set, repr=False)
    # torch.utils.checkpoint's context_fn under torch.compile (autosac.applier.compiled):
    # built once here, so Dynamo finds a constant rather than tracing its making
    compiled_context_fn: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.compiled_context_fn is None:
            self.compiled_context_fn = compiled_context_fn(self.calls, self.save)

    @classmethod
    def from_decision(cls, d: Decision) -> RegionPolicy:
        """Raises TypeError/ValueError on malformed (hand-edited) entries."""
        calls = [(str(name), tuple(int(x) for x in deps)) for name, deps in d.calls]
        n = len(calls)
        save = frozenset(int(i) for i in d.save)
        skip = frozenset(int(i) for i in d.skip) - save
        if any(not 0 <= i < n for i in save | skip):
            raise ValueError(f"call index out of range in the decision for {d.fqn!r}")
        return cls(d.fqn, calls, save, skip, plain=not save and not bool(d.writes_outside),
                   host_rng=d.host_rng is not False)

    def start(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> RegionCall:
        """A new forward call of the module with these arguments."""
        call = RegionCall(self, capture(module, args, kwargs, self.host_rng))
        if self.plain:
            call.watch_versions([*module.buffers(), *tensors_in(args, kwargs)])
        return call

    def warn(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            warn_user(message)


class RegionCall:
    """One forward call of a checkpointed module (see the module docstring)."""

    def __init__(self, policy: RegionPolicy, state: State) -> None:
        self.policy = policy
        self.state = state
        self.flow: DataflowTracker | None = None if policy.plain else DataflowTracker()
        self.watched: list[tuple[torch.Tensor, int]] = []  # (tensor, its version) where plain
        self.n = 0  # op calls the forward ran (those a selective policy sees)
        self.funcs: list = []  # ... each one's op overload, for the replay to follow
        self.weight_casts: dict[int, torch.Tensor] = {}  # ... those that cast a weight under autocast -> it
        self.cache: dict[int, object] = {}  # call index -> its outputs, detached, where the call is saved
        self.shapes: dict[int, object] = {}  # call index -> its outputs' shapes, where the replay may skip it
        self.differs: str | None = None  # how the call first departed from the plan
        self.hint = _OTHER_INPUTS  # (the likely cause, the fix) said with it
        # an autocast region keeping weight casts is open (read by contexts(), before any op: inside an op,
        # autocast's keys are off); a plain call never asks
        self.autocast_caching = False
        self.kind = ""  # "ops" or "flow": which way it departed
        self.unsafe: str | None = None  # a cached output written after a re-run op read it
        self.cached: set[int] = set()  # storages whose latest value the cache holds
        self.read_cached: set[int] = set()  # ... and that a re-run call has read since
        # storages made outside the region that it writes in place: id -> their
        # contents when the region first wrote them (= at the region's start)
        self.outside: dict[int, torch.UntypedStorage] = {}

    # --------------------------------------------------------- forward
    def forward_op(self, func, kind, args, kwargs):
        """One op call of the forward (not one of ``SAC_IGNORED_OPS``): run it,
        check it against the plan, note what it read and wrote, and cache its
        outputs where the plan saves it."""
        i = self.n
        self.n = i + 1
        self.funcs.append(func)
        if func is _TO_COPY and _autocast_weight_cast(args):
            self.weight_casts[i] = args[0]
        storages = arg_storages(args, kwargs)
        if kind.written:
            written = kind.written_tensors(args, kwargs)
            writes = [self._note_write(i, kind, value) for value in written]
        else:
            written = writes = ()
        out = func(*args, **kwargs)
        deps = self.flow.step(i, kind, storages, out, written)
        if self.differs is None:
            calls = self.policy.calls
            if i >= len(calls) or calls[i][0] != kind.name or calls[i][1] != deps:
                self._depart_at(i, kind.name, deps)
        if self.differs is None:
            if i in self.policy.save:
                self.cache[i] = tree_map(_detach, out)
                outs = [id(t.untyped_storage()) for t in tensors_in(out)]
                self.cached.update(outs)
                self.read_cached.difference_update(outs)
                return out
            if i in self.policy.skip:
                self.shapes[i] = _shape_of(out)
                skip = True
            else:
                skip = False
        else:
            skip = False
        cached = self.cached
        if cached:
            if not skip:
                for st in storages:
                    if id(st) in cached:
                        self.read_cached.add(id(st))
            if writes and self.unsafe is None and any(w in cached for w in writes):
                # the cached value already holds this write: the replay would write it twice
                self.unsafe = f"{kind.name} (op call #{i}), re-run in the replay, writes a cached output in place"
        return out

    def _depart_at(self, i: int, name: str, deps: tuple) -> None:
        """Note how op call ``i`` departs from the traced one at its position."""
        calls = self.policy.calls
        if i >= len(calls):
            self._depart("ops", f"ran more op calls than traced ({name} as call #{i})")
        elif calls[i][0] != name:
            self._depart("ops", f"ran {name} as op call #{i} where the trace ran {calls[i][0]}")
            if calls[i][0] == "_to_copy" and not calls[i][1] and self.autocast_caching:
                self.hint = _CACHED_CASTS
        else:
            self._depart("flow", f"ran op call #{i} ({name}) on other results than in the trace")

    def _note_write(self, i: int, kind, value: torch.Tensor) -> int:
        """Before op call ``i`` writes ``value`` in place: keep a tensor made
        outside the region as it was, and catch a write into a cached output
        that a re-run call has read.  Returns the storage's id."""
        st = value.untyped_storage()
        if id(st) in self.read_cached and self.unsafe is None:
            self.unsafe = (f"{kind.name} (op call #{i}) wrote a cached output in place "
                           "after an op the replay re-runs had read it")
        if id(st) not in self.outside and not self.flow.produced_here(value):
            self.outside[id(st)] = st.clone()
        return id(st)

    def _depart(self, kind: str, what: str) -> None:
        self.differs, self.kind = what, kind

    def watch_versions(self, tensors: list[torch.Tensor]) -> None:
        """Plain checkpointing: note these tensors' versions, to tell after the
        forward whether it wrote any of them in place (which the trace did not show)."""
        self.watched = [(t, t._version) for t in tensors]

    def finish(self) -> None:
        """After the forward: report how this call departed from the plan."""
        if self.policy.plain:
            written = [t for t, v in self.watched if t._version != v]
            self.watched = []
            if written and self.unsafe is None:
                self.unsafe = (f"its forward wrote {len(written)} tensor(s) made before it in place "
                               f"(shape {tuple(written[0].shape)}), which the traced forward did not")
            return
        if self.differs is None and self.n < len(self.policy.calls):
            self._depart("ops", f"ran {self.n} op calls where the trace ran {len(self.policy.calls)}")
        self.flow = None  # its weak references are no longer needed
        self.cached = self.read_cached = set()
        if self.differs is not None:
            self.shapes = {}  # a later call departed: one it reads may be a skipped one
        if self.differs is None or self.state.grew():
            return  # matched, or a first call that built lazy state (later calls match the steady-state trace)
        self.policy.warn(self.kind, (
            f"autosac: module '{self.policy.fqn}' {self.differs} ({self.hint[0]}). "
            "That call recomputes every op from the difference on and skips none: gradients are exact, "
            "recompute time is higher and its memory may differ from the plan's. Calls that match "
            f"the plan stay checkpointed as planned; {self.hint[1]}."
        ))

    # ---------------------------------------------------------- replay
    def ran(self, k: int, func) -> bool:
        """Whether the forward ran ``func`` as its op call ``k``."""
        return k < len(self.funcs) and self.funcs[k] is func

    def replay_op(self, func, kind, args, kwargs, k: int, local: dict, keep: bool):
        """Op call ``k`` of the replay (not one of ``SAC_IGNORED_OPS``): the
        cached outputs where the forward saved it (new aliases where the
        backward retains the graph: ``keep``), an empty tensor where it is
        dead, else the op re-run.  Reads and writes of outside tensors the
        region writes go to ``local``, the replay's own copy of them as they
        were at the region's start."""
        if not self.ran(k, func):
            ran = self.funcs[k].__name__ if k < len(self.funcs) else "nothing"
            raise RuntimeError(
                f"autosac: module '{self.policy.fqn}' replayed {func.__name__} as op call #{k} where its forward "
                f"ran {ran}: its forward depends on state that changed before the backward (a global flag, "
                "a tensor's values read in Python). Keep that state fixed between forward and backward, or "
                "unapply the plan"
            )
        if k in self.cache:
            if keep:
                return tree_map(_detach, self.cache[k])
            return self.cache.pop(k)  # handed to this replay only: freed as soon as it no longer needs it
        shape = self.shapes.get(k)
        if shape is not None and not kind.view and not kind.written and not kind.random:
            return _empty_like_shape(shape)
        if self.outside:
            args, kwargs = tree_map(lambda a: self._local_view(a, local), (args, kwargs))
        return func(*args, **kwargs)

    def check_replayable(self) -> None:
        """Raise when this call's replay could not recompute what its forward computed."""
        if self.unsafe is not None:
            raise RuntimeError(
                f"autosac: module '{self.policy.fqn}' cannot replay this call exactly: {self.unsafe} "
                "(its forward departed from the traced one). Re-plan with the inputs you run, or unapply the "
                "plan for this step"
            )

    def _local_view(self, a, local: dict):
        if not isinstance(a, torch.Tensor):
            return a
        key = id(a.untyped_storage())
        if key not in self.outside:
            return a
        if key not in local:
            local[key] = self.outside[key].clone()
        view = torch.empty(0, dtype=a.dtype, device=a.device)
        return view.set_(local[key], a.storage_offset(), a.size(), a.stride())

    # -------------------------------------------------------- contexts
    def contexts(self):
        """``context_fn`` for ``torch.utils.checkpoint``: (forward, recompute) contexts.

        A region that recomputes everything and writes nothing made outside
        (as traced) needs no per-op work: the forward runs as is and the
        replay only swaps the Python state in.  Others run under one dispatch
        mode each way, :class:`_Forward` and :class:`_Replay`."""
        if self.policy.plain:
            return contextlib.nullcontext(), _StateSwap(self)
        self.autocast_caching = _autocast_caching()
        return _Forward(self), _Replay(self)

    def wrap(self, fn, args: tuple, kwargs: dict):
        """``fn`` with ``kwargs`` bound, and positional tensors that were one
        object in the forward made one object again in the replay (checkpoint
        hands saved inputs back as new tensor objects; code like
        ``nn.MultiheadAttention`` branches on ``query is key``)."""
        firsts: dict[int, int] = {}
        same = []
        for j, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                i = firsts.setdefault(id(a), j)
                if i != j:
                    same.append((i, j))
        kw_same = {k: firsts[id(v)] for k, v in kwargs.items() if isinstance(v, torch.Tensor) and id(v) in firsts}

        def run(*a):
            if same or kw_same:
                a = list(a)
                for i, j in same:
                    a[j] = a[i]
                kw = {**kwargs, **{k: a[i] for k, i in kw_same.items()}}
                return fn(*a, **kw)
            return fn(*a, **kwargs)

        return run


class _Forward(TorchDispatchMode):
    """The selective forward: every op call, once, through :meth:`RegionCall.forward_op`."""

    def __init__(self, call: RegionCall) -> None:
        super().__init__()
        self.call = call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = op_kind(func)
        if kind.ignored:
            return func(*args, **(kwargs or {}))
        return self.call.forward_op(func, kind, args, kwargs or {})


class _Replay(TorchDispatchMode):
    """The selective replay: entered once per backward that recomputes the
    call; the forward's starting Python state is swapped in for its duration
    and its op calls are counted from the start.  A backward that retains the
    graph (``retain_graph=True``, ``create_graph=True``) leaves the cache as
    it found it, so the next one replays from the same cached outputs; one
    that frees the graph hands each cached output over and drops it."""

    def __init__(self, call: RegionCall) -> None:
        super().__init__()
        self.call = call
        self.k = 0
        self.keep = False
        self.local: dict = {}
        self.after: list[State] = []
        self.autocast: set[str] = set()  # the devices whose autocast may hand out cached weight casts

    def __enter__(self):
        self.call.check_replayable()
        self.k = 0
        self.local = {}
        # read here, where checkpoint has restored the forward's autocast: beneath the dispatcher's autocast
        # layer (in __torch_dispatch__) autocast reads as off
        self.autocast = {d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)} \
            if torch.is_autocast_cache_enabled() else set()
        # outside a backward (Python reading a grad_fn's saved tensor) the graph is kept, and so is the cache
        self.keep = torch._C._autograd._get_current_graph_task_keep_graph()
        self.after.append(self.call.state.swap_in())
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.after.pop().install()
            self.local = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = op_kind(func)
        if kind.ignored:
            return func(*args, **(kwargs or {}))
        if self.call.weight_casts or func is _TO_COPY:
            weight = args[0] if func is _TO_COPY and _autocast_weight_cast(args) else None
            if not self._follow_weight_casts(weight):
                # the replay casts a weight the forward found cast already in autocast's cache (a module
                # called twice in one autocast region; the replay's cache is fresh): the same values
                return func(*args, **(kwargs or {}))
        k = self.k
        self.k = k + 1
        return self.call.replay_op(func, kind, args, kwargs or {}, k, self.local, self.keep)

    def _follow_weight_casts(self, weight) -> bool:
        """Line the replay up with the forward's weight casts around op call
        ``self.k``; ``weight``: what this replay op casts (None: no weight cast).
        Weight casts the forward made at ``k`` that a replay inside the same
        autocast region finds in autocast's cache (a backward run in the
        ``torch.autocast`` block) are passed over.  Returns False where this op
        is a cast the forward did not make (it found it cached): run as is."""
        casts, k = self.call.weight_casts, self.k
        while k in casts and casts[k] is not weight and casts[k].device.type in self.autocast:
            k += 1
        if weight is not None and casts.get(k) is not weight:
            return False
        for skipped in range(self.k, k):
            self.call.cache.pop(skipped, None)  # never read: the replay has the cast from autocast
        self.k = k
        return True


_TO_COPY = torch.ops.aten._to_copy.default


_OTHER_INPUTS = ("other inputs, shapes or mode than traced?", "re-plan with the inputs you run")
# where the trace cast a weight and the forward found it cast: autocast's cache, kept for the whole region
_CACHED_CASTS = ("the weights' casts were in autocast's cache: a forward after another in one torch.autocast "
                 "region reuses the first one's casts, where the traced forward made them",
                 "enter torch.autocast once per forward (around forward and loss) to keep every call as planned")


def _autocast_caching() -> bool:
    """Whether an autocast region is open here and keeps its weight casts."""
    return torch.is_autocast_cache_enabled() and any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def _autocast_weight_cast(args) -> bool:
    """Whether a ``_to_copy`` with these arguments casts a weight (a leaf that
    requires grad) that autocast's weight cache keeps: the forward may have
    found it cached (a module called twice in one autocast region) where the
    replay, under a fresh cache, casts it."""
    return (bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_leaf and args[0].requires_grad
            and torch.is_autocast_cache_enabled())


def _detach(x):
    """A new alias of a cached output with no autograd history, sharing its
    version counter (a view made beneath autograd would not, unless its
    in-place-or-view key runs), so a later write to it shows."""
    if not isinstance(x, torch.Tensor):
        return x
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


class _StateSwap:
    """The replay of a plainly checkpointed call: the forward's starting Python
    state swapped in for its duration (re-enterable, like :class:`_Replay`)."""

    def __init__(self, call: RegionCall) -> None:
        self.call = call
        self.after: list[State] = []

    def __enter__(self):
        self.call.check_replayable()
        self.after.append(self.call.state.swap_in())
        return self

    def __exit__(self, *exc):
        self.after.pop().install()


@dataclass(frozen=True)
class _Shape:
    size: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


def _shape_of(x):
    """An op's outputs with each tensor replaced by its :class:`_Shape`."""
    if isinstance(x, torch.Tensor):
        return _Shape(tuple(x.shape), tuple(x.stride()), x.dtype, x.device)
    if isinstance(x, (list, tuple)):
        out = [_shape_of(v) for v in x]
        return out if isinstance(x, list) else tuple(out)
    return x


def _empty_like_shape(x):
    """Empty tensors where :func:`_shape_of` put shapes."""
    if isinstance(x, _Shape):
        return torch.empty_strided(x.size, x.stride, dtype=x.dtype, device=x.device)
    if isinstance(x, (list, tuple)):
        out = [_empty_like_shape(v) for v in x]
        return out if isinstance(x, list) else tuple(out)
    return x
