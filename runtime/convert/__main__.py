"""The conversion stage: `python -m runtime.convert --config <conversion_config.yaml>`.

mode: export   merge a runtime checkpoint saved under any tp x pp x dp (x ZeRO-1) layout into a Hugging Face
               model directory (config.json, safetensors, tokenizer files; optionally the Adam moments under
               HF names in optimizer/), which transformers' from_pretrained loads. A LoRA run's checkpoint
               (adapters only) is joined to its base (model.restore_from_path) by conversion.lora: merged
               (adapters folded into the weights), adapter (the base plus a PEFT adapter in adapter/) or both
               (the merged model, with base/ and adapter/ beside it).
mode: import   read a Hugging Face GPT-2 or Llama directory and write a runtime checkpoint (weights only) that
               training resumes from under any layout (training.exp_manager.resume_from_checkpoint=<it>).

Mistakes end with one `error: ...` line and exit code 2; a full disk (or quota, or file-size limit) with one line and
exit code 1, nothing half-written left behind.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import yaml

from runtime.checkpoint import (full_tensors, ranged_full_tensors, read_config, read_rank_files, resolve_checkpoint,
                                write_full_checkpoint)
from runtime.checkpoint.shards import TIED
from runtime.config import parse_model_config, tokenizer_vocab_size
from runtime.convert.hf import load_hf_directory, save_hf_directory, state_shapes, to_hf
from runtime.convert.peft import ADAPTER_DIR, adapters, check_peft_exportable, load_base, lora_of, save_adapter, \
    to_peft
from runtime.convert.reward import is_reward_model, save_reward_hf_directory
from runtime.io import ownership
from runtime.io.files import no_room, no_room_line
from runtime.alignment.reward import reward_config
from runtime.models import ModelConfig
from runtime.models.lora import merge_lora
from runtime.schema.conversion import ConversionConfig, parse_conversion
from runtime.schema.facts import USER_ERROR_EXIT_CODE
from runtime.schema.training_config import LoraConfig

# Written into every exported directory: what it was exported from, so that running the stage again knows
# its own output (same checkpoint and settings: nothing to do; an older export of ours: replaced) from files
# someone else put there (kept unless conversion.overwrite=true).
PROVENANCE = "nxdt_export.json"


def export(cfg: ConversionConfig) -> Path:
    storage, checkpoint = resolve_checkpoint(cfg.checkpoint_dir, cfg.checkpoint_name)
    training = read_config(storage, checkpoint)
    tokenizer = cfg.tokenizer_model or training["model"]["tokenizer"]["model"]
    source = {"checkpoint": f"{storage.root}/{checkpoint.name}", "step": checkpoint.step,
              "files": checkpoint.meta.get("files"), "include_optimizer": cfg.include_optimizer,
              "tokenizer": str(tokenizer)}
    where = f"checkpoint {storage.root}/{checkpoint.name}"
    lora = lora_of(training, where)
    if is_reward_model(training) and (lora is not None or cfg.include_optimizer):
        raise ValueError(f"{where} is a reward model's (the rlhf_rm stage's): its export is the merged "
                         f"sequence-classification model only; set conversion.lora=merged and "
                         f"conversion.include_optimizer=false" + (" (a LoRA reward model's export is not built: "
                                                                  "train it without model.peft)" if lora else ""))
    if lora is None and cfg.lora != "merged":
        raise ValueError(f"conversion.lora={cfg.lora}: {where} is not a LoRA run's (its config.yaml has no "
                         f"model.peft.peft_scheme lora), so it has no adapter to export; set conversion.lora=merged")
    if lora is not None:  # the base and the export's form are part of what was exported
        source.update(lora=cfg.lora, restore_from_path=training["model"].get("restore_from_path"))
    out = Path(cfg.output_dir)
    previous = _provenance(out)
    if previous == source:
        print(f"conversion: {out} already holds {source['checkpoint']} (step {checkpoint.step}) exported with "
              f"these settings; nothing to do")
        return out
    if not cfg.overwrite and previous is None and out.is_dir() and any(out.iterdir()):
        raise ValueError(f"conversion.output_dir {str(out)!r} holds files this stage did not export; set "
                         f"conversion.overwrite=true to replace them, or choose another conversion.output_dir")
    if out.is_dir() and any(out.iterdir()):  # replaced below: never a directory that holds what must stay
        inputs = [source["checkpoint"], str(tokenizer), *([str(source["restore_from_path"])]
                                                            if source.get("restore_from_path") else [])]
        if problem := ownership.overwrite_problem("conversion.output_dir", out, inputs):
            raise ValueError(problem)
    model_cfg = parse_model_config(training["model"], str(tokenizer))
    if lora is not None:
        lora = lora_of(training, where, model_cfg)  # its targets as this model names them
        _export_lora(cfg, lora, training, model_cfg, storage, checkpoint, source, str(tokenizer), where)
        print(f"exported the LoRA run's {where} (step {checkpoint.step}, conversion.lora={cfg.lora}) to {out}"
              + (f" (replacing the export of {previous['checkpoint']})" if previous else ""))
        return out
    with ranged_full_tensors(storage, checkpoint) as full:  # each tensor read by ranges when the writer asks
        head = tuple(full.full_shape("output.weight", "value")) if full.has("output.weight", "value") else None
        reward = is_reward_model(training, head, model_cfg.hidden_size)  # the rlhf_rm stage's score head
        if reward:
            model_cfg = reward_config(model_cfg)  # its head is a weight of its own
        names = set(state_shapes(model_cfg))
        tied = model_cfg.share_embeddings_and_output_weights
        missing = sorted(n for n in names if not full.has(n, "value") and not (tied and n in TIED))
        if missing:
            raise ValueError(f"checkpoint {storage.root}/{checkpoint.name} lacks {', '.join(missing[:3])}: it was "
                             f"saved from a different model")
        state = _Weights(full, sorted(n for n in names if full.has(n, "value")))

        def finish(directory: Path) -> None:
            if cfg.include_optimizer:
                _export_moments(full, names, model_cfg, directory)
            (directory / PROVENANCE).write_text(json.dumps(source, indent=2) + "\n")

        if reward:
            save_reward_hf_directory(out, state, model_cfg, str(tokenizer), overwrite=True, also=finish)
        else:
            save_hf_directory(out, state, model_cfg, str(tokenizer), overwrite=True, also=finish)
    replaced = f" (replacing the export of {previous['checkpoint']})" if previous else ""
    print(f"exported {storage.root}/{checkpoint.name} (step {checkpoint.step}, saved at {checkpoint.layout}) "
          f"to {out}{replaced}")
    return out


def _export_lora(cfg: ConversionConfig, lora: LoraConfig, training: dict, model_cfg: ModelConfig, storage,
                 checkpoint, source: dict, tokenizer: str, where: str) -> None:
    """A LoRA run's checkpoint (adapters only) + its base (model.restore_from_path), as conversion.lora asks:
    merged: output_dir is the base with W += scale * B A folded in; adapter: output_dir is the base and
    output_dir/adapter the PEFT adapter; both: output_dir is merged, with base/ and adapter/ inside."""
    if cfg.lora != "merged":
        check_peft_exportable(model_cfg)
    elif cfg.include_optimizer:
        raise ValueError("conversion.include_optimizer=true: a LoRA run's optimizer state covers its adapters "
                         "only, which a merged export does not keep; set conversion.lora=adapter or both")
    full = full_tensors(read_rank_files(storage, checkpoint))
    trained = adapters({n: full.get(n, "value") for n in full.names() if full.has(n, "value")}, model_cfg, lora)
    base = load_base(training, model_cfg, where)
    out = Path(cfg.output_dir).absolute()

    def write_adapter(directory: Path, base_dir: Path) -> None:
        state, config = to_peft(trained, model_cfg, lora, base_model_name_or_path=str(base_dir))
        moments = {}
        if cfg.include_optimizer:
            found = {key: {n: full.get(n, key) for n in trained if full.has(n, key)}
                     for key in ("exp_avg", "exp_avg_sq")}
            moments = {key: to_peft(m, model_cfg, lora)[0] for key, m in found.items() if m}
            if not moments:
                print("the checkpoint has no optimizer state; exported the adapter only", file=sys.stderr)
        save_adapter(directory / ADAPTER_DIR, state, config, moments)

    def finish(directory: Path) -> None:
        if cfg.lora == "adapter":
            write_adapter(directory, out)
        elif cfg.lora == "both":
            save_hf_directory(directory / "base", base, model_cfg, tokenizer)
            write_adapter(directory, out / "base")
        (directory / PROVENANCE).write_text(json.dumps(source, indent=2) + "\n")

    weights = base if cfg.lora == "adapter" else merge_lora({**base, **trained}, model_cfg, lora.scale)
    save_hf_directory(out, weights, model_cfg, tokenizer, overwrite=True, also=finish)


class _Weights(Mapping):
    """A checkpoint's full weights under our names, each read (by byte ranges) when it is asked for: the export
    reads each once, so it holds one full tensor at a time, never the model (the optional Adam moments,
    conversion.include_optimizer, are still gathered whole by _export_moments)."""

    def __init__(self, full, names: list[str]):
        self._full, self._names = full, names
        self.dtype = full.dtype("embed.word.weight", "value")

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._full.get(name, "value")

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _provenance(out: Path) -> dict | None:
    """What an earlier run of this stage exported into `out`, or None when it did not write it."""
    try:
        found = json.loads((out / PROVENANCE).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _export_moments(full, names: set[str], model_cfg: ModelConfig, out: Path) -> None:
    """Adam moments under the HF parameter names: the same mapping as the weights (same shapes)."""
    from safetensors.torch import save_file

    (out / "optimizer").mkdir(exist_ok=True)
    for key in ("exp_avg", "exp_avg_sq"):
        moments = {n: full.get(n, key) for n in names if full.has(n, key)}
        if not moments:
            print("the checkpoint has no optimizer state; exported the weights only", file=sys.stderr)
            return
        hf_moments, _ = to_hf(moments, model_cfg)
        save_file(hf_moments, str(out / "optimizer" / f"{key}.safetensors"))


def import_hf(cfg: ConversionConfig) -> str:
    source = cfg.hf_checkpoint_dir
    try:
        state, keys, tokenizer = load_hf_directory(source)
    except ValueError as error:  # main() prints it as one line; the key tells the user what to change
        raise ValueError(f"conversion.hf_checkpoint_dir: {error}") from None
    vocab = tokenizer_vocab_size(tokenizer) if tokenizer else None
    # The model section a training recipe needs to continue from these weights.
    model = {**keys, "tokenizer": {"library": "huggingface", "model": tokenizer}}
    if vocab:
        ModelConfig.from_model_section(keys, vocab)  # the padded vocabulary must come out at HF's size
    location = write_full_checkpoint(cfg.checkpoint_dir, 0, state,
                                     config={"model": model, "imported_from": str(source)})
    overrides = " ".join(f"training.model.{k}={v}" for k, v in _flat(keys).items() if v is not None)
    print(f"imported {source} to {location}\ncontinue training from it with "
          f"training.exp_manager.resume_from_checkpoint={location} and the model keys: {overrides}")
    return location


def _flat(keys: dict, prefix: str = "") -> dict:
    """{"moe": {"top_k": 2}} -> {"moe.top_k": 2}: each value one override."""
    flat = {}
    for key, value in keys.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["to-titan"], ["from-titan"]):  # checkpoints both ways with torchtitan (runtime/convert/titan.py)
        from runtime.convert.titan import main as titan_main

        return titan_main(argv)
    parser = argparse.ArgumentParser(prog="python -m runtime.convert", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the resolved conversion-stage YAML the launcher wrote")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        cfg, report = parse_conversion(yaml.safe_load(Path(args.config).read_text()))
        report.raise_if_any()
        export(cfg) if cfg.mode == "export" else import_hf(cfg)
    except (ValueError, FileNotFoundError) as error:
        for line in getattr(error, "problems", None) or [" ".join(str(error).split())]:
            print(f"error: {line}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    except OSError as error:
        if not no_room(error):
            raise
        # save_hf_directory and write_full_checkpoint removed what they had begun: the output appears whole or not.
        key = "output_dir" if cfg.mode == "export" else "checkpoint_dir"
        print(f"error: {no_room_line(error, f'conversion.{key}', getattr(cfg, key))}", file=sys.stderr, flush=True)
        return 1
    print(f"conversion done in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
