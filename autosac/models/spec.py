"""Models named on the command line: a built-in name with config overrides,
``hf:NAME`` (a transformers config, :mod:`autosac.models.hf`), or
``package.module:factory``.  Shared by ``autosac plan``/``sweep`` and
``autosac verify``; every mistake is a :class:`UserError` with one line."""

from __future__ import annotations

import importlib
import os
import sys
from contextlib import contextmanager

import torch

from autosac.core.errors import UserError

__all__ = ["UserError", "build_from_spec", "parse_value"]


def parse_value(text: str):
    """``--model-arg`` values: int, float, true/false, else the string."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def build_from_spec(spec: str, model_args: list[str], batch: int | None, seq: int | None, device: str = "meta"):
    """``(model, example_inputs)`` from a built-in name, ``hf:NAME`` or ``package.module:factory``.

    Raises:
        UserError: a malformed ``--model-arg``, a module that does not import,
            a factory that raises or returns something else, a bad config value.

    Example::

        >>> model, idx = build_from_spec("gpt2", ["n_layer=2"], batch=2, seq=64)
    """
    kwargs = {}
    for item in model_args:
        if "=" not in item:
            raise UserError(f"--model-arg {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        kwargs[k.strip()] = parse_value(v.strip())
    if spec.startswith("hf:"):
        from autosac.models.hf import build_hf

        return build_hf(spec[3:], kwargs, batch, seq, device)
    if ":" in spec:
        return _from_factory(spec, kwargs, batch, seq, device)
    from autosac.models import build_model

    try:
        return build_model(spec, batch=batch, seq=seq, device=device, **kwargs)
    except (ValueError, TypeError) as e:
        raise UserError(str(e)) from None


def _from_factory(spec: str, kwargs: dict, batch: int | None, seq: int | None, device: str):
    mod_name, fn_name = spec.split(":", 1)
    try:
        with _cwd_importable():
            module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - the user's module: any failure is reported in one line
        where = f" ({e.filename}, line {e.lineno})" if isinstance(e, SyntaxError) else ""
        raise UserError(f"cannot import {mod_name!r} for --model {spec}: {type(e).__name__}: {e}{where}") from None
    factory = getattr(module, fn_name, None)
    if not callable(factory):
        raise UserError(f"{mod_name!r} has no function {fn_name!r} (--model {spec})")
    try:
        made = factory(**kwargs)
    except Exception as e:  # noqa: BLE001 - the user's factory
        raise UserError(f"model factory {spec!r} raised {type(e).__name__}: {e}") from None
    if isinstance(made, tuple) and len(made) == 2:
        return made
    if not isinstance(made, torch.nn.Module):
        raise UserError(f"model factory {spec!r} must return a model or (model, example_inputs)")
    if batch is None or seq is None:
        raise UserError(f"{spec!r} returned no example inputs: pass --batch and --seq (token ids)")
    vocab = _vocab_size(made)
    if vocab is None:
        raise UserError(
            f"{spec!r} returned a model without example inputs and without a vocabulary size "
            "(cfg.vocab or config.vocab_size) to draw token ids from: return (model, example_inputs)"
        )
    return made, torch.randint(0, vocab, (batch, seq), device=device)


@contextmanager
def _cwd_importable():
    """The current directory on ``sys.path`` while a factory's module is imported,
    as for ``python -m``: the ``autosac`` script alone would not find a
    ``my_model.py`` next to where it runs."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _vocab_size(model: torch.nn.Module) -> int | None:
    for holder, name in (("cfg", "vocab"), ("config", "vocab_size")):
        value = getattr(getattr(model, holder, None), name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
