"""The training stage: `python -m runtime.train --config <training_config.yaml>`, one process per device.

What the launcher's job script runs (Seam 1), e.g. two CPU processes on one node:

    torchrun --nproc_per_node 2 -m runtime.train --config results/gpt3_tiny/training/training_config.yaml

and, for a quick look on a laptop, a single process without torchrun:

    python -m runtime.train --config training_config.yaml

Order of work: device and process group -> topology (tp x dp x pp) -> model on the meta device, parallelized, and
only this rank's part materialized (and filled with the starting weights' same part) ->
distributed optimizer -> data (sample indices built once, by local rank 0) -> resume from the newest complete
checkpoint -> the step loop with the learning rate schedule, periodic validation, metrics and checkpoints.
A mistake in the config ends the run with one `error: ...` line and exit code 2.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import shlex
import sys
import time

import torch

from runtime.alignment.reward import RewardObjective, meta_reward_model
from runtime.checkpoint.manager import CheckpointSaveFailed
from runtime.checkpoint.session import TrainingCheckpoints
from runtime.config import TrainingConfig, load_training_config
from runtime.data import DataParallelBatches
from runtime.data.training import build_data
from runtime.fault_tolerance.elastic import ACTIVE_NODES_ENV, active_nodes, elastic_line
from runtime.fault_tolerance.progress import Progress
from runtime.fault_tolerance.recovery import Recovery
from runtime.device import Device, init_device, release_freed_host_memory, shutdown
from runtime.finetune import parallelize_as_configured, starting_weights
from runtime.graphs import GraphAccounting
from runtime.io import run_lock
from runtime.metrics import MetricsLogger, model_flops_per_token, peak_tflops
from runtime.micro_batch import MicroBatch
from runtime.models import meta_model
from runtime.models.lora import apply_lora
from runtime.models.moe import step_stats
from runtime.optim_schedule import LRSchedule
from runtime.parallel import ParallelDims, ShardedAdamW, Topology
from runtime.parallel import collectives as C
from runtime.preemption import PREEMPTED_EXIT_CODE, Preempted, SignalWatch
from runtime.preflight import PREFLIGHT_EXIT_CODE, PreflightError, preflight
from runtime.schema.facts import USER_ERROR_EXIT_CODE  # the job script's decider reads it too
from runtime.schema.stages import TRAINER_STAGES
from runtime.step import eval_result, train_step


def build_topology(cfg: TrainingConfig, device: Device) -> Topology:
    nodes = active_nodes(cfg)  # trainer.num_nodes, or fewer under run.elastic after a lost node
    expected_world = nodes * cfg.trainer.devices
    if device.world_size != expected_world:
        counted = "trainer.num_nodes" if nodes == cfg.trainer.num_nodes else ACTIVE_NODES_ENV
        message = f"{counted} * trainer.devices = {expected_world} but {device.world_size} processes were started"
        if "WORLD_SIZE" in os.environ:
            # A launch (torchrun, a job script): never a warning, a layout computed for another world trains
            # something else than what was asked for.
            raise ValueError(f"{message}; start {expected_world} (torchrun --nnodes {nodes} "
                             f"--nproc_per_node {cfg.trainer.devices}) or set trainer.devices / trainer.num_nodes "
                             "to what runs")
        if device.is_main:  # `python -m runtime.train` alone: a quick look at a config in one process
            print(f"warning: {message} (no torchrun); training with {device.world_size}", file=sys.stderr)
    devices_per_node = cfg.trainer.devices if device.world_size == expected_world else None
    dims = ParallelDims.infer_dp(cfg.parallel.tp, cfg.parallel.pp, device.world_size, devices_per_node,
                                 ep=cfg.parallel.ep, cp=cfg.parallel.context)
    if nodes < cfg.trainer.num_nodes:
        line = elastic_line(cfg, nodes, dims)
        if device.is_main:
            print(line, flush=True)
    return Topology.build(dims, cfg.parallel.shard_degree)  # model.data_parallel_shard_degree: hybrid


def build_objective(cfg: TrainingConfig, model, optimizer, train: DataParallelBatches,
                    valid: DataParallelBatches | None, topo: Topology, device: Device):
    """The step's objective: the token mean, or the alignment stage's preference loss with its references
    (computed here, before any checkpoint is loaded: the model still holds the starting weights)."""
    if cfg.reward_model is not None:  # rlhf_rm: TRL RewardTrainer's loss on the scores
        objective = RewardObjective(cfg.reward_model.center_rewards_coefficient)
        return objective, objective
    if cfg.alignment is None:
        return None, None
    from runtime.alignment.objective import PreferenceObjective
    from runtime.alignment.reference import live_scorer, reference_key, reference_table
    from runtime.step import autocast_for

    alignment = cfg.alignment
    if alignment.strategy == "orpo":
        objective = PreferenceObjective("orpo", alignment.beta)
        return objective, objective
    autocast = lambda: autocast_for(optimizer, device.torch_device)  # noqa: E731
    if not alignment.precompute_ref_log_probs:  # LoRA (the schema's rule): the base model, adapters off
        objective = PreferenceObjective("dpo", alignment.beta, alignment.loss_type, live=live_scorer(topo, autocast))
        return objective, objective
    key = reference_key(cfg.restore_from_path, cfg.model, cfg.seed, cfg.precision.type, cfg.lora is not None)
    common = dict(micro_batch_size=cfg.data.micro_batch_size, device=device.torch_device, model_key=key,
                  autocast=autocast, is_writer=device.is_main, barrier=device.barrier)
    # The pairs under the epoch reader (runtime/sft/dataset.py epoch_samples keeps them as .dataset).
    tables = [reference_table(model, batches.dataset.dataset, topo, describe=name, **common)
              for name, batches in (("train", train), ("validation", valid)) if batches is not None]
    objectives = [PreferenceObjective("dpo", alignment.beta, alignment.loss_type,
                                      references=lambda ids, table=table: table[ids.to(table.device)])
                  for table in tables]
    return objectives[0], objectives[1] if len(objectives) > 1 else None


def _to_device(micro_batches: list[MicroBatch], device: Device) -> list[MicroBatch]:
    return [micro_batch.to(device.torch_device) for micro_batch in micro_batches]


def evaluate(model, optimizer, valid: DataParallelBatches, num_batches: int, topo: Topology, device: Device,
             objective=None) -> tuple[float, dict]:
    """The objective (mean per-token loss) over the first `num_batches` validation global batches (the same ones
    every time, so successive values are comparable), over every data-parallel rank; and its other metrics. The rl
    stage's (HeldOut): its held-out prompts' greedy reward, and no loss."""
    if not hasattr(valid, "batch_at"):  # the rl stage's HeldOut (runtime/rl/trainer.py): it evaluates itself
        return None, valid.evaluate(model, optimizer)
    optimizer.eval()  # schedule-free: its averaged weights are the ones to evaluate; the next step switches back
    micro_batches = []
    for index in range(num_batches):
        micro_batches += _to_device(valid.batch_at(index * valid.global_batch_size), device)
    result = eval_result(model, micro_batches, topo, optimizer, objective)
    device.step_boundary()  # XLA: the evaluation's one graph runs here, and its one read comes after
    result.read(check=not device.trial_run)
    return result.loss, result.metrics


@contextlib.contextmanager
def one_writer(results_dir: str, device: Device):
    """Hold the run's lock (runtime/io/run_lock.py) for the whole run: rank 0 takes it, every rank learns whether
    it did, and a run another live job is training stops here, before anything is written."""
    problem = None
    if device.is_main:
        try:
            run_lock.acquire(results_dir)
        except run_lock.RunLocked as error:
            problem = error
    refused = torch.tensor([0.0 if problem is None else 1.0], device=device.torch_device)
    if C.all_reduce_world(refused).item():
        raise problem or run_lock.RunLocked(f"{results_dir} is already being trained (rank 0 names the holder)")
    try:
        yield
    finally:
        if device.is_main:
            run_lock.release(results_dir)


def train(cfg: TrainingConfig, device: Device, progress: Progress | None = None) -> None:
    with one_writer(cfg.results_dir, device):
        _train(cfg, device, progress)


def _train(cfg: TrainingConfig, device: Device, progress: Progress | None = None) -> None:
    run = _setup(cfg, device)
    _loop(run, cfg, device, progress)


@dataclasses.dataclass
class _Run:
    """What the step loop works with: built once by _setup, in the order the module's docstring gives."""

    topo: Topology
    model: torch.nn.Module
    optimizer: ShardedAdamW
    train_batches: DataParallelBatches  # or the rl stage's RolloutBatches
    valid_batches: DataParallelBatches | None  # or the rl stage's HeldOut (runtime/rl/trainer.py)
    objective: object
    valid_objective: object
    schedule: LRSchedule
    metrics: MetricsLogger
    checkpoints: TrainingCheckpoints
    start_step: int
    recovery: Recovery | None
    watch: SignalWatch | None


