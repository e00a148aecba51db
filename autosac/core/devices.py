"""The device table: what a training step's ops cost on a target accelerator.

A roofline needs three numbers per device: dense FLOP/s per dtype, memory
bandwidth, and how much of each a real kernel reaches (efficiency).  Figures are
vendor datasheet numbers for dense (non-sparse) math.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from autosac.core.host import HostCosts

TFLOPS = 1e12
TBPS = 1e12
GIB = 1 << 30


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator's roofline figures.

    ``flops`` maps a dtype name (``"bfloat16"``, ``"float32"``, ...) to dense
    FLOP/s; ``bandwidth`` is bytes/s; ``compute_efficiency`` and
    ``memory_efficiency`` scale the peaks to what kernels reach in practice.
    ``measured=True`` means ops are timed on the local machine instead.
    ``device_type`` is the device class whose kernels the trace records
    (``"cuda"``: dropout and attention as CUDA runs them, see
    :mod:`autosac.trace.dispatch`; ``"cpu"``: as the CPU does) and
    ``capability`` the CUDA compute capability that picks attention kernels.
    ``host``: what the host running Python spends per op and what
    checkpointing adds (:class:`autosac.core.host.HostCosts`); ``None`` measures
    the machine that profiles (:func:`autosac.tools.calibrate.calibrate`) -- state
    another host's figures when planning for it from elsewhere.
    ``workspace_bytes``: library memory a training step keeps on the device
    besides its tensors (:func:`library_workspace_bytes`; ``None``: from
    ``device_type`` and ``capability``).

    Example::

        >>> spec = DeviceSpec("my-gpu", {"bfloat16": 400e12, "float32": 50e12}, 2e12, 80 * 2**30)
        >>> spec.peak_flops(torch.bfloat16)
        400000000000000.0
    """

    name: str
    flops: dict[str, float] = field(default_factory=dict)
    bandwidth: float = 0.0
    memory_bytes: int = 0
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    measured: bool = False
    device_type: str = "cuda"
    capability: tuple[int, int] = (9, 0)
    host: HostCosts | None = None
    workspace_bytes: int | None = None

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Dense FLOP/s for ``dtype``; float32 figures stand in for unknown dtypes."""
        name = str(dtype).removeprefix("torch.")
        return self.flops.get(name) or self.flops.get("float32", 1e12)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["capability"] = list(self.capability)  # as JSON has it
        return data

    @classmethod
    def from_dict(cls, data: dict) -> DeviceSpec:
        data = dict(data)
        if "capability" in data:
            data["capability"] = tuple(data["capability"])
        if isinstance(data.get("host"), dict):
            data["host"] = HostCosts.from_dict(data["host"])
        return cls(**data)


MIB = 1 << 20
# cuBLAS's workspace as PyTorch sizes it: 32 MiB on Hopper and later, else
# 4096 KiB x 2 + 16 KiB x 8 (PyTorch's default CUBLAS_WORKSPACE_CONFIG).
_CUBLAS_WORKSPACE = {True: 32 * MIB, False: 2 * 4096 * 1024 + 8 * 16 * 1024}
# PyTorch keeps one per (thread, stream): a training step's matmuls run on two
# threads, the forward's and autograd's device thread
_CUBLAS_THREADS = 2
# cuBLASLt's own workspace, made by the first matmul with a fused bias (``addmm``)
# of each thread: PyTorch's default CUBLASLT_WORKSPACE_SIZE, 1 MiB.  Measured on
# an H100, torch 2.11: one biased ``F.linear`` left 33 MiB, an unbiased one 32
# (benchmarks/results/gpu-2026-11-27-1120/lt_workspace.txt; 64 and 65 after the backward, whose
# matmuls fuse nothing).  Counted for both threads, as a plan's checkpointed forward re-runs its
# biased matmuls on autograd's: an unplanned step, or a plan that replays none, reads 1 MiB high
# (the side a budget is safe on).  Measured on an H100 only; the same 1 MiB is assumed before Hopper.
_CUBLASLT_WORKSPACE = 1 * MIB
FUSED_BIAS_MATMULS = frozenset({"addmm", "_addmm_activation"})


def library_workspace_bytes(spec: DeviceSpec, fused_bias: bool = False) -> int:
    """Device memory a training step keeps besides its tensors: on a CUDA
    target, cuBLAS's workspaces (made by the first matmul of each thread and
    kept for the process: 64 MiB on an H100, where about 65 MiB stayed
    allocated after a first step, ../shared/gpu/2026-11-25), and, when the
    step runs a matmul with a fused bias (``fused_bias``, an ``addmm``),
    cuBLASLt's 1 MiB a thread beside them; none on a CPU.

    Example::

        >>> library_workspace_bytes(DEVICES["h100"]) // 2**20
        64
        >>> library_workspace_bytes(DEVICES["h100"], fused_bias=True) // 2**20
        66
    """
    if spec.workspace_bytes is not None:
        return spec.workspace_bytes
    if spec.device_type != "cuda":
        return 0
    lt = _CUBLASLT_WORKSPACE if fused_bias else 0
    return _CUBLAS_THREADS * (_CUBLAS_WORKSPACE[spec.capability >= (9, 0)] + lt)


def _gpu(
    name: str, bf16: float, fp32: float, tf32: float, fp8: float, bw: float, mem_gib: int, capability: tuple[int, int]
) -> DeviceSpec:
    flops = {
        "bfloat16": bf16 * TFLOPS,
        "float16": bf16 * TFLOPS,
        # PyTorch leaves TF32 matmul off by default, so float32 runs at the FP32 rate.
        "float32": fp32 * TFLOPS,
        "tf32": tf32 * TFLOPS,
        "float8_e4m3fn": fp8 * TFLOPS,
        "float8_e5m2": fp8 * TFLOPS,
    }
    return DeviceSpec(name, flops, bw * TBPS, mem_gib * GIB, capability=capability)


DEVICES: dict[str, DeviceSpec] = {
    "h100": _gpu("h100", bf16=989, fp32=67, tf32=495, fp8=1979, bw=3.35, mem_gib=80, capability=(9, 0)),
    "h200": _gpu("h200", bf16=989, fp32=67, tf32=495, fp8=1979, bw=4.8, mem_gib=141, capability=(9, 0)),
    "a100": _gpu("a100", bf16=312, fp32=19.5, tf32=156, fp8=312, bw=2.039, mem_gib=80, capability=(8, 0)),
    "l4": _gpu("l4", bf16=121, fp32=30.3, tf32=60, fp8=242.5, bw=0.3, mem_gib=24, capability=(8, 9)),
    "cpu": DeviceSpec("cpu", measured=True, device_type="cpu"),
}


def resolve_target(target: str | DeviceSpec) -> DeviceSpec:
    """Return the :class:`DeviceSpec` for a table name or pass a spec through.

    Raises:
        ValueError: ``target`` is neither a known name nor a ``DeviceSpec``.

    Example::

        >>> resolve_target("H100").name
        'h100'
    """
    if isinstance(target, DeviceSpec):
        return target
    if isinstance(target, str) and target.lower() in DEVICES:
        return DEVICES[target.lower()]
    raise ValueError(f"unknown target {target!r}: use one of {', '.join(DEVICES)} or an autosac.DeviceSpec")
