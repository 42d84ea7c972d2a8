"""`nxdt-launch cluster-config [OVERRIDES...]`: an AWS ParallelCluster 3 cluster for Trainium training.

    nxdt-launch cluster-config subnet_id=subnet-0abc node_setup.script_s3_uri=s3://my-bucket/nxdt/on_node.sh
    nxdt-launch cluster-config instance=trn2 queue.max_count=16 ssh_key_name=my-key ...

Writes <output-dir>/<cluster_name>.yaml (checked with ParallelCluster's own schema first; nothing is written
if it fails) and <output-dir>/on_node_configured.sh, and prints the commands that create the cluster.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import click

from launcher.errors import UserError


# Both files say who wrote them (the node script's template carries the same words): a rerun overwrites its own
# output, never a file of the user's that happens to have the same name.
MARK = "rendered by nxdt-launch cluster-config"
CLUSTER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9-]{0,59}")


def _not_ours(path: Path) -> str | None:
    """Why `path` must not be overwritten, or None when it is absent or a file this command wrote."""
    if not os.path.lexists(path):
        return None
    if not path.is_file() or path.is_symlink():
        return "exists and is not a plain file"
    try:
        with open(path, "rb") as f:
            head = f.read(1024).decode("utf-8", "replace")
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    if MARK not in head.replace("`", ""):
        return "exists and was not written by nxdt-launch cluster-config"
    if not os.access(path, os.W_OK):
        return "is not writable"
    return None


@click.command(context_settings={"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]})
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@click.option("--output-dir", "-o", type=click.Path(path_type=Path), default=Path("pcluster"), show_default=True,
              help="Where the cluster YAML and the node script are written.")
@click.option("--no-validate", is_flag=True, help="Skip ParallelCluster's schema check (it needs aws-parallelcluster).")
def command(overrides: tuple[str, ...], output_dir: Path, no_validate: bool) -> None:
    """Render an AWS ParallelCluster 3 cluster config (conf/pcluster/) and check it with ParallelCluster's schema.

    \b
    OVERRIDES are Hydra overrides of conf/pcluster/config.yaml, e.g.
      instance=trn1|trn1n|trn2  subnet_id=subnet-...  queue.max_count=8  os=ubuntu2204  custom_ami=ami-...
    """
    import yaml

    from launcher import pcluster
    from launcher.launch import output_problems

    if errors := output_problems([("--output-dir", output_dir)]):
        raise UserError(*errors)
    config, script, cfg = pcluster.render(list(overrides), validate=not no_validate)
    name = str(cfg["cluster_name"])
    if not CLUSTER_NAME.fullmatch(name):  # it names the file too: no '/' or '..' may reach the path
        raise UserError(f"cluster_name: {name!r} must start with a letter and hold only letters, digits and '-', "
                        "at most 60 characters (ParallelCluster's rule); e.g. cluster_name=nxdt-trn1")
    config_path = output_dir / f"{name}.yaml"
    script_path = output_dir / "on_node_configured.sh"
    for path in (config_path, script_path):
        if problem := _not_ours(path):
            raise UserError(f"--output-dir: {path} {problem}; choose another --output-dir, or move the file aside")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        config_path.write_text(f"# AWS ParallelCluster {pcluster.PCLUSTER_VERSION} cluster config, {MARK}.\n"
                               + yaml.safe_dump(config, sort_keys=False))
        script_path.write_text(script)
        script_path.chmod(0o755)
    except OSError as error:
        raise UserError(f"--output-dir: {error.filename or output_dir} cannot be written ({error.strerror or error}); "
                        "choose another --output-dir") from None
    checked = "not checked (--no-validate)" if no_validate else f"passes ParallelCluster {pcluster.PCLUSTER_VERSION}'s schema"
    click.echo(f"wrote {config_path} ({checked}) and {script_path}")
    q = shlex.quote  # every value printed into a command: copied and pasted, it runs as shown
    click.echo("next:")
    click.echo(f"  aws s3 cp {q(str(script_path))} {q(cfg['node_setup']['script_s3_uri'])}")
    click.echo(f"  pcluster create-cluster --cluster-name {q(name)} --cluster-configuration {q(str(config_path))} "
               f"--region {q(str(cfg['region']))}")
    click.echo(f"then, on the head node: nxdt-launch {q('cluster=pcluster_' + str(cfg['instance']['queue_name']))} "
               "...  (docs/parallelcluster.md)")
