# torchtitan's metrics processor, also writing our metrics.jsonl (<dump_folder>/metrics.jsonl: one row per logged
# step with step, loss, lr, grad_norm, step_time_s and tokens_per_s, as runtime/metrics.py writes it), so that
# `nxdt-launch status` and `plot` read a torchtitan run's progress as they read ours.
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from torchtitan.components.metrics import MetricsProcessor


class JsonlMetricsProcessor(MetricsProcessor):
    """MetricsProcessor (console, TensorBoard, W&B as configured) plus metrics.jsonl on global rank 0."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl: bool = True
        """Write <dump_folder>/metrics.jsonl (global rank 0)."""

    def __init__(self, config: Config, *, dump_folder: str = "./outputs", **kwargs):
        super().__init__(config, dump_folder=dump_folder, **kwargs)
        self._jsonl = None
        # RANK is torchrun's; the process group is torchtitan's to own, so it is not asked here.
        if config.jsonl and int(os.environ.get("RANK", "0")) == 0:
            Path(dump_folder).mkdir(parents=True, exist_ok=True)
            self._jsonl = open(Path(dump_folder) / "metrics.jsonl", "a", buffering=1)  # readable while running
        self._last_step, self._last_time = 0, time.perf_counter()

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict | None = None):
        tokens = self.ntokens_since_last_log  # this rank's, as torchtitan counts them; reset by super().log
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
        now = time.perf_counter()
        elapsed, steps = now - self._last_time, max(step - self._last_step, 1)
        self._last_step, self._last_time = step, now
        if self._jsonl is None:
            return
        dims = self.parallel_dims
        data_ranks = dims.dp_replicate * dims.dp_shard  # ranks that read distinct samples
        lr = next((float(v) for k, v in (extra_metrics or {}).items() if k.startswith("lr")), None)
        record = {"step": step, "loss": float(global_avg_loss), "lr": lr, "grad_norm": float(grad_norm),
                  "step_time_s": elapsed / steps, "tokens_per_s": tokens * data_ranks / elapsed if elapsed else 0.0}
        self._jsonl.write(json.dumps(record) + "\n")

    def close(self):
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        super().close()
