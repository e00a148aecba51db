"""Record one training step op by op: where each op ran, what it cost, and
when every tensor storage was born, saved for backward, and freed.

Three observers feed one :class:`Recording`:

* a ``TorchDispatchMode`` sees every aten op (cost, outputs, in-place writes);
* weakref callbacks on storages see frees the moment the last view dies;
* saved-tensor hooks see which storages autograd keeps for backward.

Backward ops are attributed to the module whose forward created their autograd
node: forward outputs' ``grad_fn`` sequence numbers are mapped to the module
stack of the op that produced them.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from dataclasses import dataclass, field
from functools import cache, lru_cache

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from autosac.core.allocations import allocation_peak
from autosac.core.dataflow import DataflowTracker, tensors_in
from autosac.core.errors import ProfilerBusyError
from autosac.core.opkinds import is_param_cast, is_random_op, is_view_op, writes_input, written_tensors
from autosac.trace.costs import CostModel, transient_bytes
from autosac.trace.fake_kernels import run_fake
from autosac.trace.layouts import restrides, with_kernel_strides
from autosac.trace.routing import ROUTED_NUMEL, RoutingTrace, with_long_indices

Stack = tuple[str, ...]
_ACCUMULATE_GRAD_SEQ = 2**64 - 1
_CASTS = {"_to_copy", "to", "type_as"}


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


@dataclass
class Recording:
    """Raw facts of one step; :mod:`autosac.trace.aggregate` turns them into ModelStats."""

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
    origins: dict[int, int] = field(default_factory=dict)  # backward event -> forward event that made its node
    output_storages: dict[str, set[int]] = field(default_factory=dict)  # fqn -> storage records it returned
    param_dtypes: dict[str, set[str]] = field(default_factory=dict)
    unknown_ops: set[str] = field(default_factory=set)
    # each tensor autograd saved in the forward: (ops recorded before the save, module stack at the save);
    # an op's inputs are saved before it runs, its outputs after, so the stack tells whose call it was
    save_points: list[tuple[int, Stack]] = field(default_factory=list)
    # forward events that read a tensor derived from an MoE routing decision (or make one:
    # autosac.trace.routing); their number and sizes follow the routing assumed
    routed: set[int] = field(default_factory=set)
    routers: list = field(default_factory=list)  # the routing decisions the forward made (RouterCall)


SMALL_NUMEL = 1 << 16  # tensors this small (and on the cpu) may be computed for real
_TRACE_DEVICES = ("cpu", "meta")  # the trace's fakes are on the cpu; a real meta tensor is a fake's equal


# Ops whose kernels (CPU and CUDA) lay their first output out in the input's
# suggested memory format -- contiguous, or channels-last -- where the meta
# kernel keeps the input's strides.  Found by comparing real and fake output
# strides of the common ops on non-contiguous inputs; only batch norm differed.
# The strides matter for memory: a transposed batch-norm output fed to a matmul
# is copied to contiguous in the real step, not in the trace.
# Op name -> the argument whose format it is (batch norm's backward: the forward input).
SUGGESTED_FORMAT_OPS = {"native_batch_norm": 0, "_native_batch_norm_legit": 0,
                        "_native_batch_norm_legit_no_training": 0, "native_batch_norm_backward": 1}


def with_kernel_layout(func, args, out, kwargs=None):
    """``out`` with its first tensor laid out as the real kernel lays it out
    (:data:`SUGGESTED_FORMAT_OPS`; a view's or pointwise op's size-1 dims,
    :mod:`autosac.trace.layouts`); other ops' outputs unchanged."""
    if restrides(func):
        return with_kernel_strides(func, args, kwargs or {}, out)
    which = SUGGESTED_FORMAT_OPS.get(func.overloadpacket.__name__)
    if which is None or not isinstance(out, tuple) or not out or len(args) <= which:
        return out
    x, first = args[which], out[0]
    fmt = _suggested_format(x)
    if not isinstance(first, FakeTensor) or not isinstance(x, torch.Tensor) or first.is_contiguous(memory_format=fmt):
        return out
    return (torch.empty_like(first, memory_format=fmt), *out[1:])


