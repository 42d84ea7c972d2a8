# Training metrics: what a step cost (FLOPs, throughput, MFU) and where it is written (stdout, metrics.jsonl,
# TensorBoard, optionally W&B). Only the main rank writes; every rank may call these methods.
#
# The FLOPs-per-token formula (runtime/schema/sizes.py) and the accelerators' peak table (runtime/schema/facts.py)
# are the ones the launcher's estimator reads too, so the MFU a run reports and the one an estimate assumes mean the same thing.
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.peak_probe import Probe, cache_path, cached_probe, machine_key, read_cpuinfo
from runtime.schema.facts import PEAK_TFLOPS
from runtime.schema.model import ModelConfig
from runtime.schema.sizes import ModelShape, flops_per_token


def model_flops_per_token(model: ModelConfig, seq_length: int) -> float:
    """flops_per_token of a model as the runtime builds it (its shape at `seq_length` tokens a sample)."""
    return flops_per_token(ModelShape.of_model(model, seq_length))


# fp32 FLOPs per cycle per core of the widest fused multiply-add the CPU has: two FMA pipes of 16 (AVX-512),
# 8 (AVX2) or 4 (SSE/NEON) fp32 lanes, 2 FLOPs each. An upper bound: AMD Zen 4 executes AVX-512 at half this
# rate. Turbo clocks are not in /proc/cpuinfo, so on the clock side it can err low: cpu_peak covers that.
_FP32_FLOPS_PER_CYCLE = (("avx512f", 64), ("avx2", 32), ("sse2", 16), ("asimd", 16))


def cpu_peak_tflops(cpuinfo: str, threads: int) -> tuple[float, str] | None:
    """Theoretical fp32 peak of `threads` cores from /proc/cpuinfo (clock x FMA width), or None if it says too
    little."""
    mhz = [float(line.split(":", 1)[1]) for line in cpuinfo.splitlines() if line.lower().startswith("cpu mhz")]
    flags = set()
    for line in cpuinfo.splitlines():
        if line.lower().startswith(("flags", "features")):
            flags.update(line.split(":", 1)[1].split())
    per_cycle = next((n for flag, n in _FP32_FLOPS_PER_CYCLE if flag in flags), None)
    if not mhz or per_cycle is None or threads < 1:
        return None
    ghz = max(mhz) / 1000
    return (threads * ghz * per_cycle / 1000,
            f"cpu: {threads} core{'s' if threads > 1 else ''} x {ghz:.2f} GHz x {per_cycle} fp32 FLOP/cycle")


@dataclass(frozen=True)
class Peak:
    """A device's peak TFLOP/s (None: unknown, so no MFU), where it came from, and on a CPU the matmul probe."""

    tflops: float | None
    source: str
    probe: Probe | None = None

    def fields(self) -> dict:
        """What every training record in metrics.jsonl carries, so a reader can judge the MFU beside it."""
        probe = {"probe_tflops": self.probe.tflops, "probe_size": self.probe.size} if self.probe else {}
        return {"peak_tflops": self.tflops, "peak_source": self.source, **probe}

    def describe(self) -> str:
        text = f"peak {self.tflops:.3f} TFLOP/s ({self.source})" if self.tflops else self.source
        return text + (f"; matmul probe {self.probe.tflops:.3f} TFLOP/s at {self.probe.size}^2" if self.probe else "")


def peak_tflops(hardware: str) -> Peak:
    """The table for known accelerators; for a CPU, `cpu_peak` of the cores this process computes on (torch's
    intra-op threads), its probe cached per machine; None where neither is known."""
    if hardware in PEAK_TFLOPS:
        return Peak(PEAK_TFLOPS[hardware], f"table:{hardware}")
    if hardware == "cpu":  # device.py's name for a CPU; its peak is computed, not looked up
        return cpu_peak(read_cpuinfo(), min(torch.get_num_threads(), os.cpu_count() or 1), cache_path())
    return Peak(None, f"no peak known for {hardware}: MFU not reported")


