# Peer-held state (runtime/checkpoint/peer.py, runtime/fault_tolerance/peer_store.py): checkpoints saved into other
# nodes' memory through real peer stores (three `python -m runtime.fault_tolerance.peer_store serve` processes, one
# per simulated node, on loopback), by real gloo ranks. What it proves:
#   - each rank file is held by exactly two stores, its own node's and the next one's; the small files by all;
#   - with one node's store killed (SIGKILL), every rank file is still found, and a run resumed from the peers at
#     another layout continues bitwise as the run that saved (the disk checkpoint's resharding, unchanged);
#   - a damaged copy is named and never loaded.
# The Slurm test (test_peer_recovery_slurm.py) kills a node of a real job; this one is the storage alone, quick.
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch.distributed as dist

from runtime.checkpoint import Checkpointer, committed_checkpoints, load_checkpoint
from runtime.checkpoint.integrity import check_checkpoint
from runtime.checkpoint.peer import SCHEME, PeerStorage
from tests.checkpoint import harness as CH
from tests.runtime_parallel.dist_utils import run_distributed

NODES = ("node1", "node2", "node3")


@pytest.fixture
def stores(tmp_path):
    """Three stores, one per node name; node3 is the spare no rank runs on."""
    registry = tmp_path / "registry"
    procs = {node: subprocess.Popen([sys.executable, "-m", "runtime.fault_tolerance.peer_store", "serve",
                                     "--registry", str(registry), "--advertise", "127.0.0.1"],
                                    env={**os.environ, "SLURMD_NODENAME": node}, stdout=subprocess.DEVNULL)
             for node in NODES}
    deadline = time.monotonic() + 30
    while len(list(registry.glob("*.json")) if registry.exists() else []) < len(NODES):
        assert time.monotonic() < deadline, "the stores did not announce themselves"
        time.sleep(0.05)
    yield str(registry), procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


def _save(registry: str, layout: CH.L) -> dict:
    """Two ranks per node (node1, node2): train, save steps 2 and 3 into the peers, one more step."""
    os.environ["SLURMD_NODENAME"] = NODES[dist.get_rank() // 2]
    cfg, topo, model, optimizer = CH.build("gpt", layout, seed=1234)
    peer = Checkpointer(SCHEME + registry, rank=dist.get_rank(), world_size=dist.get_world_size(), token="ab",
                        keep_last=1, async_save=True, await_commit=True, log=lambda m: None)
    for i in range(3):
        CH.step(cfg, topo, model, optimizer, i)
        if i >= 1:
            peer.save(i + 1, model, optimizer, topo, extra={"step": i + 1}, config=None)
    peer.wait()  # committed, seen from this rank: await_commit
    return {"next_loss": CH.step(cfg, topo, model, optimizer, 3),
            "holders": [s.node for s in peer.storage.holders()]}


def _resume(registry: str, layout: CH.L) -> dict:
    os.environ["SLURMD_NODENAME"] = NODES[dist.get_rank() // 2]
    cfg, topo, model, optimizer = CH.build("gpt", layout, seed=99)
    storage = PeerStorage(SCHEME + registry)
    checkpoint = committed_checkpoints(storage)[-1]
    problem = check_checkpoint(storage, checkpoint, (dist.get_rank(), dist.get_world_size()))
    info = load_checkpoint(storage, checkpoint, model, optimizer, topo, rank=dist.get_rank(), verified=True)
    return {"problem": problem, "step": info["extra"]["step"], "next_loss": CH.step(cfg, topo, model, optimizer, 3),
            "read": storage.bytes_read, "alive": [s.node for s in storage.stores() if s.alive]}


def _listing(registry: str, node: str) -> list[str]:
    entry = json.loads(open(os.path.join(registry, f"{node}.json")).read())
    with urllib.request.urlopen(f"http://{entry['host']}:{entry['port']}/?prefix=", timeout=10) as response:
        return json.loads(response.read())["keys"]


def test_peer_copies_survive_a_lost_node_and_resume_at_another_layout(stores):
    registry, procs = stores
    saved = run_distributed(_save, world_size=4, args=(registry, CH.L(tp=2)))
    assert [r["holders"] for r in saved] == [["node1", "node2"]] * 2 + [["node2", "node3"]] * 2
    held = {node: _listing(registry, node) for node in NODES}
    # Only the newest save is kept (keep_last 1): step 3, with its commit marker on every store.
    names = {key.split("/")[0] for keys in held.values() for key in keys}
    assert len(names) == 1 and names.pop().startswith("step_00000003."), held
    rank_files = {r: [n for n in NODES if any(k.endswith(f"rank_{r:05d}.pt") for k in held[n])] for r in range(4)}
    assert rank_files == {0: ["node1", "node2"], 1: ["node1", "node2"], 2: ["node2", "node3"],
                          3: ["node2", "node3"]}, rank_files
    assert all(any(k.endswith("/COMMIT") for k in keys) for keys in held.values()), held

    procs["node2"].send_signal(signal.SIGKILL)  # the node holding a copy of every rank's state
    procs["node2"].wait()
    resumed = run_distributed(_resume, world_size=4, args=(registry, CH.L(pp=2)))
    assert {r["problem"] for r in resumed} == {None} and {r["step"] for r in resumed} == {3}
    assert {r["next_loss"] for r in resumed} == {saved[0]["next_loss"]}, (resumed, saved)
    assert all(r["read"] > 0 and "node2" not in r["alive"] for r in resumed), resumed


def test_a_damaged_peer_copy_is_named(stores):
    registry, _ = stores
    run_distributed(_save, world_size=2, args=(registry, CH.L()))
    storage = PeerStorage(SCHEME + registry, node="node1")
    checkpoint = committed_checkpoints(storage)[-1]
    key = f"{checkpoint.name}/rank_00001.pt"
    data = bytearray(storage.get_bytes(key))
    data[len(data) // 2] ^= 0xFF
    for store in storage.stores():  # every copy of it
        store.request("PUT", key, bytes(data))
    problem = check_checkpoint(storage, checkpoint, (1, 2))
    assert problem is not None and "rank_00001.pt" in problem, problem
