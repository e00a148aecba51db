"""A compiled plan kept by PyTorch's own partitioner, scoped to one model.

Under ``torch.compile`` AOTAutograd's min-cut partitioner picks what the
forward saves for the backward; with an activation memory budget (a fraction:
1.0 its default, 0.0 the least it can save) it recomputes, by a knapsack over
the joint graph, what costs the fewest FLOPs.  Some compiled plans
(:func:`autosac.compile.fit.fit_for_compile`) are that budget: no module is
checkpointed, and the plan records the fraction whose compiled step was traced
to fit the bytes asked for (``plan.compiled["partitioner_budget"]``).

:func:`wrap_root` makes it the model's own: the model's forward runs under
``torch.autograd.graph.region_activation_memory_budget(fraction)`` while
Dynamo traces it, so the budget applies to the graphs of this model and to no
other compile in the process (``torch._functorch.config`` is never changed).
Eager, the forward runs as it is.  That context manager is new in torch 2.13;
an older torch cannot apply such a plan (:func:`require`): the process-wide
setting is read when Dynamo compiles and not guarded, so a graph compiled for
another instance of the same class would be reused with its budget, or this
model's budget leak into the other's.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref

import torch
from torch import nn

from autosac.core.marks import APPLIED

__all__ = ["BudgetedForward", "supported", "require", "wrap_root", "unwrap_root"]


def supported() -> bool:
    """Whether this torch can scope a partitioner budget to one model's graphs
    (``torch.autograd.graph.region_activation_memory_budget``, torch >= 2.13)."""
    return hasattr(torch.autograd.graph, "region_activation_memory_budget")


class BudgetedForward:
    """The forward :func:`wrap_root` sets on a model: the one it had (``own``,
    or its class's when None), under the partitioner budget ``fraction`` (kept as text) while
    compiling.  It holds the model weakly (the model holds it: no cycle for
    the garbage collector), pickles and deep-copies with the model."""

    __slots__ = ("ref", "own", "fraction", "__weakref__")

    def __init__(self, model: nn.Module, own, fraction: float) -> None:
        self.ref, self.own, self.fraction = weakref.ref(model), own, repr(float(fraction))

    def _original(self):
        model = self.ref()
        if model is None:
            raise RuntimeError("autosac: this forward's model was freed: call the model, not a forward kept from it")
        return self.own if self.own is not None else functools.partial(type(model).forward, model)

    @property
    def __signature__(self):  # the model's own (transformers' Trainer reads it to pick dataset columns)
        return inspect.signature(self._original())

    def __call__(self, *args, **kwargs):
        original = self._original()
        state = self.ref().__dict__.get(APPLIED)
        if not torch.compiler.is_compiling() or state is None or (
                state["plan"].compiled.get("partitioner_budget") != float(self.fraction)):
            return original(*args, **kwargs)  # eager, or unapplied since (a forward set after apply calls this)
        # as text: a float attribute would reach Dynamo as a symbolic input, the budget must be a constant
        with torch.autograd.graph.region_activation_memory_budget(float(self.fraction)):
            return original(*args, **kwargs)

    def __reduce__(self):
        return BudgetedForward, (self.ref(), self.own, float(self.fraction))

    def __deepcopy__(self, memo):
        model = self.ref()
        return BudgetedForward(memo.get(id(model), model), copy.deepcopy(self.own, memo), float(self.fraction))


def require(fraction: float | None = None) -> None:
    """Raises ValueError, naming the fix, where this torch cannot scope a
    partitioner budget (``fraction``, that of a plan) to one model (:func:`supported`)."""
    if not supported():
        what = ("this plan keeps its budget by torch.compile's partitioner at "
                f"activation_memory_budget={fraction:g}" if fraction is not None
                else "partitioner=True plans by torch.compile's partitioner budget")
        raise ValueError(
            f"{what}, which torch {torch.__version__} cannot scope to one model: upgrade to torch >= 2.13, or "
            "re-plan with this torch (its plans checkpoint modules instead)"
        )


def wrap_root(model: nn.Module, fraction: float) -> None:
    """Run ``model``'s forward under the partitioner budget ``fraction`` when
    compiled.

    Raises:
        ValueError: this torch has no ``region_activation_memory_budget`` (before 2.13).
    """
    require(fraction)
    model.__dict__["forward"] = BudgetedForward(model, model.__dict__.get("forward"), fraction)


def unwrap_root(model: nn.Module) -> None:
    """Put back the forward ``model`` had before :func:`wrap_root` (one set since stays)."""
    fwd = model.__dict__.get("forward")
    if type(fwd) is not BudgetedForward or fwd.ref() is not model:
        return
    if fwd.own is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = fwd.own
