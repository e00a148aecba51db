"""The errors a traced forward raises, each naming the module it was in and
what to do (:func:`run_forward`)."""

from __future__ import annotations

import torch
from torch import nn

from autosac.core.errors import TraceError
from autosac.trace.fake_kernels import FakeKernelError
from autosac.trace.recorder import StepRecorder


class ValueBranchError(TraceError):
    """The forward read a tensor's values, which a fake trace does not have."""


def run_forward(model: nn.Module, args: tuple, kwargs: dict, recorder: StepRecorder):
    """The model's output; what the forward raises becomes one
    :class:`TraceError` naming the module it was in (the recorder's stack)
    and what to do."""
    try:
        return model(*args, **kwargs)
    except TraceError:
        raise
    except Exception as e:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):  # the compiled step (autosac.compile.trace)
            cause = getattr(e, "inner_exception", None) or e  # a backend's own error, not Dynamo's wrapper
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
            raise TraceError(f"torch.compile of {type(model._orig_mod).__name__} failed while tracing the step: "
                             f"{type(cause).__name__}: {first}") from None
        where = recorder.stack[-1] if recorder.stack else None
        if where is None or (where == "" and isinstance(e, TypeError) and len(recorder.rec.ops) == 0):
            raise TraceError(
                f"example_inputs do not fit {type(model).__name__}.forward: {type(e).__name__}: {e}"
            ) from None
        name = where or "(root)"
        mod = model.get_submodule(where) if where else model
        if recorder.random_branch:
            raise ValueBranchError(
                f"forward of module '{name}' ({type(mod).__name__}) branches on values drawn at random ({e}): "
                "LayerDrop (skips layers by chance: plan with it off, transformers config.layerdrop=0.0, and train "
                "with it on), or a check of activations after dropout (an isfinite or overflow clamp, as DETR's), "
                "which a fake trace cannot see: plan with that dropout at 0, or make the branch depend on shapes only"
            ) from None
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.momentum is None:
            raise ValueBranchError(
                f"module '{name}' ({type(mod).__name__}) has momentum=None (a cumulative average), which reads its "
                "call count as a Python number that a fake trace does not have: plan with a momentum set (e.g. 0.1; "
                "the step's memory is the same) and train with None"
            ) from None
        if type(e).__name__ in ("DataDependentOutputException", "DynamicOutputShapeException"):
            raise ValueBranchError(
                f"forward of module '{name}' ({type(mod).__name__}) branches on tensor values ({e}), "
                "which a fake-mode trace cannot see: trace with inputs that take the usual branch "
                "behind a Python flag, or make the branch depend on shapes only"
            ) from None
        if isinstance(e, FakeKernelError) and e.real == "untried":
            raise TraceError(
                f"forward of module '{name}' ({type(mod).__name__}): PyTorch's fake kernel for {e.op} raised {e}; "
                "its inputs are too large to try the real kernel on -- if the model trains with these "
                "example_inputs, plan at a smaller batch or sequence to see whether the real kernel takes them"
            ) from None
        first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else ""
        kind = "" if isinstance(e, FakeKernelError) else f"{type(e).__name__}: "
        where = f" in {e.op} (its real kernel refuses them{'' if e.real == 'refused' else ' too'})" \
            if isinstance(e, FakeKernelError) else ""
        raise TraceError(
            f"forward of module '{name}' ({type(mod).__name__}) raised {kind}{first}{where}"
            " -- check that example_inputs fit the model"
        ) from None


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
