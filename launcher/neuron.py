"""What a job script needs to run a stage on Trainium: the environment NxD Training derives from the config,
the worker count per node, and the optional neuron_parallel_compile step. Pure functions of the resolved config;
render.py puts the results into the script and launch.py writes the compile step's config file.

The EFA settings (`Fabric`) are the one thing the training script and cluster-validate's collective tests must
share: both get them from `fabric()` and render them with one macro (templates/_macros.sh.j2), so the tests
measure the network the training will use.

Precision -> environment, as NxD Training's training.py (process_config) sets it; NEURON_CC_FLAGS gets the
cluster's compiler flags first, then the hardware target, then the precision's flags, in that order:

| precision.type    | XLA_USE_BF16 | XLA_DOWNCAST_BF16 | NEURON_RT_STOCHASTIC_ROUNDING_EN | NEURON_CC_FLAGS adds                                  |
| ----------------- | ------------ | ----------------- | -------------------------------- | ----------------------------------------------------- |
| fp32              | 0            | 0                 | (not set)                        | --auto-cast none                                      |
| bf16SR            | 1            | 0                 | 1                                | --enable-mixed-precision-accumulation                 |
| mixed_precision   | 0            | 1                 | 0                                | --enable-mixed-precision-accumulation                 |
| mixed_precisionSR | 0            | 1                 | 1                                | --enable-mixed-precision-accumulation                 |
| autocast          | 0            | 0                 | 0                                | --enable-mixed-precision-accumulation --auto-cast none |
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.config import Cluster, LaunchConfig, cut_to_steps, stage_inputs
from launcher.instances import NEURON_HARDWARE, Device, at_logical_cores
from launcher.job import Job
from launcher.stages import TRAINER_STAGES
from runtime.schema.stages import TITAN_PROGRAM
from runtime.schema.training import parse_precision

PRECISION_ENV: dict[str, tuple[dict[str, str], str]] = {
    "fp32": ({"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0"}, "--auto-cast none"),
    "bf16SR": ({"XLA_USE_BF16": "1", "XLA_DOWNCAST_BF16": "0", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"},
               "--enable-mixed-precision-accumulation"),
    "mixed_precision": ({"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "1", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"},
                        "--enable-mixed-precision-accumulation"),
    "mixed_precisionSR": ({"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "1", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"},
                          "--enable-mixed-precision-accumulation"),
    "autocast": ({"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"},
                 "--enable-mixed-precision-accumulation --auto-cast none"),
}


# A node's hardware (workers_per_node: one worker per logical NeuronCore; logical_cores: LNC, physical NeuronCores
# per logical one; target: neuronx-cc --target) is launcher/instances.py's record, by cluster.neuron.hardware.
Hardware = Device
HARDWARE = NEURON_HARDWARE

# What neuron_parallel_compile prints once per node when every graph compiled; training starts only after it.
COMPILE_SUMMARY = "Total failed compilations: 0"

DEFAULTS: dict[str, Any] = {
    "hardware": "trn1",
    # trn2's logical NeuronCore config: 2 (the default: two physical cores per worker, 64 workers per
    # trn2.48xlarge, NxD Training's trainer.lnc) or 1 (128 workers, each with half the memory and compute).
    "lnc": None,
    "efa": True,
    "compiler_flags": "--model-type=transformer --distribution-strategy=llm-training",
    "async_exec_max_inflight_requests": 3,
    "malloc_arena_max": 64,
    "open_files": 65535,
    # cache null: <base_results_dir>/neuron-compile-cache, on the shared file system every node writes its logs to,
    # so the graphs outlive the nodes (a replaced node starts with an empty /var/tmp).
    "compile": {"enabled": True, "steps": 10, "cache": None},
}
# Directory under base_results_dir for the compile markers of caches on S3 (a directory cache keeps its own).
S3_CACHE_MARKERS = "neuron-compile-markers"
NEURON_KEYS = tuple(DEFAULTS)
COMPILE_KEYS = tuple(DEFAULTS["compile"])


@dataclass(frozen=True)
class CompileStep:
    config: dict[str, Any]      # the stage config it runs: the training config, cut to `steps` steps
    config_path: Path
    # Written once every node compiled without a failure; while it exists, the step is skipped (a requeue, a
    # restart, the next launch of the same graphs). Its name is graph_key(): what the graphs depend on.
    marker: str
    log_suffix: str = "compile"


@dataclass(frozen=True)
class Fabric:
    """How the workers of a Neuron job reach each other's nodes: the same for training and cluster-validate."""

    env: dict[str, str]             # FI_PROVIDER, FI_EFA_USE_DEVICE_RDMA when cluster.neuron.efa
    efa_fork_safe_check: bool       # export FI_EFA_FORK_SAFE=1 on kernels that need it (decided on the node)
    open_files: int                 # ulimit -n: each worker holds many sockets and files open


