"""Shared check for the model suites: a plan applied to a model must leave one
training step bitwise unchanged (loss, gradients, parameters after the
optimizer step, buffers), keep the measured peak under the budget, and
predict the peak within 3 % of an independent measurement."""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial

import torch

import autosac
from autosac.core.budget import parse_budget
from autosac.core.devices import DEVICES
from autosac.core.host import HostCosts
from autosac.core.inputs import split_inputs
from autosac.core.optim import default_loss
from autosac.models import build_model
from autosac.solver import least_peak, solve_stats
from autosac.solver.problem import build_problem
from autosac.trace.routing import RouterCall, forced

TOLERANCE = 0.03
# An A100's roofline with the CPU's kernels: deterministic times (no host costs:
# those are measured on the machine, autosac.tools.calibrate), and a plan that names the
# ops these CPU tests run (a plan for "a100" names CUDA's).
A100_CPU_KERNELS = replace(DEVICES["a100"], name="a100-cpu-kernels", device_type="cpu", host=HostCosts())


@dataclass
class Row:
    model: str
    budget: str
    budget_bytes: int
    predicted: int | None
    measured: int | None
    bitwise: bool | None
    note: str = ""


def training_step(model, inputs, loss_fn=None, seed: int = 1234, autocast=None, optimizer_step: bool = True):
    """One step (forward, loss, backward, AdamW step); returns loss, grads, params, buffers.

    ``optimizer_step=False``: forward, loss and backward only, the gradients
    cleared after and the weights untouched (the model can be stepped again as
    it was); returns loss, grads."""
    loss_fn = loss_fn or default_loss
    args, kwargs = split_inputs(inputs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        loss = loss_fn(model(*args, **kwargs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if not optimizer_step:
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return loss.detach(), grads, params, buffers


def assert_same_step(ref, other, inputs, loss_fn=None, autocast=None, optimizer_step: bool = True) -> None:
    """One training step of ``ref`` and of ``other`` bitwise equal: loss,
    gradients, and (``optimizer_step``) parameters after an AdamW step and
    buffers.  ``optimizer_step=False``: loss and gradients of a forward and
    backward that leave both models' weights as they were."""
    a = training_step(ref, inputs, loss_fn, autocast=autocast, optimizer_step=optimizer_step)
    b = training_step(other, inputs, loss_fn, autocast=autocast, optimizer_step=optimizer_step)
    assert torch.equal(a[0], b[0]), ("loss", a[0], b[0])
    for what, x, y in zip(("grad", "param", "buffer"), a[1:], b[1:]):
        assert x.keys() == y.keys(), what
        for name in x:
            assert torch.equal(x[name], y[name]), (what, name)


def budgets(problem) -> list[tuple[str, int]]:
    least, _ = least_peak(problem)
    return [(label, parse_budget(label, problem.baseline_peak)) for label in ("70%", "50%")] + [("least", least)]


def check_model(
    name, build, loss_fn=None, target=A100_CPU_KERNELS, labels=("70%", "50%", "least"), expect_warning: str | None = None,
    optimizer="sgd", tolerance: float = TOLERANCE, autocast=None, output_held: bool = True, routing=None,
) -> list[Row]:
    """Plan ``build()``'s model at each budget; check every promise; return the table rows.

    ``build`` returns ``(model, inputs)`` with fixed weights (the same each call).
    The applied model must warn about nothing, or exactly once with a message
    containing ``expect_warning``.  ``output_held``: the loop planned and
    measured (:mod:`autosac.core.loop`).  ``routing`` (mixture-of-experts models):
    planned for, and the measured step forced to route so
    (:func:`autosac.trace.routing.forced`); the bitwise step routes as the data does.
    """
    model, inputs = build()
    stats = autosac.profile(model, inputs, loss_fn=loss_fn, target=target, optimizer=optimizer, autocast=autocast,
                            output_held=output_held, routing=routing)
    routed = nullcontext
    if routing is not None:
        calls = [RouterCall(**c) for c in stats.routing["routers"]]
        routed = partial(forced, routing, calls)
    problem = build_problem(stats)
    rows = []
    for label, budget in budgets(problem):
        if label not in labels:
            continue
        try:
            plan = solve_stats(stats, budget, problem=problem)
        except autosac.InfeasibleBudgetError as e:
            rows.append(Row(name, label, budget, None, None, None, f"infeasible (least {e.min_feasible_bytes})"))
            continue
        ref, _ = build()
        work, inputs = build()
        autosac.apply(work, plan)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert_same_step(ref, work, inputs, loss_fn, autocast)
        said = [str(w.message) for w in caught if str(w.message).startswith("autosac:")]
        assert said == ([] if expect_warning is None else [said[0]]), said
        assert expect_warning is None or expect_warning in said[0], said
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fresh, inputs = build()
            autosac.apply(fresh, plan)
            with routed():
                measured = autosac.measure(fresh, inputs, loss_fn=loss_fn, steps=0, optimizer=optimizer,
                                           autocast=autocast, output_held=output_held).peak_bytes
        rows.append(Row(name, label, plan.budget_bytes, plan.predicted_peak_bytes, measured, True,
                        f"{len(plan.decisions)} modules"))
        assert measured <= plan.budget_bytes, (name, label, measured, plan.budget_bytes)
        assert abs(plan.predicted_peak_bytes - measured) <= tolerance * measured, (
            name, label, plan.predicted_peak_bytes, measured)
    return rows


def seeded(factory, seed: int = 0):
    """A ``build`` for :func:`check_model`: the same weights and inputs each call."""

    def build():
        torch.manual_seed(seed)
        return factory()

    return build


# small configs of the hf:NAME models (``autosac plan --model hf:NAME --model-arg ...``): two layers
# of width 64, a vocabulary of 256
HF_SMALL = {
    "llama": ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=172", "num_attention_heads=4",
              "num_key_value_heads=2", "vocab_size=256"],
    "mistral": ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=172", "num_attention_heads=4",
                "num_key_value_heads=2", "vocab_size=256"],
    "qwen2": ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=172", "num_attention_heads=4",
              "num_key_value_heads=2", "vocab_size=256"],
    "gpt2": ["n_layer=2", "n_embd=64", "n_head=4", "vocab_size=256"],
    "bert": ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=256", "num_attention_heads=4",
             "vocab_size=256"],
}


