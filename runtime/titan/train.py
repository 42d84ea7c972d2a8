"""Train with torchtitan from a job module that launcher/titan_module.py rendered:

    torchrun --nproc-per-node 2 -m runtime.titan.train --job results/launch/training_titan_job.py
    torchrun --nproc-per-node 2 -m runtime.titan.train --job job.py --training.steps 20 --dataloader.steps 20

The module is imported from its path and handed to torchtitan's own entry point (torchtitan/train.py main()) as
`--module <it> --config nxdt_job`; every other argument is torchtitan's (tyro flags `--section.key value`). The
dataloader sizes its sample index (hence the shuffle) by dataloader.steps and dataloader.global_batch_size: change
them with training.steps and training.global_batch_size, or the samples are not our runtime's.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from runtime.schema.facts import USER_ERROR_EXIT_CODE

JOB_MODULE = "nxdt_titan_job"  # the name the job module is imported under; torchtitan's ConfigManager finds it so
INSTALL = "pip install 'nxdt-launch[torchtitan]'"


def load_job(path: str | Path, name: str = JOB_MODULE):
    """Import the job module at `path` as `name` (in sys.modules, where torchtitan's ConfigManager looks it up)."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--job: {path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, "nxdt_job", None)):
        raise ValueError(f"--job: {path} defines no nxdt_job(); render it with launcher/titan_module.py")
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.titan.train", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", required=True, help="the job module (training_titan_job.py in the launch dir)")
    args, overrides = parser.parse_known_args(argv)
    if not Path(args.job).is_file():
        print(f"runtime.titan.train: --job: no file {args.job}; launch the training stage to render it",
              file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    try:
        import torchtitan.train
    except ImportError as error:
        print(f"runtime.titan.train: torchtitan cannot be imported ({error}); {INSTALL}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    try:
        load_job(args.job)
    except ValueError as error:
        print(f"runtime.titan.train: {error}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    # torchtitan's main() reads sys.argv (its ConfigManager parses --module/--config and the tyro overrides).
    sys.argv = [sys.argv[0], "--module", JOB_MODULE, "--config", "nxdt_job", *overrides]
    torchtitan.train.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
