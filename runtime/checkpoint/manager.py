# Saving, committing, finding and loading checkpoints (the layout is described in docs/checkpoints.md).
#
#   <dirpath>/step_00000010.3f9c2a1b/      one directory per save: step, then a token unique to the launch,
#       rank_00000.pt ...                  so a relaunch that saves the same step again never writes into the
#       rank_00000.done ...                files of an earlier attempt; a .done holds its rank file's checksum
#       config.yaml                        the resolved training config (rank 0)
#       COMMIT                             JSON metadata, written last by rank 0 once every rank's .done exists,
#                                          with every rank file's size and checksum (runtime/checkpoint/integrity.py)
#
# A rank file is raw tensor bytes and an index of them (format 2, runtime/checkpoint/rankfile.py; format 1, a
# torch.save zip, still loads). Loading is runtime/checkpoint/loading.py's.
#
# Every rank writes its own file and then its .done marker; rank 0 waits (polling the storage, not a collective:
# the wait runs on a background thread while training goes on) for all of them and writes COMMIT. Only a
# directory with COMMIT is ever loaded or counted; retention runs only after a commit, and deletes the oldest
# committed directories beyond keep_last plus any uncommitted leftovers of crashed saves.
#
# A save streams the live state to its file through a bounded ring of host memory (runtime/checkpoint/staging.py):
# a sync save on the calling thread, an async one on a background thread while the next step's forward and
# backward read (never write) the state; the optimizer's next update, before it changes anything, brings what is
# not written yet into the ring and waits for the rest (a pre-step hook). On CPU the writer reads the tensors in
# place; an accelerator's are transferred to the ring chunk by chunk (GPU) or whole tensor by whole tensor (XLA).
# One save in flight at a time; the host memory it holds is reported.
from __future__ import annotations

import errno
import json
import os
import re
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from runtime.checkpoint.rankfile import saved_tensors, write_rank_file
from runtime.checkpoint.shards import HostStaging, _replace, host_copy, rank_pieces
from runtime.checkpoint.staging import StreamedSnapshot, make_ring
from runtime.checkpoint.storage import LocalStorage, Storage, open_storage
from runtime.device import HostTransfer, checkpoint_transfer
from runtime.parallel.data_parallel import data_parallel_of
from runtime.schema.facts import checkpoint_staging_bytes

FORMAT = 2  # 1: a torch.save zip per rank (read still); 2: raw bytes and an index (rankfile.py)
COMMIT = "COMMIT"
_DIR = re.compile(r"^step_(\d{8})\.([0-9a-f]+)$")


class CheckpointSaveFailed(RuntimeError):
    """A save that could not be written; the message names the location and the reason on one line."""


def _save_failure(location: str, error: BaseException, host_bytes: int) -> str:
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return (f"checkpoint save to {location} failed: no space left on device (this rank's file needs about "
                f"{host_bytes} bytes); the previous checkpoint is kept: free space or point "
                f"exp_manager.checkpoint_callback_params.dirpath elsewhere, then relaunch to resume")
    if isinstance(error, OSError) and error.strerror:
        where = f" ({error.filename})" if error.filename else ""
        return f"checkpoint save to {location} failed: {error.strerror}{where}; the previous checkpoint is kept"
    return f"checkpoint save to {location} failed: {' '.join(str(error).split())}"


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _done_file(rank: int) -> str:
    return f"rank_{rank:05d}.done"


@dataclass(frozen=True)
class Committed:
    name: str       # directory name under the checkpoint location
    step: int
    meta: dict

    @property
    def layout(self) -> str:
        """The layout that saved it, for messages: 'tp 2 pp 1 dp 2 ZeRO-1'."""
        layout = self.meta.get("layout", {})
        text = f"tp {layout.get('tp')} pp {layout.get('pp')} dp {layout.get('dp')}"
        if layout.get("ep", 1) > 1:
            text += f" ep {layout['ep']}"
        return text + " ZeRO-1" if layout.get("zero1") else text


