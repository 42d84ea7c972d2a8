"""Trainium job scripts: the environment NxD Training derives from training.precision.type, the worker counts,
and the compile step. The scripts run here under bash with FAKE srun, scontrol and neuron_parallel_compile
(the real ones need Trainium nodes): they do only what the real ones do to the command line and the logs,
so these tests check the order of the steps, that compile and training get the very same flags, and that
training never starts after a failed compile. Golden files: tests/launcher/test_render.py."""

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from launcher import neuron
from launcher.config import parse
from launcher.launch import build
from tests.launcher.helpers import nxdt, resolved

NXDT_TRAINING_TABLE = {  # NxD Training's process_config, by precision.type
    "fp32": ("0", "0", None, "--auto-cast none"),
    "bf16SR": ("1", "0", "1", "--enable-mixed-precision-accumulation"),
    "mixed_precision": ("0", "1", "0", "--enable-mixed-precision-accumulation"),
    "mixed_precisionSR": ("0", "1", "1", "--enable-mixed-precision-accumulation"),
    "autocast": ("0", "0", "0", "--enable-mixed-precision-accumulation --auto-cast none"),
}


def _job(*overrides, cluster="pcluster_trn1", devices=32):
    cfg = resolved(f"cluster={cluster}", "training.trainer.accelerator=neuron", f"training.trainer.devices={devices}",
                   "stages=[training]", *overrides)
    return cfg, build(cfg)[0]


@pytest.mark.parametrize("precision", sorted(NXDT_TRAINING_TABLE))
@pytest.mark.parametrize("cluster,devices,hardware", [("pcluster_trn1", 32, "trn1"), ("pcluster_trn1n", 32, "trn1"),
                                                      ("pcluster_trn2", 64, "trn2")])
def test_precision_sets_the_environment_as_nxd_training_does(precision, cluster, devices, hardware):
    cfg, job = _job(f"training.precision.type={precision}", cluster=cluster, devices=devices)
    env = neuron.script(job, parse(cfg)).env
    use_bf16, downcast, rounding, flags = NXDT_TRAINING_TABLE[precision]
    assert env["XLA_USE_BF16"] == use_bf16 and env["XLA_DOWNCAST_BF16"] == downcast
    assert env.get("NEURON_RT_STOCHASTIC_ROUNDING_EN") == rounding
    assert env["NEURON_CC_FLAGS"].endswith(" " + flags)
    assert f"--target={hardware}" in env["NEURON_CC_FLAGS"]
    assert env["MALLOC_ARENA_MAX"] == "64"
    assert neuron.fabric(job, parse(cfg)).env == {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}
    if hardware == "trn2":
        assert env["NEURON_LOGICAL_NC_CONFIG"] == "2" and "--logical-nc-config=2" in env["NEURON_CC_FLAGS"]
    else:
        assert "NEURON_LOGICAL_NC_CONFIG" not in env
    assert job.nproc_per_node == devices == neuron.HARDWARE[hardware].workers_per_node


def test_trn2_at_lnc_1_runs_a_worker_per_physical_core():
    """cluster.neuron.lnc=1 (NxD Training's trainer.lnc): 128 workers per trn2.48xlarge, compiled and run for one
    physical NeuronCore each, with the peak and memory of one (the estimator's trn2-lnc1)."""
    from launcher.estimator.hardware import HARDWARE, detect

    cfg, job = _job("cluster.neuron.lnc=1", cluster="pcluster_trn2", devices=128)
    env = neuron.script(job, parse(cfg)).env
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "1" and "--logical-nc-config=1" in env["NEURON_CC_FLAGS"]
    assert env["NXDT_NEURON_HARDWARE"] == "trn2-lnc1" and job.nproc_per_node == 128
    assert detect("neuron", 128) == "trn2-lnc1"
    assert HARDWARE["trn2-lnc1"].memory_bytes * 2 == HARDWARE["trn2"].memory_bytes
    assert HARDWARE["trn2-lnc1"].peak_tflops * 2 == HARDWARE["trn2"].peak_tflops


def test_cpu_stages_on_a_trainium_cluster_get_no_neuron_settings():
    cfg = resolved("cluster=pcluster_trn1", "stages=[training]")
    assert neuron.script(build(cfg)[0], parse(cfg)) is None


