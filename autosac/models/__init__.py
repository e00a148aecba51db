"""Built-in example models, constructible on ``meta`` at any size.

The code is in :mod:`autosac.models.builtin`; this package re-exports it."""

from autosac.models.builtin import BUILTIN, build_model
from autosac.models.gpt import GPT, GPTConfig
from autosac.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "BUILTIN", "build_model"]
