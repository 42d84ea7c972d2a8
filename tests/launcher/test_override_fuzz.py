"""Random override sets through the launcher, in this process, exactly as `nxdt-launch --dry-run ...` runs them
(launcher.cli.run: the same click group, the same error handling). Whatever is typed, no exception escapes (each
user mistake must become `error:` lines), the exit code is 0 or 2, and a refused launch writes nothing.

Keys come from the real config tree, misspelled now and then; values are of every kind a user could type (huge,
negative, nan, unicode, shell characters, empty, lists, mappings, sweeps, interpolations).

The same 100 examples on every run (a fixed seed), so a failure in CI is a failure here, plus every failing
example ever found: they are kept in tests/launcher/fuzz_examples/ (Hypothesis's example database, in the repo)
and replayed first. To look further, `NXDT_FUZZ_EXAMPLES=2000 NXDT_FUZZ_SEED=7 pytest tests/launcher/
test_override_fuzz.py`; a failure found so is saved there: commit it with the fix. CI only reads the database."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

from launcher.cli import run
from launcher.compose import compose
from launcher.paths import CONFIG_GROUPS, group_choices
from launcher.stages import STAGES
from tests.slurm_cluster import _in_ci

EXAMPLES = int(os.environ.get("NXDT_FUZZ_EXAMPLES", 100))
SEED = int(os.environ.get("NXDT_FUZZ_SEED", 0))
_EXAMPLES_DIR = DirectoryBasedExampleDatabase(str(Path(__file__).with_name("fuzz_examples")))
# In CI the clone is thrown away: read the saved failures, write nothing.
DATABASE = ReadOnlyDatabase(_EXAMPLES_DIR) if _in_ci() else _EXAMPLES_DIR
TMP = "@TMP@"  # stands for the example's own directory in generated values


def _leaves(node, prefix: str = "") -> dict:
    """Every key of the tree (mappings too) with its default value."""
    found = {}
    for name, child in node.items():
        found[prefix + str(name)] = child
        if isinstance(child, dict):
            found.update(_leaves(child, f"{prefix}{name}."))
    return found


def _defaults() -> dict:
    """The default tree's keys, and those only some choices have (Neuron settings, file inputs, llama's)."""
    from omegaconf import OmegaConf

    found = {}
    for choices in (["cluster=pcluster_trn1", "data_preparation=custom_dataset", "training=llama/tiny"], []):
        found.update(_leaves(OmegaConf.to_container(compose(choices), resolve=False)))
    return found


DEFAULTS = _defaults()
KEYS = sorted(DEFAULTS)
# A dry run writes each stage's files under its run.results_dir: an absolute value there stays in the example's
# directory (a relative or broken one is refused and must write nothing).
OUTPUT_KEYS = [k for k in KEYS if k.endswith("results_dir")]
INPUT_KEYS = [k for k in KEYS if k not in OUTPUT_KEYS and k not in ("stages", *CONFIG_GROUPS)]

# Characters a shell passes through unchanged in a quoted argument; NUL cannot be in an argument at all.
text = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=24)
quoted = text.map(lambda t: "'" + t.replace("\\", "\\\\").replace("'", "\\'") + "'")


def _misspell(key: str, at: int, how: str) -> str:
    i = at % max(len(key), 1)
    if how == "drop":
        return key[:i] + key[i + 1:]
    if how == "double":
        return key[:i] + key[i:i + 1] * 2 + key[i + 1:]
    if how == "swap" and i + 1 < len(key):
        return key[:i] + key[i + 1] + key[i] + key[i + 2:]
    return key.upper()


# Values of every kind, as typed on a command line.
wild_scalars = st.one_of(
    st.integers(-(10**40), 10**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "false", "null", "None", "yes", "0", "-1", "1e400", "-1e400", "nan", "inf", "-inf",
                     "0x10", "1_000", "2**31", "9" * 40]),
    text,
    quoted,
    st.sampled_from(["$(touch pwned)", "`id`", "a;b", "a|b", "a&&b", "'", '"', "\\", "*", "?", "[", "]", "{", "}",
                     "%j", "a%xb", "..", ".", "/", "//", " ", "", "\t", "é", "日本", "🙂", "\\n", "a b", "~/x",
                     "a" * 300, "/" + "b" * 300, "s3://bucket/x", "s3://", "s3://b/*.jsonl", "http://h/x.jsonl",
                     "/nonexistent", "/etc/passwd", "/proc/nope"]),
)
wild_values = st.one_of(
    wild_scalars,
    st.lists(wild_scalars, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]"),
    st.dictionaries(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,7}", fullmatch=True), wild_scalars, max_size=3)
    .map(lambda d: "{" + ",".join(f"{k}:{v}" for k, v in d.items()) + "}"),
    st.sampled_from(["1,2", "range(1,3)", "choice(a,b)", "glob(*)", "interval(0,1)", "shuffle(1,2)", "sort(3,1)",
                     "tag(a,choice(1,2))", "int(3)", "str(4)", "[[training]]", "[]", "{}", "[[]]"]),
    st.sampled_from(["${training.run.name}", "${oops}", "${", "${multiply:2,3}", "${multiply:a,b}",
                     "${divide_ceil:1,0}", "${cwd:}", "${oc.env:HOME}", "${oc.env:NXDT_NOPE}", "${..x}", "$", "\\${x}",
                     "${training}", "${stages}"]),
)


def near(default):
    """Values of the default's own kind, mostly plausible: these reach validation and rendering, not just Hydra."""
    if isinstance(default, bool):
        return st.sampled_from(["true", "false", "1", "0", "null"])
    if isinstance(default, int):
        return st.one_of(st.integers(-3, 2 * max(abs(default), 8)).map(str),
                         st.sampled_from(["0", "-1", "65536", str(2**31), str(2**63), "9" * 30, "1.5"]))
    if isinstance(default, float):
        return st.one_of(st.floats(-10, 10).map(repr), st.sampled_from(["0.0", "1e-12", "nan", "inf", "-0.5", "1e308"]))
    if isinstance(default, list):
        return st.lists(st.one_of(st.sampled_from([repr(x) if not isinstance(x, str) else x for x in default] or ["a"]),
                                  wild_scalars), max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")
    if isinstance(default, str) and not default.startswith("${"):
        return st.one_of(st.just(default), st.builds(lambda d, t: d + t, st.just(default), text), quoted)
    return wild_values


keys = st.one_of(
    st.sampled_from(INPUT_KEYS),
    st.builds(_misspell, st.sampled_from(KEYS), st.integers(0, 80), st.sampled_from(["drop", "double", "swap", "upper"])),
    st.sampled_from(["", ".", "..", "a..b", "training.", ".training", "hydra.job.name", "hydra.run.dir", "x-y"]),
)
prefixes = st.sampled_from(["", "", "", "", "+", "++", "~"])
wild_overrides = st.builds(lambda p, k, v: f"{p}{k}" if p == "~" else f"{p}{k}={v}", prefixes, keys, wild_values)
typed_overrides = st.sampled_from(INPUT_KEYS).flatmap(lambda k: near(DEFAULTS[k]).map(lambda v: f"{k}={v}"))
# Output locations: inside the example's directory, or refused; never somewhere else on this machine.
output_overrides = st.builds(lambda k, v: f"{k}={v}", st.sampled_from(OUTPUT_KEYS), st.one_of(
    text.map(lambda t: f"'{TMP}/" + t.replace("\\", "\\\\").replace("'", "\\'") + "'"),
    st.from_regex(r"[a-z0-9_%.]{1,12}", fullmatch=True).map(lambda t: f"{TMP}/{t}"),
    st.sampled_from(["", "relative", "..", "null", "5", "[a]", "{a:1}"])))
group_overrides = st.sampled_from(CONFIG_GROUPS).flatmap(lambda g: st.one_of(
    st.sampled_from(group_choices(g)), st.sampled_from(group_choices(g)).map(lambda c: c[:-1]),
    st.sampled_from(["../config", "", "null", "5", "[a]", "@/nonexistent.yaml", "@", "/abs"]), text,
).map(lambda v: f"{g}={v}"))
stage_lists = st.one_of(
    st.lists(st.sampled_from(STAGES), unique=True, min_size=1),
    st.lists(st.sampled_from([*STAGES, "finetune", "", "Training", "[training]", "5"]), max_size=5),
).map(lambda xs: "stages=[" + ",".join(xs) + "]")
raw = text  # anything at all as one argument: `foo`, `=5`, `a=b=c`, `--bogus`

override_sets = st.lists(st.one_of(typed_overrides, typed_overrides, typed_overrides, typed_overrides, wild_overrides,
                                   output_overrides, group_overrides, stage_lists, raw), min_size=1, max_size=5)


@contextlib.contextmanager
def _isolated(directory: Path):
    """The example's own cwd (${cwd:} and relative paths) and state directory (remote launches render there)."""
    cwd, state = os.getcwd(), os.environ.get("NXDT_STATE_DIR")
    os.chdir(directory)
    os.environ["NXDT_STATE_DIR"] = str(directory / "state")
    try:
        yield
    finally:
        os.chdir(cwd)
        if state is None:
            os.environ.pop("NXDT_STATE_DIR", None)
        else:
            os.environ["NXDT_STATE_DIR"] = state


def dry_run(directory: Path, overrides: list[str]) -> tuple[int, str, str]:
    """`nxdt-launch --dry-run cluster_type=local OVERRIDES... base_results_dir=<directory>/results`, in process."""
    argv = ["--dry-run", "cluster_type=local", f"data_dir={directory}/data",
            *(o.replace(TMP, str(directory)) for o in overrides), f"base_results_dir={directory}/results"]
    out, err = io.StringIO(), io.StringIO()
    with _isolated(directory), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run(argv)  # an exception here is a user mistake without a handler, or our bug: both fail the test
    return code, out.getvalue(), err.getvalue()


@pytest.mark.long("100 override sets through Hydra's compose and every launch check, in this process (~45 s of CPU); "
                  "fewer examples would find less")
def test_no_override_set_gets_a_traceback_and_a_refused_one_writes_nothing():
    # Each example runs on one worker thread, from a shallow stack. Under pytest's deep stack the launcher's most
    # frequent calls straddle a boundary of Python 3.11's frame-stack chunks, which is then unmapped and mapped
    # again at every crossing: a third of this test's time went to mmap/munmap (60 s against 43 s for 500).
    with ThreadPoolExecutor(max_workers=1) as worker:

        @seed(SEED)
        @settings(max_examples=EXAMPLES, deadline=None, database=DATABASE,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(override_sets)
        def check(overrides: list[str]) -> None:
            with tempfile.TemporaryDirectory() as name:
                directory = Path(name)
                code, out, err = worker.submit(dry_run, directory, overrides).result()
                assert "Traceback" not in out + err, err
                assert code in (0, 2), (code, out, err)
                if code == 2:
                    lines = err.strip().splitlines()
                    assert lines and all(line.startswith("error: ") for line in lines), err
                    written = sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
                    assert not written, f"a refused launch wrote {written[:5]}"

        check()
