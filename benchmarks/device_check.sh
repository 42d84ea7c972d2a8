#!/usr/bin/env bash
# The device check, ready for a lent GPU machine: the CUDA path's fp32 exactness against CPU (and, with 2 GPUs, a
# dp=2 NCCL run), then the bf16 MFU of a ~1.1B Llama. See benchmarks/device_check.py for what it measures.
#
#   bash benchmarks/device_check.sh              # on the GPU machine, from the repository root or anywhere
#   bash benchmarks/device_check.sh --cpu-smoke  # the same code on CPU at tiny sizes, no GPU needed
#
# It needs only torch (and numpy, which torch brings): the script puts the checkout on sys.path, so no install of
# this repository is needed. Where torch is missing it tries `pip install -e .[runtime]` once (which reaches a
# package index: an unpinned torch there pulls a CUDA build), then gives up with one line. The whole Python run
# is under a hard `timeout` (default 450 s, well inside 8 minutes; DEVICE_CHECK_TIMEOUT overrides). With $OUT set
# the log goes to $OUT/device_check.log and the JSON summary to $OUT/device_check.json.
set -uo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
LIMIT="${DEVICE_CHECK_TIMEOUT:-450}"
export PYTHONUNBUFFERED=1
# Deterministic cuBLAS for the exactness part: 8 x 4 MiB, the 32 MiB torch gives cuBLAS on Hopper anyway.
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "device_check: torch is not importable by $PYTHON; trying: pip install -e '.[runtime]'"
    "$PYTHON" -m pip install -q --retries 0 --timeout 15 -e '.[runtime]' \
        || { echo "device_check: FAIL: torch is missing and 'pip install -e .[runtime]' failed"; exit 2; }
fi

LOG=/dev/null
if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    LOG="$OUT/device_check.log"
    : >"$LOG"
fi
if [[ " $* " != *" --cpu-smoke "* ]] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
        | sed 's/^/device_check: nvidia-smi: /' | tee -a "$LOG"
fi
timeout -k 15 "$LIMIT" "$PYTHON" benchmarks/device_check.py "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
if [[ $status -eq 124 || $status -eq 137 ]]; then
    echo "device_check: FAIL: stopped by the hard time limit of ${LIMIT} s" | tee -a "$LOG"
fi
exit "$status"
