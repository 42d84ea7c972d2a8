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

With --peer (issue 62), recovery from the peers' memory beside today's in-job restart from the checkpoint on disk:
a worker exits as step S's save begins (exit:rank=1:step=S:section=checkpoint, after S's update), at checkpoint
intervals 10 (S = 19: the disk's newest is step 10) and 100 (S = 99: none on disk yet), each once with
fault_tolerance.peer_state_every_n_steps=1 and once without. A larger model than above (hidden 512, 4 layers,
sequence 256), so that a step and the state are not nothing. Reported: time lost (the fault to the restarted run
finishing step S again), where the state came from, steps trained again, the state's load time and rate; then a
projection for llama3/8b and llama3/70b on trn1 from those measured rates, the estimator's step time and state per
node, and the restart's fixed part as measured here:

    python benchmarks/fault_recovery.py --peer               # ~5 minutes
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


PEER_SHAPE = ("training.model.hidden_size=512", "training.model.num_layers=4", "training.model.encoder_seq_length=256",
              "training.model.num_attention_heads=8", "training.model.ffn_hidden_size=2048")
PEER_CASES = ((10, 19, 24), (100, 99, 104))  # (checkpoint interval, fault step, steps)


def _submit(cluster: LocalSlurm, env: dict, work: Path, results: Path, overrides: list[str], fault: str) -> dict:
    """Launch, wait, and return the run's failed and recovered records, its wall time and state."""
    submitted = time.monotonic()
    launched = subprocess.run(["nxdt-launch", "cluster_type=slurm", f"cluster.partition={cluster.partition}",
                               *overrides], env={**env, "NXDT_INJECT_FAULT": fault}, cwd=work, capture_output=True,
                              text=True)
    if launched.returncode != 0:
        raise SystemExit(launched.stdout + launched.stderr)
    job = str(json.loads((results / "gpt3_tiny" / "launch.json").read_text())["stages"][0]["job_id"])
    state = cluster.wait_job(job, timeout=1800)
    training = results / "gpt3_tiny" / "training"
    history_path = training / "logs" / "training_attempts.jsonl"
    history = [json.loads(x) for x in history_path.read_text().splitlines()] if history_path.exists() else []
    steps = [json.loads(x) for x in (training / "metrics.jsonl").read_text().splitlines() if '"step_time_s"' in x]
    return {"state": state, "wall_s": time.monotonic() - submitted,
            "failed": next((r for r in history if r["event"] == "failed"), {}),
            "recovered": next((r for r in history if r["event"] == "recovered"), {}),
            "step_s": sorted(r["step_time_s"] for r in steps)[len(steps) // 2] if steps else None,
            "state_bytes": _state_bytes(training)}


def _state_bytes(training: Path) -> int:
    """One checkpoint's bytes (every rank's file): what a resume loads."""
    found = sorted((training / "checkpoints").glob("step_*"))
    return sum(f.stat().st_size for f in found[-1].glob("rank_*.pt")) if found else 0


def peer_main(args) -> int:
    cluster = LocalSlurm()
    cluster.up(timeout=60)
    env = cluster.env()
    work = Path(tempfile.mkdtemp(prefix="nxdt-peer-recovery-"))
    data = counting_corpus(work / "data")
    rows = []
    for every, fault_step, steps in PEER_CASES:
        for mode in ("disk", "peer"):
            results = work / f"{mode}_{every}"
            extra = ("training.trainer.num_nodes=2", "training.trainer.devices=1", "env_vars.OMP_NUM_THREADS=1",
                     "training.fault_tolerance.step_timeout_floor_s=60", *PEER_SHAPE,
                     *(["training.fault_tolerance.peer_state_every_n_steps=1"] if mode == "peer" else []))
            overrides = [o for o in training_overrides(data, results, steps=steps, every=every, extra=extra)
                         if "encoder_seq_length=64" not in o and "hidden_size=128" not in o]
            run = _submit(cluster, env, work, results, overrides,
                          f"exit:rank=1:step={fault_step}:section=checkpoint")
            r = run["recovered"]
            rows.append({"mode": mode, "every": every, "fault_step": fault_step, "state": run["state"],
                         "time_lost_s": r.get("time_lost_s"), "time_to_detect_s": run["failed"].get("time_to_detect_s"),
                         "time_to_recover_s": r.get("time_to_recover_s"), "state_from": r.get("state_from"),
                         "resumed_from_step": r.get("resumed_from_step"), "steps_redone": r.get("steps_redone"),
                         "state_load_s": r.get("state_load_s"), "state_bytes": run["state_bytes"],
                         "step_s": run["step_s"], "wall_s": round(run["wall_s"], 1)})
            print(json.dumps(rows[-1]), flush=True)
    _peer_table(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["state"] == "COMPLETED" for r in rows) else 1


def _peer_table(rows: list[dict]) -> None:
    print("\n| checkpoint every | fault at | state from | resumed from | steps redone | load (s) | load rate (MB/s) | "
          "time to recover (s) | time lost (s) | time lost / peer's |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        peer = next(r for r in rows if r["every"] == row["every"] and r["mode"] == "peer")
        rate = (row["state_bytes"] / row["state_load_s"] / 1e6) if row["state_load_s"] and row["state_bytes"] else None
        cells = [row["every"], row["fault_step"], row["state_from"], row["resumed_from_step"], row["steps_redone"],
                 row["state_load_s"], None if rate is None else f"{rate:.0f}", row["time_to_recover_s"],
                 row["time_lost_s"], f"{row['time_lost_s'] / peer['time_lost_s']:.2f}"
                 if row["time_lost_s"] and peer["time_lost_s"] else None]
        print("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    _projection(rows)


def _projection(rows: list[dict]) -> None:
    """Time lost per failure for the recipes on trn1: the restart's fixed part as measured here (time to recover less
    the load and the steps trained again), the state per node at the load rates measured here, and the steps
    trained again at the estimator's step time (on average half an interval from the disk, one step from a peer
    refreshed every step)."""
    from launcher.cache import composed
    from launcher.estimator import estimate

    disk = [r for r in rows if r["mode"] == "disk" and r["state_load_s"]]
    peer = [r for r in rows if r["mode"] == "peer" and r["state_load_s"]]
    if not disk or not peer:
        return
    rate = {name: sum(r["state_bytes"] for r in rs) / sum(r["state_load_s"] for r in rs)
            for name, rs in (("disk", disk), ("peer", peer))}
    # time to recover = the restart + the state's load + the first step: the restart is what remains.
    fixed = min(r["time_to_recover_s"] - (r["state_load_s"] or 0) - (r["step_s"] or 0)
                for r in rows if r["time_to_recover_s"])
    print(f"\nprojection (trn1): restart {fixed:.1f} s fixed, disk {rate['disk'] / 1e9:.2f} GB/s, peer "
          f"{rate['peer'] / 1e9:.2f} GB/s per node as measured here\n")
    print("| recipe | state per node (GiB) | step (s, estimator) | checkpoint every | disk: time lost (min) | "
          "peer: time lost (min) | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for recipe in ("llama3/8b", "llama3/70b"):
        e = estimate(composed(["stages=[training]", f"training={recipe}"])["training"], device="trn1",
                     vocab_size=128256)
        node_bytes = (e.memory.weights + e.memory.optimizer) * e.layout.devices_per_node
        step = e.step.total_s
        for every in (10, 100):
            disk_s = fixed + node_bytes / rate["disk"] + every / 2 * step
            peer_s = fixed + node_bytes / rate["peer"] + 1 * step
            print(f"| {recipe} | {node_bytes / 2**30:.0f} | {step:.0f} | {every} | {disk_s / 60:.1f} | "
                  f"{peer_s / 60:.1f} | {disk_s / peer_s:.1f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--step-floor", type=float, default=10.0, help="fault_tolerance.step_timeout_floor_s")
    parser.add_argument("--checkpoint-timeout", type=float, default=15.0, help="fault_tolerance.checkpoint_timeout_s")
    parser.add_argument("--setup-timeout", type=float, default=120.0, help="fault_tolerance.setup_timeout_s")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--peer", action="store_true", help="peer-held state against the disk's in-job restart")
    args = parser.parse_args()
    if args.peer:
        return peer_main(args)

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
        run = _submit(cluster, env, work, results, overrides, "" if fault == "none" else fault)
        state, wall, failed, recovered = run["state"], run["wall_s"], run["failed"], run["recovered"]
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
