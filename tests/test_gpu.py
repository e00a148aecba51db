"""What only a CUDA GPU can show (skipped elsewhere; ``benchmarks/gpu_check.sh``
runs this file on a GPU): findings of the 2026-11-25 H100 runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autosac
from autosac.models import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CFG = dict(batch=2, seq=128, n_layer=2, dim=128, n_head=4, vocab=512)


def test_the_cublas_workspace_is_what_the_prediction_counts():
    """First in this file: no real matmul has run in the process yet.  After a first step the process keeps cuBLAS's workspaces (the forward's
    thread's and autograd's): what :func:`autosac.core.devices.library_workspace_bytes`
    counts in every CUDA prediction, to within 2 MiB."""
    from autosac.core.devices import DEVICES, library_workspace_bytes

    model, idx = build_model("gpt2", device="cuda", **CFG)
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(idx).float().sum().backward()
    model.zero_grad(set_to_none=True)
    kept = torch.cuda.memory_allocated() - before
    major, minor = torch.cuda.get_device_capability()
    name = "h100" if major >= 9 else "a100"
    expected = library_workspace_bytes(DEVICES[name], fused_bias=True)  # gpt2's Linears fuse their biases
    assert abs(kept - expected) <= 2 << 20, (kept, expected)


def test_a_loss_fn_closing_over_cuda_labels_traces():
    """The labels most loops hold on the GPU, closed over by ``loss_fn``: the
    trace's tensors are fakes on the cpu, and the closed-over real CUDA tensor
    raised 'found two different devices cpu, cuda:0'."""
    model, idx = build_model("gpt2", device="cuda", **CFG)
    labels = torch.randint(0, CFG["vocab"], idx.shape, device="cuda")

    def loss_fn(out):
        return F.cross_entropy(out.float().view(-1, CFG["vocab"]), labels.view(-1))

    on_cpu = labels.cpu()  # closed over as a CPU tensor: what the trace made of it before

    stats = autosac.profile(model, idx, loss_fn=loss_fn, target="h100", autocast=torch.bfloat16)
    same = autosac.profile(model, idx, loss_fn=lambda out: F.cross_entropy(
        out.float().view(-1, CFG["vocab"]), on_cpu.view(-1)), target="h100", autocast=torch.bfloat16)
    assert stats.peak_bytes == same.peak_bytes


def test_a_planned_backward_records_memory_history_as_torch_checkpoint_does():
    """transformers GPT-2 with a plan raised SystemError ('returned NULL
    without setting an exception') in backward while
    ``torch.cuda.memory._record_memory_history(stacks="python")`` recorded.
    Found on an H100 (torch 2.11, 2026-11-26): plain ``torch.utils.checkpoint``
    without autosac raises the same, and both run with ``context=None``.  The
    applied plan behaves as torch's checkpoint in both settings."""
    import functools

    from torch.utils.checkpoint import checkpoint

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=512, n_positions=128, use_cache=False)
    idx = torch.randint(0, 512, (2, 128), device="cuda")
    inputs = {"input_ids": idx, "labels": idx}
    plan = autosac.solve(transformers.GPT2LMHeadModel(cfg).train(), "least", {k: v.cpu() for k, v in inputs.items()},
                         loss_fn=lambda out: out.loss, target="h100", autocast=torch.bfloat16)

    def torch_checkpoint(model):
        for block in model.transformer.h:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)

    def backward_runs(prepare, **history) -> bool:
        model = transformers.GPT2LMHeadModel(cfg).cuda().train()
        prepare(model)
        torch.cuda.memory._record_memory_history(max_entries=100000, **history)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(**inputs).loss.backward()
            return True
        except SystemError:
            return False
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    for history in (dict(stacks="python"), dict(context=None)):
        assert backward_runs(lambda m: autosac.apply(m, plan), **history) == backward_runs(torch_checkpoint, **history)
    assert backward_runs(lambda m: autosac.apply(m, plan), context=None)