def _suggested_format(x: torch.Tensor) -> torch.memory_format:
    """ATen's ``suggest_memory_format``: channels-last for a 4-d (5-d) tensor laid
    out so, and not also contiguous; else contiguous."""
    for dim, fmt in ((4, torch.channels_last), (5, torch.channels_last_3d)):
        if x.dim() == dim and x.is_contiguous(memory_format=fmt) and not x.is_contiguous():
            return fmt
    return torch.contiguous_format


def run_op(func, args, kwargs, made_in_trace=lambda t: False, fake_mode=None, small_values=True, routed=None):
    """Run one op of the trace: under fake mode, unless it only reads small real
    tensors (or none) and makes small ones (and ``small_values``: a trace whose
    fused kernels are skipped computes no values, so its ops all run fake).

    Code that branches on tensor values -- position ids, attention masks, a
    cache's length -- then sees the values an eager step sees, and code that
    asks whether it is being traced (``isinstance(x, FakeTensor)``, as
    transformers does before choosing its attention-mask path) gets the same
    answer as in the real step, so the trace takes the real step's branches.
    Random ops always run fake: the trace never advances the real RNG; and an
    op that writes in place runs for real only into tensors the trace made
    (``made_in_trace``): the model's own tensors are never changed (a write
    into one goes to a fake twin of it).  ``routed`` (a
    :class:`~autosac.trace.routing.RoutingTrace`): real tensors derived from
    routing decisions run for real up to ``ROUTED_NUMEL`` elements, and what
    they make is derived too.  Fake ops go through
    :func:`~autosac.trace.fake_kernels.run_fake` (meta kernels that refuse
    what the real kernel runs).
    """
    if is_random_op(func):
        return func(*args, **kwargs)
    if func.namespace != "aten":
        return run_fake(func, args, kwargs)
    foreign = [t for t in written_tensors(func, args, kwargs) if not isinstance(t, FakeTensor) and not made_in_trace(t)]
    if foreign:
        if fake_mode is None:
            raise RuntimeError("autosac: an op writes into a real tensor of the model during the trace")
        twins = {id(t): fake_mode.from_tensor(t) for t in foreign}
        args, kwargs = tree_map(lambda a: twins.get(id(a), a) if isinstance(a, torch.Tensor) else a, (args, kwargs))
        return run_fake(func, args, kwargs)
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if small_values and func.overloadpacket.__name__ in VALUE_FREE_OPS:
        made = _made_from_shapes(func, args, kwargs)
        if made is not None:
            return made
    if not small_values or any(isinstance(t, FakeTensor) or t.requires_grad or t.device.type != "cpu"
                               for t in tensors):
        return run_fake(func, with_long_indices(func, args, routed), kwargs)
    from_routing = routed is not None and routed.reads_routing(tensors)
    if sum(t.numel() for t in tensors) > (ROUTED_NUMEL if from_routing else SMALL_NUMEL):
        return run_fake(func, args, kwargs)
    if not tensors:  # a factory: real only when what it makes is small and on the cpu
        fake = func(*args, **kwargs)
        made = [t for t in tree_leaves(fake) if isinstance(t, torch.Tensor)]
        if not made or any(t.device.type != "cpu" or t.numel() > SMALL_NUMEL for t in made):
            return fake
    with unset_fake_temporarily():
        out = func(*args, **kwargs)
    if from_routing:
        routed.mark(out)
    return out


# Ops whose output values are set by the op, not read from their tensor input
# (only its shape, dtype and device are): a small one on the cpu is made for
# real from a fake input, so lengths computed from it (``ones_like(audio,
# dtype=long).sum(-1)``, transformers' CTC heads) are values the trace has.
VALUE_FREE_OPS = frozenset({"ones_like", "zeros_like", "full_like", "new_ones", "new_zeros", "new_full"})


