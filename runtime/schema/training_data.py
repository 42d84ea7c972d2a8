"""The data a training stage reads, in its config: model.micro_batch_size and global_batch_size, model.data's
pretraining keys (data_prefix, splits) and fine-tuning's (train_ds, validation_ds, chat_template), and the data's
rules that need the tokenizer."""
from __future__ import annotations

from pathlib import Path

from runtime.schema import choices as C
from runtime.schema import preference_pairs, records, rules
from runtime.schema.chat import end_of_document_id
from runtime.schema.data_prefix import MissingDataPrefix, missing_datasets, parse_data_prefix, parse_list
from runtime.schema.reader import REQUIRED, Report, Section
from runtime.schema.training_config import DataConfig, SFTDataConfig
from runtime.schema.training_files import Files, is_remote


def read_batch(model: Section) -> tuple[int | None, int | None]:
    """model.micro_batch_size and model.global_batch_size (samples per data-parallel rank, per optimizer step)."""
    return model.int("micro_batch_size", minimum=1), model.int("global_batch_size", minimum=1)


def read_data(model: Section, seq_length: int | None, files: Files, p: str, sft_data: bool = False
          ) -> DataConfig | None:
    data = model.section("data")
    data_seq = data.int("seq_length", seq_length, minimum=1) if seq_length else None
    if data_seq is not None and seq_length is not None:
        model.report.error(rules.data_seq_length(data_seq, seq_length, p))
    micro, global_ = read_batch(model)
    index_dir = data.raw("index_mapping_dir", None)
    data_prefix = data.raw("data_prefix", None if sft_data else REQUIRED)
    model.report.error(rules.fine_tuning_data(sft_data, data_prefix is not None, p))
    key = data.key("data_prefix")
    if data_prefix is not None:
        try:
            if isinstance(data_prefix, str):
                if files.inputs_checked and not is_remote(data_prefix):
                    entries = parse_data_prefix(data_prefix, key)
                    for line in missing_datasets(entries, key):
                        files.problem(line)
            else:
                entries = parse_list(data_prefix, key)
                if files.inputs_checked:
                    for line in missing_datasets([e for e in entries if not is_remote(e.prefix)], key):
                        files.problem(line)
        except MissingDataPrefix as error:
            files.problem(str(error))
        except ValueError as error:  # malformed: an error wherever it is found
            model.report.error(str(error))
    splits = data.str("splits_string", "98,1,1")
    if splits is not None:
        model.report.error(rules.splits(splits, p))
    workers = data.int("num_workers", 0, minimum=0)
    reset = (data.bool("reset_position_ids", False), data.bool("reset_attention_mask", False))
    model.report.error(rules.document_reset(*reset, p))
    if None in (micro, global_, splits, workers) or (data_prefix is None and not sft_data) or seq_length is None:
        return None
    return DataConfig(data_prefix=data_prefix, splits_string=splits, seq_length=seq_length, micro_batch_size=micro,
                      global_batch_size=global_, index_mapping_dir=None if index_dir is None else str(index_dir),
                      num_workers=workers, reset_documents=bool(reset[0] and reset[1]))


def read_sft_data(model: Section, files: Files, p: str, pairs: bool = False, prompts: bool = False
                  ) -> SFTDataConfig | None:
    """model.data.train_ds / validation_ds (NeMo's fine-tuning keys): chat or prompt/completion records, or with
    `pairs` (the alignment stage) preference records: prompt, chosen, rejected; with `prompts` (the rl stage) prompt
    records, which training_rl checks against its reward."""
    data = model.section("data")
    data.choice("truncation", C.TRUNCATIONS, "right")  # read (marked seen) even for pretraining configs
    data.raw("packing", None), data.raw("chat_template", None), data.raw("validation_ds", None)
    if data.raw("train_ds", None) is None:
        return None
    lists = {}
    for split in ("train_ds", "validation_ds"):
        section = data.section(split)
        names = section.strings("file_names") if section.data else ()
        if names is None:
            return None
        if split == "train_ds" and not names:
            model.report.error(f"{section.key('file_names')}: missing; list the .jsonl/.jsonl.gz/.parquet files to "
                               f"fine-tune on")
            return None
        for name in names:
            if not name.endswith(C.SFT_SUFFIXES):
                model.report.error(f"{section.key('file_names')}: {name!r} is not a {', '.join(C.SFT_SUFFIXES)} file")
            elif files.inputs_checked and not is_remote(name) and not Path(name).is_file():
                files.problem(f"{section.key('file_names')}: {name} does not exist; run the data_preparation that "
                              f"writes it or fix the path")
            elif files.inputs_checked and not is_remote(name) and not prompts:
                model.report.error(records.launch_problem(name, section.key("file_names"), pairs))
        lists[split] = tuple(names)
    template = data.str("chat_template", None)
    if template is not None and template not in C.CHAT_TEMPLATES and not Path(template).is_file():
        model.report.error(f"{data.key('chat_template')}: {template!r} is neither a built-in template "
                           f"({', '.join(C.CHAT_TEMPLATES)}) nor a jinja2 file; null uses the tokenizer's own")
        return None
    values = dict(packing=data.bool("packing", True), truncation=data.choice("truncation", C.TRUNCATIONS, "right"))
    if pairs:  # the alignment stage only (elsewhere the key is unknown); a bad value is already reported
        values["identical_pairs"] = data.choice("identical_pairs", preference_pairs.IDENTICAL_PAIRS, "error") or "error"
    if any(v is None for v in values.values()):
        return None
    return SFTDataConfig(train_files=lists["train_ds"], validation_files=lists["validation_ds"],
                         chat_template=template, **values)


def tokenizer_rules(report: Report, p: str, sft: SFTDataConfig | None, data: DataConfig | None, tokenizer_path: str,
                    files: Files) -> None:
    """The data's rules that read the tokenizer's files (when they are looked at here): fine-tuning's chat template
    and the end-of-document token that resets positions and attention."""
    if sft is not None and sft.chat_template is None and files.inputs_checked and tokenizer_path \
            and not is_remote(tokenizer_path):
        report.error(_tokenizer_template(tokenizer_path, p))
    if data is not None and data.reset_documents and files.inputs_checked and tokenizer_path \
            and not is_remote(tokenizer_path) and Path(tokenizer_path).exists():
        report.error(rules.document_reset_eod(end_of_document_id(tokenizer_path), tokenizer_path, p))


def _tokenizer_template(tokenizer_path: str, p: str) -> str | None:
    """model.data.chat_template: null reads the tokenizer's own template (tokenizer_config.json beside its
    tokenizer.json, as transformers keeps it): a tokenizer without one is found here, before the job is queued."""
    import json

    tokenizer = Path(tokenizer_path)
    if not tokenizer.exists():
        return None  # model.tokenizer.model's own check names it
    config = (tokenizer if tokenizer.is_dir() else tokenizer.parent) / "tokenizer_config.json"
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    except FileNotFoundError:
        template = None
    except (OSError, ValueError, AttributeError):
        return f"{p}model.data.chat_template: null reads {config}, which is not a JSON object"
    if template:
        return None
    return (f"{p}model.data.chat_template: null uses the tokenizer's own template, but {config} has no "
            f"chat_template; set model.data.chat_template to one of {', '.join(C.CHAT_TEMPLATES)}")
