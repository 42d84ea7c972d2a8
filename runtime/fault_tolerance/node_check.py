# The node checks a job runs on every node of its allocation after a failure it cannot put down to the training
# (a failed preflight, the same node failing again, a node that reported nothing):
#
#   srun --ntasks-per-node=1 python -m runtime.fault_tolerance.node_check --out ATTEMPT_DIR --accelerator cpu \
#        --results-dir RESULTS_DIR
#
# Each node runs cluster-validate's own checks of itself (csp_tools/cluster_validate/health.py local_checks: the
# accelerator count for its instance type, EFA, free space and a write/read round trip on the results directory,
# available memory), and the injected fault's (runtime/schema/faults.py unhealthy:node=NAME), and writes
# check_<node>.json; attempts.py reads them. A check that fails runs again after a pause, and names the node only
# when it fails again: cluster-validate's rule for every suspect (csp_tools/cluster_validate/confirm.py); one that
# passes then is reported as transient. The training preflight's collective check runs again in the next attempt
# itself. Exits 0 when the node passes, 1 when it fails.
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

from runtime.fault_tolerance.progress import allocation_tag, claim_fault
from runtime.schema import faults

FAIL = "fail"


def injected_unhealthy(node: str, results_dir: str) -> str | None:
    """Why this node's health check fails by injection, or None. The fault fires once per run, and holds for the
    rest of the allocation that found it: its marker names that job and requeue count."""
    fault, _ = faults.parse(os.environ.get(faults.ENV, ""))
    if fault is None or fault.kind not in ("unhealthy", "lost") or fault.node != node:
        return None
    here = allocation_tag()
    marker = os.path.join(results_dir, faults.FIRED)
    if fault.kind == "lost":  # bad from its loss on, in the allocation that lost it (progress.py _lose_node)
        try:
            with open(marker) as f:
                return f"injected fault {faults.ENV}={fault}" if f.read().strip() == here else None
        except OSError:
            return None
    first = claim_fault(marker, here)
    if first is not None and first != here:
        return None  # fired in an earlier allocation
    return f"injected fault {faults.ENV}={fault}"


def check(node: str, accelerator: str, results_dir: str) -> list[dict]:
    from csp_tools.cluster_validate import config, health

    cfg = config.parse({"accelerator": accelerator, "run": {"results_dir": results_dir},
                        "health": {"paths": [results_dir], "timeout_s": 60}})
    instance_type = health.detect_instance_type(cfg.instance_type, cfg.health.timeout_s)
    checks = [c.to_json() for c in health.local_checks(cfg, node, instance_type, token="")]
    injected = injected_unhealthy(node, results_dir)
    if injected:
        checks.append({"name": "injected", "status": FAIL, "detail": injected, "data": {}})
    return checks


def confirmed(run: Callable[[], list[dict]], pause: Callable[[], None]) -> dict:
    """The node's checks (`run`), each failed one run again after `pause`: the node is bad only where a failure
    repeats. {"ok", "checks" (the first run's), "named" and "transient" (check name -> why)}."""
    from csp_tools.cluster_validate.confirm import Remeasured, confirm, recheck

    first = run()
    failed = {c["name"]: f"{c['name']}: {c['detail']}" for c in first if c["status"] == FAIL}

    def again(names: list[str]) -> dict[str, Remeasured]:
        pause()
        now = {c["name"]: c for c in run()}
        return {name: recheck(next(c for c in first if c["name"] == name), now.get(name)) for name in names}

    found = confirm(failed, again)
    return {"ok": not found.named, "checks": first, "named": found.named, "transient": found.transient}


def main(argv: list[str] | None = None) -> int:
    from runtime.fault_tolerance.watchdog import node_name
    from runtime.io.files import atomic_write_json

    parser = argparse.ArgumentParser(prog="python -m runtime.fault_tolerance.node_check")
    parser.add_argument("--out", required=True, help="the attempt's directory: check_<node>.json goes there")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--results-dir", required=True, help="the run's results directory (checked, and where the "
                                                             "injected fault's marker is)")
    args = parser.parse_args(argv)
    from csp_tools.cluster_validate.confirm import HEALTH_RECHECK_PAUSE_S

    node = node_name()

    def run() -> list[dict]:
        try:
            return check(node, args.accelerator, args.results_dir)
        except Exception as error:  # a check that cannot run is a failed node, named with why
            return [{"name": "node check", "status": FAIL, "detail": f"could not run: {error}", "data": {}}]

    found = confirmed(run, lambda: time.sleep(HEALTH_RECHECK_PAUSE_S))
    atomic_write_json(os.path.join(args.out, f"check_{node}.json"), {"node": node, **found})
    verdict = "; ".join(found["named"].values()) or "every check passed"
    if found["transient"]:
        verdict += "; " + "; ".join(found["transient"].values())
    print(f"nxdt: node check on {node}: {'pass' if found['ok'] else 'FAIL'}: {verdict}", flush=True)
    return 0 if found["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