@pytest.mark.parametrize("overrides,expected", [
    (["cluster=pcluster_trn2", "training.trainer.devices=32"],
     "training.trainer.devices: 32 workers per node, but trn2 (LNC=2) nodes have 64 NeuronCores, one worker each; "
     "set training.trainer.devices=64"),
    (["cluster=pcluster_trn1", "training.trainer.devices=32", "cluster.neuron.hardware=trn3"],
     "cluster.neuron.hardware: 'trn3' is not one of trn1, trn2"),
    (["cluster=pcluster_trn1", "training.trainer.devices=32", "cluster.neuron.compile.steps=0"],
     "cluster.neuron.compile.steps: 0 must be a positive integer"),
    (["cluster=pcluster_trn2", "training.trainer.devices=64", "cluster.neuron.lnc=1"],
     "training.trainer.devices: 64 workers per node, but trn2 (LNC=1) nodes have 128 NeuronCores, one worker each; "
     "set training.trainer.devices=128"),
    (["cluster=pcluster_trn2", "training.trainer.devices=64", "cluster.neuron.lnc=4"],
     "cluster.neuron.lnc: 4 must be 1 or 2"),
    (["cluster=pcluster_trn1", "training.trainer.devices=32", "cluster.neuron.lnc=2"],
     "cluster.neuron.lnc: 2, but trn1 has no logical NeuronCore config"),
])
def test_neuron_mistakes_are_one_line_each(tmp_path, overrides, expected):
    result = nxdt(f"base_results_dir={tmp_path}/results", "stages=[training]", "training.trainer.accelerator=neuron",
                  "training.model.global_batch_size=256", "--dry-run", *overrides, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), result.stderr


FAKE_SRUN = """#!/bin/bash
# FAKE srun: runs the command once per node, here, one after the other, with srun's --output pattern.
nodes=1; output=/dev/stdout
while [[ "$1" == -* ]]; do
  case "$1" in --nodes=*) nodes="${1#--nodes=}" ;; --output=*) output="${1#--output=}" ;; esac
  shift
done
for ((n = 0; n < nodes; n++)); do SLURM_NODEID=$n "$@" > "${output//%n/$n}" 2>&1 || exit $?; done
"""
FAKE_SCONTROL = """#!/bin/bash
# FAKE scontrol: two nodes, the first at 127.0.0.1.
case "$1 $2" in
  "show hostnames") printf 'trn-1\\ntrn-2\\n' ;;
  "show node") echo "NodeName=trn-1 NodeAddr=127.0.0.1 NodeHostName=trn-1" ;;
esac
"""
FAKE_COMPILE = """#!/bin/bash
# FAKE neuron_parallel_compile: records what it was asked to compile, runs the command, prints its summary.
echo "compile $SLURM_NODEID" >> "$RECORD_DIR/order"
"$@"
echo "2025-01-01 00:00:00.000000:  1  INFO ||NEURON_PARALLEL_COMPILE||: Total failed compilations: ${FAILED:-0}"
"""
STAND_IN = """#!/bin/bash
# Stand-in interpreter: records the arguments, where the cache is and the compiler flags, per node.
echo "run $SLURM_NODEID ${NXDT_COMPILE:-0}" >> "$RECORD_DIR/order"
{ printf '%s\\n' "$@"; echo "CACHE=$NEURON_COMPILE_CACHE_URL"; echo "FLAGS=$NEURON_CC_FLAGS";
  echo "MASTER=$MASTER_ADDR:$MASTER_PORT"; } > "$RECORD_DIR/argv.${NXDT_COMPILE:-0}.$SLURM_NODEID"
"""


