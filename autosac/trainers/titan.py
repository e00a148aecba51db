"""autosac inside torchtitan (0.2.x): a model converter and a config section.

torchtitan builds the model on ``meta``, runs the model converters named in
``--model.converters``, then parallelizes (activation checkpointing, FSDP2).
Importing this module registers the converter ``"autosac"`` and defines the
``[autosac]`` config section, so a plan goes in without patching torchtitan::

    torchrun ... -m torchtitan.train --job.config_file llama3_8b.toml \\
        --job.custom_config_module autosac.trainers.titan \\
        --model.converters autosac --activation_checkpoint.mode none \\
        --autosac.budget 60% --autosac.target h100

The converter plans the step torchtitan runs -- ``training.local_batch_size`` x
``training.seq_len`` tokens, its cross-entropy on the float logits (which it
drops before the backward), ``optimizer.name``, FSDP2 over the data-parallel
shard degree with ``training.mixed_precision_param`` -- on the ``meta`` model,
and applies the plan before torchtitan shards it.  ``--autosac.plan FILE``
applies a plan made beforehand instead (``autosac.solve(...).save(FILE)``).
torchtitan's own checkpointing must be off (``--activation_checkpoint.mode none``):
its wrappers and autosac's would nest.

Needs the ``titan`` extra: ``pip install 'autosac[titan]'``.
"""

# no `from __future__ import annotations`: tyro resolves the config fields' types at run time
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from autosac.core.errors import MissingExtraError
from autosac.core.loop import Loop
from autosac.core.plan import Plan

try:
    from torchtitan.protocols.model_converter import register_model_converter
except ImportError:
    raise MissingExtraError("autosac.trainers.titan needs torchtitan 0.2: pip install 'autosac[titan]'") from None

__all__ = ["Autosac", "JobConfig", "AutosacConverter", "titan_loss", "plan_for_job"]

log = logging.getLogger("autosac")


@dataclass
class Autosac:
    """The ``[autosac]`` section of a torchtitan job config."""

    budget: str = "60%"
    """Memory budget per rank: "20GiB", "60%" (of the unplanned peak), "least"."""
    target: str = "h100"
    """The device the step is timed for (autosac's device table: h100, h200, a100, l4, cpu)."""
    plan: str = ""
    """A plan file made beforehand to apply instead of planning here."""
    solver: str = "auto"
    """The MILP backend: auto (CBC where PuLP has one, else HiGHS), cbc or highs."""
    reserve: str = "0"
    """Headroom kept free for allocator overheads ("2GiB")."""


@dataclass
class JobConfig:
    """What ``--job.custom_config_module autosac.trainers.titan`` adds to torchtitan's JobConfig."""

    autosac: Autosac = field(default_factory=Autosac)


def titan_loss(output: torch.Tensor) -> torch.Tensor:
    """torchtitan's training loss on ``output`` (logits ``[batch, seq, vocab]``):
    cross-entropy on the float logits, summed; the labels only set its value."""
    labels = torch.zeros(output.shape[:2], dtype=torch.long, device=output.device)
    return torch.nn.functional.cross_entropy(output.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def plan_for_job(model: nn.Module, job_config, world_size: int = 1) -> Plan:
    """Plan ``model`` (torchtitan's, on ``meta`` or real) for the step ``job_config`` describes.

    Args:
        model: torchtitan's model (its forward takes the tokens).
        job_config: torchtitan's JobConfig with the ``autosac`` section.
        world_size: ranks FSDP2 shards over (the data-parallel shard degree).

    Returns:
        Plan: the plan (not applied).

    Raises:
        InfeasibleBudgetError: no plan reaches ``autosac.core.budget``.
        ValueError: a malformed budget or target.
    """
    from autosac.api import solve

    cfg, training = job_config.autosac, job_config.training
    device = next(model.parameters()).device
    tokens = torch.zeros(training.local_batch_size, training.seq_len, dtype=torch.long, device=device)
    low = training.mixed_precision_param != "float32"
    if world_size > 1:  # FSDP2's mixed precision
        mixed = {"param_dtype": getattr(torch, training.mixed_precision_param),
                 "reduce_dtype": getattr(torch, training.mixed_precision_reduce)} if low else {}
    else:  # one device: torchtitan runs forward and loss under autocast (maybe_enable_amp)
        mixed = {"autocast": getattr(torch, training.mixed_precision_param)} if low else {}
    reserve = cfg.reserve.strip()
    return solve(model, cfg.budget, tokens, loss_fn=titan_loss, optimizer=_optimizer(job_config.optimizer),
                 target=cfg.target, world_size=world_size, solver=cfg.solver,
                 reserve=0 if reserve in ("", "0") else reserve,
                 loop=Loop(output_held=False, grad_accumulation=accumulation_steps(job_config, world_size)), **mixed)


def _optimizer(config):
    """torchtitan's optimizer as it builds it: foreach's step makes a list of
    parameter-sized temporaries at once; fused and for-loop steps (modelled
    alike: fused kernels need a real device) one parameter's at a time."""
    name = config.name
    kinds = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
    if name.lower() not in kinds:
        raise ValueError(f"the autosac converter models AdamW and Adam; this job uses {name!r}")
    kind, foreach = kinds[name.lower()], config.implementation == "foreach"

    def build(params):
        return kind(params, lr=1e-4, foreach=foreach)

    build.__name__ = name.lower()
    return build


def accumulation_steps(job_config, dp_degree: int) -> int:
    """Micro-batches per optimizer step, as torchtitan derives them from the
    global and local batch sizes over the data-parallel degree.

    Raises:
        ValueError: accumulation over several ranks (FSDP2 keeps sharded
            gradients between micro-batches, which autosac does not model)."""
    training = job_config.training
    global_batch = training.global_batch_size
    per_step = training.local_batch_size * dp_degree
    steps = 1 if global_batch < 0 else max(1, global_batch // per_step)
    if steps > 1 and dp_degree > 1:
        raise ValueError(f"the autosac converter models gradient accumulation on one rank; this job accumulates "
                         f"{steps} micro-batches over {dp_degree} ranks: raise training.local_batch_size")
    return steps


class AutosacConverter:
    """torchtitan's ``ModelConverter`` protocol: ``convert(model)`` plans (or
    loads ``--autosac.plan``) and applies the plan in place."""

    def __init__(self, job_config, parallel_dims) -> None:
        if job_config.activation_checkpoint.mode != "none":
            raise ValueError("the autosac converter decides what to checkpoint: set --activation_checkpoint.mode "
                             f"none (it is {job_config.activation_checkpoint.mode!r})")
        unmodelled = {name: getattr(parallel_dims, name) for name in ("dp_replicate", "tp", "pp", "cp", "ep")
                      if getattr(parallel_dims, name, 1) > 1}
        if unmodelled:
            raise ValueError(f"the autosac converter models FSDP2 over data-parallel shards only; this job has "
                             f"{', '.join(f'{k}={v}' for k, v in unmodelled.items())}")
        self.job_config = job_config
        self.world_size = parallel_dims.dp_shard if parallel_dims.fsdp_enabled else 1
        self.plan = None

    def convert(self, model: nn.Module) -> None:
        from autosac.applier import apply

        path = self.job_config.autosac.plan
        self.plan = Plan.load(path) if path else plan_for_job(model, self.job_config, self.world_size)
        apply(model, self.plan)
        log.info("autosac plan applied (%d modules checkpointed):\n%s", len(self.plan.decisions), self.plan)

    def post_optimizer_hook(self, model) -> None:
        pass


register_model_converter(AutosacConverter, "autosac")
