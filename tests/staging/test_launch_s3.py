"""data_dir on S3, end to end with the real programs on this machine: data preparation writes to its mirror
and pushes to S3 (moto), and a later training launch on "another cluster" (another staging directory)
pulls the tokenizer, the blend and the token files and trains. A dry run touches neither S3 nor the mirror."""

import json
import uuid

from tests.launcher.helpers import nxdt


def _launch(s3, tmp_path, local_dir, *overrides, dry_run=False, env=()):
    return nxdt("cluster_type=local", f"base_results_dir={tmp_path}/results", f"data_dir={s3.url}",
                f"cluster.staging.local_dir={local_dir}", f"cluster.s3.endpoint_url={s3.endpoint}",
                *overrides, *(["--dry-run"] if dry_run else []), cwd=tmp_path, env={**s3.env, **dict(env)},
                timeout=600)


def test_data_on_s3_is_staged_in_the_jobs(s3, tmp_path):
    bucket = f"nxdt-{uuid.uuid4().hex[:12]}"
    s3.client().create_bucket(Bucket=bucket)
    s3.url = f"s3://{bucket}/datasets"

    dry = _launch(s3, tmp_path, tmp_path / "fsx_a", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert not (tmp_path / "fsx_a").exists() and "Contents" not in s3.client().list_objects_v2(Bucket=bucket)
    manifest = json.loads((tmp_path / "results/gpt3_tiny/training/training_staging.json").read_text())
    assert {p["key"] for p in manifest["pulls"]} == {"model.tokenizer.model", "model.data.data_prefix"}
    stage_config = (tmp_path / "results/gpt3_tiny/training/training_config.yaml").read_text()
    assert f"{tmp_path}/fsx_a/{bucket}/datasets/demo/tokenizer.json" in stage_config and "s3://" not in stage_config

    # A quarter of the demo's text (what is staged is the same set of files, only shorter).
    prep = _launch(s3, tmp_path, tmp_path / "fsx_a", "stages=[data_preparation]", "data_preparation.demo.max_mb=1",
                   "data_preparation.tokenizer.train.max_mb=1")
    assert prep.returncode == 0, prep.stdout[-3000:] + prep.stderr[-3000:]
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert {"datasets/demo/tokenizer.json", "datasets/demo/blend.txt"} <= keys
    assert any(k.endswith("_text_document.bin") for k in keys)

    # One worker on one thread (torchrun sets OMP_NUM_THREADS=1 only for several): the pulls happen in the job before
    # torchrun starts, whatever the number of workers. No metrics.png (matplotlib) nor tensorboard events: nothing
    # here reads them.
    train = _launch(s3, tmp_path, tmp_path / "fsx_b", "stages=[training]", "training.trainer.devices=1",
                    "training.exp_manager.create_metrics_plot=false",
                    "training.exp_manager.create_tensorboard_logger=false", "training.trainer.max_steps=3",
                    "training.trainer.val_check_interval=0", "training.trainer.log_every_n_steps=1",
                    "training.model.optim.sched.warmup_steps=1", env={"OMP_NUM_THREADS": "1"})
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    pulled = tmp_path / "fsx_b" / bucket / "datasets" / "demo"
    assert (pulled / "tokenizer.json").exists() and list(pulled.glob("*_text_document.idx"))
    assert str(pulled) in (pulled / "blend.txt").read_text(), "the pulled blend names this cluster's mirror"
    rows = [json.loads(line) for line in (tmp_path / "results/gpt3_tiny/training/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 3
