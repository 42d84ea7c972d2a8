#!/bin/bash
# nxdt-launch: stage rl of run gpt3_tiny (local executor).
# Produced by: nxdt-launch
# Resolved stage config: /results/gpt3_tiny/rl/rl_config.yaml
set -euo pipefail
export NXDT_STAGE=rl
export NXDT_RUN_DIR=/results/gpt3_tiny
# cluster.s3, for every S3 client this stage makes (runtime/io/s3.py reads them); an empty endpoint is AWS S3.
export NXDT_S3_ENDPOINT_URL=''
export NXDT_S3_MAX_CONCURRENCY=8
export NXDT_S3_MULTIPART_CHUNK_MB=64
export NXDT_S3_RETRIES=10
export NXDT_S3_CHECKSUMS=when_supported
export PYTHON=/opt/venv/bin/python
LOG_DIR=/results/gpt3_tiny/rl/logs
mkdir -p "$LOG_DIR"

# Everything below also goes to the stage's log; `nxdt-launch logs` reads it.
exec > >(tee -a "$LOG_DIR/rl_local.log") 2>&1
# `nxdt-launch status` reads the exit code from here.
trap 'echo $? > "$LOG_DIR/rl_local.exit"' EXIT

# The watchdog's timeouts (rl.fault_tolerance): a hung worker ends the stage with one line naming it,
# instead of holding this machine until someone looks. (Restarts and node checks are the Slurm script's.)
export NXDT_FT_SETUP_TIMEOUT_S=1800
export NXDT_FT_CHECKPOINT_TIMEOUT_S=1800
export NXDT_FT_STEP_TIMEOUT_S=''
export NXDT_FT_STEP_TIMEOUT_FACTOR=5
export NXDT_FT_STEP_TIMEOUT_FLOOR_S=300
# All 2 workers of the stage's 1 node(s) run on this machine, under torchrun
# (runtime.torchrun: ending a failure in one line, with the failing worker's exit code).
"$PYTHON" -m runtime.torchrun --standalone --nnodes 1 --nproc_per_node 2 \
  -m runtime.train --config /results/gpt3_tiny/rl/rl_config.yaml --stage rl
