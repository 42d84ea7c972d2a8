"""lm-eval task names and their data, refused in one line each: at launch (nothing written) and on the node before
the model loads (runtime/evaluate/__main__.py check_inputs), with nothing downloaded."""
import pytest

from launcher.validate import lm_eval_tasks
from runtime.evaluate.__main__ import check_inputs
from runtime.schema.evaluation import parse_evaluation
from runtime.schema.reader import ConfigErrors
from tests.launcher.helpers import nxdt


def _config(tasks, **options):
    raw = {"run": {"results_dir": "/tmp/r"}, "checkpoint_dir": "/tmp/c", "tasks": tasks, **options}
    cfg, report = parse_evaluation(raw)
    assert cfg is not None, report.errors
    return cfg


def _task_file(directory, name: str, data: str) -> str:
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: a\n")
    return str(directory)


def test_an_unknown_task_name_is_refused_at_launch_with_its_close_matches(tmp_path):
    result = nxdt("cluster_type=local", "stages=[evaluation]", "evaluation.tasks=[hellaswg]", cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("error: evaluation.tasks: 'hellaswg' is not an lm-eval task") and "hellaswag," in line
    assert "Traceback" not in result.stderr and not (tmp_path / "results").exists()  # nothing written


def test_a_task_whose_local_data_file_is_missing_names_the_file(tmp_path):
    include = _task_file(tmp_path / "tasks", "mine", str(tmp_path / "gone.jsonl"))
    cfg = _config(["mine"], include_path=include)
    [], [line] = lm_eval_tasks(cfg)  # at launch (a dry run warns: it may render for another machine's files)
    assert f"mine: its data file {tmp_path / 'gone.jsonl'} does not exist" in line
    with pytest.raises(ConfigErrors) as raised:  # and on the node, before the model loads
        check_inputs(cfg)
    assert raised.value.problems == [line]


def test_a_hub_dataset_not_in_the_datasets_cache_is_one_line_naming_where_it_looked(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))  # check_inputs sets it from the config: undone after
    cfg = _config(["hellaswag"], datasets_cache=str(cache))
    [], [line] = lm_eval_tasks(cfg)
    assert f"hellaswag: its dataset 'Rowan/hellaswag' is not in the local datasets cache (looked for {cache}/" \
           "Rowan___hellaswag)" in line
    # A cache folder that is there but does not hold it: datasets, offline, says so while lm-eval builds the task.
    (cache / "Rowan___hellaswag").mkdir(parents=True)
    with pytest.raises(ConfigErrors) as raised:
        check_inputs(cfg)
    [line] = raised.value.problems
    assert "hellaswag: its dataset 'Rowan/hellaswag' is not in the local datasets cache" in line


@pytest.mark.parametrize("raw, message", [
    ({"tasks": ["two words"]}, "evaluation.tasks[0]: 'two words' is neither a built-in task"),
    ({"tasks": ["hellaswag"], "limit": 1.5}, "evaluation.limit: 1.5 must be null, a whole number"),
    ({"tasks": ["hellaswag"], "num_fewshot": -1}, "evaluation.num_fewshot"),
])
def test_bad_lm_eval_options_are_one_line_each(raw, message):
    _, report = parse_evaluation({"run": {"results_dir": "/r"}, "checkpoint_dir": "/c", **raw})
    assert len(report.errors) == 1 and message in report.errors[0], report.errors


def test_an_include_path_that_is_no_folder_is_refused(tmp_path):
    [], [line] = lm_eval_tasks(_config(["mine"], include_path=str(tmp_path / "nowhere")))
    assert line.startswith("evaluation.include_path: ") and "is not a directory" in line


def test_a_launch_checks_names_against_the_stored_catalog_and_rebuilds_a_damaged_one(tmp_path, monkeypatch):
    """launcher/cache.py lm_eval_catalog: lm-eval's own index is built once per installation and stored; a launch
    reads it back (the same answers as the TaskManager it came from), and a damaged or stale one is built again.
    lm-eval's own ~15,000 files are stood in for by a folder of two task files (indexing the real ones is ~20 s)."""
    from launcher import cache
    from runtime.evaluate import lm_tasks

    folder = _task_file(tmp_path / "tasks", "alpha", str(tmp_path / "a.jsonl"))
    _task_file(tmp_path / "tasks", "alphabet", str(tmp_path / "b.jsonl"))
    cases = (["alpha"], ["alphabt"], ["alpha", "nope"])
    real, builds = lm_tasks.task_manager, []

    def index(include_path, *, defaults):
        builds.append(defaults)
        return real(folder, defaults=False)

    monkeypatch.setattr(lm_tasks, "task_manager", index)
    expected = [lm_tasks.resolve(names, None)[1:] for names in cases]  # by lm-eval's TaskManager
    builds.clear()
    monkeypatch.setenv(cache.ENV, str(tmp_path / "cache"))
    built = cache.lm_eval_catalog()
    stored = cache.lm_eval_catalog()
    assert builds == [True] and stored.entries == built.entries and sorted(stored.entries) == ["alpha", "alphabet"]
    assert [lm_tasks.resolve(names, None, own=lambda: stored)[1:] for names in cases] == expected
    assert expected[1][0] and "close matches: alpha" in expected[1][0][0]  # the cases do tell names apart
    [path] = (tmp_path / "cache" / "lm_eval").glob("*.json")
    path.write_bytes(path.read_bytes()[:-10])  # truncated: not read, built again
    assert cache.lm_eval_catalog().entries == built.entries and builds == [True, True]
    stamp = lm_tasks.own_tasks_stamp()
    monkeypatch.setattr(lm_tasks, "own_tasks_stamp", lambda: {**stamp, "lm_eval": "another"})  # a new installation
    cache.lm_eval_catalog()
    assert builds == [True, True, True]
