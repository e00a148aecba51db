"""Built-in example models, constructible on ``meta`` at any size."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from autosac.models.gpt import GPT, GPTConfig
from autosac.models.llama import Llama, LlamaConfig

__all__ = ["BUILTIN", "build_model"]

# name -> (model class, config, default batch)
BUILTIN: dict[str, tuple[type, object, int]] = {
    "gpt2": (GPT, GPTConfig(), 8),
    "gpt2-medium": (GPT, GPTConfig(n_layer=24, n_head=16, dim=1024), 8),
    "gpt-tiny": (GPT, GPTConfig(n_layer=2, n_head=4, dim=64, seq=64, vocab=256), 4),
    # The seed's Transformer shape (PyTorch PR #137908): dim 768, 12 heads, seq 1024, vocab 8192.
    "seed-transformer": (GPT, GPTConfig(n_layer=4, vocab=8192, dropout=0.1, tie_weights=False), 8),
    "llama-7b": (Llama, LlamaConfig(), 1),
    "llama-13b": (Llama, LlamaConfig(n_layer=40, dim=5120, n_head=40, n_kv_head=40, ffn_hidden=13824), 1),
    "llama3-8b": (Llama, LlamaConfig(n_layer=32, dim=4096, n_head=32, n_kv_head=8, seq=8192,
                                     vocab=128256, ffn_hidden=14336, rope_theta=500000.0), 1),
    "llama-tiny": (Llama, LlamaConfig(n_layer=2, dim=64, n_head=4, n_kv_head=2, seq=64,
                                      vocab=256, ffn_hidden=172), 4),
}


def _check_field(config: str, name: str, value, default) -> None:
    """A config override must have the field's type (ints for ints) and, if numeric, be positive
    (``dropout`` may be 0)."""
    kind = type(default)
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{config}.{name} must be true or false, got {value!r}")
        return
    if kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise ValueError(f"{config}.{name} must be {'a whole number' if kind is int else 'a number'}, got {value!r}")
        if value < 0 or (value == 0 and name != "dropout"):
            raise ValueError(f"{config}.{name} must be positive, got {value!r}")


def build_model(
    name: str = "gpt2",
    *,
    batch: int | None = None,
    seq: int | None = None,
    device: str | torch.device = "meta",
    **overrides,
) -> tuple[nn.Module, torch.Tensor]:
    """Build a built-in model and example token ids ``(batch, seq)``.

    Args:
        name: one of :data:`BUILTIN`.
        batch, seq: input shape; ``seq`` also sets the model's maximum length.
        device: ``"meta"`` (default, no memory) or ``"cpu"`` for real weights.
        overrides: config fields, e.g. ``n_layer=4, dim=512``.

    Raises:
        ValueError: an unknown name or config field, or a value of the wrong type or sign.

    Example::

        >>> model, idx = build_model("llama-7b")      # on meta, planned anywhere
        >>> model, idx = build_model("gpt2", n_layer=2, device="cpu", batch=2, seq=128)
    """
    if name not in BUILTIN:
        raise ValueError(f"unknown built-in model {name!r}: use one of {', '.join(BUILTIN)}")
    cls, cfg, default_batch = BUILTIN[name]
    known = {f.name for f in dataclasses.fields(cfg)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"unknown {type(cfg).__name__} field(s) {', '.join(bad)}: use {', '.join(sorted(known))}")
    if seq is not None:
        overrides["seq"] = seq
    for field in dataclasses.fields(cfg):
        if field.name in overrides:
            _check_field(type(cfg).__name__, field.name, overrides[field.name], getattr(cfg, field.name))
    cfg = dataclasses.replace(cfg, **overrides)
    with torch.device(device):
        model = cls(cfg)
    idx = torch.randint(0, cfg.vocab, (batch or default_batch, cfg.seq), device=device)
    return model, idx
