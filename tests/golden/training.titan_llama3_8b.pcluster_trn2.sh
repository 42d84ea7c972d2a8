#!/bin/bash
# nxdt-launch: stage training of run llama3_8b_trn2 (slurm executor).
# Produced by: nxdt-launch training=llama3/8b cluster=pcluster_trn2 training.runtime=torchtitan
# Resolved stage config: /results/llama3_8b_trn2/training/training_config.yaml
#SBATCH --job-name=nxdt:llama3_8b_trn2:training
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=14-00:00:00
#SBATCH --output=/results/llama3_8b_trn2/training/logs/training_%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --partition=trn2
#SBATCH --exclusive
set -euo pipefail
# Cluster setup lines, run as written.
export PATH="/opt/aws/neuron/bin:$PATH"
# The cluster's venv (cluster.venv), on every node: its python runs the stage, its bin/ is on PATH.
source /opt/nxdt/venv/bin/activate
# Collectives between Neuron nodes over EFA (cluster.neuron.efa); training and cluster-validate set the same.
export FI_PROVIDER=efa
export FI_EFA_USE_DEVICE_RDMA=1
# libfabric must be told to be fork-safe on kernels older than 5.13 (no copy-on-fork for pinned memory).
if [ "$(printf '%s\n' 5.13 "$(uname -r)" | sort -V | sed -n 1p)" != 5.13 ]; then export FI_EFA_FORK_SAFE=1; fi
# Each worker holds many sockets and files open.
ulimit -n 65535 2>/dev/null || ulimit -n "$(ulimit -Hn)"
# Trainium (trn2) under TorchNeuron, for torchtitan (launcher/neuron.py torchneuron_env says where
# each comes from). The cluster's and the launch's env_vars below win.
export MALLOC_ARENA_MAX=64
export NEURON_LOGICAL_NC_CONFIG=2
export NXDT_STAGE=training
export NXDT_RUN_DIR=/results/llama3_8b_trn2
# cluster.s3, for every S3 client this stage makes (runtime/io/s3.py reads them); an empty endpoint is AWS S3.
export NXDT_S3_ENDPOINT_URL=''
export NXDT_S3_MAX_CONCURRENCY=8
export NXDT_S3_MULTIPART_CHUNK_MB=64
export NXDT_S3_RETRIES=10
export NXDT_S3_CHECKSUMS=when_supported
export PYTHON=/opt/venv/bin/python
LOG_DIR=/results/llama3_8b_trn2/training/logs
mkdir -p "$LOG_DIR"

# Which array task or job this is, and how often Slurm has requeued it: every log name carries both.
JOB_TAG="${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}_${SLURM_ARRAY_TASK_ID:-0}"
RESTART="${SLURM_RESTART_COUNT:-0}"
# `nxdt-launch status` reads this when Slurm accounting is off and the job has left the queue. An allocation
# that requeues the job writes none: the job is not over, and its last allocation writes the real code.
REQUEUED=0
trap 'CODE=$?; [ "$REQUEUED" = 1 ] || echo "$CODE" > "$LOG_DIR/training_${JOB_TAG}.exit"' EXIT
rm -f "$LOG_DIR/training_${JOB_TAG}.exit"  # an earlier allocation's, if Slurm requeued the job itself

