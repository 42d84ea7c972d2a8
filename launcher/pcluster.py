"""`nxdt-launch cluster-config`: compose conf/pcluster/ (Hydra, as a launch composes conf/), turn it into an AWS
ParallelCluster 3 cluster YAML and the node script it runs, and check the YAML with ParallelCluster's own
schema: `pcluster.schemas.cluster_schema.ClusterSchema(...).load(...)`, offline.

aws-parallelcluster pins older versions of packages this project uses (attrs, packaging), so it usually lives
in its own venv (.venv-pcluster, or NXDT_PCLUSTER_PYTHON); the check runs in that interpreter, in a
subprocess, with no AWS credentials, instance metadata turned off, every AWS API call refused and every
non-loopback connection refused: the marshmallow schema and the config objects it builds need none of them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from launcher.errors import UserError
from launcher.paths import REPO_ROOT, conf_dir
from runtime.schema import rules

PCLUSTER_VERSION = "3.16.1"
INSTALL_HINT = (f"python3 -m venv .venv-pcluster && .venv-pcluster/bin/pip install aws-parallelcluster=={PCLUSTER_VERSION}"
                " (or set NXDT_PCLUSTER_PYTHON to an interpreter that has it; --no-validate skips the check)")
OPEN_MAPS = ("extra.",)

# Where a rendered ParallelCluster key comes from, to name the config key a schema error is about.
SOURCES = {
    "Region": "region", "Image.Os": "os", "Image.CustomAmi": "custom_ami",
    "HeadNode.InstanceType": "head_node.instance_type", "HeadNode.Networking.SubnetId": "head_node.subnet_id",
    "HeadNode.Ssh.KeyName": "ssh_key_name",
    "Scheduling.SlurmQueues[0].Name": "queue.name",
    "Scheduling.SlurmQueues[0].CapacityType": "queue.capacity_type",
    "Scheduling.SlurmQueues[0].ComputeResources[0].InstanceType": "queue.instance_type",
    "Scheduling.SlurmQueues[0].ComputeResources[0].MinCount": "queue.min_count",
    "Scheduling.SlurmQueues[0].ComputeResources[0].MaxCount": "queue.max_count",
    "Scheduling.SlurmQueues[0].Networking.SubnetIds": "queue.subnet_id",
    "SharedStorage[0].FsxLustreSettings.StorageCapacity": "fsx.storage_capacity_gb",
    "SharedStorage[0].FsxLustreSettings.DeploymentType": "fsx.deployment_type",
    "SharedStorage[0].FsxLustreSettings.PerUnitStorageThroughput": "fsx.throughput_mb_per_tib",
}


def compose(overrides: list[str]) -> dict[str, Any]:
    """conf/pcluster/config.yaml with these overrides, resolved; mistakes as one-line UserErrors."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from launcher.compose import check_overrides

    root = conf_dir() / "pcluster"
    check_overrides(overrides, ("instance",), lambda group: sorted(p.stem for p in (root / group).glob("*.yaml")))
    typed = [("++" + o if o.startswith(OPEN_MAPS) and "=" in o else o) for o in overrides]
    try:
        with initialize_config_dir(str(root), version_base=None, job_name="nxdt_cluster_config"):
            cfg = hydra_compose("config", overrides=typed)
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OverrideParseException as e:
        raise UserError(f"cluster-config: {str(e).splitlines()[0]}; quote values with spaces: key='value'") from None
    except MissingConfigException:
        choices = ", ".join(sorted(p.stem for p in (root / "instance").glob("*.yaml")))
        bad = next((o for o in overrides if o.startswith("instance=")), "instance")
        raise UserError(f"{bad}: no such choice; valid choices: {choices}") from None
    except ConfigCompositionException as e:
        cause = e.__cause__
        key = getattr(cause, "full_key", None)
        parent = getattr(cause, "parent_node", None)
        if key and parent is not None and hasattr(parent, "keys"):
            valid = ", ".join(sorted(str(k) for k in parent.keys() if k != "hydra"))
            raise UserError(f"unknown key {key!r}: valid keys there: {valid} (ParallelCluster keys this file does "
                            f"not name go under extra, e.g. extra.Monitoring.DetailedMonitoring=true)") from None
        raise UserError(f"cluster-config: {str(e).splitlines()[0]}") from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise UserError(f"{key}: {str(e).splitlines()[0]}; set it, e.g. {key}=...") from None
    resolved.pop("hydra", None)
    if not isinstance(resolved.get("extra") or {}, dict):
        raise UserError(f"extra: {resolved['extra']!r} must be a mapping of ParallelCluster keys; set them one at a "
                        "time, e.g. extra.Monitoring.DetailedMonitoring=true")
    return resolved


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def _bucket(uri: str) -> str:
    return uri[len("s3://"):].split("/", 1)[0] if str(uri).startswith("s3://") else ""


