"""Unmodified steps of third-party models, predicted to the byte against a real
CPU step measured from the allocator (issue 30, "Also noticed"): a decoder LM
in the held loop (its output's key/value cache), SegFormer (softmax of
channels-last logits), a diffusers VAE (results no backward reads; strides of
size-1 dims at batch size 1)."""

import copy

import pytest
import torch

import autosac
from autosac.core.loop import output_tensors
from autosac.trace.costs import transient_bytes


def _gap(model, inputs, output_held=True, loss_fn=None) -> tuple[int, int]:
    stats = autosac.profile(model, inputs, target="cpu", output_held=output_held, loss_fn=loss_fn)
    real = autosac.measure(model, inputs, steps=0, output_held=output_held, loss_fn=loss_fn)
    return stats.peak_bytes, real.peak_bytes


def test_output_tensors_finds_a_cache_object():
    """An object pytree does not know (transformers' DynamicCache) is searched
    through its attributes: the held output's cache is alive in the loop."""

    class Layer:
        def __init__(self):
            self.keys, self.values = torch.zeros(3), torch.ones(4)

    class Cache:
        def __init__(self):
            self.layers = [Layer(), Layer()]
            self.offloading = False

    found = output_tensors({"logits": torch.zeros(2), "cache": Cache()})
    assert sorted(t.numel() for t in found) == [2, 3, 3, 4, 4]


def test_decoder_lm_held_loop_exact():
    """Bloom with use_cache on (its config's default): the held output keeps
    every layer's keys and values in a DynamicCache; measure counted them in
    neither its start nor its peak but saw them freed (64 KiB below)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=1000, hidden_size=64, n_layer=2, n_head=4)
    model = transformers.BloomForCausalLM(cfg)
    ids = torch.randint(0, 1000, (2, 32))
    for held in (True, False):
        predicted, measured = _gap(model, {"input_ids": ids, "labels": ids}, output_held=held)
        assert predicted == measured, f"output_held={held}: predicted {predicted} B, measured {measured} B"


def test_softmax_copies_a_non_contiguous_input():
    """The kernels work on contiguous copies: one per non-contiguous operand."""
    from autosac.core.allocations import allocation_peak

    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    y = torch.ops.aten._log_softmax(x, 1, False)
    cases = [(torch.ops.aten._log_softmax.default, (x, 1, False)),
             (torch.ops.aten._softmax.default, (x, 1, False)),
             (torch.ops.aten._log_softmax_backward_data.default, (x, x, 1, torch.float32)),
             (torch.ops.aten._log_softmax_backward_data.default, (x, y, 1, torch.float32))]
    for func, args in cases:
        peak, made = allocation_peak(lambda: func(*args))  # noqa: B023 - called here
        assert transient_bytes(func, args) == peak - made, func


@pytest.mark.parametrize("shape,dim,dtype", [((8, 4, 128, 128), -1, torch.float32), ((2, 2, 64, 48), 2, torch.float32),
                                             ((3, 5, 7), 1, torch.bfloat16)])
def test_safe_softmax_scratch_is_what_the_allocator_shows(shape, dim, dtype):
    """``_safe_softmax`` (sdpa's math path) makes a mask of the input and its
    rows inside the call: counted as the allocator shows them."""
    from autosac.core.allocations import allocation_peak

    func, x = torch.ops.aten._safe_softmax.default, torch.randn(shape).to(dtype)
    peak, made = allocation_peak(lambda: func(x, dim))
    assert transient_bytes(func, (x, dim)) == peak - made > x.numel()


def test_norms_of_autocast_activations_with_float32_parameters_exact():
    """Under CPU bf16 autocast a BatchNorm2d, GroupNorm or LayerNorm keeps its
    float32 parameters: the kernels save mean and inverse std in float32,
    which the meta kernels make bfloat16.  A new user's Segformer measured
    21 KB over a plan's budget, a Conv2d-BatchNorm2d 256 bytes: now exact."""
    from suite import A100_CPU_KERNELS

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 64, 1), torch.nn.BatchNorm2d(64), torch.nn.GroupNorm(8, 64),
                                torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Conv2d(64, 8, 1))
    x = torch.randn(4, 8, 16, 16)
    kw = dict(autocast=torch.bfloat16, optimizer="adamw")
    stats = autosac.profile(model, x, target=A100_CPU_KERNELS, **kw)
    assert stats.peak_bytes == autosac.measure(model, x, steps=0, **kw).peak_bytes
    plan = autosac.solve(stats, "least")
    measured = autosac.measure(autosac.apply(copy.deepcopy(model), plan), x, steps=0, **kw).peak_bytes
    # a plan under autocast may over-predict a little (docs/memory-model.md): never under
    assert measured <= plan.predicted_peak_bytes <= plan.budget_bytes and plan.decisions
    assert plan.predicted_peak_bytes - measured <= 0.01 * measured


def test_segformer_exact():
    """SegFormer's decode head is channels-last: the cross entropy's softmax
    copied its upsampled logits (96 KiB here) unseen."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.SegformerConfig(
        num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        decoder_hidden_size=32, num_labels=3)
    model = transformers.SegformerForSemanticSegmentation(cfg)
    inputs = {"pixel_values": torch.randn(2, 3, 64, 64), "labels": torch.randint(0, 3, (2, 64, 64))}
    predicted, measured = _gap(model, inputs)
    assert predicted == measured, f"predicted {predicted} B, measured {measured} B"


def _vae(groups: int, channels: tuple[int, int]):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=channels, layers_per_block=1,
        latent_channels=4, norm_num_groups=groups, sample_size=32)


def test_vae_unused_posterior_statistics_freed():
    """DiagonalGaussianDistribution makes std = exp(0.5 * logvar) and
    var = exp(logvar), which nothing reads: the real step frees them when the
    forward returns; the trace's saved-tensor hook held each in a cycle with
    its own ExpBackward node, alive to the end (16 KiB over here)."""
    model = _vae(4, (8, 16))
    predicted, measured = _gap(model, (torch.randn(2, 3, 32, 32),), loss_fn=lambda out: out.sample.pow(2).mean())
    assert predicted == measured, f"predicted {predicted} B, measured {measured} B"


def test_vae_batch_one_layouts_exact():
    """At batch size 1 the attention block's output is a view whose size-1 dim
    has a stride that makes it not channels-last for ATen (the group norm
    after it copies it to contiguous) but channels-last for FakeTensor: every
    layer after ran channels-last in the trace (3 % over before)."""
    model = _vae(8, (16, 32))
    predicted, measured = _gap(model, (torch.randn(1, 3, 48, 48),))
    assert predicted == measured, f"predicted {predicted} B, measured {measured} B"


@pytest.mark.parametrize("case", ["view", "div_number"])
def test_size_one_strides_as_aten_lays_them_out(case):
    """Fake results of views and pointwise ops with a size-1 dim get the real kernel's strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autosac.core.devices import resolve_target
    from autosac.trace.costs import CostModel
    from autosac.trace.recorder import StepRecorder

    def step(x):
        v = x.transpose(1, 2).view(1, 32, 12, 12)
        return v if case == "view" else v / 2.0

    real_x = torch.randn(1, 144, 32)
    expected = step(real_x).stride()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_x = mode.from_tensor(real_x)
    recorder = StepRecorder(CostModel(resolve_target("h100")))
    recorder.fake_mode = mode
    with recorder:
        got = step(fake_x).stride()
    assert got == expected
