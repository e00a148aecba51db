"""A model's fingerprint: its module tree and parameter shapes, hashed, so a
plan made for one model is refused by another."""

from __future__ import annotations

import hashlib

from torch import nn


def _class_of(mod: nn.Module) -> type:
    """The module's own class: ``fully_shard`` swaps in a subclass of it named
    ``FSDP<name>``, which changes nothing a plan depends on."""
    import torch.distributed as dist

    if dist.is_available():
        from torch.distributed.fsdp import FSDPModule

        if isinstance(mod, FSDPModule):
            return next(c for c in type(mod).__mro__ if not issubclass(c, FSDPModule))
    return type(mod)


def model_fingerprint(model: nn.Module) -> str:
    """Hex digest over module fqns and types and parameter fqns, shapes (a
    sharded parameter's whole shape) and dtypes.

    Example::

        >>> model_fingerprint(nn.Linear(2, 3)) == model_fingerprint(nn.Linear(2, 3))
        True
    """
    h = hashlib.sha256()
    for fqn, mod in model.named_modules():
        h.update(f"m|{fqn}|{_class_of(mod).__name__}\n".encode())
    for fqn, p in model.named_parameters():
        h.update(f"p|{fqn}|{tuple(p.shape)}|{p.dtype}\n".encode())
    return h.hexdigest()[:16]
