"""Run one whole training step of a user's model under FakeTensorMode.

The model's parameters and buffers are swapped for fake twins for the duration
(real weights are never copied; ``meta`` models work), the optimizer is stepped
once on zero gradients so its state exists as from the second step on, and then
forward, loss, backward and the optimizer step run under a :class:`StepRecorder`.

The fake twins are made in :mod:`autosac.trace.fakes`, the state the step
finds (optimizer state, gradients and batches held) in
:mod:`autosac.trace.step_state`, and a failing forward's error in
:mod:`autosac.trace.step_errors`.
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

from autosac.core.devices import FUSED_BIAS_MATMULS, library_workspace_bytes
from autosac.core.errors import NothingToCheckpointError, TraceError
from autosac.core.inputs import split_inputs
from autosac.core.integrations import caches_off
from autosac.core.loop import DEFAULT_LOOP, Loop
from autosac.core.optim import OptimizerSpec, default_loss, make_optimizer
from autosac.core.pystate import capture
from autosac.core.rng import HostRng
from autosac.core.stats import ParamStats
from autosac.trace.autocast import target_autocast
from autosac.trace.costs import CostModel
from autosac.trace.dispatch import TargetDispatch
from autosac.trace.fakes import fake_parameters, trace_input
from autosac.trace.recorder import StepRecorder
from autosac.trace.recording import Recording, StorageRecord
from autosac.trace.routing import BALANCED, Routing, RoutingTrace
from autosac.trace.step_errors import ValueBranchError, first_line, run_forward
from autosac.trace.step_state import (
    drop_gradients,
    hold_batches_ahead,
    hold_ddp_buckets,
    hold_gradients,
    hold_previous_output,
    init_optimizer_state,
    track_new,
    track_params,
)


@dataclass
class TracedStep:
    recording: Recording
    params: dict[str, ParamStats]
    module_types: dict[str, str]
    module_children: dict[str, list[str]]
    input_bytes: int
    buffer_bytes: int


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
    routing: Routing | None = None,
    loop: Loop = DEFAULT_LOOP,
) -> TracedStep:
    """Trace forward, loss, backward and optimizer step; return the raw recording.

    With ``compile_backend`` the forward runs as ``torch.compile(model,
    backend=compile_backend)`` would run it: the recording holds the ops of the
    compiled forward and backward graphs (and no module windows: compiled
    code runs no module hooks).  ``small_values=False`` runs every op fake
    (by default ops on small real cpu tensors run for real, so code that reads
    their values branches as in the real step); a compiled step whose fused
    kernels are skipped computes no values to read.  ``loop``: the training
    loop (:class:`autosac.core.loop.Loop`).  With ``output_held`` the model's
    output is alive to the step's end and the previous step's until the
    forward returns (else the output dies when the loss exists).  Its
    ``grads_alive``: ``"step"``, every gradient is alive from the step's
    start, as gradient accumulation leaves them for each micro-batch after the
    first; ``"forward"``, alive from the start until the loss exists and set
    to ``None`` before the backward (``zero_grad()`` there, as Lightning
    does).  ``batches_ahead``: copies of the inputs alive through the step
    (batches a data loader has already fetched).

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
            args, kwargs = tree_map(lambda x: trace_input(x, param_dtype), (real_args, real_kwargs))
            once = (model, args, kwargs, loss_fn, optimizer, cost_model, mode, autocast, runner, small_values, loop)
            step = _trace_routed(once, routing, before)
            if before.grew():
                step = _trace_routed(once, routing, before)
    finally:
        before.install()
    fused_bias = not FUSED_BIAS_MATMULS.isdisjoint(step.recording.ops)
    workspace = library_workspace_bytes(cost_model.spec, fused_bias) if cost_model is not None else 0
    if workspace:  # alive from before the step to after it, as every step finds it
        step.recording.storages.append(StorageRecord(workspace, "workspace", -1))
    return step


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


