"""What every trainer integration does the same way: read the trainer's own
setup (its optimizer, its first batch, the device the model is on), then
profile, solve and apply -- through the public pipeline only.

Each integration (:mod:`autosac.trainers.hf`, :mod:`autosac.trainers.lightning`,
:mod:`autosac.trainers.titan`) turns its trainer's settings into a
:class:`PlanRequest` and calls :func:`plan_and_apply`.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from autosac.api import solve
from autosac.applier import apply
from autosac.core.integrations import own_checkpointing, transformers_models
from autosac.core.loop import Loop
from autosac.core.plan import Plan
from autosac.core.rng import generators_kept

log = logging.getLogger("autosac")

__all__ = ["PlanRequest", "plan_and_apply", "first_batch", "optimizer_like", "default_target",
           "refuse_processes", "turn_off_transformers_checkpointing"]


@dataclass
class PlanRequest:
    """What to plan for: ``budget`` and the step the trainer runs.

    ``optimizer``, ``autocast`` and ``loop`` (:class:`autosac.Loop`; a
    trainer's step drops the model's output at the loss) are as in
    :func:`autosac.profile` (the integrations fill them from the trainer); ``target`` defaults to the device the model is on
    (:func:`default_target`); ``solve_kwargs`` go to :func:`autosac.solve`
    (``solver``, ``time_limit_s``, ``reserve``, ``routing``, ...)."""

    budget: str | int | float
    loss_fn: object = None
    optimizer: object = "adamw"
    autocast: torch.dtype | None = None
    loop: Loop = field(default_factory=lambda: Loop(output_held=False))
    target: object = None
    solve_kwargs: dict = field(default_factory=dict)


def plan_and_apply(model: nn.Module, example_inputs, request: PlanRequest) -> Plan:
    """Profile one training step of ``model`` on ``example_inputs`` as
    ``request`` describes (in training mode where the model is in eval mode
    now: the trainer trains it; every module's mode is restored after), solve
    for its budget and apply the plan to ``model`` in place.

    Returns:
        Plan: the plan applied (also logged, as its table, on the ``autosac`` logger).

    Raises:
        InfeasibleBudgetError: no plan reaches the budget (the model is left unchanged).
        ValueError, TraceError: as :func:`autosac.solve` raises them.
    """
    target = request.target if request.target is not None else default_target(model)
    # traced in training mode, as the trainer's steps run: a model from transformers' from_pretrained is in eval
    # mode when training begins (the Trainer calls train() in each step), and its plan had no dropout in it.  A
    # model already training keeps its submodules' modes (Lightning keeps those a user left in eval mode)
    modes = {m: m.training for m in model.modules()}
    if not model.training:
        model.train()
    try:
        plan = solve(model, request.budget, example_inputs, loss_fn=request.loss_fn, optimizer=request.optimizer,
                     target=target, autocast=request.autocast, loop=request.loop, **request.solve_kwargs)
    finally:
        for m, training in modes.items():
            m.training = training
    apply(model, plan)
    log.info("autosac plan applied (%d modules checkpointed):\n%s", len(plan.decisions), plan)
    return plan


def default_target(model: nn.Module) -> str:
    """``"cpu"`` (timed on this machine) for a model on the CPU; on a GPU the
    entry of autosac's device table whose name appears in the device's name
    (``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``).

    Raises:
        ValueError: a GPU autosac's table does not name: pass ``target=``."""
    from autosac.core.devices import DEVICES

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for key in sorted(DEVICES, key=len, reverse=True):
            if key != "cpu" and key in name.replace(" ", ""):
                return key
        raise ValueError(f"autosac has no device entry matching {name!r}: pass target= (one of "
                         f"{', '.join(DEVICES)}, or an autosac.DeviceSpec)")
    raise ValueError(f"autosac plans for cpu and cuda models; this one is on {device.type}: pass target=")


def optimizer_like(optimizer) -> object:
    """A factory ``callable(params) -> optimizer`` for the kind of ``optimizer``
    (unwrapped from accelerate's or Lightning's wrapper), with its defaults:
    its state per parameter, and so its memory, are the trainer's.  ``None``
    when there is none (``"none"``: the step is planned without an optimizer update).

    Raises:
        TypeError: an optimizer from outside ``torch.optim`` (8-bit and paged
            optimizers keep other state than their parameters' dtype): pass ``optimizer=``."""
    inner = optimizer
    while hasattr(inner, "optimizer") and isinstance(inner.optimizer, torch.optim.Optimizer):
        inner = inner.optimizer
    if inner is None:
        return "none"
    if not isinstance(inner, torch.optim.Optimizer) or not type(inner).__module__.startswith("torch.optim"):
        raise TypeError(f"autosac cannot model the optimizer {type(inner).__name__}: pass optimizer= "
                        "('adamw', 'sgd', 'none' or a callable(params) building one like it)")
    kind = type(inner)
    # settings the constructor takes (a subclass may keep more in defaults: AdamW's decoupled_weight_decay)
    accepted = inspect.signature(kind.__init__).parameters
    defaults = {k: v for k, v in inner.defaults.items() if k in accepted}

    def build(params):
        return kind(params, **defaults)

    build.__name__ = kind.__name__.lower()
    return build


def first_batch(dataloader):
    """The first batch ``dataloader`` yields, drawn without changing what
    training will draw: random generators are restored after, and accelerate's
    wrapper is bypassed for the plain ``DataLoader`` it holds (its iteration
    state is the trainer's).

    Raises:
        ValueError: the dataloader is empty or missing."""
    if dataloader is None:
        raise ValueError("autosac needs the trainer's training dataloader for its example batch: pass "
                         "example_inputs= instead")
    plain = getattr(dataloader, "base_dataloader", dataloader)
    own = _loader_generators(plain)  # a loader's or sampler's own generator advances as it is iterated
    states = [g.get_state() for g in own]
    with generators_kept():
        it = iter(plain)
        try:
            batch = next(it)
        except StopIteration:
            raise ValueError("the training dataloader is empty: autosac has no batch to plan for") from None
        finally:
            del it
            for g, state in zip(own, states):
                g.set_state(state)
    return batch


def _loader_generators(loader) -> list[torch.Generator]:
    """The generators a ``DataLoader`` draws from besides the global ones: its
    own ``generator=`` and its sampler's and batch sampler's (each once)."""
    found: dict[int, torch.Generator] = {}
    for obj in (loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator):
            found.setdefault(id(g), g)
    return list(found.values())


def refuse_processes(processes: int, trainer: str) -> None:
    """A one-line ``ValueError`` for a run over several processes: DDP's
    gradient buckets, FSDP's and DeepSpeed's sharding are not what a
    one-process plan models."""
    if processes > 1:
        raise ValueError(f"the autosac {trainer} callback plans one-process training; this run has {processes} "
                         "processes: plan with autosac.solve(..., world_size=N) and apply it before sharding")


def turn_off_transformers_checkpointing(model: nn.Module) -> str | None:
    """Turn transformers' own gradient checkpointing off wherever it is on in
    ``model``'s tree; return the one line that says so (``None``: it was off).
    autosac's plan then decides what is checkpointed."""
    reason = own_checkpointing(model)
    if reason is None:
        return None
    for _, mod in transformers_models(model):
        off = getattr(mod, "activation_checkpointing_disable", None) or mod.gradient_checkpointing_disable
        off()
    return ("autosac: turned transformers' gradient checkpointing off (gradient_checkpointing=True): "
            "the autosac plan decides what is checkpointed")
