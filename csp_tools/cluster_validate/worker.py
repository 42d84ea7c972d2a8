"""One collective worker: `python -m csp_tools.cluster_validate.worker --local-rank I --accelerator cpu`.

The node agent starts one per device and keeps it for the whole validation (torch is imported once). It reads
one JSON task per line on stdin, joins that task's process group through the coordinator's store (a fresh
prefix per test, so groups of different rounds never meet), runs the operations, leaves the group, and answers
one JSON line on stdout. Anything else the libraries print goes to stderr, never into the protocol.

Under torch-xla a process can join only one process group in its life, so the agent starts a fresh worker for
every task there (`--one-shot`), with torchrun's environment for that group.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m csp_tools.cluster_validate.worker")
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu", "neuron"))
    parser.add_argument("--one-shot", action="store_true", help="answer one task, then exit (torch-xla)")
    args = parser.parse_args(argv)

    # The protocol owns the real stdout; library chatter (warnings, NCCL/Neuron logs) goes to stderr.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        hooks = _hooks(args.accelerator, args.local_rank)
    except Exception as error:  # noqa: BLE001 - a device that cannot start is a result, not a crash
        answer({"ready": False, "error": f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"})
        return 1
    answer({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        task = json.loads(line)
        try:
            reply = run_task(task, args.accelerator, args.local_rank, hooks)
        except Exception as error:  # noqa: BLE001 - e.g. a peer that never joined: report, stay available
            reply = {"ok": False, "rows": [], "errors": [f"{type(error).__name__}: "
                                                         f"{' '.join(str(error).split())[:300]}"]}
        answer(reply)
        if args.one_shot:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
