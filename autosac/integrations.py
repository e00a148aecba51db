"""What autosac does differently for models from other libraries, in one place.

transformers: a decoder in training mode with ``use_cache=True`` (the default
of most configs) builds a key/value cache that nothing reads, and holds every
layer's keys and values in it until the output is dropped.  transformers' own
gradient checkpointing turns the cache off in training; autosac does the same,
in the trace and in the applied model alike, so the plan is made for the step
that runs.
"""

from __future__ import annotations

import sys

from torch import nn


def _is_transformers_model(model: nn.Module) -> bool:
    lib = sys.modules.get("transformers")
    base = getattr(lib, "PreTrainedModel", None) if lib is not None else None
    return base is not None and isinstance(model, base)


def builds_cache(model: nn.Module) -> bool:
    """Whether a transformers model is a decoder that builds a cache when asked
    (encoders such as BERT accept ``use_cache`` and ignore it)."""
    config = getattr(model, "config", None)
    can_generate = getattr(model, "can_generate", None)
    return bool(getattr(config, "is_decoder", False)) or (callable(can_generate) and bool(can_generate()))


def training_kwargs(model: nn.Module, kwargs: dict) -> dict | None:
    """``kwargs`` with ``use_cache=False`` when ``model`` is a transformers model
    in training mode that would otherwise build a cache; ``None`` when nothing
    changes (also for encoders, which ignore the flag).

    Example::

        >>> training_kwargs(llama.train(), {"input_ids": ids})
        {'input_ids': ..., 'use_cache': False}
    """
    if not model.training or not _is_transformers_model(model):
        return None
    config = getattr(model, "config", None)
    wanted = kwargs.get("use_cache", getattr(config, "use_cache", None))
    if not wanted or not builds_cache(model):
        return None
    return {**kwargs, "use_cache": False}


def own_checkpointing(model: nn.Module) -> str | None:
    """A one-line reason when ``model`` already checkpoints by itself (transformers'
    ``gradient_checkpointing_enable()``), else None: its checkpoints would nest
    inside autosac's and its memory is not the plan's to count."""
    # transformers 5 names it is_activation_checkpointing (the old name warns)
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    if _is_transformers_model(model) and getattr(model, name, False):
        return (
            f"{type(model).__name__} has transformers' gradient checkpointing enabled: call "
            "model.gradient_checkpointing_disable() first -- autosac decides what to checkpoint"
        )
    return None
