"""Stage 1 of the pipeline: trace one training step into :class:`ModelStats`."""

from __future__ import annotations

import warnings
from dataclasses import asdict, replace

import torch
from torch import nn

from autosac.core.allocations import refuse_running_profiler
from autosac.core.devices import DeviceSpec, resolve_target
from autosac.core.fingerprint import model_fingerprint
from autosac.core.inputs import input_signature, split_inputs
from autosac.core.integrations import own_checkpointing
from autosac.core.loop import Loop, resolve_loop
from autosac.core.marks import has_applied_plan
from autosac.core.optim import OptimizerSpec, optimizer_name
from autosac.core.rng import generators_kept
from autosac.core.stats import ModelStats
from autosac.core.userwarn import warn_user
from autosac.core.version import __version__
from autosac.trace.aggregate import aggregate
from autosac.trace.autocast import check_autocast_dtype
from autosac.trace.costs import CostModel
from autosac.trace.routing import parse_routing
from autosac.trace.step import trace_step
from autosac.trace.units import refuse_sharded, resolve_shard_units

__all__ = ["profile"]


def profile(
    model: nn.Module,
    example_inputs,
    loss_fn=None,
    optimizer: OptimizerSpec = "adamw",
    target: str | DeviceSpec = "h100",
    world_size: int = 1,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    shard_units: list[str] | str | None = None,
    output_held: bool = True,
    routing=None,
    grad_accumulation: int = 1,
    zero_grad: str = "after_step",
    batches_ahead: int = 0,
    loop: Loop | None = None,
) -> ModelStats:
    """Trace one training step (forward, loss, backward, optimizer step) under
    FakeTensorMode and return its memory, runtime and recompute statistics.

    No real memory is allocated and no weight is copied: the model may live on
    ``meta`` or on the CPU with real weights, and inputs may be real, meta or fake.

    Args:
        model: the ``nn.Module`` to profile (left unchanged).
        example_inputs: a tensor, a tuple of positional args, or a dict of kwargs.
        loss_fn: ``loss_fn(output) -> scalar``; default: the output if scalar,
            an output mapping's scalar ``loss`` (a transformers output's, where the
            batch held labels), else the sum of every tensor in the output.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"none"`` or ``callable(params)``.
        target: a device-table name (``"h100"``, ``"h200"``, ``"a100"``, ``"l4"``,
            ``"cpu"`` = timed on this machine) or a :class:`DeviceSpec`.
        world_size: ranks sharing params/grads/optimizer state (FSDP/ZeRO-3);
            recorded for the solver.
        param_dtype, reduce_dtype: FSDP2's ``MixedPrecisionPolicy``, with
            ``world_size > 1``: the step is traced with parameters (and
            floating inputs) in ``param_dtype``, gathered in it, and gradients
            reduced in ``reduce_dtype`` (default: ``param_dtype``, as FSDP2's);
            shards and optimizer state stay in the parameters' own dtype.
        autocast: ``torch.bfloat16`` or ``torch.float16``: the forward and the
            loss are traced under ``torch.autocast`` in that dtype with the
            target device's cast policy (CUDA's for a GPU target, see
            :mod:`autosac.trace.autocast`); train the same way, with
            ``torch.autocast(device_type, dtype)`` around forward and loss.
        shard_units: with ``world_size > 1``, the modules you pass to FSDP2's
            ``fully_shard`` (besides the root), as names or shell patterns
            (``"layers.*"``; a string may list several, comma-separated).
            Default: one unit per child of each ``ModuleList``/``Sequential``.
            Profile the model before sharding it: a model already sharded
            is refused with the units it has, ready to pass here.
        output_held: the training loop keeps the model's output in a variable
            (``out = model(x); loss = loss_fn(out); loss.backward()``), so it
            is alive through backward and the optimizer step, and the previous
            step's output until the forward returns (the default).  ``False``:
            the output dies as soon as the loss exists
            (``loss_fn(model(x)).backward()``, transformers' ``Trainer``).
            See :mod:`autosac.core.loop`; measure with the same setting.
        routing: for mixture-of-experts models, how many tokens each expert
            gets, which a fake trace cannot see: ``"balanced"`` (every expert
            ``tokens * top_k / experts``), a capacity factor such as ``1.25``
            (the busiest experts get 1.25 times that) or ``"worst"`` (all tokens
            to ``top_k`` experts).  ``None`` (the default): balanced, only where
            the forward reads the values of picks (``topk``, ``argmax``, ...)
            made from activations, with a warning that says so; a forward that
            never reads them is traced without any.  See
            :mod:`autosac.trace.routing`; recorded in ``stats.routing`` (empty
            when no pick was laid out).
        grad_accumulation: micro-batches per optimizer step (the example
            inputs are one micro-batch).  Above 1, gradients left by the
            micro-batches before are alive through the whole forward and
            backward of the next, so the step is traced as that worst
            micro-batch: every gradient exists from its start, and the
            optimizer step follows its backward.  Recorded in
            ``stats.grad_accumulation``.  One process only (``world_size=1``).
        zero_grad: where the loop sets gradients to ``None``:
            ``"after_step"`` (``opt.step(); opt.zero_grad()``, the default) or
            ``"before_backward"`` (after the loss, before ``loss.backward()``,
            as Lightning does: the previous step's gradients are alive through
            the forward).  Recorded in ``stats.zero_grad``.
        batches_ahead: batches the data loader holds besides the one the step
            runs, each the size of ``example_inputs`` (accelerate's loader in
            transformers' ``Trainer`` fetches the next batch before the step).
            Recorded in ``stats.batches_ahead``.
        loop: the four loop settings above as one :class:`autosac.Loop`
            (``stats.loop`` gives it back), instead of the keywords.

    Returns:
        ModelStats: plain, JSON-serialisable statistics.  A model in eval mode
        is traced as it runs (no dropout; batch norm reading its running
        statistics), with a warning: plan a training step after ``model.train()``.

    Raises:
        NothingToCheckpointError: nothing requires grad / the loss is not differentiable.
        TraceError: the forward raised (the message names the module) or inputs don't fit.
        ValueError: an unknown target or optimizer, a malformed ``routing``, ``world_size < 1``, a
            ``grad_accumulation`` that is not a positive int (or above 1 with ``world_size > 1``), an
            unknown ``zero_grad``, a
            ``param_dtype`` without ``world_size > 1`` or not floating, an
            ``autocast`` other than bfloat16/float16, ``shard_units`` naming
            no module, the root, nested units or units without ``world_size > 1``,
            a model already sharded by ``fully_shard``, a model
            that already has a plan applied, or one that checkpoints by itself
            (transformers' ``gradient_checkpointing_enable()``).
        TypeError: ``model`` is not an ``nn.Module``.
        ProfilerBusyError: a ``torch.profiler`` session is running (autosac's
            own measurements would end it): profile before starting it.

    Example::

        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig(n_layer=2))
        >>> stats = autosac.profile(model, torch.randint(0, 50304, (8, 1024), device="meta"))
        >>> print(stats.peak_bytes / 2**30, stats.peak_phase)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"profile needs an nn.Module, got {type(model).__name__}")
    reason = own_checkpointing(model)
    if reason is not None:
        raise ValueError(reason)
    if has_applied_plan(model):
        raise ValueError("the model has an autosac plan applied: call autosac.unapply(model) before profiling it")
    if not model.training:  # transformers' from_pretrained returns models in eval mode
        warn_user(f"autosac: {type(model).__name__} is in eval mode, and its step is traced as it runs now (no "
                  "dropout, batch norm reading its running statistics): the plan holds for eval-mode steps only "
                  "-- call model.train() before planning a training step")
    refuse_running_profiler()
    spec = resolve_target(target)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if world_size > 1 and any(isinstance(m, nn.parallel.DistributedDataParallel) for m in model.modules()):
        raise ValueError("DistributedDataParallel replicates the model on each rank: plan it with world_size=1 "
                         "(world_size models FSDP2's sharding)")
    mixed = _mixed_precision(model, world_size, param_dtype, reduce_dtype)
    check_autocast_dtype(autocast)
    loop = resolve_loop(loop, output_held=output_held, grad_accumulation=grad_accumulation, zero_grad=zero_grad,
                        batches_ahead=batches_ahead)
    if loop.grad_accumulation > 1 and world_size > 1:
        raise ValueError("grad_accumulation above 1 is modelled for one process only (world_size=1): FSDP2 "
                         "reduces and keeps sharded gradients between micro-batches, which the trace does not model")
    assumed = None if routing is None else parse_routing(routing)
    refuse_sharded(model, world_size)
    units = resolve_shard_units(model, shard_units, world_size)
    step, cost = _trace_confirmed(spec, lambda cost: trace_step(
        model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, cost_model=cost, param_dtype=param_dtype,
        autocast=autocast, routing=assumed, loop=loop))
    _say_unknown_ops(step.recording.unknown_ops)
    stats = aggregate(
        step,
        model_name=type(model).__name__,
        fingerprint=model_fingerprint(model),
        target=replace(spec, host=cost.host).to_dict(),  # the host figures the times include
        world_size=world_size,
        optimizer=optimizer_name(optimizer),
        versions={"autosac": __version__, "torch": torch.__version__},
    )
    stats.input_shapes = input_signature(*split_inputs(example_inputs))
    stats.mixed_precision = mixed
    stats.autocast = str(autocast).removeprefix("torch.") if autocast is not None else ""
    stats.shard_units = units
    stats.output_held, stats.grad_accumulation = loop.output_held, loop.grad_accumulation
    stats.zero_grad, stats.batches_ahead = loop.zero_grad, loop.batches_ahead
    routers = step.recording.routers
    stats.routing = {"assumption": (assumed or parse_routing("balanced")).to_dict(),
                     "routers": [asdict(c) for c in routers]} if routers else {}
    # preserve_rng_state keeps the CPU generator state (and a device's) per checkpoint call
    stats.checkpoint_state_bytes = torch.get_rng_state().numel() + (16 if not spec.measured else 0)
    return stats


def _trace_confirmed(spec: DeviceSpec, trace):
    """``(step, cost model)``: ``trace(cost)`` run with a new :class:`CostModel`
    of ``spec``, and once more where an op first timed in it read slow when
    timed again (:meth:`CostModel.confirm_timings`: a slow moment of the
    machine), from the same random state; the user's seeded RNG is left as it was."""
    def traced(cost: CostModel):
        try:
            return trace(cost)
        finally:
            cost.finish()

    with generators_kept():  # timing real ops (and Python in the forward) must not move the user's seeded RNG
        cost = CostModel(spec)
        with generators_kept():  # a trace taken again starts from the same random state
            step = traced(cost)
        changed = cost.confirm_timings()  # each op first timed now, timed once more
        cost.finish()
        if changed:
            del step
            cost = CostModel(spec)
            step = traced(cost)
    return step, cost


