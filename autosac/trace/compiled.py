"""The peak of a training step as ``torch.compile`` runs it, traced in fake mode.

A compiled step holds other tensors than the eager one: AOTAutograd's
partitioner picks what the forward graph saves for the backward outside the
checkpointed modules, and the backward graph frees its inputs in its own
order.  :func:`compiled_peak` runs one steady-state step of
``torch.compile(model, backend=...)`` under FakeTensorMode -- Dynamo and
AOTAutograd trace the model as they do for the user, then the compiled
forward and backward graphs run op by op under the step recorder, which
counts their tensors as it counts an eager step's.  Nothing real is
allocated, so a model on ``meta`` works.

Backends: ``"aot_eager"`` runs the partitioned graphs as traced, and its
peak matched the CPU allocator's to the byte (``tests/test_compile.py``);
``"aot_eager_decomp_partition"`` likewise with inductor's decompositions.
``"inductor"`` compiles as inductor does, then runs inductor's own wrapper
code on the fake tensors with its fused kernels skipped
(:mod:`autosac.trace.inductor`): the buffers it allocates, views and frees
are the step's memory.  Only bytes are kept: ops are priced by a roofline,
never timed.  Compiled traces are for CPU targets: a GPU's compiled code
(other kernels, other allocations) is not traced here.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autosac.devices import DEVICES
from autosac.trace.aggregate import memory_timeline, peak_breakdown
from autosac.trace.costs import CostModel
from autosac.trace.inductor import inductor_on_fake_tensors
from autosac.trace.step import trace_step

__all__ = ["CompiledPeak", "compiled_peak", "TRACED_AS"]

# the backends whose compiled step is traced (name -> what torch.compile is given)
TRACED_AS = {"aot_eager": "aot_eager", "aot_eager_decomp_partition": "aot_eager_decomp_partition",
             "inductor": "inductor"}
# bytes are all a compiled trace keeps: a roofline prices its ops instead of timing them on this CPU
_CPU_KERNELS_UNTIMED = replace(DEVICES["a100"], name="cpu-kernels", device_type="cpu")


@dataclass
class CompiledPeak:
    """Peak tensor bytes of one compiled training step (``peak_phase``:
    forward, loss, backward or optimizer; ``breakdown``: bytes alive at the
    peak by kind)."""

    peak_bytes: int
    peak_phase: str
    breakdown: dict[str, int]
    backend: str


def compiled_peak(
    model: nn.Module,
    example_inputs,
    *,
    loss_fn=None,
    optimizer="adamw",
    backend: str = "aot_eager",
    output_held: bool = True,
) -> CompiledPeak:
    """The peak of one steady-state training step of ``torch.compile(model, backend=backend)``.

    Counted as :func:`autosac.profile` counts an eager step (parameters,
    gradients, optimizer state, inputs, activations and temporaries), on the
    CPU's ops.  The model may have a plan applied (that is what this is for:
    the plan's compiled regions carry its decisions) and may live on ``meta``.

    Args:
        model: the model to compile (not already compiled).
        example_inputs: one batch, as :func:`autosac.profile` takes it: a tensor, a
            tuple of positional arguments, or a dict of keyword arguments.
        loss_fn, optimizer, output_held: as :func:`autosac.profile`.
        backend: ``"inductor"`` (``torch.compile``'s default), ``"aot_eager"`` or
            ``"aot_eager_decomp_partition"``.

    Returns:
        CompiledPeak.

    Raises:
        ValueError: another backend, a model already wrapped by ``torch.compile``, or
            (``"inductor"``) a model or inputs on a device other than cpu or meta.
        TraceError: the compiled forward, the loss or the backward raised.

    Dynamo's caches for the code this compiled are cleared afterwards (a
    model the user compiled before recompiles on its next call).

    Example::

        >>> autosac.apply(model, plan)
        >>> autosac.trace.compiled_peak(model, idx, backend="aot_eager").peak_bytes
    """
    if backend not in TRACED_AS:
        raise ValueError(f"compiled peaks are traced for backends {', '.join(TRACED_AS)}, not {backend!r}")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError("pass the model itself, not torch.compile(model): the compiled step is traced from it")
    inductor = backend == "inductor"  # its fused kernels are skipped in the trace: no values computed
    if inductor:
        devices = {t.device.type for t in (*model.parameters(), *model.buffers(), *tree_leaves(example_inputs))
                   if isinstance(t, torch.Tensor)}
        if not devices <= {"cpu", "meta"}:
            raise ValueError(f"inductor's compiled step is traced for cpu (or meta) models, not {sorted(devices)}: "
                             "a GPU's generated kernels are not reproduced")
    cost = CostModel(_CPU_KERNELS_UNTIMED)
    try:
        with _dynamo_caches_cleared(), (inductor_on_fake_tensors() if inductor else nullcontext()):
            step = trace_step(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, cost_model=cost,
                              compile_backend=TRACED_AS[backend], small_values=not inductor,
                              output_held=output_held)
    finally:
        cost.finish()
    rec = step.recording
    live, _ = memory_timeline(rec)
    at = int(np.argmax(live)) if len(live) else 0
    peak = int(live[at]) if len(live) else 0
    phase = rec.phases[at] if len(live) else "forward"
    return CompiledPeak(peak, phase, peak_breakdown(rec, at), backend)


@contextmanager
def _dynamo_caches_cleared():
    """Afterwards, drop Dynamo's cache entries on every code object that gained
    one meanwhile: they were compiled for fake tensors and would only count
    toward the recompile limit of the user's own ``torch.compile``."""
    from torch._dynamo import convert_frame, reset_code
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def entries() -> dict[int, tuple]:
        found = {}
        for ref in convert_frame.input_codes.seen:
            code = ref()
            if code is not None:
                found[id(code)] = (code, len(_debug_get_cache_entry_list(code)))
        return found

    before = entries()
    try:
        yield
    finally:
        for key, (code, n) in entries().items():
            if n > before.get(key, (None, 0))[1]:
                reset_code(code)
