#!/bin/bash
# ParallelCluster OnNodeConfigured action for cluster nxdt, rendered by `nxdt-launch cluster-config`.
# ParallelCluster runs it as root on every node once the node is configured (shared storage mounted), with
# one argument: head or compute. Upload it to s3://my-bucket/nxdt/on_node_configured.sh before creating the cluster.
set -euo pipefail
ROLE="${1:-compute}"
VENV=/opt/nxdt/venv
PYTHON_FOR_VENV=python3.11
PROJECT=/fsx/nxdt-launch

# 1. Ports the collectives listen on stay free: Linux never hands them out as ephemeral ports.
#    44000-44999: torchrun's rendezvous (44000 + job id % 1000); 48620: the Neuron runtime's root port.
printf 'net.ipv4.ip_local_reserved_ports = %s\n' 44000-44999,48620 > /etc/sysctl.d/99-nxdt-collectives.conf
sysctl -q -p /etc/sysctl.d/99-nxdt-collectives.conf

# 2. Trainium nodes have several network interfaces (EFA). The node's name must resolve to the primary
#    interface only, or peers may dial an address that does not route for TCP rendezvous.
if [ "$ROLE" = compute ]; then
  # (awk reads to the end: a reader that left early would end this script on ip's SIGPIPE, under pipefail)
  PRIMARY_IF=$(ip -4 route show default | awk 'NR == 1 { print $5 }')
  PRIMARY_IP=$(ip -4 -o addr show dev "$PRIMARY_IF" | awk 'NR == 1 { split($4, a, "/"); print a[1] }')
  SHORT_NAME=$(hostname -s)
  FULL_NAME=$(hostname -f)
  # Keep every line that does not name this host; then name it once, at the primary address.
  awk -v short="$SHORT_NAME" -v full="$FULL_NAME" \
    '{ for (i = 2; i <= NF; i++) if ($i == short || $i == full) next; print }' /etc/hosts > /etc/hosts.nxdt
  printf '%s %s %s\n' "$PRIMARY_IP" "$FULL_NAME" "$SHORT_NAME" >> /etc/hosts.nxdt
  cat /etc/hosts.nxdt > /etc/hosts && rm -f /etc/hosts.nxdt
fi

# 3. The Neuron driver, runtime, collectives and tools on compute nodes (the head node has no Neuron
#    devices), from the Neuron package repository as AWS's Neuron setup guide installs them. The driver is a
#    kernel module that DKMS builds against this kernel's headers. On an AMI that has them (a Neuron DLAMI),
#    node_setup.neuron_system_packages=[] leaves its versions alone.
if [ "$ROLE" = compute ]; then
  if command -v apt-get > /dev/null; then
    . /etc/os-release
    install -m 0755 -d /etc/apt/keyrings
    curl -fsSL https://apt.repos.neuron.amazonaws.com/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB \
      | gpg --batch --yes --dearmor -o /etc/apt/keyrings/neuron.gpg
    printf 'deb [signed-by=/etc/apt/keyrings/neuron.gpg] %s %s main\n' https://apt.repos.neuron.amazonaws.com "$VERSION_CODENAME" \
      > /etc/apt/sources.list.d/neuron.list
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "linux-headers-$(uname -r)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      aws-neuronx-dkms \
      aws-neuronx-runtime-lib \
      aws-neuronx-collectives \
      aws-neuronx-tools
  else
    printf '[neuron]\nname=Neuron YUM Repository\nbaseurl=%s\nenabled=1\nmetadata_expire=0\n' \
      https://yum.repos.neuron.amazonaws.com > /etc/yum.repos.d/neuron.repo
    rpm --import https://yum.repos.neuron.amazonaws.com/GPG-PUB-KEY-AMAZON-AWS-NEURON.PUB
    dnf install -y -q "kernel-devel-$(uname -r)" "kernel-headers-$(uname -r)"
    dnf install -y -q \
      aws-neuronx-dkms \
      aws-neuronx-runtime-lib \
      aws-neuronx-collectives \
      aws-neuronx-tools
  fi
  # neuron-ls finds every device once the driver is loaded; a node without them must not take jobs.
  /opt/aws/neuron/bin/neuron-ls > /dev/null
fi

# 4. This project in a venv on the node's own disk (conf/cluster/pcluster_*.yaml activates it in every job).
if ! command -v "$PYTHON_FOR_VENV" > /dev/null; then
  if command -v apt-get > /dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$PYTHON_FOR_VENV" "$PYTHON_FOR_VENV-venv"
  else
    dnf install -y -q "$PYTHON_FOR_VENV"
  fi
fi
# A path (a checkout or a wheel) gets the runtime and eval extras here; anything else is a complete pip requirement,
# e.g. 'nxdt-launch[runtime,eval] @ git+https://...'.
case "$PROJECT" in
  /*) if [ ! -e "$PROJECT" ]; then
        echo "nxdt: $PROJECT is not there yet; put a checkout of nxdt-launch there (docs/parallelcluster.md)" >&2
        # The head node starts before anyone could copy it; compute nodes must not start without it.
        if [ "$ROLE" = head ]; then exit 0; else exit 1; fi
      fi
      NODE_SPEC="$PROJECT[runtime,eval]" ;;
  *) NODE_SPEC="$PROJECT" ;;
esac
"$PYTHON_FOR_VENV" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# A checkout's constraints.txt holds the versions its test suite passed with (csp_tools/lock.py); its torch and
# triton lines are dropped: the Neuron packages bring their own torch, which pins its own triton.
LOCK=()
if [ -f "$PROJECT/constraints.txt" ]; then
  grep -v -i -E '^(torch|triton)==' "$PROJECT/constraints.txt" > "$VENV/constraints.txt"
  LOCK=(-c "$VENV/constraints.txt")
fi
if [ "$ROLE" = head ]; then
  # The head node renders and submits: the launcher alone.
  "$VENV/bin/pip" install -q ${LOCK[@]+"${LOCK[@]}"} "$PROJECT"
else
  "$VENV/bin/pip" install -q ${LOCK[@]+"${LOCK[@]}"} --extra-index-url https://pip.repos.neuron.amazonaws.com \
    torch-neuronx \
    neuronx-cc \
    "$NODE_SPEC"
fi
echo "nxdt: $ROLE node ready: $VENV"