def _tool(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def sandbox(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir / "srun", FAKE_SRUN)
    _tool(bin_dir / "scontrol", FAKE_SCONTROL)
    _tool(bin_dir / "neuron_parallel_compile", FAKE_COMPILE)
    python = tmp_path / "py $(touch CANARY)" / "python"
    python.parent.mkdir()
    _tool(python, STAND_IN)
    return tmp_path, bin_dir, python


def _run_script(sandbox, *overrides, env=None):
    tmp_path, bin_dir, python = sandbox
    # The compile cache (and its marker) in the sandbox, not on the cluster's /fsx.
    cache = [] if any("compile.cache=" in o for o in overrides) else [f"cluster.neuron.compile.cache={tmp_path}/cache"]
    cfg, job = _job(f"base_results_dir={tmp_path}/results", f"python='{python}'", "training.trainer.num_nodes=2",
                    *cache, *overrides)
    cfg = {**cfg, "cluster": {**cfg["cluster"], "setup": [], "venv": None}}  # no venv to activate here
    from launcher.launch import Plan, write

    plan = Plan(cfg, "slurm", "test", [job], [], "test", False)
    (script,) = write(plan)
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD_DIR": str(tmp_path),
                                 "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "trn-[1-2]", **(env or {})})
    assert not list(tmp_path.rglob("CANARY")), "a configured value was executed"
    return result, job, tmp_path


def test_compile_runs_first_with_the_same_flags_then_training(sandbox):
    hostile = "--model-type=transformer $(touch CANARY) 'quoted'"
    cache = sandbox[0] / "c a c h e"
    result, job, tmp = _run_script(sandbox, "training.precision.type=bf16SR", f"cluster.neuron.compiler_flags=\"{hostile}\"",
                                   "cluster.neuron.compile.steps=3", f"cluster.neuron.compile.cache='{cache}'")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp / "order").read_text().split("\n")[:-1] == ["compile 0", "run 0 1", "compile 1", "run 1 1",
                                                             "run 0 0", "run 1 0"]
    for node in (0, 1):
        compiled = (tmp / f"argv.1.{node}").read_text().splitlines()
        trained = (tmp / f"argv.0.{node}").read_text().splitlines()
        config = compiled.index("--config") + 1
        assert compiled[config] == str(job.results_dir / "training_compile_config.yaml")
        assert trained[config] == str(job.config_path)
        # Everything else, flags and environment included, is identical.
        assert compiled[:config] + compiled[config + 1:] == trained[:config] + trained[config + 1:]
        assert f"FLAGS={hostile} --target=trn1 --enable-mixed-precision-accumulation" in trained
        # One cache per model, the same on every node.
        (cache_line,) = [line for line in trained if line.startswith("CACHE=")]
        assert cache_line.startswith(f"CACHE={cache}/gpt-") and cache_line.count("/") == str(cache).count("/") + 1
        assert "MASTER=127.0.0.1:44242" in trained and "--nproc_per_node" in trained
    compile_config = yaml.safe_load((job.results_dir / "training_compile_config.yaml").read_text())
    assert compile_config["trainer"]["max_steps"] == 3
    assert compile_config["run"]["results_dir"] == str(job.results_dir / "compile")
    # Every graph kind the real run has (launcher/config.py cut_to_steps): logged steps, a validation and a save at
    # step 2 and a step after them, the checkpoints in the compile's own directory, not where training resumes.
    assert compile_config["trainer"]["log_every_n_steps"] == 1
    assert compile_config["trainer"]["val_check_interval"] == 2 < job.stage_config["trainer"]["val_check_interval"]
    assert compile_config["exp_manager"]["checkpoint_callback_params"]["every_n_train_steps"] == 2
    assert compile_config["exp_manager"]["checkpoint_callback_params"]["dirpath"] == \
        str(job.results_dir / "compile" / "checkpoints")
    assert compile_config["model"] == {**job.stage_config["model"], "optim": compile_config["model"]["optim"]}
    logs = sorted(p.name for p in job.log_dir.iterdir())
    assert "training_4242_0_restart0_compile_node1.log" in logs and "training_4242_0_restart0_node1.log" in logs


def test_training_never_starts_after_a_failed_compile(sandbox):
    result, job, tmp = _run_script(sandbox, env={"FAILED": "2"})
    assert result.returncode == 1
    assert "compile step on node 0: Total failed compilations: 2" in result.stderr
    assert "run 0 0" not in (tmp / "order").read_text()
    assert (job.log_dir / "training_4242_0.exit").read_text().strip() == "1"
    assert not Path(neuron.script(job, parse(_job(f"base_results_dir={tmp}/results", "training.trainer.num_nodes=2",
                                                  f"cluster.neuron.compile.cache={tmp}/cache")[0])).compile.marker
                    ).exists()


def test_a_requeue_or_the_next_launch_of_the_same_graphs_skips_the_compile_step(sandbox):
    first, job, tmp = _run_script(sandbox)
    assert first.returncode == 0, first.stderr
    order = tmp / "order"
    assert "compile 0" in order.read_text()
    order.unlink()
    # Slurm requeued the job (or the run is launched again): the marker says the cache holds the graphs.
    again, _, _ = _run_script(sandbox, env={"SLURM_RESTART_COUNT": "1"})
    assert again.returncode == 0, again.stderr
    assert order.read_text().split("\n")[:-1] == ["run 0 0", "run 1 0"]
    assert "compile step skipped, the cache holds these graphs" in again.stdout
    # Graphs that differ (another precision, another world size) are compiled again.
    order.unlink()
    changed, _, _ = _run_script(sandbox, "training.precision.type=bf16SR")
    assert changed.returncode == 0, changed.stderr
    assert order.read_text().startswith("compile 0")


