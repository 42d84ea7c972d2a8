"""A FAKE Slurm head node (shell scripts named as Slurm's clients), for what the real local cluster cannot show:
a cluster whose every trn1 node is busy, where nothing may be submitted. Each call is logged to `calls`, so a test
can tell whether Slurm was asked at all; sbatch refuses. The real 3-node cluster is tests/slurm_cluster.py."""

from __future__ import annotations

from pathlib import Path

COMMANDS = {
    "sinfo": """case " $* " in
  *" -t idle "*) ;;                              # no idle node in any partition
  *) printf 'trn1-st-1\\ntrn1-st-2\\n' ;;
esac""",
    "squeue": "printf '%s\\n' 101 102",                 # two jobs hold the nodes
    "scontrol": "echo 'Slurmctld(primary) at fake-head is UP'",
    "sbatch": "echo 'fake sbatch: a dry run must not submit' >&2; exit 1",
}


def install(directory: Path) -> tuple[Path, Path, Path]:
    """Write the fake clients and a slurm.conf under `directory`: (bin directory to put first on PATH, the
    slurm.conf for SLURM_CONF, the call log). cluster_type=auto finds sbatch and the conf, and picks Slurm."""
    bin_dir = directory / "fake-slurm"
    bin_dir.mkdir(parents=True)
    calls = directory / "slurm-calls"
    for name, body in COMMANDS.items():
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\necho \"{name} $*\" >> {calls}\n{body}\n")
        script.chmod(0o755)
    conf = bin_dir / "slurm.conf"
    conf.write_text("# fake: only its existence is read\n")
    return bin_dir, conf, calls
