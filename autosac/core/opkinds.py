"""What an aten op is, read from torch's own metadata: the one place the trace
(which records it per op call) and the applier (which acts on it at run time)
decide whether a call is a view, writes an input, draws from the RNG, or is
never shown to a selective-checkpoint policy.

* views and writes come from the op's schema (``Tensor(a)`` / ``Tensor(a!)``),
  so ``_native_batch_norm_legit`` (which writes its running stats without a
  trailing ``_``) counts as writing.  A few batch-norm kernels write their
  running stats without their schema saying so (PyTorch's functionalization
  special-cases them the same way): :data:`UNDECLARED_WRITES` names them;
* random ops carry ``torch.Tag.nondeterministic_seeded`` (dropout, ``bernoulli_``,
  the flash and memory-efficient attention kernels with dropout ...);
* ``torch.utils.checkpoint.SAC_IGNORED_OPS`` are the ops PyTorch's SAC never
  asks a policy about.

Example::

    >>> is_view_op(torch.ops.aten.view.default), writes_input(torch.ops.aten.add_.Tensor)
    (True, True)
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS

# The same ignored ops by aten overload-packet name, for stats that store names.
SAC_IGNORED_NAMES = frozenset(
    op.overloadpacket.__name__ for op in SAC_IGNORED_OPS if getattr(op, "namespace", None) == "aten"
)


# Kernels whose schema does not mark the running stats they update in training.
UNDECLARED_WRITES = {
    "native_batch_norm": ("running_mean", "running_var"),
    "cudnn_batch_norm": ("running_mean", "running_var"),
    "miopen_batch_norm": ("running_mean", "running_var"),
}


class OpKind:
    """What one op overload is, read once from its schema and tags."""

    __slots__ = ("name", "view", "written", "random", "ignored")

    def __init__(self, func) -> None:
        self.name: str = func.overloadpacket.__name__
        schema = func._schema
        returns = schema.returns
        #: the first result aliases an input without writing it
        self.view: bool = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        extra = UNDECLARED_WRITES.get(self.name, ())
        #: (position, name) of each argument the op writes in place
        self.written: tuple[tuple[int, str], ...] = tuple(
            (i, a.name) for i, a in enumerate(schema.arguments)
            if (a.alias_info is not None and a.alias_info.is_write) or a.name in extra
        )
        #: draws from the RNG (a replay must re-run it in order)
        self.random: bool = torch.Tag.nondeterministic_seeded in func.tags
        #: never shown to a selective-checkpoint policy
        self.ignored: bool = func in SAC_IGNORED_OPS

    def written_tensors(self, args, kwargs) -> list[torch.Tensor]:
        """The tensors one call with these arguments writes in place."""
        out = []
        for i, name in self.written:
            value = kwargs[name] if name in kwargs else (args[i] if i < len(args) else None)
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, (list, tuple)):
                out.extend(v for v in value if isinstance(v, torch.Tensor))
        return out


_KINDS: dict[int, OpKind] = {}  # by id(): op overloads live for the process, and hash in Python


def op_kind(func) -> OpKind:
    """The :class:`OpKind` of an op overload (computed once per overload)."""
    kind = _KINDS.get(id(func))
    if kind is None:
        kind = _KINDS[id(func)] = OpKind(func)
    return kind


def is_view_op(func) -> bool:
    """True when the op's first result aliases an input without writing it."""
    return op_kind(func).view


def writes_input(func) -> bool:
    """True when the op writes into one of its inputs (``add_``, ``copy_``, batch norm's running stats)."""
    return bool(op_kind(func).written)


def is_random_op(func) -> bool:
    """True when the op draws from the RNG (a replay must re-run it in order)."""
    return op_kind(func).random


def is_sac_ignored(func) -> bool:
    """True for ops PyTorch's selective checkpointing never shows a policy."""
    return op_kind(func).ignored


def written_tensors(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors one call of ``func`` writes in place, found by schema argument name."""
    return op_kind(func).written_tensors(args, kwargs)


def is_param_cast(inp: torch.Tensor, out: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether ``out``, a dtype cast of ``inp``, is a cast of all of ``param``:
    of the (contiguous, trainable) parameter itself or of a view that only
    reorders its dims (``x @ w.T`` under autocast casts ``w.T``), laid out as
    that view.  Such a cast is never saved for backward: the applier re-makes
    it from the parameter (:mod:`autosac.applier.casts`), and the trace counts
    it gone -- both ask this one question.  A cast of part of a weight, of a
    frozen weight (no autograd path back to it) or in another layout is an
    activation like any other.

    Example::

        >>> w = nn.Parameter(torch.randn(4, 3))
        >>> is_param_cast(w.T, w.T.to(torch.bfloat16), w)
        True
    """
    return (
        param.requires_grad and param.is_contiguous() and out.dtype != param.dtype
        and inp.numel() == param.numel() and inp.dim() == param.dim()
        and inp.storage_offset() == param.storage_offset() and sorted(inp.stride()) == sorted(param.stride())
        and out.shape == inp.shape and out.stride() == inp.stride() and out.storage_offset() == 0
    )
