#!/bin/bash
# nxdt-launch: stage conversion of run gpt3_tiny (slurm executor).
# Produced by: nxdt-launch
# Resolved stage config: /results/gpt3_tiny/conversion/conversion_config.yaml
#SBATCH --job-name=nxdt:gpt3_tiny:conversion
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=1:00:00
#SBATCH --output=/results/gpt3_tiny/conversion/logs/conversion_%j.out
#SBATCH --open-mode=append
#SBATCH --exclusive
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

# Which array task or job this is, and how often Slurm has requeued it: every log name carries both.
JOB_TAG="${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}_${SLURM_ARRAY_TASK_ID:-0}"
RESTART="${SLURM_RESTART_COUNT:-0}"
# `nxdt-launch status` reads this when Slurm accounting is off and the job has left the queue.
trap 'echo $? > "$LOG_DIR/conversion_${JOB_TAG}.exit"' EXIT

# What the node runs.
node_main() {
  exec "$PYTHON" -m runtime.convert --config /results/gpt3_tiny/conversion/conversion_config.yaml
}
export -f node_main

echo "nxdt: conversion job $JOB_TAG restart $RESTART on $SLURM_JOB_NODELIST"
srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 \
  --output="$LOG_DIR/conversion_${JOB_TAG}_restart${RESTART}_node%n.log" \
  bash -c node_main
