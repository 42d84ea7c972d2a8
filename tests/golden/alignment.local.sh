#!/bin/bash
# nxdt-launch: stage alignment of run gpt3_tiny (local executor).
# Produced by: nxdt-launch
# Resolved stage config: /results/gpt3_tiny/alignment/alignment_config.yaml
set -euo pipefail
export NXDT_STAGE=alignment
export NXDT_RUN_DIR=/results/gpt3_tiny
# cluster.s3, for every S3 client this stage makes (runtime/io/s3.py reads them); an empty endpoint is AWS S3.
export NXDT_S3_ENDPOINT_URL=''
export NXDT_S3_MAX_CONCURRENCY=8
export NXDT_S3_MULTIPART_CHUNK_MB=64
export NXDT_S3_RETRIES=10
export NXDT_S3_CHECKSUMS=when_supported
export PYTHON=/opt/venv/bin/python
LOG_DIR=/results/gpt3_tiny/alignment/logs
mkdir -p "$LOG_DIR"

# Everything below also goes to the stage's log; `nxdt-launch logs` reads it.
exec > >(tee -a "$LOG_DIR/alignment_local.log") 2>&1
# `nxdt-launch status` reads the exit code from here.
trap 'echo $? > "$LOG_DIR/alignment_local.exit"' EXIT

# All 2 workers of the stage's 1 node(s) run on this machine, under torchrun
# (runtime.torchrun: ending a failure in one line, with the failing worker's exit code).
"$PYTHON" -m runtime.torchrun --standalone --nnodes 1 --nproc_per_node 2 \
  -m runtime.train --config /results/gpt3_tiny/alignment/alignment_config.yaml --stage alignment
