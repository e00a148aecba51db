"""Plans on ordinary PyTorch modules that once broke checkpointing: batch norm
statistics and user counters updated once per step, lazily cached attributes,
keyword-only inputs (named like checkpoint's own arguments), attention whose
code branches on ``query is key``, RNNs, double backward, and torch.compile."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from suite import A100_CPU_KERNELS, assert_same_step, check_model, gpt, seeded
from torch import nn

import autosac


class BNStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[
            nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(4)
        ])

    def forward(self, x):
        return self.blocks(x)


class Counting(nn.Module):
    """Counts its calls in a Python int and in a buffer it adds to in place."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
        self.calls = 0
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        self.seen.add_(1)
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Lazy(nn.Module):
    """Builds an attribute on its first call."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        if not hasattr(self, "scale"):
            self.scale = torch.full((256,), 0.5)
        return x + self.fc2(torch.tanh(self.fc1(x)) * self.scale)


class KeywordBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x, *, mask=None, context_fn=None, debug=False):
        h = torch.tanh(self.fc1(x))
        if mask is not None:
            h = h * mask
        return x + self.fc2(h)


class KeywordNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(KeywordBlock() for _ in range(4))

    def forward(self, x, *, mask):
        for block in self.blocks:
            x = block(x, mask=mask, context_fn="the block's own", debug=True)
        return x


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.MultiheadAttention(64, 4, batch_first=True) for _ in range(3))

    def forward(self, x):
        for attn in self.layers:
            x = x + attn(x, x, x, need_weights=False)[0]
        return x


class ReadThenWrite(nn.Module):
    """Reads a buffer, then adds to it in place: the replay must read the value
    the forward read, not the one the forward left."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)
        self.register_buffer("step", torch.ones(()))

    def forward(self, x):
        h = torch.tanh(self.fc1(x) + self.step)
        self.step.add_(1)
        h = h + self.step
        self.step.add_(1)
        return x + self.fc2(torch.tanh(h))


class InplaceSiLU(nn.Module):
    """An in-place SiLU (as EfficientNet and MobileNet use): autograd copies its
    input, which the replay must read before the SiLU writes it."""

    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(64, 256), nn.SiLU(inplace=True), nn.Linear(256, 64)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class LSTMBlock(nn.Module):
    """oneDNN's LSTM kernels on the cpu: the backward's working memory is probed."""

    def __init__(self):
        super().__init__()
        self.rnn, self.proj = nn.LSTM(64, 64, batch_first=True), nn.Linear(64, 64)

    def forward(self, x):
        return x + self.proj(torch.tanh(self.rnn(x)[0]))


def _stack(n, block):
    return nn.Sequential(*[block() for _ in range(n)])


