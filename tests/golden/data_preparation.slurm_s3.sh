#!/bin/bash
# nxdt-launch: stage data_preparation of run gpt3_tiny (slurm executor).
# Produced by: nxdt-launch data_dir=s3://bucket/datasets cluster.staging.local_dir=/fsx/staging data_preparation=custom_dataset data_preparation.input.files=['s3://bucket/raw/{:02d}.jsonl'] data_preparation.input.file_numbers='0-2'
# Resolved stage config: /results/gpt3_tiny/data_preparation/data_preparation_config.yaml
#SBATCH --job-name=nxdt:gpt3_tiny:data_preparation
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=24:00:00
#SBATCH --array=0-2%3
#SBATCH --output=/results/gpt3_tiny/data_preparation/logs/data_preparation_%A_%a.out
#SBATCH --open-mode=append
#SBATCH --exclusive
set -euo pipefail
export NXDT_STAGE=data_preparation
export NXDT_RUN_DIR=/results/gpt3_tiny
# cluster.s3, for every S3 client this stage makes (runtime/io/s3.py reads them); an empty endpoint is AWS S3.
export NXDT_S3_ENDPOINT_URL=''
export NXDT_S3_MAX_CONCURRENCY=8
export NXDT_S3_MULTIPART_CHUNK_MB=64
export NXDT_S3_RETRIES=10
export NXDT_S3_CHECKSUMS=when_supported
export PYTHON=/opt/venv/bin/python
LOG_DIR=/results/gpt3_tiny/data_preparation/logs
mkdir -p "$LOG_DIR"

# Which array task or job this is, and how often Slurm has requeued it: every log name carries both.
JOB_TAG="${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}_${SLURM_ARRAY_TASK_ID:-0}"
RESTART="${SLURM_RESTART_COUNT:-0}"
# `nxdt-launch status` reads this when Slurm accounting is off and the job has left the queue.
trap 'echo $? > "$LOG_DIR/data_preparation_${JOB_TAG}.exit"' EXIT

# Inputs on S3, copied to the shared file system before the program starts (docs/parallelcluster.md).
"$PYTHON" -m runtime.io.staging pull /results/gpt3_tiny/data_preparation/data_preparation_staging.json

# What the node runs.
node_main() {
  exec "$PYTHON" -m runtime.data_prep --config /results/gpt3_tiny/data_preparation/data_preparation_config.yaml --task-index "$SLURM_ARRAY_TASK_ID" --num-tasks 3
}
export -f node_main

echo "nxdt: data_preparation job $JOB_TAG restart $RESTART on $SLURM_JOB_NODELIST"
srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 \
  --output="$LOG_DIR/data_preparation_${JOB_TAG}_restart${RESTART}_node%n.log" \
  bash -c node_main
# Outputs copied back to S3 once the program succeeded.
"$PYTHON" -m runtime.io.staging push /results/gpt3_tiny/data_preparation/data_preparation_staging.json
