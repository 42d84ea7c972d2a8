#!/bin/bash
# nxdt-launch: stage evaluation of run gpt3_tiny (slurm executor).
# Produced by: nxdt-launch
# Resolved stage config: /results/gpt3_tiny/evaluation/evaluation_config.yaml
#SBATCH --job-name=nxdt:gpt3_tiny:evaluation
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=1:00:00
#SBATCH --output=/results/gpt3_tiny/evaluation/logs/evaluation_%j.out
#SBATCH --open-mode=append
#SBATCH --exclusive
set -euo pipefail
export NXDT_STAGE=evaluation
export NXDT_RUN_DIR=/results/gpt3_tiny
# cluster.s3, for every S3 client this stage makes (runtime/io/s3.py reads them); an empty endpoint is AWS S3.
export NXDT_S3_ENDPOINT_URL=''
export NXDT_S3_MAX_CONCURRENCY=8
export NXDT_S3_MULTIPART_CHUNK_MB=64
export NXDT_S3_RETRIES=10
export NXDT_S3_CHECKSUMS=when_supported
export PYTHON=/opt/venv/bin/python
LOG_DIR=/results/gpt3_tiny/evaluation/logs
mkdir -p "$LOG_DIR"

# Which array task or job this is, and how often Slurm has requeued it: every log name carries both.
JOB_TAG="${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}_${SLURM_ARRAY_TASK_ID:-0}"
RESTART="${SLURM_RESTART_COUNT:-0}"
# `nxdt-launch status` reads this when Slurm accounting is off and the job has left the queue.
trap 'echo $? > "$LOG_DIR/evaluation_${JOB_TAG}.exit"' EXIT

# Rendezvous on the allocation's first node, at the address slurmd itself is reached at. (sed, not head: head
# would exit before scontrol finished writing, and pipefail would end the job on scontrol's SIGPIPE.)
MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
MASTER_ADDR=$(scontrol show node "$MASTER_NODE" | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')
MASTER_ADDR="${MASTER_ADDR:-$MASTER_NODE}"
# One IPv4 address: a multi-NIC node's name may resolve to several, and every node must dial the same one.
MASTER_IP=$(getent ahostsv4 "$MASTER_ADDR" | awk 'NR == 1 { print $1 }' || true)
export MASTER_ADDR="${MASTER_IP:-$MASTER_ADDR}"
export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))

# What each node runs: one torchrun that starts this node's 1 workers (runtime.torchrun:
# torchrun ending a failure in one line, with the failing worker's exit code).
node_main() {
  exec "$PYTHON" -m runtime.torchrun \
    --nnodes 1 --node_rank "$SLURM_NODEID" --nproc_per_node 1 \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    -m runtime.evaluate --config /results/gpt3_tiny/evaluation/evaluation_config.yaml
}
export -f node_main

echo "nxdt: evaluation job $JOB_TAG restart $RESTART on $SLURM_JOB_NODELIST"
srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 \
  --output="$LOG_DIR/evaluation_${JOB_TAG}_restart${RESTART}_node%n.log" \
  bash -c node_main
