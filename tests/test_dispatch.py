"""Plans for a GPU name the ops that GPU runs: dropout and attention traced as
CUDA dispatches them, and a plan used on another device class says so."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from suite import assert_same_step

import autosac
from autosac.models import build_model
from autosac.solver import least_peak
from autosac.solver.problem import build_problem
from autosac.trace.dispatch import cuda_sdpa_backend

CPU_ONLY = ("bernoulli_", "_for_cpu", "mkldnn")


@pytest.mark.parametrize(
    "capability,dtype,head,mask,dropout,gqa,expect",
    [
        # H100 (seen there with PyTorch 2.11, benchmarks/results/gpu_verify.md): cuDNN for half precision
        ((9, 0), torch.bfloat16, 128, False, 0.0, False, "cudnn"),
        ((9, 0), torch.bfloat16, 128, True, 0.0, False, "cudnn"),  # ... with a mask
        ((9, 0), torch.float16, 256, False, 0.1, False, "cudnn"),  # ... with dropout
        ((9, 0), torch.bfloat16, 64, True, 0.1, True, "cudnn"),  # ... with grouped key/value heads
        ((9, 0), torch.float32, 64, False, 0.0, False, "efficient"),  # no fused half kernel for fp32
        ((9, 0), torch.float32, 64, False, 0.0, True, "math"),  # memory-efficient takes no grouped heads
        ((8, 0), torch.float16, 64, False, 0.0, False, "flash"),  # A100
        ((8, 0), torch.bfloat16, 64, False, 0.0, True, "flash"),  # flash takes grouped heads
        ((8, 0), torch.bfloat16, 64, True, 0.0, False, "efficient"),  # flash takes no mask
        ((8, 0), torch.bfloat16, 64, True, 0.0, True, "math"),  # ... and efficient no grouped heads
        ((8, 0), torch.bfloat16, 320, False, 0.0, False, "efficient"),  # flash: head dim <= 256
        ((8, 9), torch.bfloat16, 208, False, 0.0, False, "efficient"),  # L4: no flash backward for (192, 224]
        ((7, 5), torch.bfloat16, 64, False, 0.0, False, "math"),  # T4: no bf16 kernels
        ((7, 5), torch.float16, 64, False, 0.0, False, "efficient"),
        ((8, 0), torch.float64, 64, False, 0.0, False, "math"),
    ],
)
def test_sdpa_backend_follows_the_cuda_selection_rules(capability, dtype, head, mask, dropout, gqa, expect):
    assert cuda_sdpa_backend(capability, dtype, head, head, mask, dropout, gqa, True) == expect


def _forward_ops(stats) -> list[str]:
    return [op for op, ph in zip(stats.timeline.ops, stats.timeline.phases) if ph == "forward"]


@pytest.mark.parametrize(
    "name,dtype,target,attention",
    [
        ("gpt-tiny", torch.float32, "h100", None),  # spelled-out attention: only dropout differs
        ("llama-tiny", torch.bfloat16, "h100", "_scaled_dot_product_cudnn_attention"),
        ("llama-tiny", torch.bfloat16, "a100", "_scaled_dot_product_flash_attention"),
        ("llama-tiny", torch.float32, "a100", "_scaled_dot_product_efficient_attention"),
    ],
)
def test_a_gpu_plan_names_gpu_ops_only(name, dtype, target, attention):
    extra = {"dropout": 0.1} if name == "gpt-tiny" else {}
    model, idx = build_model(name, device="meta", batch=2, seq=64, **extra)
    stats = autosac.profile(model.to(dtype), idx, target=target)
    ops = _forward_ops(stats)
    assert not [op for op in ops if any(c in op for c in CPU_ONLY)]
    if attention:
        assert attention in ops and f"{attention}_backward" in stats.timeline.ops
    if name == "gpt-tiny":
        assert "native_dropout" in ops
    least, _ = least_peak(build_problem(stats))
    plan = autosac.solve(stats, least)
    assert plan.decisions and plan.device == "cuda" and plan.target == target
    named = {o.op for d in plan.details.values() for o in d.ops}
    assert not [op for op in named if any(c in op for c in CPU_ONLY)]
    # the same model planned for the cpu names the cpu's kernels
    cpu_ops = _forward_ops(autosac.profile(model.to(dtype), idx, target="cpu"))
    assert "native_dropout" not in cpu_ops and not [op for op in cpu_ops if op.startswith("_scaled_dot_product_") and
                                                     not op.endswith("_for_cpu")]


def test_flash_attention_keeps_its_logsumexp_not_the_scores():
    b, h, s, d = 2, 4, 256, 64

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(h * d, 3 * h * d, dtype=torch.bfloat16)

        def forward(self, x):
            q, k, v = self.qkv(x).view(b, s, 3, h, d).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    x = torch.randn(b, s, h * d, dtype=torch.bfloat16)
    stats = autosac.profile(Attn(), x, target="a100", optimizer="none")
    (attn,) = [o for o in stats.saved_ops if o.op == "_scaled_dot_product_flash_attention"]
    # the output (bf16), the logsumexp (fp32, one per query row) and the RNG
    # state (a few bytes): no s x s matrix
    out_and_lse = b * h * s * d * 2 + b * h * s * 4
    assert out_and_lse <= attn.bytes <= out_and_lse + 64


def test_a_gpu_plan_applied_on_the_cpu_says_so_once():
    model, idx = build_model("gpt-tiny", device="cpu", batch=2, seq=64, dropout=0.1)
    stats = autosac.profile(model, idx, target="h100")
    plan = autosac.solve(stats, least_peak(build_problem(stats))[0])
    ref = copy.deepcopy(model)
    autosac.apply(model, plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_same_step(ref, model, idx)
        assert_same_step(ref, model, idx)
    said = [str(w.message) for w in caught if "made for cuda" in str(w.message)]
    assert len(said) == 1 and "runs on cpu" in said[0] and "target='cpu'" in said[0]
    assert "\n" not in said[0]


def test_verify_refuses_a_gpu_plan_where_there_is_no_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from autosac.cli import main

    path = str(tmp_path / "p.json")
    common = ["--model", "gpt-tiny", "--batch", "2", "--seq", "64"]
    assert main(["plan", *common, "--target", "h100", "--budget", "least", "--json", path]) == 0
    capsys.readouterr()
    assert main(["verify", path, *common, "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no GPU" in err[0] and "--target cpu" in err[0]
