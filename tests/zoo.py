"""A zoo of small third-party models for the planning suites.

Each builder is a zero-argument function returning ``(model, inputs, loss_fn)``:
a model with random weights built from a config (no download, no hub), in
``train()`` mode, float32, on the CPU; ``inputs`` one batch (a tensor or a dict
of keyword arguments); ``loss_fn(output) -> scalar`` (``None`` where the output
already is the scalar loss).  Sizes are small (mostly four layers of width 64,
sequences of 128, batches of 4; vocabulary 128) yet large enough that
activations, not weights, make most of the peak, so that 70 %, 50 % and the
least budget are mostly all feasible; one :func:`suite.check_model` takes 1 to
10 s on one CPU thread.

Builders draw their weights and inputs from torch's global generator: call
them through :func:`seeded` (or :func:`for_check`) for the same weights and
inputs on every call, as ``check_model`` needs::

    from zoo import ZOO, for_check
    build, loss_fn = for_check("t5")
    check_model("t5", build, loss_fn=loss_fn)

Two forms of each transformers model:

* :data:`ZOO` -- the bare transformers model, the root of what is planned
  (``loss_fn=lambda out: out.loss``);
* :data:`WRAPPED` -- the same model inside :class:`LossWrapper`, the usual user
  module whose ``forward(**batch)`` calls the transformers model and returns
  ``outputs.loss``; ``loss_fn`` is ``None`` (the output is the scalar loss).

Decoders keep their config's ``use_cache=True`` (the default of the configs,
and the realistic case: a training forward then builds a cache nothing
reads).  Attention: ``sdpa`` where transformers offers it, except Gemma 2
(``eager``: its logit soft-capping is an eager-only path) and Mamba (no
attention).  timm models are built through ``timm_import.import_timm()``;
the diffusers UNet only when diffusers is installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from suite import hf_loss
from torch import nn
from torch.nn import functional as F

Builder = Callable[[], tuple]

VOCAB = 128
BATCH = 4
SEQ = 128
LAYERS = 4


def _ids(batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


def _lm(model: nn.Module, batch: int = BATCH, seq: int = SEQ) -> tuple:
    ids = _ids(batch, seq)
    return model.train(), {"input_ids": ids, "labels": ids}, hf_loss


# ---------------------------------------------------------------- transformers


def _transformers():
    import transformers

    return transformers


def build_t5():
    """T5 encoder-decoder: relative position buckets, a decoder with a cache (``sdpa``)."""
    tf = _transformers()
    # two layers each: with four, each budget's CBC solve took ~20 s (an encoder-decoder is no chain: no DP)
    cfg = tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=16, relative_attention_max_distance=32,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=True,
                      attn_implementation="sdpa")
    model = tf.T5ForConditionalGeneration(cfg)
    return model.train(), {"input_ids": _ids(), "labels": _ids(seq=SEQ // 2)}, hf_loss


def build_whisper():
    """Whisper: a convolutional audio encoder over log-mel features, a decoder with a cache (``sdpa``)."""
    tf = _transformers()
    cfg = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=LAYERS,
                           decoder_layers=LAYERS, encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=64, max_target_positions=64,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                           suppress_tokens=None, begin_suppress_tokens=None, use_cache=True,
                           attn_implementation="sdpa")
    model = tf.WhisperForConditionalGeneration(cfg)
    # the encoder takes exactly 2 * max_source_positions frames
    features = torch.randn(BATCH, cfg.num_mel_bins, 2 * cfg.max_source_positions)
    labels = _ids(seq=64)
    return model.train(), {"input_features": features, "labels": labels}, hf_loss


def build_gemma2():
    """Gemma 2: sliding-window and global layers alternating, logit soft-capping (``eager``)."""
    tf = _transformers()
    cfg = tf.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ,
                          sliding_window=32, use_cache=True, attn_implementation="eager")
    return _lm(tf.Gemma2ForCausalLM(cfg))


def build_falcon():
    """Falcon with multi-query attention (one key/value head, expanded to the query's heads):
    on the CPU its ``sdpa`` runs the math path, whose ``_safe_softmax`` works in scratch
    (not in :data:`TRANSFORMERS`: one test, at its least budget, is what it is here for)."""
    tf = _transformers()
    cfg = tf.FalconConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                          new_decoder_architecture=False, multi_query=True, hidden_dropout=0.0,
                          attention_dropout=0.0, use_cache=False, attn_implementation="sdpa")
    return _lm(tf.FalconForCausalLM(cfg), batch=8)


def build_gpt_neox():
    """GPT-NeoX: parallel attention and MLP, partial rotary embeddings (``sdpa``)."""
    tf = _transformers()
    cfg = tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=LAYERS,
                           num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=SEQ, use_cache=True,
                           attn_implementation="sdpa")
    return _lm(tf.GPTNeoXForCausalLM(cfg))


def build_deberta_v2():
    """DeBERTa-v2 (masked LM): disentangled relative attention, an encoder (no cache; eager attention,
    the only one it has)."""
    tf = _transformers()
    cfg = tf.DebertaV2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                             num_attention_heads=4, max_position_embeddings=SEQ, relative_attention=True,
                             position_buckets=32, max_relative_positions=-1, pos_att_type=["p2c", "c2p"],
                             norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False)
    return _lm(tf.DebertaV2ForMaskedLM(cfg))


def build_mamba():
    """Mamba: a selective state-space model, the slow pure-torch scan (no mamba_ssm kernels on the CPU).
    Its config says ``use_cache=True``, but in training its forward builds a cache only when the
    caller passes ``use_cache=True`` (no attention, so no attention implementation)."""
    tf = _transformers()
    cfg = tf.MambaConfig(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=LAYERS, expand=2,
                         conv_kernel=4, time_step_rank=8, use_cache=True, use_mambapy=False)
    # the slow scan runs ~10 ops per position and layer: a short sequence, a larger batch
    return _lm(tf.MambaForCausalLM(cfg), batch=16, seq=32)


def build_clip():
    """CLIP: a text and a vision transformer and a contrastive loss (``return_loss=True``; ``sdpa``)."""
    tf = _transformers()
    text = dict(vocab_size=VOCAB, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1, pad_token_id=0, hidden_size=64,
                intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=32,
                projection_dim=32)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                  image_size=64, patch_size=8, num_channels=3, projection_dim=32)
    cfg = tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=32, attn_implementation="sdpa")
    model = tf.CLIPModel(cfg)
    batch = 8
    inputs = {"input_ids": _ids(batch, 32), "pixel_values": torch.randn(batch, 3, 64, 64), "return_loss": True}
    return model.train(), inputs, hf_loss


def build_gpt2():
    """GPT-2 (``sdpa``, the cache on)."""
    tf = _transformers()
    cfg = tf.GPT2Config(vocab_size=VOCAB, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, n_layer=LAYERS, n_embd=64,
                        n_head=4, n_positions=SEQ, use_cache=True, attn_implementation="sdpa")
    return _lm(tf.GPT2LMHeadModel(cfg))


# ------------------------------------------------------------------------ timm


def _timm():
    from timm_import import import_timm

    return import_timm()


def _classify(model: nn.Module, batch: int, size: int) -> tuple:
    """A classifier's batch of images and its cross-entropy against fixed labels."""
    images = torch.randn(batch, 3, size, size)
    labels = torch.randint(0, 10, (batch,))
    return model.train(), images, lambda out: F.cross_entropy(out, labels)


def build_convnext():
    """timm ConvNeXt-atto's layout, narrower (depthwise 7x7 convolutions, LayerNorm2d, layer scale), 64x64 images."""
    model = _timm().create_model("convnext_atto", pretrained=False, num_classes=10, depths=(2, 2, 4, 2),
                                 dims=(16, 32, 64, 128))
    return _classify(model, 16, 64)


def build_swin():
    """timm Swin: shifted windows with relative position bias and patch merging (64x64 images,
    4x4 windows, a narrower Swin-T with two blocks a stage)."""
    model = _timm().create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=10, img_size=64,
                                 window_size=4, embed_dim=32, depths=(2, 2, 2, 2), num_heads=(1, 2, 4, 8))
    return _classify(model, 16, 64)


