"""Where PyTorch's fake (meta) kernels reject what the real kernels run.

A trace must follow the path the real step takes.  When the meta kernel of
an op refuses arguments its real kernels accept, the trace would fail (and
blame the user's inputs) on a step that trains fine.  Known cases, each
checked against the real kernel:

* ``aten._grouped_mm`` (``torch.nn.functional.grouped_mm``, transformers'
  default MoE experts path): the meta kernel implements the CUDA bf16 kernel's
  checks and refuses float32 and float16, which the CPU kernel (and the CUDA
  fallback) run.  Its output is sized here as the meta kernel sizes it.

:func:`run_fake` runs an op under the trace's fake mode and, only when its
meta kernel raises and a rule here covers the op, returns the rule's output.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
_GROUPED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """Output of ``_grouped_mm`` for dtypes the meta kernel refuses: 2-d by
    3-d is ``(rows, n)``, 3-d by 2-d ``(m, n)``, 2-d by 2-d one matrix per
    group, 3-d by 3-d a batched matmul."""
    if mat_a.dtype not in _GROUPED_DTYPES or mat_b.dtype != mat_a.dtype:
        return None
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


def run_fake(func, args, kwargs):
    """``func(*args, **kwargs)`` under the active fake mode; where its meta
    kernel raises and :data:`RULES` covers the op, the rule's output."""
    rule = RULES.get(func)
    if rule is None:
        return func(*args, **kwargs)
    try:
        return func(*args, **kwargs)
    except RuntimeError:
        out = rule(*args, **kwargs)
        if out is None:
            raise
        return out
