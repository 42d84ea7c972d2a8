#!/bin/bash
# nxdt-launch: stage training of run gpt3_tiny (slurm executor).
# Produced by: nxdt-launch cluster=pcluster_trn1 training.trainer.num_nodes=4 training.trainer.devices=32 training.trainer.accelerator=neuron
# Resolved stage config: /results/gpt3_tiny/training/training_config.yaml
#SBATCH --job-name=nxdt:gpt3_tiny:training
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --time=0:30:00
#SBATCH --output=/results/gpt3_tiny/training/logs/training_%j.out
#SBATCH --open-mode=append
#SBATCH --partition=compute
#SBATCH --exclusive
set -euo pipefail
# Cluster setup lines, run as written.
source /fsx/nxdt_venv/bin/activate
export FI_PROVIDER=efa
export FI_EFA_USE_DEVICE_RDMA=1
export FI_EFA_FORK_SAFE=1
export NEURON_RT_NUM_CORES=32
export CCOM_SOCKET_IFNAME=eth0
export MALLOC_ARENA_MAX=64
export XLA_TRANSFER_SEED_ASYNC=1
export NXDT_STAGE=training
export NXDT_RUN_DIR=/results/gpt3_tiny
export PYTHON=/opt/venv/bin/python
LOG_DIR=/results/gpt3_tiny/training/logs
mkdir -p "$LOG_DIR"

# Which array task or job this is, and how often Slurm has requeued it: every log name carries both.
JOB_TAG="${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}_${SLURM_ARRAY_TASK_ID:-0}"
RESTART="${SLURM_RESTART_COUNT:-0}"
# `nxdt-launch status` reads this when Slurm accounting is off and the job has left the queue.
trap 'echo $? > "$LOG_DIR/training_${JOB_TAG}.exit"' EXIT

# Rendezvous on the allocation's first node, at the address slurmd itself is reached at.
MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_ADDR=$(scontrol show node "$MASTER_NODE" | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')
export MASTER_ADDR="${MASTER_ADDR:-$MASTER_NODE}"
export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))

# What each node runs: one torchrun that starts this node's 32 workers.
node_main() {
  exec "$PYTHON" -m torch.distributed.run \
    --nnodes 4 --node_rank "$SLURM_NODEID" --nproc_per_node 32 \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    -m runtime.train --config /results/gpt3_tiny/training/training_config.yaml
}
export -f node_main

echo "nxdt: training job $JOB_TAG restart $RESTART on $SLURM_JOB_NODELIST"
srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=1 \
  --output="$LOG_DIR/training_${JOB_TAG}_restart${RESTART}_node%n.log" \
  bash -c node_main
