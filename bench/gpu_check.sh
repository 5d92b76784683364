#!/usr/bin/env bash
# The GPU list, in one go, on a machine with a CUDA GPU (the lent device machine; never CI):
# CUDA tests, stage runtime vs transformers on the GPU, speculative decoding through a
# 2-stage mesh whose stages both sit on the GPU. Each step has its own time limit so one
# hang does not cost the others; logs and JSON go to $OUT (default bench/results/gpu).
#
#   MESHD_HOME=<dir holding models/ and tokenizers/> bash bench/gpu_check.sh [--quick]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-bench/results/gpu}"; mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
step() {  # name, limit_s, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0))s"; tail -n 25 "$out/$name.log"
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c "import torch,sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'python', sys.version.split()[0])"
  nproc; } 2>&1 | tee "$out/machine.txt"
step cuda_tests 200 "$py" -m pytest -q -p no:cacheprovider -o addopts="" --timeout 150 \
    tests/system/test_cuda.py tests/decoding/test_device_placement.py
step stage_runtime_cuda 170 "$py" bench/stage_runtime.py --device cuda --quick --threads 1 --rounds 1 --json
step decode_cuda 200 "$py" bench/decode.py --device cuda --quick --json --out "$out/decode_cuda.json"