@dataclass(frozen=True)
class NeuronScript:
    """Everything the templates render for a Neuron stage."""

    hardware: str
    env: dict[str, str]             # exported once, after the fabric's and before the cluster's and launch's env_vars
    cache_url: str                  # NEURON_COMPILE_CACHE_URL: one cache per model, shared by every node
    compile: CompileStep | None
    torchneuron: bool = False       # a torchtitan job: TorchNeuron's environment (torchneuron_env), no XLA settings


def settings(cluster: Cluster) -> dict[str, Any]:
    """cluster.neuron with every missing key filled from DEFAULTS."""
    given = cluster.neuron or {}
    merged = {**DEFAULTS, **{k: v for k, v in given.items() if k != "compile"}}
    merged["compile"] = {**DEFAULTS["compile"], **(given.get("compile") or {})}
    return merged


# A trn2.48xlarge's physical NeuronCore-v3: the workers per node are these over the logical-core config.
TRN2_PHYSICAL_CORES = HARDWARE["trn2"].instance.physical_cores


def hardware_of(neuron: dict[str, Any]) -> Hardware:
    """The node's workers and compiler target under cluster.neuron.lnc (problems() has refused an lnc the hardware
    does not take)."""
    base = HARDWARE[neuron["hardware"]]
    lnc = neuron.get("lnc")
    if lnc is None or lnc == base.logical_cores or base.target != "trn2":
        return base
    return at_logical_cores(base, lnc)


def estimator_device(neuron: dict[str, Any]) -> str:
    """The estimator's (and the runtime's peak-FLOPs) name of one worker's device: trn1, trn2 (LNC=2) or trn2-lnc1."""
    return hardware_of(neuron).name


def runs_on_neuron(job: Job) -> bool:
    return job.distributed and job.accelerator == "neuron"


def fabric(job: Job, cfg: LaunchConfig) -> Fabric | None:
    """The EFA settings of every job whose workers talk across Neuron nodes: a stage on Neuron
    (trainer.accelerator), and cluster-validate's collective tests (cluster_validation.accelerator=neuron)."""
    validating_neuron = job.stage == "cluster_validation" and job.accelerator == "neuron"
    if not (runs_on_neuron(job) or validating_neuron):
        return None
    neuron = settings(cfg.cluster)
    env = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"} if neuron["efa"] else {}
    return Fabric(env=env, efa_fork_safe_check=bool(neuron["efa"]), open_files=int(neuron["open_files"]))


def cache_location(cfg: LaunchConfig) -> str:
    """cluster.neuron.compile.cache, or its default on the shared file system, without a trailing slash."""
    cache = settings(cfg.cluster)["compile"]["cache"]
    if not cache:
        cache = f"{str(cfg.base_results_dir or '').rstrip('/')}/neuron-compile-cache"
    return str(cache).rstrip("/")


def model_key(stage_config: dict[str, Any]) -> str:
    """Names the compile cache of one model: its architecture and a hash of what shapes its graphs (the model
    section without its data and tokenizer paths, the precision). Data-only changes reuse the cache. A model whose
    architecture its config.json decides (model.architecture null: NxD Training's hf_* files, a Hugging Face
    directory) is named after that file's model_type when it is readable here, else "model"."""
    inputs = stage_inputs(stage_config)
    model = {k: v for k, v in inputs.model_without_data.items() if k != "tokenizer"}  # its path is data too
    shaping = {"model": model, "precision": inputs.precision}
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{inputs.architecture or _config_json_model_type(model) or 'model'}-{digest}"


def _config_json_model_type(model: dict[str, Any]) -> str | None:
    """model_type of the config.json that decides the model (model.model_config, or the Hugging Face directory in
    model.restore_from_path), when it is a readable file here; a name for people, not part of the hash."""
    source = model.get("model_config") or (f"{str(model['restore_from_path']).rstrip('/')}/config.json"
                                            if isinstance(model.get("restore_from_path"), str) else None)
    try:
        model_type = json.loads(Path(str(source)).read_text()).get("model_type") if source else None
    except (OSError, ValueError, AttributeError):
        return None
    return re.sub(r"[^A-Za-z0-9_.]", "_", model_type) if isinstance(model_type, str) and model_type else None


