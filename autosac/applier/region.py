"""One checkpointed module at run time: its selective-checkpoint policy, the
checks that keep it correct, and what its replay does.

Each forward call of a decided module is a :class:`RegionCall`.  Its op calls
are matched to the plan's :attr:`~autosac.plan.Decision.calls` by position:

* **Forward.**  A dispatch mode beneath PyTorch's SAC caching mode sees every
  op call first: it records which earlier calls it reads
  (:mod:`autosac.dataflow`) and, when the call writes a tensor made outside the
  region (batch norm's running stats, a counter buffer, a parameter), keeps a
  copy of that tensor as it was.  The policy then keeps the plan's ``save``
  calls and recomputes the rest.
* **Checks, per call.**  An op that differs from the traced one at the same
  position (another branch, other shapes, ``eval()``), or that reads other
  results than traced, makes this call recompute everything from there on and
  skip nothing.  That warns once per module and kind, pointing at the user's
  code; the next call that matches is checkpointed as planned again.  Should a
  call write in place into an output the checkpoint cached after a re-run op
  read it (the plan never lets that happen; a call that departs from it might),
  its replay raises instead of computing a wrong gradient.
* **Replay.**  A dispatch mode beneath SAC's recompute mode sees exactly the
  calls SAC re-runs, in order.  Calls the plan marks dead (and only while the
  call matched the plan) return an empty tensor of the recorded shape; views,
  writes and random ops always run.  Outside tensors the region writes are
  read and written, in the replay, in a copy of them as they were when the
  region started, and the Python state the forward started from is swapped in
  for the replay (:mod:`autosac.pystate`): recomputation never updates
  anything twice.  PyTorch's SAC hands each cached output to one replay only;
  a replay in a backward that retains the graph (``retain_graph=True``,
  ``create_graph=True``) leaves the cache as it found it, so the next backward
  replays from the same cached outputs.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autosac.dataflow import DataflowTracker, arg_storages, tensors_in
from autosac.opkinds import op_kind
from autosac.plan import Decision
from autosac.pystate import State, capture


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
    warned: set[str] = field(default_factory=set, repr=False)

    @classmethod
    def from_decision(cls, d: Decision) -> RegionPolicy:
        """Raises TypeError/ValueError on malformed (hand-edited) entries."""
        calls = [(str(name), tuple(int(x) for x in deps)) for name, deps in d.calls]
        n = len(calls)
        save = frozenset(int(i) for i in d.save)
        skip = frozenset(int(i) for i in d.skip) - save
        if any(not 0 <= i < n for i in save | skip):
            raise ValueError(f"call index out of range in the decision for {d.fqn!r}")
        return cls(d.fqn, calls, save, skip, plain=not save and not bool(d.writes_outside))

    def start(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> RegionCall:
        """A new forward call of the module with these arguments."""
        call = RegionCall(self, capture(module, args, kwargs))
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
        self.n = 0
        self.last: tuple | None = None  # the call forward_op ran that SAC has not asked about yet
        self.pending: tuple | None = None  # SAC's answer for the call about to run, where it asks first
        self.answers: dict = defaultdict(list)  # per op, SAC's answers in call order ...
        self.asked_again: dict = defaultdict(int)  # ... and how many of them a re-run asked for again
        self.differs: str | None = None  # how the call first departed from the plan
        self.kind = ""  # "ops" or "flow": which way it departed
        self.unsafe: str | None = None  # a cached output written after a re-run op read it
        # per op name, one entry per call SAC re-runs, in order: the outputs'
        # shapes where the replay may skip the call, else None
        self.rerun: dict[str, list] = defaultdict(list)
        self.cached: set[int] = set()  # storages whose latest value the checkpoint caches
        self.read_cached: set[int] = set()  # ... and that a re-run call has read since
        # storages made outside the region that it writes in place: id -> their
        # contents when the region first wrote them (= at the region's start)
        self.outside: dict[int, torch.UntypedStorage] = {}

    # --------------------------------------------------------- forward
    # SAC asks its policy about each op call: after running it (torch >= 2.13,
    # the context carries ``op_output``) or before (earlier versions).  Either
    # way the decision rests on what is known before the call runs (its index,
    # name and inputs) and the bookkeeping on its outputs is done once it ran.

    def forward_op(self, func, args, kwargs):
        """Beneath SAC's caching mode: note reads and outside writes, run the op."""
        kind = op_kind(func)
        if kind.ignored:
            return func(*args, **kwargs)
        storages = arg_storages(args, kwargs)
        deps = tuple(self.flow.reads(args, kwargs, storages))
        written = kind.written_tensors(args, kwargs) if kind.written else []
        writes = []
        for value in written:
            st = value.untyped_storage()
            writes.append(id(st))
            if id(st) in self.read_cached and self.unsafe is None:
                self.unsafe = (f"{kind.name} (op call #{self.n}) wrote a cached output in place "
                               "after an op the replay re-runs had read it")
            if id(st) not in self.outside and not self.flow.produced_here(value):
                self.outside[id(st)] = st.clone()
        out = func(*args, **kwargs)
        self.flow.record(self.n, func, args, kwargs, out, storages, written)
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == self.n and pending[1] is func:  # SAC asked before the call
            self._note_outputs(self.n, kind, pending[2], out, storages, writes)
        else:
            self.last = (self.n, func, deps, out, storages, writes)
        self.n += 1
        return out

    def policy_fn(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        """SAC's question about an op call: the one :meth:`forward_op` just
        ran, or, where SAC asks first, the one it is about to run (and, in
        torch < 2.13, again when backward re-runs it: the same answer)."""
        if ctx.is_recompute:
            k = self.asked_again[id(func)]
            self.asked_again[id(func)] = k + 1
            answers = self.answers.get(id(func), ())
            return answers[k] if k < len(answers) else CheckpointPolicy.PREFER_RECOMPUTE
        if not hasattr(ctx, "op_output"):  # asked before the call runs
            decision = self._decide(self.n, func, tuple(self.flow.reads(args, kwargs)))
            self.pending = (self.n, func, decision)
            return decision
        if self.last is None or self.last[1] is not func:  # cannot happen: keep the region correct anyway
            self._depart("ops", "ran op calls that could not be followed")
            self.answers[id(func)].append(CheckpointPolicy.PREFER_RECOMPUTE)
            return CheckpointPolicy.PREFER_RECOMPUTE
        i, _, deps, out, reads, writes = self.last
        self.last = None
        decision = self._decide(i, func, deps)
        self._note_outputs(i, op_kind(func), decision, out, reads, writes)
        return decision

    def _decide(self, i: int, func, deps: tuple) -> CheckpointPolicy:
        """Save or recompute op call ``i``; notes where the call departs from the trace."""
        name = op_kind(func).name
        calls = self.policy.calls
        if self.differs is None:
            if i >= len(calls):
                self._depart("ops", f"ran more op calls than traced ({name} as call #{i})")
            elif calls[i][0] != name:
                self._depart("ops", f"ran {name} as op call #{i} where the trace ran {calls[i][0]}")
            elif calls[i][1] != deps:
                self._depart("flow", f"ran op call #{i} ({name}) on other results than in the trace")
        decision = CheckpointPolicy.MUST_SAVE if self.differs is None and i in self.policy.save \
            else CheckpointPolicy.PREFER_RECOMPUTE
        self.answers[id(func)].append(decision)
        return decision

    def _note_outputs(self, i: int, kind, decision, out, reads: list, writes: list[int]) -> None:
        """What the replay needs to know of call ``i`` once it ran (``reads``: its arguments' storages)."""
        outs = [id(t.untyped_storage()) for t in tensors_in(out)]
        if decision == CheckpointPolicy.MUST_SAVE:
            self.cached.update(outs)
            self.read_cached.difference_update(outs)
            return
        skip = self.differs is None and i in self.policy.skip
        if not skip and self.cached:
            self.read_cached.update(id(st) for st in reads if id(st) in self.cached)
        if self.unsafe is None and any(w in self.cached for w in writes):
            # the cached value already holds this write: the replay would write it twice
            self.unsafe = f"{kind.name} (op call #{i}), re-run in the replay, writes a cached output in place"
        self.rerun[kind.name].append(_shape_of(out) if skip else None)

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
        self.last = self.pending = None
        self.cached = self.read_cached = set()
        if self.differs is None or self.state.grew():
            return  # matched, or a first call that built lazy state (later calls match the steady-state trace)
        self.policy.warn(self.kind, (
            f"autosac: module '{self.policy.fqn}' {self.differs} (other inputs, shapes or mode than traced?). "
            "That call recomputes every op from the difference on and skips none: gradients are exact, "
            "recompute time is higher and its memory may differ from the plan's. Calls that match "
            "the plan stay checkpointed as planned; re-plan with the inputs you run."
        ))

    @property
    def may_skip(self) -> bool:
        return self.differs is None

    # ---------------------------------------------------------- replay
    def replay_op(self, func, args, kwargs, counts: dict[str, int], local: dict):
        """Beneath SAC's recompute mode: skip dead calls; reads and writes of
        outside tensors the region writes go to ``local``, the replay's own copy
        of them as they were at the region's start."""
        self.check_replayable()
        if self.outside:
            args, kwargs = tree_map(lambda a: self._local_view(a, local), (args, kwargs))
        kind = op_kind(func)
        if kind.ignored:
            return func(*args, **kwargs)
        name = kind.name
        k = counts[name]
        counts[name] = k + 1
        queue = self.rerun.get(name, ())
        shape = queue[k] if k < len(queue) else None
        if shape is not None and self.may_skip and not kind.view and not kind.written and not kind.random:
            return _empty_like_shape(shape)
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
        replay only swaps the Python state in.  Others get selective
        checkpointing with the dispatch modes the module docstring describes."""
        if self.policy.plain:
            return contextlib.nullcontext(), _StateSwap(self)
        forward, recompute = create_selective_checkpoint_contexts(self.policy_fn, allow_cache_entry_mutation=True)
        return _Nested(_Forward(self), forward), _Nested(_Replay(self, recompute), recompute)

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
    def __init__(self, call: RegionCall) -> None:
        super().__init__()
        self.call = call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.call.forward_op(func, args, kwargs or {})


class _Replay(TorchDispatchMode):
    """Entered once per replay: the forward's starting Python state is swapped
    in for its duration, the calls are counted from the start, and in a
    backward that retains the graph SAC's cache is left as it was found."""

    def __init__(self, call: RegionCall, recompute) -> None:
        super().__init__()
        self.call = call
        # SAC's cache, shared by its two modes: per op, its calls' cached outputs
        # (a dict by call index in torch >= 2.13, a list before)
        self.cache = getattr(recompute, "storage", None)
        self.counts: dict[str, int] = defaultdict(int)
        self.local: dict = {}
        self.after: State | None = None
        self.kept: list = []

    def __enter__(self):
        self.counts = defaultdict(int)
        self.local = {}
        self.call.asked_again.clear()  # torch < 2.13 asks again in each replay, from the first call on
        self.kept.append(_keep(self.cache))
        self.after = self.call.state.recapture()
        self.call.state.install()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _restore(self.cache, self.kept.pop())
            self.after.install()
            self.after = None
            self.local = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.call.replay_op(func, args, kwargs or {}, self.counts, self.local)


def _keep(cache):
    """SAC's cache as it is, where the backward about to replay retains the graph.

    PyTorch's SAC hands each cached output to one replay only (it marks the
    entry consumed, to free it early), so the next backward through a retained
    graph would raise "Trying to backward an extra time".  A backward that
    retains the graph keeps the region's saved tensors anyway: a copy of the
    cache made of new aliases of the same tensors (no data copied), put back by
    :func:`_restore` once the replay ended, lets the next backward replay from
    the same outputs.  New aliases, as the replay gives autograd history to the
    tensors it is handed, and a cached view handed out twice would refuse it.
    A backward that frees the graph consumes the cache as PyTorch does: nothing
    is held longer.  Outside a backward (Python reading a ``grad_fn``'s saved
    tensor) the graph is kept, and so is the cache."""
    if not cache or not torch._C._autograd._get_current_graph_task_keep_graph():
        return None
    return {key: _fresh(entries) for key, entries in cache.items()}


def _fresh(entries):
    """A copy of one op's cache entries (a dict by call index, or a list),
    each cached tensor a new alias with no autograd history."""
    def alias(leaf):
        val = getattr(leaf, "val", None)  # SAC wraps each cached tensor with its version
        if not isinstance(val, torch.Tensor):
            return leaf
        leaf = copy.copy(leaf)
        leaf.val = val.detach()
        return leaf

    if isinstance(entries, dict):
        return {i: tree_map(alias, e) for i, e in entries.items()}
    return [tree_map(alias, e) for e in entries]


def _restore(cache, kept) -> None:
    if kept is not None:
        cache.clear()
        cache.update(kept)


class _StateSwap:
    """The replay of a plainly checkpointed call: the forward's starting Python
    state swapped in for its duration (re-enterable, like :class:`_Replay`)."""

    def __init__(self, call: RegionCall) -> None:
        self.call = call
        self.after: list[State] = []

    def __enter__(self):
        self.call.check_replayable()
        self.after.append(self.call.state.recapture())
        self.call.state.install()
        return self

    def __exit__(self, *exc):
        self.after.pop().install()


class _Nested:
    """Enter ``below`` then ``above`` (so ``above`` sees each op first);
    re-enterable, as a second backward or ``create_graph`` may replay again."""

    def __init__(self, below, above) -> None:
        self.below, self.above = below, above
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self):
        stack = contextlib.ExitStack()
        stack.enter_context(self.below)
        stack.enter_context(self.above)
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc):
        return self._stacks.pop().__exit__(*exc)


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


_INTERNAL = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # autosac/
    os.path.dirname(os.path.abspath(torch.__file__)),
)


def warn_user(message: str) -> None:
    """Warn, attributed to the innermost frame of the user's own code: not
    autosac's or torch's, and not an installed library's where the user's script
    is further out (so filters on torch's warnings leave it alone)."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_INTERNAL):
            frames.append(frame)
        frame = frame.f_back
    if not frames:
        warnings.warn(message, UserWarning, stacklevel=2)
        return
    own = [f for f in frames if "-packages" + os.sep not in f.f_code.co_filename]
    frame = (own or frames)[0]
    warnings.warn_explicit(
        message, UserWarning, frame.f_code.co_filename, frame.f_lineno,
        module=frame.f_globals.get("__name__", "__main__"),
        registry=frame.f_globals.setdefault("__warningregistry__", {}),
    )
