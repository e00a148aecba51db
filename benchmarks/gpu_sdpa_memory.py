"""On a GPU (outside CI): the memory SDPA's fused kernels allocate beyond
their inputs, outputs and saved tensors -- forward and backward transients --
against what autosac's trace counts for the same call on fake tensors.

    python benchmarks/gpu_sdpa_memory.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from autosac.core.budget import format_bytes

SHAPES = [(4, 16, 4096, 128, 4), (4, 16, 4096, 128, 16), (8, 12, 1024, 64, 12), (1, 32, 8192, 128, 8),
          (2, 16, 2048, 128, 16)]


def transients(backend, b, h, s, d, kvh, dtype=torch.bfloat16):
    q = torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, kvh, s, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, kvh, s, d, device="cuda", dtype=dtype, requires_grad=True)
    with sdpa_kernel([backend]):
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kvh != h)  # warm-up
        y.backward(torch.ones_like(y))
        q.grad = k.grad = v.grad = None
        del y
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kvh != h)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base  # output + what autograd saved
        fwd_extra = torch.cuda.max_memory_allocated() - base - held
        g = torch.ones_like(y)
        torch.cuda.synchronize()
        before_bwd = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y.backward(g)
        torch.cuda.synchronize()
        grads = sum(t.grad.numel() * t.grad.element_size() for t in (q, k, v))
        bwd_extra = torch.cuda.max_memory_allocated() - before_bwd - grads
    return held, fwd_extra, bwd_extra


def main():
    print(torch.__version__, torch.cuda.get_device_name())
    print(f"{'backend':10s} {'b,h,s,d,kvh':>22s} {'q bytes':>10s} {'held':>10s} {'fwd extra':>10s} {'bwd extra':>10s}")
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for shape in SHAPES:
            b, h, s, d, kvh = shape
            try:
                held, fe, be = transients(backend, *shape)
                qb = b * h * s * d * 2
                print(f"{backend.name:10s} {str(shape):>22s} {format_bytes(qb):>10s} {format_bytes(held):>10s} "
                      f"{format_bytes(fe):>10s} {format_bytes(be):>10s}  bwd/q={be / qb:.2f}", flush=True)
            except Exception as e:
                print(backend.name, shape, "error", type(e).__name__, str(e)[:100], flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
