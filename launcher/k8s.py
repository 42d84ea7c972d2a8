"""cluster_type=k8s: each stage as one Kubernetes object (docs/kubernetes.md). A Kubeflow Trainer v2 TrainJob on a
torch-distributed ClusterTrainingRuntime by default; a Kubeflow training operator v1 PyTorchJob, or SageMaker
HyperPod's HyperPodPyTorchJob, by cluster.k8s.job_kind. Every pod runs the node script that render.py renders from
templates/k8s/node.sh.j2 with the macros the sbatch and local scripts share (environment, program), so the
command, its environment and its torchrun flags come from one place.

Pure here: rendering (manifest), the config's rules (problems) and the vendored schemas (schema_problems). The
`kubernetes` client is imported only by the functions that talk to a cluster (submit, state, logs, cancel)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from launcher import neuron
from launcher.config import LaunchConfig, typed
from launcher.instances import NEURON_HARDWARE
from launcher.job import Job
from launcher.k8s_pod import code_dir, runtime_requirements
from launcher.render import _environment, render

if TYPE_CHECKING:
    from launcher.slurm import JobState

SCHEMAS = Path(__file__).parent / "schemas" / "k8s"


@dataclass(frozen=True)
class Kind:
    api_version: str
    template: str             # under templates/k8s/
    schema: str | None        # the vendored openAPIV3Schema the whole object is validated against
    container: str            # the name of the container that runs the node script
    plural: str               # the resource's plural, for the API's URLs

    @property
    def group(self) -> str:
        return self.api_version.split("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.split("/")[1]


KINDS = {
    "TrainJob": Kind("trainer.kubeflow.org/v1alpha1", "trainjob.yaml.j2", "trainjob.v1alpha1.json", "node",
                     "trainjobs"),
    "PyTorchJob": Kind("kubeflow.org/v1", "pytorchjob.yaml.j2", "pytorchjob.v1.json", "pytorch", "pytorchjobs"),
    # No public CRD to vendor: its pod templates are validated against the core PodTemplateSpec that the PyTorchJob
    # CRD embeds, and its own fields by shape (schema_problems).
    "HyperPodPyTorchJob": Kind("sagemaker.amazonaws.com/v1", "hyperpodpytorchjob.yaml.j2", None, "pytorch",
                               "hyperpodpytorchjobs"),
}

# Per instance of each cluster.neuron.hardware (launcher/instances.py): Trainium chips (what the Neuron device plugin
# counts as aws.amazon.com/neuron) and EFA interfaces (vpc.amazonaws.com/efa). trn1n.32xlarge has twice trn1's EFA
# interfaces: set cluster.k8s.efa_per_node there.
NEURON_DEVICES = {name: device.instance.chips for name, device in NEURON_HARDWARE.items()}
EFA_INTERFACES = {name: device.instance.efa_interfaces for name, device in NEURON_HARDWARE.items()}

DEFAULTS: dict[str, Any] = {
    "job_kind": "TrainJob",
    "image": None,                    # the pods' image when `container` names none (the presets: AWS's Neuron DLC)
    # Before the program, each pod pip-installs the runtime's requirements its image lacks (runtime_requirements):
    # the Neuron DLC has torch, torch-xla and torch-neuronx but not, e.g., zstandard or schedulefree.
    "install_requirements": True,
    "namespace": "default",
    "runtime": "torch-distributed",   # TrainJob: the ClusterTrainingRuntime it runs on
    "queue": None,                    # Kueue LocalQueue: the kueue.x-k8s.io/queue-name label
    "volume": {"claim": None, "mount_path": None},
    "neuron_devices_per_node": None,  # null: the instance's (NEURON_DEVICES)
    "efa_per_node": None,             # null: the instance's (EFA_INTERFACES) when cluster.neuron.efa, else none
    "service_account": None,
    "auto_resume": {"enabled": False, "max_retry": 3},
    "context": None,                  # kubeconfig context; null: the current one
    "poll_s": 5,                      # how often a launch asks the API server whether its stage has ended
}
KEYS = tuple(DEFAULTS)


def settings(cfg: LaunchConfig) -> dict[str, Any]:
    """cluster.k8s with every missing key filled from DEFAULTS."""
    given = cfg.cluster.k8s if isinstance(cfg.cluster.k8s, Mapping) else {}
    merged = {**DEFAULTS, **given}
    for key in ("volume", "auto_resume"):
        merged[key] = {**DEFAULTS[key], **(given.get(key) if isinstance(given.get(key), Mapping) else {})}
    return merged


def _under(path: Any, root: str) -> bool:
    path, root = str(path), root.rstrip("/")
    return path == root or path.startswith(root + "/")


def problems(cfg: LaunchConfig) -> list[str]:
    """The config's rules for cluster_type=k8s, one line each, naming the key and the fix."""
    if cfg.cluster_type != "k8s":
        return []
    given = cfg.cluster.k8s
    if given is not None and not isinstance(given, Mapping):
        return [f"cluster.k8s: {given!r} must be a mapping; choose a preset, e.g. cluster=eks_trn2"]
    errors = [f"cluster.k8s.{key}: unknown key; valid keys: {', '.join(KEYS)}" for key in (given or {})
              if key not in KEYS]
    k8s = settings(cfg)
    if k8s["job_kind"] not in KINDS:
        errors.append(f"cluster.k8s.job_kind: {k8s['job_kind']!r} is not one of {', '.join(KINDS)}")
    if not image(cfg):
        errors.append("container: cluster_type=k8s runs every stage in an image; set container=IMAGE (or "
                      "cluster.k8s.image), one with torch for the stages' devices")
    if not isinstance(k8s["install_requirements"], bool):
        errors.append(f"cluster.k8s.install_requirements: {k8s['install_requirements']!r} must be true or false")
    for key in ("namespace", "runtime"):
        if not isinstance(k8s[key], str) or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", k8s[key]):
            errors.append(f"cluster.k8s.{key}: {k8s[key]!r} is not a Kubernetes name (lower-case letters, digits, "
                          f"'-' and '.'); e.g. cluster.k8s.{key}={DEFAULTS[key]}")
    queue = k8s["queue"]
    if queue is not None and not (isinstance(queue, str)
                                  and re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", queue)):
        errors.append(f"cluster.k8s.queue: {queue!r} is not a label value (63 letters, digits, '-', '_', '.'); "
                      f"give the Kueue LocalQueue's name, e.g. cluster.k8s.queue=training")
    claim, mount = k8s["volume"]["claim"], k8s["volume"]["mount_path"]
    if not isinstance(claim, str) or not claim or not isinstance(mount, str) or not mount.startswith("/"):
        errors.append("cluster.k8s.volume: every pod reads and writes the run's files on a shared volume; set "
                      "cluster.k8s.volume.claim=PVC and cluster.k8s.volume.mount_path=/fsx")
    hardware = cfg.cluster.neuron_hardware
    for key, table in (("neuron_devices_per_node", NEURON_DEVICES), ("efa_per_node", EFA_INTERFACES)):
        value = k8s[key]
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            errors.append(f"cluster.k8s.{key}: {value!r} must be a whole number >= 0 (or null for the instance's)")
        elif hardware not in table:
            if value:
                errors.append(f"cluster.k8s.{key}: {value}, but the cluster's nodes are no Trainium instance (no "
                              f"cluster.neuron.hardware); set cluster.k8s.{key}=null or choose cluster=eks_trn2")
        elif value > table[hardware]:
            errors.append(f"cluster.k8s.{key}: {value} is more than a {hardware} node has ({table[hardware]}); "
                          f"set cluster.k8s.{key}=null for the instance's")
    poll = k8s["poll_s"]
    if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 < poll <= 600:
        errors.append(f"cluster.k8s.poll_s: {poll!r} must be a number of seconds in (0, 600], "
                      f"e.g. cluster.k8s.poll_s=5")
    ar = k8s["auto_resume"]
    if not isinstance(ar["enabled"], bool) or isinstance(ar["max_retry"], bool) \
            or not isinstance(ar["max_retry"], int) or ar["max_retry"] < 0:
        errors.append("cluster.k8s.auto_resume: enabled must be true or false and max_retry a whole number >= 0")
    return errors


def image(cfg: LaunchConfig) -> str | None:
    """The pods' image: `container`, else the preset's cluster.k8s.image."""
    found = cfg.container or settings(cfg)["image"]
    return str(found) if found else None


def mount_problems(cfg: LaunchConfig) -> list[str]:
    """A launch (not a dry run) writes the stage configs and the code onto the shared volume, at the path the pods
    see it at: it must be mounted here."""
    mount = settings(cfg)["volume"]["mount_path"]
    if isinstance(mount, str) and not os.path.isdir(mount):
        return [f"cluster.k8s.volume.mount_path: {mount} is not mounted on this machine, and the pods read the run's "
                f"files there; launch where the shared volume is mounted at {mount} (a login pod or an instance with "
                f"FSx mounted), or use --dry-run"]
    return []


def job_problems(cfg: LaunchConfig, jobs: list[Job], produced_by: str) -> list[str]:
    """After problems(): what every pod must see on the shared volume, then each stage's manifest against the
    vendored schemas (schema_problems)."""
    from launcher import staging

    mount = settings(cfg)["volume"]["mount_path"]
    shared = [("base_results_dir", cfg.base_results_dir)]
    if str(cfg.data_dir or "").startswith("/"):
        shared.append(("data_dir", cfg.data_dir))
    # A stage's results directory under base_results_dir is named by base_results_dir's line, if at all.
    shared += [(f"{job.stage}.run.results_dir", job.results_dir) for job in jobs
               if not _under(job.results_dir, str(cfg.base_results_dir))]
    if any(neuron.script(job, cfg) for job in jobs) and not neuron.cache_location(cfg).startswith("s3://"):
        shared.append(("cluster.neuron.compile.cache", neuron.cache_location(cfg)))
    if any(staging.for_job(job, cfg) for job in jobs):  # the S3 mirror the pods read and write
        shared.append(("cluster.staging.local_dir", cfg.cluster.staging_local_dir))
    errors = [f"{key}: {path} is not on the shared volume (cluster.k8s.volume.mount_path={mount}), so the pods "
              f"would not see it; put it under {mount}" for key, path in shared if not _under(path, mount)]
    if errors:
        return errors
    for job in jobs:
        errors += schema_problems(manifest(job, cfg, produced_by=produced_by), job.stage)
    return errors


def resource_name(job: Job) -> str:
    """metadata.name: the run and stage as a DNS-1035 label (JobSet names its pods and services by it), with a short
    hash of the launch's config path so that a relaunch of the run makes a new object."""
    base = re.sub(r"[^a-z0-9]+", "-", f"{job.run_name}-{job.stage.replace('_', '-')}".lower()).strip("-")
    if not base[:1].isalpha():
        base = "r-" + base
    digest = hashlib.sha256(str(job.config_path).encode()).hexdigest()[:6]
    return f"{base[:40].rstrip('-')}-{digest}"


def _label(value: Any) -> str:
    text = re.sub(r"[^A-Za-z0-9_.-]+", "-", str(value))[:63].strip("-_.")
    return text or "none"


def resources(job: Job, cfg: LaunchConfig) -> dict[str, int]:
    """What one node's pod requests: its Neuron devices and EFA interfaces, for a stage that runs on Neuron."""
    if not neuron.runs_on_neuron(job) or cfg.cluster.neuron_hardware not in NEURON_DEVICES:
        return {}
    k8s, hardware = settings(cfg), cfg.cluster.neuron_hardware
    found = {"aws.amazon.com/neuron": k8s["neuron_devices_per_node"]}
    if found["aws.amazon.com/neuron"] is None:
        found["aws.amazon.com/neuron"] = NEURON_DEVICES[hardware]
    efa = k8s["efa_per_node"]
    if efa is None:
        efa = EFA_INTERFACES[hardware] if neuron.settings(cfg.cluster)["efa"] else 0
    if efa:
        found["vpc.amazonaws.com/efa"] = efa
    return found


def pods(job: Job) -> int:
    """The stage object's pods: one per node, or for an array stage (data preparation) as many as its tasks may run
    at once (run.node_array_size), each pod running every pods-th task as a Slurm array would run them in parallel."""
    return (job.array_parallel or 1) if job.array_size else job.nodes


def manifest(job: Job, cfg: LaunchConfig | dict[str, Any], *, produced_by: str) -> str:
    """The stage's object as YAML text; its pods run the node script (render.render for executor k8s)."""
    cfg = typed(cfg)

    k8s = settings(cfg)
    kind = KINDS[k8s["job_kind"]]
    labels = {"app.kubernetes.io/managed-by": "nxdt-launch", "nxdt.run": _label(job.run_name),
              "nxdt.stage": _label(job.stage)}
    if k8s["queue"]:
        labels["kueue.x-k8s.io/queue-name"] = k8s["queue"]
    annotations = {"nxdt.produced-by": produced_by, "nxdt.stage-config": str(job.config_path)}
    if k8s["job_kind"] == "PyTorchJob" and k8s["auto_resume"]["enabled"]:
        # HyperPod's auto-resume of a Kubeflow PyTorchJob: HyperPod replaces a faulty node and resubmits the job.
        annotations["sagemaker.amazonaws.com/enable-job-auto-resume"] = "true"
        annotations["sagemaker.amazonaws.com/job-max-retry-count"] = str(k8s["auto_resume"]["max_retry"])
    template = _environment().get_template(f"k8s/{kind.template}")
    return template.render(
        kind=kind, name=resource_name(job), namespace=k8s["namespace"], labels=labels, annotations=annotations,
        job=job, image=image(cfg), env={"NXDT_K8S_OBJECT": resource_name(job)},
        pods=pods(job), script=render(job, cfg, executor="k8s", produced_by=produced_by, k8s={
            "code_dir": code_dir(job), "pods": pods(job),
            "requirements": runtime_requirements(cfg) if k8s["install_requirements"] else []}),
        runtime=k8s["runtime"],
        resources=resources(job, cfg), claim=k8s["volume"]["claim"], mount_path=k8s["volume"]["mount_path"],
        service_account=k8s["service_account"], auto_resume=k8s["auto_resume"], container_name=kind.container,
        hyperpod_health=k8s["job_kind"] != "TrainJob" and k8s["auto_resume"]["enabled"],
    )


@lru_cache(maxsize=None)
def _schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / name).read_text())


