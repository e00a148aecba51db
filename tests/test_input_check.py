"""The applied model checks its inputs' shapes on every training forward (a
plan holds for the shapes it was traced with): once per new signature, cheaply
for the shapes a loop runs again; and its parameters: a dtype or a
requires_grad the plan was not made for is said once."""

import collections
import copy
import warnings

import pytest
import torch
from torch import nn

import autosac
from autosac.core.inputs import input_signature, quick_shapes

_T = collections.namedtuple("_T", "x")


def _sig_pairs():
    a, b, c = torch.zeros(2, 3), torch.zeros(4, 5), torch.zeros(2, 3, dtype=torch.float64)
    return [
        (((a,), {}), ((a.clone(),), {}), True),
        (((a,), {}), ((c,), {}), False),  # dtype
        (((), {"p": a, "q": b}), ((), {"p": b, "q": a}), False),  # shapes swapped under the same names
        (((), {"p": a, "q": b}), ((), {"q": a, "p": b}), False),  # names swapped with the same shape order
        (((a, b), {}), (([a], b), {}), False),  # nesting
        (((a, 3, None), {"m": [b, b]}), ((a, 7, None), {"m": [b, b]}), True),  # scalars are not shapes
    ]


@pytest.mark.parametrize("first,second,same", _sig_pairs())
def test_quick_shapes_agree_with_the_full_signature(first, second, same):
    q1, q2 = quick_shapes(*first), quick_shapes(*second)
    assert (q1 == q2) is same
    assert (input_signature(*first) == input_signature(*second)) is same


def test_quick_shapes_leaves_other_containers_to_the_full_signature():
    assert quick_shapes((_T(torch.zeros(2)),), {}) is None


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x, y):
        return self.b(torch.relu(self.a(x))) + y


