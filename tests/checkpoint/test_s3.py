# Checkpoints on S3: save, keep-last-2 and resume, against moto in server mode on loopback (a FAKE of AWS S3
# served over real HTTP, so boto3's real transfer code runs; tests/s3_server.py). The endpoint is the cluster
# config's (cluster.s3.endpoint_url, exported by the stage's job script), never boto3's own: AWS_ENDPOINT_URL points
# at a port nothing listens on.
import shlex
import uuid
from pathlib import Path

import pytest

from runtime.checkpoint import committed_checkpoints, open_storage
from runtime.io.s3 import S3Settings, to_env
from tests.checkpoint.launch_helpers import counting_corpus, losses, train_rendered, training_overrides
from tests.launcher.helpers import nxdt

SCHEDULE = "++training.model.optim.sched.max_steps=12"
NOWHERE = "http://127.0.0.1:9"  # the discard port: a client that ignored cluster.s3 would fail here


def test_storage_uses_the_endpoint_the_job_script_exports(aws_env, monkeypatch):
    bucket = f"nxdt-{uuid.uuid4().hex[:12]}"
    aws_env.client().create_bucket(Bucket=bucket)
    monkeypatch.setenv("AWS_ENDPOINT_URL", NOWHERE)
    for name, value in to_env(S3Settings(endpoint_url=aws_env.endpoint, retries=2)).items():
        monkeypatch.setenv(name, value)  # what `export NXDT_S3_...` in the job script does
    storage = open_storage(f"s3://{bucket}/runs/tiny")
    storage.put_bytes("step_00000001/COMMIT", b"1")
    assert storage.get_bytes("step_00000001/COMMIT") == b"1" and storage.list_dirs() == ["step_00000001"]


def _train(overrides: list[str], stage: Path, monkeypatch, capfd) -> str:
    """The training stage of this launch as the launcher renders it (--dry-run), its two ranks forked from this
    process (train_rendered) under the NXDT_S3_* variables its job script exports (the endpoint among them comes
    from cluster.s3, nowhere else): what is under test is checkpointing to S3, not the local launch of a stage
    (tests/checkpoint/test_kill_resume.py's). `stage`: the stage's results directory. Rank 0's output."""
    result = nxdt("cluster_type=local", *overrides, "--dry-run", cwd=stage.parents[2], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    exports = [shlex.split(line)[1] for line in (stage / "training.local.sh").read_text().splitlines()
               if line.startswith("export NXDT_S3_")]
    assert any(e.startswith("NXDT_S3_ENDPOINT_URL=") for e in exports), exports
    for name, _, value in (e.partition("=") for e in exports):
        monkeypatch.setenv(name, value)
    capfd.readouterr()
    codes = train_rendered(stage / "training_config.yaml")
    output = "".join(capfd.readouterr())
    assert codes == [0, 0], output[-3000:]
    return output


@pytest.mark.slow
@pytest.mark.long("trains with checkpoints on the S3 server, then resumes from it")
def test_save_keep_last_two_and_resume_from_s3(tmp_path, s3, aws_env, monkeypatch, capfd):
    s3.client().create_bucket(Bucket="ckpt")
    monkeypatch.setenv("AWS_ENDPOINT_URL", NOWHERE)
    data = counting_corpus(tmp_path / "data")
    url = "s3://ckpt/runs/tiny"
    on_s3 = (f"training.exp_manager.checkpoint_callback_params.dirpath={url}",
             "training.exp_manager.checkpoint_callback_params.save_top_k=2", SCHEDULE,
             f"cluster.s3.endpoint_url={s3.endpoint}")

    stage = tmp_path / "s3run" / "gpt3_tiny" / "training"
    _train(training_overrides(data, tmp_path / "s3run", steps=8, every=3, extra=on_s3), stage, monkeypatch, capfd)
    storage = open_storage(url, S3Settings(endpoint_url=s3.endpoint))
    assert [c.step for c in committed_checkpoints(storage)] == [6, 8]  # 3 was deleted once 8 was committed
    assert not (stage / "checkpoints").exists()

    second = _train(training_overrides(data, tmp_path / "s3run", steps=12, every=3, extra=on_s3), stage,
                    monkeypatch, capfd)
    assert f"resumed from {url}/step_00000008" in second
    assert [c.step for c in committed_checkpoints(storage)] == [9, 12]

    # The second launch continued from step 8's state: it logged steps 9-12 only, from a trained model.
    # (Bitwise resume is the kill test's job; here the dataset is sized by max_steps, which changed.)
    logged = losses(stage)
    assert sorted(logged) == list(range(1, 13))
    second_lines = [line for line in second.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1].split("/")[0]) for line in second_lines] == [9, 10, 11, 12]  # "9/12"
    assert logged[9] < logged[1] - 0.5


@pytest.mark.parametrize("verify", [True, False])
def test_ranged_loads_from_s3_fill_rows_in_place_and_check_them(tmp_path, aws_env, verify):
    """Column shards (2 KiB rows) of an S3 rank file into a tp=1 target and a ZeRO-1 range of it: ranged GETs
    widened to whole checksum blocks, into the reading threads' buffers and scattered from there."""
    import torch

    from runtime.checkpoint.rankfile import RankFile, write_rank_file
    from runtime.checkpoint.reshard import RangedSource, Target

    bucket = f"nxdt-{uuid.uuid4().hex[:12]}"
    aws_env.client().create_bucket(Bucket=bucket)
    full = torch.randn(3000, 1024, generator=torch.Generator().manual_seed(2))  # 12 MiB: several blocks
    halves = [torch.arange(0, 512), torch.arange(512, 1024)]
    write_rank_file(str(tmp_path / "rank_00000.pt"), {"rank": 0}, {"model": {"w": [
        {"dim": 1, "index": rows, "full_shape": (3000, 1024), "shard_shape": (3000, 512), "start": 0,
         "value": full.index_select(1, rows).contiguous()} for rows in halves]}, "optim": {}})
    storage = open_storage(f"s3://{bucket}/ck", S3Settings(endpoint_url=aws_env.endpoint))
    storage.put_file("rank_00000.pt", str(tmp_path / "rank_00000.pt"))
    source = RangedSource([RankFile(storage, "rank_00000.pt")], verify=verify, workers=2)
    ranges = [(0, full.numel()), (1000 * 1024 + 7, 2500 * 1024 + 3)]
    outs = [torch.full((hi - lo,), float("nan")) for lo, hi in ranges]
    for (lo, hi), out in zip(ranges, outs):
        source.fill("w", Target((3000, 1024), {}), lo, hi, {"value": (out, "value")})
    source.run()
    source.close()
    for (lo, hi), out in zip(ranges, outs):
        assert torch.equal(out, full.reshape(-1)[lo:hi])