def _pod_template_schema() -> dict[str, Any]:
    """The core v1 PodTemplateSpec, as the PyTorchJob CRD embeds it (controller-gen's copy of k8s.io/api)."""
    spec = _schema("pytorchjob.v1.json")["properties"]["spec"]["properties"]["pytorchReplicaSpecs"]
    return spec["additionalProperties"]["properties"]["template"]


def _validate(instance: Any, schema: dict[str, Any], where: str) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    found = []
    for error in sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path)):
        path = ".".join(str(p) for p in error.absolute_path) or "(root)"
        found.append(f"{where}.{path}: {error.message}")
    return found


def schema_problems(text: str, stage: str) -> list[str]:
    """The manifest against the vendored schema of its kind (launcher/schemas/k8s/README.md), one line per error."""
    import yaml

    obj = yaml.safe_load(text)
    kind = KINDS.get(obj.get("kind"))
    where = f"{stage} ({obj.get('kind')})"
    if kind is None or obj.get("apiVersion") != kind.api_version:
        return [f"{where}: not a kind this launcher renders"]
    if kind.schema:
        return _validate(obj, _schema(kind.schema), where)
    # HyperPodPyTorchJob's own fields, as AWS documents them; each pod template as the core PodTemplateSpec.
    spec_schema = {"type": "object", "required": ["nprocPerNode", "replicaSpecs"], "properties": {
        "nprocPerNode": {"type": "string"},
        "runPolicy": {"type": "object", "properties": {"jobMaxRetryCount": {"type": "integer", "minimum": 0}}},
        "replicaSpecs": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "replicas", "template"],
            "properties": {"name": {"type": "string"}, "replicas": {"type": "integer", "minimum": 1},
                           "template": _pod_template_schema()}}}}}
    return _validate(obj.get("spec"), spec_schema, f"{where}.spec")


