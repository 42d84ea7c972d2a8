"""Every template is checked against a stored golden file. The golden files change only on purpose:
NXDT_UPDATE_GOLDEN=1 python -m pytest tests/launcher/test_render.py rewrites them; review the diff."""

import os
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from launcher import render as render_module
from launcher.launch import build
from launcher.render import render
from launcher.stages import BUILDERS

from .helpers import REPO, resolved

GOLDEN = REPO / "tests" / "golden"
CASES = [
    # (stage, executor, overrides)
    ("data_preparation", "local", []),
    ("data_preparation", "slurm", []),
    ("training", "local", []),
    ("training", "slurm", ["training.trainer.num_nodes=2", "cluster.partition=compute",
                           "cluster.exclude=[node7,node9]", "cluster.setup=['source /fsx/venv/bin/activate']",
                           "env_vars.NCCL_DEBUG=INFO"]),
    ("training", "slurm_container", ["container=nvcr.io/nvidia/pytorch:24.01-py3",
                                     "container_mounts=[/fsx:/fsx]", "cluster.exclusive=false"]),
    # Pyxis with the image's own python3: code, results and the data's staging mirror mounted automatically,
    # then container_mounts; staging runs in the container too.
    ("training", "slurm_container_mounts", ["python=null", "container=nvcr.io/nvidia/pytorch:24.01-py3",
                                            "container_mounts=[/fsx/enroot/cache:/cache:ro,/scratch:/scratch]",
                                            "data_dir=s3://bucket/datasets", "cluster.staging.local_dir=/fsx/staging"]),
    # Trainium in a container: the compile cache directory is mounted, the cluster's venv is not activated.
    ("training", "pcluster_trn1_container", ["python=null", "cluster=pcluster_trn1", "training.trainer.num_nodes=2",
                                             "training.trainer.devices=32", "training.trainer.accelerator=neuron",
                                             "container=/fsx/images/neuron-training.sqsh"]),
    # No `python`: the job runs the cluster's venv (cluster.venv), not the interpreter that launched it.
    ("training", "pcluster_trn1_venv", ["python=null", "cluster=pcluster_trn1", "training.trainer.num_nodes=2",
                                        "training.trainer.devices=32", "training.trainer.accelerator=neuron"]),
    # The compile cache on S3: the compile step's marker is kept on the shared file system.
    ("training", "pcluster_trn1_s3cache", ["cluster=pcluster_trn1", "training.trainer.num_nodes=2",
                                           "training.trainer.devices=32", "training.trainer.accelerator=neuron",
                                           "cluster.neuron.compile.cache=s3://bucket/neuron-cache"]),
    ("training", "pcluster_trn1", ["cluster=pcluster_trn1", "training.trainer.num_nodes=4",
                                   "training.trainer.devices=32", "training.trainer.accelerator=neuron"]),
    *[("training", f"{cluster}_{precision}", [f"cluster={cluster}", "training.trainer.num_nodes=2",
                                             f"training.trainer.devices={workers}", "training.trainer.accelerator=neuron",
                                             f"training.precision.type={precision}"])
      for cluster, workers in (("pcluster_trn1", 32), ("pcluster_trn2", 64))
      for precision in ("fp32", "bf16SR", "mixed_precision", "mixed_precisionSR", "autocast")],
    # The headline command: one recipe, the cluster's layout (launcher/targets.py, docs/recipes.md).
    *[("training", f"gpt3_175b.{cluster}", ["training=gpt3/175b", f"cluster={cluster}"])
      for cluster in ("pcluster_trn1", "pcluster_trn2", "slurm")],
    # trn1n, without the compile step and with the compile cache on S3.
    ("training", "pcluster_trn1n_nocompile", ["cluster=pcluster_trn1n", "training.trainer.devices=32",
                                              "training.trainer.accelerator=neuron", "training.precision.type=bf16SR",
                                              "cluster.neuron.compile.enabled=false",
                                              "cluster.neuron.compile.cache=s3://bucket/neuron-cache"]),
    # data on S3: staged to the shared file system inside the job.
    ("training", "slurm_s3", ["data_dir=s3://bucket/datasets", "cluster.staging.local_dir=/fsx/staging",
                              "cluster.s3.endpoint_url=http://minio.internal:9000", "cluster.s3.retries=4"]),
    ("training", "local_s3", ["data_dir=s3://bucket/datasets", "cluster.staging.local_dir=/fsx/staging"]),
    ("data_preparation", "slurm_s3", ["data_dir=s3://bucket/datasets", "cluster.staging.local_dir=/fsx/staging",
                                      "data_preparation=custom_dataset",
                                      "data_preparation.input.files=['s3://bucket/raw/{:02d}.jsonl']",
                                      "data_preparation.input.file_numbers='0-2'"]),
    # preemption: requeue on USR1 without asking Slurm for the signal; and no signal handling at all.
    ("training", "slurm_requeue_only", ["training.run.preemption_signal_s=0", "training.run.max_restarts=5"]),
    ("training", "slurm_no_preemption", ["training.run.preemption_signal_s=null", "training.run.max_restarts=0"]),
    # Recovery in place (issue 62): the peer stores, a spare node, and one node fewer when none is left.
    ("training", "slurm_peer_spare_elastic", ["training.trainer.num_nodes=2", "training.run.elastic=true",
                                              "training.fault_tolerance.peer_state_every_n_steps=1",
                                              "training.fault_tolerance.spare_nodes=1"]),
    # Fine-tuning runs the trainer like training (torchrun, preemption, requeue), naming its stage with --stage.
    ("fine_tuning", "local", []),
    ("peft", "slurm", ["peft.trainer.num_nodes=2", "cluster.partition=compute"]),
    # Alignment (DPO, ORPO) is the trainer's job again, with --stage alignment.
    ("alignment", "local", []),
    ("alignment", "slurm", ["alignment.trainer.num_nodes=2", "cluster.partition=compute"]),
    # The reward model (NeMo-Launcher's rlhf_rm) too, with --stage rlhf_rm.
    ("rlhf_rm", "local", []),
    ("rlhf_rm", "slurm", ["rlhf_rm.trainer.num_nodes=2", "cluster.partition=compute"]),
    # GRPO (the rl stage) too, with --stage rl.
    ("rl", "local", []),
    ("rl", "slurm", ["rl.trainer.num_nodes=2", "cluster.partition=compute"]),
    ("conversion", "local", []),
    ("conversion", "slurm", []),
    ("evaluation", "local", []),
    ("evaluation", "slurm", []),
]


