"""Hugging Face transformers models by name, built from a config with random
weights (on ``meta`` for planning): nothing is downloaded.

``--model hf:llama --model-arg hidden_size=4096 --model-arg num_hidden_layers=32``
builds ``LlamaForCausalLM(LlamaConfig(hidden_size=4096, num_hidden_layers=32))``.
Config keys are checked against the config class (transformers itself would
accept a misspelt key silently); example inputs are token ids drawn from the
config's ``vocab_size``.

Example::

    >>> model, ids = build_hf("gpt2", {"n_layer": 2}, batch=2, seq=64, device="meta")
"""

from __future__ import annotations

import torch

from autosac.core.errors import MissingExtraError, UserError

# name -> (config class, model class) in transformers
HF_MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "bert": ("BertConfig", "BertForMaskedLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    # mixture of experts: planned for a stated routing (autosac.trace.routing)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
DEFAULT_BATCH, DEFAULT_SEQ = 1, 1024


def build_hf(name: str, kwargs: dict, batch: int | None, seq: int | None, device: str = "meta"):
    """``(model, input_ids)`` for transformers model ``name`` (a key of :data:`HF_MODELS`).

    ``seq`` defaults to 1024 (or the config's ``max_position_embeddings`` if
    smaller), ``batch`` to 1.  The model is in training mode.

    Raises:
        MissingExtraError: transformers is not installed.
        UserError: ``name`` is unknown or missing
            from the installed transformers, a config key the config class does
            not have, a config transformers rejects, ``seq`` beyond the positions.
    """
    try:
        import transformers
    except ImportError:
        raise MissingExtraError("hf: models need transformers: pip install 'autosac[hf]'") from None
    if name not in HF_MODELS:
        raise UserError(f"unknown hf: model {name!r}: use one of {', '.join('hf:' + n for n in HF_MODELS)}")
    config_name, model_name = HF_MODELS[name]
    config_cls, model_cls = getattr(transformers, config_name, None), getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        raise UserError(f"transformers {transformers.__version__} has no {model_name}: upgrade transformers for hf:{name}")
    defaults = config_cls()
    unknown = sorted(k for k in kwargs if not hasattr(defaults, k))
    if unknown:
        raise UserError(f"{config_name} has no {', '.join(unknown)} (--model-arg): see its documentation for the keys")
    vocab = kwargs.get("vocab_size", getattr(defaults, "vocab_size", None))
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise UserError(f"hf:{name} needs a positive vocab_size to draw token ids from, got {vocab!r}")
    try:
        config = config_cls(**kwargs)
        with torch.device(device):
            model = model_cls(config)
    except Exception as e:  # noqa: BLE001 - transformers' own checks on the config values
        reason = "; ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
        raise UserError(f"hf:{name} with {kwargs} failed: {type(e).__name__}: {reason[:400]}") from None
    dtype = _config_dtype(config)
    if dtype is not None:  # a model built from a config keeps float32 weights unless cast
        model = model.to(dtype)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if seq is None:
        seq = min(DEFAULT_SEQ, positions) if positions else DEFAULT_SEQ
    if positions and seq > positions and name in ("gpt2", "bert"):  # learned positions: no longer sequences
        raise UserError(f"--seq {seq} is longer than hf:{name}'s {positions} positions: raise "
                        f"--model-arg {'n_positions' if name == 'gpt2' else 'max_position_embeddings'}={seq}")
    ids = torch.randint(0, config.vocab_size, (batch or DEFAULT_BATCH, seq), device=device)
    return model.train(), ids


def _config_dtype(config) -> torch.dtype | None:
    """The weights' dtype a config asks for (``dtype``, formerly ``torch_dtype``), if any."""
    for key in ("dtype", "torch_dtype"):
        value = config.__dict__.get(key)
        if isinstance(value, str) and value not in ("auto", ""):
            value = getattr(torch, value, None)
        if isinstance(value, torch.dtype):
            return value
    return None
