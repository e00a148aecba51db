"""Measure real training steps on this machine: peak tensor bytes and step time.

The peak comes from an independent source, never from autosac's tracer.  On
CPU: the PyTorch profiler's allocator events (every allocation and free the
allocator made during one step), added to the bytes of the tensors alive when
the step starts (parameters, buffers, optimizer state, inputs).  On CUDA:
``torch.cuda.max_memory_allocated`` over one step (tensor bytes, not the
caching allocator's reserve).
"""

from __future__ import annotations

import gc
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
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])

    # inputs that require grad get theirs anew each step, as parameters do
    # (a gradient left from the step before would be written in place, unseen)
    grad_inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]

    held = []  # the loop's `out` variable (output_held): the previous step's output until a forward returns

    def zero_grads() -> None:
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        for t in grad_inputs:
            t.grad = None

    def micro_step(first: bool) -> float:
        with amp():
            out = model(*args, **kwargs)
            if loop.output_held:
                held[:] = [out]  # the previous step's output dies here
            loss = loss_fn(out)
            del out
        if first and loop.zero_grad == "before_backward":
            zero_grads()
        loss.backward()
        value = float(loss.detach())
        del loss
        return value

    def step() -> float:
        for i in range(loop.grad_accumulation):
            value = micro_step(first=i == 0)
        if opt is not None:
            opt.step()
        if loop.zero_grad == "after_step":
            zero_grads()
        return value

    loss = step()  # creates optimizer state: later steps are steady-state
    times = []
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            loss = step()
            times.append((time.perf_counter() - t0) * 1e3)
    # batches a data loader fetched ahead: alive from before the measured step to after it
    ahead = [t.clone() for _ in range(loop.batches_ahead) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    gc.collect()  # garbage left by earlier work is not freed in the middle of the measured step
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return Measurement(torch.cuda.max_memory_allocated(device), _median(times), times, loss)

    alive = list(model.parameters()) + list(model.buffers()) + list(tree_leaves((args, kwargs)))
    if opt is not None:
        alive += [t for st in opt.state.values() for t in st.values()]
    alive += ahead
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # zero_grad="before_backward"
    if not loop.output_held and not grads:
        peak, _ = allocation_peak(step)
        return Measurement(_storage_bytes(alive) + peak, _median(times), times, loss)
    # The measured step frees the previous step's output (and gradients), which the profiler
    # reports only if they were made under the profile: one step runs first, then the measured
    # step, counted from its start; what the first leaves alive is counted as the step before
    # the profile left it (same sizes).
    base = _storage_bytes(alive + output_tensors(held) + grads)
    held.clear()
    del grads

    def two_steps():
        step()
        with torch.profiler.record_function(_MEASURED):
            pass
        return step()

    peak, _ = allocation_peak(two_steps, after=_MEASURED)
    return Measurement(base + peak, _median(times), times, loss)