CASES = {
    "batchnorm": (lambda: (BNStack(), torch.randn(512, 64)), 0.03),
    "counters": (lambda: (_stack(4, Counting), torch.randn(512, 64)), 0.03),
    "lazy-attribute": (lambda: (_stack(4, Lazy), torch.randn(512, 64)), 0.03),
    "read-then-write-buffer": (lambda: (_stack(4, ReadThenWrite), torch.randn(512, 64)), 0.03),
    "inplace-silu": (lambda: (_stack(4, InplaceSiLU), torch.randn(512, 64)), 0.03),
    "keyword-inputs": (lambda: (KeywordNet(), {"x": torch.randn(512, 64), "mask": torch.rand(512, 256)}), 0.03),
    "lstm": (lambda: (_stack(3, LSTMBlock), torch.randn(16, 64, 64)), 0.03),
    # the engine sums the gradients of MHA's packed projection in place
    "multihead-attention": (lambda: (SelfAttention(), torch.randn(8, 64, 64, requires_grad=True)), 0.03),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ordinary_module(name):
    build, tolerance = CASES[name]
    rows = check_model(name, seeded(build), tolerance=tolerance)
    assert any(r.bitwise for r in rows)


def test_counters_and_batch_norm_stats_advance_once_per_step():
    """Not only equal to the unmodified model: exactly one update per step."""
    torch.manual_seed(0)
    model = nn.Sequential(_stack(3, Counting), nn.Linear(64, 64), nn.BatchNorm1d(64))
    x = torch.randn(2048, 64)
    plan = autosac.solve(model, "80%", example_inputs=x, target=A100_CPU_KERNELS)
    assert plan.decisions
    autosac.apply(model, plan)
    for _ in range(2):
        model(x).sum().backward()
    assert [m.calls for m in model[0]] == [2, 2, 2]
    assert [int(m.seen) for m in model[0]] == [2, 2, 2]
    assert int(model[2].num_batches_tracked) == 2


def test_profile_leaves_lazily_built_attributes_alone():
    model = _stack(2, Lazy)
    autosac.profile(model, torch.randn(8, 64))
    assert not any(hasattr(m, "scale") for m in model)
    model(torch.randn(8, 64))  # the real first call builds real tensors
    assert all(type(m.scale) is torch.Tensor for m in model)


def test_rnn_profiles_and_keeps_gradients():
    """oneDNN's RNN kernels: no crash timing them for ``target="cpu"``, exact
    gradients, and the peak predicted to the byte (their backward's working
    memory is probed)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(32, 64, num_layers=2, batch_first=True)
            self.head = nn.Linear(64, 8)

        def forward(self, x):
            return self.head(self.rnn(x)[0])

    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 32, 32)
    stats = autosac.profile(model, x, target="cpu", optimizer="none")
    assert stats.peak_bytes == autosac.measure(copy.deepcopy(model), x, optimizer="none", steps=0).peak_bytes
    from autosac.solver import plan_from_decisions

    plan = plan_from_decisions(stats, {"rnn": 1.0})  # the RNN itself checkpointed
    ref = copy.deepcopy(model)
    autosac.apply(model, plan)
    assert_same_step(ref, model, x)


GPT = dict(n_layer=2, dim=64, n_head=4, seq=64, vocab=256, dropout=0.0)


def test_retain_graph_twice_and_gradient_penalty_work_like_plain_autograd():
    model, idx = gpt(GPT, batch=2)
    plan = autosac.solve(model, "92%", example_inputs=idx, target=A100_CPU_KERNELS)
    assert plan.decisions
    ref = copy.deepcopy(model)
    autosac.apply(model, plan)

    def twice(m):
        loss = m(idx).float().pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    def penalty(m):
        loss = m(idx).float().pow(2).mean()
        grads = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        (loss + sum(g.pow(2).sum() for g in grads)).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    for run in (twice, penalty):
        a, b = run(ref), run(model)
        assert all(torch.equal(a[k], b[k]) for k in a), run.__name__
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)


def test_torch_compile_of_an_applied_model_keeps_its_gradients():
    model, idx = gpt(GPT, batch=2)
    plan = autosac.solve(model, "92%", example_inputs=idx, target=A100_CPU_KERNELS)
    ref = copy.deepcopy(model)
    autosac.apply(model, plan)
    compiled = torch.compile(model, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(idx).float().sum().backward()
    ref(idx).float().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), name


class SharedBlock(nn.Module):
    """ALBERT-style weight sharing: one block applied four times holds most activations."""

    def __init__(self, width=64, repeats=4):
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.block = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.repeats = repeats
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        h = self.embed(x)
        for _ in range(self.repeats):
            h = h + self.block(h)
        return self.head(h)


def test_a_module_called_four_times_is_checkpointed_at_every_call():
    """Each call of a shared module is a checkpoint region: the least feasible
    budget is no higher than checkpointing every call reaches (measured), far
    below what the root alone could reach, and the plan keeps every promise."""
    from autosac.solver import least_peak, plan_from_decisions
    from autosac.solver.problem import build_problem

    torch.manual_seed(0)
    model, x = SharedBlock(), torch.randn(1024, 16)
    stats = autosac.profile(model, x, target=A100_CPU_KERNELS, optimizer="sgd")
    problem = build_problem(stats)
    assert [c.call for c in problem.candidates if c.fqn == "block"] == [0, 1, 2, 3]
    least, _ = least_peak(problem)
    every_call = plan_from_decisions(stats, {"block": 1.0})
    measured_every_call = autosac.measure(
        autosac.apply(copy.deepcopy(model), every_call), x, steps=1, optimizer="sgd"
    ).peak_bytes
    # the least budget is what checkpointing every call reaches: predicted
    # exactly that, and measured within 0.01 % of it (the model is cautious)
    assert least <= every_call.predicted_peak_bytes
    assert abs(least - measured_every_call) <= 1e-4 * least and measured_every_call <= least
    root_only = plan_from_decisions(stats, {"": 1.0}).predicted_peak_bytes
    assert least < 0.6 * root_only
    rows = check_model("shared-block", seeded(lambda: (SharedBlock(), torch.randn(1024, 16))))
    assert sum(bool(r.bitwise) for r in rows) >= 2


class Tick(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x


class ManyTicks(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.ticks = nn.ModuleList(Tick() for _ in range(n))
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        for tick in self.ticks:
            x = tick(x)
        return x + self.fc2(torch.tanh(torch.tanh(self.fc1(x))))


def test_python_state_of_hundreds_of_modules_is_restored():
    """Every module's state is captured, however many: profiling changes none,
    and a replay does not count any call twice."""
    from autosac.solver import least_peak
    from autosac.solver.problem import build_problem

    torch.manual_seed(0)
    model, x = nn.Sequential(ManyTicks(1200), ManyTicks(1200)), torch.randn(1024, 64)
    stats = autosac.profile(model, x, target=A100_CPU_KERNELS)
    assert {t.calls for t in model.modules() if isinstance(t, Tick)} == {0}
    plan = autosac.solve(stats, least_peak(build_problem(stats))[0])
    assert plan.decisions
    autosac.apply(model, plan)
    model(x).sum().backward()
    assert {t.calls for t in model.modules() if isinstance(t, Tick)} == {1}


def test_profile_never_writes_the_models_real_tensors():
    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)
            self.table = torch.zeros(8)  # a plain tensor attribute, not a buffer
            self.history = [torch.zeros(4)]

        def forward(self, x):
            self.table.add_(1)
            self.history[0].add_(1)
            return self.fc(x)

    model = Writes()
    autosac.profile(model, torch.randn(16, 64))
    assert torch.equal(model.table, torch.zeros(8)) and torch.equal(model.history[0], torch.zeros(4))


def _mlp():
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


class _Outer(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.f = inner, _mlp()

    def forward(self, x):
        return x + self.f(self.inner(x))


class NestedShared(nn.Module):
    """``a(b(a(x)))`` with ``a.inner`` also used by ``b``."""

    def __init__(self):
        super().__init__()
        inner = _mlp()
        self.a, self.b = _Outer(inner), _Outer(inner)

    def forward(self, x):
        return self.a(self.b(self.a(x)))


def test_a_shared_module_called_inside_another_module_never_nests_checkpoints():
    """The call of the shared module inside ``b`` belongs to ``b``: a plan never
    checkpoints both (that once measured 30 % over the budget)."""
    rows = check_model("nested-shared", seeded(lambda: (NestedShared(), torch.randn(2048, 64))))
    assert sum(bool(r.bitwise) for r in rows) >= 2


class AutocastBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.tanh(self.fc1(x))
            return x + self.fc2(torch.nn.functional.gelu(h)).float()


def test_bf16_autocast_peaks_count_half_precision_matmul_scratch_and_remade_casts():
    """bf16 matmuls on the cpu work in scratch the dispatcher never sees, and a
    weight cast that is not saved is made again by the backward that uses it:
    both counted, so the unplanned and the planned peak are exact."""
    from autosac.solver import plan_from_decisions

    torch.manual_seed(0)
    model, x = AutocastBlock(), torch.randn(4096, 64)
    stats = autosac.profile(model, x, target=A100_CPU_KERNELS)
    assert abs(stats.peak_bytes - autosac.measure(copy.deepcopy(model), x, steps=0).peak_bytes) <= 64
    plan = plan_from_decisions(stats, {"fc1": 1.0})
    measured = autosac.measure(autosac.apply(copy.deepcopy(model), plan), x, steps=0).peak_bytes
    assert plan.predicted_peak_bytes - 1024 <= measured <= plan.predicted_peak_bytes
