"""Measure real training steps on this machine: peak tensor bytes and step time.

The peak comes from an independent source, never from autosac's tracer.  On
CPU: the PyTorch profiler's allocator events (every allocation and free the
allocator made during one step), added to the bytes of the tensors alive when
the step starts (parameters, buffers, optimizer state, inputs, and the
gradient buckets a ``DistributedDataParallel`` reports).  On CUDA:
``torch.cuda.max_memory_allocated`` over one step (tensor bytes, not the
caching allocator's reserve).
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autosac.core.allocations import allocation_peak, refuse_running_profiler
from autosac.core.inputs import split_inputs
from autosac.core.loop import Loop, output_tensors, resolve_loop
from autosac.core.optim import OptimizerSpec, default_loss, make_optimizer
from autosac.trace.autocast import check_autocast_dtype

_MEASURED = "autosac::measured_step"


@dataclass
class Measurement:
    """``peak_bytes``: most tensor bytes alive at once in one steady-state step;
    ``step_ms``: median wall time of the timed steps (``nan`` with ``steps=0``);
    ``loss``: last step's loss."""

    peak_bytes: int
    step_ms: float
    step_ms_all: list[float]
    loss: float


def _median(times: list[float]) -> float:
    return statistics.median(times) if times else float("nan")


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` on this process (a
    sharded DTensor counts its local shard)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    seen = {}
    todo = [t for t in tensors if isinstance(t, torch.Tensor)]
    while todo:
        t = todo.pop()
        if is_traceable_wrapper_subclass(t):  # a DTensor, autosac.zero3's shards: count what they hold
            inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
            todo.extend(x for x in inner if isinstance(x, torch.Tensor))
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measure(
    model: nn.Module,
    example_inputs,
    loss_fn=None,
    steps: int = 3,
    optimizer: OptimizerSpec = "adamw",
    autocast: torch.dtype | None = None,
    output_held: bool = True,
    grad_accumulation: int = 1,
    zero_grad: str = "after_step",
    batches_ahead: int = 0,
    loop: Loop | None = None,
) -> Measurement:
    """Run ``steps`` real training steps (after one warm-up that creates the
    optimizer state) and one more under the profiler for the memory peak.

    Args:
        model: a model with real weights on the local device (CPU or one CUDA device).
        example_inputs: a tensor, tuple of args, or dict of kwargs.
        loss_fn: as in :func:`autosac.profile`.
        steps: timed steps; their median is ``step_ms``.  ``0``: the peak
            only (the warm-up and the profiled step), ``step_ms`` is ``nan``.
        optimizer: as in :func:`autosac.profile`; must match the profile to compare peaks.
        autocast: run forward and loss under ``torch.autocast`` in this dtype
            on the model's device (as :func:`autosac.profile` traced them).
        output_held: run the loop :func:`autosac.profile` plans for by
            default (:mod:`autosac.core.loop`): ``out = model(x)`` held in a
            variable through backward and the optimizer step, replaced once
            the next forward returns; ``False``: ``loss_fn(model(x))``, the
            output dropped when the loss exists.  Use the plan's setting
            (``plan.output_held``).
        grad_accumulation: micro-batches per optimizer step: each step runs
            forward and backward this many times on ``example_inputs``, then
            the optimizer step; ``peak_bytes`` is the most over the whole
            step and ``step_ms`` its time.  Use the plan's setting
            (``plan.grad_accumulation``; 2 already reaches its peak).
        zero_grad: ``"after_step"`` (gradients set to ``None`` after the
            optimizer step) or ``"before_backward"`` (between the first
            micro-batch's loss and its backward, as Lightning does); the
            plan's setting (``plan.zero_grad``).
        batches_ahead: copies of ``example_inputs`` kept alive through the
            steps, as a data loader that fetches ahead holds them
            (``plan.batches_ahead``).
        loop: the four loop settings above as one :class:`autosac.Loop`
            instead of the keywords: ``plan.loop`` (``plan.loop.measuring()``
            to run at most 2 micro-batches).

    Returns:
        Measurement with ``.peak_bytes`` and ``.step_ms``.

    Raises:
        ValueError: ``steps < 0`` or ``grad_accumulation < 1``, a model on ``meta`` (nothing to run), an
            ``autocast`` other than bfloat16/float16, or a non-bool ``output_held``.
        ProfilerBusyError: a ``torch.profiler`` session is running on a CPU model (measuring would end it).

    Example::

        >>> m = autosac.measure(model, idx, steps=3)
        >>> print(m.peak_bytes / 2**20, "MiB", m.step_ms, "ms")
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    loop = resolve_loop(loop, output_held=output_held, grad_accumulation=grad_accumulation, zero_grad=zero_grad,
                        batches_ahead=batches_ahead)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("the model is on meta: measure needs real weights (build it on cpu)")
    check_autocast_dtype(autocast)
    loss_fn = loss_fn or default_loss
    args, kwargs = split_inputs(example_inputs)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    cuda = device.type == "cuda"
    if not cuda:  # the CPU's peak is read off a profiler of ours (CUDA's off the allocator's counters)
        refuse_running_profiler()
    amp = (lambda: torch.autocast(device.type, dtype=autocast)) if autocast is not None else nullcontext
    runner = _LoopRunner(model, args, kwargs, loss_fn, optimizer, loop, amp)
    loss = runner.step()  # creates optimizer state: later steps are steady-state
    times = []
    for _ in range(steps):
        ms, loss = _timed(runner.step, cuda)
        times.append(ms)
    # batches a data loader fetched ahead: alive from before the measured step to after it
    ahead = [t.clone() for _ in range(loop.batches_ahead) for t in tree_leaves((args, kwargs))
             if isinstance(t, torch.Tensor)]
    gc.collect()  # garbage left by earlier work is not freed in the middle of the measured step
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        runner.step()
        torch.cuda.synchronize(device)
        return Measurement(torch.cuda.max_memory_allocated(device), _median(times), times, loss)
    return Measurement(_cpu_peak(runner, ahead), _median(times), times, loss)


def in_rounds(variants: list, rounds: int) -> dict:
    """Run each variant's measurement once a round for ``rounds`` rounds, each
    round starting one variant further along, so that a machine whose speed
    drifts through a round favours none of them.

    Args:
        variants: ``(key, run)`` pairs; ``run()`` measures the variant once
            (a :class:`Measurement`, from :func:`measure`).
        rounds: how many rounds.

    Returns:
        key -> that variant's measurements, round by round.

    Example::

        >>> got = in_rounds([("plain", lambda: measure(m0, x)), ("planned", lambda: measure(m1, x))], 5)
        >>> [p.step_ms / u.step_ms for u, p in zip(got["plain"], got["planned"])]
    """
    out = {key: [] for key, _ in variants}
    for r in range(rounds):
        turn = r % len(variants)
        for key, run in variants[turn:] + variants[:turn]:
            out[key].append(run())
    return out


class _LoopRunner:
    """The training loop :func:`measure` runs (:mod:`autosac.core.loop`):
    each step runs ``loop.grad_accumulation`` forwards and backwards, then
    the optimizer step, with gradients set to ``None`` where ``loop.zero_grad``
    says and the model's output held in ``held`` as ``out = model(x)`` is."""

    def __init__(self, model, args, kwargs, loss_fn, optimizer, loop: Loop, amp) -> None:
        self.model, self.args, self.kwargs, self.loss_fn, self.loop, self.amp = model, args, kwargs, loss_fn, loop, amp
        self.opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
        # inputs that require grad get theirs anew each step, as parameters do
        # (a gradient left from the step before would be written in place, unseen)
        self.grad_inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        self.held: list = []  # the loop's `out` variable: the previous step's output until a forward returns

    def zero_grads(self) -> None:
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        for t in self.grad_inputs:
            t.grad = None

    def micro_step(self, first: bool) -> float:
        with self.amp():
            out = self.model(*self.args, **self.kwargs)
            if self.loop.output_held:
                self.held[:] = [out]  # the previous step's output dies here
            loss = self.loss_fn(out)
            del out
        if first and self.loop.zero_grad == "before_backward":
            self.zero_grads()
        loss.backward()
        value = float(loss.detach())
        del loss
        return value

    def step(self) -> float:
        for i in range(self.loop.grad_accumulation):
            value = self.micro_step(first=i == 0)
        if self.opt is not None:
            self.opt.step()
        if self.loop.zero_grad == "after_step":
            self.zero_grads()
        return value


def _timed(step, cuda: bool) -> tuple[float, float]:
    """Milliseconds one ``step()`` takes (CUDA events on a GPU), and its loss."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), loss
    t0 = time.perf_counter()
    loss = step()
    return (time.perf_counter() - t0) * 1e3, loss


def _cpu_peak(runner: _LoopRunner, ahead: list[torch.Tensor]) -> int:
    """The peak of one steady-state step on the CPU: the bytes alive at its
    start plus the most the profiler's allocator events add during it."""
    model, opt = runner.model, runner.opt
    alive = list(model.parameters()) + list(model.buffers()) + list(tree_leaves((runner.args, runner.kwargs)))
    if opt is not None:
        alive += [t for st in opt.state.values() for t in st.values()]
    alive += ahead
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # zero_grad="before_backward"
    buckets = _ddp_bucket_bytes(model, bool(grads))
    if not runner.loop.output_held and not grads:
        peak, _ = allocation_peak(runner.step)
        return _storage_bytes(alive) + buckets + peak
    # The measured step frees the previous step's output (and gradients), which the profiler
    # reports only if they were made under the profile: one step runs first, then the measured
    # step, counted from its start; what the first leaves alive is counted as the step before
    # the profile left it (same sizes).
    base = _storage_bytes(alive + output_tensors(runner.held) + grads)
    runner.held.clear()
    del grads

    def two_steps():
        runner.step()
        with torch.profiler.record_function(_MEASURED):
            pass
        return runner.step()

    peak, _ = allocation_peak(two_steps, after=_MEASURED)
    return base + buckets + peak


def _ddp_bucket_bytes(model: nn.Module, grads_alive: bool) -> int:
    """The gradient buckets of each ``DistributedDataParallel`` in ``model``,
    as DDP reports them (its logging data's ``bucket_sizes``): made when DDP
    was built, alive through the step, and no tensor the count above holds --
    but with ``gradient_as_bucket_view`` the gradients, when alive, are views
    of them and already count them."""
    total = 0
    for ddp in model.modules():
        if isinstance(ddp, nn.parallel.DistributedDataParallel) and not (ddp.gradient_as_bucket_view and grads_alive):
            sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
            total += sum(int(n) for n in re.findall(r"\d+", str(sizes)))
    return total
