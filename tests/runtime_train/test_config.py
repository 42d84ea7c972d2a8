# The resolved training YAML: the reference configs load into typed sections, and mistakes name their key.
import copy

import pytest
import yaml

from runtime.config import load_training_config, parse_training_config


@pytest.fixture
def tokenizer(tmp_path, tokenizer_builder):
    path = tmp_path / "tokenizer.json"
    vocab = tokenizer_builder(path, [f"w{i}" for i in range(200)])
    return path, vocab


@pytest.fixture
def dataset(tmp_path, mmidx_writer):
    return mmidx_writer(tmp_path / "tokens", [[1, 2, 3], [4, 5]])


@pytest.mark.parametrize("architecture", ["gpt", "llama"])
def test_reference_configs_load(tmp_path, tokenizer, dataset, reference_config, architecture):
    path, vocab = tokenizer
    raw = reference_config(architecture, results_dir=tmp_path / "r", data_prefix=[1, dataset], tokenizer=path)
    config_file = tmp_path / "training_config.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    cfg = load_training_config(config_file)
    assert cfg.tokenizer_vocab_size == vocab == 201
    assert cfg.model.vocab_size == 256  # padded to make_vocab_size_divisible_by = 128
    assert cfg.model.architecture == architecture
    assert cfg.model.ffn_hidden_size == (512 if architecture == "gpt" else 352)
    assert cfg.trainer.max_steps == 150 and cfg.trainer.accelerator == "cpu"
    assert cfg.data.seq_length == 128 and cfg.data.global_batch_size == 16 and cfg.data.micro_batch_size == 4
    assert cfg.optim.betas == (0.9, 0.95) and cfg.optim.sched.name == "CosineAnnealing"
    assert cfg.optim.sched.max_steps == 150  # from trainer.max_steps
    assert cfg.parallel.tp == 1 and cfg.parallel.activation_checkpointing is None
    assert cfg.precision.type == "fp32" and cfg.tensorboard and not cfg.wandb
    if architecture == "llama":
        assert cfg.model.num_query_groups == 2 and not cfg.model.share_embeddings_and_output_weights


def _set(raw, dotted, value):
    node = raw
    *parents, last = dotted.split(".")
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return raw


_DELETE = object()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("precision.type", "bf16", "training.precision.type: 'bf16' is not one of fp32, bf16SR, mixed_precision"),
        ("trainer.accelerator", "tpu", "training.trainer.accelerator: 'tpu' is not one of cpu, gpu, neuron"),
        ("trainer.max_steps", "many", "training.trainer.max_steps: 'many' is not an integer"),
        ("trainer.max_steps", _DELETE, "training.trainer.max_steps: missing"),
        ("trainer.val_check_interval", 0.25, "training.trainer.val_check_interval: 0.25 must be a whole number of steps"),
        ("model.micro_batch_size", 0, "training.model.micro_batch_size: 0 must be a positive integer"),
        ("model.global_batch_size", 10, "training.model.global_batch_size: 10 is not divisible by micro_batch_size × data-parallel size = 4 × 2 = 8"),
        ("model.tensor_model_parallel_size", 3, "the padded vocabulary 256 \\(201 tokens rounded up to a multiple of 128\\) is not divisible by tensor_model_parallel_size 3"),
        ("model.architecture", "mamba", "training.model.architecture: 'mamba' is not one of gpt, llama, gemma3, gpt_oss"),
        ("model.hidden_size", 130, "training.model.hidden_size: 130 is not divisible by num_attention_heads 4"),
        ("model.optim.betas", [0.9], r"training.model.optim.betas: \[0.9\] is invalid"),
        ("model.optim.name", "lamb", "training.model.optim.name: 'lamb' is not one of adamw"),
        ("model.optim.lr", "fast", "training.model.optim.lr: 'fast' is not a number"),
        ("model.sequence_parallel", "yes", "training.model.sequence_parallel: 'yes' is not true or false"),
        ("model.activations_checkpoint_granularity", "some", "activations_checkpoint_granularity: 'some' is not one of null, full, selective"),
        ("model.activations_checkpoint_recompute", ["attn"], "model.activations_checkpoint_recompute\\[0\\]: 'attn' is not one of core_attention, mlp"),
        ("model.data.seq_length", 64, "training.model.data.seq_length: 64 differs from model.encoder_seq_length 128"),
        ("model.tokenizer.library", "sentencepiece", "training.model.tokenizer.library: 'sentencepiece' is not one of huggingface"),
        ("model.tokenizer.model", "/nonexistent/tokenizer.json", "training.model.tokenizer.model: /nonexistent/tokenizer.json does not exist"),
        ("model.max_position_embeddings", 64, "training.model.max_position_embeddings: 64 is smaller than"),
        ("run", _DELETE, "^training.run: missing"),
        ("model.data.data_prefix", [1, "/nowhere/tokens"], "data_prefix: dataset /nowhere/tokens has no /nowhere/tokens.idx"),
        ("model.data.data_prefix", ["1", "a", "b"], r"data_prefix: \['1', 'a', 'b'\] is invalid; expected \[weight1"),
    ],
)
def test_mistakes_name_the_key(tmp_path, tokenizer, dataset, reference_config, key, value, message):
    raw = reference_config("gpt", results_dir=tmp_path, data_prefix=dataset, tokenizer=tokenizer[0])
    with pytest.raises(ValueError, match=message):
        parse_training_config(_set(copy.deepcopy(raw), key, value))


@pytest.mark.parametrize(
    "updates, message",
    [
        ({"trainer.devices": 3}, "num_nodes × devices = 1 × 3 = 3 is not divisible by tensor_model_parallel_size × pipeline_model_parallel_size = 2 × 1 = 2"),
        ({"model.num_attention_heads": 1}, "training.model.num_attention_heads: 1 is not divisible by tensor_model_parallel_size 2"),
        ({"trainer.devices": 1}, "num_nodes × devices = 1 × 1 = 1 is not divisible by"),
    ],
)
def test_layout_mistakes_are_caught_before_training(tmp_path, tokenizer, dataset, reference_config, updates, message):
    raw = reference_config("gpt", results_dir=tmp_path, data_prefix=dataset, tokenizer=tokenizer[0])
    _set(raw, "model.tensor_model_parallel_size", 2)
    for key, value in updates.items():
        _set(raw, key, value)
    with pytest.raises(ValueError, match=message):
        parse_training_config(raw)


def test_unreadable_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_training_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_training_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="training: \\['a list'\\] must be a mapping of keys"):
        load_training_config(bad)


def test_a_tokenizer_file_is_read_again_once_it_changes(tmp_path):
    """tokenizer_vocab_size keeps what it read per file version (runtime/schema/model.py): a rewritten file, as a
    rerun of data preparation writes it, is read again; a file gone or damaged is still named."""
    import json
    import os

    from runtime.schema.model import tokenizer_vocab_size

    path = tmp_path / "tokenizer.json"

    def write(vocab: int, mtime_ns: int) -> None:
        path.write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(vocab)}}, "added_tokens": []}))
        os.utime(path, ns=(mtime_ns, mtime_ns))

    write(300, 1_000_000_000)
    assert tokenizer_vocab_size(path) == tokenizer_vocab_size(str(path)) == 300
    write(301, 2_000_000_000)
    assert tokenizer_vocab_size(path) == 301
    path.write_text("{")
    with pytest.raises(ValueError, match="is not a readable tokenizer.json"):
        tokenizer_vocab_size(path)
    path.unlink()
    with pytest.raises(ValueError, match="does not exist"):
        tokenizer_vocab_size(path)