def _made_from_shapes(func, args, kwargs):
    """A :data:`VALUE_FREE_OPS` op's integer or boolean output (lengths, masks),
    made for real from an empty twin of its fake input when small and on the
    cpu; ``None`` otherwise.  A floating one stays fake: what it holds is
    written next by ops on fake activations (an MoE's ``zeros_like`` output
    buffer), whose results a real tensor could not keep."""
    x = args[0] if args else None
    if not isinstance(x, FakeTensor) or any(isinstance(a, torch.Tensor) for a in tree_leaves((args[1:], kwargs))):
        return None
    fake = func(*args, **kwargs)
    if (not isinstance(fake, torch.Tensor) or fake.device.type != "cpu" or fake.numel() > SMALL_NUMEL
            or fake.is_floating_point() or fake.is_complex()):
        return fake
    with unset_fake_temporarily():
        return func(torch.empty_strided(x.shape, x.stride(), dtype=x.dtype), *args[1:], **kwargs)


# Kernels whose outputs the meta kernel sizes unlike the real one: their output
# sizes are read off a real call on zeros.  oneDNN's RNN workspace; and losses
# whose reduced result is a 0-dim view of the input-sized elementwise loss the
# kernel made (mse_loss(reduction="mean") of a 64 KiB input returns a scalar
# holding 64 KiB, alive as long as the loss is: through backward).
REAL_SIZE_OPS = frozenset({"mkldnn_rnn_layer", "mse_loss", "smooth_l1_loss", "soft_margin_loss",
                           "binary_cross_entropy"})
# Kernels whose internal working memory depends on the kernel's own choices
# (oneDNN's reorders in a convolution's backward; the CPU flash attention's
# per-thread blocks), and losses that reduce an input-sized elementwise loss
# they make inside the kernel (mse_loss(reduction="mean") of a 64 KiB input
# peaks 128 KiB above its result on the CPU): measured on a real call on zeros.
PROBE_SCRATCH_OPS = frozenset({
    "convolution_backward", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "mse_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "soft_margin_loss",
})
# Matmuls in half precision (oneDNN converts and reorders blocks internally).
_HALF_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


def needs_probe(func, args) -> bool:
    """Whether the kernel's internal working memory is measured by a probe."""
    name = func.overloadpacket.__name__
    if name in PROBE_SCRATCH_OPS or name == "mkldnn_rnn_layer_backward":
        return True
    return name in _HALF_MATMULS and any(
        isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) for a in args
    )
_PROBE_CAP_BYTES = 256 << 20
_PROBE_CAP_FLOPS = 3e10  # a probe runs the kernel for real: about a second here at most


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


@dataclass(frozen=True)
class _Zeros:
    shape: tuple
    stride: tuple
    dtype: torch.dtype


def _spec(x):
    """A hashable stand-in for an op's arguments: tensors by shape, stride and dtype."""
    if isinstance(x, torch.Tensor):
        return _Zeros(tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_spec(v) for v in x)
    return x


def _real(x):
    """Zeros (with the recorded strides) for each :class:`_Zeros` in ``x``."""
    if isinstance(x, _Zeros):
        return torch.empty_strided(x.shape, x.stride, dtype=x.dtype).zero_()
    return [_real(v) for v in x] if isinstance(x, tuple) else x


