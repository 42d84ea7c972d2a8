"""Command line for the local test cluster.

    python -m csp_tools.local_slurm up [--root DIR] [--timeout S]   # start (or keep a healthy one), wait for idle
    python -m csp_tools.local_slurm status [--root DIR]             # sinfo
    python -m csp_tools.local_slurm down [--root DIR]               # cancel jobs, stop daemons, delete all but logs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from csp_tools.local_slurm.cluster import DEFAULT_ROOT, ClusterError, LocalSlurm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m csp_tools.local_slurm", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help=f"state directory (default {DEFAULT_ROOT})")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds `up` waits for idle nodes")
    args = parser.parse_args(argv)
    cluster = LocalSlurm(root=args.root.resolve())
    try:
        if args.command == "up":
            started = cluster.up(timeout=args.timeout)
            print("started" if started else "already running and healthy", f"(root {cluster.root})")
            print(cluster.status().rstrip("\n"))
            print(f"export SLURM_CONF={cluster.conf_path}")
        elif args.command == "down":
            cluster.down()
            print(f"stopped; logs kept in {cluster.root / 'log'}")
        else:
            print(cluster.status().rstrip("\n"))
    except (ClusterError, FileNotFoundError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
