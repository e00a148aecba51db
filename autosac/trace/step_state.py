"""The state a traced step finds when it starts, as a training loop leaves it:
parameters and their optimizer state (as from the second step on), gradients
held from earlier micro-batches, DistributedDataParallel's gradient buckets,
batches a data loader fetched ahead, and the previous step's output -- each registered with the :class:`StepRecorder`."""

from __future__ import annotations

import torch
from torch import nn

from autosac.core.loop import output_tensors
from autosac.core.stats import ParamStats
from autosac.trace.recorder import StepRecorder
from autosac.trace.recording import StorageRecord, stack_of


def track_params(model: nn.Module, opt, recorder: StepRecorder) -> dict[str, ParamStats]:
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


def hold_gradients(model: nn.Module, recorder: StepRecorder) -> None:
    """Gradient accumulation: the gradients the micro-batches before left,
    alive from the step's start; the backward adds into them in place."""
    for p in {id(p): p for p in model.parameters()}.values():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
            recorder.track(p.grad, "grad")


def hold_ddp_buckets(model: nn.Module, recorder: StepRecorder, grads_held: bool) -> set[int]:
    """``DistributedDataParallel``'s gradient buckets, for each DDP in the
    model: a flat copy of the gradients of the parameters it reduces, made when
    DDP is built and alive through every step, as one record of their bytes
    besides the gradients autograd makes.  With ``gradient_as_bucket_view=True``
    the gradients are views of them: alive from the step's start (as
    :func:`hold_gradients` holds them; already so where ``grads_held``) and
    never freed -- returns the ids of those parameters, whose gradients
    :func:`drop_gradients` keeps."""
    views: set[int] = set()
    for ddp in model.modules():
        if not isinstance(ddp, nn.parallel.DistributedDataParallel):
            continue
        ignored = ddp.parameters_to_ignore
        reduced = {id(p): p for fqn, p in ddp.module.named_parameters() if p.requires_grad and fqn not in ignored}
        if ddp.gradient_as_bucket_view:
            for p in reduced.values():
                if p.grad is None and not grads_held:
                    p.grad = torch.zeros_like(p)
                    recorder.track(p.grad, "grad")
            views.update(reduced)
            continue
        nbytes = sum(p.numel() * p.element_size() for p in reduced.values())
        if nbytes:
            recorder.rec.storages.append(StorageRecord(nbytes, "grad", -1))
    return views


def hold_batches_ahead(recorder: StepRecorder, input_bytes: int, n: int) -> int:
    """Batches a data loader fetched ahead (accelerate's holds the next one
    while the step runs): ``n`` more inputs' worth of bytes, alive throughout,
    as one record each; returns the bytes added."""
    for _ in range(n):
        if input_bytes:
            recorder.rec.storages.append(StorageRecord(input_bytes, "input", -1))
    return n * input_bytes


def drop_gradients(model: nn.Module, keep: set[int] = frozenset()) -> None:
    """``zero_grad()`` between the loss and the backward: the gradients go
    (the recorder marks each freed at the current op), but those of the
    parameters in ``keep`` (views of DDP's buckets, which stay)."""
    for p in model.parameters():
        if id(p) not in keep:
            p.grad = None


def track_new(recorder: StepRecorder, tensors, kind: str) -> int:
    """Register the storages of ``tensors`` not yet known as ``kind``; return their bytes."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and recorder.record_of(t) is None:
            total += recorder.rec.storages[recorder.track(t, kind)].nbytes
    return total


def hold_previous_output(recorder: StepRecorder, out, forward_end: int) -> None:
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


def _state_tensors(opt, p) -> list[torch.Tensor]:
    if opt is None:
        return []
    return [v for v in opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)]


def _state_bytes(opt, p) -> int:
    return sum(t.untyped_storage().nbytes() for t in _state_tensors(opt, p))


def init_optimizer_state(model: nn.Module, opt) -> None:
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