@lru_cache(maxsize=256)
def _probe(func, args: tuple, kwargs: tuple) -> tuple[int, ...] | None:
    try:
        with unset_fake_temporarily(), torch.random.fork_rng(devices=[]):
            out = func(*[_real(a) for a in args], **{k: _real(v) for k, v in kwargs})
        return tuple(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    except Exception:  # noqa: BLE001 - no probe: keep the meta kernel's sizes
        return None


@lru_cache(maxsize=512)
def _probe_scratch(func, args: tuple, kwargs: tuple) -> int | None:
    try:
        with unset_fake_temporarily(), torch.random.fork_rng(devices=[]):  # never advance the real RNG
            real_args = [_real(a) for a in args]
            real_kwargs = {k: _real(v) for k, v in kwargs}
            peak, made = allocation_peak(lambda: func(*real_args, **real_kwargs))
        return max(0, peak - max(made, 0))
    except ProfilerBusyError:
        raise
    except Exception:  # noqa: BLE001 - no probe: keep the modelled scratch
        return None


@lru_cache(maxsize=64)
def _probe_rnn_backward(args: tuple) -> tuple[int, int] | None:
    """oneDNN's RNN backward reads the workspace its forward wrote: a probe on
    zeros alone could crash, so the layer's forward runs first (on zeros of the
    same shapes, with the same settings) and its backward is measured on what
    that forward returned: ``(peak, net)`` as :func:`allocation_peak`."""
    (inp, w1, w2, w3, w4, hx, cx, _out, _hy, _cy, g_out, g_hy, g_cy,
     reverse, mode, hidden, layers, biases, train, bidirectional, batch_sizes, batch_first, _ws) = args
    try:
        with unset_fake_temporarily(), torch.enable_grad():  # the forward writes a workspace only with grad on
            x, a, b, c, d, h0, c0 = (_real(t) for t in (inp, w1, w2, w3, w4, hx, cx))
            out, hy, cy, ws = torch.ops.aten.mkldnn_rnn_layer(
                x, a, b, c, d, h0, c0, reverse, list(batch_sizes), mode, hidden, layers, biases, bidirectional,
                batch_first, train)
            grads = [None if g is None else _real(g) for g in (g_out, g_hy, g_cy)]
            return allocation_peak(lambda: torch.ops.aten.mkldnn_rnn_layer_backward(
                x, a, b, c, d, h0, c0, out, hy, cy, *grads, reverse, mode, hidden, layers, biases, train,
                bidirectional, list(batch_sizes), batch_first, ws))
    except ProfilerBusyError:
        raise
    except Exception:  # noqa: BLE001 - no probe: keep the modelled scratch
        return None


def probed_scratch_bytes(func, args, kwargs, default: int, outs=()) -> int:
    """Working memory the real kernel allocates and frees inside one call (its
    peak above what it returns), measured once per shape on zeros (inputs up to
    256 MiB); ``default`` when it cannot be measured.

    oneDNN's RNN backward returns the two bias gradients as two tensors where
    the meta kernel returns one: the difference to the fake ``outs`` is counted
    here too."""
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if sum(t.numel() * t.element_size() for t in tensors) > _PROBE_CAP_BYTES:
        return default
    try:
        if func.overloadpacket.__name__ == "mkldnn_rnn_layer_backward" and not kwargs:
            probed = _probe_rnn_backward(_spec(tuple(args)))
            if probed is None:
                return default
            peak, made = probed
            fake_made = sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in outs}.values())
            return max(0, peak - made) + max(0, made - fake_made)
        found = _probe_scratch(func, _spec(tuple(args)), tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))
    except TypeError:
        return default
    return default if found is None else found


_WRAPPED = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def scalar_scratch_bytes(func, args, kwargs, device_type: str = "cpu") -> int:
    """What a CPU pointwise kernel allocates for a Python number passed as its
    ``other`` operand (``x * 2.0``, ``ids.ne(-100)``): the number wrapped in a
    0-dim tensor (8 bytes for a float or int, 1 for a bool), plus its cast to
    the op's dtype where that differs (4 more for float32).  Numbers in other
    slots (``alpha``, ``min``, a fill value) are kernel parameters and cost
    nothing.  Measured with the profiler's allocator events; on a GPU the
    number is a kernel argument and costs no device memory."""
    if device_type != "cpu" or torch.Tag.pointwise not in func.tags:
        return 0
    i = _other_slot(func)
    v = None if i is None else _arg(args, kwargs, i, "other")
    if type(v) not in _WRAPPED:
        return 0
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if first is None or first.device.type != "cpu":
        return 0
    wrapped = _WRAPPED[type(v)]
    return wrapped.itemsize + (first.element_size() if first.dtype != wrapped else 0)


def real_output_bytes(func, args, kwargs) -> tuple[int, ...] | None:
    """Storage bytes of each tensor output when the real kernel runs (on zeros
    of the same shapes; inputs up to 256 MiB), or None."""
    tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if sum(t.numel() * t.element_size() for t in tensors) > _PROBE_CAP_BYTES:
        return None

    try:
        return _probe(func, _spec(tuple(args)), tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))
    except TypeError:  # unhashable arguments
        return None


