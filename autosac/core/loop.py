"""The training loop a plan is made for: what it keeps alive besides the model.

A plan's budget holds for one loop shape, the one the trace runs and
:func:`autosac.measure` measures.  Two are modelled, chosen by ``output_held``:

``output_held=True`` (the default), the loop most people write::

    for x, y in data:
        out = model(x)            # the previous step's `out` dies only here,
        loss = loss_fn(out, y)    # once this forward has returned
        loss.backward()           # `out` (the logits, say) is alive through backward
        opt.step()
        opt.zero_grad()

The model's output lives from the moment it is made to the end of the step,
and the previous step's output lives until this step's forward returns.  A
loop whose step is a function that returns before the next forward (or that
does ``del out``) holds less: its plan is conservative by at most one output.

``output_held=False``: the output dies as soon as the loss exists, as in
``loss = loss_fn(model(x)); loss.backward()`` or transformers' ``Trainer``
(whose ``compute_loss`` returns only the loss).  Tensors the loss saves for
backward stay alive in both cases.

Where the gradients go, chosen by ``zero_grad``: ``"after_step"`` (the
default, as above: none exists while the forward runs) or
``"before_backward"``, the loop Lightning runs::

    loss = training_step(batch)   # the previous step's gradients are alive here
    opt.zero_grad()
    loss.backward()
    opt.step()

With gradient accumulation (``grad_accumulation > 1``) the micro-batches after
the first run with every gradient alive throughout, whichever the order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.utils._pytree import tree_leaves


def output_tensors(output) -> list[torch.Tensor]:
    """Every tensor in a model's output: a tensor, nested tuples, lists and
    dicts, and transformers' ``ModelOutput`` (a dict) or other dataclasses.

    Example::

        >>> len(output_tensors({"loss": torch.zeros(()), "logits": torch.zeros(2, 3)}))
        2
    """
    found: list[torch.Tensor] = []
    todo = [output]
    seen: set[int] = set()
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, Mapping):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif hasattr(x, "__dataclass_fields__"):
            todo.extend(getattr(x, f, None) for f in x.__dataclass_fields__)
        else:
            leaves = [t for t in tree_leaves(x) if t is not x]
            # an object pytree does not know (transformers' DynamicCache, its layers): what its attributes hold
            todo.extend(leaves if leaves else _attributes(x))
    return found


def _attributes(x) -> list:
    """The values of an object's instance attributes (none for a type, a
    module or a function: a model's output holds its parameters only by
    accident, and they are counted as parameters)."""
    if isinstance(x, (type, torch.nn.Module)) or callable(x):
        return []
    return list(getattr(x, "__dict__", {}).values())


ZERO_GRAD = ("after_step", "before_backward")


def check_zero_grad(zero_grad) -> str:
    """``zero_grad`` as given, or a one-line ``ValueError``."""
    if zero_grad not in ZERO_GRAD:
        raise ValueError(f"zero_grad must be 'after_step' (opt.step(); opt.zero_grad()) or 'before_backward' "
                         f"(zero_grad() between the loss and loss.backward(), as Lightning does), got {zero_grad!r}")
    return zero_grad


def check_output_held(output_held) -> bool:
    """``output_held`` as a bool, or a one-line ``ValueError``."""
    if not isinstance(output_held, bool):
        raise ValueError(f"output_held must be True (the loop keeps `out = model(x)` through backward) or False "
                         f"(`loss = loss_fn(model(x))`), got {output_held!r}")
    return output_held
