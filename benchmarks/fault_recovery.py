"""Time to detect and time to recover from each injected fault (docs/fault_tolerance.md), on the local 3-node Slurm,
beside the same job uninterrupted in the same run.

Each job is a 2-node training of gpt3/tiny's shape on a counting corpus (fp32, dp=2, one CPU worker per node, a
checkpoint every 4 of 24 steps), submitted with one NXDT_INJECT_FAULT at step 10, one job after the other so that
none shares the cores with another:

    none                                  the reference: no fault
    exit:rank=1:step=10                   a worker dies; the job restarts in the same allocation
    hang:rank=1:step=10                   a worker stops in its step; the watchdog's step timeout (the floor) finds it
    hang:rank=1:step=8:section=checkpoint a worker stops in step 8's save; the checkpoint timeout finds it
    unhealthy:node=node2                  node2 fails its preflight; the job checks its nodes, requeues without node2

The figures come from the run's attempt history and metrics.jsonl (runtime/fault_tolerance/recovery.py):
time to detect (fault to the job noticing), time to recover (noticing to the restarted run's first step), time lost
(fault to the restarted run finishing that step again), and each job's wall time from submission to COMPLETED against
the reference's. Needs root and the local Slurm (csp_tools/local_slurm; started here if it is not up).

    python benchmarks/fault_recovery.py                      # ~4 minutes
    python benchmarks/fault_recovery.py --step-floor 20 --checkpoint-timeout 30
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from csp_tools.local_slurm import LocalSlurm  # noqa: E402
from tests.checkpoint.launch_helpers import counting_corpus, training_overrides  # noqa: E402

FAULTS = ("none", "exit:rank=1:step=10", "hang:rank=1:step=10", "hang:rank=1:step=8:section=checkpoint",
          "unhealthy:node=node2")


def _wait(cluster: LocalSlurm, job: str, timeout: float) -> str:
    return cluster.wait_job(job, timeout=timeout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--step-floor", type=float, default=10.0, help="fault_tolerance.step_timeout_floor_s")
    parser.add_argument("--checkpoint-timeout", type=float, default=15.0, help="fault_tolerance.checkpoint_timeout_s")
    parser.add_argument("--setup-timeout", type=float, default=120.0, help="fault_tolerance.setup_timeout_s")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()

    cluster = LocalSlurm()
    cluster.up(timeout=60)
    env = cluster.env()
    work = Path(tempfile.mkdtemp(prefix="nxdt-fault-recovery-"))
    data = counting_corpus(work / "data")
    rows = []
    for fault in FAULTS:
        name = fault.split(":")[0] + ("_checkpoint" if "checkpoint" in fault else "")
        results = work / name
        overrides = training_overrides(data, results, steps=args.steps, every=4, extra=(
            "training.trainer.num_nodes=2", "training.trainer.devices=1", "env_vars.OMP_NUM_THREADS=1",
            "training.trainer.preflight=true", "training.trainer.preflight_timeout_s=30",
            f"training.fault_tolerance.step_timeout_floor_s={args.step_floor:g}",
            f"training.fault_tolerance.setup_timeout_s={args.setup_timeout:g}",
            f"training.fault_tolerance.checkpoint_timeout_s={args.checkpoint_timeout:g}"))
        submitted = time.monotonic()
        launched = subprocess.run(["nxdt-launch", "cluster_type=slurm", f"cluster.partition={cluster.partition}",
                                   *overrides], env={**env, "NXDT_INJECT_FAULT": "" if fault == "none" else fault},
                                  cwd=work, capture_output=True, text=True)
        if launched.returncode != 0:
            print(launched.stdout + launched.stderr, file=sys.stderr)
            return 1
        job = str(json.loads((results / "gpt3_tiny" / "launch.json").read_text())["stages"][0]["job_id"])
        state = _wait(cluster, job, timeout=900)
        wall = time.monotonic() - submitted
        training = results / "gpt3_tiny" / "training"
        history_path = training / "logs" / "training_attempts.jsonl"
        history = [json.loads(x) for x in history_path.read_text().splitlines()] if history_path.exists() else []
        failed = next((r for r in history if r["event"] == "failed"), {})
        recovered = next((r for r in history if r["event"] == "recovered"), {})
        rows.append({"fault": fault, "state": state, "wall_s": round(wall, 1), "cause": failed.get("cause"),
                     "node": failed.get("node"), "section": failed.get("section"),
                     "time_to_detect_s": failed.get("time_to_detect_s"),
                     "time_to_recover_s": recovered.get("time_to_recover_s"),
                     "time_lost_s": recovered.get("time_lost_s"),
                     "resumed_from_step": recovered.get("resumed_from_step")})
        print(json.dumps(rows[-1]), flush=True)
    reference = rows[0]["wall_s"]
    print(f"\ntimeouts: step floor {args.step_floor:g} s, checkpoint {args.checkpoint_timeout:g} s, "
          f"setup {args.setup_timeout:g} s\n")
    print("| fault | found as | time to detect (s) | time to recover (s) | time lost (s) | resumed from | "
          "job wall (s) | wall / no fault |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        found = "-" if row["cause"] is None else f"{row['cause']} on {row['node']}" + (
            f" in {row['section']}" if row["cause"] == "hang" else "")
        cells = [row["fault"], found, row["time_to_detect_s"], row["time_to_recover_s"], row["time_lost_s"],
                 row["resumed_from_step"], row["wall_s"], f"{row['wall_s'] / reference:.2f}"]
        print("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["state"] == "COMPLETED" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