def build_efficientnet():
    """timm EfficientNet-B0 (depthwise convolutions, squeeze-excite, SiLU, batch norm, drop path), 96x96 images."""
    model = _timm().create_model("efficientnet_b0", pretrained=False, num_classes=10, drop_path_rate=0.1)
    return _classify(model, 8, 96)


# ------------------------------------------------------------------- diffusers


def build_unet():
    """diffusers UNet2DConditionModel: ResNet blocks with GroupNorm, cross-attention to a text
    embedding, down/up sampling and skips; MSE of the predicted noise against a fixed target."""
    from diffusers import UNet2DConditionModel

    model = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        norm_num_groups=8, cross_attention_dim=32, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )
    batch = 4
    inputs = {"sample": torch.randn(batch, 4, 32, 32), "timestep": torch.randint(0, 1000, (batch,)),
              "encoder_hidden_states": torch.randn(batch, 8, 32)}
    target = torch.randn(batch, 4, 32, 32)
    return model.train(), inputs, lambda out: F.mse_loss(out.sample, target)


# --------------------------------------------------------------------- wrapped


class LossWrapper(nn.Module):
    """The usual user module around a transformers model: ``forward(**batch)``
    calls it and returns the scalar loss."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **batch):
        outputs = self.model(**batch)
        return outputs.loss


def wrapped(builder: Builder) -> Builder:
    """``builder``'s transformers model inside :class:`LossWrapper` (``loss_fn`` None)."""

    def build():
        model, inputs, _ = builder()
        return LossWrapper(model).train(), inputs, None

    build.__name__ = f"wrapped_{builder.__name__}"
    build.__doc__ = f"{builder.__name__} inside LossWrapper."
    return build


