"""autosac inside Lightning: one callback.

Example::

    >>> from autosac.trainers.lightning import AutosacCallback
    >>> trainer = lightning.Trainer(max_steps=1000, precision="bf16-mixed",
    ...                             callbacks=[AutosacCallback("60%")])
    >>> trainer.fit(module, datamodule)     # planned and applied before the first batch

At ``on_train_start`` -- the optimizer is built, the model is on its device
and the training dataloader is loaded -- the callback plans the step
Lightning runs and applies the plan:

- the step is the module's own ``training_step(batch, batch_idx)`` on the first
  batch of the training dataloader (drawn with the random generators restored,
  moved to the device by the strategy); the loss is what it returns (the
  ``"loss"`` entry of a dict); ``self.log`` calls do nothing while it is traced;
- the optimizer is the trainer's, ``precision="bf16-mixed"``/``"16-mixed"`` is
  the autocast, and ``accumulate_grad_batches`` the accumulation planned for;
- the module's output dies at the loss (``output_held=False``), as inside a
  ``training_step``, and the previous step's gradients are alive through the
  forward (Lightning calls ``zero_grad()`` between the loss and the backward:
  ``zero_grad="before_backward"``).

To put the plan's whole-step hooks around each step (parameter casts under
autocast are never saved; a batch of another shape is warned about), the
module's ``training_step`` runs through a thin wrapper module while the fit
lasts; ``on_fit_end`` (or ``on_exception``) puts the module's own method back (the checkpointed
submodules stay checkpointed: ``autosac.unapply(callback.root)`` undoes them).
Manual optimization (``automatic_optimization = False``) is refused.

Needs the ``lightning`` extra: ``pip install 'autosac[lightning]'``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from contextlib import contextmanager

import torch
from torch import nn

from autosac.core.errors import MissingExtraError
from autosac.core.loop import Loop
from autosac.trainers.common import PlanRequest, first_batch, optimizer_like, plan_and_apply, refuse_processes

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:
    raise MissingExtraError("autosac.trainers.lightning needs lightning: pip install 'autosac[lightning]'") from None

__all__ = ["AutosacCallback", "TrainingStep"]

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class TrainingStep(nn.Module):
    """``module.training_step`` as a module's forward: what autosac profiles
    and applies its plan to (the module is its only child, ``"module"``).
    ``forward(batch, batch_idx)`` returns what ``training_step`` returns."""

    def __init__(self, module: nn.Module, training_step) -> None:
        super().__init__()
        self.module = module
        self._step = training_step  # the module's own bound method
        self._positional = _positional_count(training_step)

    def forward(self, batch, *args, **kwargs):
        args = (batch, *args)
        return self._step(*(args if self._positional is None else args[:self._positional]), **kwargs)


def _positional_count(fn) -> int | None:
    """How many positional arguments ``fn`` takes (``None``: any number), so a
    ``training_step(self, batch)`` is not handed the ``batch_idx`` it does not take."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return sum(1 for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                               inspect.Parameter.POSITIONAL_OR_KEYWORD))


def step_loss(output) -> torch.Tensor:
    """The loss a ``training_step`` returned: the tensor, or a dict's ``"loss"``."""
    if isinstance(output, Mapping):
        if "loss" not in output:
            raise ValueError("training_step returned a dict without 'loss'")
        return output["loss"]
    if not isinstance(output, torch.Tensor):
        raise ValueError("training_step returned no loss: autosac plans steps that return one")
    return output


@contextmanager
def _quiet_logging(module: nn.Module):
    """``module.log``/``log_dict`` do nothing while the step is traced (fake tensors are no metrics)."""
    saved = {name: module.__dict__.get(name) for name in ("log", "log_dict")}
    module.log = module.log_dict = lambda *a, **k: None
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del module.__dict__[name]
            else:
                module.__dict__[name] = value