def test_a_new_signature_warns_once_and_the_traced_one_never():
    torch.manual_seed(0)
    model = _Two()
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    plan = autosac.solve(model, "least", example_inputs=(x, y), target="cpu")
    autosac.apply(model, plan)
    other = (torch.randn(4, 8), torch.randn(4, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for args in [(x, y), (x, y), other, other, (x, y), other]:
            model(*args).sum().backward()
    said = [str(w.message) for w in caught if "made for inputs" in str(w.message)]
    assert len(said) == 1 and "args[0] (4, 8) float32" in said[0]


def test_a_model_in_eval_mode_is_planned_with_a_warning_that_says_so():
    """transformers' ``from_pretrained`` returns a model in eval mode; planned
    so and then trained, a new user's BERT ran 53 % over its budget (dropout
    on) with only a generic warning at the first step.  The plan is made as
    the model runs, and the profile says to call ``model.train()``."""
    from autosac.models import build_model

    model, idx = build_model("gpt-tiny", device="meta", batch=2, dropout=0.1)
    for training in (False, True):
        model.train(training)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = autosac.profile(model, idx, target="cpu")
        said = [str(w.message) for w in caught if "eval mode" in str(w.message)]
        assert said == ([] if training else [
            "autosac: GPT is in eval mode, and its step is traced as it runs now (no dropout, batch norm reading its "
            "running statistics): the plan holds for eval-mode steps only -- call model.train() before planning a "
            "training step"]), said
        assert [w.filename for w in caught if "eval mode" in str(w.message)] == ([] if training else [__file__])
        assert any(op.random for op in stats.saved_ops) == training  # dropout traced in train mode only


def _said(run, text):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if text in str(w.message)]


def test_validation_forwards_do_not_use_up_the_shape_warning():
    """A no_grad or inference_mode forward checkpoints nothing: it warned about
    its shapes, and used up the one warning a training step at those shapes
    then needed (a new-user trial)."""
    torch.manual_seed(0)
    model = _Two()
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    autosac.apply(model, autosac.solve(model, "least", example_inputs=(x, y), target="cpu"))
    other = (torch.randn(4, 8), torch.randn(4, 8))

    def validate():
        with torch.no_grad():
            model(*other)
        with torch.inference_mode():
            model(*other)

    assert _said(validate, "made for inputs") == []
    assert len(_said(lambda: model(*other).sum().backward(), "made for inputs")) == 1


def _frozen_plan():
    torch.manual_seed(0)
    model = _Two()
    model.a.requires_grad_(False)
    x, y = torch.randn(64, 8), torch.randn(64, 8)
    plan = autosac.solve(model, "least", example_inputs=(x, y), target="cpu", optimizer="adamw")
    assert plan.frozen == ["a.bias", "a.weight"]
    return model, (x, y), plan


def test_unfreezing_what_the_plan_traced_frozen_is_said_once_and_is_over_the_budget():
    """Planned with a frozen part, then unfrozen (after some epochs): the
    gradients and optimizer state of that part are beyond the budget (1.5-2.2x
    in a new-user trial), and nothing said so.  Said once, at the first
    training forward after; the measured peak shows why."""
    model, inputs, plan = _frozen_plan()
    autosac.apply(model, plan)
    assert _said(lambda: model(*inputs).sum().backward(), "require gradients") == []
    before = autosac.measure(model, inputs, optimizer="adamw", steps=1).peak_bytes
    model.a.requires_grad_(True)
    said = _said(lambda: [model(*inputs).sum().backward() for _ in range(2)], "require gradients")
    assert len(said) == 1 and "2 parameters" in said[0] and "'a." in said[0], said
    after = autosac.measure(model, inputs, optimizer="adamw", steps=1).peak_bytes
    assert before <= plan.budget_bytes < after


def test_a_copy_watches_its_own_parameters():
    model, inputs, plan = _frozen_plan()
    autosac.apply(model, plan)
    model(*inputs).sum().backward()
    twin = copy.deepcopy(model)
    twin.a.requires_grad_(True)
    assert _said(lambda: model(*inputs).sum().backward(), "require gradients") == []
    assert len(_said(lambda: twin(*inputs).sum().backward(), "require gradients")) == 1


def test_a_dtype_change_after_apply_is_said_once():
    """``model.to(torch.float64)`` after apply doubles every byte the plan
    counted (1.7-2x the budget in a new-user trial), silently."""
    torch.manual_seed(0)
    model = _Two()
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    autosac.apply(model, autosac.solve(model, "least", example_inputs=(x, y), target="cpu"))
    model.to(torch.float64)
    with torch.no_grad():
        assert _said(lambda: model(x.double(), y.double()), "changed since the plan") == []
    said = _said(lambda: [model(x.double(), y.double()).sum().backward() for _ in range(2)], "changed since the plan")
    assert len(said) == 1 and "float64" in said[0], said


def test_the_watch_compares_no_tensors_and_a_toggling_loop_pays_no_fingerprint(monkeypatch):
    """Review found ``None in params`` calling ``Tensor.__eq__`` per parameter
    each forward (seen by the user's TorchFunctionModes too), and a loop that
    toggles ``requires_grad`` each step (GAN alternation, Lightning's
    ``toggle_optimizer``) paying a fingerprint of the model each forward."""
    from torch.overrides import TorchFunctionMode

    from autosac.applier import param_watch

    model, inputs, plan = _frozen_plan()
    model.a.requires_grad_(True)  # trained in this loop's other half: said once, not checked again
    autosac.apply(model, plan)
    fingerprints = []
    real = param_watch.model_fingerprint
    monkeypatch.setattr(param_watch, "model_fingerprint", lambda m: fingerprints.append(1) or real(m))
    seen = []

    class Calls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(6):
            model.b.requires_grad_(step % 2 == 0)
            model(*inputs).sum().backward()
        watch = model.__dict__[autosac.applier.model.APPLIED]["params"]
        with Calls():
            watch.check(model)
    assert len(fingerprints) == 1 and "__eq__" not in seen, seen
