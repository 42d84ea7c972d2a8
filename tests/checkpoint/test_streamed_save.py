# The asynchronous save (runtime/checkpoint/staging.py) holds no copy of the state: the writer streams the live
# tensors (on CPU in place; an accelerator's through a bounded ring), and the optimizer's next update first brings
# what is not yet written into the ring. Checked without timing: the writer is held at its first chunk by a gate, so
# the update finds the rest unwritten every time. The accelerators' paths differ only in their transfer
# (runtime/device.py): CPU stand-ins of them run the same code here (a GPU's chunks, XLA's whole tensors); the XLA
# path itself runs in tests/runtime_xla/test_streamed_save_xla.py.
import threading
import time

import pytest
import torch
import torch.distributed as dist

from runtime.checkpoint import Checkpointer, full_tensors, open_storage, read_rank_files, rankfile
from runtime.checkpoint.integrity import DamagedCheckpoint
from runtime.checkpoint.staging import ChunkRing, StreamedSnapshot
from runtime.device import HostTransfer
from runtime.schema.facts import CHECKPOINT_CHUNK_BYTES, checkpoint_staging_bytes
from runtime.parallel.data_parallel import data_parallel_of
from tests.checkpoint import harness as CH
from tests.runtime_parallel.dist_utils import run_distributed

MIB = 1 << 20


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_the_update_copies_only_what_the_ring_holds_and_the_writer_sees_the_saved_bytes():
    """Six 1 MiB chunks, a ring of two: the writer holds chunk 0 in place; the update (freeze) copies chunks into
    the two slots as the writer frees them and returns once none is left to read in place; then the tensors
    change, and the writer still gets every saved byte."""
    tensors = [torch.arange(i * 3 * 2**18, (i * 3 + 2) * 2**18, dtype=torch.float32) for i in range(3)]  # 2 MiB
    saved = [t.clone() for t in tensors]
    ring = ChunkRing(2 * MIB, chunk=MIB)
    snapshot = StreamedSnapshot("step", tensors, ring)
    chunks = snapshot.chunks()
    written = {}

    def take():
        i, start, data = next(chunks)
        written[(i, start)] = data  # a view of the tensor (in place) or of a ring slot
        return (i, start), bytes(data)

    first = take()  # chunk 0, read in place
    freeze = threading.Thread(target=snapshot.freeze)
    freeze.start()
    _until(lambda: snapshot.staged_bytes == 2 * MIB, "the update copies chunks 1 and 2 into the ring")
    assert freeze.is_alive()  # and waits: the ring is full and chunk 0 is still being read in place
    got = [first]
    for staged in (3, 4, 5):  # each chunk the writer takes frees a slot for the next copy
        got.append(take())
        got.append(take()) if staged == 3 else None
        _until(lambda: snapshot.staged_bytes == staged * MIB, f"the update copies chunk {staged}")
    freeze.join(60)
    assert not freeze.is_alive()  # chunk 5 copied, none read in place: the update may change the tensors
    assert ring.nbytes == 2 * MIB and snapshot.staged_bytes == 5 * MIB
    for t in tensors:
        t.fill_(-1.0)
    got.append(((2, 0), bytes(written[(2, 0)])))  # chunk 4, taken before the change, read after it
    got.append(take())  # chunk 5
    with pytest.raises(StopIteration):
        take()
    out = {key: data for key, data in got}
    for i, t in enumerate(saved):
        raw = t.view(torch.uint8).numpy().tobytes()
        assert out[(i, 0)] + out[(i, MIB)] == raw, i


def test_without_a_ring_the_update_waits_for_the_whole_write():
    tensors = [torch.ones(2**18) * i for i in range(3)]
    snapshot = StreamedSnapshot("step", tensors, ChunkRing(0, chunk=MIB))
    chunks = snapshot.chunks()
    next(chunks)
    freeze = threading.Thread(target=snapshot.freeze)
    freeze.start()
    next(chunks)
    assert freeze.is_alive() and snapshot.staged_bytes == 0
    next(chunks)  # the last chunk, still read in place
    assert freeze.is_alive()
    with pytest.raises(StopIteration):
        next(chunks)
    freeze.join(60)
    assert not freeze.is_alive() and snapshot.staged_bytes == 0


