"""The traced peak against real CPU steps measured independently (allocator
events from the PyTorch profiler), at sizes where activations dominate."""

import pytest
import torch
from suite import A100_CPU_KERNELS

import autosac
from autosac.measure import measure
from autosac.models import build_model

MIB = 1 << 20


@pytest.mark.parametrize(
    "name,kw",
    [
        ("gpt2", dict(n_layer=3, dim=256, n_head=4, seq=512, vocab=4096, batch=4, dropout=0.1)),
        ("llama-tiny", dict(n_layer=3, dim=256, n_head=4, n_kv_head=2, ffn_hidden=688, seq=512, vocab=4096, batch=8)),
    ],
)
def test_baseline_peak_matches_real_step(name, kw):
    torch.manual_seed(0)
    batch = kw.pop("batch")
    model, idx = build_model(name, device="cpu", batch=batch, **kw)
    stats = autosac.profile(model, idx, target=A100_CPU_KERNELS)  # measured here: the CPU's kernels
    acts = stats.peak_breakdown.get("act", 0)
    assert acts >= 200 * MIB, f"activations {acts / MIB:.0f} MiB: too small to mean anything"
    real = measure(model, idx, steps=1)
    assert abs(real.peak_bytes - stats.peak_bytes) <= 0.05 * real.peak_bytes, (
        f"predicted {stats.peak_bytes / MIB:.1f} MiB vs measured {real.peak_bytes / MIB:.1f} MiB"
    )


def test_reused_module_peak_matches_real_step():
    from torch import nn

    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(512, 1024)
            self.shared = nn.Linear(1024, 1024)

        def forward(self, x):
            h = torch.relu(self.inp(x))
            for _ in range(4):
                h = torch.relu(self.shared(h))
            return h

    model = Reuse()
    x = torch.randn(4096, 512)
    stats = autosac.profile(model, x)
    assert stats.modules["shared"].calls == 4
    real = measure(model, x, steps=1)
    assert abs(real.peak_bytes - stats.peak_bytes) <= 0.05 * real.peak_bytes
