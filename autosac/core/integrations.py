"""What autosac does differently for models from other libraries, in one place.

transformers: a decoder in training mode with ``use_cache=True`` (the default
of most configs) builds a key/value cache that nothing reads, and holds every
layer's keys and values in it until the output is dropped.  transformers' own
gradient checkpointing turns the cache off in training; autosac does the same,
in the trace and in the applied model alike, so the plan is made for the step
that runs.  That holds wherever the transformers model sits in the module tree
(the root, or inside a user's wrapper whose forward returns ``.loss``): each
outermost one gets a forward pre-hook (:func:`no_cache_hook`).  With the cache
on, a checkpointed layer's bound keyword arguments would keep the cache -- every
layer's keys and values -- alive until that layer's backward.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from functools import cache

import torch
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
    in training mode that can build a cache; ``None`` when nothing changes
    (``use_cache=False`` passed already, or an encoder, which ignores the flag).

    The flag is passed even when the model's config says ``use_cache=False``
    (as transformers' ``Trainer`` sets it): an encoder-decoder such as T5
    hands ``use_cache=None`` on to its decoder, whose own config still says
    True, and the decoder builds the cache anyway.

    Example::

        >>> training_kwargs(llama.train(), {"input_ids": ids})
        {'input_ids': ..., 'use_cache': False}
    """
    if not model.training or not _is_transformers_model(model):
        return None
    if kwargs.get("use_cache", True) is False or not builds_cache(model) or not _takes_use_cache(type(model)):
        return None
    return {**kwargs, "use_cache": False}


@cache
def _takes_use_cache(kind: type) -> bool:
    """Whether ``kind.forward`` accepts ``use_cache`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(kind.forward).parameters
    except (TypeError, ValueError):
        return False
    return "use_cache" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def cache_requested(model: nn.Module, kwargs: dict) -> bool:
    """Whether the caller asked ``model`` for a cache: ``use_cache=True`` passed,
    or not passed and the model's config says True."""
    return bool(kwargs.get("use_cache", getattr(getattr(model, "config", None), "use_cache", None)))


def transformers_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(fqn, module)`` of each outermost transformers model in ``model``'s
    tree: the root itself when it is one, else those inside wrappers (one
    nested in another is reached through its parent, which passes its flags on).

    Example::

        >>> transformers_models(Wrapper(llama))
        [('lm', LlamaForCausalLM(...))]
    """
    if "transformers" not in sys.modules:
        return []
    found: list[tuple[str, nn.Module]] = []
    todo = [("", model)]
    while todo:
        fqn, mod = todo.pop()
        if _is_transformers_model(mod):
            found.append((fqn, mod))
            continue
        todo.extend(reversed([(f"{fqn}.{n}" if fqn else n, c) for n, c in mod.named_children()]))
    return found


def no_cache_hook(module: nn.Module, args, kwargs):
    """Forward pre-hook (``with_kwargs=True``) for a transformers model: its
    training forward with grad enabled runs with ``use_cache=False`` where it
    would build a cache (see :func:`training_kwargs`)."""
    changed = training_kwargs(module, kwargs) if torch.is_grad_enabled() else None
    return None if changed is None else (args, changed)


@contextmanager
def caches_off(model: nn.Module):
    """:func:`no_cache_hook` on every outermost transformers model inside
    ``model`` for the block (the trace's step), removed after."""
    found = transformers_models(model)
    # run outside a compiled trace's graph, as the applied model's hook runs under a user's torch.compile (Dynamo
    # would trace the functools.cache above, and warn that it ignores it); made only where needed: it imports Dynamo
    hook = torch.compiler.disable(no_cache_hook) if found else None
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True, prepend=True) for _, m in found]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def own_checkpointing(model: nn.Module) -> str | None:
    """A one-line reason when ``model`` -- or a transformers model inside it --
    already checkpoints by itself (transformers' ``gradient_checkpointing_enable()``),
    else None: its checkpoints would nest inside autosac's and its memory is not
    the plan's to count."""
    for fqn, mod in transformers_models(model):
        # transformers 5 names it is_activation_checkpointing (the old name warns)
        name = "is_activation_checkpointing" if hasattr(type(mod), "is_activation_checkpointing") else \
            "is_gradient_checkpointing"
        if getattr(mod, name, False):
            where = "model" if not fqn else f"model.{fqn}"
            return (
                f"{type(mod).__name__} has transformers' gradient checkpointing enabled: call "
                f"{where}.gradient_checkpointing_disable() first -- autosac decides what to checkpoint"
            )
    return None
