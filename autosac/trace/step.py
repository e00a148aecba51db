"""Run one whole training step of a user's model under FakeTensorMode.

The model's parameters and buffers are swapped for fake twins for the duration
(real weights are never copied; ``meta`` models work), the optimizer is stepped
once on zero gradients so its state exists as from the second step on, and then
forward, loss, backward and the optimizer step run under a :class:`StepRecorder`.
"""

from __future__ import annotations

import gc
import logging
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from autosac.core.devices import library_workspace_bytes
from autosac.core.errors import NothingToCheckpointError, TraceError
from autosac.core.inputs import split_inputs
from autosac.core.integrations import caches_off
from autosac.core.loop import output_tensors
from autosac.core.optim import OptimizerSpec, default_loss, make_optimizer
from autosac.core.pystate import capture
from autosac.core.stats import ParamStats
from autosac.trace.autocast import target_autocast
from autosac.trace.costs import CostModel
from autosac.trace.dispatch import TargetDispatch
from autosac.trace.fake_kernels import FakeKernelError
from autosac.trace.recorder import SMALL_NUMEL, Recording, StepRecorder, StorageRecord
from autosac.trace.routing import BALANCED, Routing, RoutingTrace


@dataclass
class TracedStep:
    recording: Recording
    params: dict[str, ParamStats]
    module_types: dict[str, str]
    module_children: dict[str, list[str]]
    input_bytes: int
    buffer_bytes: int


def _fake_like(t: torch.Tensor, requires_grad: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    # Always on cpu: fake tensors hold no data, and one device keeps meta models,
    # real-weight models and any kind of input compatible.
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    fake = torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="cpu")
    return fake.requires_grad_(requires_grad) if requires_grad else fake


@contextmanager
def fake_parameters(model: nn.Module, mode: FakeTensorMode, param_dtype: torch.dtype | None = None):
    """Swap every parameter and buffer for a fake twin (floating parameters in
    ``param_dtype`` when given); tied ones stay tied; restored on exit."""
    memo: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    try:
        with mode:
            for mod in model.modules():
                for table in (mod._parameters, mod._buffers):
                    for name, t in list(table.items()):
                        if t is None:
                            continue
                        if id(t) not in memo:
                            if isinstance(t, nn.Parameter):
                                memo[id(t)] = nn.Parameter(_fake_like(t, False, param_dtype),
                                                           requires_grad=t.requires_grad)
                            else:
                                memo[id(t)] = _fake_like(t, False)
                        swapped.append((table, name, t))
                        table[name] = memo[id(t)]
        yield
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