def graph_key(job: Job, compiler_flags: str, cache_url: str) -> str:
    """Names the graphs one training compiles into one cache: everything that changes an HLO graph (the model's
    shape and layout, the optimizer, the sequence length, the precision), the world size (collectives name
    every rank), the compiler flags and target, and the cache itself. Data paths and step counts do not change
    a graph and are left out. Conservative on purpose: a needless compile costs minutes, a wrong skip nothing
    worse (a graph missing from the cache is compiled when training first runs it), but both are avoided."""
    inputs = stage_inputs(job.stage_config)
    model = dict(inputs.model_without_data, seq_length=inputs.seq_length)
    graphs = {"model": model, "precision": inputs.precision, "nodes": job.nodes,
              "workers_per_node": job.nproc_per_node, "compiler_flags": compiler_flags, "cache": cache_url}
    return hashlib.sha256(json.dumps(graphs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def compile_config(job: Job, steps: int) -> dict[str, Any]:
    """The training config, cut to `steps` steps, writing its metrics where they cannot mix with the real
    run's (config.cut_to_steps)."""
    return cut_to_steps(job.stage_config, steps, str(job.results_dir / "compile"))


def torchneuron_env(neuron: dict[str, Any]) -> dict[str, str]:
    """A torchtitan job's environment on Trainium (TorchNeuron, the native PyTorch backend: Trn2 and Trn3; Trn1 has
    none, launcher/titan.py refuses it). What each variable is, and where it comes from:
    - the `neuron` device: nothing to set; torchtitan takes torch's available accelerator (torchtitan/tools/utils.py
      get_device_info), which TorchNeuron registers;
    - NEURON_LOGICAL_NC_CONFIG: the logical NeuronCore config (LNC=2: two physical cores per worker on trn2), the
      Neuron runtime's setting that script() exports for our runtime too, by cluster.neuron.lnc;
    - NEURON_COMPILE_CACHE_URL (exported by the job script's node_main, NeuronScript.cache_url): the Neuron
      persistent compile cache, shared by every node;
    - MALLOC_ARENA_MAX: glibc's, bounding the host memory of many threads per worker (cluster.neuron).
    None of the torch-xla settings (XLA_*, NEURON_CC_FLAGS' precision flags: the precision is torchtitan's
    mixed_precision_param) and no neuron_parallel_compile step: those are torch-xla's."""
    hardware = hardware_of(neuron)
    env = {"MALLOC_ARENA_MAX": str(neuron["malloc_arena_max"])}
    if hardware.logical_cores > 1 or hardware.target == "trn2":
        env["NEURON_LOGICAL_NC_CONFIG"] = str(hardware.logical_cores)
    return env


def script(job: Job, cfg: LaunchConfig) -> NeuronScript | None:
    """The Neuron parts of this job's script, or None when the stage does not run on Neuron."""
    if not runs_on_neuron(job):
        return None
    neuron = settings(cfg.cluster)
    hardware = hardware_of(neuron)
    if job.program[1:2] == (TITAN_PROGRAM,):  # training.runtime=torchtitan (launcher/stages.py)
        return NeuronScript(hardware=neuron["hardware"], env=torchneuron_env(neuron),
                            cache_url=f"{cache_location(cfg)}/{model_key(job.stage_config)}", compile=None,
                            torchneuron=True)
    precision, _ = parse_precision(job.stage_config, f"{job.stage}.")  # validate.py has refused a bad one
    precision_env, precision_flags = PRECISION_ENV[precision.type]

    # trn2 compiles for one logical-core config or the other: said explicitly, 1 included.
    logical = hardware.logical_cores > 1 or hardware.target == "trn2"
    flags = [str(neuron["compiler_flags"] or "").strip(), f"--target={hardware.target}"]
    if logical:
        flags.append(f"--logical-nc-config={hardware.logical_cores}")
    flags.append(precision_flags)

    env: dict[str, str] = {}
    env["MALLOC_ARENA_MAX"] = str(neuron["malloc_arena_max"])
    env["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] = str(neuron["async_exec_max_inflight_requests"])
    if logical:
        env["NEURON_LOGICAL_NC_CONFIG"] = str(hardware.logical_cores)
    env["NEURON_FUSE_SOFTMAX"] = "1"
    env.update(precision_env)
    env["NEURON_CC_FLAGS"] = " ".join(f for f in flags if f)
    env["NXDT_NEURON_HARDWARE"] = estimator_device(neuron)  # runtime/device.py reports peak FLOPs by it

    cache_url = f"{cache_location(cfg)}/{model_key(job.stage_config)}"
    compile_step = None
    if neuron["compile"]["enabled"] and job.stage in TRAINER_STAGES:
        steps = int(neuron["compile"]["steps"])
        key = graph_key(job, env["NEURON_CC_FLAGS"], cache_url)
        # A directory cache holds its markers; one on S3 has them on the shared file system instead, where the
        # job script can look without an S3 client.
        markers = (f"{str(cfg.base_results_dir).rstrip('/')}/{S3_CACHE_MARKERS}" if cache_url.startswith("s3://")
                   else f"{cache_url}/nxdt-compiled")
        compile_step = CompileStep(compile_config(job, steps), job.config_path.with_name(f"{job.stage}_compile_config.yaml"),
                                   marker=f"{markers}/{key}")
    return NeuronScript(hardware=neuron["hardware"], env=env, cache_url=cache_url, compile=compile_step)


def problems(cfg: LaunchConfig) -> list[str]:
    """Mistakes in cluster.neuron, and a training stage whose worker count does not fill the Neuron nodes."""
    given = cfg.cluster.neuron
    if given is None:
        return []
    if not isinstance(given, dict):
        return ["cluster.neuron: must be a mapping (see conf/cluster/pcluster_trn1.yaml)"]
    errors = [f"cluster.neuron.{k}: unknown key; valid keys: {', '.join(NEURON_KEYS)}" for k in given
              if k not in NEURON_KEYS]
    errors += [f"cluster.neuron.compile.{k}: unknown key; valid keys: {', '.join(COMPILE_KEYS)}"
               for k in (given.get("compile") or {}) if k not in COMPILE_KEYS]
    neuron = settings(cfg.cluster)
    if neuron["hardware"] not in HARDWARE:
        return errors + [f"cluster.neuron.hardware: {neuron['hardware']!r} is not one of {', '.join(HARDWARE)}"]
    lnc = neuron["lnc"]
    if lnc is not None and (isinstance(lnc, bool) or not isinstance(lnc, int)):
        errors.append(f"cluster.neuron.lnc: {lnc!r} must be a whole number: 1 or 2 on trn2, or null")
        return errors
    if neuron["hardware"] == "trn2" and lnc not in (None, 1, 2):
        errors.append(f"cluster.neuron.lnc: {lnc!r} must be 1 or 2 (trn2's logical NeuronCore config: 2 gives "
                      f"{TRN2_PHYSICAL_CORES // 2} workers per node, 1 gives {TRN2_PHYSICAL_CORES}), or null for 2")
        return errors
    if neuron["hardware"] != "trn2" and lnc not in (None, 1):
        errors.append(f"cluster.neuron.lnc: {lnc!r}, but {neuron['hardware']} has no logical NeuronCore config "
                      f"(one worker per physical NeuronCore); set it to null")
        return errors
    steps = neuron["compile"]["steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        errors.append(f"cluster.neuron.compile.steps: {steps!r} must be a positive integer, e.g. 10")
    for key in ("open_files", "malloc_arena_max", "async_exec_max_inflight_requests"):
        value = neuron[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            errors.append(f"cluster.neuron.{key}: {value!r} must be a positive integer")
    cache = neuron["compile"]["cache"]
    if cache is not None and not (isinstance(cache, str) and (cache.startswith("/") or cache.startswith("s3://"))):
        errors.append(f"cluster.neuron.compile.cache: {cache!r} must be a directory every node sees, e.g. "
                      "/fsx/neuron-compile-cache, or an s3:// URL (null: <base_results_dir>/neuron-compile-cache)")
    if "\n" in str(neuron["compiler_flags"] or ""):
        errors.append("cluster.neuron.compiler_flags: must be one line of neuronx-cc flags")
    workers = hardware_of(neuron).workers_per_node
    for stage in (s for s in cfg.stages if s in TRAINER_STAGES and s in cfg.sections):
        # The values as given, even where the schema refuses them (it says so beside this line).
        given = cfg.stage(stage).inputs
        if given.accelerator != "neuron":
            errors.append(
                f"{stage}.trainer.accelerator: {given.accelerator!r}, but cluster.neuron.hardware is "
                f"{neuron['hardware']}: its nodes have NeuronCores and no GPUs; drop the override or set "
                f"{stage}.trainer.accelerator=neuron {stage}.trainer.devices={workers} (docs/recipes.md lists each "
                f"recipe's {neuron['hardware']} layout), or choose a GPU cluster (cluster=slurm)")
        elif given.devices != workers:
            lnc = f" (LNC={hardware_of(neuron).logical_cores})" if neuron["hardware"] == "trn2" else ""
            errors.append(
                f"{stage}.trainer.devices: {given.devices!r} workers per node, but {neuron['hardware']}"
                f"{lnc} nodes have {workers} NeuronCores, one worker each; set {stage}.trainer.devices={workers}"
            )
    return errors
