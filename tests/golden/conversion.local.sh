#!/bin/bash
# nxdt-launch: stage conversion of run gpt3_tiny (local executor).
# Produced by: nxdt-launch
# Resolved stage config: /results/gpt3_tiny/conversion/conversion_config.yaml
set -euo pipefail
export NXDT_STAGE=conversion
export NXDT_RUN_DIR=/results/gpt3_tiny
# cluster.s3, for every S3 client this stage makes (runtime/io/s3.py reads them); an empty endpoint is AWS S3.
export NXDT_S3_ENDPOINT_URL=''
export NXDT_S3_MAX_CONCURRENCY=8
export NXDT_S3_MULTIPART_CHUNK_MB=64
export NXDT_S3_RETRIES=10
export NXDT_S3_CHECKSUMS=when_supported
export PYTHON=/opt/venv/bin/python
LOG_DIR=/results/gpt3_tiny/conversion/logs
mkdir -p "$LOG_DIR"

# Everything below also goes to the stage's log; `nxdt-launch logs` reads it.
exec > >(tee -a "$LOG_DIR/conversion_local.log") 2>&1
# `nxdt-launch status` reads the exit code from here.
trap 'echo $? > "$LOG_DIR/conversion_local.exit"' EXIT

"$PYTHON" -m runtime.convert --config /results/gpt3_tiny/conversion/conversion_config.yaml
