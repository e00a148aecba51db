"""Forwards that draw from Python's or NumPy's global generator (a SpecAugment
mask from ``np.random``, a layer dropped on ``random.random()``): the trace
notes them and a checkpoint's replay draws what the forward drew.

``torch.utils.checkpoint`` restores only torch's generators: without this, a
replay of such a module computed other gradients, silently (a NumPy mask), or
raised (a branch on ``random.random()``)."""

import copy
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from suite import A100_CPU_KERNELS
from torch import nn

import autosac
from autosac.core.host import HostCosts
from autosac.solver import plan_from_decisions


class _Masked(nn.Module):
    """A block whose forward draws a mask from NumPy and a branch from ``random``."""

    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.fill = nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = self.down(torch.relu(self.up(x)))
        mask = torch.tensor(np.random.rand(*x.shape[:-1]) < 0.3)  # host data: the replay cannot recompute it
        h = torch.where(mask[..., None], self.fill.expand_as(h), h)
        if random.random() < 0.5:
            h = h * 2
        return x + torch.tanh(h)


class _Plain(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class _Net(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.masked = nn.ModuleList(_Masked(d) for _ in range(2))
        self.plain = _Plain(d)

    def forward(self, x):
        x = self.plain(x)
        for b in self.masked:
            x = b(x)
        return x.square().mean()


def _seeded_step(model, x, seed=3):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model(x).backward()
    return random.random(), float(np.random.rand())  # what the user's next draws are


def test_the_trace_notes_the_modules_that_draw_from_host_generators():
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 8, 16)
    before = random.getstate(), np.random.get_state()[2]
    stats = autosac.profile(model, x, target=A100_CPU_KERNELS)
    assert (random.getstate(), np.random.get_state()[2]) == before  # planning draws nothing the user sees
    drew = {f for f, m in stats.modules.items() if m.host_rng}
    assert drew == {"", "masked.0", "masked.1"}  # a parent re-runs what its children draw (a ModuleList never runs)
    assert autosac.ModelStats.from_json(stats.to_json()).modules["plain"].host_rng is False  # kept in a round trip


@pytest.mark.parametrize("ratios", [{"masked.0": 1.0, "masked.1": 1.0}, {"masked.0": 0.5, "masked.1": 0.5}],
                         ids=["plain", "selective"])
def test_a_replay_draws_what_its_forward_drew_and_leaves_the_users_next_draws(ratios):
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 8, 16)
    ref = copy.deepcopy(model)
    plan = plan_from_decisions(autosac.profile(model, x, target=A100_CPU_KERNELS), ratios)
    assert all(plan.details[f].host_rng for f in ratios)
    autosac.apply(model, plan)
    for seed in (3, 4):  # one seed's mask takes the random.random() branch where the other does not
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        expected, got = _seeded_step(ref, x, seed), _seeded_step(model, x, seed)
        assert got == expected
        for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name


def test_a_plan_that_does_not_say_which_modules_draw_captures_them_all_and_says_so():
    # plans of format 6 and older: every checkpointed call captures the host generators (safe, unpriced)
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 8, 16)
    ref = copy.deepcopy(model)
    plan = plan_from_decisions(autosac.profile(model, x, target=A100_CPU_KERNELS), {"masked.0": 1.0, "masked.1": 0.5})
    for d in plan.details.values():
        d.host_rng = None
    with pytest.warns(UserWarning, match="does not say which of its 2 checkpointed modules draw"):
        autosac.apply(model, plan)
    assert _seeded_step(model, x) == _seeded_step(ref, x)
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_numpy_with_another_bit_generator_is_traced_and_replayed():
    # np.random.set_bit_generator(PCG64): NumPy's state is then a dict, not MT19937's tuple
    saved = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(0))
    try:
        torch.manual_seed(0)
        model, x = _Net(), torch.randn(4, 8, 16)
        ref = copy.deepcopy(model)
        stats = autosac.profile(model, x, target=A100_CPU_KERNELS)
        assert stats.modules["masked.0"].host_rng and not stats.modules["plain"].host_rng
        autosac.apply(model, plan_from_decisions(stats, {"masked.0": 1.0}))
        assert _seeded_step(model, x) == _seeded_step(ref, x)
        for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
    finally:
        np.random.set_bit_generator(saved)


def test_a_module_that_draws_is_priced_its_generators_states():
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 8, 16)
    mechanism = {}
    for rng_us in (0.0, 1000.0):
        costs = HostCosts(op_us=10.0, checkpoint_call_us=100.0, host_rng_us=rng_us)
        stats = autosac.profile(model, x, target=replace(A100_CPU_KERNELS, host=costs))
        mechanism[rng_us] = plan_from_decisions(stats, {"masked.0": 1.0}).details["masked.0"].mechanism_ms
    assert mechanism[1000.0] - mechanism[0.0] == pytest.approx(1.0)  # one call, its generators swapped once


_DRAWS = {
    "rand": lambda h, gen: torch.rand(h.shape, generator=gen) > 0.2,  # the generator as a keyword
    "poisson": lambda h, gen: torch.poisson(torch.full_like(h, 2.0), gen),  # ... as a positional argument
}


class _OwnGenerator(nn.Module):
    """A block that scales units by draws from a ``torch.Generator`` of its own."""

    def __init__(self, d, draw):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gen = torch.Generator().manual_seed(7)
        self.draw = draw

    def forward(self, x):
        h = torch.relu(self.up(x))
        return x + self.down(h * _DRAWS[self.draw](h, self.gen))


@pytest.mark.parametrize("draw", list(_DRAWS))
@pytest.mark.parametrize("ratio", [1.0, 0.5], ids=["plain", "selective"])
def test_a_replay_draws_from_a_modules_own_generator_what_its_forward_drew(ratio, draw):
    # torch's checkpoint restores only the default generators: a plain replay drew the next values
    # (other gradients) and either replay moved the user's generator on twice
    torch.manual_seed(0)
    model, x = nn.Sequential(_OwnGenerator(16, draw), _OwnGenerator(16, draw)), torch.randn(4, 8, 16)
    ref = copy.deepcopy(model)
    stats = autosac.profile(model, x, target=A100_CPU_KERNELS)
    assert {f for f, m in stats.modules.items() if m.host_rng} == {"", "0", "1"}
    autosac.apply(model, plan_from_decisions(stats, {"0": ratio, "1": ratio}))
    for _ in range(2):
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
            m(x).square().mean().backward()
        for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
        assert all(torch.equal(a.gen.get_state(), b.gen.get_state()) for a, b in zip(ref, model, strict=True))


def test_transformers_wav2vec2_checkpointed_whole_replays_its_numpy_mask():
    # transformers' wav2vec2 family draws its SpecAugment mask with np.random in training
    # (mask_time_prob > 0): checkpointed whole, 62 of its gradients differed before the replay drew it again
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), vocab_size=16, layerdrop=0.0, mask_time_prob=0.3,
        mask_time_length=2, num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(cfg).train()
    inputs = {"input_values": torch.randn(2, 2000), "labels": torch.randint(1, 16, (2, 12))}
    ref = copy.deepcopy(model)
    stats = autosac.profile(model, inputs, target=A100_CPU_KERNELS)
    assert stats.modules["wav2vec2"].host_rng and not stats.modules["wav2vec2.encoder"].host_rng
    autosac.apply(model, plan_from_decisions(stats, {"wav2vec2": 1.0}))
    for m in (ref, model):
        np.random.seed(1)
        torch.manual_seed(1)
        m(**inputs).loss.backward()
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
