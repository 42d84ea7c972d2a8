# The evaluation stage through the launcher: a checkpoint trained at tp=2 x pp=2 evaluates to the same loss and
# the same zero-shot scores at tp=1 x pp=1 and under the interleaved forward-only schedule (pp=2 x vpp=2); its
# lm-eval tasks (a local type, and a task of the user's own include_path by name) take lm-eval's options.
import json

import pytest

from tests.checkpoint.launch_helpers import counting_corpus, train_rendered, training_overrides
from tests.launcher.helpers import nxdt
from tests.runtime_parallel.dist_utils import run_distributed

EVAL_LAYOUTS = {
    "tp2_pp2": ["evaluation.trainer.devices=4", "evaluation.model.tensor_model_parallel_size=2",
                "evaluation.model.pipeline_model_parallel_size=2"],
    "tp1_pp1": ["evaluation.trainer.devices=1"],
    "pp2_vpp2": ["evaluation.trainer.devices=2", "evaluation.model.pipeline_model_parallel_size=2",
                 "evaluation.model.virtual_pipeline_model_parallel_size=2"],
}


def _evaluate(config: str) -> int:
    """`python -m runtime.evaluate --config CONFIG` in one rank (run_distributed has joined it to the world)."""
    from runtime.evaluate.__main__ import main

    return main(["--config", config])


def _named_task(directory, data):
    """A task of the user's own, by name from evaluation.include_path (lm-eval's --include_path)."""
    directory.mkdir()
    (directory / "next_word.yaml").write_text(f"""
task: next_word
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}}]
""")
    return directory


def _choice_file(path):
    """Counting sequences: the gold continuation keeps counting, the others break the pattern."""
    lines = []
    for start in range(8):
        context = " ".join(f"w{(start + i) % 64}" for i in range(12))
        good = f"w{(start + 12) % 64}"
        lines.append(json.dumps({"context": context, "choices": [f"w{(start + 40) % 64}", good, "w0"], "gold": 1}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.long("trains a tp2 x pp2 checkpoint, then evaluates it under several layouts")
def test_tp2_pp2_checkpoint_evaluates_the_same_under_any_layout(tmp_path, capfd):
    data = counting_corpus(tmp_path / "data")
    tasks = _choice_file(tmp_path / "choices.jsonl")
    include = _named_task(tmp_path / "my_tasks", tasks)
    train = training_overrides(data, tmp_path / "results", steps=6, every=0,
                               extra=("training.trainer.devices=4", "training.model.tensor_model_parallel_size=2",
                                      "training.model.pipeline_model_parallel_size=2", "training.model.num_layers=4"))
    # The training and each layout's evaluation are rendered by the launcher (--dry-run), then run in ranks forked
    # from this process: the launch path of a stage is tested elsewhere (tests/test_pipeline.py), what is under test
    # here is the evaluation under each layout, and torchruns with fresh interpreters would import torch 12 times.
    result = nxdt("cluster_type=local", *train, "--dry-run", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert train_rendered(tmp_path / "results" / "gpt3_tiny" / "training" / "training_config.yaml") == [0] * 4

    # What every evaluation rank imports (the stage, lm-eval and its task index), imported once here: the 7 ranks
    # forked below inherit it instead of importing it each (~3 s of CPU a rank).
    import lm_eval.evaluator  # noqa: F401
    import lm_eval.tasks  # noqa: F401

    import runtime.evaluate.__main__  # noqa: F401
    import runtime.evaluate.harness  # noqa: F401

    scores = {}
    for name, layout in EVAL_LAYOUTS.items():
        evaluate = [o.replace("stages=[training]", "stages=[evaluation]") for o in train] + layout + [
            f"evaluation.run.results_dir={tmp_path / name}", "evaluation.limit_batches=2",
            f"evaluation.tasks=[validation_loss,{{name: count, type: multiple_choice, path: {tasks}}},next_word]",
            f"evaluation.include_path={include}", "evaluation.num_fewshot=1", "evaluation.limit=6"]
        rendered = nxdt("cluster_type=local", *evaluate, "--dry-run", cwd=tmp_path)
        assert rendered.returncode == 0, rendered.stdout[-3000:] + rendered.stderr[-3000:]
        devices = next(int(o.rpartition("=")[2]) for o in layout if o.startswith("evaluation.trainer.devices="))
        capfd.readouterr()
        assert run_distributed(_evaluate, devices, args=(str(tmp_path / name / "evaluation_config.yaml"),)) == \
            [0] * devices
        assert "trained at tp 2 pp 2" in capfd.readouterr().out
        scores[name] = json.loads((tmp_path / name / "results.json").read_text())["tasks"]
        harness = json.loads((tmp_path / name / "lm_eval_results.json").read_text())  # lm-eval's own results
        assert harness["n-samples"]["next_word"]["effective"] == 6 and harness["configs"]["next_word"][
            "num_fewshot"] == 1, harness["config"]

    reference = scores.pop("tp1_pp1")
    for name, tasks_out in scores.items():
        assert tasks_out[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-5), name
        assert [t["task"] for t in tasks_out] == ["validation_loss", "count", "next_word"]
        assert tasks_out[1]["acc"] == reference[1]["acc"] and tasks_out[1]["acc_norm"] == reference[1]["acc_norm"]
        assert tasks_out[2]["acc"] == reference[2]["acc"] and tasks_out[2]["num_examples"] == 6