class Chunked(HostTransfer):
    """A GPU's transfer on CPU: the writer never reads the live tensors, every chunk is copied into a ring slot."""

    in_place = False


class Whole(HostTransfer):
    """XLA's on CPU: only whole flat buffers are fetched (into memory of their own), never after release()."""

    in_place, whole_tensors = False, True

    def __init__(self, bases):
        super().__init__(bases)
        self.sizes = [t.numel() * t.element_size() for t in bases]

    def fetch(self, base, start, end, into):
        assert into is None and (start, end) == (0, self.sizes[base]), "a whole tensor, into its own memory"
        return self.live(base, start, end).clone()

    def release(self):
        self._flat = None  # a fetch after this fails: the update may change the tensors now


def _gated_save(directory: str, ring_bytes: int, freeze: bool, transfer=None) -> dict:
    """A sync save at step 2, and an async save at step 2 whose writer is held at its first chunk until the next
    update has begun copying (or, with freeze off, a naive share: until the update has run)."""
    cfg, topo, model, optimizer = CH.build("llama", CH.L(tp=1, zero1=True), seed=3)
    for i in range(2):
        CH.step(cfg, topo, model, optimizer, i)
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = Checkpointer(f"{directory}/sync", rank=rank, world_size=world, token="0", async_save=False)
    sync.save(2, model, optimizer, topo, extra={"step": 2}, config={})
    streamed = Checkpointer(f"{directory}/async", rank=rank, world_size=world, token="0", async_save=True,
                            deferred_copy=True, ring_bytes=ring_bytes, transfer=transfer)
    stepped = threading.Event()
    write, gate = rankfile._pwrite_all, []

    def held(fd, data, offset):
        if not gate:  # the first chunk of tensor bytes
            gate.append(1)
            _until(lambda: streamed._snapshot.staged_bytes > 0 if freeze else stepped.is_set(), "gate")
        write(fd, data, offset)

    rankfile._pwrite_all = held
    if not freeze:
        streamed.wait_for_copy = lambda: None
    try:
        streamed.save(2, model, optimizer, topo, extra={"step": 2}, config={})
        CH.step(cfg, topo, model, optimizer, 2)  # changes the live weights and moments in place
        stepped.set()
        staged = streamed._snapshot.staged_bytes
        streamed.wait()
    finally:
        rankfile._pwrite_all = write
    dist.barrier()
    return {"staged": staged, "saved_bytes": streamed.last_host_bytes, "sync_saved_bytes": sync.last_host_bytes,
            "staging_bytes": streamed.staging_bytes,
            "largest_buffer": max(t.numel() * t.element_size() for b in data_parallel_of(model).buckets
                                  for t in (b.param_buffer, *optimizer.exp_avg))}


def _equal_to_sync(directory) -> bool:
    a = full_tensors(read_rank_files(open_storage(directory / "sync"), "step_00000002.0"))
    b = full_tensors(read_rank_files(open_storage(directory / "async"), "step_00000002.0"))
    assert a.names() == b.names() and a.names()
    return all(torch.equal(a.get(name, key), b.get(name, key)) for name in a.names()
               for key in ("value", "exp_avg", "exp_avg_sq"))


def test_a_save_the_next_update_overlaps_writes_what_a_sync_save_writes(tmp_path):
    ranks = run_distributed(_gated_save, world_size=2, args=(str(tmp_path), 2 * CHECKPOINT_CHUNK_BYTES, True))
    # The update found all but the first chunk unwritten and copied some of it: the ring is what it held.
    assert all(0 < r["staged"] <= r["saved_bytes"] for r in ranks), ranks
    assert all(r["staging_bytes"] == 2 * CHECKPOINT_CHUNK_BYTES for r in ranks), ranks
    # What the file needs (named when the disk is full) is the same either way (issue 39: it once said "about 0").
    assert all(r["saved_bytes"] == r["sync_saved_bytes"] > 0 for r in ranks), ranks
    assert _equal_to_sync(tmp_path)


