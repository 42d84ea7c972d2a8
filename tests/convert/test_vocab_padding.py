"""A Hugging Face model whose vocab_size is not a multiple of make_vocab_size_divisible_by (GPT-2's 50257 here as
257, a fine-tune's added tokens as Llama's 600): the runtime pads its vocabulary rows on load (zeros), keeps the
padded logits out of every softmax, and cuts the rows again on export, so the model computes exactly what
transformers computes and the export is the source, tensor for tensor."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from runtime.checkpoint import write_full_checkpoint
from runtime.convert import load_hf_directory, save_hf_directory
from runtime.convert.hf import SlicedReader
from runtime.convert.pretrained import read_pretrained, read_selected
from runtime.finetune import load_pretrained
from runtime.models import build_model
from runtime.schema.training import parse_model
from tests.recipe_data import write_tokenizer

transformers = pytest.importorskip("transformers")
SEQ = 64
# kind -> (vocab_size, tied, the padded size make_vocab_size_divisible_by 128 makes of it)
KINDS = {"gpt2": (257, True, 384), "llama": (600, False, 640)}


def write_hf_model(directory, kind: str):
    """A tiny random transformers model of `kind` saved as its publisher would, with a tokenizer of fewer tokens
    than its vocab_size (a model's extra rows are its own, not padding): returns the transformers model."""
    vocab, tied, _ = KINDS[kind]
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)
        model_class = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                          tie_word_embeddings=tied)
        model_class = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # larger weights and visible norms: a misplaced row or a leaked padded logit shows
        for p in model.parameters():
            p.mul_(5.0) if p.dim() > 1 else p.add_(torch.randn(p.shape) * 0.1)
    model.save_pretrained(directory)
    write_tokenizer(directory / "tokenizer.json", vocab - 7)
    return model


def padded_config(directory):
    """The model a fine_tuning stage builds from the directory with make_vocab_size_divisible_by 128 (the schema's
    own reading, as training and conversion run it)."""
    cfg, report = parse_model({"restore_from_path": str(directory), "make_vocab_size_divisible_by": 128})
    report.raise_if_any()
    return cfg


@pytest.fixture(scope="module", params=list(KINDS))
def source(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, write_hf_model(directory, request.param)


def test_padded_import_computes_the_sources_log_probs(source):
    kind, directory, theirs = source
    vocab, tied, padded = KINDS[kind]
    cfg = padded_config(directory)
    assert (cfg.vocab_size, cfg.unpadded_vocab_size, cfg.share_embeddings_and_output_weights) == (padded, vocab, tied)
    model = build_model(cfg).eval()
    load_pretrained(model, str(directory))  # each tensor read by slices, as a training rank reads its shard
    assert torch.equal(model.embed.word.weight[vocab:], torch.zeros(padded - vocab, 32))
    assert torch.equal(model.output.weight[vocab:], torch.zeros(padded - vocab, 32))
    whole = read_pretrained(str(directory), cfg)  # the whole-directory read (.bin, legacy names) pads the same
    for name, tensor in model.state_dict().items():
        assert torch.equal(whole[name], tensor), name

    ids = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = torch.log_softmax(theirs(ids).logits.float(), dim=-1)
        logits = model(ids)
        ours = torch.log_softmax(logits, dim=-1)
        loss = model(ids[:, :-1], ids[:, 1:])
    assert logits.shape[-1] == padded and bool(torch.isneginf(logits[..., vocab:]).all())
    diff = (ours[..., :vocab] - expected).abs().max().item()
    assert diff <= 2e-4, diff
    reference = F.cross_entropy(theirs(ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    torch.testing.assert_close(loss.flatten(), reference.detach(), rtol=0, atol=2e-4)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_ranks_rows_of_a_padded_vocabulary(source, tp):
    """Each TP rank's rows of the embedding and head: the source's where they exist, zero past them (GPT-2 at tp4:
    the last rank's 96 rows are all padding)."""
    kind, directory, _ = source
    cfg = padded_config(directory)
    whole = read_pretrained(str(directory), cfg)
    reader = SlicedReader(directory, cfg)
    reader.check()
    rows = cfg.vocab_size // tp
    for name in ("embed.word.weight", "output.weight"):
        parts = [reader.read(name, {0: torch.arange(r * rows, (r + 1) * rows)}) for r in range(tp)]
        assert torch.equal(torch.cat(parts), whole[name]), name


def test_a_checkpoint_of_the_sources_rows_is_padded_as_the_directory_is(source, tmp_path):
    """The conversion stage's import writes the source's rows into a checkpoint of ours; starting from that
    checkpoint pads them as starting from the directory does (whole, and by each TP rank's rows)."""
    kind, directory, _ = source
    cfg = padded_config(directory)
    state, _, _ = load_hf_directory(directory)
    assert state["embed.word.weight"].shape[0] == KINDS[kind][0]
    location = write_full_checkpoint(str(tmp_path / "ckpt"), 0, state, config={"model": {}})
    expected = read_pretrained(str(directory), cfg)
    whole = read_pretrained(location, cfg)
    for name, tensor in expected.items():
        assert torch.equal(whole[name], tensor), name
    rows = cfg.vocab_size // 4
    for name in ("embed.word.weight", "output.weight"):
        targets = {f"{name}@{r}": (name, {0: torch.arange(r * rows, (r + 1) * rows)}) for r in range(4)}
        parts = dict(read_selected(location, cfg, targets))
        assert torch.equal(torch.cat([parts[f"{name}@{r}"] for r in range(4)]), expected[name]), name


def test_export_is_the_source_tensor_for_tensor(source, tmp_path):
    kind, directory, theirs = source
    vocab, _, _ = KINDS[kind]
    cfg = padded_config(directory)
    model = build_model(cfg).eval()
    load_pretrained(model, str(directory))
    out = save_hf_directory(tmp_path / "export", model.state_dict(), cfg, str(directory / "tokenizer.json"))

    assert json.loads((out / "config.json").read_text())["vocab_size"] == vocab
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    original, written = load_file(directory / "model.safetensors"), load_file(out / "model.safetensors")
    assert written.keys() == original.keys()
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    ids = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(exported.eval()(ids).logits, theirs(ids).logits)