def build_model(cfg: TrainingConfig, topo: Topology, device: Device) -> torch.nn.Module:
    """This rank's part of the model, parallelized, with its part of the starting weights and adapters."""
    # On the meta device: shapes only. parallelize_model materializes this rank's part alone (its TP slices, its
    # stage's layers, its experts, its adapters) and fills it with the starting weights' same part, if any.
    model = meta_model(cfg.model) if cfg.reward_model is None else meta_reward_model(cfg.model)
    if cfg.lora is not None:
        apply_lora(model, cfg.lora, cfg.seed)
        if cfg.reward_model is not None:
            model.output.weight.requires_grad_(True)  # the score head trains beside the adapters
    if device.is_main and (cfg.restore_from_path or cfg.lora):
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"fine-tuning from {cfg.restore_from_path or 'random init'}: {trainable:,} of "
              f"{model.num_params():,} parameters train" + (f" (LoRA rank {cfg.lora.rank} on "
              f"{', '.join(cfg.lora.target_modules)})" if cfg.lora else ""), flush=True)
    return parallelize_as_configured(cfg, model, topo, device,
                                     starting_weights(cfg.restore_from_path, score_head=cfg.reward_model is not None))


def build_metrics(cfg: TrainingConfig, topo: Topology, device: Device) -> MetricsLogger:
    """metrics.jsonl and its sinks (rank 0 writes), and the run's opening line."""
    data = cfg.data
    # Only the main rank reports MFU; the others neither pay for a CPU's matmul probe nor disturb it.
    peak = peak_tflops(device.hardware) if device.is_main else None
    metrics = MetricsLogger(
        cfg.results_dir,
        is_main=device.is_main,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        # A preference pair is two rows through the model.
        tokens_per_step=data.global_batch_size * data.seq_length * (2 if cfg.alignment or cfg.reward_model else 1),
        flops_per_token=model_flops_per_token(cfg.model, data.seq_length),
        num_devices=device.world_size,
        peak=peak,
        tensorboard=cfg.tensorboard,
        wandb=cfg.wandb,
        wandb_kwargs=cfg.wandb_kwargs,
        run_name=cfg.run_name,
        config=cfg.raw,
        max_steps=cfg.trainer.max_steps,
    )
    if device.is_main:
        print(f"training {cfg.run_name}: {topo!r} world {device.world_size} on {device.hardware}; "
              f"{peak.describe()}; results in {cfg.results_dir}", flush=True)
        if cfg.tensorboard:
            print(f"tensorboard: tensorboard --logdir {shlex.quote(os.path.join(cfg.results_dir, 'tensorboard'))}",
                  flush=True)
    return metrics


