"""The preference-pair pipeline on real files and a small ChatML byte-level BPE trained here: records and their
errors, the shared prompt, the response-only loss mask, truncation, the row layout, the cache, worker processes,
parquet."""
import gzip
import json
import multiprocessing

import numpy as np
import pytest

from runtime.alignment import data as preference_data
from runtime.alignment.data import build_preference_dataset
from runtime.schema.chat import ChatTokenizer
from runtime.schema.preference_pairs import check_preference_file
from runtime.schema.records import read_preference_records
from runtime.sft.dataset import epoch_samples
from runtime.sft.synthetic import tokenizer_config, train_tokenizer
from tests.sft.chatml import render_chatml

LIMIT_KEY = "model_alignment_strategy.dpo.max_dpo_prompt_length"
END = "<|im_end|>\n"
MULTI_TURN = [{"role": "system", "content": "You are terse."},
              {"role": "user", "content": "reverse: red fox"},
              {"role": "assistant", "content": "fox red"},
              {"role": "user", "content": "upper: blue owl"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    texts = ["user assistant system", "reverse: red fox the sun", "fox red", "upper: blue owl", "BLUE OWL",
             "sort: 3 1 2", "1 2 3", "You are terse.", "the red fox and the blue owl"] * 20
    tokenizer_json = train_tokenizer(texts, 400)
    directory = tmp_path_factory.mktemp("tok")
    (directory / "tokenizer.json").write_text(tokenizer_json)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tokenizer_json)))
    return directory


@pytest.fixture(scope="module")
def chat(tokenizer_dir):
    return ChatTokenizer(tokenizer_dir)


def pairs(count: int) -> list[dict]:
    """Pairs of different lengths and shapes (string and message-list prompts and responses), in a fixed order."""
    out = []
    for i in range(count):
        words = " ".join(["red fox", "blue owl", "the sun"][j % 3] for j in range(i % 5 + 1))
        if i % 4 == 0:
            out.append({"prompt": MULTI_TURN, "chosen": [{"role": "assistant", "content": "BLUE OWL"}],
                        "rejected": "blue owl"})
        else:
            out.append({"prompt": f"reverse: {words}", "chosen": " ".join(reversed(words.split())),
                        "rejected": [{"role": "assistant", "content": words}]})
    return out


def write_jsonl(path, rows):
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def build(files, tokenizer_dir, seq_length=64, **kwargs):
    kwargs.setdefault("max_prompt_length", 48)
    return build_preference_dataset(files, tokenizer_dir, seq_length, **kwargs)


def example(sample, side):
    """(ids, loss flags) of one side, rebuilt from the shifted row: input_ids[0] + labels, up to the padding."""
    row = sample[side]
    width = int(np.nonzero(row[2])[0].max()) + 1  # through the last loss token: responses end with one
    return np.concatenate([row[0, :1], row[1, :width]]), np.concatenate([[0], row[2, :width]])


def response_text(messages):
    return "".join(m["content"] + END for m in messages) if isinstance(messages, list) else messages + END


def test_the_mask_covers_exactly_the_response_and_both_sides_share_the_prompt(tmp_path, tokenizer_dir, chat):
    records = pairs(8)
    data = write_jsonl(tmp_path / "p.jsonl", records)
    ds = build([data], tokenizer_dir)
    assert len(ds) == 8 and ds.stats["pairs"] == 8 and ds.stats["dropped"] == 0
    for index, record in enumerate(records):
        sample = ds[index]
        assert sample.shape == (2, 4, 64) and sample.dtype == np.int64
        prompt = record["prompt"] if isinstance(record["prompt"], list) else \
            [{"role": "user", "content": record["prompt"]}]
        # The prompt ends with the generation header, rendered here by jinja2 (not by the code under test).
        prompt_ids = chat.tokenizer.encode(render_chatml(prompt, add_generation_prompt=True)).ids
        for side, key in enumerate(("chosen", "rejected")):
            ids, mask = example(sample, side)
            assert ids[:len(prompt_ids)].tolist() == prompt_ids  # the same tokens on both sides
            assert not mask[:len(prompt_ids)].any()  # never the prompt's own assistant turn
            assert chat.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == response_text(record[key])
            assert mask[len(prompt_ids):].all()
            # The shifted layout, then padding: pad id, label 0, mask 0.
            n = len(ids) - 1
            assert (sample[side, 0, n:] == chat.pad_id).all() and not sample[side, 1:3, n:].any()
            assert (sample[side, 3] == index).all()  # the pair's index, for the cached reference log-probs
    starts = [int(np.flatnonzero(example(ds[i], 0)[1])[0]) for i in range(8)]  # each prompt's length
    assert ds.stats["prompt_tokens"] == sum(starts)
    assert ds.stats["response_tokens"] == ds.stats["loss_tokens"] == \
        sum(len(example(ds[i], s)[0]) - starts[i] for i in range(8) for s in (0, 1))
    assert ds[-1][0, 3, 0] == 7
    with pytest.raises(IndexError):
        ds[8]


