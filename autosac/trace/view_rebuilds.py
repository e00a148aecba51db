"""Autograd re-making a view that an in-place op wrote.

Under grad mode, an in-place op that writes a view makes autograd rebuild that
view's ``grad_fn`` at once; for a fake tensor (a tensor subclass: no
``as_strided``) it does so by running the view ops from the base again --
``out[:, t] = x`` dispatches ``select`` a second time under the trace, once for
real; Funnel's attention re-runs a chain of seven views.  The real step
dispatches no op for that: the trace must not count them.
"""

from __future__ import annotations

import os
import sys

import torch

from autosac.core.dataflow import tensors_in
from autosac.core.opkinds import is_view_op, written_tensors

__all__ = ["rebuilds", "view_written"]

# torch's package and autosac's (this file's grandparent)
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)


def view_written(func, args, kwargs) -> tuple | None:
    """The geometry of the one view an in-place op writes, under grad mode,
    and the caller's instruction; else None."""
    if not torch.is_grad_enabled():
        return None
    written = [t for t in written_tensors(func, args, kwargs) if isinstance(t, torch.Tensor)]
    if len(written) != 1 or not written[0]._is_view():
        return None
    return _geometry(written[0]), _caller()


def rebuilds(func, ran, written: tuple) -> bool | None:
    """Whether ``func``, run after an in-place write into a view (``written``,
    from :func:`view_written`), is autograd re-making that view: a view op
    dispatched within the same caller's instruction as the write.  ``None``
    once it made exactly the written geometry (the rebuild is over)."""
    geometry, caller = written
    outs = tensors_in(ran)
    if not is_view_op(func) or len(outs) != 1 or caller is None or _caller() != caller:
        return False
    return None if _geometry(outs[0]) == geometry else True


def _geometry(t: torch.Tensor) -> tuple:
    return id(t.untyped_storage()), tuple(t.shape), t.stride(), t.storage_offset()


def _caller() -> tuple | None:
    """The innermost frame outside torch and autosac, as (frame, instruction):
    ops autograd dispatches on its own while one call runs share it."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back
    return None if frame is None else (id(frame), frame.f_lasti)
