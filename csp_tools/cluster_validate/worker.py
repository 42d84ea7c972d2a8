"""One collective worker: `python -m csp_tools.cluster_validate.worker --local-rank I --accelerator cpu`.

The node agent starts one per device and keeps it for the whole validation. It reads
one JSON task per line on stdin, joins that task's process group through the coordinator's store (a fresh
prefix per test, so groups of different rounds never meet), runs the operations, leaves the group, and answers
one JSON line on stdout. Anything else the libraries print goes to stderr, never into the protocol.

Under torch-xla a process can join only one process group in its life, so the agent starts a fresh worker for
every task there (`--one-shot`), with torchrun's environment for that group.

On CPUs and GPUs the agent forks its workers from one server process that has imported torch (`forked`, see
node.WorkerPool): a node's 8 or 32 workers import torch once, not each. The server touches no device, so each
worker starts its own device (torch.cuda.set_device) after the fork.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta


def _hooks(accelerator: str, local_rank: int):
    import torch

    from csp_tools.cluster_validate.measure import DeviceHooks

    if accelerator == "gpu":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        return DeviceHooks(device, synchronize=lambda: torch.cuda.synchronize(device))
    if accelerator == "neuron":
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" backend

        device = torch_xla.device() if hasattr(torch_xla, "device") else xm.xla_device()
        return DeviceHooks(device, synchronize=xm.wait_device_ops, step=getattr(torch_xla, "sync", xm.mark_step))
    return DeviceHooks(torch.device("cpu"))


def run_task(task: dict, accelerator: str, local_rank: int, hooks) -> dict:
    import torch.distributed as dist

    from csp_tools.cluster_validate.measure import measure_sweep

    timeout = timedelta(seconds=float(task["timeout_s"]))
    if accelerator == "neuron":
        dist.init_process_group("xla", init_method="xla://")
    else:
        store = dist.TCPStore(task["store_host"], int(task["store_port"]), is_master=False, timeout=timeout)
        options = {"device_id": hooks.device} if accelerator == "gpu" else {}
        dist.init_process_group(task["backend"], store=dist.PrefixStore(task["prefix"], store), rank=task["rank"],
                                world_size=task["world"], timeout=timeout, **options)
    try:
        rows = measure_sweep(task["operations"], task["sizes"], dtype=task["dtype"], warmup=task["warmup"],
                             iters=task["iters"], check=task["check"], hooks=hooks)
    finally:
        dist.destroy_process_group()
    errors = sorted({row.error for row in rows if row.error})
    return {"ok": not errors, "rows": [row.to_json() for row in rows] if task.get("report") else [],
            "errors": errors}


def serve(local_rank: int, accelerator: str, one_shot: bool, tasks, protocol) -> int:
    """Say ready (or why not) on `protocol`, then answer each JSON line of `tasks` with one JSON line."""
    def answer(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        hooks = _hooks(accelerator, local_rank)
    except Exception as error:  # noqa: BLE001 - a device that cannot start is a result, not a crash
        answer({"ready": False, "error": f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"})
        return 1
    answer({"ready": True, "pid": os.getpid()})
    for line in tasks:
        if not line.strip():
            continue
        task = json.loads(line)
        try:
            reply = run_task(task, accelerator, local_rank, hooks)
        except Exception as error:  # noqa: BLE001 - e.g. a peer that never joined: report, stay available
            reply = {"ok": False, "rows": [], "errors": [f"{type(error).__name__}: "
                                                         f"{' '.join(str(error).split())[:300]}"]}
        answer(reply)
        if one_shot:
            break
    return 0


def _protocol_out(fd: int):
    """The protocol owns `fd`; library chatter (warnings, NCCL/Neuron logs) goes to stderr, never into it."""
    protocol = os.fdopen(fd, "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


def _take(connection) -> int:
    """A multiprocessing Connection's pipe as a plain descriptor, for a line protocol (the Connection closed)."""
    fd = os.dup(connection.fileno())
    connection.close()
    return fd


def forked(local_rank: int, accelerator: str, env: dict, tasks, replies) -> None:
    """A worker forked from the agent's server process (node.WorkerPool): its environment is `env` as a fresh
    worker's would be, its protocol the two pipe ends it was given."""
    import torch

    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or 1))  # read when the server imported torch
    protocol = _protocol_out(_take(replies))
    with os.fdopen(_take(tasks), "r") as lines:
        code = serve(local_rank, accelerator, False, lines, protocol)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m csp_tools.cluster_validate.worker")
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu", "neuron"))
    parser.add_argument("--one-shot", action="store_true", help="answer one task, then exit (torch-xla)")
    args = parser.parse_args(argv)
    protocol = _protocol_out(os.dup(1))
    return serve(args.local_rank, args.accelerator, args.one_shot, sys.stdin, protocol)


if __name__ == "__main__":
    sys.exit(main())
