# Damaged checkpoints are named, never trained on. Unit level: a checkpoint saved by one process, then a flipped
# byte, a truncation, a deleted file or a garbage COMMIT, locally and on the moto S3 server (a FAKE of AWS S3 over
# real HTTP, tests/s3_server.py). End to end: a 2-process ZeRO-1 run whose newest checkpoint is damaged resumes
# from the one before it and then trains exactly as the uninterrupted run did; with every checkpoint damaged it
# stops with one error line.
import json
import re
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from runtime.checkpoint import Checkpointer, committed_checkpoints, open_storage, read_rank_files
from runtime.checkpoint.integrity import DamagedCheckpoint, check_checkpoint
from runtime.io.s3 import S3Settings
from runtime.models import ModelConfig, build_model
from runtime.parallel import DataParallelConfig, ParallelDims, ShardedAdamW, Topology, parallelize_model
from tests.checkpoint.launch_helpers import counting_corpus, losses, train_rendered, training_overrides
from tests.launcher.helpers import nxdt


def _save(location: str, steps=(1, 2), settings: S3Settings | None = None):
    """Two committed checkpoints of a small model, saved by this process (no process group needed)."""
    topo = Topology.build(ParallelDims(tp=1, pp=1, dp=1, world_size=1))
    cfg = ModelConfig(architecture="gpt", vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4,
                      ffn_hidden_size=128, max_position_embeddings=32)
    model = parallelize_model(build_model(cfg), topo, data_parallel=DataParallelConfig())
    optimizer = ShardedAdamW(model, {"lr": 1e-3})
    ckpt = Checkpointer(location, rank=0, world_size=1, token="0", async_save=False)
    if settings is not None:
        ckpt.storage = open_storage(location, settings)
    for step in steps:
        ckpt.save(step, model, optimizer, topo, extra={"step": step}, config={})
    return ckpt.storage


def _flip(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _newest(storage):
    return committed_checkpoints(storage)[-1]


@pytest.mark.parametrize("damage, expected", [
    (lambda f: _flip(f), "rank_00000.pt does not match its crc32 checksum at bytes "),
    (lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]), "rank_00000.pt holds"),
    (lambda f: f.unlink(), "rank_00000.pt is missing"),
], ids=["flipped-bytes", "truncated", "deleted"])
def test_a_damaged_rank_file_is_named(tmp_path, damage, expected):
    storage = _save(str(tmp_path))
    newest = _newest(storage)
    assert check_checkpoint(storage, newest) is None
    damage(tmp_path / newest.name / "rank_00000.pt")
    assert expected in check_checkpoint(storage, newest)
    with pytest.raises(DamagedCheckpoint, match=re.escape(f"{newest.name} is damaged: {expected}")):
        read_rank_files(storage, newest)
    assert check_checkpoint(storage, committed_checkpoints(storage)[0]) is None, "the older one is intact"


def test_commit_records_every_rank_file_and_a_garbage_commit_is_named(tmp_path):
    storage = _save(str(tmp_path))
    newest = _newest(storage)
    recorded = newest.meta["files"]["rank_00000.pt"]
    assert recorded["bytes"] == (tmp_path / newest.name / "rank_00000.pt").stat().st_size
    assert len(recorded["index_sha256"]) == 64  # the index holds every block's crc32
    (tmp_path / newest.name / "COMMIT").write_text("{not json")
    assert check_checkpoint(storage, _newest(storage)) == "COMMIT is not the JSON object nxdt writes"


def test_a_checkpoint_from_before_checksums_is_still_checked_by_opening_it(tmp_path):
    storage = _save(str(tmp_path))
    newest = _newest(storage)
    commit = tmp_path / newest.name / "COMMIT"
    meta = json.loads(commit.read_text())
    del meta["files"]
    commit.write_text(json.dumps(meta))
    assert check_checkpoint(storage, _newest(storage)) is None
    rank_file = tmp_path / newest.name / "rank_00000.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:1000])
    assert check_checkpoint(storage, _newest(storage)).startswith("rank_00000.pt cannot be read (")


