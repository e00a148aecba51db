"""Bad input to profile: clear one-line errors, and the model left as it was."""

import pytest
import torch
from torch import nn

import autosac
from autosac.models import build_model


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.ok = nn.Linear(4, 4)
        self.bad = nn.Linear(4, 4)

    def forward(self, x):
        return self.bad(self.ok(x)) + torch.ones(3)


def _weights(model):
    return {k: (type(v), v.device, v.shape) for k, v in model.state_dict().items()}


def test_forward_that_raises_names_the_module():
    class Raises(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(4, 4), Boom())

        def forward(self, x):
            return self.inner(x)

    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("kaboom")

    model = Raises()
    before = _weights(model)
    with pytest.raises(autosac.TraceError, match=r"module 'inner.1' \(Boom\) raised RuntimeError: kaboom"):
        autosac.profile(model, torch.randn(2, 4))
    assert _weights(model) == before  # parameters restored, no fake left behind
    assert all(type(p) is nn.Parameter and not p.is_meta for p in model.parameters())
    # the model still works for real afterwards
    model.inner[0](torch.randn(2, 4)).sum().backward()


def test_inputs_that_do_not_fit():
    with pytest.raises(autosac.TraceError, match="module '' .*Sequential.* raised|module '0' \\(Linear\\)"):
        autosac.profile(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 5))
    with pytest.raises(autosac.TraceError, match="example_inputs do not fit Linear.forward"):
        autosac.profile(nn.Linear(4, 4), (torch.randn(2, 4), torch.randn(2, 4)))


def test_shape_error_in_root_forward_names_root():
    with pytest.raises(autosac.TraceError, match=r"module '\(root\)' \(Broken\)"):
        autosac.profile(Broken(), torch.randn(2, 4))


def test_no_trainable_parameter():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(autosac.NothingToCheckpointError, match="no parameter that requires grad: nothing to checkpoint"):
        autosac.profile(model, torch.randn(2, 4))


def test_output_not_differentiable():
    class Argmax(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).argmax(-1)

    with pytest.raises(autosac.NothingToCheckpointError, match="not differentiable"):
        autosac.profile(Argmax(), torch.randn(2, 4), loss_fn=lambda out: out.float().sum())


def test_bad_optimizer_and_world_size():
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        autosac.profile(nn.Linear(4, 4), torch.randn(2, 4), optimizer="lion")
    with pytest.raises(ValueError, match="world_size"):
        autosac.profile(nn.Linear(4, 4), torch.randn(2, 4), world_size=0)


def test_an_op_whose_fake_kernel_refuses_what_its_real_kernel_runs_is_traced_as_the_real_one_lays_it_out():
    """Like torch's grouped matmul (its fake kernel takes only bf16): the trace
    tries the real kernel on zeros and goes on with its output's layout."""

    @torch.library.custom_op("autosac_test::doubled_rows", mutates_args=())
    def doubled_rows(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x]).t().contiguous().t()  # (2n, d), column-major

    @doubled_rows.register_fake
    def _(x):
        raise RuntimeError("Expected inputs of BF16 type")

    class UsesIt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return doubled_rows(self.lin(x).detach()).sum() + self.lin(x).sum()

    stats = autosac.profile(UsesIt(), torch.randn(4, 8), target="cpu")
    i = stats.timeline.ops.index("doubled_rows")
    assert stats.timeline.made_bytes[i] == 8 * 8 * 4  # (8, 8) float32, as the real kernel made it


def test_an_op_both_kernels_refuse_blames_the_inputs_and_names_the_op():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x)

    with pytest.raises(autosac.TraceError, match=r"module 'lin' \(Linear\) raised RuntimeError: a and b must have "
                                                 r"same reduction dim.* in aten.addmm \(its real kernel refuses them "
                                                 r"too\) -- check that example_inputs fit the model"):
        autosac.profile(Bad(), torch.randn(4, 7), target="cpu")


def test_planning_inside_a_users_profiler_is_refused_and_leaves_their_profile_whole():
    """autosac reads memory off a profiler of its own, which would end the
    user's session and empty it (a user profiling ``trainer.train()`` found
    their profile empty).  profile and measure refuse in one line instead, the
    model and the user's profile untouched; inside a schedule's wait step (no
    session recording yet) planning works."""
    torch.manual_seed(0)
    model, idx = build_model("gpt2", device="cpu", batch=2, n_layer=2, dim=64, n_head=4, seq=64, vocab=128)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.profiler.profile(profile_memory=True) as prof:
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
        with pytest.raises(autosac.ProfilerBusyError, match="another profiler session is running"):
            autosac.profile(model, idx, target="cpu")
        with pytest.raises(autosac.ProfilerBusyError, match="plan and measure before starting your profiler"):
            autosac.measure(model, idx, steps=0)
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    assert sum(e.name == "aten::mm" for e in prof.events()) == 2  # the user's session recorded on
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.profiler.profile(schedule=torch.profiler.schedule(wait=1, warmup=0, active=1)) as prof:
        autosac.profile(model, idx, target="cpu")
        prof.step()
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
        prof.step()
    assert sum(e.name == "aten::mm" for e in prof.events()) == 1


def test_inputs_that_do_not_fit_raise_one_clear_error_without_log_noise(capfd):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.raises(autosac.TraceError, match="check that example_inputs fit"):
        autosac.profile(model, torch.randn(4, 5))
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "fake_tensor" not in err
