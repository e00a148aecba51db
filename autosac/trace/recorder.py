"""Record one training step op by op: where each op ran, what it cost, and
when every tensor storage was born, saved for backward, and freed.

Three observers feed one :class:`Recording`:

* a ``TorchDispatchMode`` sees every aten op (cost, outputs, in-place writes);
* weakref callbacks on storages see frees the moment the last view dies;
* saved-tensor hooks see which storages autograd keeps for backward.

Backward ops are attributed to the module whose forward created their autograd
node: forward outputs' ``grad_fn`` sequence numbers are mapped to the module
stack of the op that produced them (:mod:`autosac.trace.nodes`).

Each op becomes one :class:`~autosac.trace.recording.OpRecord`, filed into the
recording's per-op columns.  How an op runs (fake, or for real when small) is
:mod:`autosac.trace.execution`; the real-kernel probes for scratch memory and
output sizes are :mod:`autosac.trace.probes`; the real tensors the trace meets
(another device's, ones a fake op wrote) are :mod:`autosac.trace.real_tensors`;
autograd's re-making of a view written in place, which the real step does not
dispatch, is :mod:`autosac.trace.view_rebuilds`.
"""

from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from autosac.core.dataflow import DataflowTracker
from autosac.core.opkinds import is_param_cast, is_random_op, is_view_op, writes_input, written_tensors
from autosac.trace.costs import CostModel, transient_bytes
from autosac.trace.execution import run_op, with_kernel_layout
from autosac.trace.nodes import NodeOrigins
from autosac.trace.probes import (
    PROBE_CAP_FLOPS,
    REAL_SIZE_OPS,
    dtypes_key,
    needs_probe,
    norm_stat_bytes,
    number_in_tensor_slot,
    probed_scratch_bytes,
    real_output_bytes,
    saved_number_bytes,
    scalar_scratch_bytes,
)
from autosac.trace.real_tensors import RealTensors, same_layout
from autosac.trace.recording import OpRecord, Recording, Stack, StorageRecord, common_prefix
from autosac.trace.routing import RoutingTrace
from autosac.trace.view_rebuilds import rebuilds, view_written

_CASTS = {"_to_copy", "to", "type_as"}


def _without_graph(t):
    """What a saved-tensor hook keeps of ``t``: an alias with no ``grad_fn``
    (autograd gives the unpacked tensor its node back).  Kept as ``t`` itself,
    an output its own node saves (``exp``, ``tanh``, ``sigmoid``) would hold
    that node, which holds it: a cycle through C++ no collector breaks, so a
    result no backward reads -- the unused ``std``/``var`` of diffusers'
    ``DiagonalGaussianDistribution`` -- stayed alive in the trace to the step's
    end, where the real step frees it with its last reference.  Detached with
    the dispatch modes off: no op is recorded."""
    if not isinstance(t, torch.Tensor) or t.grad_fn is None:
        return t
    with _disable_current_modes():
        return t.detach()


def _unpack_detach(func, args, unpacked) -> bool:
    """Whether ``func`` is autograd's shallow copy of the saved tensor a
    saved-tensor hook just gave back (``unpacked``).  Autograd makes it by
    detaching, which for a tensor a Python dispatch mode sees (a fake, the
    trace's) is an ``aten.detach`` call; for a plain tensor it is a C++ copy of
    the tensor's header that no dispatcher sees.  Counted as an op, it was
    188 of transformers Qwen3's 894 backward events at width 64, priced as
    many view calls, where the real backward has one ``detach`` per parameter
    (its gradient's, kept)."""
    return func is torch.ops.aten.detach.default and len(args) == 1 and args[0] is unpacked


# the ops a derivative formula makes its zeros with, and the ones it fills them
# with, in place on real tensors (gather's, sort's, topk's, index_select's,
# index's backwards), out of place on tensor subclasses
_ZERO_FILLS = frozenset({"zeros", "zeros_like", "new_zeros"})
_FILLS = frozenset({"scatter", "scatter_add", "index_add", "index_put", "index_copy", "masked_scatter"})


class _Packed:
    """A tensor saved in the forward and which save it was (``Recording.save_points``):
    one per save, as a checkpoint's holders are, so each read in the backward is known."""

    __slots__ = ("t", "point")

    def __init__(self, t, point: int) -> None:
        self.t, self.point = t, point


