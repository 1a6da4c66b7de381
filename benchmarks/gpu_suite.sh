#!/usr/bin/env bash
# The GPU checks, on one lent GPU in about 8 minutes, each part bounded by its own timeout:
#   1. the runtime tests on NCCL, several ranks sharing the GPU (DAPPLE_SHARE_GPUS=1), 4 pytest workers;
#   2. torch.compile against eager, bf16, a one-stage GPT of about 1.1 B parameters (step time, peak memory);
#   3. the cost of tracing (CUDA events resolved at the step's end) against untraced steps, 2 ranks.
# Each part's output goes to $OUT (default: gpu_suite_out/), a file per part; a failing part does not stop the
# others. Run from anywhere:  bash benchmarks/gpu_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD DAPPLE_SHARE_GPUS=1 OMP_NUM_THREADS=1
OUT=${OUT:-gpu_suite_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

part() {  # part NAME SECONDS COMMAND...: run COMMAND with a timeout, its output into $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; $PY -c \
    "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } >"$OUT/summary.txt" 2>&1
part runtime_tests 270 $PY -m pytest -q -n 4 -p no:cacheprovider tests/runtime -x
part compile 180 $PY benchmarks/compile_speed.py
part trace_overhead 60 $PY benchmarks/trace_overhead.py --steps 5 --rounds 3
cat "$OUT/summary.txt"