def cluster_yaml(cfg: dict[str, Any]) -> dict[str, Any]:
    """ParallelCluster 3's cluster configuration, as a dict in its own key names."""
    head, queue, fsx, setup = cfg["head_node"], cfg["queue"], cfg["fsx"], cfg["node_setup"]
    script_bucket = _bucket(setup["script_s3_uri"])
    s3_access = [{"BucketName": script_bucket, "EnableWriteAccess": False}] if script_bucket else []
    s3_access += [{"BucketName": b, "EnableWriteAccess": True} for b in cfg.get("s3_access") or [] if b != script_bucket]

    def action(role: str) -> dict[str, Any]:
        return {"OnNodeConfigured": {"Script": setup["script_s3_uri"], "Args": [role]}}

    image: dict[str, Any] = {"Os": cfg["os"]}
    if cfg.get("custom_ami"):
        image["CustomAmi"] = cfg["custom_ami"]
    head_node: dict[str, Any] = {
        "InstanceType": head["instance_type"],
        "Networking": {"SubnetId": head["subnet_id"]},
        "LocalStorage": {"RootVolume": {"Size": head["root_volume_gb"]}},
        "CustomActions": action("head"),
    }
    if cfg.get("ssh_key_name"):
        head_node["Ssh"] = {"KeyName": cfg["ssh_key_name"]}
    if s3_access:
        head_node["Iam"] = {"S3Access": [dict(a) for a in s3_access]}
    resource: dict[str, Any] = {
        "Name": str(queue["instance_type"]).replace(".", "-"),
        "InstanceType": queue["instance_type"],
        "MinCount": queue["min_count"],
        "MaxCount": queue["max_count"],
        "Efa": {"Enabled": True},
    }
    if queue.get("capacity_reservation_id"):
        resource["CapacityReservationTarget"] = {"CapacityReservationId": queue["capacity_reservation_id"]}
    slurm_queue: dict[str, Any] = {
        "Name": queue["name"],
        "CapacityType": queue["capacity_type"],
        "ComputeSettings": {"LocalStorage": {"RootVolume": {"Size": queue["root_volume_gb"]}}},
        "ComputeResources": [resource],
        "Networking": {"SubnetIds": [queue["subnet_id"]], "PlacementGroup": {"Enabled": bool(queue["placement_group"])}},
        "CustomActions": action("compute"),
    }
    if s3_access:
        slurm_queue["Iam"] = {"S3Access": [dict(a) for a in s3_access]}
    if fsx.get("file_system_id"):
        lustre: dict[str, Any] = {"FileSystemId": fsx["file_system_id"]}
    else:
        lustre = {"StorageCapacity": fsx["storage_capacity_gb"], "DeploymentType": fsx["deployment_type"],
                  "PerUnitStorageThroughput": fsx["throughput_mb_per_tib"]}
    config = {
        "Region": cfg["region"],
        "Image": image,
        "HeadNode": head_node,
        "Scheduling": {"Scheduler": "slurm", "SlurmQueues": [slurm_queue]},
        "SharedStorage": [{"MountDir": fsx["mount_dir"], "Name": "fsx", "StorageType": "FsxLustre",
                           "FsxLustreSettings": lustre}],
    }
    return _merge(config, cfg.get("extra") or {})


def node_script(cfg: dict[str, Any]) -> str:
    """The OnNodeConfigured script, from templates/pcluster/on_node_configured.sh.j2."""
    from launcher.render import _environment

    template = _environment().get_template("pcluster/on_node_configured.sh.j2")
    return template.render(setup=cfg["node_setup"], instance=cfg["instance"], cluster_name=cfg["cluster_name"])


def find_python() -> str | None:
    """An interpreter that has aws-parallelcluster: NXDT_PCLUSTER_PYTHON, this one, or a .venv-pcluster."""
    if os.environ.get("NXDT_PCLUSTER_PYTHON"):
        return os.environ["NXDT_PCLUSTER_PYTHON"]
    if importlib.util.find_spec("pcluster") is not None:
        return sys.executable
    for root in (Path.cwd(), REPO_ROOT):
        candidate = root / ".venv-pcluster" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return None