def test_the_marker_names_what_the_graphs_depend_on():
    def marker(*overrides):
        cfg, job = _job("training.trainer.num_nodes=2", *overrides)
        return neuron.script(job, parse(cfg)).compile.marker

    base = marker()
    assert base.startswith("/fsx/neuron-compile-cache/gpt-") and "/nxdt-compiled/" in base
    # Not the data or the step count: neither changes a graph.
    assert marker("training.trainer.max_steps=77", "training.model.data.splits_string='90,5,5'") == base
    for changed in ("training.trainer.num_nodes=4", "training.precision.type=bf16SR", "training.model.micro_batch_size=2",
                    "training.model.encoder_seq_length=64", "cluster.neuron.compiler_flags='--model-type=transformer'"):
        assert marker(changed) != base, changed
    # A cache on S3 keeps its markers on the shared file system, where the job script can look.
    on_s3 = marker("cluster.neuron.compile.cache=s3://bucket/cache")
    assert on_s3.startswith("/results/neuron-compile-markers/") and on_s3 != base
    # null: under base_results_dir, which every node sees.
    assert marker("cluster.neuron.compile.cache=null").startswith("/results/neuron-compile-cache/gpt-")


def test_a_cache_that_not_every_node_can_find_is_refused(tmp_path):
    result = nxdt(f"base_results_dir={tmp_path}/results", "stages=[training]", "training.trainer.accelerator=neuron",
                  "cluster=pcluster_trn1", "training.trainer.devices=32", "cluster.neuron.compile.cache=neuron-cache",
                  "--dry-run", cwd=tmp_path)
    assert result.returncode == 2
    assert "error: cluster.neuron.compile.cache: 'neuron-cache' must be a directory every node sees" in result.stderr


def _efa_block(script: str) -> list[str]:
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Collectives between Neuron nodes over EFA"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("ulimit -n"))
    return lines[start:end + 1]


@pytest.mark.parametrize("cluster", ["pcluster_trn1", "pcluster_trn2", "slurm"])
def test_cluster_validate_on_neuron_sets_the_efa_environment_training_sets(tmp_path, cluster):
    from launcher.commands import cluster_validate
    from launcher.render import render

    plan, _ = cluster_validate.make_plan([f"cluster={cluster}", f"base_results_dir={tmp_path}", "cluster_type=slurm",
                                          "accelerator=neuron", "devices=32", "nodes=2"],
                                         dry_run=True, produced_by="test")
    validation = render(plan.jobs[0], plan.cfg, executor="slurm", produced_by="test")
    devices = 64 if cluster == "pcluster_trn2" else 32
    cfg, job = _job(f"base_results_dir={tmp_path}", cluster=cluster, devices=devices)
    training = render(job, cfg, executor="slurm", produced_by="test")
    assert _efa_block(validation) == _efa_block(training)
    assert {"export FI_PROVIDER=efa", "export FI_EFA_USE_DEVICE_RDMA=1"} <= set(_efa_block(training))
    # Switched off in one place, off in both.
    plan, _ = cluster_validate.make_plan([f"cluster={cluster}", f"base_results_dir={tmp_path}", "cluster_type=slurm",
                                          "accelerator=neuron", "devices=32", "nodes=2", "++cluster.neuron.efa=false"],
                                         dry_run=True, produced_by="test")
    assert "FI_PROVIDER" not in render(plan.jobs[0], plan.cfg, executor="slurm", produced_by="test")


def test_cluster_validate_on_cpu_sets_no_efa_environment(tmp_path):
    from launcher.commands import cluster_validate
    from launcher.render import render

    plan, _ = cluster_validate.make_plan(["cluster=pcluster_trn1", f"base_results_dir={tmp_path}", "cluster_type=slurm",
                                          "accelerator=cpu", "nodes=2"], dry_run=True, produced_by="test")
    assert "FI_PROVIDER" not in render(plan.jobs[0], plan.cfg, executor="slurm", produced_by="test")


def test_without_the_compile_step_training_runs_alone(sandbox):
    result, _, tmp = _run_script(sandbox, "cluster.neuron.compile.enabled=false")
    assert result.returncode == 0, result.stderr
    assert (tmp / "order").read_text().split() == ["run", "0", "0", "run", "1", "0"]


def test_a_cache_is_named_after_the_model_whose_config_json_decides_it(tmp_path):
    """NxD Training's hf_* files leave model.architecture to the config.json they name: the cache takes that
    file's model_type, or "model" where it cannot be read here (never "None")."""
    import copy

    _, job = _job()
    config = copy.deepcopy(job.stage_config)
    config["model"]["architecture"] = None
    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    config["model"]["model_config"] = str(tmp_path / "config.json")
    assert neuron.model_key(config).startswith("llama-")
    config["model"]["model_config"] = str(tmp_path / "elsewhere" / "config.json")
    assert neuron.model_key(config).startswith("model-")
