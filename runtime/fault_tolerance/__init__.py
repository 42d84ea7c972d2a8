"""Self-healing jobs (docs/fault_tolerance.md): workers report progress (progress.py) to a watchdog outside them on
each node (watchdog.py, in runtime/torchrun.py); the job script restarts a failed attempt, checks the nodes
(node_check.py) and requeues without a bad one, or restarts onto a spare node or onto fewer (elastic.py), as
attempts.py decides and records; peer_store.py holds copies of the workers' state in each node's memory for a
restart to resume from. Torch-free."""
