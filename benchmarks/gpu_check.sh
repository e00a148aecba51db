#!/usr/bin/env bash
# Every GPU measurement the project claims, on one H100 or H200, in two parts that each fit a 600 s call:
#
#   PART=compile: the host calibration, the partitioner's traced peaks against measured (limit 150 s; on an
#                 H100 in session 5 its real step was wrong after the fake trace -- a stale Python-dispatcher
#                 entry, fixed since on the CPU: it must now measure ~11 GiB, ~33 ms, no autograd warning) and
#                 the compiled comparison (limit 420 s; on a fresh H100, 2026-11-26, torch 2.11, its autosac
#                 row alone did not finish in 200 s, and took 142 s warm);
#   PART=compile2: the compiled comparison's rows gpu_compile.py --quick leaves out for time: gpt2 at 0.3
#                 and 0.7 (limit 480 s; on an H100, 2026-11-27, 200 s held torch's two rows and none of
#                 autosac's: each of its compiled fits takes over 140 s);
#   PART=compile3: the 16-layer Llama at 0.5 (limit 480 s); not yet run on a GPU;
#   PART=rest:    everything else (limits 820 s together, more than one 600 s call at worst: split it with STEPS;
#                 290 s on a fresh H100, 2026-11-26; 340 s, 2026-11-27; on an H200, 2026-11-29, in three calls of
#                 175-239 s with the calibration each, gpu_time_model 55-58 s, gpu_verify 106-116 s).
#
# Unset, PART runs both in one go.  Each step has a time limit; one that runs out is said so in summary.txt,
# and the others still run.  After every step the results so far are archived under $OUT (when set, as the
# project's GPU runner collects them; it brings back 8 files at most): <folder>.tar.gz and summary.txt.
#
#   PART=compile bash benchmarks/gpu_check.sh   # then, on the same warm machine:
#   PART=rest bash benchmarks/gpu_check.sh
#   bash benchmarks/gpu_check.sh            # from the repository root, on a machine with a CUDA GPU
#   FULL=1 bash benchmarks/gpu_check.sh     # the whole compiled comparison (gpt2 and Llama, three fractions): longer
#   STEPS="calibrate tests" bash benchmarks/gpu_check.sh   # only the steps named (of those PART selects)
#
# Writes benchmarks/results/gpu-<date>-<hhmm>/, a new folder each run (archived under $OUT when that
# is set):
#   summary.txt               device, torch, Python, whether torch gives checkpoint policies op outputs,
#                             each step's exit status and seconds
#   all.log                   everything the steps printed
#   tests.txt                 tests/test_gpu.py (the GPU findings: CUDA labels in loss_fn, memory
#                             history during a planned backward, the cuBLAS workspace counted)
#   pack_downcast_cuda_*.json the native cast's CUDA kernel: bitwise, GB/s against a plain copy (and .txt)
#   gpu_verify.md             eager plans: predicted against measured peak and step, bitwise
#   gpu_compile.md            compiled plans against torch.compile's activation_memory_budget
#   gpu_partitioner_peaks.md  the compiled step under activation_memory_budget 1.0: traced peak
#                             (what a partitioner plan predicts) against measured
#   gpu_overhead.txt          plans against torch.utils.checkpoint and torch's SAC at their peaks
#   gpu_time_model.md         issue 32's GPU time model: launches against kernels (wall, host, GPU busy), the
#                             plain path's cost per checkpointed call, HF's gradient_checkpointing against plans
#   gpu_hf_gpt2.txt           transformers GPT-2: autosac's plan against its own gradient checkpointing
#   gpu_peak_snapshot_70.txt  the 16-layer Llama planned at 70 %: what the allocator holds at the step's peak,
#                             by the source line that allocated it
#   lt_workspace.txt          the library memory a first matmul leaves, with and without a fused bias
#   gpu_trace_vs_allocator.txt gpt2's unplanned step: what the trace holds at its peak against the CUDA
#                             allocator's record (made in the step, alive before it, blocks by stack)
#   bench_search_gpu.md       autosac.search: built-in gpt2, bf16, 20 GiB, batch 4..64: the predicted choice
#                             against every feasible candidate run, peaks within the memory
# Each step has a time limit; one that runs out is said so in summary.txt, and the others still run.
# PuLP: where it is missing and .whl/ holds its wheel (carried to the GPU machine), it is installed
# into /tmp/site first.  A 3.x wheel (pyproject asks for pulp>=3.3.1,<4; a 4.x one is not used):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl 'pulp>=3.3.1,<4'
set -uo pipefail
cd "$(dirname "$0")/.."
DATE=$(date +%Y-%m-%d)
DIR=benchmarks/results/gpu-$DATE-$(date +%H%M)
mkdir -p "$DIR"
: > "$DIR/all.log"
if ! python3 -c "import pulp" 2>/dev/null && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
python3 -c "import torch, platform, datetime, inspect, torch.utils.checkpoint as c; print(datetime.date.today(), torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA DEVICE', 'torch', torch.__version__, 'python', platform.python_version()); print('checkpoint policy context gets op_output (compiled plans match calls by data flow):', 'op_output' in inspect.signature(c.SelectiveCheckpointContext.__init__).parameters)" > "$DIR/summary.txt" 2>&1
cat "$DIR/summary.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log, and note the outcome
  local name=$1 limit=$2 start rc
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  start=$(date +%s)
  echo "== $name: $*" >> "$DIR/all.log"
  timeout "$limit" "$@" >> "$DIR/all.log" 2>&1
  rc=$?
  local note="exit $rc"
  [ "$rc" = 124 ] && note="TIMED OUT after $limit s"
  echo "$name: $note in $(( $(date +%s) - start )) s" | tee -a "$DIR/summary.txt"
  if [ -n "${OUT:-}" ]; then  # after every step: a run cut short by its runner still brings back what is done,
    # as one archive (the runner brings back 8 files at most) and the summary beside it
    tar czf "$OUT/$(basename "$DIR").tar.gz" -C "$(dirname "$DIR")" "$(basename "$DIR")" && cp "$DIR/summary.txt" "$OUT/"
  fi
}
part() { [ -z "${PART:-}" ] || [ "$PART" = "$1" ]; }

