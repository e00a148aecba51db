"""The traced peak against real CPU steps measured independently (allocator
events from the PyTorch profiler), at sizes where activations dominate."""

import pytest
import torch
from suite import A100_CPU_KERNELS

import autosac
from autosac.models import build_model
from autosac.tools.measure import measure

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
    stats = autosac.profile(model, x, target=A100_CPU_KERNELS)  # measured here: the CPU's kernels, no cuBLAS
    assert stats.modules["shared"].calls == 4
    real = measure(model, x, steps=1)
    assert abs(real.peak_bytes - stats.peak_bytes) <= 0.05 * real.peak_bytes


def test_batch_norm_over_a_transposed_input_lays_out_its_outputs_as_the_kernel_does():
    """BatchNorm1d over (B, C, T) taken as a transpose of (B, T, C): the CPU
    kernel returns a contiguous output (and a contiguous input gradient), the
    meta kernel keeps the transposed strides.  The trace follows the kernel, so
    the copies the real step makes before the next matmul are counted: the
    peak is exact, and the least plan keeps its budget (it was 1 MiB over)."""
    from torch import nn

    class BNOverTime(nn.Module):
        def __init__(self, d=256):
            super().__init__()
            self.emb = nn.Embedding(500, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            self.bn = nn.BatchNorm1d(d)
            self.out = nn.Linear(d, 500, bias=False)

        def forward(self, ids):
            h = self.emb(ids)
            h = h + self.mlp(h)
            return self.out(self.bn(h.transpose(1, 2)).transpose(1, 2))

    torch.manual_seed(0)
    model, ids = BNOverTime(), torch.randint(0, 500, (8, 128))
    stats = autosac.profile(model, ids, target=A100_CPU_KERNELS)
    assert stats.peak_bytes == measure(model, ids, steps=0).peak_bytes
    with pytest.raises(autosac.InfeasibleBudgetError) as err:
        autosac.solve(stats, 1)
    plan = autosac.solve(stats, err.value.min_feasible_bytes)
    import copy

    planned = autosac.apply(copy.deepcopy(model), plan)
    assert measure(planned, ids, steps=0).peak_bytes <= plan.budget_bytes


def test_the_kernel_layout_rule_matches_real_batch_norm_kernels():
    """The rule the trace applies (the output in the input's suggested memory
    format) against the real CPU kernels, forward and backward, for
    transposed, channels-last and width/height-swapped inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autosac.trace.recorder import with_kernel_layout

    aten = torch.ops.aten
    layouts = [torch.randn(4, 16, 8).transpose(1, 2), torch.randn(2, 6, 5, 3).permute(0, 3, 1, 2),
               torch.randn(2, 3, 6, 5).transpose(2, 3), torch.randn(2, 3, 6, 5)]
    for x in layouts:
        c = x.shape[1]
        w, b, rm, rv = torch.randn(c), torch.randn(c), torch.zeros(c), torch.ones(c)
        fw = aten.native_batch_norm.default
        out = fw(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5)
        grads = [torch.randn_like(out[0]), torch.randn(out[0].shape), x.clone()]
        bw = aten.native_batch_norm_backward.default
        calls = [(fw, (x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5))]
        calls += [(bw, (g, x, w, rm, rv, out[1], out[2], True, 1e-5, [True, True, True])) for g in grads]
        for func, args in calls:
            real = func(*args)[0].stride()
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with mode:
                fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
                traced = with_kernel_layout(func, fake_args, func(*fake_args))[0].stride()
            assert traced == real, (func, x.stride(), traced, real)


def test_measuring_the_peak_only_gives_the_same_peak_and_no_time():
    """``steps=0``: the warm-up and the profiled step, no timed ones -- the
    same peak as with timed steps (the measured step is steady-state either
    way), ``step_ms`` nan; a bad ``steps`` is one clear error."""
    import math

    from autosac.tools.sweep import measure_sweep, sweep

    torch.manual_seed(0)
    model, idx = build_model("gpt2", device="cpu", batch=2, n_layer=2, dim=64, n_head=4, seq=64, vocab=128)
    timed, peak_only = measure(model, idx, steps=2), measure(model, idx, steps=0)
    assert peak_only.peak_bytes == timed.peak_bytes
    assert math.isnan(peak_only.step_ms) and peak_only.step_ms_all == [] and len(timed.step_ms_all) == 2
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="steps must be an int >= 0"):
            measure(model, idx, steps=bad)
    result = sweep(autosac.profile(model, idx, target=A100_CPU_KERNELS), ["90%"])
    with pytest.raises(ValueError, match="measure_sweep needs steps >= 1"):
        measure_sweep(result, model, idx, steps=0)
    with pytest.raises(ValueError, match="measure_sweep needs rounds >= 1"):
        measure_sweep(result, model, idx, rounds=0)
