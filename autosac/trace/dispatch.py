"""Trace with the op choices of the target device.

The trace runs fake tensors on the CPU, but a plan names the ops the target
runs, and the applier matches them call by call.  Two composite functions
choose different ops on a CUDA device than on the CPU, and both save tensors
for backward, so they matter for memory and for matching:

* **dropout** (``F.dropout`` in training, ``0 < p < 1``): CUDA runs the fused
  ``native_dropout`` (output and a bool mask), the CPU ``bernoulli_`` and
  ``div_`` into a float mask;
* **scaled dot-product attention**: CUDA picks a fused kernel by PyTorch's
  selection rules (cuDNN, flash, memory-efficient, or the math fallback), the
  CPU its own flash kernel.

:class:`TargetDispatch` is a ``TorchFunctionMode`` that, while the trace runs
for a CUDA target, calls the op the target would: the fused kernels' meta
implementations give their outputs and saved tensors (flash attention keeps
the logsumexp, not the score matrix) on CPU fake tensors.

The SDPA rules (:func:`cuda_sdpa_backend`) follow PyTorch's ``sdp_utils.cpp``
for dense inputs: cuDNN first on sm90/sm100 for half precision (masks,
dropout and grouped key/value heads included), then flash, then
memory-efficient (not for grouped heads), then math.  On an H100 with PyTorch
2.11 they agree with the backend PyTorch picked in all 108 combinations of
dtype, head size, mask, dropout and grouped heads that
``benchmarks/gpu_verify.py`` tries.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def cuda_sdpa_backend(
    capability: tuple[int, int],
    dtype: torch.dtype,
    head_dim: int,
    value_dim: int,
    has_mask: bool,
    dropout_p: float,
    gqa: bool,
    training: bool,
) -> str:
    """The SDPA backend PyTorch picks on a CUDA device of compute
    ``capability`` for dense inputs: ``"cudnn"``, ``"flash"``, ``"efficient"``
    or ``"math"``.

    Example::

        >>> cuda_sdpa_backend((9, 0), torch.bfloat16, 128, 128, False, 0.0, False, True)
        'cudnn'
    """
    sm = capability[0] * 10 + capability[1]
    same_dims = head_dim == value_dim
    if capability in ((9, 0), (10, 0)) and dtype in _HALF and same_dims and head_dim <= 256 and head_dim % 8 == 0:
        return "cudnn"  # masks, dropout and grouped heads included (seen on an H100)
    if 80 <= sm <= 121 and dtype in _HALF and not has_mask and same_dims and head_dim <= 256 and head_dim % 8 == 0:
        # sm86/89/120: no flash backward for head dims in (192, 224], nor above 224 with dropout
        consumer = sm in (86, 89, 120, 121)
        if not (training and consumer and (192 < head_dim <= 224 or (head_dim > 224 and dropout_p > 0))):
            return "flash"
    align = 8 if dtype in _HALF else 4
    if 50 <= sm <= 121 and (dtype != torch.bfloat16 or sm >= 80) and dtype != torch.float64 and not gqa \
            and head_dim % align == 0 and value_dim % align == 0:
        return "efficient"  # takes no grouped key/value heads: those fall to math
    return "math"


class TargetDispatch(TorchFunctionMode):
    """Run dropout and SDPA as a CUDA device of ``capability`` would (see the
    module docstring).  Active only while the trace's forward runs.

    Example::

        >>> with FakeTensorMode(), TargetDispatch((9, 0)):
        ...     y = F.dropout(torch.randn(4, 4), 0.1)   # aten.native_dropout
    """

    def __init__(self, capability: tuple[int, int], autocast=None):
        super().__init__()
        self.capability = tuple(capability)
        self.autocast = autocast  # a CudaAutocast the forward runs under, if any

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return _dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return self._sdpa(*args, **kwargs)
        return func(*args, **kwargs)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        if self.autocast is not None and torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling():
            # CUDA autocast casts the inputs before the backend is chosen (by their dtype); under
            # torch.compile (a compiled plan's trace) Dynamo applies autocast to the graph itself
            (query, key, value, attn_mask), _ = self.autocast.cast_args(
                aten.scaled_dot_product_attention.default, (query, key, value, attn_mask), {})
        gqa = bool(enable_gqa) and query.size(-3) != key.size(-3)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        backend = cuda_sdpa_backend(self.capability, query.dtype, query.size(-1), value.size(-1),
                                    attn_mask is not None, dropout_p, gqa, training)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # the composite turns a boolean mask into an additive one in the query's dtype
            attn_mask = torch.where(attn_mask.logical_not(), -math.inf,
                                    torch.scalar_tensor(0.0, dtype=query.dtype, device=attn_mask.device))
        if backend == "cudnn":
            return aten._scaled_dot_product_cudnn_attention(
                query, key, value, attn_mask, training, dropout_p, is_causal, False, scale=scale)[0]
        if backend == "flash":
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if backend == "efficient":
            if attn_mask is not None:
                attn_mask = _efficient_mask(attn_mask, query, key)
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, training, dropout_p, is_causal, scale=scale)[0]
        return aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=bool(enable_gqa))[0]


def _dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as CUDA runs it: the fused ``native_dropout`` when it applies."""
    if not training or p == 0.0 or input.numel() == 0:
        return input
    if p == 1.0 or not input.is_floating_point():
        return F.dropout(input, p, training, inplace)
    out = aten.native_dropout(input, p, True)[0]
    return input.copy_(out) if inplace else out


def _efficient_mask(mask, query, key):
    """The memory-efficient kernel's mask: the last dim padded to 16 and cut
    back (a stride it can read), expanded to ``(batch, heads, L, S)``."""
    last = mask.size(-1)
    if last % 16:
        mask = F.pad(mask, (0, 16 - last % 16))[..., :last]
    shape = (query.size(0), query.size(1), query.size(-2), key.size(-2))
    return mask.expand(shape) if mask.dim() == 4 else mask