# Runs in the aws-parallelcluster interpreter: reads the config as JSON on stdin, prints the schema's verdict.
_SCHEMA_CHECK = r"""
import json, socket, sys

def _refuse(self, address, *args):
    host = address[0] if isinstance(address, tuple) else str(address)
    if host not in ("127.0.0.1", "::1", "localhost") and not str(address).startswith("/"):
        raise OSError("nxdt cluster-config validates offline: no connection to %s" % (address,))
    return _connect(self, address, *args)

_connect = socket.socket.connect
socket.socket.connect = _refuse

import botocore.client
import botocore.exceptions
skipped = []

def _no_aws(self, operation, params):
    skipped.append(operation)
    raise botocore.exceptions.EndpointConnectionError(endpoint_url="(offline schema check)")

botocore.client.BaseClient._make_api_call = _no_aws

from marshmallow import ValidationError
from pcluster.schemas.cluster_schema import ClusterSchema

config = json.load(sys.stdin)
try:
    ClusterSchema(cluster_name=sys.argv[1]).load(config)
    messages = None
except ValidationError as error:
    messages = error.messages
print(json.dumps({"errors": messages, "skipped_aws_calls": sorted(set(skipped))}))
"""


def _flatten(messages: Any, path: str = "") -> list[tuple[str, str]]:
    """marshmallow's nested messages -> (Key.Path[0].Leaf, message) pairs."""
    if isinstance(messages, dict):
        found = []
        for key, value in messages.items():
            if key == "_schema":
                found += _flatten(value, path)
            elif isinstance(key, int) or str(key).isdigit():
                found += _flatten(value, f"{path}[{key}]")
            else:
                found += _flatten(value, f"{path}.{key}" if path else str(key))
        return found
    if isinstance(messages, list):
        return [pair for item in messages for pair in _flatten(item, path)]
    return [(path or "(config)", str(messages))]


def _value(cfg: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
    return cfg


def schema_check(config: dict[str, Any], cluster_name: str, python: str) -> dict[str, Any]:
    """ParallelCluster's verdict: {"errors": marshmallow messages or None, "skipped_aws_calls": [...]}, the
    AWS operations the config objects tried during the load and were refused (none, for configs without
    capacity reservations)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_DEFAULT_REGION=str(config.get("Region") or "us-east-1"), AWS_EC2_METADATA_DISABLED="true",
               AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_CONFIG_FILE=os.devnull)
    try:
        result = subprocess.run([python, "-c", _SCHEMA_CHECK, cluster_name], input=json.dumps(config), env=env,
                                capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"cluster-config: cannot run the ParallelCluster schema check with {python}: {e}") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        raise UserError(f"cluster-config: the ParallelCluster schema check failed in {python}: {last}; "
                        f"install it with {INSTALL_HINT}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def schema_errors(config: dict[str, Any], cluster_name: str, python: str,
                  cfg: dict[str, Any] | None = None) -> list[str]:
    """One line per key ParallelCluster's schema rejects, naming the config key it came from; [] when it
    accepts the config."""
    verdict = schema_check(config, cluster_name, python)
    lines = []
    for key, message in _flatten(verdict["errors"] or {}):
        source = SOURCES.get(key)
        where = f" (from {source}={_value(cfg or {}, source)})" if source else ""
        lines.append(f"ParallelCluster schema: {key}{where}: {message}")
    return lines


def s3_problems(cfg: dict[str, Any]) -> list[str]:
    """The node script's S3 URI and the buckets of s3_access, by the schema's S3 rules (a newline or a `$(...)` in
    them would reach the YAML and the commands printed after it)."""
    problems = [rules.s3_uri(cfg["node_setup"]["script_s3_uri"], "node_setup.script_s3_uri")]
    buckets = cfg.get("s3_access") or []
    problems += [rules.s3_bucket(b, "s3_access") for b in (buckets if isinstance(buckets, list) else [buckets])]
    return [p for p in problems if p]


def render(overrides: list[str], *, validate: bool = True) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(cluster YAML as a dict, node script, composed config); UserError if the schema refuses the YAML."""
    cfg = compose(overrides)
    if errors := s3_problems(cfg):
        raise UserError(*errors)
    config = cluster_yaml(cfg)
    if validate:
        python = find_python()
        if python is None:
            raise UserError(f"cluster-config checks the config with aws-parallelcluster's schema, which is not "
                            f"installed: {INSTALL_HINT}")
        errors = schema_errors(config, str(cfg["cluster_name"]), python, cfg)
        if errors:
            raise UserError(*errors)
    return config, node_script(cfg), cfg