def trace_step(
    model: nn.Module,
    example_inputs,
    loss_fn=None,
    optimizer: OptimizerSpec = "adamw",
    cost_model: CostModel | None = None,
    param_dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    compile_backend: str | None = None,
    small_values: bool = True,
    output_held: bool = True,
    routing: Routing | None = None,
    grads_alive: str = "",
    batches_ahead: int = 0,
) -> TracedStep:
    """Trace forward, loss, backward and optimizer step; return the raw recording.

    With ``compile_backend`` the forward runs as ``torch.compile(model,
    backend=compile_backend)`` would run it: the recording holds the ops of the
    compiled forward and backward graphs (and no module windows: compiled
    code runs no module hooks).  ``small_values=False`` runs every op fake
    (by default ops on small real cpu tensors run for real, so code that reads
    their values branches as in the real step); a compiled step whose fused
    kernels are skipped computes no values to read.  ``output_held``: the
    loop :mod:`autosac.core.loop` describes keeps the model's output alive to the
    step's end and the previous step's until the forward returns (else the
    output dies when the loss exists).  ``grads_alive``: ``"step"``, every
    gradient is alive from the step's start, as gradient accumulation leaves
    them for each micro-batch after the first; ``"forward"``, alive from the
    start until the loss exists and set to ``None`` before the backward (a
    loop that calls ``zero_grad()`` there, as Lightning does); ``""``, none.
    ``batches_ahead``: copies of the inputs alive through the step (batches a
    data loader has already fetched).

    The model and the example inputs are left exactly as they were: parameters
    and buffers are swapped back, and attributes the forward assigned (under
    fake mode) are undone.  A forward that builds lazy state on its first call
    (a cache attribute, say) is traced a second time, with that state in place,
    so the recording is the steady-state step the plan is for.

    Raises:
        NothingToCheckpointError: no parameter requires grad, or the loss is not differentiable.
        TraceError: the forward (naming the module) or the loss raised.
    """
    if not any(p.requires_grad for p in model.parameters()):
        raise NothingToCheckpointError(
            f"{type(model).__name__} has no parameter that requires grad: nothing to checkpoint"
        )
    loss_fn = loss_fn or default_loss
    real_args, real_kwargs = split_inputs(example_inputs)
    # made before the capture: torch.compile marks the model, which is not state its forward builds
    runner = torch.compile(model, backend=compile_backend) if compile_backend is not None else None
    before = capture(model, real_args, real_kwargs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with _gc_paused(), _fake_tensor_log_quiet(), fake_parameters(model, mode, param_dtype), mode:
            # FSDP2's mixed precision casts floating inputs to param_dtype too
            args, kwargs = tree_map(lambda x: _trace_input(x, param_dtype), (real_args, real_kwargs))
            once = (model, args, kwargs, loss_fn, optimizer, cost_model, mode, autocast, runner, small_values,
                    output_held, grads_alive, batches_ahead)
            step = _trace_routed(once, routing, before)
            if before.grew():
                step = _trace_routed(once, routing, before)
    finally:
        before.install()
    workspace = library_workspace_bytes(cost_model.spec) if cost_model is not None else 0
    if workspace:  # alive from before the step to after it, as every step finds it
        step.recording.storages.append(StorageRecord(workspace, "workspace", -1))
    return step


class ValueBranchError(TraceError):
    """The forward read a tensor's values, which a fake trace does not have."""


def _trace_routed(once: tuple, routing: Routing | None, before) -> TracedStep:
    """One recorded step, routing decisions laid out by ``routing`` when it is
    given; else (:mod:`autosac.trace.routing`) they stay fake unless the
    trace needs their values: a forward that reads values picked from fake
    scores is traced again with balanced picks, and says so."""
    if routing is not None:
        return _trace_once(*once, routing=routing, route=True)
    try:
        return _trace_once(*once, routing=BALANCED, route=False)
    except ValueBranchError as e:
        failed = e
    before.install()  # as the failed attempt found the model
    try:
        step = _trace_once(*once, routing=BALANCED, route=True)
    except ValueBranchError:
        raise failed from None
    if not step.recording.routers:
        raise failed from None
    where = sorted({c.module or "(root)" for c in step.recording.routers})
    warnings.warn(
        f"autosac: the forward reads values picked by {step.recording.routers[0].op} from activations "
        f"({len(step.recording.routers)} picks, in {', '.join(where[:3])}{' ...' if len(where) > 3 else ''}): "
        "planned for balanced picks, as for mixture-of-experts routing; pass routing= (a capacity factor, or "
        "'worst') to plan for another, or routing='balanced' to say this is intended", stacklevel=4)
    return step


@contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off while the trace runs, back as it
    was after.  Its full passes walk every object the trace has made, so with
    it on the trace's time grows faster than the model (64 layers took 2.2x
    32 layers, 2.0x without); and a tensor only a reference cycle holds would
    otherwise die whenever a pass happens to run: now it stays alive to the
    end of the trace, the same in every run (the conservative side)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextmanager
def _fake_tensor_log_quiet():
    """FakeTensorMode logs a traceback for every op that raises before the
    error reaches us; the trace turns those errors into one clear TraceError,
    so that log is silenced while (and only while) the trace runs."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    before = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = before


@contextmanager
def _as_on_target(spec, autocast: torch.dtype | None):
    """Dropout, attention (:mod:`autosac.trace.dispatch`) and autocast's casts
    (:mod:`autosac.trace.autocast`) as the target runs them."""
    with target_autocast(spec.device_type, autocast) as cast:
        if spec.device_type != "cuda":
            yield
            return
        with TargetDispatch(spec.capability, cast):  # cast: the CudaAutocast, or None without autocast
            yield


class CompiledStepRecorder(StepRecorder):
    """A recorder Dynamo compiles under: it is off while Dynamo and AOTAutograd
    trace, and sees the ops the compiled graphs run."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def _trace_input(x, dtype: torch.dtype | None = None):
    """A fake twin of an example input -- except small integer and boolean
    tensors on the cpu (token ids, masks, positions), which stay real so that
    code reading their values branches as in the real step."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.device.type == "cpu" and not x.is_floating_point() and not x.is_complex() and x.numel() <= SMALL_NUMEL:
        return x
    return _fake_like(x, x.requires_grad, dtype)


def _trace_once(model, args, kwargs, loss_fn, optimizer, cost_model, mode, autocast=None,
                compiled=None, small_values=True, output_held=True, grads_alive="", batches_ahead=0, routing=BALANCED,
                route=True) -> TracedStep:
    """One recorded step on a model whose parameters are already fake (run
    through ``compiled``, its ``torch.compile`` wrapper, when given)."""
    names = {id(m): fqn for fqn, m in model.named_modules()}
    recorder = (StepRecorder if compiled is None else CompiledStepRecorder)(cost_model)
    recorder.fake_mode = mode
    recorder.small_values = small_values
    recorder.routing = RoutingTrace(routing, active=route)
    recorder.device_type = cost_model.spec.device_type
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
    _init_optimizer_state(model, opt)
    params = _track_params(model, opt, recorder)
    if grads_alive:
        _hold_gradients(model, recorder)
    buffer_bytes = _track_new(recorder, {id(b): b for b in model.buffers()}.values(), "buffer")
    input_bytes = _track_new(recorder, tree_leaves((args, kwargs)), "input")
    input_bytes += _hold_batches_ahead(recorder, input_bytes, batches_ahead)
    hooks = []
    runner = model if compiled is None else compiled
    if compiled is None:  # compiled code runs no module hooks
        for mod in model.modules():
            fqn = names[id(mod)]
            hooks.append(mod.register_forward_pre_hook(_pre_hook(recorder, fqn), with_kwargs=True))
            hooks.append(mod.register_forward_hook(_post_hook(recorder, fqn)))
    try:
        # transformers models run without a cache, as the applied model will run them
        with caches_off(model), _as_on_target(cost_model.spec, autocast):  # forward and loss under autocast
            loss, out, forward_end = _forward_and_loss(runner, args, kwargs, loss_fn, recorder)
        if output_held:
            _hold_previous_output(recorder, out, forward_end)
        else:
            del out
        if grads_alive == "forward":
            _drop_gradients(model)
        _backward_and_update(model, loss, opt, recorder)
    finally:
        for h in hooks:
            h.remove()
    recording = recorder.finish()
    for fqn, ps in params.items():
        ps.consumed_dtypes = sorted(recording.param_dtypes.get(fqn, ()))
    module_children: dict[str, list[str]] = {fqn: [] for fqn in names.values()}
    module_types = {fqn: type(m).__name__ for fqn, m in model.named_modules()}
    for fqn, m in model.named_modules():
        for cname, child in m.named_children():
            cfqn = names.get(id(child))
            if cfqn is not None and cfqn == (f"{fqn}.{cname}" if fqn else cname):
                module_children[fqn].append(cfqn)
    return TracedStep(recording, params, module_types, module_children, input_bytes, buffer_bytes)


def _track_params(model: nn.Module, opt, recorder: StepRecorder) -> dict[str, ParamStats]:
    """Register each parameter (once, under its first owner) and its optimizer state."""
    owners: dict[int, str] = {}
    params: dict[str, ParamStats] = {}
    for mod_fqn, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in owners:
                continue
            owners[id(p)] = mod_fqn
            fqn = f"{mod_fqn}.{pname}" if mod_fqn else pname
            recorder.track_param(fqn, p, stack_of(mod_fqn))
            for t in _state_tensors(opt, p):
                recorder.track(t, "optim")
            nbytes = p.numel() * p.element_size()
            params[fqn] = ParamStats(
                fqn, mod_fqn, list(p.shape), str(p.dtype).removeprefix("torch."), nbytes,
                p.requires_grad, nbytes if p.requires_grad else 0, _state_bytes(opt, p), [],
            )
    return params


def _hold_gradients(model: nn.Module, recorder: StepRecorder) -> None:
    """Gradient accumulation: the gradients the micro-batches before left,
    alive from the step's start; the backward adds into them in place."""
    for p in {id(p): p for p in model.parameters()}.values():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
            recorder.track(p.grad, "grad")