def cpu_peak(cpuinfo: str, threads: int, cache: Path) -> Peak:
    """The higher of the theoretical peak and the best matmul rate ever measured on this machine (runtime/
    peak_probe.py). The theoretical one is an upper bound when /proc/cpuinfo says enough, so MFU stays <= 100% by
    construction and a probe slowed by load cannot pull the peak down. The probe covers CPUs whose cpuinfo says
    too little, and where it reads above the theory, the theory was wrong: turbo (on the 2-core CI machine
    cpuinfo says 2.6 GHz, and a 2048^2 matmul runs at 74 FLOP/cycle of that, above AVX-512's 64)."""
    probe = cached_probe(machine_key(cpuinfo, threads), cache)
    theory = cpu_peak_tflops(cpuinfo, threads)
    if theory is not None and theory[0] >= probe.tflops:
        return Peak(theory[0], theory[1], probe)
    above = f", above the theoretical {theory[0]:.3f} of {theory[1]}" if theory else ""
    plural = "s" if threads > 1 else ""
    return Peak(probe.tflops, f"probe: best fp32 matmul on {threads} thread{plural}{above}", probe)


class MetricsLogger:
    """Accumulates per-step timings and writes one record every `log_every_n_steps` steps."""

    def __init__(
        self,
        results_dir: str | os.PathLike,
        *,
        is_main: bool,
        log_every_n_steps: int,
        tokens_per_step: int,
        flops_per_token: float,
        num_devices: int,
        peak: Peak | None = None,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_kwargs: dict | None = None,
        run_name: str = "run",
        config: dict | None = None,
        max_steps: int | None = None,
    ):
        self.is_main, self.every = is_main, max(int(log_every_n_steps), 1)
        self.max_steps = max_steps
        # Every step after this process's first (which pays for warm-up, compilation, a resume): the ETA's pace.
        self._steady_time, self._steady_steps, self._seen = 0.0, 0, 0
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.num_devices, self.peak = num_devices, peak or Peak(None, "no peak given")
        self._warned_mfu = False
        self._window_time, self._window_steps = 0.0, 0
        self._jsonl = self._tensorboard = self._wandb = None
        if not is_main:
            return
        results = Path(results_dir)
        results.mkdir(parents=True, exist_ok=True)
        if wandb:  # first: the one sink that can fail on a user's setup
            self._wandb = _start_wandb(results, run_name, config or {}, wandb_kwargs or {})
        self._jsonl = open(results / "metrics.jsonl", "a", buffering=1)  # line-buffered: readable while running
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(results / "tensorboard"))

    def should_log(self, step: int) -> bool:
        """Steps are counted from 1 (updates done); step 1 is logged too, as the starting point of the curve."""
        return step == 1 or step % self.every == 0

    def record_step(
        self, step: int, *, loss: float, lr: float, grad_norm: float, step_time_s: float, memory_gib: float,
        extra: dict[str, float] | None = None,
    ) -> dict | None:
        """Add one step's timing; returns (and writes) the record when this step is logged."""
        self._window_time += step_time_s
        self._window_steps += 1
        self._seen += 1
        if self._seen > 1:
            self._steady_time += step_time_s
            self._steady_steps += 1
        if not self.should_log(step):
            return None
        mean_step = self._window_time / self._window_steps
        tokens_per_s = self.tokens_per_step / mean_step if mean_step > 0 else 0.0
        tflops = self.flops_per_token * tokens_per_s / self.num_devices / 1e12
        record = {
            "step": step,
            "loss": float(loss),
            "lr": float(lr),
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens_per_s,
            "step_time_s": mean_step,
            "tflops_per_device": tflops,
            **self._mfu(step, tflops),
            "memory_gib": memory_gib,
            **self.peak.fields(),
            **(extra or {}),  # e.g. the MoE layers' moe_aux_loss, moe_tokens_dropped, moe_load_imbalance
        }
        self._window_time, self._window_steps = 0.0, 0
        if self.is_main:
            mfu = f"{100 * record['mfu']:.1f}%" if record["mfu"] is not None else "n/a"
            print(
                f"step {self._progress(step, mean_step)} | loss {loss:.4f} | lr {lr:.3e} | grad_norm {grad_norm:.3f} | "
                f"{tokens_per_s:,.0f} tok/s | {mean_step:.3f} s/step | {tflops:.3f} TFLOP/s/dev | mfu {mfu} | "
                f"mem {memory_gib:.2f} GiB" + _shown(extra),
                flush=True,
            )
            self._write(record)
        return record

    def _mfu(self, step: int, tflops: float) -> dict:
        """{"mfu": ...}; above 1 the peak is wrong, not the step: reported as 1, with the raw figure as mfu_raw and
        a warning (once) that names where the peak came from."""
        if not self.peak.tflops:
            return {"mfu": None}
        mfu = tflops / self.peak.tflops
        if mfu <= 1:
            return {"mfu": mfu}
        if self.is_main and not self._warned_mfu:
            self._warned_mfu = True
            print(f"warning: step {step}: MFU {100 * mfu:.0f}% against a peak of {self.peak.tflops:.3f} TFLOP/s "
                  f"({self.peak.source}) that this run exceeds; reported as 100%, the raw figure as mfu_raw",
                  file=sys.stderr, flush=True)
        return {"mfu": 1.0, "mfu_raw": mfu}

    def _progress(self, step: int, mean_step: float) -> str:
        """"12/40 (eta 0:00:06)": the pace of the steady steps so far (this window's if there are none yet)."""
        if not self.max_steps:
            return str(step)
        pace = self._steady_time / self._steady_steps if self._steady_steps else mean_step
        return f"{step}/{self.max_steps} (eta {format_duration(max(self.max_steps - step, 0) * pace)})"

    def record_validation(self, step: int, val_loss: float | None, extra: dict[str, float] | None = None) -> None:
        """extra: the objective's other figures (the alignment stage's rewards), written as val_<name>. val_loss
        None: a validation without a loss (the rl stage's held-out reward)."""
        if self.is_main:
            values = {f"val_{k}": float(v) for k, v in (extra or {}).items()}
            loss = {} if val_loss is None else {"val_loss": float(val_loss)}
            print(f"step {step}" + "".join(f" | {k} {v:.4f}" for k, v in loss.items()) + _shown(values), flush=True)
            self._write({"step": step, **loss, **values})

    def record_event(self, event: dict) -> None:
        """A record of something that happened to the run (a recovery, runtime/fault_tolerance/recovery.py): in
        metrics.jsonl beside the steps, with no loss, so that readers of losses pass it by; not charted."""
        if self.is_main:
            print("nxdt: " + ", ".join(f"{k} {v}" for k, v in event.items() if k not in ("event", "at")), flush=True)
            self._jsonl.write(json.dumps(event) + "\n")
            self._jsonl.flush()

    def _write(self, record: dict) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        step = record["step"]
        scalars = {k: v for k, v in record.items()
                   if k not in _NOT_CHARTED and isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tensorboard is not None:
            for name, value in scalars.items():
                tag = f"val/{name[4:]}" if name.startswith("val_") else f"train/{name}"
                self._tensorboard.add_scalar(tag, value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


# Not charted: the step is the x axis; the peak figures, in every record of metrics.jsonl, are the same all run.
_NOT_CHARTED = ("step", "peak_tflops", "probe_tflops", "probe_size")

# Figures worth a place on the console line besides the loss (the rest are in metrics.jsonl).
_CONSOLE = ("reward_accuracy", "reward_margin", "val_reward_accuracy", "val_reward_margin",
            "reward", "kl", "completion_length", "val_reward", "val_exact")  # the rl stage's


def _shown(values: dict | None) -> str:
    return "".join(f" | {k} {values[k]:.3f}" for k in _CONSOLE if values and k in values)


def format_duration(seconds: float) -> str:
    """h:mm:ss, as a progress line shows it."""
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def wandb_init_args(results: Path, run_name: str, config: dict, kwargs: dict, environ=os.environ) -> dict:
    """wandb.init's arguments from NeMo's wandb_logger_kwargs (Lightning's WandbLogger names: offline, save_dir,
    version); offline unless credentials or WANDB_MODE say otherwise, so a run without network still logs."""
    args = {"project": "nxdt-launch", "name": run_name, "dir": str(results), "config": config}
    for key, value in kwargs.items():
        if key == "offline" or value is None:  # null: the default above
            continue
        args[{"save_dir": "dir", "version": "id"}.get(key, key)] = value
    if kwargs.get("offline"):
        args["mode"] = "offline"
    else:
        args["mode"] = environ.get("WANDB_MODE") or ("online" if environ.get("WANDB_API_KEY") else "offline")
    if args.get("tags") is not None:
        args["tags"] = [str(t) for t in args["tags"]]
    return args


def _start_wandb(results: Path, run_name: str, config: dict, kwargs: dict):
    try:
        import wandb
    except ImportError:
        raise ValueError(
            "exp_manager.create_wandb_logger is true but wandb is not installed; pip install wandb, "
            "or set exp_manager.create_wandb_logger=false"
        ) from None
    args = wandb_init_args(results, run_name, config, kwargs)
    print(f"wandb: logging {args['mode']} under {args['dir']}/wandb", file=sys.stderr)
    return wandb.init(**args)
