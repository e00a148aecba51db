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
from dataclasses import dataclass, replace

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


@dataclass(frozen=True)
class Loop:
    """The training loop a plan is made for (this module's docstring shows
    each setting's loop), checked once when built.

    Attributes:
        output_held: the loop keeps ``out = model(x)`` through backward
            (``True``, the default) or drops it at the loss (``False``).
        grad_accumulation: micro-batches per optimizer step (1: none).
        zero_grad: ``"after_step"`` (``opt.step(); opt.zero_grad()``) or
            ``"before_backward"`` (between the loss and ``backward``, as
            Lightning does: the previous step's gradients alive in the forward).
        batches_ahead: batches a data loader holds besides the step's.

    Raises:
        ValueError: a setting of the wrong type or out of range, in one line.

    Example::

        >>> loop = autosac.Loop(output_held=False, grad_accumulation=4)
        >>> stats = autosac.profile(model, x, loop=loop)
        >>> stats.loop == loop
        True
    """

    output_held: bool = True
    grad_accumulation: int = 1
    zero_grad: str = "after_step"
    batches_ahead: int = 0

    def __post_init__(self) -> None:
        check_output_held(self.output_held)
        n = self.grad_accumulation
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"grad_accumulation must be a positive int (micro-batches per optimizer step), got {n!r}")
        check_zero_grad(self.zero_grad)
        b = self.batches_ahead
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise ValueError(f"batches_ahead must be an int >= 0, got {b!r}")

    @property
    def grads_alive(self) -> str:
        """Which gradients a traced step starts with: ``"step"`` (every one,
        the worst micro-batch of an accumulating loop), ``"forward"`` (the
        previous step's, until ``zero_grad`` before backward) or ``""``."""
        if self.grad_accumulation > 1:
            return "step"
        return "forward" if self.zero_grad == "before_backward" else ""

    @property
    def is_plain(self) -> bool:
        """No accumulation, ``zero_grad`` after the step, no batch ahead (the
        loop compiled plans are fitted for; the output may be held or not)."""
        return self.grad_accumulation == 1 and self.zero_grad == "after_step" and not self.batches_ahead

    def measuring(self) -> Loop:
        """The same loop with at most 2 micro-batches: the second already
        reaches an accumulating loop's peak, so measuring it is enough."""
        return replace(self, grad_accumulation=min(self.grad_accumulation, 2))

    @classmethod
    def of(cls, obj) -> Loop:
        """The loop a :class:`ModelStats` or :class:`Plan` (or anything with the four fields) is for."""
        return cls(output_held=obj.output_held, grad_accumulation=obj.grad_accumulation,
                   zero_grad=obj.zero_grad, batches_ahead=obj.batches_ahead)


DEFAULT_LOOP = Loop()  # the loop most people write (the module docstring's first)


def resolve_loop(loop: Loop | None, **settings) -> Loop:
    """``loop``, or one built from the loop keywords (``output_held``,
    ``grad_accumulation``, ``zero_grad``, ``batches_ahead``) the convenience
    signatures take; a one-line ``ValueError`` where both are given."""
    if loop is None:
        return Loop(**settings)
    if not isinstance(loop, Loop):
        raise TypeError(f"loop must be an autosac.Loop, got {type(loop).__name__}")
    given = sorted(k for k, v in settings.items() if v != getattr(DEFAULT_LOOP, k))
    if given:
        raise ValueError(f"pass the loop as loop= or as keywords, not both: drop {', '.join(given)} "
                         f"or set it in the Loop")
    return loop
