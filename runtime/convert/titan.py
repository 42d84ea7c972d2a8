"""Checkpoints both ways between our runtime and torchtitan 0.3.0 (torch.distributed.checkpoint, DCP).

    python -m runtime.convert to-titan --checkpoint <our checkpoint dir or step_* dir> --folder <titan folder>
        writes <folder>/step-N, which torchtitan's CheckpointManager resumes from (checkpoint.folder=<folder>)
    python -m runtime.convert from-titan --dcp <folder>/step-N --config <training config YAML> --checkpoint-dir <dir>
        writes <dir>/step_0000000N.<token>, which our runtime resumes from under any layout

A torchtitan step-N holds (DCP's flattened keys): its model's state dict (torchtitan's names, q/k/v split:
`layers.N.attention.qkv_linear.wq.weight`...), `optimizer.state.<parameter>.{exp_avg,exp_avg_sq,step}` and
`optimizer.param_groups.<parameter>.<key>` (keyed by parameter, so wqkv's moments are fused), `lr_scheduler.last_epoch`,
`dataloader.consumed_samples` (nxdt's dataloader for torchtitan: contract 3 of the torchtitan work) and
`train_state.{step,ntokens_seen}`. Both directions go through torchtitan's own objects (its model, its optimizer
container and LambdaLR for the param-group keys), so the keys are what its trainer saves and loads. Weights, moments,
the step and the data position are copied bitwise; bf16 runs give their fp32 master weights (torchtitan's parameters
are fp32). Mistakes: one `error:` line, exit 2, nothing written (each output appears whole, renamed into place).
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
from pathlib import Path

import torch
import yaml

from runtime.checkpoint import full_tensors, read_config, read_rank_files, resolve_checkpoint
from runtime.checkpoint.manager import write_full_checkpoint
from runtime.config import parse_model_config
from runtime.convert.hf_layout import state_shapes
from runtime.convert.titan_model import TitanModel, titan_family
from runtime.schema.facts import USER_ERROR_EXIT_CODE
from runtime.titan.shape import OPTIMIZERS

MOMENTS = ("exp_avg", "exp_avg_sq")


def to_titan(location: str, folder: str, implementation: str = "fused") -> Path:
    """Our checkpoint (any layout) -> <folder>/step-N. implementation: the optimizer's, recorded in its param
    groups as torchtitan's trainer records it (its default: fused)."""
    storage, checkpoint = resolve_checkpoint(location)
    where = f"checkpoint {storage.root}/{checkpoint.name}"
    training = read_config(storage, checkpoint)
    model = training.get("model") or {}
    cfg = parse_model_config(model, str((model.get("tokenizer") or {}).get("model")))
    family = titan_family(cfg, where)
    optim = model.get("optim") or {}
    name = str(optim.get("name", "adamw")).lower()
    if name not in OPTIMIZERS:
        raise ValueError(f"{where} was trained with model.optim.name={name}; torchtitan resumes {', '.join(OPTIMIZERS)}"
                         f" only")
    out = Path(folder) / f"step-{checkpoint.step}"
    if out.exists():
        raise ValueError(f"{out} exists; choose another --folder or remove it")
    files = read_rank_files(storage, checkpoint)
    full = full_tensors(files)
    header = next((f for f in files if f.get("rank") == 0), files[0])
    shapes = state_shapes(cfg)
    for n, shape in shapes.items():
        if not full.has(n, "value"):
            raise ValueError(f"{where} lacks {n}: it was saved from a different model than its config.yaml names")
        if tuple(full.full_shape(n)) != tuple(shape):
            raise ValueError(f"{where} holds {n} with shape {tuple(full.full_shape(n))}; its model config implies "
                             f"{tuple(shape)}")
    weights = {n: full.get(n, "master" if full.has(n, "master") else "value").float() for n in shapes}
    titan = TitanModel(cfg, family)
    state = titan.checkpoint_state(weights)
    extra, step_count = header["extra"], int(header["optim_scalars"]["step"])
    consumed = int(extra.get("data", {}).get("consumed_samples", 0))
    if all(full.has(n, key) for n in shapes for key in MOMENTS):
        moments = {key: titan.parameter_state({n: full.get(n, key) for n in shapes}) for key in MOMENTS}
        state["optimizer"] = _optimizer_state(titan, OPTIMIZERS[name], optim, moments, step_count, implementation)
        state["lr_scheduler"] = {"last_epoch": step_count}  # one LambdaLR step per optimizer step
    else:
        print(f"{where} has no optimizer state: step-{checkpoint.step} holds the model only (load it with "
              f"checkpoint.initial_load_path and checkpoint.initial_load_model_only=true)", file=sys.stderr)
    seq = int(model.get("encoder_seq_length") or 0)
    state["dataloader"] = {"consumed_samples": consumed}
    state["train_state"] = {"step": int(extra.get("step", checkpoint.step)), "ntokens_seen": consumed * seq}
    _save_dcp(state, out)
    print(f"converted {where} (step {checkpoint.step}, saved at {checkpoint.layout}) to torchtitan's {out} "
          f"({family})")
    return out