def _hold_batches_ahead(recorder: StepRecorder, input_bytes: int, n: int) -> int:
    """Batches a data loader fetched ahead (accelerate's holds the next one
    while the step runs): ``n`` more inputs' worth of bytes, alive throughout,
    as one record each; returns the bytes added."""
    for _ in range(n):
        if input_bytes:
            recorder.rec.storages.append(StorageRecord(input_bytes, "input", -1))
    return n * input_bytes


def _drop_gradients(model: nn.Module) -> None:
    """``zero_grad()`` between the loss and the backward: the gradients go
    (the recorder marks each freed at the current op)."""
    for p in model.parameters():
        p.grad = None


def _track_new(recorder: StepRecorder, tensors, kind: str) -> int:
    """Register the storages of ``tensors`` not yet known as ``kind``; return their bytes."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and recorder.record_of(t) is None:
            total += recorder.rec.storages[recorder.track(t, kind)].nbytes
    return total


def _forward_and_loss(model, args, kwargs, loss_fn, recorder: StepRecorder):
    """Run forward and loss; return the loss, the model's output and the event
    at which the forward returned."""
    with recorder, torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
        recorder.phase = "forward"
        out = _run_forward(model, args, kwargs, recorder)
        forward_end = len(recorder.rec.ops)
        recorder.phase = "loss"
        try:
            loss = loss_fn(out)
        except Exception as e:
            raise TraceError(f"loss_fn raised {type(e).__name__}: {e}") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TraceError("loss_fn must return a scalar tensor")
    if not loss.requires_grad:
        raise NothingToCheckpointError(
            "the loss does not require grad (the output is not differentiable): nothing to checkpoint"
        )
    return loss, out, forward_end


def _hold_previous_output(recorder: StepRecorder, out, forward_end: int) -> None:
    """The previous step's output, alive in the loop's variable from the step's
    start until this step's forward returns (:mod:`autosac.core.loop`): one record,
    kind ``"output"``, per storage the forward made for its output."""
    seen: set[int] = set()
    for t in output_tensors(out):
        i = recorder.index_of(t)
        if i is None or i in seen:
            continue
        seen.add(i)
        r = recorder.rec.storages[i]
        if r.created >= 0 and r.nbytes > 0:  # made by this step, as the previous step made its own
            recorder.rec.storages.append(StorageRecord(r.nbytes, "output", -1, freed=forward_end))


def _backward_and_update(model, loss, opt, recorder: StepRecorder) -> None:
    with recorder:
        recorder.phase = "backward"
        try:
            loss.backward()
        except Exception as e:
            raise TraceError(f"the backward pass raised {type(e).__name__}: {_first_line(e)}") from None
        del loss
        recorder.phase = "optimizer"
        for p in model.parameters():
            if p.grad is not None:
                recorder.relabel(p.grad, "grad")
        try:
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
        except Exception as e:
            raise TraceError(f"the optimizer step raised {type(e).__name__}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def stack_of(fqn: str) -> tuple[str, ...]:
    """The module stack of ``fqn``: root ``""`` first, then each enclosing module."""
    if fqn == "":
        return ("",)
    parts = fqn.split(".")
    return ("",) + tuple(".".join(parts[: i + 1]) for i in range(len(parts)))


def _pre_hook(recorder: StepRecorder, fqn: str):
    def hook(module, args, kwargs):
        if recorder.phase == "forward":
            recorder.push(fqn)
            recorder.rec.io_bytes.setdefault(fqn, [0, 0])[0] += _unique_bytes((args, kwargs))
            found = (recorder.index_of(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            recorder.rec.input_storages.setdefault(fqn, []).append(sorted({i for i in found if i is not None}))

    return hook


def _post_hook(recorder: StepRecorder, fqn: str):
    def hook(module, args, output):
        if recorder.phase == "forward":
            recorder.pop(fqn)
            recorder.rec.io_bytes[fqn][1] += _unique_bytes(output)
            found = (recorder.index_of(t) for t in tree_leaves(output) if isinstance(t, torch.Tensor))
            recorder.rec.output_storages.setdefault(fqn, set()).update(i for i in found if i is not None)

    return hook


def _unique_bytes(tree) -> int:
    seen = {}
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[id(st)] = st.nbytes()
    return sum(seen.values())


def _run_forward(model: nn.Module, args: tuple, kwargs: dict, recorder: StepRecorder):
    try:
        return model(*args, **kwargs)
    except TraceError:
        raise
    except Exception as e:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):  # the compiled step (trace/compiled.py)
            cause = getattr(e, "inner_exception", None) or e  # a backend's own error, not Dynamo's wrapper
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
            raise TraceError(f"torch.compile of {type(model._orig_mod).__name__} failed while tracing the step: "
                             f"{type(cause).__name__}: {first}") from None
        where = recorder.stack[-1] if recorder.stack else None
        if where is None or (where == "" and isinstance(e, TypeError) and len(recorder.rec.ops) == 0):
            raise TraceError(
                f"example_inputs do not fit {type(model).__name__}.forward: {type(e).__name__}: {e}"
            ) from None
        name = where or "(root)"
        mod = model.get_submodule(where) if where else model
        if recorder.random_branch:
            raise ValueBranchError(
                f"forward of module '{name}' ({type(mod).__name__}) branches on a random draw ({e}), as LayerDrop "
                "skips layers by chance, which a trace cannot follow: plan with it off (transformers: "
                "config.layerdrop=0.0) and train with it on: a step that skips layers does less than the plan's"
            ) from None
        if type(e).__name__ in ("DataDependentOutputException", "DynamicOutputShapeException"):
            raise ValueBranchError(
                f"forward of module '{name}' ({type(mod).__name__}) branches on tensor values ({e}), "
                "which a fake-mode trace cannot see: trace with inputs that take the usual branch "
                "behind a Python flag, or make the branch depend on shapes only"
            ) from None
        if isinstance(e, FakeKernelError) and e.real == "untried":
            raise TraceError(
                f"forward of module '{name}' ({type(mod).__name__}): PyTorch's fake kernel for {e.op} raised {e}; "
                "its inputs are too large to try the real kernel on -- if the model trains with these "
                "example_inputs, plan at a smaller batch or sequence to see whether the real kernel takes them"
            ) from None
        first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else ""
        kind = "" if isinstance(e, FakeKernelError) else f"{type(e).__name__}: "
        where = f" in {e.op} (its real kernel refuses them{'' if e.real == 'refused' else ' too'})" \
            if isinstance(e, FakeKernelError) else ""
        raise TraceError(
            f"forward of module '{name}' ({type(mod).__name__}) raised {kind}{first}{where}"
            " -- check that example_inputs fit the model"
        ) from None


def _state_tensors(opt, p) -> list[torch.Tensor]:
    if opt is None:
        return []
    return [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]


def _state_bytes(opt, p) -> int:
    return sum(t.untyped_storage().nbytes() for t in _state_tensors(opt, p))


def _init_optimizer_state(model: nn.Module, opt) -> None:
    """Give the optimizer the state it has from the second step on.

    Adam/AdamW (without amsgrad) and momentum SGD get their state tensors made
    directly, as their first step makes them; any other optimizer takes one
    update on zero gradients (slower in fake mode: foreach ops over every param).
    """
    if opt is None:
        return
    kind = type(opt)
    if kind in (torch.optim.Adam, torch.optim.AdamW) and not any(g["amsgrad"] for g in opt.param_groups):
        for g in opt.param_groups:
            for p in g["params"]:
                opt.state[p] = {
                    "step": torch.tensor(1.0, dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
        return
    if kind is torch.optim.SGD and all(g["momentum"] for g in opt.param_groups):
        for g in opt.param_groups:
            for p in g["params"]:
                opt.state[p] = {"momentum_buffer": torch.zeros_like(p)}
        return
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