def _setup(cfg: TrainingConfig, device: Device) -> _Run:
    """Topology, model, optimizer, data, objective, schedule, metrics, and the resumed checkpoint's step."""
    topo = build_topology(cfg, device)
    device.manual_seed(cfg.seed)
    model = build_model(cfg, topo, device)
    optimizer = ShardedAdamW(model, cfg.optim)
    release_freed_host_memory()  # the materialized parameters data parallelism copied into its flat buffers
    if cfg.rl is not None:  # GRPO: rollouts of this model as it trains, and its held-out greedy reward
        from runtime.rl.trainer import build_rl  # only this stage's runs import the rl package
        train_batches, valid_batches = build_rl(cfg, model, optimizer, topo, device, lambda: build_model(cfg, topo,
                                                                                                         device))
        objective, valid_objective = train_batches.objective, None
    else:
        train_batches, valid_batches = build_data(cfg, topo, device)
        objective, valid_objective = build_objective(cfg, model, optimizer, train_batches, valid_batches, topo, device)
    sched = cfg.optim.sched
    schedule = LRSchedule(sched.name, cfg.optim.lr, sched.max_steps, sched.warmup_steps, sched.constant_steps,
                          sched.min_lr)
    metrics = build_metrics(cfg, topo, device)

    ft = cfg.fault_tolerance
    checkpoints = TrainingCheckpoints(cfg.checkpoint, device, topo, model, optimizer, train_batches, cfg.raw,
                                      cfg.trainer.max_steps,
                                      peer_every=ft.peer_state_every_n_steps if ft and ft.enabled else 0)
    if hasattr(train_batches, "with_critic"):  # rl's PPO: the critic's checkpoints, saved and resumed with these
        checkpoints = train_batches.with_critic(checkpoints)
    checkpoints.check_room(str(cfg.results_dir))
    start_step = checkpoints.resume()
    # After a restart (the job script's, runtime/fault_tolerance/attempts.py): rank 0 records how long the fault took
    # to detect and recover from, and the time it cost, in metrics.jsonl and the run's attempt history.
    recovery = Recovery.from_env(start_step, checkpoints.resumed, str(cfg.results_dir)) if device.is_main else None
    if start_step >= cfg.trainer.max_steps and device.is_main:
        print(f"training {cfg.run_name}: the newest checkpoint is at step {start_step}, trainer.max_steps is "
              f"{cfg.trainer.max_steps}: nothing to train (raise training.trainer.max_steps to continue)", flush=True)
    watch = SignalWatch(device.torch_device) if cfg.checkpoint.save_on_signal and cfg.checkpoint.enabled else None
    return _Run(topo, model, optimizer, train_batches, valid_batches, objective, valid_objective, schedule, metrics,
                checkpoints, start_step, recovery, watch)


