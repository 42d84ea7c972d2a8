"""The adversarial sweep's classes (issue 39), kept true: damaged config files, numbers no config means, empty task
lists, and every subcommand given missing, odd and hostile arguments. Each ends in `error:` lines (one per
problem, at most cli.MAX_ERRORS and a count), exit 2, no traceback, and nothing written. Through the real CLI,
forked (helpers.nxdt). Damaged weights and checkpoint names: tests/convert/test_damaged_weights.py; a live run:
tests/checkpoint/test_one_writer.py."""

import pytest

from launcher.cli import MAX_ERRORS
from launcher.config_file import MAX_FILE_BYTES

from .helpers import nxdt, refused


def _refused(result, expected: str, cwd) -> list[str]:
    lines = refused(result, expected)
    assert not [p for p in cwd.iterdir() if p.name != "configs"], "a refused command wrote files"
    return lines


DAMAGED_YAML = {
    "tab.yaml": ("model:\n\tfoo: 1\n", "tab.yaml:2:1: not valid YAML: found character that cannot start any token; "
                                        "YAML indents with spaces, not tabs"),
    "unclosed.yaml": ("model: [1, 2\ntrainer: {}\n", "unclosed.yaml:2:8: not valid YAML: did not find expected ',' or ']'"),
}


@pytest.mark.parametrize("entry", ["training", "fine_tuning", "peft", "alignment", "explain-config"])
@pytest.mark.parametrize("name", sorted(DAMAGED_YAML))
def test_a_yaml_syntax_error_is_named_by_file_line_and_column(tmp_path, entry, name):
    text, expected = DAMAGED_YAML[name]
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / name).write_text(text)
    args = ["explain-config", f"configs/{name}"] if entry == "explain-config" else \
        [f"stages=[{entry}]", f"{entry}=@configs/{name}", f"base_results_dir={tmp_path}/results", "--dry-run"]
    _refused(nxdt(*args, cwd=tmp_path), f"configs/{expected}", tmp_path)


def test_an_empty_yaml_says_it_holds_no_keys(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "empty.yaml").write_text("")
    _refused(nxdt("training=@configs/empty.yaml", "--dry-run", cwd=tmp_path),
             "training=@configs/empty.yaml: the file holds no keys", tmp_path)


def test_a_file_too_large_to_be_a_config_is_refused_before_it_is_parsed(tmp_path):
    (tmp_path / "configs").mkdir()
    with open(tmp_path / "configs" / "huge.yaml", "wb") as f:
        f.truncate(50 << 20)  # 50 MB (sparse): parsing it took minutes and printed 520,000 lines
    for args in (["training=@configs/huge.yaml", "--dry-run"], ["explain-config", "configs/huge.yaml"]):
        _refused(nxdt(*args, cwd=tmp_path), "configs/huge.yaml: 50.0 MiB is too large to be a config", tmp_path)


