#!/usr/bin/env bash
# Installs what the local 3-node Slurm test cluster needs (Debian/Ubuntu, as root), for CI and fresh machines.
# Idempotent: does nothing, not even `apt-get update`, when every program is already there.
#   slurmctld, slurmd, slurm-client (sinfo, srun, ...): pulled in by the slurm-wlm metapackage
#   munge: Slurm's authentication daemon and its munge/unmunge clients
# No iproute2: both slurmd run on 127.0.0.1 on separate ports, so no network namespaces are created.
set -euo pipefail

needed=(slurmctld slurmd sinfo srun sbatch scontrol munged munge unmunge)
missing=()
for program in "${needed[@]}"; do
    PATH="$PATH:/usr/sbin:/sbin" command -v "$program" >/dev/null || missing+=("$program")
done
if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi
echo "local_slurm/install.sh: installing slurm-wlm and munge (missing: ${missing[*]})"

if [ "$(id -u)" -ne 0 ]; then
    echo "local_slurm/install.sh: must run as root" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# Recommends would add mail and documentation packages the cluster never uses.
apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