@pytest.fixture(autouse=True)
def _stable_code_root(monkeypatch):
    # Where this checkout lies differs between machines; a container mounts it, so the golden files name one.
    monkeypatch.setattr(render_module, "code_root", lambda: PurePosixPath("/opt/nxdt-launch"))


@pytest.mark.parametrize("stage,variant,overrides", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_script_matches_golden(stage, variant, overrides):
    cfg = resolved(*overrides)
    job = next(j for j in build({**cfg, "stages": [stage]}) if j.stage == stage)
    executor = "local" if variant.startswith("local") else "slurm"
    text = render(job, cfg, executor=executor, produced_by=f"nxdt-launch {' '.join(overrides)}".rstrip())
    golden = GOLDEN / f"{stage}.{variant}.sh"
    if os.environ.get("NXDT_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden.name}: run with NXDT_UPDATE_GOLDEN=1 and review it"
    assert text.splitlines() == golden.read_text().splitlines()


@pytest.mark.parametrize("golden", sorted(GOLDEN.glob("*.sh")), ids=lambda p: p.name)
def test_golden_scripts_are_valid_bash(golden):
    result = subprocess.run(["bash", "-n", str(golden)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_template_has_a_golden_file():
    # templates/pcluster/ (the cluster config's node script) has its golden files in tests/pcluster.
    rendered = {"local" if v.startswith("local") else "slurm" for _, v, _ in CASES}
    templates = {p.name.split(".")[0] for p in (REPO / "templates").glob("*.j2") if not p.name.startswith("_")}
    assert templates == {"sbatch", "local"} and rendered == {"local", "slurm"}
    assert {c[0] for c in CASES} == set(BUILDERS)


def test_a_container_gets_the_code_results_and_data_mounted_then_container_mounts():
    from launcher.render import container

    cfg = resolved("python=null", "container=img.sqsh", "container_mounts=[/scratch:/scratch,/results/x:/x]",
                   "training.run.results_dir=/elsewhere/training")
    job = next(j for j in build({**cfg, "stages": ["training"]}) if j.stage == "training")
    inside = container(job, cfg)
    assert inside.mounts == ["/opt/nxdt-launch/runtime:/opt/nxdt-launch/runtime:ro",
                             "/opt/nxdt-launch/csp_tools:/opt/nxdt-launch/csp_tools:ro",
                             "/results:/results", "/elsewhere/training:/elsewhere/training", "/data:/data",
                             "/scratch:/scratch", "/results/x:/x"]
    assert inside.workdir == "/elsewhere/training" and inside.make_dirs == ["/results", "/elsewhere/training", "/data"]
    assert container(job, resolved()) is None