class StepRecorder(TorchDispatchMode):
    """Dispatch mode that fills a :class:`Recording` while one step runs."""

    def __init__(self, cost_model: CostModel) -> None:
        super().__init__()
        self.rec = Recording()
        self.cost = cost_model
        self.phase = "forward"
        self.stack: list[str] = []
        self._stack_t: Stack = ()
        self._by_storage: dict[int, int] = {}  # id(storage) -> index in rec.storages
        self._refs: dict[int, weakref.ref] = {}
        self._param_of_storage: dict[int, str] = {}  # id(storage) -> param fqn
        self._param_of: dict[str, torch.Tensor] = {}
        self._param_stack: dict[int, Stack] = {}  # id(param) -> owner module stack
        self._pending: list[tuple[weakref.ref, Stack, int, int]] = []  # (output, stack, event, its version then)
        self._nodes = NodeOrigins()  # the forward's autograd nodes -> the stack and event that made them
        self._flow = DataflowTracker()
        self._engine_sums: list[tuple[int, int]] = []  # (event, storage it may have written in place)
        self._number_args: dict[int, int] = {}  # forward events with a number in a Tensor argument -> in-place bytes
        self.device_type = "cpu"  # the device the traced step's tensors are on
        self.fake_mode = None  # the trace's FakeTensorMode (writes into the model's real tensors go to fakes)
        self.small_values = True  # small cpu ops run for real (see run_op)
        self.routing = RoutingTrace()  # MoE routing decisions get real indices (autosac.trace.routing)
        self._real = RealTensors(self._flow)  # real tensors the trace meets: twins, stale ones (trace.real_tensors)
        self._written_view: tuple | None = None  # an in-place op's written view, until the next op (view_written)
        self._unpacked = None  # the tensor a saved-tensor unpack just returned, until the next op (_unpack_detach)
        self.random_branch = False  # the forward failed reading a value drawn at random (LayerDrop)

    # ----------------------------------------------------------- storages
    def track(
        self, t: torch.Tensor, kind: str, created: int = -1, producer: int = -1, nbytes: int | None = None
    ) -> int:
        """Register ``t``'s storage (once) and return its record index."""
        st = t.untyped_storage()
        key = id(st)
        idx = self._by_storage.get(key)
        if idx is not None:
            return idx
        idx = len(self.rec.storages)
        self.rec.storages.append(StorageRecord(st.nbytes() if nbytes is None else nbytes, kind, created, producer))
        self._by_storage[key] = idx
        self._refs[idx] = weakref.ref(st, self._on_free(key, idx))
        return idx

    def _on_free(self, key: int, idx: int):
        def callback(_ref) -> None:
            self.rec.storages[idx].freed = len(self.rec.ops)
            if self._by_storage.get(key) == idx:
                del self._by_storage[key]
            self._refs.pop(idx, None)

        return callback

    def track_param(self, fqn: str, p: torch.Tensor, owner: Stack) -> None:
        self.track(p, "param")
        self._param_of_storage[id(p.untyped_storage())] = fqn
        self._param_of[fqn] = p
        self._param_stack[id(p)] = owner
        self.rec.param_dtypes.setdefault(fqn, set())

    def relabel(self, t: torch.Tensor, kind: str) -> None:
        idx = self._by_storage.get(id(t.untyped_storage()))
        if idx is not None:
            self.rec.storages[idx].kind = kind

    def _made_in_trace(self, t: torch.Tensor) -> bool:
        record = self.record_of(t)
        return record is not None and record.producer >= 0

    def index_of(self, t: torch.Tensor) -> int | None:
        return self._by_storage.get(id(t.untyped_storage()))

    def record_of(self, t: torch.Tensor) -> StorageRecord | None:
        idx = self._by_storage.get(id(t.untyped_storage()))
        return None if idx is None else self.rec.storages[idx]

    # ------------------------------------------------------ module stack
    def push(self, fqn: str) -> None:
        self._flush_pending()
        self.stack.append(fqn)
        self._stack_t = tuple(self.stack)
        self.rec.fw_pre_order.append(fqn)
        self.rec.fw_windows.setdefault(fqn, []).append((len(self.rec.ops), -1))

    def pop(self, fqn: str) -> None:
        self._flush_pending()
        if self.stack and self.stack[-1] == fqn:
            self.stack.pop()
        self._stack_t = tuple(self.stack)
        self.rec.fw_post_order.append(fqn)
        windows = self.rec.fw_windows[fqn]
        windows[-1] = (windows[-1][0], len(self.rec.ops))

    def _flush_pending(self) -> None:
        """Map the autograd nodes of the last op's outputs to the module stack
        that made them.

        A view the op wrote in place is never asked for its ``grad_fn``: autograd
        rebuilds that node under the view's own lock, and an op the rebuild
        dispatches lands here while the lock is held (``x.view(...).relu_()``):
        asking again would wait on it for ever, a hang no signal ends.  The
        op's node is its base's (``CopySlices``), read without that lock."""
        for ref, stack, event, version in self._pending:
            t = ref()
            if t is None:
                continue
            written_view = t._is_view() and t._version != version
            node = t._base.grad_fn if written_view else t.grad_fn
            if node is None:
                continue
            if event in self._number_args:
                if written_view:
                    self._hold_numbers(node, event, self._number_args[event])
                else:
                    self._track_saved_numbers(node, event)
            self._nodes.add(node, stack, event)
        self._pending.clear()
        self._number_args.clear()

    def _hold_numbers(self, node, event: int, nbytes: int) -> None:
        """The numbers an in-place op on a view keeps, inside a ``CopySlices``
        node that shows no saved values: ``nbytes`` (:func:`~autosac.trace.probes.saved_number_bytes`)
        live from ``event`` until that node's backward has run."""
        if not nbytes:
            return
        i = len(self.rec.storages)
        self.rec.storages.append(StorageRecord(nbytes, "act", created=event))

        def released(grad_inputs, grad_outputs) -> None:
            if self.rec.storages[i].freed is None:
                self.rec.storages[i].freed = len(self.rec.ops)

        node.register_hook(released)

    def _track_saved_numbers(self, node, event: int) -> None:
        """Count the numbers an op took as 0-dim tensors that its backward node
        keeps (``x * 0.5`` keeps 0.5 as an 8-byte tensor).  Autograd saves these
        without saved-tensor hooks, so a checkpoint cannot discard them either:
        they live until the node's backward, checkpointed or not."""
        for name in dir(node):
            if name.startswith("_saved_"):
                v = getattr(node, name)
                if self._is_loose_scalar(v):
                    self.track(v, "act", created=event)

    def _note_engine_sum(self, func, args, kwargs, idx: int) -> None:
        """The engine sums two gradients for one input out of place on fake
        tensors, but in place into the first when it holds the last reference
        to a dense tensor (and grad mode is off): remember such sums, settled
        in :meth:`finish` once it is known whether that reference was the last."""
        if (
            self._nodes.applying or func is not torch.ops.aten.add.Tensor or torch.is_grad_enabled()
            or kwargs.get("alpha", 1) != 1 or len(args) != 2
        ):
            return
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
            return
        if old.dtype != torch.result_type(old, new) or torch.broadcast_shapes(old.shape, new.shape) != old.shape:
            return
        if not old.is_contiguous() or old.untyped_storage().nbytes() != old.numel() * old.element_size():
            return
        if old._is_view():  # a view made in the backward keeps its base: its storage has two holders
            return
        i = self.index_of(old)
        if i is not None and self.rec.storages[i].kind == "temp":
            self._engine_sums.append((idx, i))

    def _note_functional_fill(self, func, args, outs, idx: int) -> None:
        """Derivative formulas that fill zeros (``gather``'s backward scatters
        the gradient into them) write in place on plain tensors and out of
        place on tensor subclasses, fakes included: such a fill (not in a
        custom ``autograd.Function``, whose backward runs as written), on
        zeros the backward just made, is settled in :meth:`finish` as in
        place when those zeros die with it."""
        if func.overloadpacket.__name__ not in _FILLS or len(outs) != 1 or torch.is_grad_enabled():
            return
        if isinstance(torch._C._current_autograd_node(), torch.autograd.function.BackwardCFunction):
            return  # a custom Function's backward runs as written, out of place on real tensors too
        i = self.index_of(args[0])
        if i is None or not same_layout(args[0], outs[0]):
            return
        r = self.rec.storages[i]
        if r.kind == "temp" and 0 <= r.producer < idx and self.rec.ops[r.producer] in _ZERO_FILLS:
            self._engine_sums.append((idx, i))

    # ------------------------------------------------------ saved tensors
    def pack(self, t: torch.Tensor):
        if self.phase == "forward" and isinstance(t, torch.Tensor):
            point = len(self.rec.save_points)
            self.rec.save_points.append((len(self.rec.ops), self._stack_t))
            # which call of each module on the stack: a call's last output and the next call's first input,
            # back to back, are saved at one position
            self.rec.save_calls.append(tuple(len(self.rec.fw_windows[f]) - 1 for f in self._stack_t))
            idx = self._by_storage.get(id(t.untyped_storage()))
            if idx is not None:
                rec = self.rec.storages[idx]
                stack = self._stack_t
                rec.saver_stack = stack if rec.saver_stack is None else common_prefix(rec.saver_stack, stack)
                rec.saver_stacks.add(stack)
                rec.saved_as_view = rec.saved_as_view or t._is_view()
            return _Packed(_without_graph(t), point)
        return _without_graph(t)

    def unpack(self, packed):
        """The saved tensor back; in the backward, when it is first read (a
        checkpointed region re-runs its forward at its first such read)."""
        if not isinstance(packed, _Packed):
            return packed
        if self.phase == "backward":
            self.rec.unpacks.append((len(self.rec.ops), packed.point))
        self._unpacked = packed.t
        return packed.t

    # ------------------------------------------------------------- ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("prim", "profiler"):
            return func(*args, **kwargs)
        unpacked, self._unpacked = self._unpacked, None
        if unpacked is not None and _unpack_detach(func, args, unpacked):
            return func(*args, **kwargs)  # autograd's copy of a saved tensor: the real step dispatches no op for it
        args, kwargs = self._real.as_traced(args, kwargs, self.fake_mode)
        if self._pending:
            self._flush_pending()
        written_view, self._written_view = self._written_view, None
        ran, routed = self._run(func, args, kwargs)
        rebuilding = written_view is not None and rebuilds(func, ran, written_view)
        if rebuilding is not False:
            self._written_view = written_view if rebuilding else None
            return ran  # autograd rebuilding a written view's node: the real step dispatches no op for it
        if writes_input(func) and not is_view_op(func):
            self._real.note_written(func, args, kwargs, ran)
            self._written_view = view_written(func, args, kwargs)
        out = with_kernel_layout(func, args, ran, kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        op = self._op_record(func, args, kwargs, out, outs)
        idx = self.rec.add_op(op)
        if routed:
            self.rec.routed.add(idx)
        self._note_scratch(func, args, kwargs, idx, op.flops, outs)
        if op.phase == "backward":
            self._note_engine_sum(func, args, kwargs, idx)
            self._note_functional_fill(func, args, outs, idx)
        elif op.phase == "forward":
            deps = self._flow.reads(args, kwargs)
            if deps:
                self.rec.inputs[idx] = deps
            self._flow.record(idx, func, args, kwargs, out)
        self._track_outputs(func, args, kwargs, outs, idx, "act" if op.phase == "forward" else "temp")
        if op.phase == "forward":
            self._after_forward_op(func, args, kwargs, outs, idx, op)
        return out

    def _run(self, func, args, kwargs):
        """Run the op (:func:`~autosac.trace.execution.run_op`), a routing
        decision of the forward laid out as :attr:`routing` says; return what it
        made and whether it reads or makes a routed tensor."""
        try:
            ran = run_op(func, args, kwargs, self._made_in_trace, self.fake_mode, self.small_values, self.routing)
        except Exception as e:
            if type(e).__name__ == "DataDependentOutputException" and self._reads_random(args, kwargs):
                self.random_branch = True
            raise
        if not (self.routing.active and self.phase == "forward" and torch._C._current_autograd_node() is None):
            return ran, False
        picks = len(self.routing.calls)
        ran = self.routing.route(func, args, kwargs, ran, self._stack_t[-1] if self._stack_t else "")
        routed = len(self.routing.calls) > picks or self.routing.reads_routing(
            a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
        return ran, routed

    def _op_record(self, func, args, kwargs, out, outs) -> OpRecord:
        """The op as the recording files it: where it ran, what it cost, what kind of op it is."""
        origin = -1
        if torch._C._current_autograd_node() is not None:
            (stack, origin), phase = self._nodes.of_running(self._param_stack), "backward"
        else:
            phase, stack = self.phase, self._stack_t
        ms, flops = self.cost.op_ms(func, args, kwargs, out, backward=phase == "backward")
        view = is_view_op(func)
        writes = writes_input(func)
        # ops like _unsafe_view return an alias without being view ops: treat
        # them as views (a replay must run them for their consumers to see data)
        alias = bool(outs) and not writes and all(self.index_of(t) is not None for t in outs)
        return OpRecord(func.overloadpacket.__name__, phase, stack, ms, flops, view or alias, is_random_op(func),
                        writes and not view, origin)

    def _note_scratch(self, func, args, kwargs, idx: int, flops: int, outs) -> None:
        """The working memory the op's kernel allocates and frees inside the call."""
        scratch = transient_bytes(func, args)
        if needs_probe(func, args, self.device_type, outs) and flops <= PROBE_CAP_FLOPS:
            scratch = probed_scratch_bytes(func, args, kwargs, scratch, outs)
        scratch += scalar_scratch_bytes(func, args, kwargs, self.device_type) + self._loose_scalar_bytes(args)
        if scratch:
            self.rec.transient[idx] = scratch

    def _track_outputs(self, func, args, kwargs, outs, idx: int, kind: str) -> None:
        """Register the storages the op made (sized as the real kernel sizes them
        where the meta kernel differs: :data:`~autosac.trace.probes.REAL_SIZE_OPS`,
        :func:`~autosac.trace.probes.norm_stat_bytes`)."""
        if func.overloadpacket.__name__ in REAL_SIZE_OPS:
            sizes = real_output_bytes(func, args, kwargs)
        else:
            sizes = norm_stat_bytes(func, args, outs)
        for j, t in enumerate(outs):
            self.track(t, kind, created=idx, producer=idx, nbytes=sizes[j] if sizes and j < len(sizes) else None)

    def _after_forward_op(self, func, args, kwargs, outs, idx: int, op: OpRecord) -> None:
        """What a forward op leaves besides its outputs: the storages it wrote,
        the parameters it read (and cast), the numbers it took in Tensor
        slots, and its outputs' autograd nodes, resolved at the next op."""
        if op.writes:
            self._note_written(func, args, kwargs, idx)
        if op.random and self.rec.host_rng is not None and any(
                isinstance(a, torch.Generator) for a in (*args, *kwargs.values())):  # poisson takes it positionally
            self.rec.host_rng.update(self.stack)  # a generator of its own: its state is swapped in for the replay
        self._note_param_use(func, args, outs)
        if number_in_tensor_slot(func, args, kwargs):
            self._number_args[idx] = saved_number_bytes(func, dtypes_key(args), dtypes_key(kwargs)) \
                if writes_input(func) else 0
        # grad_fn is attached above this dispatch level: resolve it at the next op
        self._pending.extend((weakref.ref(t), op.stack, idx, t._version) for t in outs if t.is_floating_point())

    def _note_written(self, func, args, kwargs, idx: int) -> None:
        """An in-place forward op: the storages it wrote, with their producers."""
        for t in written_tensors(func, args, kwargs):
            r = self.record_of(t)
            if r is not None:
                if r.producer != idx and r.producer >= 0:
                    r.writers.append(idx)
                self.rec.written.setdefault(idx, []).append((r.producer, self.index_of(t), r.nbytes))
            else:  # a tensor the trace never saw made (a global, say): made before any call
                self.rec.written.setdefault(idx, []).append((-1, -1, 0))

    def _reads_random(self, args, kwargs) -> bool:
        """Whether an op reads a value derived from a random op of the forward."""
        todo, seen = list(self._flow.reads(args, kwargs)), set()
        while todo:
            event = todo.pop()
            if event in seen or event < 0:
                continue
            seen.add(event)
            if self.rec.random[event]:
                return True
            todo.extend(self.rec.inputs.get(event, ()))
        return False

    def _loose_scalar_bytes(self, args) -> int:
        """Bytes of real 0-dim cpu tensors the op reads that the trace never saw
        made: Python made them for this call from a number (``torch.where(c, x,
        0.0)``) and frees them after it."""
        return sum(a.untyped_storage().nbytes() for a in args if self._is_loose_scalar(a))

    def _is_loose_scalar(self, t) -> bool:
        """A real 0-dim tensor on the traced device that no op of the trace made."""
        return (
            isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.dim() == 0
            and t.device.type == self.device_type and self.index_of(t) is None
        )

    def _note_param_use(self, func, args, outs) -> None:
        name = func.overloadpacket.__name__
        for a in tree_leaves(args):
            if not isinstance(a, torch.Tensor):
                continue
            fqn = self._param_of_storage.get(id(a.untyped_storage()))
            if fqn is None:
                continue
            if name in _CASTS and outs and outs[0].dtype != a.dtype:
                self.rec.param_dtypes[fqn].add(str(outs[0].dtype).removeprefix("torch."))
                if not is_param_cast(a, outs[0], self._param_of[fqn]):
                    continue  # part of a weight, a frozen one, another layout: saved as any activation
                for t in outs:
                    r = self.record_of(t)
                    if r is not None:
                        r.param_cast, r.cast_of = True, fqn
            else:
                self.rec.param_dtypes[fqn].add(str(a.dtype).removeprefix("torch."))

    def finish(self) -> Recording:
        """Close the recording: storages still alive are freed at the step's end."""
        self._flush_pending()
        end = len(self.rec.ops)
        for r in self.rec.storages:
            if r.freed is None:
                r.freed = end
        for event, i in self._engine_sums:
            r = self.rec.storages[i]
            if r.freed == event + 1:  # the sum held its last reference: the real engine adds in place
                r.freed = event
        self._refs.clear()
        self.rec.unknown_ops = set(self.cost.unknown_ops)
        self.rec.routers = list(self.routing.calls)
        return self.rec
