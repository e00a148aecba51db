"""The parameters an applied plan was made for, watched at each training forward.

A plan's peak holds for the step it traced: parameters of the dtypes they had
and gradients for those that required them.  Two common moves change that step
after ``apply`` without touching the plan: ``model.to(torch.float64)`` (or
``.half()``), which changes every parameter's bytes, and unfreezing a frozen
backbone after some epochs, which gives it gradients and optimizer state the
budget has no room for (1.5-2.2x the budget in a new-user trial).  Each is
said once, at the first training forward that runs so.

The check per forward compares one tuple of ``(requires_grad, dtype)`` over the
parameters, read through weak references (0.2-0.4 us a parameter on a 2-core
VM, ``benchmarks/bench_loop_checks.py``: each attribute of a ``Parameter`` is
read through its torch-function check); names and the fingerprint are read
only when it changes.
"""

from __future__ import annotations

import sys
import weakref
from operator import attrgetter

from torch import nn

from autosac.core.budget import format_bytes
from autosac.core.fingerprint import model_fingerprint
from autosac.core.plan import Plan
from autosac.core.userwarn import warn_user

_KEY = attrgetter("requires_grad", "dtype")
_DEREF = weakref.ref.__call__


class ParamWatch:
    """Whether a model's parameters still train and weigh what ``plan`` traced.

    Example::

        >>> watch = ParamWatch(plan)
        >>> watch.check(model)          # each training forward: warns once per change the plan did not trace
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.refs: list | None = None  # weak references to the parameters, in the model's order
        self.fqns: list[str] = []  # ... their names
        self.key: tuple = ()  # ... (requires_grad, dtype) of each when last seen
        self.dtypes_checked: set[tuple] = set()  # dtype tuples compared with the plan's fingerprint
        self.said: set = set()
        self.root: type | None = None  # the model's class when collected (fully_shard changes it)

    def check(self, model: nn.Module) -> None:
        """Warn once per kind of change: a dtype the plan was not made for, or
        a parameter the plan traced frozen that now requires a gradient."""
        refs = self.refs
        if refs is None or type(model) is not self.root:
            self._collect(model)
            return
        try:
            key = tuple(map(_KEY, map(_DEREF, refs)))
        except AttributeError:  # a parameter replaced (and freed) since: look again
            self._collect(model)
            return
        if key != self.key:
            self.key = key
            self._compare(model)

    def _collect(self, model: nn.Module) -> None:
        self.root = type(model)
        named = list(model.named_parameters())
        if _fsdp(model) or any(_sharded(p) for _, p in named):  # FSDP2 swaps parameters in and out: not watched
            self.refs, self.key = [], ()
            return
        self.refs = [weakref.ref(p) for _, p in named]
        self.fqns = [fqn for fqn, _ in named]
        self.key = tuple(_KEY(p) for _, p in named)
        self._compare(model)

    def _compare(self, model: nn.Module) -> None:
        """The parameters as last seen (``self.key``) against the plan: names
        from the list collected, the fingerprint once per distinct dtypes
        (a loop toggling ``requires_grad`` each step pays neither)."""
        frozen = set(self.plan.frozen)
        trained = [fqn for fqn, (grad, _) in zip(self.fqns, self.key) if grad and fqn in frozen]
        if trained and "unfrozen" not in self.said:
            self.said.add("unfrozen")
            names = set(trained)
            size = sum(p.numel() * p.element_size() for fqn, p in model.named_parameters() if fqn in names)
            warn_user(
                f"autosac: {len(trained)} parameters the plan for {self.plan.model} was made with frozen now require "
                f"gradients ({trained[0]!r}{', ...' if len(trained) > 1 else ''}; {format_bytes(size)}): their "
                "gradients and optimizer state are beyond its budget -- re-plan with them trainable "
                "(autosac.solve after requires_grad_(True))"
            )
        dtypes = tuple(dtype for _, dtype in self.key)
        if "dtype" in self.said or dtypes in self.dtypes_checked:
            return
        self.dtypes_checked.add(dtypes)
        if model_fingerprint(model) != self.plan.fingerprint:
            changed = sorted({str(d).removeprefix("torch.") for d in dtypes})
            self.said.add("dtype")
            warn_user(
                f"autosac: the parameters of {self.plan.model} changed since the plan was made (now "
                f"{', '.join(changed)}; a .to(dtype), .half() or a replaced parameter): its predicted peak and "
                "budget hold only for the traced model -- re-plan for the model as it is now"
            )

    def __reduce__(self):  # a copy or a loaded model collects its own parameters (weak references do not pickle)
        return (ParamWatch, (self.plan,))


def _sharded(p) -> bool:
    """Whether ``p`` is a ``DTensor`` (FSDP2's sharded parameters; never imported: none)."""
    tensor_module = sys.modules.get("torch.distributed.tensor")
    return tensor_module is not None and isinstance(p, tensor_module.DTensor)


def _fsdp(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or a module in it."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules())
