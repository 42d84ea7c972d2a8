"""`nxdt-launch cluster-config [OVERRIDES...]`: an AWS ParallelCluster 3 cluster for Trainium training.

    nxdt-launch cluster-config subnet_id=subnet-0abc node_setup.script_s3_uri=s3://my-bucket/nxdt/on_node.sh
    nxdt-launch cluster-config instance=trn2 queue.max_count=16 ssh_key_name=my-key ...

Writes <output-dir>/<cluster_name>.yaml (checked with ParallelCluster's own schema first; nothing is written
if it fails) and <output-dir>/on_node_configured.sh, and prints the commands that create the cluster.
"""

from __future__ import annotations

from pathlib import Path

import click


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

    config, script, cfg = pcluster.render(list(overrides), validate=not no_validate)
    output_dir.mkdir(parents=True, exist_ok=True)
    config_path = output_dir / f"{cfg['cluster_name']}.yaml"
    script_path = output_dir / "on_node_configured.sh"
    config_path.write_text(f"# AWS ParallelCluster {pcluster.PCLUSTER_VERSION} cluster config, rendered by "
                           f"nxdt-launch cluster-config.\n" + yaml.safe_dump(config, sort_keys=False))
    script_path.write_text(script)
    script_path.chmod(0o755)
    checked = "not checked (--no-validate)" if no_validate else f"passes ParallelCluster {pcluster.PCLUSTER_VERSION}'s schema"
    click.echo(f"wrote {config_path} ({checked}) and {script_path}")
    click.echo("next:")
    click.echo(f"  aws s3 cp {script_path} {cfg['node_setup']['script_s3_uri']}")
    click.echo(f"  pcluster create-cluster --cluster-name {cfg['cluster_name']} --cluster-configuration {config_path} "
               f"--region {cfg['region']}")
    click.echo(f"then, on the head node: nxdt-launch cluster=pcluster_{cfg['instance']['queue_name']} ...  "
               "(docs/parallelcluster.md)")
