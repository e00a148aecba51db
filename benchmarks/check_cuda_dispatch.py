"""Check, outside CI, that a plan for a GPU names the ops CUDA runs: the forward
op sequence autosac records for ``target="h100"`` (CPU fake tensors, CUDA's
choices reproduced) against the one a CUDA build of torch records on fake CUDA
tensors, in fp32 and under bfloat16 autocast (CUDA's cast policy).

    # in a venv with a CUDA build of torch (no GPU needed: forward only)
    python benchmarks/check_cuda_dispatch.py record-cuda /tmp/cuda_ops.json
    # in the project's environment
    python benchmarks/check_cuda_dispatch.py compare /tmp/cuda_ops.json

Without a device, the CUDA build's SDPA falls to the math path (backend
selection reads the properties of a device that does not exist), so the
attention ops differ by design; everything else should match.
"""

from __future__ import annotations

import difflib
import json
import sys
import warnings

# (label, built-in model, config overrides, autocast): fp32 weights, so the same buffers on both sides
MODELS = (
    ("gpt-tiny", "gpt-tiny", {"dropout": 0.1}, False),
    ("llama-tiny", "llama-tiny", {}, False),
    ("gpt-tiny+autocast", "gpt-tiny", {"dropout": 0.1}, True),
    ("llama-tiny+autocast", "llama-tiny", {}, True),
)


def record_cuda(path: str) -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from autosac.models import build_model

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace not in ("prim", "profiler"):
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    out = {}
    for label, name, extra, amp in MODELS:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model, idx = build_model(name, device="cuda", batch=2, seq=64, **extra)
            rec = Record()
            # torch.autocast refuses "cuda" without a device: switch CUDA autocast on directly
            torch.set_autocast_enabled("cuda", amp)
            torch.set_autocast_dtype("cuda", torch.bfloat16)
            try:
                with rec:
                    model.train()(idx.to("cuda")).float().sum()
            finally:
                torch.set_autocast_enabled("cuda", False)
        out[label] = rec.ops
    with open(path, "w") as f:
        json.dump(out, f)


def ours() -> dict[str, list[str]]:
    import torch

    import autosac
    from autosac.models import build_model

    out = {}
    for label, name, extra, amp in MODELS:
        model, idx = build_model(name, device="meta", batch=2, seq=64, **extra)
        tl = autosac.profile(model, idx, target="h100", autocast=torch.bfloat16 if amp else None).timeline
        out[label] = [op for op, ph in zip(tl.ops, tl.phases) if ph in ("forward", "loss")]
    return out


# the math path of SDPA, as the CUDA build decomposes it without a device
_MATH_SDPA = {"_safe_softmax", "tril", "bmm", "scalar_tensor", "where", "ones"}


def _attention(cuda_ops: list[str], traced_ops: list[str]) -> bool:
    """Whether a difference is SDPA's: a fused kernel traced, or the math path on the CUDA side."""
    return any("attention" in op for op in traced_ops) or bool(_MATH_SDPA & set(cuda_ops))


def compare(path: str) -> int:
    warnings.simplefilter("ignore")
    with open(path) as f:
        cuda = json.load(f)
    status = 0
    for name, mine in ours().items():
        a = [op for op in cuda[name] if op != "detach"]
        b = [op for op in mine if op != "detach"]
        diffs = [d for d in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if d[0] != "equal"]
        sdpa = [_attention(a[d[1] : d[2]], b[d[3] : d[4]]) for d in diffs]
        # a stretch of the math path between two of its parts (its scaling, say) is SDPA's too
        sdpa = [x or (0 < i < len(sdpa) - 1 and sdpa[i - 1] and sdpa[i + 1] and diffs[i][3] == diffs[i][4])
                for i, x in enumerate(sdpa)]
        outside_sdpa = [d for d, x in zip(diffs, sdpa) if not x]
        print(f"{name}: {len(a)} ops on fake CUDA, {len(b)} traced for h100; differences: {len(diffs)}, "
              f"outside attention: {len(outside_sdpa)}")
        for tag, i1, i2, j1, j2 in diffs:
            print(f"  {tag}: cuda {a[i1:i2][:10]} / h100 trace {b[j1:j2][:10]}")
        status |= bool(outside_sdpa)
    return status


if __name__ == "__main__":
    if sys.argv[1] == "record-cuda":
        record_cuda(sys.argv[2])
    else:
        sys.exit(compare(sys.argv[2]))
