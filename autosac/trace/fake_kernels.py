"""Where PyTorch's fake (meta) kernels reject what the real kernels run.

A trace must follow the path the real step takes.  When the meta kernel of
an op refuses arguments its real kernels accept, the trace would fail (and
blame the user's inputs) on a step that trains fine.  Known cases, each
checked against the real kernel:

* ``aten._grouped_mm`` (``torch.nn.functional.grouped_mm``, transformers'
  default MoE experts path): the meta kernel implements the CUDA bf16 kernel's
  checks and refuses float32 and float16, which the CPU kernel (and the CUDA
  fallback) run.  Its output is sized here as the meta kernel sizes it.

Any other op whose meta kernel raises is tried once on the real CPU kernel,
on zeros of the same shapes, strides and dtypes (real tensors of the trace,
an offsets tensor say, as they are; inputs up to 256 MiB): when the real
kernel runs, the trace goes on with fake outputs laid out as the real ones;
when it raises too, the error is the inputs' (or the model's), and
:class:`FakeKernelError` says which of the two happened.

:func:`run_fake` runs an op under the trace's fake mode that way.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten
_GROUPED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """Output of ``_grouped_mm`` for dtypes the meta kernel refuses: 2-d by
    3-d is ``(rows, n)``, 3-d by 2-d ``(m, n)``, 2-d by 2-d one matrix per
    group, 3-d by 3-d a batched matmul."""
    if mat_a.dtype not in _GROUPED_DTYPES or mat_b.dtype != mat_a.dtype:
        return None
    # the checks the real kernel makes besides the dtype: a wrong shape fails here as it would there
    torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3),
                 lambda: f"Multiplicands must be 2D or 3D but got mat_a.dim()={mat_a.dim()} and mat_b.dim()={mat_b.dim()}")
    torch._check(mat_a.size(-1) == mat_b.size(-2) or (mat_a.dim() == 2 and mat_b.dim() == 2),
                 lambda: "contraction dimension of mat_a and mat_b must match")
    torch._check((offs is not None) == (mat_a.dim() == 2 or mat_b.dim() == 2),
                 lambda: "offs is required exactly when one of the matrices is 2D")
    if offs is not None:
        torch._check(offs.dim() == 1 and offs.dtype == torch.int32, lambda: "offs must be a 1D int32 tensor")
        torch._check(mat_b.dim() == 2 or offs.size(0) == mat_b.size(0), lambda: "matrix batch sizes have to match")
        torch._check(mat_a.dim() == 2 or offs.size(0) == mat_a.size(0), lambda: "matrix batch sizes have to match")
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        if offs is None:
            return None
        shape = (offs.size(0), mat_a.size(0), mat_b.size(1))
    elif mat_a.dim() == 2:
        shape = (mat_a.size(0), mat_b.size(-1))
    elif mat_b.dim() == 2:
        shape = (mat_a.size(1), mat_b.size(1))
    else:
        shape = (mat_a.size(0), mat_a.size(1), mat_b.size(-1))
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


# op overload -> rule(*args, **kwargs) -> output, or None where the rule does not apply
RULES = {aten._grouped_mm.default: _grouped_mm}


_PROBE_CAP_BYTES = 256 << 20


class FakeKernelError(RuntimeError):
    """An op's fake kernel raised ``error`` (its type and first line): ``op``
    names the op, ``real`` says what the real kernel did on zeros of the same
    inputs: ``"raised"`` (the inputs or the model are at fault) or
    ``"untried"`` (inputs too large to try)."""

    def __init__(self, op: str, error: str, real: str) -> None:
        super().__init__(error)
        self.op, self.real = op, real


def _data_dependent(e: Exception) -> bool:
    return type(e).__name__ in ("DataDependentOutputException", "DynamicOutputShapeException",
                                "GuardOnDataDependentSymNode", "UnsupportedOperatorException")


def _real_twin(x):
    if isinstance(x, FakeTensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).zero_()
    return x


def _follow_real(func, args, kwargs):
    """Fake outputs laid out as the real CPU kernel lays them out on zeros of
    the same inputs; ``None`` when the inputs are too large to try.  Raises
    what the real kernel raises."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if sum(t.numel() * t.element_size() for t in tensors) > _PROBE_CAP_BYTES:
        return None
    with unset_fake_temporarily(), torch.random.fork_rng(devices=[]):
        real_args, real_kwargs = tree_map(_real_twin, (args, kwargs))
        out = func(*real_args, **real_kwargs)
    return tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
                    if isinstance(t, torch.Tensor) else t, out)


def run_fake(func, args, kwargs):
    """``func(*args, **kwargs)`` under the active fake mode; where its meta
    kernel raises, :data:`RULES`' output for the op, else the real kernel's
    layout (see the module docstring).

    Raises:
        FakeKernelError: the fake kernel raised and the real one did too (or
            could not be tried); data-dependent errors pass through as they are.
    """
    try:
        return func(*args, **kwargs)
    except Exception as e:
        if _data_dependent(e) or not isinstance(e, (RuntimeError, ValueError, IndexError, TypeError)):
            raise
        # only the text is kept: the exception's traceback holds this frame's tensors, and
        # the trace runs with the garbage collector off (a cycle would keep them to the end)
        text = str(e).strip()
        error = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    rule = RULES.get(func)
    out = rule(*args, **kwargs) if rule is not None else None
    if out is not None:
        return out
    name = f"{func.namespace}.{func.overloadpacket.__name__}"
    real = "untried"
    try:
        out = _follow_real(func, args, kwargs)
    except Exception:  # noqa: BLE001 - the real kernel refuses them too: the inputs' fault
        out, real = None, "raised"
    # raised here, outside the handler: the probe's exception (its frames hold the zeros it
    # ran on) is not kept as the context of the error the user sees
    if out is None:
        raise FakeKernelError(name, error, real)
    return out
