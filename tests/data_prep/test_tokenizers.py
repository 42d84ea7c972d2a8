"""Both tokenizer families, GPT-2 vocab/merges, training (reproducible, once across tasks), and the
SentencePiece -> tokenizer.json conversion the training stage reads."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from runtime.schema.data_preparation import DataError, UserError
from tests.data_prep.conftest import hf_ids, make_texts, read_indexed, run_cli, run_inprocess, stage, write_jsonl

TEXTS = make_texts(80, seed=2)


def _gpt2_reference(vocab_file, merges_file):
    """GPT-2's BPE written out plainly (byte->unicode map, GPT-2's regex, rank-ordered merges)."""
    import regex

    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    vocab = json.load(open(vocab_file, encoding="utf-8"))
    merges = [tuple(line.split()) for line in open(merges_file, encoding="utf-8").read().splitlines()[1:] if line]
    ranks = {pair: i for i, pair in enumerate(merges)}
    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def bpe(word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, _ = min(pairs)
            if rank == 1 << 30:
                break
            first, second = merges[rank]
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(text):
        return [vocab[p] for piece in pattern.findall(text)
                for p in bpe("".join(mapping[b] for b in piece.encode("utf-8")))]

    return encode


def test_gpt2_vocab_and_merges(tmp_path, hf_tokenizer):
    from tokenizers import Tokenizer

    Tokenizer.from_file(str(hf_tokenizer)).model.save(str(tmp_path))      # vocab.json + merges.txt
    write_jsonl(tmp_path / "in" / "a.jsonl", TEXTS)
    cfg = stage(tmp_path, tokenizer={"vocab_file": str(tmp_path / "vocab.json"),
                                     "merge_file": str(tmp_path / "merges.txt")})
    run_inprocess(cfg)
    _, docs = read_indexed(tmp_path / "out" / "a_text_document")
    reference = _gpt2_reference(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert [d.tolist() for d in docs] == [reference(t) + [0] for t in TEXTS]
    # The assembled tokenizer is what the training stage reads.
    written = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert written.get_vocab_size() == Tokenizer.from_file(str(hf_tokenizer)).get_vocab_size()


def test_given_tokenizer_json_is_copied_and_guarded(tmp_path, hf_tokenizer, spm_model):
    write_jsonl(tmp_path / "in" / "a.jsonl", TEXTS)
    run_inprocess(stage(tmp_path, tokenizer={"model": str(hf_tokenizer)}))
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == hf_tokenizer.read_bytes()
    other = tmp_path / "other.json"
    other.write_text(hf_tokenizer.read_text().replace('"<|endoftext|>"', '"<|end|>"'))
    with pytest.raises(UserError, match="differs from the configured tokenizer"):
        run_inprocess(stage(tmp_path, tokenizer={"model": str(other), "eod_token": "<|end|>"}))
    with pytest.raises(UserError, match="not a HF tokenizer.json"):
        run_inprocess(stage(tmp_path, output_dir=str(tmp_path / "o2"), tokenizer={"model": str(spm_model)}))


def _spm_ids(model, texts, eos=True):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model))
    return [ids + ([sp.eos_id()] if eos else []) for ids in sp.encode(texts, out_type=int)]


def _converted_agrees(model_path, json_path, texts):
    from tokenizers import Tokenizer

    converted = Tokenizer.from_file(str(json_path))
    assert converted.get_vocab_size() == __import__("sentencepiece").SentencePieceProcessor(
        model_file=str(model_path)).get_piece_size()
    want = _spm_ids(model_path, texts, eos=False)
    got = [converted.encode(t, add_special_tokens=False).ids for t in texts]
    assert got == want


def test_sentencepiece_model(tmp_path, spm_model):
    write_jsonl(tmp_path / "in" / "a.jsonl", TEXTS)
    run_inprocess(stage(tmp_path, tokenizer={"library": "sentencepiece", "model": str(spm_model)}))
    _, docs = read_indexed(tmp_path / "out" / "a_text_document")
    assert [d.tolist() for d in docs] == _spm_ids(spm_model, TEXTS)
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == spm_model.read_bytes()
    _converted_agrees(spm_model, tmp_path / "out" / "tokenizer.json", TEXTS)


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_train_huggingface_reproducibly(tmp_path, model_type):
    write_jsonl(tmp_path / "in" / "a.jsonl", make_texts(300, seed=3))
    write_jsonl(tmp_path / "in" / "b.jsonl", make_texts(300, seed=4))
    train = {"model_type": model_type, "vocab_size": 400, "special_tokens": ["<|endoftext|>", "<pad>"]}
    # HF's Unigram trainer is not reproducible (hash-map order), which is safe: tasks all encode with the one
    # published file. The BPE trainer is, so a retrained BPE tokenizer is the same tokenizer (trained twice; a
    # Unigram one once, there being nothing to compare: its training is most of this test's CPU).
    trained = []
    for run in range(2 if model_type == "bpe" else 1):
        out = tmp_path / f"out{run}"
        run_inprocess(stage(tmp_path, output_dir=str(out), tokenizer={"train": train}))
        trained.append((out / "tokenizer.json").read_bytes())
    if model_type == "bpe":
        assert trained[0] == trained[1]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "out0" / "tokenizer.json"))
    assert tokenizer.token_to_id("<|endoftext|>") == 0 and tokenizer.token_to_id("<pad>") == 1
    _, docs = read_indexed(tmp_path / "out0" / "a_text_document")
    assert [d.tolist() for d in docs] == hf_ids(tmp_path / "out0" / "tokenizer.json", make_texts(300, seed=3))
    # Changing the training settings must not silently reuse the old tokenizer.
    with pytest.raises(UserError, match="trained with other tokenizer.train settings"):
        run_inprocess(stage(tmp_path, output_dir=str(tmp_path / "out0"),
                            tokenizer={"train": {**train, "vocab_size": 500}}))


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_train_sentencepiece_and_convert(tmp_path, model_type):
    texts = make_texts(300, seed=6)
    write_jsonl(tmp_path / "in" / "a.jsonl", texts)
    train = {"model_type": model_type, "vocab_size": 700,
             "sentencepiece_args": {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3, "byte_fallback": True}}
    models = []
    for run in range(2):
        out = tmp_path / f"out{run}"
        run_inprocess(stage(tmp_path, output_dir=str(out), tokenizer={"library": "sentencepiece", "train": train}))
        models.append((out / "tokenizer.model").read_bytes())
    assert models[0] == models[1]
    out = tmp_path / "out0"
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2, 3)
    _, docs = read_indexed(out / "a_text_document")
    assert [d.tolist() for d in docs] == _spm_ids(out / "tokenizer.model", texts)
    assert all(d[-1] == 3 for d in docs)
    _converted_agrees(out / "tokenizer.model", out / "tokenizer.json", texts + make_texts(50, seed=7))


def _training_cfg(tmp_path, **extra):
    for name in "abcd":
        write_jsonl(tmp_path / "in" / f"{name}.jsonl", make_texts(150, seed=ord(name)))
    return stage(tmp_path, tokenizer={"train": {"vocab_size": 500}, **extra})


def test_parallel_tasks_train_once(tmp_path):
    cfg = _training_cfg(tmp_path)
    procs = [run_cli(cfg, tmp_path, "--task-index", str(i), "--num-tasks", "2", wait=False,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sum(o.count("training a huggingface bpe tokenizer") for o in outputs) == 1, outputs
    blend = (tmp_path / "out" / "blend.txt").read_text().splitlines()
    assert [line.split()[1].rsplit("/", 1)[1] for line in blend] == [f"{n}_text_document" for n in "abcd"]
    assert not (tmp_path / "out" / "tokenizer.lock").exists()


def test_stale_lock_is_taken_over_and_live_lock_waited_for(tmp_path, monkeypatch):
    from runtime.data_prep import tokenizer as tokenizer_module

    cfg = _training_cfg(tmp_path, wait_timeout_s=1.5)
    lock = tmp_path / "out" / "tokenizer.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("node9 12345\n")
    monkeypatch.setattr(tokenizer_module, "_POLL_S", 0.1)
    with pytest.raises(DataError, match="gave up after 2s waiting for .*tokenizer.json"):
        run_inprocess(cfg)
    old = time.time() - tokenizer_module.LOCK_STALE_S - 5
    os.utime(lock, (old, old))
    assert run_inprocess(cfg, 0, 1)
    assert (tmp_path / "out" / "tokenizer.json").exists() and not lock.exists()


def _diverging_bpe(path):
    """A byte-level BPE where tiktoken's whole-word lookup and pair merging disagree on "abcd":
    merges b+c first, so BPE gives [a, bc, d], yet "abcd" (from ab+cd) is in the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from runtime.data_prep.fast_bpe import byte_to_char

    vocab = {ch: i for i, ch in enumerate(byte_to_char().values())}
    merges = [("b", "c"), ("a", "b"), ("c", "d"), ("ab", "cd")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    return path


def test_engine_choice_and_the_guard_against_disagreement(tmp_path, hf_tokenizer, capsys):
    from runtime.data_prep.fast_bpe import ineligible

    assert ineligible(json.loads(hf_tokenizer.read_text()), add_special_tokens=False) is None
    write_jsonl(tmp_path / "in" / "a.jsonl", TEXTS)
    run_inprocess(stage(tmp_path, tokenizer={"model": str(hf_tokenizer)}))
    assert "encoded by tiktoken" in capsys.readouterr().out
    fast = (tmp_path / "out" / "a_text_document.bin").read_bytes()
    run_inprocess(stage(tmp_path, output_dir=str(tmp_path / "o2"),
                        tokenizer={"model": str(hf_tokenizer), "engine": "huggingface"}))
    assert "encoded by huggingface" in capsys.readouterr().out
    assert (tmp_path / "o2" / "a_text_document.bin").read_bytes() == fast

    diverging = _diverging_bpe(tmp_path / "diverging.json")
    write_jsonl(tmp_path / "in2" / "x.jsonl", ["abcd abcd", "dcba"])
    cfg = stage(tmp_path, input={"files": [str(tmp_path / "in2" / "x.jsonl")]}, output_dir=str(tmp_path / "o3"),
                tokenizer={"model": str(diverging)})
    with pytest.raises(DataError, match="x.jsonl: tiktoken and tokenizers disagree at line 1 .*engine: huggingface"):
        run_inprocess(cfg)
    assert not (tmp_path / "o3" / "x_text_document.bin").exists()
    cfg["tokenizer"]["engine"] = "huggingface"
    run_inprocess(cfg)
    _, docs = read_indexed(tmp_path / "o3" / "x_text_document")
    assert len(docs[0]) == 3 + 4 + 1       # [a, bc, d] + [Ġ, a, bc, d] + <|endoftext|>


def test_tiktoken_refused_where_it_cannot_match(tmp_path, spm_model):
    write_jsonl(tmp_path / "in" / "a.jsonl", TEXTS)
    train = {"model_type": "unigram", "vocab_size": 300}
    with pytest.raises(UserError, match="engine = 'tiktoken' cannot run .*its model is Unigram"):
        run_inprocess(stage(tmp_path, tokenizer={"train": train, "engine": "tiktoken"}))