def _loop(run: _Run, cfg: TrainingConfig, device: Device, progress: Progress | None) -> None:
    """The steps from the resumed one to max_steps: each step's one graph and its one read, then its metrics,
    validation, checkpoint and a signal's stop; the metric sinks and the signal watch closed however it ends."""
    model, optimizer, topo, checkpoints, metrics, watch = (run.model, run.optimizer, run.topo, run.checkpoints,
                                                           run.metrics, run.watch)
    # A sleep after each step, for a test that needs a run still training when another system acts (Slurm's
    # time-limit warning, tests/checkpoint/test_preemption_slurm.py) without keeping cores busy until then. It
    # changes no result; unset, nothing waits.
    pause_s = float(os.environ.get("NXDT_STEP_PAUSE_S") or 0)

    # Every persistent tensor (weights, moments, gradient buffers, restored state) as device data before the first
    # step: on XLA a tensor still pending its creation (zeros, a copy) would make step 1's graph differ from step 2's.
    views = optimizer.data_parallel.views()
    device.settle_views(views)
    device.step_boundary()
    graphs = GraphAccounting(device, is_main=device.is_main)
    try:
        for step in range(run.start_step, cfg.trainer.max_steps):
            done = step + 1
            if progress is not None:  # the node's hang watchdog times each section (runtime/fault_tolerance)
                progress.enter("data", done)
            started = time.perf_counter()
            lr = run.schedule(step)
            with graphs.part("step", done):
                micro_batches = _to_device(run.train_batches.next_batch(), device)
                if progress is not None:
                    progress.enter("step", done)
                result = train_step(model, optimizer, micro_batches, topo, lr=lr,
                                    clip=cfg.trainer.gradient_clip_val, objective=run.objective,
                                    read_with=watch.flag() if watch is not None else None)
                device.settle_views(views)  # XLA: the updated parameters, inside this step's graph
                device.step_boundary()  # XLA: the step's one graph runs here
                result.read(check=not device.trial_run)  # its one read, after it ran (it waits for the step)
                device.synchronize()
            elapsed = time.perf_counter() - started
            loss, grad_norm = result.loss, result.grad_norm
            if not math.isfinite(loss) and not device.trial_run:  # the step's one read already holds it
                raise LossNotFinite(_diverged(loss, done, cfg, checkpoints.last_saved))
            logged = metrics.should_log(done)
            # The signal any rank had received when this step began, agreed inside the step and read with it.
            signum = (int(result.extra[0]) or None) if watch is not None and not device.trial_run else None
            extra = {**getattr(run.train_batches, "metrics", {}), **result.metrics}  # rl: the rollout's too
            if logged:
                with graphs.part("logging", done):
                    extra.update(step_stats(model, report=True), **memory_peaks(device, cfg.trainer.devices))
                extra.update(graphs.fields())
            else:
                step_stats(model, report=False)
            metrics.record_step(done, loss=loss, lr=lr, grad_norm=grad_norm, step_time_s=elapsed,
                                memory_gib=device.memory_gib(), extra=extra)
            if run.recovery is not None and (event := run.recovery.after_step(done)) is not None:
                metrics.record_event(event)
            if run.valid_batches is not None and (done % cfg.trainer.val_check_interval == 0
                                                  or done == cfg.trainer.max_steps):
                if progress is not None:
                    progress.enter("validation", done)
                with graphs.part("validation", done):
                    val_loss, val_metrics = evaluate(model, optimizer, run.valid_batches,
                                                     cfg.trainer.limit_val_batches, topo, device, run.valid_objective)
                metrics.record_validation(done, val_loss, val_metrics)
            if progress is not None:
                progress.enter("checkpoint", done)
            with graphs.part("save", done):
                checkpoints.after_step(done)
            if pause_s:
                time.sleep(pause_s)
            if signum is not None and done < cfg.trainer.max_steps:
                checkpoints.save_and_wait(done)
                device.barrier()  # nobody exits (and has torchrun stop the others) before rank 0 committed
                raise Preempted(done, signum)
        checkpoints.wait()
        # Rank 0 may still have been committing: leave together, since a gloo peer that tears down while
        # another still holds its connections can abort that process.
        device.barrier()
    finally:
        checkpoints.wait_quietly()
        if watch is not None:
            watch.close()
        metrics.close()


