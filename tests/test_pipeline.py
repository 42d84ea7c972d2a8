"""The whole product, end to end, with the real programs: the embedded default pipeline on this machine
(what the README's first command runs), and the same pipeline on two nodes of the real 3-node Slurm cluster:
mixtral/tiny at tp=2 x dp=2 with its experts over an expert-parallel group spanning both nodes, then the data
preparation and training of gpt3/tiny at pp=2 and llama/tiny at cp=2 across the two nodes."""

import json
import math
from pathlib import Path

import pytest

from tests.launcher.helpers import nxdt


def _metrics(results: Path, run: str = "gpt3_tiny") -> list[dict]:
    path = results / run / "training" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _check_training_outputs(results: Path, steps: int, run: str = "gpt3_tiny") -> list[dict]:
    rows = [r for r in _metrics(results, run) if "loss" in r]
    assert rows and rows[-1]["step"] == steps
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"):
        assert key in rows[-1], key
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert list((results / run / "training" / "tensorboard").rglob("events.out.tfevents.*"))
    return rows


STAGES = ["data_preparation", "training", "conversion", "evaluation"]


def _demo_accuracy(results: Path) -> float:
    tasks = json.loads((results / "gpt3_tiny" / "evaluation" / "results.json").read_text())["tasks"]
    return next(t for t in tasks if t["task"] == "demo_code_lines")["acc"]


def _evaluate_here(config: Path) -> int:
    """`python -m runtime.evaluate --config CONFIG` in this process, on one thread as torchrun starts each worker
    (OMP_NUM_THREADS=1): a tiny model gains nothing from more, and spinning threads slow a shared machine."""
    import torch

    from runtime.evaluate.__main__ import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(["--config", str(config)])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.long("the README's first command end to end (data, tokenizer, training, export, evaluation), then its rerun and resume")