def _committed(storage: Storage, name: str) -> Committed | None:
    """The checkpoint in directory `name`, or None when it is not a complete one."""
    match = _DIR.match(name)
    if not match or not storage.exists(f"{name}/{COMMIT}"):
        return None
    try:
        meta = json.loads(storage.get_bytes(f"{name}/{COMMIT}"))
    except FileNotFoundError:  # removed since: another rank's retention of an older one (peer copies, peer.py)
        return None
    except ValueError:
        meta = None
    if not isinstance(meta, dict):  # found damaged when it is checked (integrity.check_checkpoint)
        meta = {"unreadable": f"{COMMIT} is not the JSON object nxdt writes"}
    return Committed(name, int(match.group(1)), meta)


def committed_checkpoints(storage: Storage) -> list[Committed]:
    """Every complete checkpoint, oldest first (by step, then commit time)."""
    found = [c for c in (_committed(storage, name) for name in storage.list_dirs()) if c is not None]
    return sorted(found, key=lambda c: (c.step, c.meta.get("committed_at", 0.0)))


def resolve_checkpoint(location: str, name: str | None = None) -> tuple[Storage, Committed]:
    """A checkpoint given by the user: a step directory, or a checkpoint directory (its newest complete one, or
    the one called `name` unless that is 'latest')."""
    location = str(location).rstrip("/")
    if name and name != "latest":
        location = f"{location}/{name}"
    parent, _, leaf = location.rpartition("/")
    if _DIR.match(leaf):
        storage = open_storage(parent or ".")
        checkpoint = _committed(storage, leaf)
        if checkpoint is None:
            raise ValueError(f"checkpoint {location} is incomplete (no {COMMIT} marker): it cannot be loaded")
        return storage, checkpoint
    storage = open_storage(location)
    found = committed_checkpoints(storage)
    if not found:
        raise ValueError(f"{location} holds no complete checkpoint (a step_* directory with a {COMMIT} marker)")
    return storage, found[-1]


def _on_host(tree) -> bool:
    return all(t.is_cpu for t in HostStaging._tensors(tree, []))


def _put_rank_file(storage: Storage, key: str, header: dict, pieces: dict,
                   snapshot: StreamedSnapshot | None = None) -> dict:
    """Write the rank file into the storage's spool file (the tensors' bytes from `snapshot` when given), then
    publish it under `key` in one step; returns its size and the checksum of its index (which holds every block's
    checksum)."""
    spool = storage.spool_path(key)
    try:
        # A local spool is the file itself (renamed into place): start the disk on it while it is written.
        digest = write_rank_file(spool, header, pieces, flush_early=isinstance(storage, LocalStorage),
                                 chunks=None if snapshot is None else snapshot.chunks())
        storage.put_file(key, spool)
        return digest
    finally:
        if os.path.exists(spool):
            os.unlink(spool)


def _put_config(storage: Storage, name: str, config: dict) -> None:
    import yaml

    storage.put_bytes(f"{name}/config.yaml", yaml.safe_dump(config, sort_keys=False).encode())


