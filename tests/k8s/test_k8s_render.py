"""cluster_type=k8s, rendered for real: each stage's manifest against a golden file and against the vendored CRD
schemas (launcher/schemas/k8s), the config's rules through the real CLI, and a dry run that prints the manifests
without importing the Kubernetes client. Golden files change only on purpose: NXDT_UPDATE_GOLDEN=1 rewrites them."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

from launcher import k8s
from launcher.launch import build

from ..launcher.helpers import REPO, nxdt, refused, resolved

GOLDEN = REPO / "tests" / "golden"
ON_FSX = ["base_results_dir=/fsx/results", "data_dir=/fsx/data", "python=null", "container=123.dkr.ecr/nxdt:1"]
CASES = [
    # (stage, variant, overrides)
    ("training", "trainjob.eks_trn2", ["training=llama3/8b", "cluster=eks_trn2", "cluster.k8s.queue=team-a"]),
    ("data_preparation", "trainjob.eks_trn2", ["training=llama3/8b", "cluster=eks_trn2"]),
    ("training", "pytorchjob.eks_trn1", ["training=llama3/8b", "cluster=eks_trn1", "training.trainer.num_nodes=4",
                                         "training.trainer.devices=32", "cluster.k8s.job_kind=PyTorchJob",
                                         "cluster.k8s.service_account=trainer"]),
    ("training", "hyperpodpytorchjob.hyperpod_eks", ["training=llama3/8b", "cluster=hyperpod_eks",
                                                     "training.trainer.num_nodes=2", "cluster.k8s.queue=team-a"]),
    # HyperPod's auto-resume of a Kubeflow PyTorchJob: annotations and the node-health affinity.
    ("training", "pytorchjob.hyperpod_eks", ["training=llama3/8b", "cluster=hyperpod_eks",
                                             "training.trainer.num_nodes=2", "cluster.k8s.job_kind=PyTorchJob"]),
    ("conversion", "trainjob.eks_trn2", ["training=llama3/8b", "cluster=eks_trn2"]),
    ("evaluation", "trainjob.eks_trn2", ["training=llama3/8b", "cluster=eks_trn2"]),
    ("fine_tuning", "trainjob.eks_trn2", ["fine_tuning=llama3/8b_trn2", "cluster=eks_trn2"]),
    ("peft", "pytorchjob.eks_trn2", ["peft=llama3/8b_trn2", "cluster=eks_trn2", "cluster.k8s.job_kind=PyTorchJob"]),
    ("alignment", "hyperpodpytorchjob.hyperpod_eks", ["alignment=llama3/8b_trn2", "cluster=hyperpod_eks"]),
]


def _manifest(stage: str, overrides: list[str]) -> str:
    return _rendered(stage, tuple(overrides))


@lru_cache(maxsize=None)  # each composition once per session (about a second each)
def _rendered(stage: str, overrides: tuple[str, ...]) -> str:
    cfg = resolved(*ON_FSX, *overrides, "cluster_type=k8s", f"stages=[{stage}]")
    job = next(j for j in build(cfg, dry_run=True) if j.stage == stage)
    return k8s.manifest(job, cfg, produced_by=f"nxdt-launch {' '.join(overrides)}")


@pytest.mark.parametrize("stage,variant,overrides", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_manifest_matches_golden_and_the_schema(stage, variant, overrides):
    text = _manifest(stage, overrides)
    golden = GOLDEN / f"k8s.{stage}.{variant}.yaml"
    if os.environ.get("NXDT_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden.name}: run with NXDT_UPDATE_GOLDEN=1 and review it"
    assert text.splitlines() == golden.read_text().splitlines()
    assert k8s.schema_problems(text, stage) == []


@pytest.mark.parametrize("golden", sorted(GOLDEN.glob("k8s.*.yaml")), ids=lambda p: p.name)
def test_golden_manifests_run_valid_bash_with_the_recipes_layout(golden):
    obj = yaml.safe_load(golden.read_text())
    if obj["kind"] == "TrainJob":
        trainer = obj["spec"]["trainer"]
        command, nodes, per_node = trainer["command"], trainer["numNodes"], trainer["numProcPerNode"]
    else:
        replicas = obj["spec"].get("pytorchReplicaSpecs") or {s["name"]: s for s in obj["spec"]["replicaSpecs"]}
        command = next(iter(replicas.values()))["template"]["spec"]["containers"][0]["command"]
        nodes, per_node = sum(r["replicas"] for r in replicas.values()), int(obj["spec"]["nprocPerNode"])
    assert command[:2] == ["bash", "-c"]
    result = subprocess.run(["bash", "-n", "-c", command[2]], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    if "runtime.torchrun" in command[2]:  # the pods' torchrun starts the layout the object asks Kubernetes for
        assert f"--nnodes {nodes} " in command[2] and f"--nproc_per_node {per_node} " in command[2]


def test_a_neuron_stage_requests_the_instances_devices_and_efa():
    trn2 = yaml.safe_load(_manifest(*CASES[0][::2]))
    assert trn2["spec"]["trainer"]["resourcesPerNode"]["limits"] == {"aws.amazon.com/neuron": 16,
                                                                     "vpc.amazonaws.com/efa": 16}
    trn1 = yaml.safe_load(_manifest("training", ["training=llama3/8b", "cluster=eks_trn1",
                                                 "training.trainer.devices=32",
                                                 "cluster.neuron.efa=false"]))
    assert trn1["spec"]["trainer"]["resourcesPerNode"]["limits"] == {"aws.amazon.com/neuron": 16}
    cpu = yaml.safe_load(_manifest(*CASES[5][::2]))
    assert "resourcesPerNode" not in cpu["spec"]["trainer"]
    # An image that has the runtime's requirements: the pods install nothing.
    assert " -m pip install " in _manifest(*CASES[0][::2])
    assert " -m pip install " not in _manifest("training", [*CASES[0][2], "cluster.k8s.install_requirements=false"])


def test_a_broken_manifest_is_named_by_the_schema():
    obj = yaml.safe_load(_manifest(*CASES[0][::2]))
    obj["spec"]["trainer"]["numNodes"] = "two"
    assert k8s.schema_problems(yaml.safe_dump(obj), "training") == [
        "training (TrainJob).spec.trainer.numNodes: 'two' is not of type 'integer'"]
    hp = yaml.safe_load(_manifest(*CASES[3][::2]))
    del hp["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["name"]
    assert k8s.schema_problems(yaml.safe_dump(hp), "training") == [
        "training (HyperPodPyTorchJob).spec.replicaSpecs.0.template.spec.containers.0: 'name' is a required property"]


LAUNCH = ["stages=[data_preparation,training]", "training=llama3/8b", "cluster_type=k8s", "container=nxdt:1",
          "data_preparation.input.files=[/fsx/data/raw.jsonl]"]


@pytest.mark.parametrize("overrides,expected", [
    # The cluster.k8s rules, all at once: one line each.
    (["cluster=eks_trn2", "cluster.k8s.neuron_devices_per_node=32", "cluster.k8s.efa_per_node=17", "container=null",
      "cluster.k8s.image=null", "cluster.k8s.job_kind=MPIJob", "cluster.k8s.volume.claim=null",
      "cluster.k8s.queue='a b'", "cluster.k8s.install_requirements=maybe"],
     ["cluster.k8s.neuron_devices_per_node: 32 is more than a trn2 node has (16)",
      "cluster.k8s.efa_per_node: 17 is more than a trn2 node has (16)",
      "container: cluster_type=k8s runs every stage in an image",
      "cluster.k8s.job_kind: 'MPIJob' is not one of TrainJob",
      "cluster.k8s.volume: every pod reads and writes", "cluster.k8s.queue: 'a b' is not a label value",
      "cluster.k8s.install_requirements: 'maybe' must be true or false"]),
    # What the pods must see on the shared volume.
    (["cluster=eks_trn1", "training.trainer.devices=32", "base_results_dir=/elsewhere/results",
      "cluster.neuron.compile.cache=/scratch/cache"],
     ["base_results_dir: /elsewhere/results is not on the shared volume (cluster.k8s.volume.mount_path=/fsx)",
      "cluster.neuron.compile.cache: /scratch/cache is not on the shared volume"]),
], ids=["cluster.k8s", "shared volume"])
def test_config_rules_refuse_in_one_line_and_write_nothing(tmp_path, overrides, expected):
    fsx = tmp_path / "fsx"
    moved = [o.replace("/fsx", str(fsx)) for o in ["base_results_dir=/fsx/results", "data_dir=/fsx/data", *LAUNCH,
                                                   "cluster.k8s.volume.mount_path=/fsx",
                                                   "cluster.neuron.compile.cache=/fsx/cache", *overrides]]
    result = nxdt(*moved, "--dry-run", cwd=tmp_path)
    lines = [line.replace(str(fsx), "/fsx") for line in refused(result, "")]
    assert len(lines) == len(expected) and all(any(e in line for line in lines) for e in expected), lines
    assert not list(tmp_path.iterdir()), "a refused launch wrote files"


# The command, as written: the preset's image (AWS's Neuron DLC), results and data on the shared volume.
DONE_WHEN = ["stages=[data_preparation,training]", "training=llama3/8b", "cluster=eks_trn2", "cluster_type=k8s",
             "--dry-run"]


def test_dry_run_prints_valid_manifests_in_stage_order_without_the_client(tmp_path, monkeypatch):
    """From a machine without the shared volume (/fsx is not mounted here): the dry run renders under a directory of
    its own, says so, and prints the manifests with the paths the pods see."""
    assert not os.path.exists("/fsx")
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # any import of the client in the forked CLI fails
    result = nxdt(*DONE_WHEN, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the shared volume (/fsx) is not mounted here" in result.stdout and not os.path.exists("/fsx")
    assert not list(tmp_path.iterdir())
    printed = result.stdout[result.stdout.index("---\n"):result.stdout.index("\nrun llama3")]
    documents = [d for d in yaml.safe_load_all(printed) if d]
    assert [(d["kind"], d["metadata"]["labels"]["nxdt.stage"]) for d in documents] == [
        ("TrainJob", "data_preparation"), ("TrainJob", "training")]
    for document in documents:
        assert k8s.schema_problems(yaml.safe_dump(document), document["metadata"]["labels"]["nxdt.stage"]) == []
    # The recipe's layout (llama3/8b on trn2: one node of 64 workers, TP 8) and the instance's devices and EFA.
    recipe = resolved("training=llama3/8b", "cluster=eks_trn2", "cluster_type=k8s")["training"]
    trainer = documents[1]["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (recipe["trainer"]["num_nodes"],
                                                                recipe["trainer"]["devices"])
    assert trainer["resourcesPerNode"]["limits"] == {"aws.amazon.com/neuron": 16, "vpc.amazonaws.com/efa": 16}
    assert trainer["image"].startswith("public.ecr.aws/neuron/pytorch-training-neuronx:")
    config = yaml.safe_load(Path(documents[1]["metadata"]["annotations"]["nxdt.stage-config"].replace(
        "/fsx", str(_mirror(result.stdout)) + "/fsx", 1)).read_text())
    assert (config["model"]["tensor_model_parallel_size"], config["model"]["pipeline_model_parallel_size"]) == (
        recipe["model"]["tensor_model_parallel_size"], recipe["model"]["pipeline_model_parallel_size"])
    script = trainer["command"][2]
    assert "/fsx/results/llama3_8b_trn2/training/launches/" in script and "'schedulefree>=1.4'" in script
    assert f"--nnodes {trainer['numNodes']} " in script and "--nproc_per_node 64 " in script


def test_a_launch_where_the_shared_volume_is_not_mounted_is_refused(tmp_path):
    result = nxdt(*DONE_WHEN[:-1], cwd=tmp_path)  # the same command, not a dry run
    assert refused(result, "cluster.k8s.volume.mount_path: /fsx is not mounted on this machine")
    assert not list(tmp_path.iterdir()) and not os.path.exists("/fsx")


def _mirror(stdout: str) -> Path:
    return Path(stdout.split("wrote its files under ", 1)[1].split()[0])


def _pod(tmp_path, *overrides, stage="training"):
    """A training pod's script (llama3/8b on eks_trn2, its volume under tmp_path) and a way to run it with bash, FAKE
    `neuron_parallel_compile` and `python3` first on PATH (no Neuron compiler or torch here): each records its
    arguments, and the compile prints its summary line with $FAILED failures."""
    fsx, bin_dir, calls = tmp_path / "fsx", tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "neuron_parallel_compile").write_text(
        f'#!/bin/bash\necho "compile $*" >> {calls}\necho "Total failed compilations: ${{FAILED:-0}}"\n')
    (bin_dir / "python3").write_text(f'#!/bin/bash\necho "python3 $*" >> {calls}\n')
    for fake in bin_dir.iterdir():
        fake.chmod(0o755)
    cfg = resolved(f"base_results_dir={fsx}/results", f"data_dir={fsx}/data", f"cluster.k8s.volume.mount_path={fsx}",
                   "python=null", "training=llama3/8b", "cluster=eks_trn2", "cluster_type=k8s", f"stages=[{stage}]",
                   "cluster.k8s.install_requirements=false", *overrides)
    job = build(cfg, dry_run=True)[0]
    script = yaml.safe_load(k8s.manifest(job, cfg, produced_by="test"))["spec"]["trainer"]["command"][2]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PET_NODE_RANK": "0", "NXDT_K8S_OBJECT": "obj"}

    def start(**extra):
        calls.unlink(missing_ok=True)
        result = subprocess.run(["bash", "-c", script], env={**env, **extra}, capture_output=True, text=True,
                                timeout=60)
        return result, calls.read_text().splitlines() if calls.exists() else []

    return fsx, job, start


def test_the_node_script_compiles_once_then_trains(tmp_path):
    """The compile step runs under the wrapper with the shortened config, its summary line is checked, node 0 writes
    the marker, and the next start skips the step; a failed compile starts no training."""
    fsx, _, start = _pod(tmp_path)

    failed, ran = start(FAILED="2")
    assert failed.returncode == 1 and len(ran) == 1 and ran[0].startswith("compile python3 -m runtime.torchrun")
    assert "training_compile_config.yaml" in ran[0]
    compiled, ran = start()
    assert compiled.returncode == 0, compiled.stderr
    assert [line.split()[0] for line in ran] == ["compile", "python3"] and "training_config.yaml" in ran[1]
    again, ran = start()
    assert again.returncode == 0 and [line.split()[0] for line in ran] == ["python3"]
    assert "compile step skipped" in (fsx / "results" / "llama3_8b_trn2" / "training" / "logs" /
                                      "training_obj_node0.log").read_text()


def test_inputs_on_s3_are_staged_by_node_0_and_the_other_nodes_wait_for_it(tmp_path):
    """data_dir on S3: node 0 pulls the stage's inputs into cluster.staging.local_dir on the volume before anything
    else and marks it; another node waits for the mark and pulls nothing, and gives up at once on node 0's failure
    mark. Training pushes nothing back (its checkpoints go to S3 natively), so its torchrun stays the pod's process
    (exec: the pod's SIGTERM reaches it)."""
    fsx, job, start = _pod(tmp_path, "data_dir=s3://bucket/data", f"cluster.staging.local_dir={tmp_path}/fsx/staging")
    manifest = str(job.results_dir / "training_staging.json")
    marker = job.results_dir / ".staged-obj"
    early, ran = start(PET_NODE_RANK="1", NXDT_K8S_WAIT_S="0")
    assert early.returncode == 1 and ran == [] and "node 0 did not stage the inputs" in early.stdout + early.stderr
    node0, ran = start()
    assert node0.returncode == 0, node0.stderr
    assert [line.split()[:4] for line in ran] == [
        ["python3", "-m", "runtime.io.staging", "pull"], ["compile", "python3", "-m", "runtime.torchrun"],
        ["python3", "-m", "runtime.torchrun", "--nnodes"]]
    assert ran[0].endswith(manifest) and marker.exists()
    node1, ran = start(PET_NODE_RANK="1")
    assert node1.returncode == 0 and all("runtime.io.staging" not in line for line in ran), ran
    marker.unlink()
    (job.results_dir / ".staged-obj.failed").touch()
    failed, ran = start(PET_NODE_RANK="1")
    assert failed.returncode == 1 and ran == []


def test_a_stage_with_outputs_on_s3_pushes_them_after_the_program_succeeded(tmp_path):
    fsx, job, start = _pod(tmp_path, "data_dir=s3://bucket/data", f"cluster.staging.local_dir={tmp_path}/fsx/staging",
                           "data_preparation.input.files=[s3://bucket/data/raw.jsonl]", stage="data_preparation")
    done, ran = start()
    assert done.returncode == 0, done.stderr
    assert [line.split()[3] for line in ran if "runtime.io.staging" in line] == ["pull", "push"]
    assert "runtime.io.staging" in ran[0] and "runtime.io.staging" in ran[-1] and len(ran) >= 3, ran


def test_the_staging_mirror_must_be_on_the_shared_volume(tmp_path):
    fsx = tmp_path / "fsx"
    result = nxdt(*LAUNCH, "cluster=eks_trn2", f"base_results_dir={fsx}/results", "data_dir=s3://bucket/data",
                  f"cluster.k8s.volume.mount_path={fsx}", "cluster.staging.local_dir=/scratch/staging",
                  "data_preparation.input.files=[s3://bucket/data/raw.jsonl]", "--dry-run", cwd=tmp_path)
    assert refused(result, "cluster.staging.local_dir: /scratch/staging is not on the shared volume")


def test_node_0_marks_the_graphs_compiled_only_when_every_node_compiled_them(tmp_path):
    fsx, job, start = _pod(tmp_path, "training.trainer.num_nodes=2")
    marker = next(fsx.rglob("nxdt-compiled"), None)
    node1_mark = job.log_dir / "training_obj_compile_node1.log.ok"  # what node 1's pod marks beside its log
    node1_mark.parent.mkdir(parents=True, exist_ok=True)
    node1_mark.with_name(node1_mark.name + ".failed").touch()
    failed_elsewhere, ran = start(NXDT_K8S_WAIT_S="0")
    assert failed_elsewhere.returncode == 0 and [line.split()[0] for line in ran] == ["compile", "python3"]
    assert marker is None and not list(fsx.rglob("nxdt-compiled/*"))  # node 1's failure: no marker
    node1_mark.with_name(node1_mark.name + ".failed").unlink()
    node1_mark.touch()
    compiled, ran = start(NXDT_K8S_WAIT_S="0")
    assert compiled.returncode == 0 and len(list(fsx.rglob("nxdt-compiled/*"))) == 1


def test_data_preparation_spreads_its_tasks_over_pods_and_node_0_pushes_after_all(tmp_path):
    """Three array tasks, two at once (run.node_array_size=2): the object has two pods, pod 0 runs tasks 0 and 2,
    pod 1 task 1; node 0 copies the outputs back to S3 only once pod 1 has marked its tasks done."""
    files = "[" + ",".join(f"s3://bucket/raw/{i}.jsonl" for i in range(3)) + "]"
    fsx, job, start = _pod(tmp_path, "data_dir=s3://bucket/data", f"cluster.staging.local_dir={tmp_path}/fsx/staging",
                           f"data_preparation.input.files={files}", "data_preparation.run.node_array_size=2",
                           stage="data_preparation")
    assert (job.array_size, k8s.pods(job)) == (3, 2)
    early, ran = start(NXDT_K8S_WAIT_S="0")  # pod 1 has not finished: no push
    assert early.returncode == 1 and not any("push" in line for line in ran)
    assert [line.split("--task-index ")[1].split()[0] for line in ran if "--task-index" in line] == ["0", "2"]
    node1, ran = start(PET_NODE_RANK="1")
    assert node1.returncode == 0 and [line.split("--task-index ")[1].split()[0] for line in ran] == ["1"]
    node0, ran = start()
    assert node0.returncode == 0 and "runtime.io.staging push" in ran[-1], ran
