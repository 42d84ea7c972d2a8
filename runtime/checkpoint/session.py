# The trainer's side of checkpointing: when to save, what to resume from, and the state beyond weights and
# optimizer shards (step, data position, RNG). train.py calls resume() once and after_step() every step.
from __future__ import annotations

import os
import secrets
import shutil
import sys
import time

import torch

from runtime.checkpoint.integrity import DamagedCheckpoint, check_checkpoint
from runtime.checkpoint.loading import load_checkpoint
from runtime.checkpoint.manager import Checkpointer, Committed, committed_checkpoints, resolve_checkpoint
from runtime.checkpoint.peer import REGISTRY_ENV, SCHEME
from runtime.checkpoint.shards import rank_pieces
from runtime.parallel.data_parallel import data_parallel_of
from runtime.config import CheckpointConfig
from runtime.io import ownership
from runtime.parallel import collectives as C


def _shared_token(device) -> str:
    """A random token drawn by rank 0 and agreed by all ranks: names this launch's checkpoint directories."""
    value = torch.tensor([secrets.randbits(31) if device.is_main else 0], dtype=torch.int64,
                         device=device.torch_device)
    C.all_reduce_world(value)
    return f"{int(value.item()):08x}"


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class TrainingCheckpoints:
    def __init__(self, cfg: CheckpointConfig, device, topo, model, optimizer, train_batches, raw_config: dict,
                 max_steps: int, peer_every: int = 0):
        self.cfg, self.device, self.topo = cfg, device, topo
        self.model, self.optimizer, self.batches = model, optimizer, train_batches
        self.raw_config, self.max_steps = raw_config, max_steps
        self.last_saved: int | None = None
        self.resumed: dict | None = None  # where the state came from: source, step, seconds, bytes
        self.checkpointer = None
        token = _shared_token(device) if cfg.enabled or peer_every else None
        if cfg.enabled:
            self.checkpointer = Checkpointer(
                cfg.dirpath, rank=device.rank, world_size=device.world_size, token=token,
                keep_last=cfg.save_top_k if cfg.save_top_k > 0 else None, async_save=cfg.async_save,
                # Only host tensors can be copied on a background thread while the next step runs.
                deferred_copy=device.defers_staging_copy, pin_memory=device.pins_host_memory, log=self._log)
        # Peer-held state (fault_tolerance.peer_state_every_n_steps, runtime/checkpoint/peer.py): the same save into
        # other nodes' memory every K steps, where the job script started the stores. One copy kept (and the one
        # being written); every rank waits for rank 0's commit, so a refresh is loadable once the next update has
        # begun anywhere.
        self.peer, self.peer_every = None, peer_every
        if peer_every and os.environ.get(REGISTRY_ENV):
            self.peer = Checkpointer(SCHEME + os.environ[REGISTRY_ENV], rank=device.rank,
                                     world_size=device.world_size, token=token, keep_last=1, async_save=True,
                                     deferred_copy=False, log=lambda message: None, await_commit=True)

    def _log(self, message: str) -> None:
        if self.device.is_main:
            print(f"nxdt: {message}", file=sys.stderr, flush=True)

    # ---- before training ---------------------------------------------------------------------------------

    def check_room(self, results_dir: str) -> None:
        """Find out now, not at the first save after hours of training, that the checkpoint directory cannot take
        files or (on a file system) has no room for one checkpoint. Every rank probes; all stop together. First,
        that it is not another run's (runtime/io/ownership.py: this run would resume from it, write into it and
        prune it), whoever started this trainer."""
        if self.checkpointer is None:
            return
        if problem := ownership.foreign("exp_manager.checkpoint_callback_params.dirpath", self.cfg.dirpath,
                                        ownership.owner(results_dir), ownership.CHECKPOINTS_WOULD,
                                        ownership.checkpoints_fix("", self.cfg.dirpath, f"{results_dir}/checkpoints")):
            raise ValueError(problem)
        storage, key = self.checkpointer.storage, f".nxdt_write_probe_{self.device.rank:05d}"
        problem = None
        try:
            storage.put_bytes(key, b"")
            storage.delete(key)
        except Exception as error:  # noqa: BLE001 - any storage failure means the saves would fail too
            reason = getattr(error, "strerror", None) or " ".join(str(error).split())
            problem = f"{self.cfg.dirpath} is not writable ({reason}); fix its permissions or point it elsewhere"
        dp = data_parallel_of(self.model)
        pieces = rank_pieces(dp, self.optimizer, self.topo)
        mine = sum(t.numel() * t.element_size() for tree in pieces for ps in tree.values() for p in ps
                   for t in p.values() if isinstance(t, torch.Tensor) and t.is_floating_point())
        # fp32 (every backend reduces it): the byte count is only compared with free space, to ~7 digits.
        need = torch.tensor([float(mine), 0.0 if problem is None else 1.0], device=self.device.torch_device)
        C.all_reduce_world(need)
        total, failures = float(need[0].item()), int(need[1].item())
        if problem is None and failures == 0 and self.device.is_main:
            root = storage.local_path("")
            if root is not None:
                free = shutil.disk_usage(root).free
                if free < total:
                    problem = (f"{self.cfg.dirpath} has {_size(free)} free but one checkpoint needs {_size(total)}; "
                               f"free space or point it elsewhere")
        flag = torch.tensor([0.0 if problem is None else 1.0], device=self.device.torch_device)
        if C.all_reduce_world(flag).item():
            raise ValueError(f"exp_manager.checkpoint_callback_params.dirpath: "
                             f"{problem or 'not usable (rank 0 says why)'}")

    # ---- resume ------------------------------------------------------------------------------------------

    def _candidates(self) -> list[tuple[object, Committed]]:
        """What to resume from, in order of preference: the one checkpoint asked for, or every complete one in
        the run's checkpoint directory, newest first."""
        if self.cfg.resume_from_checkpoint:
            return [resolve_checkpoint(self.cfg.resume_from_checkpoint)]
        if self.cfg.resume_if_exists and self.checkpointer is not None:
            storage = self.checkpointer.storage
            return [(storage, c) for c in reversed(committed_checkpoints(storage))]
        return []

    def _find(self) -> tuple[object, Committed] | None:
        """The newest candidate whose rank files all match their checksums, agreed by every rank: each checks
        its share of the files, and one damaged file anywhere sends all ranks to the next older checkpoint."""
        candidates = self._candidates()
        explicit = bool(self.cfg.resume_from_checkpoint)
        for storage, checkpoint in candidates:
            where = f"{storage.root}/{checkpoint.name}"
            if self._intact(storage, checkpoint, f"checkpoint {where}",
                            "" if explicit else "; resuming from an older checkpoint instead"):
                return storage, checkpoint
            if explicit:
                raise DamagedCheckpoint(f"exp_manager.resume_from_checkpoint: {where} is damaged (the file is named "
                                        f"above); point it at another checkpoint")
        if candidates:
            raise DamagedCheckpoint(f"no checkpoint in {self.cfg.dirpath} is intact (each damaged file is named "
                                    f"above); remove them, or set exp_manager.resume_if_exists=false to start over")
        return None

    def _find_peer(self) -> tuple[object, Committed] | None:
        """The newest peer copy whose rank files all match their checksums, agreed by every rank; None when there is
        none (the first attempt, or every copy lost): the disk's checkpoints are then the candidates."""
        if self.peer is None:
            return None
        try:
            candidates = list(reversed(committed_checkpoints(self.peer.storage)))
        except OSError:  # no store announced itself: as without peer state
            candidates = []
        none = torch.tensor([0.0 if candidates else 1.0], device=self.device.torch_device)
        if C.all_reduce_world(none).item():  # every rank resumes from the same place: the disk, if any rank saw none
            return None
        for checkpoint in candidates:
            if self._intact(self.peer.storage, checkpoint, f"peer copy {checkpoint.name}", "; trying an older one"):
                return self.peer.storage, checkpoint
        return None

    def _intact(self, storage, checkpoint: Committed, what: str, then: str) -> bool:
        """Every rank checks its share of the checkpoint's files against their checksums and names a damaged one;
        intact when no rank found one (agreed, so every rank goes on to the same candidate)."""
        problem = check_checkpoint(storage, checkpoint, (self.device.rank, self.device.world_size))
        if problem is not None:
            print(f"nxdt: {what} is damaged: {problem}{then}", file=sys.stderr, flush=True)
        damaged = torch.tensor([0.0 if problem is None else 1.0], device=self.device.torch_device)
        return C.all_reduce_world(damaged).item() == 0

    def resume(self) -> int:
        """Load the checkpoint to resume from, if any; returns the step to continue from (0: from scratch).
        A peer copy first: it is at most peer_every steps old, and reading it reads no file."""
        disk = self.checkpointer.storage if self.checkpointer is not None else None
        reads_before = disk.reads if disk is not None else 0
        began = time.perf_counter()
        found = self._find_peer()
        source = "peer" if found is not None else "disk"
        found = found or self._find()
        if found is None:
            return 0
        storage, checkpoint = found
        started = time.perf_counter()  # found, every rank's share of its checksums verified
        dp = self.topo.dp
        share = self.cfg.load_on_one_replica and dp.size > 1
        device = self.device.torch_device

        def broadcast(tensor: torch.Tensor, axis) -> None:
            on_device = tensor.to(device)
            C.broadcast(on_device, axis)
            tensor.copy_(on_device.cpu())

        # The first rank of every replica group reads: DP rank 0, and with expert parallelism every rank of the
        # first EP group (each holds other experts).
        info = load_checkpoint(storage, checkpoint, self.model, self.optimizer, self.topo, rank=self.device.rank,
                               broadcast=broadcast if share else None, reader=not share or self.topo.edp.rank == 0,
                               verified=True)
        extra = info["extra"]
        self.batches.load_state_dict(extra["data"])
        if info["same_world"] and "rng" in extra:
            torch.set_rng_state(extra["rng"]["torch"])
            self.device.set_rng_state(extra["rng"])
        self.last_saved = int(extra["step"]) if source == "disk" else None
        seconds, checked = time.perf_counter() - began, started - began
        reads = disk.reads - reads_before if disk is not None else 0
        self.resumed = {"source": source, "step": int(extra["step"]), "seconds": round(seconds, 3),
                        "check_s": round(checked, 3),
                        # requests to the checkpoint directory while resuming (0 from the peers: no file read)
                        "disk_reads": reads if disk is not None else None,
                        "where": storage.root if source == "disk" else ",".join(
                            s.node for s in storage.stores() if s.alive)}
        where = f": peer copies in the memory of {self.resumed['where']}" if source == "peer" else ""
        self._log(f"resumed from {storage.root}/{checkpoint.name} (step {extra['step']}, saved at "
                  f"{checkpoint.layout}) in {seconds:.2f} s ({checked:.2f} s to find and verify it){where}"
                  + (", no file read" if source == "peer" and not reads else ""))
        return int(extra["step"])

    # ---- save --------------------------------------------------------------------------------------------

    def _extra(self, step: int) -> dict:
        rng = {"torch": torch.get_rng_state(), **self.device.rng_state()}
        return {"step": step, "data": self.batches.state_dict(), "rng": rng}

    def save(self, step: int, *, sync: bool = False) -> None:
        if self.checkpointer is None or self.last_saved == step:
            return
        self.checkpointer.save(step, self.model, self.optimizer, self.topo, extra=self._extra(step),
                               config=self.raw_config, sync=sync)
        self.last_saved = step

    def after_step(self, done: int) -> None:
        if self.peer is not None and done % self.peer_every == 0 and done < self.max_steps:
            self.peer.save(done, self.model, self.optimizer, self.topo, extra=self._extra(done), config=None)
            # Written and committed before the next update changes the state: a failure after that update finds
            # this step in the peers' memory, so at most the step it stopped in is trained again.
            self.optimizer.add_pre_step_hook(self.peer.wait)
        every = self.cfg.every_n_train_steps
        if every and done % every == 0 and done < self.max_steps:
            self.save(done)
        elif done == self.max_steps and self.cfg.save_last:
            self.save(done, sync=True)

    def save_and_wait(self, step: int) -> None:
        """A save that is committed when this returns on rank 0 (signal, end of training)."""
        self.save(step, sync=True)
        self.wait()

    def wait(self) -> None:
        if self.peer is not None:
            self.peer.wait()
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def wait_quietly(self) -> None:
        """On the way out after an error: let a save in flight finish, but do not hide the first error. A peer
        copy in flight is left (its writer is a daemon thread): it lives in memory only, and after a rank's death its
        commit would wait for that rank's done mark for as long as the commit timeout, holding up the restart."""
        try:
            if self.checkpointer is not None:
                self.checkpointer.wait()
        except RuntimeError as error:
            print(f"nxdt: {error}", file=sys.stderr, flush=True)