TRANSFORMERS = {
    "t5": build_t5,
    "whisper": build_whisper,
    "gemma2": build_gemma2,
    "gpt-neox": build_gpt_neox,
    "deberta-v2": build_deberta_v2,
    "mamba": build_mamba,
    "clip": build_clip,
    "gpt2": build_gpt2,
}
TIMM = {
    "timm-convnext": build_convnext,
    "timm-swin": build_swin,
    "timm-efficientnet": build_efficientnet,
}
DIFFUSERS = {"diffusers-unet": build_unet} if importlib.util.find_spec("diffusers") is not None else {}

#: name -> builder, every model in its bare form
ZOO: dict[str, Builder] = {**TRANSFORMERS, **TIMM, **DIFFUSERS}
#: name -> builder, the transformers models inside :class:`LossWrapper`
WRAPPED: dict[str, Builder] = {f"wrapped-{name}": wrapped(b) for name, b in TRANSFORMERS.items()}


def seeded(builder: Builder, seed: int = 0) -> Builder:
    """``builder`` with torch's generator seeded first: the same weights and inputs each call."""

    def build():
        torch.manual_seed(seed)
        return builder()

    return build


def for_check(name: str, seed: int = 0) -> tuple[Callable[[], tuple], Callable | None]:
    """``(build, loss_fn)`` for :func:`suite.check_model`: ``build()`` returns ``(model, inputs)``
    with the same weights each call; ``loss_fn`` is the builder's (for the UNet its target is
    drawn from the same seed, so one call's ``loss_fn`` serves every build)."""
    builder = {**ZOO, **WRAPPED}[name]
    build = seeded(builder, seed)
    loss_fn = build()[2]
    return (lambda: build()[:2]), loss_fn


__all__ = ["DIFFUSERS", "TIMM", "TRANSFORMERS", "WRAPPED", "ZOO", "LossWrapper", "for_check", "seeded", "wrapped"]
