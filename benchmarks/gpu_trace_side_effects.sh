#!/usr/bin/env bash
# Runs gpu_trace_side_effects.py in a fresh process per mode and compares each mode's gradients with ref's.
#   bash benchmarks/gpu_trace_side_effects.sh OUTDIR [--full] [--no-eager]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
D=${1:-/tmp/side_effects}; mkdir -p "$D"; shift || true
for mode in ref profile compiled; do
  timeout 200 python3 benchmarks/gpu_trace_side_effects.py $mode "$D/$mode.pt" "$@" 2>&1 | grep -v Warning | tail -3
done
python3 - "$D" <<'PY'
import sys, torch
d = sys.argv[1]
ref = torch.load(f"{d}/ref.pt")
for mode in ("profile", "compiled"):
    try:
        got = torch.load(f"{d}/{mode}.pt")
    except FileNotFoundError:
        print(mode, "MISSING"); continue
    for kind in ("eager", "compiled"):
        if not ref[kind]:
            continue
        worst = max(((got[kind][n] - g).abs().max() / (g.abs().max() + 1e-30)).item() for n, g in ref[kind].items())
        same = all(torch.equal(got[kind][n], g) for n, g in ref[kind].items())
        print(f"{mode}: {kind} step gradients {'bitwise equal' if same else 'DIFFER'} to ref's (worst relative {worst:.2e})")
PY