def _optimizer_state(titan: TitanModel, optimizer: str, optim: dict, moments: dict, step: int,
                     implementation: str) -> dict:
    """torchtitan's flattened optimizer state dict, made by its own OptimizersContainer (one catch-all group with our
    hyperparameters, LambdaLR's initial_lr) holding our moments and step."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    kwargs = {"lr": float(optim.get("lr", 1e-3)), "betas": tuple(float(b) for b in optim.get("betas", (0.9, 0.999))),
              "eps": float(optim.get("eps", 1e-8)), "weight_decay": float(optim.get("weight_decay", 0.0))}
    config = OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name=optimizer,
                                                                        optimizer_kwargs=kwargs)],
                                        implementation=implementation)
    container = config.build(model_parts=[titan.model])
    LRSchedulersContainer(container, lambda _: 1.0)  # adds initial_lr to every group, as the trainer's does
    container.state_dict()  # creates the state (a zero step, as torchtitan does before a save or load)
    with torch.no_grad():
        for opt in container.optimizers:
            for group in opt.param_groups:
                for fqn, param in zip(group["param_names"], group["params"]):
                    held = opt.state[param]
                    for key in MOMENTS:
                        held[key].copy_(moments[key][fqn])
                    held["step"].fill_(step)
    return container.state_dict()


def _save_dcp(state: dict, out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{secrets.token_hex(4)}"
    try:
        dcp.save(state, checkpoint_id=str(partial), no_dist=True)
        try:
            os.rename(partial, out)
        except OSError:  # another conversion wrote the same step meanwhile: its files stay, ours go
            raise ValueError(f"{out} appeared while this conversion wrote; choose another --folder or remove it")
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def read_dcp(path: str | Path) -> dict:
    """Every entry of a DCP checkpoint, by its flattened key (tensors whole, other values as saved)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"--dcp {path}: not a torchtitan checkpoint (no DCP .metadata file in it)")
    reader = FileSystemReader(str(path))
    try:
        meta = reader.read_metadata()
        state = {key: torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
                 for key, m in meta.state_dict_metadata.items()}
        dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - a damaged file: several kinds of error
        raise ValueError(f"--dcp {path} cannot be read: {' '.join(str(error).split())[:200]}") from None
    return state


def from_titan(step_dir: str, config_path: str, checkpoint_dir: str, consumed: int | None = None) -> str:
    """torchtitan's <folder>/step-N -> a checkpoint of ours in checkpoint_dir, for the model `config_path` names."""
    try:
        raw = yaml.safe_load(Path(config_path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--config {config_path}: cannot be read ({' '.join(str(error).split())[:160]})") from None
    model = (raw or {}).get("model") or ((raw or {}).get("training") or {}).get("model")
    if not isinstance(model, dict):
        raise ValueError(f"--config {config_path}: has no model section (model: or training.model:)")
    cfg = parse_model_config(model, str((model.get("tokenizer") or {}).get("model")))
    family = titan_family(cfg, f"--config {config_path}")
    flat = read_dcp(step_dir)
    titan = TitanModel(cfg, family)
    for key, shape in titan.state_keys().items():
        if key not in flat:
            raise ValueError(f"--dcp {step_dir} lacks {key}: it was saved from another model than --config names")
        if tuple(flat[key].shape) != tuple(shape):
            raise ValueError(f"--dcp {step_dir} holds {key} with shape {tuple(flat[key].shape)}; the model of "
                             f"--config implies {tuple(shape)}")
    weights = titan.to_ours({key: flat[key] for key in titan.state_keys()})
    params = [name for name, _ in titan.model.named_parameters()]
    moments, step_count = {}, 0
    if all(f"optimizer.state.{p}.{key}" in flat for p in params for key in MOMENTS):
        moments = {key: titan.from_parameter_state({p: flat[f"optimizer.state.{p}.{key}"] for p in params})
                   for key in MOMENTS}
        step_count = int(flat[f"optimizer.state.{params[0]}.step"])
    if consumed is None:
        if "dataloader.consumed_samples" not in flat:
            raise ValueError(f"--dcp {step_dir} has no dataloader.consumed_samples (nxdt's dataloader for torchtitan "
                             f"writes it): give the data position with --consumed-samples N")
        consumed = int(flat["dataloader.consumed_samples"])
    step = int(flat.get("train_state.step", step_count))
    location = write_full_checkpoint(checkpoint_dir, step, weights, moments=moments, step_count=step_count,
                                     extra={"step": step, "data": {"consumed_samples": consumed}},
                                     config={"model": model, "imported_from": str(step_dir)}, source="torchtitan")
    print(f"converted torchtitan's {step_dir} ({family}, step {step}) to {location}; resume from it with "
          f"training.exp_manager.resume_from_checkpoint={location}")
    return location


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.convert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    to = sub.add_parser("to-titan", help="our checkpoint -> torchtitan's <folder>/step-N")
    to.add_argument("--checkpoint", required=True, help="our checkpoint directory (its newest) or a step_* directory")
    to.add_argument("--folder", required=True, help="torchtitan's checkpoint.folder: step-N is written in it")
    to.add_argument("--implementation", default="fused", choices=("fused", "foreach", "for-loop"),
                    help="torchtitan's optimizer.implementation, which its param groups record (default: fused)")
    back = sub.add_parser("from-titan", help="torchtitan's <folder>/step-N -> our checkpoint")
    back.add_argument("--dcp", required=True, help="torchtitan's step-N directory")
    back.add_argument("--config", required=True, help="the training config YAML whose model: section it was")
    back.add_argument("--checkpoint-dir", required=True, help="where our checkpoint's step_* directory is written")
    back.add_argument("--consumed-samples", type=int, default=None,
                      help="the data position, for a checkpoint without dataloader.consumed_samples")
    args = parser.parse_args(argv)
    try:
        if args.direction == "to-titan":
            to_titan(args.checkpoint, args.folder, args.implementation)
        else:
            from_titan(args.dcp, args.config, args.checkpoint_dir, args.consumed_samples)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    return 0
