# The job script's decisions after a failed attempt, and the run's attempt history (<log_dir>/<stage>_attempts.jsonl,
# which `nxdt-launch status` shows). The batch script runs, after a training step that failed:
#
#   python -m runtime.fault_tolerance.attempts failed --attempt-dir D --exit CODE ...   -> restart | check-nodes | stop
#
# and, when that says check-nodes, the node checks on every node (node_check.py), then:
#
#   python -m runtime.fault_tolerance.attempts checked --attempt-dir D ...              -> restart | requeue LIST | stop
#
# What failed comes from what each node's runtime.torchrun wrote into the attempt's directory: hang.json (the
# watchdog's verdict), node_<node>.json (how the step ended there: a worker's exit, a signal) and, for a node that
# wrote nothing, its absence. Each decision is one line on stderr and one record in the history. Torch-free and
# quick to start: it runs on the batch host between attempts.
from __future__ import annotations

import argparse
import os
import sys
import time

from runtime.fault_tolerance.recovery import append, read_history
from runtime.io.files import read_json
from runtime.schema.facts import PREFLIGHT_EXIT_CODE, USER_ERROR_EXIT_CODE



def what_failed(attempt_dir: str, nodes: list[str], step_exit: int) -> dict:
    """The cause of a failed attempt, from its directory: hang, preflight, exit or lost node."""
    now = time.time()
    hang = read_json(os.path.join(attempt_dir, "hang.json"))
    if hang:
        return {**hang, "fault_at": hang.get("last_progress_at"), "exit_code": step_exit}
    reports = {n: read_json(os.path.join(attempt_dir, f"node_{n}.json")) for n in nodes}
    exits = [r for r in reports.values() if r and r.get("outcome") == "exit"]
    if exits:
        def victim(report: dict) -> bool:
            """A worker that stopped because another did: it said so (progress.py close), or was terminated."""
            record = next((x for x in report.get("records", []) if x.get("rank") == report.get("rank")), {})
            return record.get("section") == "peer_lost" or report.get("exit_code") == 128 + 15

        # The cause first, then the node that noticed its worker's end first (to the microsecond: torchrun's own
        # failure times are whole seconds).
        first = min(exits, key=lambda r: (victim(r), r.get("ended_at") or now, r["node"]))
        record = next((x for x in first.get("records", []) if x.get("rank") == first.get("rank")), {})
        code = first.get("exit_code")
        return {"cause": "preflight" if code == PREFLIGHT_EXIT_CODE else "exit", "node": first["node"],
                "rank": first.get("rank"), "section": record.get("section"), "step": record.get("step"),
                "exit_code": code, "fault_at": min(first.get("failed_at") or now, first.get("ended_at", now)),
                "detected_at": first.get("ended_at", now)}
    silent = [n for n, r in reports.items() if r is None]
    if silent:
        # The step it was lost in: the furthest any other node's workers got (their records say).
        steps = [x.get("step") or 0 for r in reports.values() if r for x in r.get("records", [])]
        return {"cause": "lost node", "node": silent[0], "exit_code": step_exit, "fault_at": None,
                "detected_at": now, "step": max(steps) if steps else None}
    return {"cause": "exit", "node": None, "exit_code": step_exit, "fault_at": None, "detected_at": now}


def _describe(f: dict) -> str:
    if f["cause"] == "hang":
        return f"hang of rank {f.get('rank')} on {f.get('node')} in section {f.get('section')} (step {f.get('step')})"
    if f["cause"] == "lost node":
        return f"{f.get('node')} reported nothing (the node or its torchrun died)"
    if f["cause"] == "preflight":
        return f"preflight failed on {f.get('node')} (rank {f.get('rank')})"
    where = f" of rank {f.get('rank')} on {f.get('node')}" if f.get("node") else ""
    step = f" at step {f.get('step')}" if f.get("step") else ""
    return f"exit {f.get('exit_code')}{where}{step}"


def _same_node_run(history: list[dict], job: str, node: str | None) -> int:
    """How many of this job's failures in a row, newest first, named `node`."""
    count = 0
    for record in reversed([r for r in history if r.get("job") == job and r.get("event") == "failed"]):
        if node is None or record.get("node") != node:
            break
        count += 1
    return count


def failed(args) -> str:
    history = read_history(args.history)
    found = what_failed(args.attempt_dir, args.allocation.split(), args.exit)
    record = {"event": "failed", "job": args.job, "job_id": os.environ.get("SLURM_JOB_ID"),
              "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", 0) or 0), "attempt": args.attempt,
              **{k: found.get(k) for k in ("cause", "node", "rank", "section", "step", "exit_code", "fault_at",
                                           "detected_at")}}
    if record["fault_at"] is not None:
        record["time_to_detect_s"] = round(record["detected_at"] - record["fault_at"], 3)
    repeated = _same_node_run(history, args.job, record["node"]) + 1
    if found["cause"] in ("preflight", "lost node") or (record["node"] and repeated >= args.same_node_failures):
        action, why = "check-nodes", ("checking every node of the allocation" + (
            f" ({record['node']} failed {repeated} times in a row)" if found["cause"] in ("exit", "hang") else ""))
    elif record["exit_code"] == USER_ERROR_EXIT_CODE and found["cause"] == "exit":
        action, why = "stop", "a mistake in the config (its line is above): a restart would repeat it"
    elif args.attempt < args.in_job_restarts:
        action, why = "restart", (f"restarting the workers from the newest checkpoint (restart {args.attempt + 1} of "
                                  f"at most {args.in_job_restarts}, fault_tolerance.in_job_restarts)")
    else:
        action, why = "stop", f"fault_tolerance.in_job_restarts ({args.in_job_restarts}) used up"
    append(args.history, {**record, "action": "check nodes" if action == "check-nodes" else action})
    _say(f"nxdt: {args.stage} job {args.job} attempt {args.attempt} failed: {_describe(found)}; {why}")
    return action


