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
(:mod:`autosac.compile.inductor`): the buffers it allocates, views and frees
are the step's memory.  Besides bytes, the time of the library kernels the
step runs (matmuls, attention) is kept (``CompiledPeak.kernel_ms``): a CUDA
target's roofline, or a CPU target's op timings (cached as the profile's);
inductor's fused kernels are not priced.

For a CUDA target (``target=``) the step is traced as the eager trace of that
target runs it -- CUDA autocast's casts, CUDA's attention and dropout kernels
(:mod:`autosac.trace.dispatch`), cuBLAS's workspaces -- while inductor
generates its CPU code: the buffers of a Triton kernel's fusions are not
reproduced (what a GPU's generated code allocates beyond its graphs' tensors
is measured on a GPU: ``benchmarks/gpu_compile.py``).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autosac.compile.inductor import inductor_on_fake_tensors
from autosac.core.devices import DEVICES, DeviceSpec, resolve_target
from autosac.core.host import HostCosts
from autosac.core.loop import Loop
from autosac.trace.aggregate import memory_timeline, peak_breakdown
from autosac.trace.costs import CostModel
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
    peak by kind); ``flops`` and ``kernel_ms``: the floating-point operations
    of the ops the step runs as library kernels (under inductor: matmuls,
    attention, convolutions; its fused kernels are not counted) in the
    forward, loss and backward, and their time on the target (a CPU target's
    measured op times, a CUDA target's roofline): what a plan's recomputation
    adds to them is the matmul work it re-runs."""

    peak_bytes: int
    peak_phase: str
    breakdown: dict[str, int]
    backend: str
    flops: int = 0
    kernel_ms: float = 0.0


def compiled_peak(
    model: nn.Module,
    example_inputs,
    *,
    loss_fn=None,
    optimizer="adamw",
    backend: str = "aot_eager",
    output_held: bool = True,
    target: str | DeviceSpec | None = None,
    autocast: torch.dtype | None = None,
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
        target: the device the step runs on, as :func:`autosac.profile` takes it;
            ``None`` (or a CPU target): the CPU's kernels.  A CUDA target's
            kernels and casts are traced as the module docstring says.
        autocast: the dtype the forward and loss run under ``torch.autocast`` in.

    Returns:
        CompiledPeak.

    Raises:
        ValueError: another backend, a model already wrapped by ``torch.compile``, or
            (``"inductor"``) a model or inputs on a device other than cpu or meta
            (or cuda, for a CUDA target).
        TraceError: the compiled forward, the loss or the backward raised.

    Dynamo's caches for the code this compiled are cleared afterwards (a
    model the user compiled before recompiles on its next call).

    Example::

        >>> autosac.apply(model, plan)
        >>> autosac.compile.compiled_peak(model, idx, backend="aot_eager").peak_bytes
    """
    if backend not in TRACED_AS:
        raise ValueError(f"compiled peaks are traced for backends {', '.join(TRACED_AS)}, not {backend!r}")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError("pass the model itself, not torch.compile(model): the compiled step is traced from it")
    inductor = backend == "inductor"  # its fused kernels are skipped in the trace: no values computed
    spec = _kernels_of(target)
    if inductor:
        devices = {t.device.type for t in (*model.parameters(), *model.buffers(), *tree_leaves(example_inputs))
                   if isinstance(t, torch.Tensor)}
        allowed = {"cpu", "meta", "cuda"} if spec.device_type == "cuda" else {"cpu", "meta"}
        if not devices <= allowed:
            raise ValueError(f"inductor's compiled step is traced for {' or '.join(sorted(allowed))} models, not "
                             f"{sorted(devices)}: pass the target the model trains on (target='h100', say)")
    cost = CostModel(spec)
    try:
        with _dynamo_caches_cleared(), (inductor_on_fake_tensors() if inductor else nullcontext()):
            step = trace_step(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, cost_model=cost,
                              compile_backend=TRACED_AS[backend], small_values=not inductor,
                              loop=Loop(output_held=output_held), autocast=autocast)
    finally:
        cost.finish()
    rec = step.recording
    live, _ = memory_timeline(rec)
    at = int(np.argmax(live)) if len(live) else 0
    peak = int(live[at]) if len(live) else 0
    phase = rec.phases[at] if len(live) else "forward"
    kernels = [(f, ms) for f, ms, ph in zip(rec.flops, rec.ms, rec.phases) if f > 0 and ph != "optimizer"]
    return CompiledPeak(peak, phase, peak_breakdown(rec, at), backend, int(sum(f for f, _ in kernels)),
                        float(sum(ms for _, ms in kernels)))


def _kernels_of(target) -> DeviceSpec:
    """The spec a compiled trace runs under: ``target``'s kernels, priced by a
    roofline for a CUDA target and by this CPU's op timings (cached, as the
    profile's) for a measured CPU target; without a target, the CPU's kernels
    and a roofline (only bytes are wanted)."""
    if target is None:
        return _CPU_KERNELS_UNTIMED
    spec = resolve_target(target)
    if spec.device_type != "cuda":
        return spec if spec.measured else _CPU_KERNELS_UNTIMED
    return replace(spec, measured=False, host=HostCosts())


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
