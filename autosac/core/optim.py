"""Optimizers by name and the default loss, shared by the tracer and the real-step measurement so
both run exactly the same update."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

OptimizerSpec = str | Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None

# foreach=True everywhere: it is the GPU default, and its per-step temporaries
# (one list of param-sized tensors per update term) shape the optimizer's peak.
_BY_NAME = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, foreach=True),
}


def make_optimizer(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    """Build the optimizer ``spec`` names over ``params``; ``None``/``"none"`` means no optimizer step.

    Raises:
        ValueError: an unknown name.

    Example::

        >>> opt = make_optimizer("adamw", model.parameters())
    """
    if spec is None or spec == "none":
        return None
    if callable(spec):
        return spec(params)
    if isinstance(spec, str) and spec.lower() in _BY_NAME:
        return _BY_NAME[spec.lower()](list(params))
    raise ValueError(f"unknown optimizer {spec!r}: use one of {', '.join(_BY_NAME)}, 'none', or a callable(params)")


def optimizer_name(spec: OptimizerSpec) -> str:
    if spec is None:
        return "none"
    return spec.lower() if isinstance(spec, str) else getattr(spec, "__name__", "custom")


def default_loss(output) -> torch.Tensor:
    """The output itself when it is a scalar tensor; an output mapping's
    scalar ``loss`` where it has one (a transformers output: the model
    computed it from the batch's labels); else ``output.float().sum()`` (over
    every tensor in a tuple/dict output)."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.float().sum()
    loss = output.get("loss") if isinstance(output, Mapping) else None
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    tensors = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise TypeError("the model's output holds no tensor: pass loss_fn=")
    return sum(t.float().sum() for t in tensors)
