"""On a GPU (outside CI): the library memory one matmul leaves behind, with and
without a fused bias, each in a fresh process (no matmul has run before).

cuBLAS's workspace (32 MiB on Hopper) comes with a thread's first matmul;
cuBLASLt's (PyTorch's default ``CUBLASLT_WORKSPACE_SIZE``, 1 MiB) with its
first ``addmm`` that fuses a bias.  What :func:`autosac.core.devices.library_workspace_bytes`
counts; on an H100 with torch 2.11 (2026-11-27): 32 and 33 MiB after the
forward, 64 and 65 after the backward (autograd's thread has its own).

    python benchmarks/gpu_lt_workspace.py
"""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F

MIB = 1 << 20


def one(bias: bool) -> str:
    """In this process: one bf16 ``F.linear`` forward and backward; what the
    device holds beyond its output, then beyond the gradients."""
    dt = torch.bfloat16
    x = torch.randn(8192, 768, device="cuda", dtype=dt, requires_grad=True)
    w = torch.randn(3072, 768, device="cuda", dtype=dt, requires_grad=True)
    b = torch.randn(3072, device="cuda", dtype=dt, requires_grad=True) if bias else None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y = F.linear(x, w, b)
    torch.cuda.synchronize()
    forward = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
    y.sum().backward()
    del y
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (x, w, b) if t is not None)
    backward = torch.cuda.memory_allocated() - base - grads
    return (f"{'with' if bias else 'without'} bias: {forward / MIB:.3f} MiB beyond the output after the "
            f"forward, {backward / MIB:.3f} MiB beyond the gradients after the backward")


def main() -> None:
    if len(sys.argv) > 1:
        print(one(sys.argv[1] == "bias"))
        return
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for arg in ("nobias", "bias"):  # each in a fresh process: the workspaces live as long as it does
        subprocess.run([sys.executable, __file__, arg], check=True, timeout=120)


if __name__ == "__main__":
    main()