def _alias_bomb() -> str:
    """1 KiB that expands to 10**9 values: each level lists the one before ten times."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\nmodel: *a8\n"


SHAPES = {
    "bomb.yaml": (_alias_bomb(), "holds more than 100,000 values once its aliases (*name) are expanded (line 5)"),
    # libyaml's composer (PyYAML's C loader) crashes the interpreter on this; the scan reads flat events.
    "deep.yaml": ("model: " + "[" * 50000 + "]" * 50000 + "\n", "nests more than 64 levels deep (line 1)"),
    "binary.yaml": (b"\xff\xfe\x00model", "not a text file (byte 0 is not UTF-8)"),
    "list.yaml": ("- 1\n- 2\n", "holds list, not a training config mapping"),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_file_that_is_not_shaped_like_a_config_is_refused_before_it_is_expanded(tmp_path, name):
    text, expected = SHAPES[name]
    (tmp_path / "configs").mkdir()
    file = tmp_path / "configs" / name
    file.write_bytes(text) if isinstance(text, bytes) else file.write_text(text)
    _refused(nxdt(f"training=@configs/{name}", "--dry-run", cwd=tmp_path, timeout=60),
             f"training=@configs/{name}: {expected}", tmp_path)


def test_thousands_of_problems_print_the_first_ones_and_a_count(tmp_path):
    (tmp_path / "configs").mkdir()
    text = "".join(f"key{i}: {i}\n" for i in range(4000))
    assert len(text) < MAX_FILE_BYTES
    (tmp_path / "configs" / "keys.yaml").write_text(text)
    lines = _refused(nxdt("training=@configs/keys.yaml", "--dry-run", cwd=tmp_path),
                     "key0 is not an NxD Training key", tmp_path)
    assert len(lines) == MAX_ERRORS + 1, len(lines)
    assert lines[-1] == f"error: ... and {4000 - MAX_ERRORS} more problems of the same input; fix the ones above " \
                        "and run it again"


TOO_BIG = "99999999999999999999"  # 2**66.4: no int64 holds it

NUMBERS = [
    (["training.trainer.max_steps=" + TOO_BIG], "training.trainer.max_steps: " + TOO_BIG + " does not fit a 64-bit"),
    (["training.model.encoder_seq_length=" + TOO_BIG], "training.model.encoder_seq_length: " + TOO_BIG + " does not"),
    (["stages=[peft]", "peft.model.peft.lora_rank=" + TOO_BIG], "peft.model.peft.lora_rank: " + TOO_BIG + " does"),
    (["stages=[evaluation]", "evaluation.micro_batch_size=" + TOO_BIG], "evaluation.micro_batch_size: " + TOO_BIG),
    (["stages=[evaluation]", "evaluation.tasks=[]"], "evaluation.tasks: [] must be a non-empty list of task names"),
    (["autoconfig", "--dry-run", "search_config.train_settings.num_nodes=nan"],
     "search_config.train_settings.num_nodes: nan is not an integer"),
    (["autoconfig", "--dry-run", "search_config.train_settings.num_nodes=inf"],
     "search_config.train_settings.num_nodes: inf is not an integer"),
    (["autoconfig", "--dry-run", "search_config.train_settings.assumed_mfu=nan"],
     "search_config.train_settings.assumed_mfu: nan is not a number"),
]


@pytest.mark.parametrize("args,expected", NUMBERS, ids=[c[1][:45] for c in NUMBERS])
def test_numbers_no_config_means_are_refused(tmp_path, args, expected):
    launch = [] if args[0] == "autoconfig" else [f"base_results_dir={tmp_path}/results", "cluster_type=local",
                                                   "--dry-run"]
    _refused(nxdt(*args, *launch, cwd=tmp_path), expected, tmp_path)


COMMANDS = ["autoconfig", "cancel", "cluster-config", "cluster-validate", "estimate", "explain-config", "logs", "plot",
            "status"]
ODD = [[], ["--bogus"], ["../../etc"], ["$(touch PWNED)"], ["a\nb"], ["x" * 5000], ["=", "'", "%s%n"]]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_takes_missing_odd_and_hostile_arguments_without_a_traceback(tmp_path, command):
    """Each argument list once per subcommand (the ones that would start work get --dry-run): exit 0 or 2, never a
    traceback; a refusal is `error:` lines and writes nothing; nothing reaches a shell."""
    for i, odd in enumerate(ODD):
        cwd = tmp_path / str(i)
        cwd.mkdir()
        args = [command, *odd, *(["--dry-run"] if command in ("autoconfig", "cluster-validate") else [])]
        result = nxdt(*args, cwd=cwd, env={"HOME": str(cwd)}, timeout=120)
        assert "Traceback" not in result.stdout + result.stderr, (args, result.stderr[-2000:])
        assert result.returncode in (0, 2), (args, result.returncode, result.stderr[-2000:])
        assert not (cwd / "PWNED").exists()
        if result.returncode == 2:
            refused(result, "error: ")
            assert not list(cwd.iterdir()), (args, "a refused command wrote files")
