"""Submit, status, logs and cancel of a two-stage k8s run, against kmock's KubernetesEmulator:
a FAKE Kubernetes API server (no kube-apiserver, kind or k3s can be installed here). It stores the objects the
official client creates and serves them back, but runs nothing: this test plays the training operator, setting each
object's status.conditions and writing the per-pod log the node script would write on the shared volume.
What is real: the kubernetes client's requests, the order the launcher creates the stages in, the record, and the
functions the status, logs and cancel commands call. The launch runs in a thread of this process (the emulator serves
from this test's event loop; a forked CLI would inherit that loop's threads mid-flight)."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rich.console import Console

from launcher import k8s, k8s_pod, launch, records, runs

from ..launcher.helpers import REPO

TRAINJOBS = "trainer.kubeflow.org/v1alpha1/trainjobs"


def _kubeconfig(tmp_path, url) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: kmock, cluster: {{server: "{url}"}}}}]
users: [{{name: me, user: {{token: t}}}}]
contexts: [{{name: kmock, context: {{cluster: kmock, user: me}}}}]
current-context: kmock
""")
    return str(path)


def _launch(tmp_path):
    """The headline recipe on eks_trn2, its inputs on the shared volume (here a directory of the test's)."""
    fsx = tmp_path / "fsx"
    (fsx / "data" / "llama3" / "raw").mkdir(parents=True)
    (fsx / "data" / "llama3" / "raw" / "a.jsonl").write_text('{"text": "x"}\n')
    (fsx / "data" / "llama3" / "tokenizer.json").write_text("{}\n")
    return ["stages=[data_preparation,training]", "training=llama3/8b", "cluster=eks_trn2", "cluster_type=k8s",
            "container=nxdt:1", f"base_results_dir={fsx}/results", f"data_dir={fsx}/data",
            f"cluster.k8s.volume.mount_path={fsx}", f"cluster.neuron.compile.cache={fsx}/cache",
            "cluster.k8s.poll_s=0.05", "run_name=k8srun"]


