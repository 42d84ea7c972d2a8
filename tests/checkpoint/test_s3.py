# Checkpoints on S3: save, keep-last-2 and resume, against moto in server mode on loopback (a FAKE of AWS S3
# served over real HTTP, so boto3's real transfer code runs; tests/s3_server.py).
import pytest

from runtime.checkpoint import committed_checkpoints, open_storage
from tests.checkpoint.launch_helpers import counting_corpus, losses, training_overrides
from tests.launcher.helpers import nxdt

SCHEDULE = "++training.model.optim.sched.max_steps=12"


@pytest.mark.slow
def test_save_keep_last_two_and_resume_from_s3(tmp_path, s3, aws_env, monkeypatch):
    s3.client().create_bucket(Bucket="ckpt")
    env = {**s3.env, "AWS_ENDPOINT_URL": s3.endpoint}  # boto3 reads the endpoint from the environment
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    data = counting_corpus(tmp_path / "data")
    url = "s3://ckpt/runs/tiny"
    on_s3 = (f"training.exp_manager.checkpoint_callback_params.dirpath={url}",
             "training.exp_manager.checkpoint_callback_params.save_top_k=2", SCHEDULE)

    first = nxdt("cluster_type=local", *training_overrides(data, tmp_path / "s3run", steps=8, every=3, extra=on_s3),
                 cwd=tmp_path, env=env, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    storage = open_storage(url)
    assert [c.step for c in committed_checkpoints(storage)] == [6, 8]  # 3 was deleted once 8 was committed
    assert not (tmp_path / "s3run" / "gpt3_tiny" / "training" / "checkpoints").exists()

    second = nxdt("cluster_type=local", *training_overrides(data, tmp_path / "s3run", steps=12, every=3,
                                                             extra=on_s3), cwd=tmp_path, env=env, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resumed from {url}/step_00000008" in second.stdout + second.stderr
    assert [c.step for c in committed_checkpoints(storage)] == [9, 12]

    # The second launch continued from step 8's state: it logged steps 9-12 only, from a trained model.
    # (Bitwise resume is the kill test's job; here the dataset is sized by max_steps, which changed.)
    logged = losses(tmp_path / "s3run" / "gpt3_tiny" / "training")
    assert sorted(logged) == list(range(1, 13))
    second_lines = [line for line in second.stdout.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1]) for line in second_lines] == [9, 10, 11, 12]
    assert logged[9] < logged[1] - 0.5