@cache
def _tensor_slots(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of the schema's Tensor-typed arguments (once per op)."""
    return tuple((i, a.name) for i, a in enumerate(func._schema.arguments) if isinstance(a.type, torch.TensorType))


@cache
def _other_slot(func) -> int | None:
    """Position of the schema's ``other`` argument, if it has one."""
    return next((i for i, a in enumerate(func._schema.arguments) if a.name == "other"), None)


def _arg(args, kwargs, i: int, name: str):
    return args[i] if i < len(args) else kwargs.get(name)


def _number_in_tensor_slot(func, args, kwargs) -> bool:
    """Whether a Python number was passed where the schema takes a Tensor."""
    return any(isinstance(_arg(args, kwargs, i, n), (int, float, complex)) for i, n in _tensor_slots(func))


def _dtypes(x):
    """A hashable stand-in for an op's arguments: tensors by dtype alone."""
    if isinstance(x, torch.Tensor):
        return _Zeros((), (), x.dtype)
    if isinstance(x, dict):
        return tuple((k, _dtypes(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return tuple(_dtypes(v) for v in x)
    return x


@lru_cache(maxsize=256)
def _saved_number_bytes(func, args: tuple, kwargs: tuple) -> int:
    """Bytes of the 0-dim tensors autograd keeps for the numbers an in-place op
    took in Tensor slots (``h.mul_(0.5)`` keeps 0.5): the op run for real on
    0-dim tensors, its node's saved values read.  It runs on a thread of its
    own, outside this dispatch (where autograd is below) and any mode."""
    found = []
    worker = threading.Thread(target=lambda: found.append(_numbers_kept(func, args, kwargs)), daemon=True)
    worker.start()
    worker.join()
    return found[0] if found else 0


def _numbers_kept(func, args: tuple, kwargs: tuple) -> int:
    try:
        real = [_real(a).requires_grad_().clone() if isinstance(a, _Zeros) else a for a in args]
        out = func(*real, **{k: _real(v) for k, v in kwargs})
    except Exception:  # noqa: BLE001 - an op that cannot run on 0-dim tensors: nothing counted
        return 0
    node = out.grad_fn if isinstance(out, torch.Tensor) else None
    saved = [getattr(node, n) for n in dir(node) if n.startswith("_saved_")] if node is not None else []
    mine = {id(t) for t in real if isinstance(t, torch.Tensor)}
    return sum(v.untyped_storage().nbytes() for v in saved
               if isinstance(v, torch.Tensor) and v.dim() == 0 and id(v) not in mine and not v.requires_grad)


def common_prefix(a: Stack, b: Stack) -> Stack:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


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
        self._seq_keys: list[int] = []
        self._seq_stacks: list[Stack] = []
        self._seq_events: list[int] = []
        self._flow = DataflowTracker()
        self._applying = 0  # depth of backward nodes computing now
        self._engine_sums: list[tuple[int, int]] = []  # (event, storage of the first gradient)
        self._number_args: dict[int, int] = {}  # forward events with a number in a Tensor argument -> in-place bytes
        self.device_type = "cpu"  # the device the traced step's tensors are on
        self.fake_mode = None  # the trace's FakeTensorMode (writes into the model's real tensors go to fakes)
        self.small_values = True  # small cpu ops run for real (see run_op)
        self.routing = RoutingTrace()  # MoE routing decisions get real indices (autosac.trace.routing)
        self._twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # real tensors of another device -> cpu twin
        self._stale: dict[int, torch.UntypedStorage] = {}  # real storages a fake op wrote (their values unknown)
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
            self._map_node(node, stack, event)
        self._pending.clear()
        self._number_args.clear()

    def _map_node(self, node, stack: Stack, event: int) -> None:
        """Remember that ``node`` was made in ``stack`` by forward ``event``.
        Nodes are numbered in creation order: one no newer than the last mapped
        was passed on, not made, by the op."""
        seq = node._sequence_nr()
        if self._seq_keys and seq <= self._seq_keys[-1]:
            return
        self._watch_apply(node)
        self._seq_keys.append(seq)
        self._seq_stacks.append(stack)
        self._seq_events.append(event)

    def _hold_numbers(self, node, event: int, nbytes: int) -> None:
        """The numbers an in-place op on a view keeps, inside a ``CopySlices``
        node that shows no saved values: ``nbytes`` (:func:`_saved_number_bytes`)
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

    def _watch_apply(self, node) -> None:
        """Count when the backward runs inside a node's own computation, so that
        the engine's work between nodes (summing gradients) can be told apart."""

        def enter(grad_outputs):
            self._applying += 1

        def leave(grad_inputs, grad_outputs):
            self._applying -= 1

        node.register_prehook(enter)
        node.register_hook(leave)

    def _note_engine_sum(self, func, args, kwargs, idx: int) -> None:
        """The engine sums two gradients for one input out of place on fake
        tensors, but in place into the first when it holds the last reference
        to a dense tensor (and grad mode is off): remember such sums, settled
        in :meth:`finish` once it is known whether that reference was the last."""
        if (
            self._applying or func is not torch.ops.aten.add.Tensor or torch.is_grad_enabled()
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
        i = self.index_of(old)
        if i is not None and self.rec.storages[i].kind == "temp":
            self._engine_sums.append((idx, i))

    def _backward_stack(self) -> tuple[Stack, int]:
        """The module stack the running backward node was created in, and the
        forward event that created it (-1 for gradient accumulation)."""
        node = torch._C._current_autograd_node()
        if node is None:
            return (), -1
        seq = node._sequence_nr()
        if seq == _ACCUMULATE_GRAD_SEQ:
            var = getattr(node, "variable", None)
            return (self._param_stack.get(id(var), ()) if var is not None else ()), -1
        # Nodes are numbered in creation order, so the closest mapped node at or
        # before this one was created by the same module's forward.
        i = bisect.bisect_right(self._seq_keys, seq) - 1
        return (self._seq_stacks[i], self._seq_events[i]) if i >= 0 else ((), -1)

    # ------------------------------------------------------ saved tensors
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.phase == "forward" and isinstance(t, torch.Tensor):
            self.rec.save_points.append((len(self.rec.ops), self._stack_t))
            idx = self._by_storage.get(id(t.untyped_storage()))
            if idx is not None:
                rec = self.rec.storages[idx]
                stack = self._stack_t
                rec.saver_stack = stack if rec.saver_stack is None else common_prefix(rec.saver_stack, stack)
                rec.saver_stacks.add(stack)
                rec.saved_as_view = rec.saved_as_view or t._is_view()
        return _without_graph(t)

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    # ------------------------------------------------------------- ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("prim", "profiler"):
            return func(*args, **kwargs)
        if any(not isinstance(t, FakeTensor) and t.device.type not in _TRACE_DEVICES for t in tensors_in(args, kwargs)):
            args, kwargs = self._on_trace_device(args, kwargs)
        if self._stale and any(id(t.untyped_storage()) in self._stale for t in tensors_in(args, kwargs)
                               if not isinstance(t, FakeTensor)):
            args, kwargs = self._stale_as_fake(args, kwargs)
        if self._pending:
            self._flush_pending()
        try:
            ran = run_op(func, args, kwargs, self._made_in_trace, self.fake_mode, self.small_values, self.routing)
        except Exception as e:
            if type(e).__name__ == "DataDependentOutputException" and self._reads_random(args, kwargs):
                self.random_branch = True
            raise
        routed = False
        if self.routing.active and self.phase == "forward" and torch._C._current_autograd_node() is None:
            picks = len(self.routing.calls)
            ran = self.routing.route(func, args, kwargs, ran, self._stack_t[-1] if self._stack_t else "")
            routed = len(self.routing.calls) > picks or self.routing.reads_routing(
                a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor))
        if writes_input(func) and not is_view_op(func):
            self._note_stale(func, args, kwargs, ran)
        out = with_kernel_layout(func, args, ran, kwargs)

        rec = self.rec
        idx = len(rec.ops)
        if torch._C._current_autograd_node() is not None:
            (stack, origin), phase = self._backward_stack(), "backward"
            if origin >= 0:
                self.rec.origins[len(self.rec.ops)] = origin
        else:
            phase, stack = self.phase, self._stack_t
        ms, flops = self.cost.op_ms(func, args, kwargs, out, backward=phase == "backward")
        view = is_view_op(func)
        writes = writes_input(func)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        # ops like _unsafe_view return an alias without being view ops: treat
        # them as views (a replay must run them for their consumers to see data)
        alias = bool(outs) and not writes and all(self.index_of(t) is not None for t in outs)
        rec.ops.append(func.overloadpacket.__name__)
        rec.phases.append(phase)
        rec.stacks.append(stack)
        rec.ms.append(ms)
        rec.flops.append(flops)
        rec.views.append(view or alias)
        rec.random.append(is_random_op(func))
        rec.writes.append(writes and not view)
        if routed:
            rec.routed.add(idx)
        scratch = transient_bytes(func, args)
        if needs_probe(func, args) and flops <= _PROBE_CAP_FLOPS:
            scratch = probed_scratch_bytes(func, args, kwargs, scratch, outs)
        scratch += scalar_scratch_bytes(func, args, kwargs, self.device_type) + self._loose_scalar_bytes(args)
        if scratch:
            rec.transient[idx] = scratch

        if phase == "backward":
            self._note_engine_sum(func, args, kwargs, idx)
        if phase == "forward":
            deps = self._flow.reads(args, kwargs)
            if deps:
                rec.inputs[idx] = deps
            self._flow.record(idx, func, args, kwargs, out)
        kind = "act" if phase == "forward" else "temp"
        sizes = real_output_bytes(func, args, kwargs) if func.overloadpacket.__name__ in REAL_SIZE_OPS else None
        for j, t in enumerate(outs):
            self.track(t, kind, created=idx, producer=idx, nbytes=sizes[j] if sizes and j < len(sizes) else None)
        if phase == "forward" and writes and not view:
            for t in written_tensors(func, args, kwargs):
                r = self.record_of(t)
                if r is not None:
                    if r.producer != idx and r.producer >= 0:
                        r.writers.append(idx)
                    rec.written.setdefault(idx, []).append((r.producer, self.index_of(t), r.nbytes))
                else:  # a tensor the trace never saw made (a global, say): made before any call
                    rec.written.setdefault(idx, []).append((-1, -1, 0))
        if phase == "forward":
            self._note_param_use(func, args, outs)
            if _number_in_tensor_slot(func, args, kwargs):
                self._number_args[idx] = _saved_number_bytes(func, _dtypes(args), _dtypes(kwargs)) if writes else 0
            # grad_fn is attached above this dispatch level: resolve it at the next op
            self._pending.extend((weakref.ref(t), stack, idx, t._version) for t in outs if t.is_floating_point())
        return out

    def _on_trace_device(self, args, kwargs):
        """The arguments with each real tensor of another device (labels a
        ``loss_fn`` closes over on the GPU, a mask kept as a plain attribute)
        as the trace's twin of it on the cpu, where its fakes are: small
        integer ones copied (their values read as the real step reads them),
        the others fake; the same twin each time."""
        def twin(t):
            if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or t.device.type in _TRACE_DEVICES:
                return t
            key = id(t)
            if key not in self._twins:
                if not t.is_floating_point() and not t.is_complex() and t.numel() <= SMALL_NUMEL:
                    with unset_fake_temporarily():
                        made = t.detach().to("cpu")
                else:
                    made = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                    if t.requires_grad:  # a leaf the step trains: its gradient is made as for the real one
                        made.requires_grad_()
                self._twins[key] = (t, made)  # t kept: its id is not reused while the twin is known
            return self._twins[key][1]

        return tree_map(twin, (args, kwargs))

    def _note_stale(self, func, args, kwargs, ran) -> None:
        """An in-place op that ran fake wrote a real tensor's fake twin (a mask
        ``zeros_like`` made small and real, filled under a fake condition): the
        real tensor's values are stale from now on, and nothing may read them
        (:meth:`_stale_as_fake`)."""
        outs = tensors_in(ran)
        if not outs or not isinstance(outs[0], FakeTensor):
            return  # it ran for real: the values are right
        for t in written_tensors(func, args, kwargs):
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
                st = t.untyped_storage()
                self._stale[id(st)] = st  # kept: its id is not reused while known

    def _stale_as_fake(self, args, kwargs):
        """The arguments with each stale real tensor as its fake twin, the one
        the write went to: its values are unknown, as they are."""
        def fake(t):
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and id(t.untyped_storage()) in self._stale:
                return self.fake_mode.from_tensor(t)
            return t

        return tree_map(fake, (args, kwargs))

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
