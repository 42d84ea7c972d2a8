"""Self-healing jobs (docs/fault_tolerance.md): workers report progress (progress.py) to a watchdog outside them on
each node (watchdog.py, in runtime/torchrun.py); the job script restarts a failed attempt, checks the nodes
(node_check.py) and requeues without a bad one, as attempts.py decides and records. Torch-free."""