def test_an_accelerators_chunks_pass_through_the_ring_and_write_what_a_sync_save_writes(tmp_path):
    ranks = run_distributed(_gated_save, world_size=2,
                            args=(str(tmp_path), 2 * CHECKPOINT_CHUNK_BYTES, True, Chunked))
    assert all(0 < r["staged"] <= r["saved_bytes"] for r in ranks), ranks
    assert all(r["staging_bytes"] == 2 * CHECKPOINT_CHUNK_BYTES for r in ranks), ranks
    assert _equal_to_sync(tmp_path)


def test_whole_buffers_stay_within_the_budget_and_write_what_a_sync_save_writes(tmp_path):
    """XLA's way: the flat buffers the pieces are ranges of, each fetched whole, at most the budget at once (a
    buffer larger than it alone)."""
    budget = 3 << 20
    ranks = run_distributed(_gated_save, world_size=2, args=(str(tmp_path), budget, True, Whole))
    assert all(0 < r["staged"] for r in ranks), ranks
    assert all(0 < r["staging_bytes"] <= max(budget, r["largest_buffer"]) for r in ranks), ranks
    assert _equal_to_sync(tmp_path)


def test_a_naive_share_of_the_live_tensors_is_torn(tmp_path):
    """Why the update must wait: the same save, its writer let go only after the update ran, holds the next
    step's values where it should hold step 2's (here: beside the checksums of step 2's, computed before)."""
    run_distributed(_gated_save, world_size=1, args=(str(tmp_path), 0, False))
    try:
        torn = not _equal_to_sync(tmp_path)
    except DamagedCheckpoint:
        torn = True
    assert torn


def _default_ring(directory: str) -> dict:
    cfg, topo, model, optimizer = CH.build("llama", CH.L(tp=1), seed=3)
    ckpt = Checkpointer(directory, rank=0, world_size=1, token="0", async_save=True, deferred_copy=True)
    for i in range(2):
        ckpt.save(i, model, optimizer, topo, extra={"step": i}, config={})
        CH.step(cfg, topo, model, optimizer, i)
    ckpt.wait()
    return {"saved_bytes": ckpt.last_host_bytes, "staging_bytes": ckpt.staging_bytes}


def test_the_host_memory_of_an_async_save_on_cpu_is_the_ring_the_launch_counts(tmp_path):
    [r] = run_distributed(_default_ring, world_size=1, args=(str(tmp_path),))
    # Not a copy of the state (what it held for the run before issue 56): the rule's ring, here none at all.
    assert r["staging_bytes"] == checkpoint_staging_bytes(r["saved_bytes"], state_on_host=True) == 0
    gib = 1 << 30
    assert checkpoint_staging_bytes(gib, state_on_host=True) == 4 * CHECKPOINT_CHUNK_BYTES  # 1/16 of it
    assert checkpoint_staging_bytes(64 * gib, state_on_host=True) == 256 * MIB  # capped
    # An accelerator's ring: 1/4 of what the rank saves, at least a chunk, at most 2 GiB (no longer a whole copy).
    assert checkpoint_staging_bytes(gib, state_on_host=False) == gib // 4
    assert checkpoint_staging_bytes(MIB, state_on_host=False) == CHECKPOINT_CHUNK_BYTES
    assert checkpoint_staging_bytes(64 * gib, state_on_host=False) == 2 * gib


def test_the_launch_estimates_the_cpu_ring_and_an_accelerators_ring():
    from launcher.estimator.hardware import HARDWARE, cpu_hardware
    from launcher.estimator.host import host_memory
    from launcher.estimator.memory import stage_memory
    from launcher.estimator.shapes import ModelShape
    from tests.estimate.test_estimator import layout

    shape = ModelShape("llama", 16, 2048, 8192, 16, 16, 32000, 1024, 1024, False)
    plan = layout(num_nodes=1, devices_per_node=2, tp=2, pp=1, precision="fp32")
    saved = stage_memory(shape, plan, first=True, last=True)
    saved = saved.weights + saved.optimizer
    assert host_memory(shape, plan, HARDWARE["trn1"]).staging == checkpoint_staging_bytes(saved, state_on_host=False)
    assert 0 < host_memory(shape, plan, HARDWARE["trn1"]).staging <= saved / 4
    on_cpu = host_memory(shape, plan, cpu_hardware(2, 64 * 2**30)).staging
    assert on_cpu == checkpoint_staging_bytes(saved, state_on_host=True) and 0 < on_cpu <= saved / 16
