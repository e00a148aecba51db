"""A step's example inputs: how they split into args and kwargs, and the
shapes a plan records so a run with other shapes is noticed."""

from __future__ import annotations

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path


def split_inputs(example_inputs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from a tensor, a tuple/list of positional args, or a dict of kwargs."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def input_signature(args: tuple, kwargs: dict) -> list[list]:
    """``[[where, shape, dtype], ...]`` for every tensor in ``args``/``kwargs``
    (``where`` like ``args[0]`` or ``kwargs['attention_mask']``).

    Example::

        >>> input_signature((torch.zeros(2, 3),), {})
        [['args[0]', [2, 3], 'float32']]
    """
    leaves, _ = tree_flatten_with_path({"args": tuple(args), "kwargs": dict(kwargs)})
    out = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            where = keystr(path)  # "['args'][0]" -> "args[0]"
            where = where.replace("['args']", "args", 1).replace("['kwargs']", "kwargs", 1)
            out.append([where, list(leaf.shape), str(leaf.dtype).removeprefix("torch.")])
    return out


def quick_shapes(args: tuple, kwargs: dict) -> tuple | None:
    """A hashable key of the shapes and dtypes of the tensors in
    ``args``/``kwargs`` and the dict keys that lead to them, where they sit in
    plain tuples, lists and dicts; ``None`` where another container holds
    something.  Equal keys mean equal :func:`input_signature`: a check run on
    every forward, a few microseconds where the pytree walk takes ten or more.

    Example::

        >>> quick_shapes((torch.zeros(2, 3),), {}) == quick_shapes((torch.ones(2, 3),), {})
        True
    """
    out: list = []
    stack = [kwargs, args]  # popped from the end: args first
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            out.append((node.shape, node.dtype))
        elif type(node) in (tuple, list):
            out.append(len(node))
            stack.extend(reversed(node))
        elif type(node) is dict:
            out.append(tuple(node))
            stack.extend(reversed(node.values()))
        elif not isinstance(node, (int, float, bool, str, type(None))):
            return None
    return tuple(out)


def format_signature(sig: list[list]) -> str:
    """``args[0] (8, 1024) int64, ...`` for messages."""
    return ", ".join(f"{w} {tuple(s)} {d}" for w, s, d in sig) or "no tensors"