_SAID_UNKNOWN: set[str] = set()  # ops already named in this process


def _say_unknown_ops(ops: set[str]) -> None:
    """One line naming the ops without a FLOP formula, each once per process
    (``stats.unknown_flop_ops`` lists a profile's own)."""
    new = sorted(set(ops) - _SAID_UNKNOWN)
    if new:
        _SAID_UNKNOWN.update(new)
        warnings.warn(f"autosac: no FLOP formula for {', '.join(new)}; timed as memory-bound (said once per op)",
                      stacklevel=3)


def _mixed_precision(model: nn.Module, world_size: int, param_dtype, reduce_dtype) -> dict:
    """Validate FSDP2's mixed precision options; the sizes the solver needs."""
    if param_dtype is None:
        if reduce_dtype is not None:
            raise ValueError("reduce_dtype needs param_dtype (FSDP2's MixedPrecisionPolicy)")
        return {}
    for name, d in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if d is not None and (not isinstance(d, torch.dtype) or not d.is_floating_point):
            raise ValueError(f"{name} must be a floating torch.dtype such as torch.bfloat16, got {d!r}")
    if world_size < 2:
        raise ValueError("param_dtype is FSDP2's MixedPrecisionPolicy: it needs world_size > 1")
    master = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    reduce = reduce_dtype or param_dtype
    return {
        "param_dtype": str(param_dtype).removeprefix("torch."), "reduce_dtype": str(reduce).removeprefix("torch."),
        # the trace's parameter, gradient and optimizer bytes are in param_dtype: these scale them
        "master_ratio": master.itemsize / param_dtype.itemsize, "reduce_ratio": reduce.itemsize / param_dtype.itemsize,
    }