# USR1 asks the training to save a checkpoint and stop, so that the job can requeue itself and resume.
# Slurm sends it 120 s before the time limit (--signal above; slurmctld looks every 30 s,
# so it may come up to 30 s sooner).
# By hand: `scancel --batch --signal=USR1 <job>`. This shell passes it to srun, srun to every process of the
# step (torchrun on each node, which passes it on too, and its workers), and the workers finish their step,
# save and exit 75. TERM means Slurm is ending the job (scancel, the time limit, a preemption): Slurm sends it
# to every process itself (srun would take a TERM as "kill the step now"), and whether the job runs again is
# Slurm's decision, so this shell only notes it.
MAX_RESTARTS=3  # training.run.max_restarts
SIGNALLED=""
STEP_PID=""
on_signal() {
  echo "nxdt: training job $JOB_TAG restart $RESTART: SIG$1"
  if [ "$SIGNALLED" != TERM ]; then SIGNALLED=$1; fi
  if [ "$1" = USR1 ] && [ -n "$STEP_PID" ]; then kill -s USR1 "$STEP_PID" 2>/dev/null || true; fi
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

# Rendezvous on the allocation's first node, at the address slurmd itself is reached at. (sed, not head: head
# would exit before scontrol finished writing, and pipefail would end the job on scontrol's SIGPIPE.)
MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
MASTER_ADDR=$(scontrol show node "$MASTER_NODE" | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')
MASTER_ADDR="${MASTER_ADDR:-$MASTER_NODE}"
# One IPv4 address: a multi-NIC node's name may resolve to several, and every node must dial the same one.
MASTER_IP=$(getent ahostsv4 "$MASTER_ADDR" | awk 'NR == 1 { print $1 }' || true)
export MASTER_ADDR="${MASTER_IP:-$MASTER_ADDR}"
export MASTER_PORT=$(( 44000 + SLURM_JOB_ID % 1000 ))

# What each node runs: one torchrun that starts this node's 64 workers (runtime.torchrun:
# torchrun ending a failure in one line, with the failing worker's exit code): torchtitan on TorchNeuron, which
# compiles as it runs (no compile step: that is torch-xla's).
export STAGE_CONFIG=/results/llama3_8b_trn2/training/training_config.yaml
node_main() {
  # Compiled graphs of this model, one cache that every node shares (a shared directory or S3): a node that
  # replaces another finds them.
  export NEURON_COMPILE_CACHE_URL=/fsx/neuron-compile-cache/llama-6498dd724871
  exec "$PYTHON" -m runtime.torchrun \
    --nnodes 1 --node_rank "$SLURM_NODEID" --nproc_per_node 64 \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout 120 \
    -m runtime.titan.train --job /results/llama3_8b_trn2/training/training_titan_job.py
}
export -f node_main

echo "nxdt: training job $JOB_TAG restart $RESTART on $SLURM_JOB_NODELIST"
# The node watchdog's timeouts (training.fault_tolerance; runtime.torchrun reads them), and the run's attempt
# history, which `nxdt-launch status` shows.
export NXDT_FT_SETUP_TIMEOUT_S=1800
export NXDT_FT_CHECKPOINT_TIMEOUT_S=1800
export NXDT_FT_STEP_TIMEOUT_S=''
export NXDT_FT_STEP_TIMEOUT_FACTOR=5
export NXDT_FT_STEP_TIMEOUT_FLOOR_S=300
export NXDT_ATTEMPTS_FILE="$LOG_DIR/training_attempts.jsonl"
ATTEMPT=0
ATTEMPT_TAG=""
while :; do
  # What each node's torchrun writes about this attempt (how it ended there, a hang's verdict, the node checks).
  export NXDT_ATTEMPT_DIR="$LOG_DIR/attempts/${JOB_TAG}_restart${RESTART}_attempt${ATTEMPT}"
  mkdir -p "$NXDT_ATTEMPT_DIR"
  # In the background, so that a signal is handled at once: bash runs a trap only between commands, and `wait` is
  # one that a trapped signal interrupts (it then returns > 128 while the step goes on).
  if [ -z "$SIGNALLED" ]; then
    srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 \
      --output="$LOG_DIR/training_${JOB_TAG}_restart${RESTART}${ATTEMPT_TAG}_node%n.log" \
      bash -c node_main &
    STEP_PID=$!
    while kill -0 "$STEP_PID" 2>/dev/null; do wait "$STEP_PID" || true; done
    STEP_EXIT=0
    wait "$STEP_PID" || STEP_EXIT=$?
  else
    STEP_EXIT=143  # signalled before the step could start (during the compile step, say): no time left to train
  fi

  # Finished, or stopped at a checkpoint by a signal: as without fault tolerance, below.
  if [ "$STEP_EXIT" = 0 ] || [ -n "$SIGNALLED" ] || [ "$STEP_EXIT" = 75 ]; then break; fi
  STEP_PID=""
  # What Slurm says, asked here on the batch host (a container image may have no Slurm clients): the allocation's
  # nodes, the nodes the job already excludes, and the partition's nodes that can take work.
  ALLOCATION=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | tr '\n' ' ' || true)
  EXCLUDED=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.* ExcNodeList=\([^ ]*\).*/\1/p' || true)
  if [ -n "$EXCLUDED" ] && [ "$EXCLUDED" != "(null)" ]; then
    EXCLUDED=$(scontrol show hostnames "$EXCLUDED" 2>/dev/null | tr '\n' ' ' || true)
  else
    EXCLUDED=""
  fi
  USABLE=$(sinfo -h -N -p "${SLURM_JOB_PARTITION:-}" -o '%N %t' 2>/dev/null \
    | awk '$2 ~ /^(idle|mix|alloc|comp)$/ { print $1 }' | sort -u | tr '\n' ' ' || true)
  DECIDE=(--attempt-dir "$NXDT_ATTEMPT_DIR" --history "$NXDT_ATTEMPTS_FILE" --stage training \
    --job "$JOB_TAG" --attempt "$ATTEMPT" --exit "$STEP_EXIT" --in-job-restarts 3 \
    --same-node-failures 2 --requeues-on-failure 2 \
    --min-nodes 1 --allocation "$ALLOCATION" --excluded "$EXCLUDED" --usable "$USABLE")
  ACTION=$("$PYTHON" -m runtime.fault_tolerance.attempts failed "${DECIDE[@]}") || ACTION=stop
  if [ "$ACTION" = check-nodes ]; then
    # Bounded (--time, minutes): a node whose check hangs on a dead mount is the bad one, not a reason to wait.
    srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=0 --time=10 \
      --output="$LOG_DIR/training_${JOB_TAG}_restart${RESTART}_attempt${ATTEMPT}_nodecheck_node%n.log" \
      bash -c '"$PYTHON" "$@"' python \
      -m runtime.fault_tolerance.node_check --out "$NXDT_ATTEMPT_DIR" --accelerator neuron \
      --results-dir /results/llama3_8b_trn2/training || true
    ACTION=$("$PYTHON" -m runtime.fault_tolerance.attempts checked "${DECIDE[@]}") || ACTION=stop
  fi
  case "$ACTION" in
    restart)
      ATTEMPT=$((ATTEMPT + 1))
      ATTEMPT_TAG="_attempt$ATTEMPT"
      echo "nxdt: training job $JOB_TAG restart $RESTART attempt $ATTEMPT on $SLURM_JOB_NODELIST" ;;
    requeue\ *)
      # Requeued, then told to avoid the bad nodes: Slurm takes ExcNodeList only from a job that is pending, and
      # holds a requeued job for cred_expire (120 s by default) before it may start again, which the update needs
      # a moment of. The requeue ends this allocation with a TERM, ignored until then.
      REQUEUED=1
      trap '' TERM
      if scontrol requeue "$SLURM_JOB_ID"; then
        scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="${ACTION#requeue }" \
          || echo "nxdt: could not exclude ${ACTION#requeue } from the requeued job $SLURM_JOB_ID" >&2
        exit 0
      fi
      REQUEUED=0
      echo "nxdt: scontrol requeue $SLURM_JOB_ID failed; launch the run again with cluster.exclude=[${ACTION#requeue }]" >&2
      exit "$STEP_EXIT" ;;
    *)
      exit "$STEP_EXIT" ;;
  esac
