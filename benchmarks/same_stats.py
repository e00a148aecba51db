"""Check that a change leaves what autosac computes byte for byte the same: the
ModelStats JSON and the plan JSON of five profiles, made by two versions of
the package side by side (each in a fresh process).

A refactor (issue 34: files split, the recorder's op records) must leave both
identical; a change to the time model or the memory model shows here which
profiles it moves.  The profiles: the built-in gpt2 on ``meta`` (h100),
llama-tiny with real cpu weights under bf16 autocast (target cpu), llama-tiny
with gradient accumulation and a batch held ahead, and transformers' Llama and
GPT-2 at small configs (gpt2 at world size 4).

    python benchmarks/same_stats.py                 # HEAD against the working tree
    python benchmarks/same_stats.py 09c1ceb HEAD    # two commits

Exit status 1 when any file differs.  The cpu-target profiles read the host
timing cache (``~/.cache/autosac/cpu-timings-*.json``), which measuring runs
grow: compare versions side by side, as here, not against files saved earlier.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

CHILD = r"""
import pathlib, sys, warnings
warnings.simplefilter("ignore")
import torch
import autosac
from autosac.models import build_model
from autosac.models.hf import build_hf

out = pathlib.Path(sys.argv[1])
llama = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)
gpt2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
cases = {
    "gpt2_meta_h100": (lambda: build_model("gpt2"), {}),
    "llama_tiny_cpu_bf16": (lambda: build_model("llama-tiny", device="cpu"), {"autocast": torch.bfloat16, "target": "cpu"}),
    "llama_tiny_cpu_accum": (lambda: build_model("llama-tiny", device="cpu"), {"grad_accumulation": 2, "batches_ahead": 1}),
    "hf_llama_cpu": (lambda: build_hf("llama", llama, 2, 32, device="cpu"), {"target": "cpu"}),
    "hf_gpt2_world4": (lambda: build_hf("gpt2", gpt2, 2, 32, device="cpu"), {"world_size": 4}),
}
for name, (build, kw) in cases.items():
    torch.manual_seed(0)
    model, idx = build()
    stats = autosac.profile(model, idx, **kw)
    (out / f"{name}.stats.json").write_text(stats.to_json())
    for budget in ("60%", "80%", "least"):
        try:
            plan = autosac.solve(stats, budget)
            break
        except autosac.InfeasibleBudgetError:
            continue
    (out / f"{name}.plan.json").write_text(plan.to_json())
"""


def _tree(rev: str, into: pathlib.Path) -> pathlib.Path:
    """The package at ``rev`` (``worktree``: this checkout as it is)."""
    if rev == "worktree":
        return ROOT
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "autosac"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def _dump(tree: pathlib.Path, out: pathlib.Path) -> None:
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run([sys.executable, "-c", CHILD, str(out)], env=env, cwd=tree, check=True, timeout=600,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", nargs="?", default="HEAD")
    ap.add_argument("other", nargs="?", default="worktree")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        outs = []
        for i, rev in enumerate((args.base, args.other)):
            out = tmp / f"out{i}"
            _dump(_tree(rev, tmp / f"tree{i}"), out)
            outs.append(out)
        names = sorted(p.name for p in outs[0].iterdir())
        differ = [n for n in names if (outs[0] / n).read_bytes() != (outs[1] / n).read_bytes()]
    for n in names:
        print(f"{n:<36} {'DIFFERS' if n in differ else 'same'}")
    print(f"{args.base} vs {args.other}: {len(names) - len(differ)} of {len(names)} files byte-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