def _trace_once(model, args, kwargs, loss_fn, optimizer, cost_model, mode, autocast=None,
                compiled=None, small_values=True, loop: Loop = DEFAULT_LOOP, routing=BALANCED, route=True) -> TracedStep:
    """One recorded step on a model whose parameters are already fake (run
    through ``compiled``, its ``torch.compile`` wrapper, when given)."""
    names = {id(m): fqn for fqn, m in model.named_modules()}
    recorder = (StepRecorder if compiled is None else CompiledStepRecorder)(cost_model)
    recorder.fake_mode = mode
    recorder.small_values = small_values
    recorder.routing = RoutingTrace(routing, active=route)
    recorder.device_type = cost_model.spec.device_type
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
    init_optimizer_state(model, opt)
    params = track_params(model, opt, recorder)
    if loop.grads_alive:
        hold_gradients(model, recorder)
    bucket_views = hold_ddp_buckets(model, recorder, grads_held=bool(loop.grads_alive))
    buffer_bytes = track_new(recorder, {id(b): b for b in model.buffers()}.values(), "buffer")
    input_bytes = track_new(recorder, tree_leaves((args, kwargs)), "input")
    input_bytes += hold_batches_ahead(recorder, input_bytes, loop.batches_ahead)
    hooks = []
    runner = model if compiled is None else compiled
    if compiled is None:  # compiled code runs no module hooks
        recorder.rec.host_rng = set()
        for mod in model.modules():
            fqn, rng_at = names[id(mod)], []
            hooks.append(_mark_entry(mod, _pre_hook(recorder, fqn, rng_at)))
            hooks.append(mod.register_forward_hook(_post_hook(recorder, fqn, rng_at)))
    try:
        # transformers models run without a cache, as the applied model will run them
        with caches_off(model), _as_on_target(cost_model.spec, autocast):  # forward and loss under autocast
            loss, out, forward_end = _forward_and_loss(runner, args, kwargs, loss_fn, recorder)
        if loop.output_held:
            hold_previous_output(recorder, out, forward_end)
        else:
            del out
        if loop.grads_alive == "forward":
            drop_gradients(model, keep=bucket_views)
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


def _forward_and_loss(model, args, kwargs, loss_fn, recorder: StepRecorder):
    """Run forward and loss; return the loss, the model's output and the event
    at which the forward returned."""
    with recorder, torch.autograd.graph.saved_tensors_hooks(recorder.pack, recorder.unpack):
        recorder.phase = "forward"
        out = run_forward(model, args, kwargs, recorder)
        forward_end = len(recorder.rec.ops)
        recorder.phase = "loss"
        try:
            loss = loss_fn(out)
        except Exception as e:
            raise TraceError(f"loss_fn raised {type(e).__name__}: {e}") from None
    if loss is None:
        raise TraceError("loss_fn returned None: it must return the step's scalar loss (a transformers model "
                         "returns .loss only when example_inputs hold labels)")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TraceError(f"loss_fn must return a scalar tensor, not {shape} (reduce it: .mean() or .sum())")
    if not loss.requires_grad:
        raise NothingToCheckpointError(
            "the loss does not require grad (the output is not differentiable): nothing to checkpoint"
        )
    return loss, out, forward_end


def _backward_and_update(model, loss, opt, recorder: StepRecorder) -> None:
    with recorder:
        recorder.phase = "backward"
        try:
            loss.backward()
        except Exception as e:
            raise TraceError(f"the backward pass raised {type(e).__name__}: {first_line(e)}") from None
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
            raise TraceError(f"the optimizer step raised {type(e).__name__}: {first_line(e)}") from None


def _mark_entry(mod: nn.Module, hook):
    """Run ``hook(module, args, kwargs)`` where the module's forward starts,
    as the applier's checkpoint does: a forward pre-hook, except where the
    module has full backward hooks -- PyTorch then runs their input op
    (``BackwardHookFunction``) after the pre-hooks, outside the forward the
    applier wraps, so the hook wraps the forward itself.  Returns a handle
    whose ``remove()`` undoes it."""
    full, _ = mod._get_backward_hooks()
    if not (full or mod._get_backward_pre_hooks()):
        return mod.register_forward_pre_hook(hook, with_kwargs=True)
    return _ForwardMark(mod, hook)


class _ForwardMark:
    """``hook`` called at the start of ``mod.forward`` while set (see :func:`_mark_entry`)."""

    def __init__(self, mod: nn.Module, hook) -> None:
        self.mod, self.own = mod, mod.__dict__.get("forward")  # a forward set on the instance, if any
        inner = mod.forward

        def forward(*args, **kwargs):
            hook(mod, args, kwargs)
            return inner(*args, **kwargs)

        self.forward = forward
        mod.forward = forward

    def remove(self) -> None:
        if self.mod.__dict__.get("forward") is self.forward:
            if self.own is None:
                del self.mod.__dict__["forward"]
            else:
                self.mod.forward = self.own


def _pre_hook(recorder: StepRecorder, fqn: str, rng_at: list):
    def hook(module, args, kwargs):
        if recorder.phase == "forward":
            rng_at.append(HostRng.now())  # compared at its end: did it draw from Python's or NumPy's generator?
            recorder.push(fqn)
            recorder.rec.io_bytes.setdefault(fqn, [0, 0])[0] += _unique_bytes((args, kwargs))
            found = (recorder.index_of(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            recorder.rec.input_storages.setdefault(fqn, []).append(sorted({i for i in found if i is not None}))
            if fqn not in recorder.rec.state_items:  # what a checkpoint of it captures per call (pystate)
                recorder.rec.state_items[fqn] = capture(module, args, kwargs).items()

    return hook


def _post_hook(recorder: StepRecorder, fqn: str, rng_at: list):
    def hook(module, args, output):
        if recorder.phase == "forward":
            if rng_at and rng_at.pop() != HostRng.now():
                recorder.rec.host_rng.add(fqn)
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