def test_default_pipeline_runs_locally(tmp_path):
    steps = 40
    # A checkpoint every 5 steps, all kept; the synthetic task on the first 50 of its 200 examples (a prefix: the
    # task file is built in one seeded order), 32 requests a forward pass: what the step-5 checkpoint is scored on
    # below.
    short = ["training.exp_manager.checkpoint_callback_params.every_n_train_steps=5",
             "training.exp_manager.checkpoint_callback_params.save_top_k=-1", "evaluation.tasks.2.num_examples=50",
             "evaluation.micro_batch_size=32"]
    result = nxdt("cluster_type=local", f"training.trainer.max_steps={steps}", *short, cwd=tmp_path,
                  timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = tmp_path / "results"
    record = json.loads((results / "gpt3_tiny" / "launch.json").read_text())
    assert [(s["stage"], s["exit_code"]) for s in record["stages"]] == [(s, 0) for s in STAGES]
    # It ends with the evaluation table, and a Hugging Face export beside it.
    assert "demo_code_lines" in result.stdout and "validation_loss" in result.stdout
    assert (results / "gpt3_tiny" / "conversion" / "hf_model" / "model.safetensors").exists()
    assert (tmp_path / "data" / "demo" / "blend.txt").exists()
    assert (tmp_path / "data" / "demo" / "tokenizer.json").exists()
    rows = _check_training_outputs(results, steps)
    vocab = json.loads((tmp_path / "data" / "demo" / "tokenizer.json").read_text())["model"]["vocab"]
    assert rows[0]["loss"] > math.log(len(vocab)) - 0.5, "training should start near ln(vocab)"
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0, "the tiny model should learn in 40 steps"

    status = nxdt("status", "gpt3_tiny", cwd=tmp_path)
    assert status.returncode == 0 and status.stdout.count("COMPLETED") == 4, status.stdout
    logs = nxdt("logs", "gpt3_tiny", "training", cwd=tmp_path)
    assert "step 40/40" in logs.stdout
    picture = results / "gpt3_tiny" / "training" / "metrics.png"  # drawn when training ended
    assert picture.read_bytes()[:4] == b"\x89PNG"
    picture.unlink()
    drawn = nxdt("plot", "gpt3_tiny", cwd=tmp_path)
    assert drawn.returncode == 0 and drawn.stdout.strip() == f"plot: {picture}", drawn.stdout + drawn.stderr
    assert picture.read_bytes()[:4] == b"\x89PNG"
    trained = _demo_accuracy(results)

    # The same command again (the README says training resumes): every stage finds its work done and says so,
    # nothing fails because an output exists, and no step is trained or logged twice.
    again = nxdt("cluster_type=local", f"training.trainer.max_steps={steps}", *short, cwd=tmp_path, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "nothing to train" in again.stdout, again.stdout[-3000:]
    assert "conversion:" in again.stdout and "nothing to do" in again.stdout
    assert "already scores" in again.stdout and "demo_code_lines" in again.stdout  # the table, shown again
    assert [r["step"] for r in _metrics(results) if "loss" in r] == [r["step"] for r in rows]
    assert _demo_accuracy(results) == trained

    # The synthetic task moves with training: the step-5 checkpoint of the same run scores clearly lower on the same
    # 50 examples. Only that task is scored here (the loss tasks say nothing about it).
    # The launcher renders this evaluation's config as for any launch; the stage's job script, torchrun and a
    # worker interpreter were all started above, so the evaluation itself runs in this process.
    early = sorted((results / "gpt3_tiny" / "training" / "checkpoints").glob("step_00000005.*"))[0].name
    corpus = tmp_path / "data" / "demo" / "raw"
    demo_task = f"{{name:demo_code_lines,type:synthetic_demo,corpus:'{corpus}',num_examples:50}}"
    rendered = nxdt("cluster_type=local", "stages=[evaluation]", f"evaluation.checkpoint_name={early}",
                    f"evaluation.tasks=[{demo_task}]", "evaluation.micro_batch_size=32", "--dry-run", cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stdout[-3000:] + rendered.stderr[-3000:]
    assert _evaluate_here(results / "gpt3_tiny" / "evaluation" / "evaluation_config.yaml") == 0
    assert trained > _demo_accuracy(results) + 0.1, (trained, _demo_accuracy(results))


LAYOUTS = {
    # 2 nodes x 2 processes: tensor parallel inside each node, data parallel across the two, and Mixtral's experts
    # shared out over an expert-parallel group of the two DP ranks (one per node): tokens cross nodes by all-to-all.
    "tp2_dp2_ep2": ["training=mixtral/tiny", "training.trainer.devices=2", "training.model.tensor_model_parallel_size=2",
                    "training.model.expert_model_parallel_size=2"],
    # 2 nodes x 1 process: one pipeline stage per node, activations crossing between the nodes.
    "pp2": ["training.trainer.devices=1", "training.model.pipeline_model_parallel_size=2"],
    # 2 nodes x 1 process: each sequence split over the two nodes (context parallelism), K/V blocks going round a
    # ring that crosses between them.
    "cp2": ["training=llama/tiny", "training.trainer.devices=1", "training.model.context_parallel_size=2"],
}
RUNS = {"tp2_dp2_ep2": "mixtral_tiny", "pp2": "gpt3_tiny", "cp2": "llama_tiny"}
# The whole pipeline once (its export and evaluation of a 2-node checkpoint); the other layouts prepare their data
# and train across the nodes. Exporting and evaluating pipeline and context-parallel checkpoints are
# tests/checkpoint/test_conversion.py's and tests/evaluate/'s, under every layout.
STAGES_OF = {"tp2_dp2_ep2": STAGES, "pp2": STAGES[:2], "cp2": STAGES[:2]}


WHOLE = pytest.mark.long("the whole pipeline, four Slurm jobs one after another (data preparation, 2-node training, "
                         "export, evaluation), each starting its processes on the shared cores")


@pytest.mark.slurm
@pytest.mark.parametrize("layout", [pytest.param(name, marks=WHOLE) if STAGES_OF[name] == STAGES else name
                                    for name in sorted(LAYOUTS)])
def test_pipeline_on_two_slurm_nodes(slurm_cluster, tmp_path, layout):
    # Short stages, so that the pipeline is mostly its programs starting (about 30 s on two idle cores): 4 steps
    # logged at 1, 2 and 4, validated (one batch) at 2 and 4; the evaluation scores every kind of task it has by
    # default, each on a little data (one batch per loss task, 16 demo examples). The three layouts run one after
    # the other: their data-preparation arrays must each find two nodes free to be seen spreading over them (with
    # nodes shared, or pipelines interleaved on exclusive ones, Slurm may put both tasks on one node).
    steps = 4
    results = tmp_path / "results"
    slurm_cluster.wait_idle()  # an earlier test's job still on a node would leave the array one node to run on
    result = nxdt(
        "cluster_type=slurm", f"cluster.partition={slurm_cluster.partition}", f"base_results_dir={results}",
        f"data_dir={tmp_path}/data", "training.trainer.num_nodes=2", *LAYOUTS[layout],
        f"stages=[{','.join(STAGES_OF[layout])}]",
        f"training.trainer.max_steps={steps}", "training.trainer.log_every_n_steps=2",
        "training.trainer.val_check_interval=2", "training.trainer.limit_val_batches=1",
        "training.model.optim.sched.warmup_steps=1", "evaluation.limit_batches=1",
        "evaluation.tasks.2.num_examples=16", cwd=tmp_path, env=slurm_cluster.env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    run = RUNS[layout]
    record = json.loads((results / run / "launch.json").read_text())
    # Where the data-preparation tasks ran is read as soon as they finish: slurmctld forgets a finished job after
    # MinJobAge (5 minutes), which a busy cluster's queue can outlast before the whole pipeline is done.
    states = [slurm_cluster.wait_job(str(record["stages"][0]["job_id"]), 600)]
    prep_nodes = {info.get("NodeList") for info in slurm_cluster.job_info(str(record["stages"][0]["job_id"]))}
    states += [slurm_cluster.wait_job(str(s["job_id"]), 600) for s in record["stages"][1:]]
    logs = nxdt("logs", run, "--results-dir", str(results), env=slurm_cluster.env).stdout
    assert states == ["COMPLETED"] * len(STAGES_OF[layout]), logs[-4000:]

    # The data-preparation array ran its two tasks on two nodes (any two of the cluster's three), then training
    # spanned two nodes.
    prep_logs = sorted((results / run / "data_preparation" / "logs").glob("*_node0.log"))
    assert len(prep_logs) == 2
    assert len(prep_nodes) == 2 and prep_nodes <= set(slurm_cluster.nodes), prep_nodes
    train_logs = sorted((results / run / "training" / "logs").glob("*_node*.log"))
    assert len(train_logs) == 2, train_logs
    topology = {"tp2_dp2_ep2": "tp=0/2, dp=0/2, pp=0/1, ep=0/2", "pp2": "tp=0/1, dp=0/1, pp=0/2",
                "cp2": "tp=0/1, dp=0/2, pp=0/1, cp=0/2"}[layout]
    assert topology in logs, logs[-3000:]
    rows = _check_training_outputs(results, steps, run)
    if layout == "tp2_dp2_ep2":
        assert all(r["moe_tokens_dropped"] == 0.0 and r["moe_aux_loss"] > 0 for r in rows)
        exported = json.loads((results / run / "conversion" / "hf_model" / "config.json").read_text())
        assert exported["architectures"] == ["MixtralForCausalLM"]
