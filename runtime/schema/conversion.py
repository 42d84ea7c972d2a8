# The conversion stage's config (runtime/convert): export a checkpoint to a Hugging Face directory, or import one.
# The launcher parses it at launch and the stage again on the node; an import's weights are looked at (headers only)
# wherever they are on this machine's disk, so a damaged download is refused before the job is queued.
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.schema import choices as C
from runtime.schema import rules
from runtime.schema.reader import Choices, Report, Section
from runtime.schema.safetensors_file import hf_weights_problems

# conversion.lora: how an export writes a LoRA run's checkpoint (adapters only, base from restore_from_path).
LORA_EXPORTS = Choices(("merged", "adapter", "both"))


@dataclass(frozen=True)
class ConversionConfig:
    mode: str                        # export | import
    checkpoint_dir: str              # export: read (may be s3://); import: written
    checkpoint_name: str | None      # export: 'latest' or one checkpoint's directory name
    output_dir: str | None           # export: the Hugging Face directory written
    tokenizer_model: str | None      # export: copied into output_dir; default: the checkpoint's own
    include_optimizer: bool
    overwrite: bool
    hf_checkpoint_dir: str | None    # import: the Hugging Face directory read
    lora: str = "merged"             # export of a LoRA run: merged | adapter (PEFT, in adapter/) | both


def parse_conversion(raw: Any, p: str = "conversion.") -> tuple[ConversionConfig | None, Report]:
    report = Report()
    s = Section(raw, p.rstrip("."), report)
    mode = s.choice("mode", C.CONVERSION_MODES, "export")
    values = dict(
        mode=mode,
        checkpoint_dir=s.str("checkpoint_dir"),
        checkpoint_name=s.str("checkpoint_name", None),
        output_dir=s.str("output_dir", None),
        tokenizer_model=s.str("tokenizer_model", None),
        include_optimizer=s.bool("include_optimizer", False),
        overwrite=s.bool("overwrite", False),
        hf_checkpoint_dir=s.str("hf_checkpoint_dir", None),
        lora=s.choice("lora", LORA_EXPORTS, "merged"),
    )
    if mode == "export" and values["output_dir"] is None and not report.errors:
        report.error(f"{p}output_dir: missing; the Hugging Face directory to write, e.g. {p}output_dir=/fsx/hf_model")
    if mode == "import" and values["hf_checkpoint_dir"] is None and not report.errors:
        report.error(f"{p}hf_checkpoint_dir: missing; give the Hugging Face model directory to import")
    if mode == "import" and values["lora"] != "merged" and not report.errors:
        report.error(f"{p}lora: {values['lora']} applies to export only; an import writes the full weights")
    report.error(rules.checkpoint_name(values["checkpoint_name"], f"{p}checkpoint_name", f"{p}checkpoint_dir"))
    source = values["hf_checkpoint_dir"]
    if mode == "import" and source and not source.startswith("s3://") and Path(source).is_dir():
        # Not there (a dry run for another machine's disk): the node reads and checks it.
        for problem in hf_weights_problems(source):
            report.error(f"{p}hf_checkpoint_dir: {problem}; re-download it, or point {p}hf_checkpoint_dir at a "
                         f"complete copy")
    if report.errors:
        return None, report
    return ConversionConfig(**values), report

