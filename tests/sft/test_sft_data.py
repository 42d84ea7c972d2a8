"""The SFT data pipeline on real files and a real (small, trained here) byte-level BPE tokenizer: records, chat
templates and the assistant-only mask, packing, truncation, epochs, the cache, worker processes, and errors."""
import gzip
import json
import multiprocessing
import re
from pathlib import Path

import numpy as np
import pytest

from runtime.schema.choices import CHAT_TEMPLATES
from runtime.sft import dataset as sft_dataset
from runtime.schema.chat import BUILTIN_TEMPLATES, ChatTokenizer, generation_examples
from runtime.sft.dataset import build_sft_dataset, epoch_samples

CHATML = BUILTIN_TEMPLATES["chatml"][0]
CHATML_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And reversed words of 'red fox'?"},
        {"role": "assistant", "content": "fox red, naturally ☃"}]


def make_tokenizer(directory: Path, specials: list[str], config: dict | None) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = ["user assistant system", "What is 2 + 2? 4", "the red fox and the blue owl", "fox red, naturally"]
    tokenizer.train_from_iterator(texts * 20, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    config = {"chat_template": CHATML, "eos_token": {"content": "<|endoftext|>"}, "pad_token": "<|pad|>",
              "bos_token": None}
    return make_tokenizer(tmp_path_factory.mktemp("tok"), CHATML_TOKENS, config)


@pytest.fixture(scope="module")
def chat(tokenizer_path) -> ChatTokenizer:
    return ChatTokenizer(tokenizer_path)


def records(count: int) -> list[dict]:
    """Chats of different lengths, some prompt/completion, in a fixed order."""
    out = []
    for i in range(count):
        words = " ".join(["red fox", "blue owl", "the sun"][j % 3] for j in range(i % 7 + 1))
        if i % 3 == 0:
            out.append({"prompt": f"Say {words}", "completion": words})
        else:
            out.append({"messages": [{"role": "user", "content": f"Repeat {words}"},
                                     {"role": "assistant", "content": words}]})
    return out


def write_jsonl(path: Path, rows: list) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def segments(row: np.ndarray) -> list[tuple]:
    """A row's examples as (input_ids, labels, loss_mask) tuples, cut where position_ids restart; not padding."""
    length = int((row[2] != 0).nonzero()[0].max()) + 1  # through the last loss token: the examples end with one
    starts = [int(i) for i in np.flatnonzero(row[3][:length] == 0)] + [length]
    assert all((row[3, a:b] == np.arange(b - a)).all() for a, b in zip(starts, starts[1:]))
    return [tuple(tuple(row[k, a:b].tolist()) for k in range(3)) for a, b in zip(starts, starts[1:])]


def all_segments(dataset) -> list[tuple]:
    return sorted(s for i in range(len(dataset)) for s in segments(dataset[i]))


def test_mask_covers_exactly_the_assistant_turns(chat):
    ids, mask = chat.encode_example(CHAT)
    assert chat.decode(ids, skip_special_tokens=False) == chat.render(CHAT)
    runs, current = [], []
    for token, flag in zip(ids + [None], mask + [0]):
        if flag:
            current.append(token)
        elif current:
            runs.append(chat.decode(current, skip_special_tokens=False))
            current = []
    assert runs == ["4<|im_end|>\n", "fox red, naturally ☃<|im_end|>\n"]
    assert chat.stop_ids == {chat.tokenizer.token_to_id("<|im_end|>"), chat.tokenizer.token_to_id("<|endoftext|>")}
    assert chat.pad_id == chat.tokenizer.token_to_id("<|pad|>")


def test_prompt_completion_is_a_user_and_an_assistant_message(tmp_path, tokenizer_path):
    pair = write_jsonl(tmp_path / "pair.jsonl", [{"prompt": "Hi", "completion": "red fox"}])
    chat_file = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                                     {"role": "assistant", "content": "red fox"}]}])
    a, b = (build_sft_dataset([f], tokenizer_path, 32, cache_dir=tmp_path / f.stem) for f in (pair, chat_file))
    assert np.array_equal(a[0], b[0]) and a.stats["loss_tokens"] > 0