# --- talking to the cluster (the official `kubernetes` client, the k8s extra) --------------------------------------
# The stages run in order: each object is created once the one before it has completed, and a failed or cancelled
# stage leaves the later ones uncreated (Kubernetes has no afterok). The launch waits for them, as a local launch does.

_COMPLETED = {"Complete", "Completed", "Succeeded"}   # TrainJob | HyperPodPyTorchJob | PyTorchJob condition types
_FAILED = {"Failed"}


def _apis(context: str | None):
    """(CustomObjectsApi, CoreV1Api) for the kubeconfig kubectl would use ($KUBECONFIG, ~/.kube/config)."""
    from launcher.errors import UserError

    try:
        from kubernetes import client, config
    except ImportError:
        raise UserError("cluster_type=k8s: the kubernetes package is missing; pip install 'nxdt-launch[k8s]'") from None
    try:  # KUBECONFIG read now, not when the client was imported (it may be a ':'-separated list, as for kubectl)
        api = config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"), context=context)
    except config.ConfigException as error:
        raise UserError(f"cluster.k8s.context: no usable kubeconfig ({error}); set KUBECONFIG or "
                        f"cluster.k8s.context") from None
    return client.CustomObjectsApi(api), client.CoreV1Api(api)


def _call(what: str, method, *args, **kwargs):
    """One API request; a refusal or an unreachable server is one line naming what was asked, not a traceback."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    from launcher.errors import UserError

    try:
        return method(*args, **kwargs)
    except ApiException as error:
        if error.status == 404 and what.startswith("read"):
            return None
        raise UserError(f"cluster.k8s: {what}: the API server answered {error.status} {error.reason}; "
                        f"check the cluster's CRDs and your permissions (kubectl auth can-i)") from None
    except HTTPError as error:
        raise UserError(f"cluster.k8s: {what}: the API server cannot be reached ({type(error).__name__}); check "
                        f"KUBECONFIG or cluster.k8s.context") from None


def _where(record: dict[str, Any]) -> tuple[Kind, str, str | None]:
    k8s = record["k8s"]
    return KINDS[k8s["kind"]], k8s["namespace"], k8s.get("context")


def object_state(obj: dict[str, Any] | None) -> "JobState":
    """The stage's state from its object's status.conditions (None: the object is gone, i.e. cancelled)."""
    from launcher.slurm import JobState

    if obj is None:
        return JobState("CANCELLED", "the object was deleted")
    conditions = {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []
                  if str(c.get("status")) == "True"}
    for kind, state in ((_FAILED, "FAILED"), (_COMPLETED, "COMPLETED")):
        if found := kind & set(conditions):
            condition = conditions[sorted(found)[0]]
            return JobState(state, str(condition.get("reason") or condition.get("message") or ""))
    if "Suspended" in conditions or not conditions:
        return JobState("PENDING")
    return JobState("RUNNING")


def _read(custom, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
    return _call(f"read {kind.plural}/{name}", custom.get_namespaced_custom_object, kind.group, kind.version,
                 namespace, kind.plural, name)


def stage_states(record: dict[str, Any], running: bool) -> list[tuple[dict[str, Any], "JobState"]]:
    """`nxdt-launch status` of a k8s run: each created object's state; the others wait for the stage before them
    while the launch that creates them runs, and are not run otherwise."""
    from launcher.slurm import JobState

    custom, _ = _apis(_where(record)[2])
    kind, namespace, _ = _where(record)
    rows, blocked = [], False
    for entry in record["stages"]:
        if entry.get("job_id"):
            state = object_state(_read(custom, kind, namespace, str(entry["job_id"])))
            blocked = blocked or state.state in ("FAILED", "CANCELLED")
        elif running and not blocked:
            state = JobState("PENDING", "waits for the stage before it")
        else:
            state = JobState("NOT RUN", "an earlier stage failed or the run was cancelled")
        rows.append((entry, state))
    return rows


def cancel(record: dict[str, Any], run_dir: Path) -> str:
    """Delete every object of the run that is still there (its pods go with it), and note the cancel so that the
    waiting launch creates no later stage."""
    from launcher import records

    custom, _ = _apis(_where(record)[2])
    kind, namespace, _ = _where(record)
    records.write_cancel(run_dir, record, [e["stage"] for e in record["stages"]], "deleted")
    deleted = []
    for entry in record["stages"]:
        name = entry.get("job_id")
        if name and object_state(_read(custom, kind, namespace, str(name))).state not in ("COMPLETED", "CANCELLED"):
            _call(f"delete {kind.plural}/{name}", custom.delete_namespaced_custom_object, kind.group, kind.version,
                  namespace, kind.plural, str(name), propagation_policy="Foreground")
            deleted.append(f"{namespace}/{name}")
    return f"deleted {kind.plural} {' '.join(deleted)}" if deleted else "nothing left to delete"


def run(plan, record: dict[str, Any], console, *, pid_started: float | None) -> int:
    """Create the stages' objects in order, each after the one before has completed; stop at a failure or a
    cancel. Returns 0 when every stage completed, else 1. `pid_started`: this process's start (runs.process_started),
    by which `status` tells that the launch still runs."""
    import yaml

    from launcher import records

    k8s = settings(plan.config)
    custom, _ = _apis(k8s["context"])
    kind = KINDS[k8s["job_kind"]]
    records.archive_previous(plan.run_dir)
    record["k8s"] = {"kind": k8s["job_kind"], "namespace": k8s["namespace"], "context": k8s["context"]}
    record["pid"], record["pid_started"] = os.getpid(), pid_started
    records.write(plan.run_dir, record)
    code = 0
    for job, entry in zip(plan.jobs, record["stages"]):
        if entry["stage"] in records.cancelled_stages(plan.run_dir, record):
            code = 1
            break
        body = yaml.safe_load(Path(plan.local_path(Path(entry["script"]))).read_text())
        _call(f"create {kind.plural}/{resource_name(job)}", custom.create_namespaced_custom_object, kind.group,
              kind.version, k8s["namespace"], kind.plural, body)
        entry["job_id"] = resource_name(job)
        records.write(plan.run_dir, record)
        console.print(f"{entry['stage']}: created {kind.plural}/{entry['job_id']} in {k8s['namespace']}",
                      highlight=False)
        while (state := object_state(_read(custom, kind, k8s["namespace"], entry["job_id"]))).state in (
                "PENDING", "RUNNING"):
            time.sleep(float(k8s["poll_s"]))
        entry["exit_code"] = 0 if state.state == "COMPLETED" else 1
        records.write(plan.run_dir, record)
        console.print(f"{entry['stage']}: {state}", highlight=False)
        if state.state != "COMPLETED":
            code = 1
            break
    record.pop("pid", None)
    records.write(plan.run_dir, record)
    return code