async def _created(kmock, stage: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for key in list(kmock.objects):
            if str(key[0].plural) == "trainjobs" and key[2].startswith(f"k8srun-{stage.replace('_', '-')}-"):
                return key
        await asyncio.sleep(0.02)
    raise AssertionError(f"no TrainJob for {stage} was created")


def _finish(kmock, key, condition: str) -> None:
    obj = dict(kmock.objects[key].raw)
    kmock.objects[key] = {**obj, "status": {"conditions": [{"type": condition, "status": "True",
                                                            "reason": f"Job{condition}"}]}}


def _launch_now(overrides: list[str]) -> tuple[int, str]:
    """What `nxdt-launch OVERRIDES` does for cluster_type=k8s (launcher/cli.py launch): plan, write, run."""
    plan = launch.make_plan(overrides, dry_run=False, produced_by="nxdt-launch (test)")
    record = launch.new_record(plan, launch.write(plan))
    console = Console(file=io.StringIO(), width=200)
    code = k8s.run(plan, record, console, pid_started=runs.process_started(os.getpid()))
    plan.launch_lock.close()
    return code, console.file.getvalue()


def _status(run_dir) -> list[tuple[str, str]]:
    return [(e["stage"], str(state)) for e, state in runs.stage_states(records.load(run_dir))]


@pytest.mark.asyncio
async def test_two_stages_run_in_order_and_status_logs_cancel_read_them(kmock, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, kmock.url))
    started = asyncio.create_task(asyncio.to_thread(_launch_now, _launch(tmp_path)))
    first = await _created(kmock, "data_preparation")
    await asyncio.sleep(0.3)  # several polls: the training is not created while data preparation runs
    assert [k[2] for k in kmock.objects if str(k[0].plural) == "trainjobs"] == [first[2]]
    run_dir = tmp_path / "fsx" / "results" / "k8srun"
    assert await asyncio.to_thread(_status, run_dir) == [("data_preparation", "PENDING"),
                                                         ("training", "PENDING (waits for the stage before it)")]
    # The code the pods put first on PYTHONPATH (k8s_pod.code_dir, in the manifest), copied into the launch's directory.
    record = records.load(run_dir)
    script = (run_dir / "data_preparation" / "data_preparation.k8s.yaml").read_text()
    code = next(line.split("=", 1)[1].split("$")[0] for line in script.splitlines()
                if "export PYTHONPATH=" in line)
    assert code.startswith(str(run_dir / "data_preparation" / "launches"))
    ours = sorted(str(f.relative_to(REPO)) for package in ("runtime", "csp_tools") for f in (REPO / package).rglob("*")
                  if f.is_file() and "__pycache__" not in f.parts)
    assert sorted(str(f.relative_to(code)) for f in Path(code).rglob("*") if f.is_file()) == ours
    imported = subprocess.run([sys.executable, "-c", "import runtime, csp_tools; print(runtime.__file__)"],
                              env={**os.environ, "PYTHONPATH": code}, capture_output=True, text=True, cwd=tmp_path)
    assert imported.stdout.strip() == f"{code}/runtime/__init__.py", imported.stderr
    # `nxdt-launch logs -f`: the pod's log as it grows, where the node script tees it, until the stage has ended.
    printed: list[str] = []
    following = asyncio.create_task(asyncio.to_thread(runs.follow, run_dir, record, "data_preparation",
                                                      printed.append, 0.05))
    log = run_dir / "data_preparation" / "logs" / f"data_preparation_{first[2]}_node0.log"
    log.write_text("prepared 1 file\n")
    deadline = time.monotonic() + 30
    while not printed and time.monotonic() < deadline:  # printed while the stage runs
        await asyncio.sleep(0.02)
    assert printed == ["prepared 1 file\n"] and not following.done()
    with log.open("a") as f:
        f.write("wrote 2 shards\n")
    _finish(kmock, first, "Complete")
    await asyncio.wait_for(following, 30)  # it ends with the stage, having printed the rest
    assert printed == ["prepared 1 file\n", "wrote 2 shards\n"]
    second = await _created(kmock, "training")
    assert (await asyncio.to_thread(_status, run_dir))[0] == ("data_preparation", "COMPLETED (JobComplete)")
    record = records.load(run_dir)
    assert [p.read_text() for p in runs.log_files(record, "data_preparation")] == [
        "prepared 1 file\nwrote 2 shards\n"]
    said = await asyncio.to_thread(runs.cancel, record, run_dir, timeout_s=5)
    assert said == f"deleted trainjobs default/{second[2]}"
    code, printed = await asyncio.wait_for(started, 60)
    assert code == 1 and "training: CANCELLED" in printed, printed
    record = records.load(run_dir)
    assert [(e["stage"], e["job_id"], e["exit_code"]) for e in record["stages"]] == [
        ("data_preparation", first[2], 0), ("training", second[2], 1)]


@pytest.mark.asyncio
async def test_a_failed_stage_leaves_the_next_uncreated(kmock, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", _kubeconfig(tmp_path, kmock.url))
    started = asyncio.create_task(asyncio.to_thread(_launch_now, _launch(tmp_path)))
    first = await _created(kmock, "data_preparation")
    _finish(kmock, first, "Failed")
    code, printed = await asyncio.wait_for(started, 60)
    assert code == 1 and "data_preparation: FAILED (JobFailed)" in printed, printed
    assert [k[2] for k in kmock.objects if str(k[0].plural) == "trainjobs"] == [first[2]]
    assert await asyncio.to_thread(_status, tmp_path / "fsx" / "results" / "k8srun") == [
        ("data_preparation", "FAILED (JobFailed)"),
        ("training", "NOT RUN (an earlier stage failed or the run was cancelled)")]


def test_stages_that_share_a_results_dir_share_the_code_copy(tmp_path):
    """A real (not dry) k8s launch writes its files without the API server: two stages in one results directory get
    one copy of the code, which both manifests name."""
    plan = launch.make_plan([*_launch(tmp_path), "data_preparation.run.results_dir=${training.run.results_dir}"],
                            dry_run=False, produced_by="nxdt-launch (test)")
    try:
        launch.write(plan)
    finally:
        plan.launch_lock.close()
    codes = {k8s_pod.code_dir(job) for job in plan.jobs}
    assert len(codes) == 1 and (next(iter(codes)) / "runtime" / "train.py").is_file()