def test_gzip_and_parquet_give_the_same_samples_as_jsonl(tmp_path, tokenizer_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    rows = records(20)
    plain = write_jsonl(tmp_path / "d.jsonl", rows)
    gz = write_jsonl(tmp_path / "d.jsonl.gz", rows)
    as_messages = [r if "messages" in r else {"messages": [{"role": "user", "content": r["prompt"]},
                                                          {"role": "assistant", "content": r["completion"]}]}
                   for r in rows]
    parquet.write_table(pyarrow.Table.from_pylist(as_messages), tmp_path / "d.parquet")
    built = [build_sft_dataset([f], tokenizer_path, 64, cache_dir=tmp_path / f"c{i}")
             for i, f in enumerate((plain, gz, tmp_path / "d.parquet"))]
    for other in built[1:]:
        assert len(other) == len(built[0]) and all(np.array_equal(other[i], built[0][i]) for i in range(len(other)))


def test_packing_restarts_positions_and_keeps_every_example(tmp_path, tokenizer_path, chat):
    data = write_jsonl(tmp_path / "d.jsonl", records(30))
    packed = build_sft_dataset([data], tokenizer_path, 128, packing=True, cache_dir=tmp_path / "p")
    unpacked = build_sft_dataset([data], tokenizer_path, 128, packing=False, cache_dir=tmp_path / "u")
    assert len(unpacked) == 30 and len(packed) < 30
    assert max(len(segments(packed[i])) for i in range(len(packed))) >= 3
    assert all_segments(packed) == all_segments(unpacked)
    assert packed.stats["padding_fraction"] < unpacked.stats["padding_fraction"]
    # Unpacked row i is record i, exactly as encode_example gives it, shifted for next-token prediction.
    for i, record in enumerate(records(30)):
        messages = record.get("messages") or [{"role": "user", "content": record["prompt"]},
                                              {"role": "assistant", "content": record["completion"]}]
        ids, mask = chat.encode_example(messages)
        assert segments(unpacked[i]) == [(tuple(ids[:-1]), tuple(ids[1:]), tuple(mask[1:]))]
    for sample in (packed[0], unpacked[0]):
        assert sample.shape == (4, 128) and sample.dtype == np.int64


def test_first_fit_puts_each_example_in_the_first_row_with_room():
    assert sft_dataset._first_fit([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    assert sft_dataset._first_fit([8], 8) == [[0]]


def test_padding_is_its_own_segment(tmp_path, tokenizer_path, chat):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hi", "completion": "red fox"}])
    row = build_sft_dataset([data], tokenizer_path, 40, cache_dir=tmp_path / "c")[0]
    width = len(chat.encode_example([{"role": "user", "content": "Hi"},
                                     {"role": "assistant", "content": "red fox"}])[0]) - 1
    assert (row[0, width:] == chat.pad_id).all() and not row[1:3, width:].any()
    assert row[3].tolist() == list(range(width)) + list(range(40 - width))


@pytest.mark.parametrize("truncation, kept, truncated, dropped", [
    ("right", 2, 1, 1), ("left", 3, 2, 0), ("drop", 1, 0, 2)])
def test_truncation(tmp_path, tokenizer_path, chat, truncation, kept, truncated, dropped):
    long_answer = {"prompt": "Hi", "completion": "the red fox and the blue owl " * 6}
    long_prompt = {"prompt": "the red fox and the blue owl " * 6, "completion": "fox"}
    short = {"prompt": "Hi", "completion": "fox"}
    data = write_jsonl(tmp_path / "d.jsonl", [long_answer, long_prompt, short])
    built = build_sft_dataset([data], tokenizer_path, 16, packing=False, truncation=truncation, cache_dir=tmp_path)
    assert (len(built), built.stats["truncated"], built.stats["dropped"]) == (kept, truncated, dropped)
    ids, _ = chat.encode_example([{"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": long_answer["completion"]}])
    if truncation != "drop":
        window = ids[:17] if truncation == "right" else ids[-17:]
        assert built[0][0].tolist() == window[:-1] and built[0][1].tolist() == window[1:]


def test_every_example_dropped_names_files_and_keys(tmp_path, tokenizer_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "the red fox " * 9, "completion": "fox"}])
    with pytest.raises(ValueError) as error:
        build_sft_dataset([data], tokenizer_path, 8, truncation="drop", cache_dir=tmp_path)
    assert str(data) in str(error.value) and "model.data.seq_length" in str(error.value)
    assert "model.data.truncation" in str(error.value)


def test_epoch_samples_are_deterministic_and_cover_each_epoch():
    rows = [np.full((4, 2), i) for i in range(7)]
    samples = epoch_samples(rows, 17, seed=3)
    firsts = [int(samples[j][0, 0]) for j in range(len(samples))]
    assert len(samples) == 17 and firsts == [int(s[0, 0]) for s in epoch_samples(rows, 17, seed=3)]
    assert sorted(firsts[:7]) == sorted(firsts[7:14]) == list(range(7)) and firsts[:7] != firsts[7:14]
    assert firsts != [int(s[0, 0]) for s in epoch_samples(rows, 17, seed=4)]
    with pytest.raises(IndexError):
        samples[17]


def test_the_cache_is_reused_and_a_damaged_file_is_caught(tmp_path, tokenizer_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", records(12))
    calls = []
    original = sft_dataset._encode_chunk
    monkeypatch.setattr(sft_dataset, "_encode_chunk", lambda *a: calls.append(1) or original(*a))
    first = build_sft_dataset([data], tokenizer_path, 64)
    assert calls and (tmp_path / ".nxdt_sft_cache").is_dir()
    calls.clear()
    second = build_sft_dataset([data], tokenizer_path, 64)
    assert not calls and all(np.array_equal(first[i], second[i]) for i in range(len(first)))
    assert second.stats == first.stats

    tokens = next((tmp_path / ".nxdt_sft_cache").glob("*.tokens.npy"))
    damaged = bytearray(tokens.read_bytes())
    damaged[-1] ^= 1
    tokens.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=f"{tokens}: the SFT cache file .* does not match"):
        build_sft_dataset([data], tokenizer_path, 64, is_builder=False)
    rebuilt = build_sft_dataset([data], tokenizer_path, 64)  # the builder rebuilds, never uses the damaged file
    assert calls and all(np.array_equal(first[i], rebuilt[i]) for i in range(len(first)))
    barrier_calls = []
    build_sft_dataset([data], tokenizer_path, 64, is_builder=False, barrier=lambda: barrier_calls.append(1))
    assert barrier_calls == [1]


def test_two_workers_give_what_one_gives(tmp_path, tokenizer_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", records(40))
    one = build_sft_dataset([data], tokenizer_path, 64, cache_dir=tmp_path / "one")
    pools = []
    real = multiprocessing.get_context
    monkeypatch.setattr(multiprocessing, "get_context", lambda method: pools.append(method) or real(method))
    two = build_sft_dataset([data], tokenizer_path, 64, cache_dir=tmp_path / "two", num_workers=2)
    assert pools == ["spawn"]  # the records really went through worker processes
    for name in ("tokens", "loss", "spans", "rows", "row_examples"):
        assert np.array_equal(one.arrays[name], two.arrays[name]), name
    assert one.stats == two.stats


BAD = {
    "bad JSON": (['{"prompt": "a", "completion": "b"}', '{"prompt": '], 2, "not valid JSON"),
    "no assistant": ([{"messages": [{"role": "user", "content": "a"}]}], 1, "no assistant message"),
    "unknown role": ([{"messages": [{"role": "bot", "content": "a"}]}], 1, "role 'bot'; use one of"),
    "non-string content": ([{"messages": [{"role": "assistant", "content": 3}]}], 1, "content must be a string"),
    "neither layout": ([{"text": "a"}], 1, "needs \"messages\" or both"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_records_name_file_and_line(tmp_path, tokenizer_path, case):
    lines, line, message = BAD[case]
    data = write_jsonl(tmp_path / "d.jsonl", ["", *lines])  # a blank first line still counts
    with pytest.raises(ValueError) as error:
        build_sft_dataset([data], tokenizer_path, 32, cache_dir=tmp_path)
    assert str(error.value).startswith(f"{data}:{line + 1}: ") and message in str(error.value)
    assert "\n" not in str(error.value)


def test_bad_files_are_named(tmp_path, tokenizer_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    whole = gzip.compress(("".join(json.dumps(r) + "\n" for r in records(200))).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    damaged = bytearray(whole)
    damaged[len(damaged) // 2] ^= 0xFF  # garbles a line in the middle before the CRC at the end catches it
    (tmp_path / "bad.jsonl.gz").write_bytes(bytes(damaged))
    (tmp_path / "empty.jsonl").write_text("\n")
    parquet.write_table(pyarrow.Table.from_pylist([{"prompt": "a", "completion": "b"},
                                                   {"prompt": "a", "completion": None}]), tmp_path / "d.parquet")
    expected = {"cut.jsonl.gz": "cut.jsonl.gz: truncated or corrupt gzip", "empty.jsonl": "holds no records",
                "bad.jsonl.gz": "bad.jsonl.gz: truncated or corrupt gzip",
                "d.parquet": "d.parquet:row 1: the record has keys ['prompt']"}
    for name, message in expected.items():
        with pytest.raises(ValueError, match=re.escape(message)) as error:
            build_sft_dataset([tmp_path / name], tokenizer_path, 32, cache_dir=tmp_path / "c")
        assert "\n" not in str(error.value)


def test_template_errors_name_the_key(tmp_path, tokenizer_path):
    bare = make_tokenizer(tmp_path / "bare", CHATML_TOKENS, None)
    with pytest.raises(ValueError, match=r"model.data.chat_template is unset and .*tokenizer_config.json has no"):
        ChatTokenizer(bare)
    with pytest.raises(ValueError, match="'llama3' needs the special token <|begin_of_text|>"):
        ChatTokenizer(tokenizer_path, "llama3")
    with pytest.raises(ValueError, match="'plain' ends answers with the eos token"):
        ChatTokenizer(bare, "plain")
    with pytest.raises(ValueError, match="'mistral' is neither a built-in"):
        ChatTokenizer(tokenizer_path, "mistral")
    unstable = tmp_path / "unstable.jinja"  # numbers turns from the end, so a prefix renders differently
    unstable.write_text("{% for m in messages %}{{ (messages|length - loop.index)|string + m['content'] }}"
                        "{% endfor %}")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(ValueError, match=f"{data}:1: chat template .*unstable.jinja is not prefix-stable"):
        build_sft_dataset([data], tokenizer_path, 32, chat_template=str(unstable), cache_dir=tmp_path)


def test_llama3_and_plain_templates(tmp_path):
    path = make_tokenizer(tmp_path / "llama", CHATML_TOKENS + LLAMA3_TOKENS, {"eos_token": "<|endoftext|>"})
    llama = ChatTokenizer(path, "llama3")
    ids, mask = llama.encode_example(CHAT[1:3])
    assert llama.decode(ids, skip_special_tokens=False) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>")
    assert llama.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == "4<|eot_id|>"
    assert llama.tokenizer.token_to_id("<|eot_id|>") in llama.stop_ids
    plain = ChatTokenizer(path, "plain")
    ids, mask = plain.encode_example(CHAT[1:3])
    assert plain.decode(ids, skip_special_tokens=False) == (
        "### User:\nWhat is 2 + 2?\n\n### Assistant:\n4<|endoftext|>\n\n")
    assert plain.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == "4<|endoftext|>\n\n"
    assert plain.stop_ids == {plain.tokenizer.token_to_id("<|endoftext|>")}
    assert set(BUILTIN_TEMPLATES) == set(CHAT_TEMPLATES)  # the schema's list and the templates here agree


def test_generation_examples_use_the_tokens_training_saw(tmp_path, chat):
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, {"prompt": "Hi", "completion": "red fox"}])
    examples = generation_examples([data], chat)
    assert [reference for _, reference in examples] == ["fox red, naturally ☃", "red fox"]
    ids, mask = chat.encode_example(CHAT)
    last_turn_start = max(i for i in range(len(mask)) if mask[i] and not mask[i - 1])
    assert examples[0][0] == ids[:last_turn_start]
    assert chat.decode(examples[0][0], skip_special_tokens=False).endswith("<|im_start|>assistant\n")


# ChatML written over several lines, as model repositories do: trim_blocks and lstrip_blocks decide its whitespace.
MULTILINE = """{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


@pytest.mark.parametrize("template", [CHATML, MULTILINE], ids=["chatml", "multiline"])
def test_rendering_matches_transformers(tmp_path, template):
    transformers = pytest.importorskip("transformers")
    config = {"chat_template": template, "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
    path = make_tokenizer(tmp_path, CHATML_TOKENS, config)
    ours = ChatTokenizer(path)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), chat_template=template,
                                                  eos_token="<|endoftext|>", pad_token="<|pad|>")
    for messages in (CHAT, CHAT[:2], CHAT[1:3]):
        for add_generation_prompt in (False, True):
            expected = theirs.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
            assert ours.render(messages, add_generation_prompt) == expected
    ids, mask = ours.encode_example(CHAT)
    assert ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False) == (
        "4<|im_end|>\nfox red, naturally ☃<|im_end|>\n")