class LossNotFinite(Exception):
    """The global loss (the same on every rank) stopped being finite: rank 0 says so in one line, every rank stops."""


def _diverged(loss: float, step: int, cfg: TrainingConfig, last_good: int | None) -> str:
    """What to do about a loss that became NaN or inf: where to restart from, and what to change."""
    if last_good is not None and cfg.checkpoint.enabled:
        restart = (f"the last checkpoint is at step {last_good} in {cfg.checkpoint.dirpath} (resume from it after "
                   f"the change)")
    else:
        restart = "no checkpoint was saved before it"
    clip = "" if cfg.trainer.gradient_clip_val else ", set trainer.gradient_clip_val (e.g. 1.0)"
    return (f"the loss became {loss} at step {step}; {restart}; lower model.optim.lr{clip}, check the data, and "
            f"check that the starting weights (model.restore_from_path) are finite")


def memory_peaks(device: Device, devices_per_node: int) -> dict:
    """At a logged step (every rank calls it there), in one small all-reduce of a row per rank: the highest rank's
    peak host RSS and which rank, the busiest node's total (its ranks' peaks summed: what the node's memory must
    hold), and the highest device peak where the device reports one."""
    table = torch.zeros(device.world_size, 2)
    table[device.rank, 0] = device.host_peak_gib()
    table[device.rank, 1] = device.device_peak_gib() or 0.0
    if device.world_size > 1:  # alone, there is nothing to agree on: no trip to the device
        table = C.all_reduce_world(table.to(device.torch_device)).cpu()
    host = table[:, 0]
    per_node = max(1, min(devices_per_node, device.world_size))
    nodes = torch.nn.functional.pad(host, (0, -len(host) % per_node)).view(-1, per_node).sum(dim=1)
    peaks = {"host_peak_gib": float(host.max()), "host_peak_rank": int(host.argmax()),
             "node_host_peak_gib": float(nodes.max())}
    if device.device_peak_gib() is not None:
        peaks["device_peak_gib"] = float(table[:, 1].max())
    return peaks


