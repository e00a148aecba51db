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

from autosac.errors import MissingExtraError
from autosac.plan import Plan

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
    solver: str = "cbc"
    """The MILP backend: cbc or highs."""
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
        InfeasibleBudgetError: no plan reaches ``autosac.budget``.
        ValueError: a malformed budget or target.
    """
    from autosac.api import solve

    cfg, training = job_config.autosac, job_config.training
    device = next(model.parameters()).device
    tokens = torch.zeros(training.local_batch_size, training.seq_len, dtype=torch.long, device=device)
    mixed = {}
    if world_size > 1 and training.mixed_precision_param != "float32":
        mixed = {"param_dtype": getattr(torch, training.mixed_precision_param),
                 "reduce_dtype": getattr(torch, training.mixed_precision_reduce)}
    optimizer = job_config.optimizer.name.lower()
    return solve(model, cfg.budget, tokens, loss_fn=titan_loss, optimizer=optimizer if optimizer in
                 ("adamw", "adam") else "adamw", target=cfg.target, world_size=world_size, output_held=False,
                 solver=cfg.solver, reserve=cfg.reserve if not cfg.reserve.isdigit() else int(cfg.reserve), **mixed)


class AutosacConverter:
    """torchtitan's ``ModelConverter`` protocol: ``convert(model)`` plans (or
    loads ``--autosac.plan``) and applies the plan in place."""

    def __init__(self, job_config, parallel_dims) -> None:
        if job_config.activation_checkpoint.mode != "none":
            raise ValueError("the autosac converter decides what to checkpoint: set --activation_checkpoint.mode "
                             f"none (it is {job_config.activation_checkpoint.mode!r})")
        self.job_config = job_config
        self.world_size = parallel_dims.dp_shard * parallel_dims.cp if parallel_dims.fsdp_enabled else 1
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