def gpt(config: dict, *, device: str = "cpu", batch: int = 4, **over) -> tuple:
    """``build_model("gpt2", ...)`` with ``config`` (``over`` replacing some of
    it), after ``torch.manual_seed(0)``: the same weights each call; returns
    ``(model, idx)``."""
    torch.manual_seed(0)
    return build_model("gpt2", device=device, batch=batch, **{**config, **over})


def lm_inputs(vocab: int, batch: int, seq: int) -> dict:
    """A language model's batch for transformers: random token ids, also the labels."""
    ids = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": ids, "labels": ids}


def hf_loss(out):
    """The loss a transformers model computed from its ``labels``."""
    return out.loss


__all__ = ["A100_CPU_KERNELS", "HF_SMALL", "Row", "assert_same_step", "check_model", "gpt", "hf_loss", "lm_inputs",
           "seeded", "training_step"]


def stale_dispatch_choices() -> list[tuple[str, str, str]]:
    """The Python dispatcher's cached kernel choices (op, key, choice) that
    differ from a fresh resolution (each is re-resolved, so re-cached)."""
    stale = []
    for op in list(torch._ops.get_cached_ops()):
        for key, cached in list(op._dispatch_cache.items()):
            if isinstance(cached, torch._C.DispatchKey):
                op._uncache_dispatch(key)
                if op._get_dispatch(key) != cached:
                    stale.append((str(op), str(key), str(cached)))
    return stale


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world, *args, timeout_s: float = 120) -> None:
    """Run ``target(rank, world, port, *args)`` in ``world`` spawned processes
    (a gloo process group's ranks), bounded in time; raise if any fails.
    Benchmarks use it too."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_run_rank, args=(target, r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            raise AssertionError("a rank timed out")
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    assert not failed, f"rank(s) {failed} failed"


def _run_rank(target, rank: int, world: int, port: int, *args) -> None:
    """One rank's process: ``target``, then straight out once it returned.  A
    rank that had finished its work was seen aborting in the interpreter's own
    exit ("terminate called without an active exception": gloo's threads torn
    down by the C++ runtime's exit); a failure still exits non-zero (the
    exception propagates before this)."""
    import os
    import sys

    target(rank, world, port, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextmanager
def gloo_group(rank: int, world: int, port: int):
    """This process as ``rank`` of a gloo process group on 127.0.0.1 for the
    block (a worker of :func:`run_ranks`)."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
        # every rank done before any tears its gloo pairs down: a rank whose peer
        # left mid-teardown can abort ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()
