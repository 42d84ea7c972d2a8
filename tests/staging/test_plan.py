"""How a config says that data lives on S3, and what the launcher makes of it, without contacting anything:
stage configs that read the mirror, manifests that name every transfer, array sizes from the config alone,
and one-line errors for what cannot be staged."""

import pytest

from launcher import staging
from launcher.config import parse
from launcher.launch import build
from tests.launcher.helpers import nxdt, resolved

S3 = ["data_dir=s3://bucket/datasets", "cluster.staging.local_dir=/fsx/staging"]


def test_stage_configs_read_the_mirror_and_manifests_name_the_transfers():
    cfg = resolved(*S3, "stages=[data_preparation,training]")
    prep, train = build(cfg)
    assert prep.stage_config["output_dir"] == "/fsx/staging/bucket/datasets/demo"
    assert train.stage_config["model"]["tokenizer"]["model"] == "/fsx/staging/bucket/datasets/demo/tokenizer.json"
    assert staging.for_job(prep, cfg).pushes == [{"key": "output_dir", "kind": "tree", "url": "s3://bucket/datasets/demo",
                                                 "local": "/fsx/staging/bucket/datasets/demo"}]
    pulls = staging.for_job(train, cfg).pulls
    assert [(p["key"], p["kind"], p["url"]) for p in pulls] == [
        ("model.tokenizer.model", "object", "s3://bucket/datasets/demo/tokenizer.json"),
        ("model.data.data_prefix", "blend", "s3://bucket/datasets/demo/blend.txt")]


def test_prefix_lists_are_pulled_as_megatron_prefixes():
    cfg = resolved(*S3, "stages=[training]", "training.model.data.data_prefix=[1,s3://bucket/a_text_document,2,/fsx/b]")
    pull = staging.for_job(build(cfg)[0], cfg).pulls[-1]
    assert pull == {"key": "model.data.data_prefix", "url": "s3://bucket/a_text_document", "kind": "indexed",
                    "local": "/fsx/staging/bucket/a_text_document"}


def test_data_preparation_inputs_on_s3_are_counted_from_the_config():
    cfg = resolved(*S3, "data_preparation=custom_dataset", "stages=[data_preparation]",
                   "data_preparation.input.files=['s3://bucket/raw/{:02d}.jsonl.zst']", "data_preparation.input.file_numbers='0-4,7'")
    (job,) = build(cfg)
    assert job.array_size == 6
    assert [p["url"] for p in staging.for_job(job, cfg).pulls] == [
        f"s3://bucket/raw/{n:02d}.jsonl.zst" for n in (0, 1, 2, 3, 4, 7)]
    assert job.stage_config["input"]["files"] == ["/fsx/staging/bucket/raw/{:02d}.jsonl.zst"]


def test_nothing_on_s3_changes_nothing():
    cfg = parse(resolved("stages=[training]"))
    assert staging.localize(cfg) is cfg and staging.for_job(build(cfg)[0], cfg) is None


@pytest.mark.parametrize("overrides,expected", [
    (["data_dir=s3://bucket/datasets"], "cluster.staging.local_dir: None; data_dir is on S3 (s3://bucket/datasets)"),
    ([*S3, "data_preparation=custom_dataset", "stages=[data_preparation]", "data_preparation.input.files=['s3://bucket/raw/*.jsonl']"],
     "data_preparation.input.files[0]: s3://bucket/raw/*.jsonl: S3 URLs cannot hold wildcards"),
    ([*S3, "stages=[training]", "training.model.data.index_mapping_dir=/x", "training.exp_manager.resume_if_exists=s3://bucket/x"],
     "training.exp_manager.resume_if_exists: s3://bucket/x is on S3, but this stage stages only"),
])
def test_what_cannot_be_staged_is_one_error_line(tmp_path, overrides, expected):
    result = nxdt(f"base_results_dir={tmp_path}/results", "cluster_type=local", "--dry-run", *overrides, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    # One line for the staging problem (the schema may name the same key's type beside it).
    assert all(line.startswith("error: ") for line in lines), result.stderr
    assert [line for line in lines if "is on S3" in line or "S3" in expected] and \
        any(line.startswith(f"error: {expected}") for line in lines), result.stderr