class Checkpointer:
    """One per training process. `token` must be the same on every rank (rank 0 draws it; see train.py)."""

    def __init__(self, location: str, *, rank: int, world_size: int, token: str, keep_last: int | None = None,
                 async_save: bool = True, deferred_copy: bool = False, pin_memory: bool = False,
                 commit_timeout_s: float = 3600.0, ring_bytes: int | None = None,
                 transfer: type[HostTransfer] | None = None, log: Callable[[str], None] | None = None,
                 await_commit: bool = False):
        """deferred_copy: saves stream the live state (staging.py) through a ring of ring_bytes (default:
        runtime/schema/facts.py checkpoint_staging_bytes of what the rank saves); off, the old way: a whole host
        copy at the save, kept for the run (HostStaging). transfer: how bytes reach the host (default: the state's
        device's, runtime/device.py checkpoint_transfer; a test stands one in on CPU). await_commit: every rank's
        save ends once rank 0 has committed it (the peer copies, peer.py), so that wait() returning on any rank means
        the save is committed: a rank that dies after its next update leaves this save loadable."""
        self.storage = open_storage(location)
        self.location = str(location)
        self.rank, self.world_size, self.token = rank, world_size, token
        self.keep_last = keep_last if keep_last and keep_last > 0 else None
        self.async_save, self.deferred_copy = async_save, deferred_copy
        self.commit_timeout_s = commit_timeout_s
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._thread: threading.Thread | None = None
        self._snapshot: StreamedSnapshot | None = None
        self._error: BaseException | None = None
        self.last_host_bytes = 0   # the tensor bytes of this rank's last save (what its file needs)
        self.last_timings: dict[str, float] = {}
        self._staging = HostStaging(pin=pin_memory)
        self._ring_bytes, self._ring = ring_bytes, None
        self._transfer = transfer
        self.await_commit = await_commit

    # ---- saving ------------------------------------------------------------------------------------------

    def save(self, step: int, model, optimizer, topo, *, extra: dict, config: dict | None,
             sync: bool = False) -> None:
        """Save this rank's shards for `step`. Async unless sync (or async_save is off): returns right away when
        streamed (deferred_copy: the optimizer's next update waits for what the writer has not read), else once the
        state is copied."""
        self.wait()  # one save in flight: bounds host memory, keeps commits in order
        started = time.perf_counter()
        name = f"step_{step:08d}.{self.token}"
        dp = data_parallel_of(model)
        origins: dict = {}
        # Schedule-free optimizers save their evaluation point (the averaged weights, what an export wants) with z:
        # the next step switches back exactly as a resumed run's first step does, so both continue bitwise.
        optimizer.eval()
        model_pieces, optim_pieces = rank_pieces(dp, optimizer, topo, origins)
        header = {
            "format": FORMAT, "rank": self.rank, "world_size": self.world_size, "step": step,
            "layout": {"tp": topo.tp.size, "pp": topo.pp.size, "dp": topo.dp.size, "ep": topo.ep.size,
                       "tp_rank": topo.tp.rank, "pp_rank": topo.pp.rank, "dp_rank": topo.dp.rank, "zero1": dp.zero1},
            "optim_scalars": {"step": optimizer.step_count, "sr_generator": dp.sr_generator_state(),
                              "optimizer": host_copy(optimizer.scalars())},
            "extra": host_copy(extra),
        }
        meta = {"format": FORMAT, "step": step, "world_size": self.world_size, "layout": {
            "tp": topo.tp.size, "pp": topo.pp.size, "dp": topo.dp.size, "ep": topo.ep.size, "zero1": dp.zero1}}
        live = {"model": model_pieces, "optim": optim_pieces}
        tensors = saved_tensors(live)
        self.last_host_bytes = sum(t.numel() * t.element_size() for t in tensors)
        run_async = self.async_save and not sync
        snapshot = None
        if self.deferred_copy:  # streamed from the live tensors until the next update
            transfer = self._transfer or checkpoint_transfer(tensors[0] if tensors else None)
            if self._ring is None:
                self._ring = make_ring(transfer, self._ring_bytes if self._ring_bytes is not None else
                                       checkpoint_staging_bytes(self.last_host_bytes,
                                                                state_on_host=transfer.in_place))
            snapshot = StreamedSnapshot(name, tensors, self._ring, origins=origins, transfer=transfer)
            if transfer.whole_tensors:
                # XLA: the pieces are views of the flat buffers, and a view alive while the next step is traced
                # makes its graph a different one (compiled after every first save): the writer gets their shapes.
                saved = {id(t) for t in tensors}
                live = _replace(live, iter([torch.empty(t.shape, dtype=t.dtype, device="meta") if id(t) in saved
                                            else t for t in HostStaging._tensors(live, [])]))
                del tensors, origins, model_pieces, optim_pieces
        elif run_async or not _on_host(live):
            live = self._staging.copy(live)  # device -> host now; the background thread only writes
        self.last_timings = {"snapshot_s": time.perf_counter() - started}
        self._error = None
        args = (name, header, live, snapshot, meta, config, started)
        if run_async:
            self._snapshot = snapshot
            self._thread = threading.Thread(target=self._write, args=args, name="nxdt-checkpoint", daemon=True)
            self._thread.start()
            if snapshot is not None:
                optimizer.add_pre_step_hook(self.wait_for_copy)
        else:
            self._write(*args)
            self._raise()
            if snapshot is not None:
                snapshot.frozen = True  # written: nothing for an update to wait for

    @property
    def staging_bytes(self) -> int:
        """Host memory the saves hold besides the live state: the ring (at most, for XLA's byte budget), or the
        host copy of deferred_copy=False."""
        return (self._ring.nbytes if self._ring is not None else 0) + self._staging.nbytes

    def wait_for_copy(self) -> None:
        """Block until the save in flight reads nothing more from the live tensors (the optimizer calls this
        before its update changes them)."""
        snapshot = self._snapshot
        if snapshot is not None and not snapshot.frozen:
            began = time.perf_counter()
            snapshot.freeze()
            waited = self.last_timings["update_wait_s"] = time.perf_counter() - began
            if self.rank == 0:
                self.log(f"checkpoint {snapshot.name}: the next update waited {waited:.2f} s for the write on rank 0 "
                         f"({snapshot.staged_bytes / 2**20:.0f} MiB of it copied first)")
        self._raise()

    def wait(self) -> None:
        """Block until the save in flight is written (and, on rank 0, committed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = self._snapshot = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointSaveFailed(_save_failure(self.location, error, self.last_host_bytes)) from error

    def _write(self, name: str, header: dict, live: dict, snapshot: StreamedSnapshot | None, meta: dict,
               config: dict | None, started: float) -> None:
        if threading.current_thread() is not threading.main_thread():
            # Background writes yield the CPU to training: on a host whose cores also compute (CPU training,
            # or the input pipeline of an accelerator), the write should fill idle time, not take turns.
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (AttributeError, OSError):
                pass
        try:
            digest = _put_rank_file(self.storage, f"{name}/{_rank_file(self.rank)}", header, live, snapshot)
            if self.rank == 0 and config is not None:
                _put_config(self.storage, name, config)
            self.storage.put_bytes(f"{name}/{_done_file(self.rank)}", json.dumps(digest).encode())
            written = time.perf_counter()
            if self.rank == 0:
                self._commit(name, meta)
            elif self.await_commit:
                self._await_commit(name)
            self.last_timings.update({"write_s": written - started, "total_s": time.perf_counter() - started})
            if self.rank == 0:
                self.log(f"checkpoint {self.location}/{name} committed: {self.last_host_bytes / 2**30:.3f} GiB "
                         f"from rank 0, {self.staging_bytes / 2**30:.3f} GiB host staging, written in "
                         f"{self.last_timings['total_s']:.2f} s")
        except BaseException as error:  # surfaced on the training thread by wait()/wait_for_copy()
            self._error = error
        finally:
            if snapshot is not None:  # a failed write reads no more: the update need not wait (it raises)
                snapshot.close()

    def _commit(self, name: str, meta: dict) -> None:
        deadline, delay = time.monotonic() + self.commit_timeout_s, 0.02
        want = {f"{name}/{_done_file(r)}" for r in range(self.world_size)}
        while True:
            missing = want - set(self.storage.list(name))
            if not missing:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(missing)} ranks did not finish writing {name} within "
                                   f"{self.commit_timeout_s:.0f} s; it stays uncommitted and will never be loaded")
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)
        files = {_rank_file(r): json.loads(self.storage.get_bytes(f"{name}/{_done_file(r)}"))
                 for r in range(self.world_size)}
        meta = {**meta, "committed_at": time.time(), "files": files}
        self.storage.put_bytes(f"{name}/{COMMIT}", json.dumps(meta, indent=1).encode())
        self._retain(name)

    def _await_commit(self, name: str) -> None:
        """Block until rank 0 has committed `name` (one small lookup per poll)."""
        deadline, delay = time.monotonic() + self.commit_timeout_s, 0.01
        while not self.storage.exists(f"{name}/{COMMIT}"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} was not committed within {self.commit_timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _retain(self, newest: str) -> None:
        committed = committed_checkpoints(self.storage)
        names = {c.name for c in committed}
        keep = names if self.keep_last is None else {c.name for c in committed[-self.keep_last:]} | {newest}
        newest_step = int(_DIR.match(newest).group(1))
        for dirname in self.storage.list_dirs():
            match = _DIR.match(dirname)
            if not match or dirname in keep:
                continue
            # Uncommitted: a crashed save of an earlier launch (another token), or of this launch at an earlier
            # step. A later step of this launch is the next save, which other ranks may already be writing.
            in_flight = dirname not in names and match.group(2) == self.token and int(match.group(1)) > newest_step
            if not in_flight:
                self.storage.delete_prefix(dirname)

    def latest(self) -> Committed | None:
        found = committed_checkpoints(self.storage)
        return found[-1] if found else None


def write_full_checkpoint(location: str, step: int, full_state: dict[str, torch.Tensor], *, config: dict,
                          moments: dict[str, dict[str, torch.Tensor]] | None = None, step_count: int = 0,
                          extra: dict | None = None, source: str = "import") -> str:
    """A one-file checkpoint of unsharded weights that any layout resumes from: imported from Hugging Face (no
    optimizer state: a fresh optimizer), or from torchtitan with its moments ({exp_avg|exp_avg_sq: {name: full
    tensor}}), the optimizer's step count and `extra` (step, data position). Returns the checkpoint's location."""
    storage = open_storage(location)
    name = f"step_{step:08d}.{secrets.token_hex(4)}"

    def piece(t: torch.Tensor) -> dict:
        return {"dim": None, "index": None, "full_shape": tuple(t.shape), "shard_shape": tuple(t.shape), "start": 0}

    pieces = {n: [{**piece(t), "value": t.detach().cpu().contiguous()}] for n, t in full_state.items()}
    optim = {n: [{**piece(t), **{key: moments[key][n].detach().cpu().contiguous() for key in moments},
                  "master": None}] for n, t in full_state.items()} if moments else {}
    layout = {"tp": 1, "pp": 1, "dp": 1, "zero1": False}
    scalars = {"step": step_count if moments else 0, "sr_generator": None}
    if moments:
        scalars["optimizer"] = None  # written by another trainer: no optimizer name to check on resume
    try:
        digest = _put_rank_file(storage, f"{name}/{_rank_file(0)}", {
            "format": FORMAT, "rank": 0, "world_size": 1, "step": step, "layout": layout, "optim_scalars": scalars,
            "extra": extra or {"step": step, "data": {"consumed_samples": 0}}}, {"model": pieces, "optim": optim})
        _put_config(storage, name, config)
        storage.put_bytes(f"{name}/{_done_file(0)}", json.dumps(digest).encode())
        meta = {"format": FORMAT, "step": step, "world_size": 1, "layout": layout, "committed_at": time.time(),
                "source": source, "files": {_rank_file(0): digest}}
        storage.put_bytes(f"{name}/{COMMIT}", json.dumps(meta, indent=1).encode())
    except BaseException:  # a full disk, say: no uncommitted directory is left for the next reader to skip
        storage.delete_prefix(name)
        raise
    return f"{storage.root}/{name}"
