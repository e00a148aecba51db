"""The trace fails where the real step fails, and runs where it runs: inputs
whose dtype the model's kernels refuse, and CTC losses, whose output sizes
follow the (real) target lengths that fake kernels cannot read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from suite import assert_same_step, check_model, seeded
from torch import nn

import autosac
from autosac.trace.step import TraceError


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def test_float64_inputs_to_a_float32_model_fail_as_the_real_step_fails():
    model, x = _mlp(), torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="same dtype"):
        model(x)
    with pytest.raises(TraceError, match=r"module '0' \(Linear\) raised RuntimeError: mat1 and mat2 must have the same "
                                         r"dtype.*aten.addmm.*check that example_inputs fit the model"):
        autosac.profile(model, (x,), target="cpu")


class _Promotes(nn.Module):
    """Mixed floating dtypes the real kernels take: ``cat`` promotes."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.cat([self.fc(x), x.double()], dim=-1)
        return h.float().sum(-1)


def test_mixed_dtypes_the_real_kernel_takes_still_trace():
    model, x = _Promotes(), torch.randn(4, 8)
    stats = autosac.profile(model, (x,), target="cpu")
    assert stats.peak_bytes > 0


class _Acoustic(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)])
        self.head = nn.Linear(64, 12)

    def forward(self, x):
        return self.head(self.blocks(x)).log_softmax(-1)


def _ctc_build():
    torch.manual_seed(0)
    model, x = _Acoustic(), torch.randn(4, 100, 64)
    targets, target_lengths = torch.randint(1, 12, (4, 30)), torch.tensor([30, 25, 20, 12])
    input_lengths = torch.tensor([100, 90, 80, 70])

    def loss(out):
        return F.ctc_loss(out.transpose(0, 1), targets, input_lengths, target_lengths)

    return model, x, loss


def test_ctc_loss_in_loss_fn_plans_a_step_that_holds():
    _, _, loss = _ctc_build()
    build = seeded(lambda: _ctc_build()[:2])
    rows = check_model("ctc", build, loss_fn=loss, target="cpu", labels=("70%", "least"))
    assert [r.bitwise for r in rows] == [True, True]


def test_nonzero_of_a_fake_tensor_stays_data_dependent():
    """Sizes read from real lengths are known; sizes read from the fake
    activations are not: those still say the forward branches on values."""
    class Picks(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x)[self.fc(x) > 0].sum()

    with pytest.raises(TraceError, match="values"):
        autosac.profile(Picks(), (torch.randn(4, 8),), target="cpu")


def _speech_ctc(kind: str, layerdrop: float = 0.0):
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
                  vocab_size=12, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                  ctc_loss_reduction="mean", layerdrop=layerdrop,
                  mask_time_prob=0.0)  # SpecAugment draws from NumPy, which the step comparison does not seed
    config, model = {"wav2vec2": (transformers.Wav2Vec2Config, transformers.Wav2Vec2ForCTC),
                     "hubert": (transformers.HubertConfig, transformers.HubertForCTC)}[kind]

    def build():
        torch.manual_seed(0)
        inputs = {"input_values": torch.randn(2, 4000), "labels": torch.randint(1, 12, (2, 20))}
        return model(config(**common)).train(), inputs

    return build


@pytest.mark.parametrize("kind", ["wav2vec2", "hubert"])
def test_transformers_ctc_heads_with_labels_plan_steps_that_hold(kind):
    rows = check_model(kind, _speech_ctc(kind), loss_fn=lambda out: out.loss, target="cpu", labels=("least",))
    assert [r.bitwise for r in rows] == [True]


def test_layerdrop_is_one_line_and_a_plan_made_without_it_holds_with_it():
    """LayerDrop draws torch.rand([]) per layer and skips by its value: the
    trace says so in one line; a plan made with every layer running keeps the
    step bitwise and within budget when layers are skipped."""
    build = _speech_ctc("wav2vec2", layerdrop=0.5)
    model, inputs = build()
    with pytest.raises(TraceError, match=r"drawn at random .*config.layerdrop=0.0") as caught:
        autosac.profile(model, inputs, loss_fn=lambda out: out.loss, target="cpu")
    assert "\n" not in str(caught.value)
    plan = autosac.solve(_speech_ctc("wav2vec2")()[0], "least", example_inputs=inputs, loss_fn=lambda out: out.loss,
                         target="cpu")
    ref, (work, inputs) = build()[0], build()
    work.load_state_dict(ref.state_dict())
    autosac.apply(work, plan)
    assert_same_step(ref, work, inputs, loss_fn=lambda out: out.loss)
    fresh, inputs = build()
    autosac.apply(fresh, plan)
    for seed in range(3):  # different layers skipped
        torch.manual_seed(seed)
        peak = autosac.measure(fresh, inputs, loss_fn=lambda out: out.loss, steps=0).peak_bytes
        assert peak <= plan.budget_bytes, (seed, peak, plan.budget_bytes)


class _Unique(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        values = torch.unique(x)  # its size follows the (fake) values
        return self.fc(x).sum() + (values[:, None] * self.fc.weight[0]).sum()


class _MaskFilledUnderAFakeCondition(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.fc, self.make = nn.Linear(64, 256), make

    def forward(self, x):
        h = self.fc(x)
        keep = self.make(h)  # small: made real in the trace
        keep.masked_fill_(h.mean(-1) > -1e9, True)  # the condition is fake: the write went to a fake twin
        return h[keep].sum()


@pytest.mark.parametrize("model", [
    _Unique(),
    _MaskFilledUnderAFakeCondition(lambda h: torch.zeros_like(h[:, 0], dtype=torch.bool)),
    _MaskFilledUnderAFakeCondition(lambda h: torch.zeros(h.shape[0], dtype=torch.bool)),
], ids=["unique", "zeros_like-mask", "zeros-mask"])
def test_sizes_read_off_unknown_values_stay_a_clear_error(model):
    """Review of the CTC change: zeros and ones of a fake input both give one
    unique value, and a small real mask written under a fake condition kept
    its stale values: both traces went on with wrong sizes (predicted 14x and
    29 % under the measured peak).  Sizes that follow unknown values are one
    line, as before."""
    with pytest.raises(TraceError, match="branches on tensor values"):
        autosac.profile(model, (torch.randn(512, 64),), target="cpu")


def test_batch_norm_with_a_cumulative_average_is_one_line_naming_the_fix():
    """``momentum=None`` reads the call count with ``float()``: the trace
    names the module and the setting to plan with, not "your branch"."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8, momentum=None))
    with pytest.raises(TraceError, match=r"module '1' \(BatchNorm1d\) has momentum=None .* plan with a momentum set") \
            as caught:
        autosac.profile(model, torch.randn(16, 8), target="cpu")
    assert "\n" not in str(caught.value)