def test_a_kept_prompt_render_is_used_only_for_an_equal_conversation(chat, monkeypatch):
    from runtime.schema import chat as chat_module

    monkeypatch.setattr(chat_module, "_RENDERS_KEPT", 8)  # the bound, reached with a few conversations
    for _ in range(2):  # the second time from what render() kept
        assert chat.render(MULTI_TURN, True) == render_chatml(MULTI_TURN, add_generation_prompt=True)
    changed = [*MULTI_TURN[:-1], {"role": "user", "content": "upper: red fox"}]  # equal but for the last message
    assert chat.render(changed, True) == render_chatml(changed, add_generation_prompt=True)
    assert chat.render([dict(m) for m in changed], True) == render_chatml(changed, add_generation_prompt=True)
    assert chat_module._render_key([{"role": "user", "content": ["a", "list"]}]) is None  # rendered each time
    many = [[{"role": "user", "content": f"reverse: {i}"}] for i in range(chat_module._RENDERS_KEPT + 5)]
    assert [chat.render(m, True) for m in many] == [render_chatml(m, add_generation_prompt=True) for m in many]
    assert len(chat._rendered) == 8


def test_keep_start_cuts_the_prompt_to_the_limit(tmp_path, tokenizer_dir, chat):
    data = write_jsonl(tmp_path / "p.jsonl", pairs(4))
    full = build([data], tokenizer_dir, cache_dir=tmp_path / "full")
    cut = build([data], tokenizer_dir, max_prompt_length=10, cache_dir=tmp_path / "cut")
    for index in range(4):
        for side in (0, 1):
            whole, whole_mask = example(full[index], side)
            ids, mask = example(cut[index], side)
            start = int(np.flatnonzero(whole_mask)[0])  # where the response starts: the prompt's length
            assert start > 10 and int(np.flatnonzero(mask)[0]) == 10
            assert ids[:10].tolist() == whole[:10].tolist()  # the prompt's first 10 tokens
            assert ids[10:].tolist() == whole[start:].tolist()  # and the whole response
    assert cut.stats["prompts_truncated"] == cut.stats["truncated"] == 4
    assert full.stats["truncated"] == 0 and cut.cache_key != full.cache_key


def test_keep_end_refuses_a_prompt_over_the_limit_by_file_and_line(tmp_path, tokenizer_dir, chat):
    data = write_jsonl(tmp_path / "p.jsonl", [pairs(2)[1], pairs(1)[0]])  # the multi-turn prompt is on line 2
    length = len(chat.tokenizer.encode(render_chatml(MULTI_TURN, add_generation_prompt=True)).ids)
    expected = (f"{data}:2: the prompt is {length} tokens, over {LIMIT_KEY}=20; truncation_mode keep_end never "
                "cuts a prompt (it keeps the end next to the response whole): raise the limit, shorten the prompt "
                "or use keep_start")
    with pytest.raises(ValueError) as error:
        build([data], tokenizer_dir, max_prompt_length=20, truncation_mode="keep_end")
    assert str(error.value) == expected
    with pytest.raises(ValueError) as error:
        check_preference_file(data, tokenizer_dir, None, 64, 20, "keep_end", LIMIT_KEY)
    assert str(error.value) == expected
    assert check_preference_file(data, tokenizer_dir, None, 64, 48, "keep_end", LIMIT_KEY) is None
    orpo = "model_alignment_strategy.orpo.max_prompt_length"
    with pytest.raises(ValueError, match=f"over {orpo}=20;"):
        check_preference_file(data, tokenizer_dir, None, 64, 20, "keep_end", orpo)
    with pytest.raises(ValueError, match=r"model_alignment_strategy\.dpo\.truncation_mode: 'keep_middle' is not "
                                         r"one of keep_start, keep_end"):
        build([data], tokenizer_dir, truncation_mode="keep_middle")