class AutosacCallback(Callback):
    """Plan and apply autosac's checkpointing when ``trainer.fit`` starts training.

    Args:
        budget: as in :func:`autosac.solve` (``"60%"``, ``"20GiB"``, ``"least"``, ...).
        example_inputs: the batch to plan for (as ``training_step`` gets it, on
            the module's device); default: the first training batch.
        target: as in :func:`autosac.profile`; default: ``"cpu"`` for a model on
            the CPU, the GPU's entry of the device table on CUDA.
        optimizer: default: the trainer's optimizer, its kind and settings.
        **solve_kwargs: passed to :func:`autosac.solve` (``solver``,
            ``time_limit_s``, ``reserve``, ``routing``, ...).

    After ``on_train_start``: ``callback.plan`` (the :class:`autosac.Plan`
    applied; its module names start with ``module.``) and ``callback.root``
    (the :class:`TrainingStep` it was applied to).

    Raises (from ``trainer.fit``, before the first batch, the model unchanged):
        InfeasibleBudgetError: no plan reaches the budget; the message says the least that does.
        ValueError: manual optimization, more than one optimizer, a ``training_step``
            that returns no loss, or training over several processes.
        TypeError: an optimizer from outside ``torch.optim``: pass ``optimizer=``.
    """

    def __init__(self, budget, *, example_inputs=None, target=None, optimizer=None, **solve_kwargs) -> None:
        self.budget = budget
        self.example_inputs = example_inputs
        self.target = target
        self.optimizer = optimizer
        self.solve_kwargs = solve_kwargs
        self.plan = None
        self.root = None
        self._step = None

    def on_train_start(self, trainer, pl_module) -> None:
        if self.plan is not None:  # a later fit: the plan is in place if it is the same module
            if self.root.module is not pl_module:
                raise ValueError("this AutosacCallback planned another LightningModule: "
                                 "give each module its own AutosacCallback")
            self._route(pl_module)
            return
        refuse_processes(trainer.world_size, "Lightning")
        if not pl_module.automatic_optimization:
            raise ValueError("autosac plans Lightning's automatic optimization; this module optimizes manually "
                             "(automatic_optimization = False): plan its step with autosac.solve directly")
        if len(trainer.optimizers) > 1:
            raise ValueError("autosac plans one optimizer per step; this trainer has "
                             f"{len(trainer.optimizers)}: pass optimizer= (the one whose state dominates)")
        batch = self.example_inputs
        if batch is None:
            batch = trainer.strategy.batch_to_device(first_batch(trainer.train_dataloader))
        optimizer = self.optimizer
        if optimizer is None:
            optimizer = optimizer_like(trainer.optimizers[0] if trainer.optimizers else None)
        request = PlanRequest(budget=self.budget, loss_fn=step_loss, optimizer=optimizer,
                              autocast=_AUTOCAST.get(str(trainer.precision)),
                              target=self.target, solve_kwargs=self.solve_kwargs,
                              loop=Loop(output_held=False, grad_accumulation=trainer.accumulate_grad_batches,
                                        zero_grad="before_backward"))
        root = TrainingStep(pl_module, pl_module.training_step)
        with _quiet_logging(pl_module):
            self.plan = plan_and_apply(root, (batch, 0), request)
        self.root = root
        self._route(pl_module)

    def _route(self, pl_module) -> None:
        """Lightning calls the module's ``training_step``: make it run through the root."""
        root = self.root

        def training_step(*args, **kwargs):
            return root(*args, **kwargs)

        pl_module.__dict__["training_step"] = self._step = training_step  # not a submodule: a plain function

    def on_fit_end(self, trainer, pl_module) -> None:
        self._restore(pl_module)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore(pl_module)

    def _restore(self, pl_module) -> None:
        """The module's own ``training_step`` back (the plan stays on its submodules)."""
        if self.root is not None and pl_module.__dict__.get("training_step") is self._step:
            del pl_module.__dict__["training_step"]