done
# Requeues after a bad node (the attempt history's) are not preemptions: run.max_restarts counts only those.
FAILURE_REQUEUES=$(grep -c "\"job_id\": \"$SLURM_JOB_ID\".*\"action\": \"requeue\"" "$NXDT_ATTEMPTS_FILE" 2>/dev/null || true)
if [ "$SIGNALLED" = USR1 ] || { [ -z "$SIGNALLED" ] && [ "$STEP_EXIT" = 75 ]; }; then
  ENDED="nxdt: training job $JOB_TAG restart $RESTART ended (exit $STEP_EXIT${SIGNALLED:+ after SIG$SIGNALLED})"
  if [ "$((RESTART - ${FAILURE_REQUEUES:-0}))" -lt "$MAX_RESTARTS" ]; then
    echo "$ENDED: scontrol requeue $SLURM_JOB_ID (restart $((RESTART + 1)) of at most $MAX_RESTARTS)"
    REQUEUED=1
    trap - TERM  # the requeue ends this allocation with a TERM
    if scontrol requeue "$SLURM_JOB_ID"; then exit 0; fi
    REQUEUED=0
    echo "nxdt: scontrol requeue $SLURM_JOB_ID failed; launch the run again to resume it" >&2
  else
    echo "$ENDED; training.run.max_restarts is $MAX_RESTARTS: not requeueing;" \
      "launch the run again to resume it" >&2
  fi
  exit 75  # runtime/preemption.py PREEMPTED_EXIT_CODE: stopped at a checkpoint, not finished
fi
if [ "$STEP_EXIT" != 0 ]; then exit "$STEP_EXIT"; fi