def checked(args) -> str:
    history = read_history(args.history)
    nodes = args.allocation.split()
    bad, transient = {}, {}
    for node in nodes:
        report = read_json(os.path.join(args.attempt_dir, f"check_{node}.json"))
        if report is None:
            bad[node] = "did not report (unreachable, or its check could not start)"
            continue
        if report.get("transient"):  # failed once, passed when run again: not bad (node_check.py)
            transient[node] = "; ".join(report["transient"].values())
        if not report.get("ok"):
            bad[node] = "; ".join(report.get("named", {}).values()) or "; ".join(
                f"{c['name']}: {c['detail']}" for c in report["checks"] if c["status"] == "fail")
    record = {"event": "node_check", "job": args.job, "job_id": os.environ.get("SLURM_JOB_ID"),
              "attempt": args.attempt, "at": time.time(), "bad_nodes": bad,
              **({"transient": transient} if transient else {})}
    if not bad:
        if args.attempt < args.in_job_restarts:
            action, line = "restart", "every node passed its checks; restarting the workers"
        else:
            action, line = "stop", (f"every node passed its checks, and fault_tolerance.in_job_restarts "
                                    f"({args.in_job_restarts}) is used up")
    else:
        named = ", ".join(f"{n} ({why})" for n, why in bad.items())
        done = sum(1 for r in history if r.get("event") == "node_check" and r.get("action") == "requeue"
                   and r.get("job_id") == record["job_id"])
        excluded = sorted(set(args.excluded.split()) | set(bad))
        usable = args.usable.split()
        healthy = [n for n in usable if n not in excluded] if usable else None  # None: sinfo said nothing
        # A restart in this allocation without the bad nodes: onto a spare one (fault_tolerance.spare_nodes), or,
        # with none, on one node fewer (run.elastic: the launch checked that layout; one step down, no further).
        in_allocation = [n for n in nodes if n not in excluded]
        nodes_now = args.nodes_now or args.min_nodes
        restarts_left = args.attempt < args.in_job_restarts
        if restarts_left and len(in_allocation) >= nodes_now:
            action, record["exclude"] = "replace", excluded
            line = (f"bad node(s): {named}; restarting on the allocation's healthy nodes "
                    f"({', '.join(in_allocation[:nodes_now])}: a spare node took the bad one's place)")
        elif (restarts_left and args.elastic and nodes_now == args.min_nodes
              and len(in_allocation) >= nodes_now - 1 >= 1):
            action, record["exclude"] = "shrink", excluded
            record["nodes_now"] = nodes_now - 1
            line = (f"bad node(s): {named}; no spare node: going on with {nodes_now - 1} of {args.min_nodes} nodes "
                    f"(run.elastic): fewer data-parallel replicas, the same global batch")
        elif done >= args.requeues_on_failure:
            action, line = "stop", (f"bad node(s): {named}; fault_tolerance.requeues_on_failure "
                                    f"({args.requeues_on_failure}) used up: launch again with cluster.exclude=[...]")
        elif healthy is not None and len(healthy) < args.min_nodes:
            action, line = "stop", (f"bad node(s): {named}; too few healthy nodes left: {len(healthy)} "
                                    f"({', '.join(healthy) or 'none'}) for a job of {args.min_nodes}")
        else:
            action = "requeue"
            record["exclude"] = excluded
            line = (f"bad node(s): {named}; requeueing with --exclude={','.join(excluded)} "
                    f"(requeue {done + 1} of at most {args.requeues_on_failure}, fault_tolerance.requeues_on_failure)")
    append(args.history, {**record, "action": action})
    if transient:
        line += "; transient, not named: " + "; ".join(f"{n} ({why})" for n, why in transient.items())
    _say(f"nxdt: {args.stage} job {args.job} node checks: {line}")
    if action in ("requeue", "replace"):
        return f"{action} {','.join(record['exclude'])}"
    if action == "shrink":
        return f"shrink {record['nodes_now']} {','.join(record['exclude'])}"
    return action


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.fault_tolerance.attempts")
    parser.add_argument("what", choices=("failed", "checked"))
    parser.add_argument("--attempt-dir", required=True)
    parser.add_argument("--history", required=True)
    parser.add_argument("--stage", default="training")
    parser.add_argument("--job", required=True, help="the job's tag: <job id>_<array task>")
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--exit", type=int, default=1)
    parser.add_argument("--in-job-restarts", type=int, default=3)
    parser.add_argument("--same-node-failures", type=int, default=2)
    parser.add_argument("--requeues-on-failure", type=int, default=2)
    parser.add_argument("--min-nodes", type=int, default=1)
    parser.add_argument("--nodes-now", type=int, default=0, help="the nodes the training step runs on now (0: "
                                                                  "--min-nodes); below it after an elastic shrink")
    parser.add_argument("--elastic", action="store_true", help="run.elastic: go on with fewer nodes when none is "
                                                               "spare")
    parser.add_argument("--allocation", default="", help="the allocation's nodes, space-separated (scontrol show "
                                                         "hostnames, on the batch host)")
    parser.add_argument("--excluded", default="", help="the nodes the job excludes already, space-separated")
    parser.add_argument("--usable", default="", help="the partition's nodes that can take work, space-separated")
    args = parser.parse_args(argv)
    print(failed(args) if args.what == "failed" else checked(args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
