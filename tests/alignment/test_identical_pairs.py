"""Preference pairs whose chosen equals rejected (issue 57): DPO trains on them silently at loss ln 2 with no
gradient. Reading the data refuses them in one line naming the file and the count, nothing cached; with
model.data.identical_pairs=drop they are dropped with a warning."""
import pytest

from tests.alignment.test_preference_data import build, pairs, tokenizer_dir, write_jsonl  # noqa: F401


def _with_identical(path, positions):
    rows = pairs(12)
    for i in positions:
        rows[i]["rejected"] = rows[i]["chosen"]
    return write_jsonl(path, rows)


def test_identical_pairs_are_refused_naming_the_file_and_the_count(tokenizer_dir, tmp_path):  # noqa: F811
    good = write_jsonl(tmp_path / "good.jsonl", pairs(12))
    bad = _with_identical(tmp_path / "bad.jsonl", [2, 5, 7])
    cache = tmp_path / "cache"
    with pytest.raises(ValueError) as caught:
        build([good, bad], tokenizer_dir, cache_dir=cache)
    assert str(caught.value) == (
        f"{bad}: 3 preference pairs have chosen equal to rejected, the first at {bad}:3; they teach nothing (DPO's "
        f"loss stays ln 2 with no gradient): fix the data, or set model.data.identical_pairs=drop to drop them with "
        f"a warning")
    assert not list(cache.glob("pairs_*")), "a refused build writes no cache"


def test_every_pair_identical_is_refused_even_when_dropping(tokenizer_dir, tmp_path):  # noqa: F811
    bad = _with_identical(tmp_path / "bad.jsonl", range(12))
    with pytest.raises(ValueError, match=r"bad.jsonl: 12 preference pairs have chosen equal to rejected"):
        build([bad], tokenizer_dir, cache_dir=tmp_path / "cache", identical_pairs="drop")


def test_drop_keeps_the_other_pairs_and_warns(tokenizer_dir, tmp_path, capsys):  # noqa: F811
    bad = _with_identical(tmp_path / "bad.jsonl", [2, 5, 7])
    dataset = build([bad], tokenizer_dir, cache_dir=tmp_path / "cache", identical_pairs="drop")
    assert dataset.stats["identical"] == 3 and dataset.stats["kept"] == 9 and len(dataset) == 9
    assert list(dataset.arrays["records"]) == [0, 1, 3, 4, 6, 8, 9, 10, 11]
    assert f"dropped 3 preference pairs whose chosen equals rejected (the first at {bad}:3" in capsys.readouterr().err
    clean = build([write_jsonl(tmp_path / "good.jsonl", pairs(12))], tokenizer_dir, cache_dir=tmp_path / "cache")
    assert clean.stats["identical"] == 0 and len(clean) == 12


def test_an_unknown_setting_is_refused(tokenizer_dir, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="model.data.identical_pairs"):
        build([write_jsonl(tmp_path / "good.jsonl", pairs(4))], tokenizer_dir, identical_pairs="warn")