def test_responses_are_cut_at_seq_length_and_pairs_without_room_dropped(tmp_path, tokenizer_dir, chat):
    long_answer = " ".join(["the red fox"] * 12)
    rows = [{"prompt": "upper: blue owl", "chosen": long_answer, "rejected": "blue owl"},
            {"prompt": "reverse: " + " ".join(["red fox"] * 20), "chosen": "fox red", "rejected": "red fox"}]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    ds = build([data], tokenizer_dir, seq_length=24, max_prompt_length=30)
    # Pair 2's prompt, cut to 30 tokens, is longer than a row's 25 (24 positions + 1): no response token is left,
    # so the pair is dropped.
    assert len(ds) == 1 and ds.stats["dropped"] == 1 and ds.stats["truncated"] == 1
    sample = ds[0]
    assert sample[0, 2, -1] == 1  # the chosen side fills the row: 25 tokens, its last label a response token
    ids, mask = example(sample, 0)
    assert len(ids) == 25
    assert long_answer.startswith(chat.decode(ids[mask == 1].tolist()))
    rejected, rejected_mask = example(sample, 1)
    assert chat.decode(rejected[rejected_mask == 1].tolist(), skip_special_tokens=False) == "blue owl" + END
    assert ds.arrays["records"].tolist() == [0]
    with pytest.raises(ValueError, match=r"every pair of .* was dropped: .* raise model\.data\.seq_length"):
        build([write_jsonl(tmp_path / "q.jsonl", rows[1:])], tokenizer_dir, seq_length=24, max_prompt_length=30)


