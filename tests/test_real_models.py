"""Plans on third-party models, built from configs with random weights (no
download): transformers' GPT-2, Llama and BERT (eager and SDPA attention, with
the cache on and off) and timm's ResNet (batch norm) and ViT (drop-path).

For each, at 70 %, 50 % and the least feasible budget (where reachable): one
training step bitwise equal to the unmodified model's (loss, gradients,
parameters after the update, buffers), the measured peak (the profiler's
allocator events) within the budget and within 3 % of the prediction.
"""

from __future__ import annotations

import copy

import pytest
import torch
from suite import A100_CPU_KERNELS, HF_SMALL, check_model, lm_inputs, seeded
from torch import nn

import autosac

transformers = pytest.importorskip("transformers")


def _gpt2(attn: str, cache: bool):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=128,
                                  attn_implementation=attn, use_cache=cache)
    return lambda: (transformers.GPT2LMHeadModel(cfg).train(), lm_inputs(128, 4, 128))


def _llama(attn: str, cache: bool):
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=172, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
                                   attn_implementation=attn, use_cache=cache)
    return lambda: (transformers.LlamaForCausalLM(cfg).train(), lm_inputs(128, 4, 128))


def _bert(attn: str, cache: bool):
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=256, num_attention_heads=4,
                                  vocab_size=128, max_position_embeddings=128, attn_implementation=attn)
    return lambda: (transformers.BertForMaskedLM(cfg).train(), lm_inputs(128, 4, 128))


HF = [
    (f"{name}-{attn}-{'cache' if cache else 'nocache'}", make, attn, cache)
    for name, make in (("gpt2", _gpt2), ("llama", _llama), ("bert", _bert))
    for attn in ("eager", "sdpa")
    for cache in (False, True)
    if not (name == "bert" and cache)
]


@pytest.mark.parametrize("name,make,attn,cache", HF, ids=[h[0] for h in HF])
def test_transformers_model(name, make, attn, cache):
    rows = check_model(
        name, seeded(make(attn, cache)), loss_fn=lambda out: out.loss,
        expect_warning="use_cache=True" if cache else None,
    )
    assert any(r.bitwise for r in rows)


@pytest.fixture(scope="module")
def timm():
    import importlib.util

    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed")
    from timm_import import import_timm

    return import_timm()


def test_timm_resnet_with_batch_norm(timm):
    def build():
        return timm.create_model("resnet10t", pretrained=False, num_classes=10).train(), torch.randn(16, 3, 96, 96)

    rows = check_model("timm-resnet10t", seeded(build))
    assert any(r.bitwise for r in rows)


def test_timm_vit_with_drop_path(timm):
    def build():
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=96,
                                  drop_path_rate=0.1, depth=4)
        return model.train(), torch.randn(16, 3, 96, 96)

    rows = check_model("timm-vit", seeded(build))
    assert sum(bool(r.bitwise) for r in rows) >= 2


def test_a_model_that_checkpoints_by_itself_is_refused_in_one_line():
    model, inputs = _llama("sdpa", False)()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match=r"gradient_checkpointing_disable\(\) first"):
        autosac.profile(model, inputs, loss_fn=lambda out: out.loss)
    model.gradient_checkpointing_disable()
    # a CPU-kernel target, as the model runs here (a CUDA one's 64 MiB cuBLAS workspace leaves it no 90 %)
    plan = autosac.solve(model, "90%", example_inputs=inputs, loss_fn=lambda out: out.loss, target=A100_CPU_KERNELS)
    assert plan.decisions
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match=r"gradient_checkpointing_disable\(\) first"):
        autosac.apply(model, plan)


def test_timm_mobilenet_with_inplace_activations(timm):
    """Depthwise convolutions, squeeze-excite and in-place Hardswish/ReLU."""

    def build():
        return timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=10).train(), \
            torch.randn(16, 3, 96, 96)

    rows = check_model("timm-mobilenetv3", seeded(build))
    assert any(r.bitwise for r in rows)


def test_a_generating_model_whose_forward_takes_no_use_cache_is_not_given_one():
    """autosac passes ``use_cache=False`` to a transformers model that can build a
    cache in training -- only where its forward accepts the flag (by name or
    ``**kwargs``); a forward without it raised TypeError in the trace."""
    import transformers

    class NoCacheArg(transformers.PreTrainedModel):
        config_class = transformers.PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.post_init()

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = NoCacheArg(transformers.PretrainedConfig(is_decoder=True)).train()
    plan = autosac.solve(model, "least", example_inputs=torch.randn(64, 8), target="cpu")
    ref, work = copy.deepcopy(model), autosac.apply(copy.deepcopy(model), plan)
    x = torch.randn(64, 8)
    ref(x).sum().backward()
    work(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), work.parameters()))


def test_the_trace_turns_the_cache_off_outside_a_compiled_graph(monkeypatch):
    """In a compiled step's trace the hook that turns a transformers decoder's
    cache off runs outside Dynamo's graph, as the applied model's does under a
    user's torch.compile: traced, Dynamo warned that it ignored the hook's
    functools.cache (a new user's solve(compile=...) on Falcon).  The cache
    is still off in the compiled step."""
    import warnings

    from autosac.core.integrations import caches_off

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())  # Dynamo warns once a process
    model, inputs = seeded(_gpt2("sdpa", cache=True))()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught, caches_off(model):
        warnings.simplefilter("always")
        out = torch.compile(model, backend="eager")(**inputs)
    torch._dynamo.reset()
    assert not [w for w in caught if "cache" in str(w.message) and "Dynamo" in str(w.message)], \
        [str(w.message) for w in caught]
    assert out.get("cache", out.get("past_key_values")) is None  # transformers 5 names it ``cache``


def test_without_loss_fn_a_transformers_output_trains_its_loss():
    """No ``loss_fn``: a transformers output with a ``loss`` (the batch held
    labels) is planned for that loss, as ``loss_fn=lambda o: o.loss``; before,
    the logits' sum was added to it (a step no one trains).  A ``loss_fn``
    returning None (no labels) says what is missing."""
    from autosac.core.errors import TraceError

    model, inputs = seeded(_gpt2("sdpa", cache=False))()
    given = autosac.profile(model, inputs, loss_fn=lambda out: out.loss, target=A100_CPU_KERNELS)
    default = autosac.profile(model, inputs, target=A100_CPU_KERNELS)
    assert default.peak_bytes == given.peak_bytes and len(default.timeline.ops) == len(given.timeline.ops)
    unlabelled = {"input_ids": inputs["input_ids"]}
    with pytest.raises(TraceError, match=r"loss_fn returned None: .*only when example_inputs hold labels"):
        autosac.profile(model, unlabelled, loss_fn=lambda out: out.loss, target=A100_CPU_KERNELS)
    with pytest.raises(TraceError, match=r"not a tensor of shape \(4, 128, 128\) \(reduce it"):
        autosac.profile(model, unlabelled, loss_fn=lambda out: out.logits, target=A100_CPU_KERNELS)


def test_hf_config_dtype_is_the_weights_dtype():
    pytest.importorskip("transformers")
    from autosac.models.spec import build_from_spec

    args = HF_SMALL["llama"]
    model, _ = build_from_spec("hf:llama", [*args, "dtype=bfloat16"], batch=2, seq=64)
    assert {p.dtype for p in model.parameters()} == {__import__("torch").bfloat16}
    plain, _ = build_from_spec("hf:llama", args, batch=2, seq=64)
    assert {p.dtype for p in plain.parameters()} == {__import__("torch").float32}
