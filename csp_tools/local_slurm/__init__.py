"""A real three-node Slurm cluster on localhost for tests and for trying nxdt-launch (see cluster.py)."""

from csp_tools.local_slurm.cluster import DEFAULT_ROOT, NODES, TERMINAL_STATES, ClusterError, LocalSlurm

__all__ = ["DEFAULT_ROOT", "NODES", "TERMINAL_STATES", "ClusterError", "LocalSlurm"]