step calibrate 90 python3 -m autosac.cli calibrate  # 43 s in session 15, before the in-step size figure (~5-10 s more)
if part compile; then
  step partitioner_peaks 150 python3 benchmarks/gpu_partitioner_peaks.py "$DIR/gpu_partitioner_peaks.md" --fractions 1.0
  if [ "${FULL:-0}" = 1 ]; then
    step gpu_compile 1500 python3 benchmarks/gpu_compile.py "$DIR/gpu_compile.md"
  else
    step gpu_compile 420 python3 benchmarks/gpu_compile.py "$DIR/gpu_compile.md" --quick
  fi
fi
if [ "${PART:-}" = compile2 ]; then  # the compiled comparison's other rows, each step cut short keeps its rows
  step gpu_compile_gpt2_more 480 python3 benchmarks/gpu_compile.py "$DIR/gpu_compile_gpt2_more.md" --quick --fractions 0.3,0.7
fi
if [ "${PART:-}" = compile3 ]; then
  step gpu_compile_llama 480 python3 benchmarks/gpu_compile.py "$DIR/gpu_compile_llama.md" --quick --models llama
fi
if part rest; then
  step gpu_time_model 150 python3 benchmarks/gpu_time_model.py "$DIR/gpu_time_model.md"
  step gpu_hf_gpt2 60 sh -c "python3 benchmarks/gpu_hf_gpt2.py > '$DIR/gpu_hf_gpt2.txt'"
  if [ "${FULL:-0}" = 1 ]; then
    step gpu_verify 600 python3 benchmarks/gpu_verify.py "$DIR/gpu_verify.md"
  else
    step gpu_verify 180 python3 benchmarks/gpu_verify.py "$DIR/gpu_verify.md"  # 114 s in session 15, before its interleaved gpt2 rounds (~20 s)
  fi
  step peak_snapshot 40 sh -c "python3 benchmarks/gpu_peak_snapshot.py 70% > '$DIR/gpu_peak_snapshot_70.txt'"
  step trace_vs_allocator 90 sh -c "python3 benchmarks/gpu_trace_vs_allocator.py > '$DIR/gpu_trace_vs_allocator.txt'"
  step lt_workspace 60 sh -c "python3 benchmarks/gpu_lt_workspace.py > '$DIR/lt_workspace.txt'"
  step pack_downcast 30 python3 benchmarks/pack_downcast_cuda.py --out-dir "$DIR"
  step tests 120 sh -c "python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > '$DIR/tests.txt' 2>&1"
  if [ "${FULL:-0}" = 1 ]; then
    step gpu_overhead 600 sh -c "python3 benchmarks/gpu_overhead.py --models gpt2 > '$DIR/gpu_overhead.txt'"
  else
    step gpu_overhead 30 sh -c "python3 benchmarks/gpu_overhead.py --models gpt2 > '$DIR/gpu_overhead.txt'"
  fi
  step bench_search 60 sh -c "python3 benchmarks/bench_search.py --gpu > '$DIR/bench_search_gpu.md'"
fi
echo "results in $DIR"