def _draw(results_dir: str) -> None:
    """metrics.png beside metrics.jsonl (runtime/plot.py), when training ends (`nxdt-launch plot` draws any run)."""
    if not os.path.exists(os.path.join(results_dir, "metrics.jsonl")):
        return  # it stopped before its first step: nothing to draw
    try:
        from runtime.plot import plot_run

        print(f"plot: {plot_run(results_dir)}", flush=True)
    except ImportError:
        print("plot: matplotlib is not installed, so no metrics.png (pip install matplotlib)", flush=True)
    except (OSError, ValueError) as error:
        print(f"plot: no metrics.png ({error})", flush=True)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the resolved training-stage YAML the launcher wrote")
    parser.add_argument("--stage", default="training", choices=TRAINER_STAGES,
                        help="the stage this config is (names its keys in errors); fine_tuning, peft, alignment, "
                             "rlhf_rm and rl run here too")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0") or 0)
    try:
        cfg = load_training_config(args.config, args.stage)
        progress = Progress.from_env(str(cfg.results_dir))
    except ValueError as error:
        # Every rank reads the same file and fails the same way: one line is enough.
        if rank == 0:
            for line in getattr(error, "problems", None) or [_one_line(error)]:
                _say(f"error: {line}")
        return USER_ERROR_EXIT_CODE
    device, clean = None, False
    try:
        device = init_device(cfg.trainer.accelerator)
        if cfg.trainer.preflight and device.world_size > 1 and not device.trial_run:  # a trial run reads zeros
            preflight(device, timeout_s=cfg.trainer.preflight_timeout_s, results_dir=str(cfg.results_dir))
        train(cfg, device, progress)
        if device.is_main and cfg.plot:
            _draw(cfg.results_dir)
        # Leave together: rank 0 released the run lock, closed its metric sinks and drew metrics.png since train()'s
        # last barrier, and a rank must not tear its groups down while another still talks to it.
        device.barrier()
        clean = True
    except Preempted as stop:
        clean = True  # every rank stopped at the same step, past a barrier
        if device.is_main:
            _say(f"nxdt: {stop}; exiting with {PREEMPTED_EXIT_CODE} so the job is requeued")
        return PREEMPTED_EXIT_CODE
    except LossNotFinite as error:
        clean = True  # every rank read the same loss after the same step, and stops there
        if device.is_main:
            _say(f"error: {error}")
        return 1
    except PreflightError as error:
        _say(f"error: {_one_line(error)}")
        return PREFLIGHT_EXIT_CODE
    except CheckpointSaveFailed as error:  # a full disk or a vanished directory: the message says which
        _say(f"error: {_one_line(error)}")
        return 1
    except RuntimeError as error:
        if device is None or device.world_size == 1 or not C.peer_lost(error):
            raise
        if progress is not None:
            progress.close("peer_lost")
        _say(f"error (rank {rank}): another rank stopped (its error is above); stopping too")
        return 1
    except ValueError as error:
        prefix = "error" if rank == 0 else f"error (rank {rank})"
        _say(f"{prefix}: {_one_line(error)}")
        return USER_ERROR_EXIT_CODE
    finally:
        if progress is not None:
            progress.close()
        if device is not None:
            shutdown(device, drain=clean)
    return 0


def _say(line: str) -> None:
    """One line to stderr in a single write. Workers run unbuffered (python -u), where print() writes the text and
    its newline separately, and another rank's line could land between them ("...stopping tooerror: ...")."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
