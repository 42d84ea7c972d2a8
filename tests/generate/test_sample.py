"""`python -m runtime.sample` on a tiny checkpoint written here: the printed completion is the greedy answer worked
out by re-running the full forward, with the chat template when the tokenizer has one and as raw text when not;
mistakes are one `error:` line and exit code 2."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from runtime.checkpoint import write_full_checkpoint
from runtime.config import parse_model_config
from runtime.models import build_model
from runtime.sample import main
from runtime.sft.synthetic import write_demo
from tests.sft.chatml import render_chatml

MODEL = {"architecture": "llama", "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
         "num_query_groups": 2, "max_position_embeddings": 64, "encoder_seq_length": 64, "seed": 11,
         "init_method_std": 0.1}
NEW = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(checkpoint dir, tokenizer, the model): a checkpoint of a tiny Llama's random init with the demo tokenizer."""
    out = tmp_path_factory.mktemp("sample")
    write_demo(out / "demo", num_train=40, num_valid=2, num_test=2, vocab_size=300, seed=3)
    tokenizer = str(out / "demo" / "tokenizer.json")
    section = {**MODEL, "tokenizer": {"library": "huggingface", "model": tokenizer}}
    model = build_model(parse_model_config(section, tokenizer)).eval()
    write_full_checkpoint(str(out / "checkpoints"), 3, dict(model.named_parameters()), config={"model": section})
    return out / "checkpoints", tokenizer, model


@torch.no_grad()
def greedy(model, tokenizer_json: str, text: str, stop: set[int]) -> str:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_json)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    vocab, new = tokenizer.get_vocab_size(with_added_tokens=True), []
    for _ in range(NEW):
        token = int(model(torch.tensor([ids + new]))[0, -1, :vocab].argmax())
        if token in stop:
            break
        new.append(token)
    return tokenizer.decode(new, skip_special_tokens=True)


def sample(capsys, *args) -> tuple[int, str, str]:
    code = main([*args, "--max-new-tokens", str(NEW)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_prints_the_greedy_answer_with_the_chat_template_or_raw(run, tmp_path, capsys):
    checkpoints, tokenizer, model = run
    code, out, err = sample(capsys, "--checkpoint", str(checkpoints), "--prompt", "add: 2 + 3")
    assert code == 0, err
    chat = render_chatml([{"role": "user", "content": "add: 2 + 3"}], add_generation_prompt=True)
    im_end = json.loads(open(tokenizer).read())["added_tokens"][2]
    assert im_end["content"] == "<|im_end|>"
    assert out == greedy(model, tokenizer, chat, {im_end["id"]}) + "\n"
    assert "prompt: chat template" in err

    # A tokenizer without tokenizer_config.json has no template: the text is continued as is, with no stop id.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tokenizer, bare / "tokenizer.json")
    code, out, err = sample(capsys, "--checkpoint", str(checkpoints), "--prompt", "add: 2 + 3",
                            "--tokenizer", str(bare / "tokenizer.json"))
    assert code == 0, err
    assert out == greedy(model, tokenizer, "add: 2 + 3", set()) + "\n" and "prompt: raw text" in err

    first = sample(capsys, "--checkpoint", str(checkpoints), "--prompt", "sort: 3 1", "--temperature", "1.0",
                   "--top-p", "0.9", "--seed", "4")
    assert first[0] == 0 and sample(capsys, "--checkpoint", str(checkpoints), "--prompt", "sort: 3 1",
                                    "--temperature", "1.0", "--top-p", "0.9", "--seed", "4") == first


def test_mistakes_are_one_line(run, tmp_path, capsys):
    checkpoints, _, _ = run
    code, out, err = sample(capsys, "--checkpoint", str(tmp_path / "nothing"), "--prompt", "hi")
    assert code == 2 and out == ""
    assert err == f"error: {tmp_path / 'nothing'} holds no complete checkpoint (a step_* directory with a COMMIT " \
                  f"marker)\n"
    code, out, err = sample(capsys, "--checkpoint", str(checkpoints), "--prompt", "hi", "--top-p", "0")
    assert (code, out, err) == (2, "", "error: top_p: 0.0 must be in (0, 1]\n")
