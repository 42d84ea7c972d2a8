"""Shared pieces of the torchtitan tests: a tiny corpus written by our data_preparation writer, a hand-written job
context (contract 1 of issue 60), and torchtitan run in torchrun's workers on CPU with the FAKE accelerator of
tests/titan/cpu_shim.py (loaded there by tests/titan/shim_site/sitecustomize.py)."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SHIM_SITE = Path(__file__).resolve().parent / "shim_site"
VOCAB = 128
SEQ_LEN = 16

CONTEXT = {
    "launch": "tests/titan (a hand-written context)",
    "family": "llama3",
    "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 64, "vocab_size": VOCAB,
              "rope_theta": 10000.0, "norm_eps": 1e-5, "max_seq_len": SEQ_LEN, "head_dim": None, "qk_norm": None,
              "tie_embeddings": False},
    "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 1, "tensor_parallel_degree": 1,
                    "pipeline_parallel_degree": 1, "pipeline_parallel_schedule": None,
                    "pipeline_parallel_microbatch_size": None, "context_parallel_degree": 1,
                    "expert_parallel_degree": 1},
    "training": {"local_batch_size": 2, "global_batch_size": 4, "seq_len": SEQ_LEN, "steps": 4, "max_norm": 1.0,
                 "mixed_precision_param": "float32", "mixed_precision_reduce": "float32", "seed": 1234,
                 "deterministic": True},
    "optimizer": {"name": "AdamW", "lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1},
    "lr_scheduler": {"warmup_steps": 1, "decay_ratio": None, "decay_type": "linear", "min_lr_factor": 0.1},
    "checkpoint": {"enable": False, "folder": "checkpoint", "interval": 2, "keep_latest_k": 0,
                   "initial_load_path": None, "initial_load_model_only": None},
    "activation_checkpoint": "none",
    "compile": {"enable": False, "components": None},
    "data": {"blend": [], "seed": 1234, "splits_string": "98,1,1", "index_dir": None},
    "dump_folder": "",
    "metrics": {"log_freq": 1},
    "comm": {"init_timeout_seconds": 60, "train_timeout_seconds": 60},
}


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> list[list]:
    """Two tiny corpora of random documents (our data_preparation's IndexedDatasetWriter), blended 2:1."""
    from runtime.data_prep.indexed import IndexedDatasetWriter, token_dtype

    directory = tmp_path_factory.mktemp("titan-corpus")
    rng = np.random.default_rng(0)
    blend = []
    for name, weight in (("a", 2.0), ("b", 1.0)):
        writer = IndexedDatasetWriter(directory / f"{name}.bin", directory / f"{name}.idx", token_dtype(VOCAB))
        for length in rng.integers(5, 40, size=60):
            writer.add_document(rng.integers(1, VOCAB, size=int(length)))
        writer.finish()
        blend.append([weight, str(directory / name)])
    return blend


def context(corpus: list[list], dump_folder: Path, **sections) -> dict:
    """CONTEXT on this corpus, writing to dump_folder, with sections' keys replaced ({"training": {...}})."""
    ctx = copy.deepcopy(CONTEXT)
    ctx["data"]["blend"] = corpus
    ctx["dump_folder"] = str(dump_folder)
    for section, values in sections.items():
        ctx[section].update(values)
    return ctx


def write_job(ctx: dict, path: Path) -> Path:
    from launcher.titan_module import render_module

    path.write_text(render_module(ctx))
    return path


def shim_env() -> dict[str, str]:
    """What loads the fake accelerator in every Python process started with it (torchrun's workers): the switch,
    and shim_site (its sitecustomize.py) ahead of this checkout on PYTHONPATH."""
    return {"NXDT_TITAN_CPU_SHIM": "1",
            "PYTHONPATH": os.pathsep.join([str(SHIM_SITE), str(REPO), os.environ.get("PYTHONPATH", "")])}


def run_titan(job: Path, nproc: int, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc -m runtime.titan.train --job job overrides` on CPU with the fake
    accelerator; AssertionError with its output when it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **shim_env())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "runtime.titan.train", "--job", str(job), *overrides]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    return done


def losses(dump_folder: Path) -> dict[int, float]:
    """step -> loss from the run's metrics.jsonl (runtime/titan/metrics.py)."""
    rows = [json.loads(line) for line in (dump_folder / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}
