# Training inputs that used to end in a traceback on every rank, now one line and a non-zero exit: a loss that
# stops being finite, and token ids beyond the vocabulary in the data.
import re

import numpy as np
import pytest
import yaml

from tests.checkpoint.launch_helpers import NUM_WORDS, train_here
from tests.runtime_parallel.dist_utils import run_distributed
from tests.runtime_train.helpers import build_tokenizer, reference_training_config, write_mmidx


def _corpus(directory, *, bad_token=None):
    """Counting documents over a 64-word tokenizer; bad_token: an id put at token 5 of every 4th document."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory / "tokenizer.json", [f"w{i}" for i in range(NUM_WORDS)])
    rng = np.random.default_rng(0)
    docs = [(rng.integers(NUM_WORDS) + np.arange(rng.integers(40, 90))) % NUM_WORDS + 1 for _ in range(60)]
    if bad_token is not None:
        for doc in docs[::4]:
            doc[5] = bad_token
    write_mmidx(directory / "count", docs)
    return directory


def _config(tmp_path, data, name, **changes):
    raw = reference_training_config("gpt", results_dir=tmp_path / name, data_prefix=[1, str(data / "count")],
                                    tokenizer=data / "tokenizer.json")
    raw["trainer"].update(devices=2, max_steps=4, log_every_n_steps=1, val_check_interval=0, preflight=False)
    model = raw["model"]
    model.update(encoder_seq_length=32, max_position_embeddings=32, num_layers=1, hidden_size=32,
                 ffn_hidden_size=64, num_attention_heads=2, micro_batch_size=2, global_batch_size=4,
                 make_vocab_size_divisible_by=16)
    model["data"].update(seq_length=32, splits_string="100,0,0", index_mapping_dir=str(tmp_path / name / "index"))
    model["optim"]["sched"].update(warmup_steps=0)
    raw["exp_manager"].update(create_tensorboard_logger=False, create_metrics_plot=False)
    for key, value in changes.items():
        node = raw
        *parents, last = key.split(".")
        for parent in parents:
            node = node[parent]
        node[last] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _errors(capfd):
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return [line for line in captured.err.splitlines() if line.startswith("error")]


def test_a_loss_that_stops_being_finite_is_one_line_from_rank_0(tmp_path, capfd):
    data = _corpus(tmp_path / "data")
    config = _config(tmp_path, data, "diverges", **{"model.optim.lr": 1e38, "trainer.gradient_clip_val": 0.0})
    codes = run_distributed(train_here, 2, args=(config, "training"))
    assert codes == [1, 1]
    errors = _errors(capfd)
    assert len(errors) == 1, errors
    assert errors[0].startswith("error: the loss became nan at step 2;"), errors
    assert "no checkpoint was saved before it" in errors[0]
    assert "lower model.optim.lr" in errors[0] and "trainer.gradient_clip_val" in errors[0]


def test_a_token_id_beyond_the_vocabulary_names_the_file_and_position(tmp_path, capfd):
    """A damaged .bin (or another tokenizer's data): found on the host when the batch is read, not as an
    IndexError in the embedding; the place it names really holds the id."""
    from runtime.data.indexed import IndexedDataset

    data = _corpus(tmp_path / "data", bad_token=5000)
    config = _config(tmp_path, data, "bad_ids", **{"trainer.devices": 1})
    assert run_distributed(train_here, 1, args=(config, "training")) == [2]
    errors = _errors(capfd)
    assert len(errors) == 1, errors
    found = re.fullmatch(r"error: model\.data\.data_prefix: (.+)\.bin holds token id 5000 at sequence (\d+), token "
                         r"(\d+), but the model's vocabulary has 80 ids; .* prepare the data again with this "
                         r"tokenizer", errors[0])
    assert found, errors
    prefix, sequence, offset = found.group(1), int(found.group(2)), int(found.group(3))
    assert prefix == str(data / "count") and offset == 5
    assert IndexedDataset(prefix).get(sequence)[offset] == 5000
