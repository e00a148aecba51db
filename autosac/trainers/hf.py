"""autosac inside transformers' ``Trainer``: one callback.

Example::

    >>> from autosac.trainers.hf import AutosacCallback
    >>> trainer = Trainer(model=model, args=TrainingArguments(..., bf16=True), train_dataset=ds,
    ...                   callbacks=[AutosacCallback("60%")])
    >>> trainer.train()          # planned and applied before the first step

At ``on_train_begin`` -- after the Trainer has built its optimizer and its
dataloader, before the first step -- the callback plans the step the Trainer
runs, and applies the plan to the model in place:

- the example input is the first batch of the Trainer's own training
  dataloader, drawn without changing what training draws (random generators
  restored); the loss is the model's ``loss`` output, as ``Trainer.compute_loss``
  takes it;
- the optimizer is the Trainer's (its kind and settings: ``adamw_torch``,
  ``sgd``, ...), autocast is ``bf16=True``/``fp16=True``, and
  ``gradient_accumulation_steps`` is the accumulation planned for;
- the loop drops the model's output once the loss exists (``Trainer`` does),
  so the plan is made with ``output_held=False``; the Trainer fetches every
  micro-batch of an optimizer step before the first runs, and accelerate's
  dataloader the next one too (``batches_ahead=gradient_accumulation_steps``);
- ``gradient_checkpointing=True`` is turned off, with a warning: the plan
  decides what to checkpoint, and transformers' checkpoints would nest
  inside autosac's.

A batch of another shape than the first (dynamic padding) is warned about at
run time: plan for the longest batch by passing ``example_inputs=``.

Needs the ``hf`` extra: ``pip install 'autosac[hf]'``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping

import torch

from autosac.applier import applied_plan
from autosac.core.errors import MissingExtraError
from autosac.core.loop import Loop
from autosac.trainers.common import (
    PlanRequest,
    first_batch,
    optimizer_like,
    plan_and_apply,
    refuse_processes,
    turn_off_transformers_checkpointing,
)

try:
    from transformers import TrainerCallback
except ImportError:
    raise MissingExtraError("autosac.trainers.hf needs transformers: pip install 'autosac[hf]'") from None

__all__ = ["AutosacCallback", "trainer_loss"]


def trainer_loss(output) -> torch.Tensor:
    """The loss as ``Trainer.compute_loss`` takes it: ``output["loss"]`` from
    a dict-like output, else its first element."""
    if isinstance(output, dict) or hasattr(output, "keys"):
        if "loss" not in output or output["loss"] is None:
            raise ValueError("the model returned no loss: the training batches need labels (or pass loss_fn=)")
        return output["loss"]
    return output[0]


def _takes_loss_kwargs(model) -> bool:
    """Whether ``Trainer`` passes ``num_items_in_batch`` to this model's forward
    (as it decides: the model's ``accepts_loss_kwargs``, else a ``**kwargs``)."""
    inner = getattr(model, "get_base_model", lambda: model)()
    accepts = getattr(inner, "accepts_loss_kwargs", None)
    if accepts is not None:
        return bool(accepts)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(inner.forward).parameters.values())


class AutosacCallback(TrainerCallback):
    """Plan and apply autosac's checkpointing when ``Trainer.train()`` begins.

    Args:
        budget: as in :func:`autosac.solve` (``"60%"``, ``"20GiB"``, ``"least"``, ...).
        example_inputs: the batch to plan for (a dict of the model's keyword
            arguments on the model's device); default: the Trainer's first
            training batch.
        loss_fn: ``loss_fn(output) -> scalar``; default :func:`trainer_loss`.
            Give yours when the Trainer computes the loss itself
            (``compute_loss_func``, label smoothing): only its memory matters.
        target: as in :func:`autosac.profile`; default: ``"cpu"`` for a model
            on the CPU, the GPU's entry of the device table on CUDA.
        optimizer: default: the Trainer's optimizer, its kind and settings.
        **solve_kwargs: passed to :func:`autosac.solve` (``solver``,
            ``time_limit_s``, ``reserve``, ``routing``, ...).

    After ``on_train_begin``, ``callback.plan`` is the :class:`autosac.Plan`
    applied.

    Raises (from ``trainer.train()``, before the first step, the model unchanged):
        InfeasibleBudgetError: no plan reaches the budget; the message says the least that does.
        ValueError: a malformed budget; the model has no loss output and no ``loss_fn`` was given;
            training over several processes (DDP, FSDP, DeepSpeed).
        TypeError: an optimizer from outside ``torch.optim``: pass ``optimizer=``.

    transformers' gradient checkpointing, turned off before planning, stays off
    when planning fails.
    """

    def __init__(self, budget, *, example_inputs=None, loss_fn=None, target=None, optimizer=None,
                 **solve_kwargs) -> None:
        self.budget = budget
        self.example_inputs = example_inputs
        self.loss_fn = loss_fn
        self.target = target
        self.optimizer = optimizer
        self.solve_kwargs = solve_kwargs
        self.plan = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs):
        said = turn_off_transformers_checkpointing(model)  # also on a model planned before: never both
        if said:
            warnings.warn(said, stacklevel=2)
        if applied_plan(model) is not None:  # train() called again on the same model: the plan is in place
            return
        refuse_processes(args.world_size, "Trainer")
        batch = self.example_inputs if self.example_inputs is not None else first_batch(train_dataloader)
        if not isinstance(batch, Mapping):
            raise ValueError("the Trainer callback's example_inputs is a dict of the model's keyword inputs, as the "
                             f"Trainer's batches are (e.g. {{'input_ids': ...}}), not a {type(batch).__name__}")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in dict(batch).items()}
        if "labels" in batch and "num_items_in_batch" not in batch and _takes_loss_kwargs(model):
            # Trainer.compute_loss passes the step's label count to such a forward, divided (so floating)
            batch["num_items_in_batch"] = (batch["labels"] != -100).sum() / 1
        autocast = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        request = PlanRequest(
            budget=self.budget, loss_fn=self.loss_fn or trainer_loss,
            optimizer=self.optimizer if self.optimizer is not None else optimizer_like(optimizer),
            autocast=autocast, target=self.target, solve_kwargs=self.solve_kwargs,
            loop=Loop(output_held=False, grad_accumulation=args.gradient_accumulation_steps,
                      batches_ahead=args.gradient_accumulation_steps))
        self.plan = plan_and_apply(model, batch, request)