def test_a_damaged_object_on_s3_is_named(aws_env):
    bucket = f"nxdt-{uuid.uuid4().hex[:12]}"
    client = aws_env.client()
    client.create_bucket(Bucket=bucket)
    storage = _save(f"s3://{bucket}/run", settings=S3Settings(endpoint_url=aws_env.endpoint))
    newest = _newest(storage)
    assert check_checkpoint(storage, newest) is None
    key = f"run/{newest.name}/rank_00000.pt"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    assert check_checkpoint(storage, newest).startswith("rank_00000.pt does not match its crc32 checksum at bytes ")


# ---- end to end ------------------------------------------------------------------------------------------

STEPS, EVERY = 8, 2
ZERO1 = ("training.model.zero1=true",)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted ZeRO-1 run over 2 processes (dp = 2) with a checkpoint every 2 steps: rendered by the
    launcher (--dry-run), its ranks forked from this process (the relaunch below is the one through torchrun)."""
    root = tmp_path_factory.mktemp("straight")
    data = counting_corpus(root / "data")
    result = nxdt("cluster_type=local", *training_overrides(data, root / "results", steps=STEPS, every=EVERY,
                                                            extra=ZERO1), "--dry-run", cwd=root, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert train_rendered(root / "results" / "gpt3_tiny" / "training" / "training_config.yaml") == [0, 0]
    return root


def _copy_run(straight: Path, tmp_path: Path) -> tuple[list[str], Path]:
    """The straight run's results under a new base directory, as if it had stopped after its last checkpoint."""
    shutil.copytree(straight / "results", tmp_path / "results")
    overrides = training_overrides(straight / "data", tmp_path / "results", steps=STEPS, every=EVERY, extra=ZERO1)
    return overrides, tmp_path / "results" / "gpt3_tiny" / "training"


def _rank_file(run_dir: Path, step: int, rank: int) -> Path:
    [directory] = (run_dir / "checkpoints").glob(f"step_{step:08d}.*")
    return directory / f"rank_{rank:05d}.pt"


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
@pytest.mark.long("resumes a real run from the fallback checkpoint per kind of damage")
def test_a_damaged_newest_checkpoint_falls_back_and_resumes_exactly(straight, tmp_path, capfd, damage):
    overrides, run_dir = _copy_run(straight, tmp_path)
    newest = _rank_file(run_dir, STEPS, rank=1)
    {"flip": _flip, "truncate": lambda f: f.write_bytes(f.read_bytes()[:-100]), "delete": Path.unlink}[damage](newest)
    # The same config again: it resumes from the newest intact checkpoint and trains the steps after it. The
    # launcher renders it (--dry-run) and its two ranks are forked from this process: what is under test is the
    # trainer's choice of checkpoint (the relaunch through torchrun is test_every_checkpoint_damaged_is_one_error's).
    rendered = nxdt("cluster_type=local", *overrides, "--dry-run", cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stdout[-3000:] + rendered.stderr[-3000:]
    capfd.readouterr()
    assert train_rendered(run_dir / "training_config.yaml") == [0, 0]
    output = "".join(capfd.readouterr())
    damaged_line = [line for line in output.splitlines() if "is damaged" in line]
    assert len(damaged_line) == 1 and f"{newest.parent.name} is damaged: rank_00001.pt" in damaged_line[0], output
    assert "resuming from an older checkpoint instead" in damaged_line[0]
    assert f"resumed from {run_dir / 'checkpoints'}/step_{STEPS - EVERY:08d}." in output
    expected, got = losses(straight / "results" / "gpt3_tiny" / "training"), losses(run_dir)
    assert [got[s] for s in (STEPS - 1, STEPS)] == [expected[s] for s in (STEPS - 1, STEPS)], "bit for bit"


@pytest.mark.slow
def test_every_checkpoint_damaged_is_one_error(straight, tmp_path):
    overrides, run_dir = _copy_run(straight, tmp_path)
    for step in range(EVERY, STEPS + 1, EVERY):
        _flip(_rank_file(run_dir, step, rank=0))
    result = nxdt("cluster_type=local", *overrides, cwd=tmp_path, timeout=600)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0
    assert errors and "is intact (each damaged file is named above)" in errors[0], output[-3000:]
    assert len([line for line in output.splitlines() if "is damaged" in line]) == STEPS // EVERY
    # torchrun reports its failed child with a traceback of its own; none comes from our code.
    assert not [line for line in output.splitlines() if line.strip().startswith("File ") and "/runtime/" in line]