BAD = {
    "missing chosen": ({"prompt": "a", "rejected": "b"}, "the record has no 'chosen' (keys: prompt, rejected); "
                       'a preference pair is {"prompt": ..., "chosen": ..., "rejected": ...}'),
    "missing prompt": ({"chosen": "a", "rejected": "b"}, "the record has no 'prompt'"),
    "not an object": (["a", "b"], "a record must be a JSON object, not list"),
    "number prompt": ({"prompt": 3, "chosen": "a", "rejected": "b"}, "prompt is of type int; write a string"),
    "empty response": ({"prompt": "a", "chosen": "a", "rejected": " "}, "rejected is empty"),
    "empty list": ({"prompt": "a", "chosen": [], "rejected": "b"}, "chosen is an empty list"),
    "unknown role": ({"prompt": [{"role": "bot", "content": "a"}], "chosen": "a", "rejected": "b"},
                     "prompt message 0 has role 'bot'; use one of system, user, assistant"),
    "prompt ends with assistant": ({"prompt": MULTI_TURN[:3], "chosen": "a", "rejected": "b"},
                                   "the prompt ends with a assistant message; it must end with the user message"),
    "user in response": ({"prompt": "a", "chosen": "a", "rejected": [{"role": "user", "content": "b"}]},
                         "rejected holds a user message; a response is assistant messages only"),
    "non-string content": ({"prompt": "a", "chosen": [{"role": "assistant", "content": 1}], "rejected": "b"},
                           "chosen message 0 (assistant) has content of type int"),
    "bad JSON": ('{"prompt": ', "not valid JSON"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_records_name_file_and_line(tmp_path, tokenizer_dir, case):
    record, message = BAD[case]
    data = write_jsonl(tmp_path / "p.jsonl", ["", pairs(1)[0], record])  # a blank first line still counts
    for run in (lambda: build([data], tokenizer_dir), lambda: read_preference_records(data),
                lambda: check_preference_file(data, tokenizer_dir, None, 64, 48, "keep_start", LIMIT_KEY)):
        with pytest.raises(ValueError) as error:
            run()
        assert str(error.value).startswith(f"{data}:3: ") and message in str(error.value)
        assert "\n" not in str(error.value)


def test_bad_files_are_named(tmp_path, tokenizer_dir):
    whole = gzip.compress(("".join(json.dumps(r) + "\n" for r in pairs(200))).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match=r"cut\.jsonl\.gz: truncated or corrupt gzip .*; fetch or write the file"):
        build([tmp_path / "cut.jsonl.gz"], tokenizer_dir)
    (tmp_path / "p.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"p\.csv: unknown input format; preference inputs end in \.jsonl"):
        read_preference_records(tmp_path / "p.csv")
    with pytest.raises(ValueError, match=r"no preference files; list them in model\.data\.train_ds\.file_names"):
        build([], tokenizer_dir)


def test_gzip_and_parquet_give_the_same_rows_as_jsonl(tmp_path, tokenizer_dir):
    parquet = pytest.importorskip("pyarrow.parquet")
    import pyarrow

    records = pairs(9)
    plain = build([write_jsonl(tmp_path / "p.jsonl", records)], tokenizer_dir, cache_dir=tmp_path / "a")
    packed = build([write_jsonl(tmp_path / "p.jsonl.gz", records)], tokenizer_dir, cache_dir=tmp_path / "b")
    # Parquet's columns hold one type: every prompt and response as a message list.
    as_lists = [{key: value if isinstance(value, list) else
                 [{"role": "user" if key == "prompt" else "assistant", "content": value}]
                 for key, value in r.items()} for r in records]
    parquet.write_table(pyarrow.Table.from_pylist(as_lists), tmp_path / "p.parquet")
    table = build([tmp_path / "p.parquet"], tokenizer_dir, cache_dir=tmp_path / "c")
    assert read_preference_records(tmp_path / "p.parquet")[2].where == f"{tmp_path / 'p.parquet'}:row 2"
    for other in (packed, table):
        assert len(other) == len(plain) and all(np.array_equal(plain[i], other[i]) for i in range(len(plain)))


def test_the_cache_is_reused_and_a_damaged_file_is_rebuilt(tmp_path, tokenizer_dir, monkeypatch):
    data = write_jsonl(tmp_path / "p.jsonl", pairs(12))
    calls = []
    original = preference_data._encode_chunk
    monkeypatch.setattr(preference_data, "_encode_chunk", lambda *a: calls.append(1) or original(*a))
    first = build([data], tokenizer_dir)
    assert calls and first.cache_dir == tmp_path / ".nxdt_preference_cache"
    assert (first.cache_dir / f"pairs_{first.cache_key}.json").is_file()
    calls.clear()
    second = build([data], tokenizer_dir)
    assert not calls and second.cache_key == first.cache_key and second.stats == first.stats
    assert all(np.array_equal(first[i], second[i]) for i in range(len(first)))

    tokens = next(first.cache_dir.glob("*.tokens.npy"))
    damaged = bytearray(tokens.read_bytes())
    damaged[-1] ^= 1
    tokens.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=f"{tokens}: the preference cache file .* does not match"):
        build([data], tokenizer_dir, is_builder=False)
    rebuilt = build([data], tokenizer_dir)  # the builder rebuilds, never uses the damaged file
    assert calls and all(np.array_equal(first[i], rebuilt[i]) for i in range(len(first)))
    barrier_calls = []
    build([data], tokenizer_dir, is_builder=False, barrier=lambda: barrier_calls.append(1))
    assert barrier_calls == [1]
    # Other content, limit or mode is another cache; the same content elsewhere finds this one.
    keys = {build([data], tokenizer_dir, **kw).cache_key for kw in
            ({"max_prompt_length": 47}, {"truncation_mode": "keep_end"}, {"seq_length": 65})}
    assert len(keys) == 3 and first.cache_key not in keys
    (tmp_path / "copy").mkdir()
    copy = write_jsonl(tmp_path / "copy" / "p.jsonl", pairs(12))
    assert build([copy], tokenizer_dir).cache_key == first.cache_key


def test_two_workers_give_what_one_gives(tmp_path, tokenizer_dir, monkeypatch):
    data = write_jsonl(tmp_path / "p.jsonl", pairs(40))
    one = build([data], tokenizer_dir, cache_dir=tmp_path / "one", max_prompt_length=12)
    pools = []
    real = multiprocessing.get_context
    monkeypatch.setattr(multiprocessing, "get_context", lambda method: pools.append(method) or real(method))
    two = build([data], tokenizer_dir, cache_dir=tmp_path / "two", max_prompt_length=12, num_workers=2)
    assert pools == ["spawn"]  # the pairs really went through worker processes
    for name in ("tokens", "loss", "bounds", "records"):
        assert np.array_equal(one.arrays[name], two.arrays[name]), name
    assert one.stats == two.stats and one.stats["truncated"] > 0


def test_epoch_samples_draw_pairs(tmp_path, tokenizer_dir):
    ds = build([write_jsonl(tmp_path / "p.jsonl", pairs(5))], tokenizer_dir)
    samples = epoch_samples(ds, 12, seed=3)
    indices = [int(samples[j][0, 3, 0]) for j in range(12)]
    assert samples[0].shape == (2, 4, 64)
    assert sorted(indices[:5]) == sorted(indices[5:10]) == list(range(5))
