"""The data_preparation stage config: the launcher's resolved YAML loaded into small frozen dataclasses.

Standard library only, because the launcher imports it (through runtime/data_prep/plan.py) at render time. It
reads with the schema's one reader (reader.py): every mistake is one line naming the key, the bad value and what
would be accepted, and all of them are reported together.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.schema.choices import BAD_LINE_POLICIES, DATA_SOURCES, TOKEN_DTYPES, TOKENIZER_ENGINES
from runtime.schema.choices import TOKENIZER_FORMATS, TRAINABLE_TOKENIZERS
from runtime.schema import rules
from runtime.schema.reader import ConfigErrors, Report, Section

P = "data_preparation."
# input.source: synthetic_instructions writes runtime/sft/synthetic.py's instruction demo (chat records and the
# tokenizer the fine_tuning and peft stages read) instead of tokenizing a corpus; synthetic_preferences writes
# runtime/alignment/synthetic.py's preference pairs (and tokenizer) for the alignment stage; synthetic_prompts
# writes runtime/rl/synthetic.py's prompts with exact answers (and a word-level tokenizer) for the rl stage. Each
# has its own settings section of the same name.
SYNTHETIC = "synthetic_instructions"
SYNTHETIC_PREFERENCES = "synthetic_preferences"
SYNTHETIC_PROMPTS = "synthetic_prompts"
SYNTHETIC_SOURCES = (SYNTHETIC, SYNTHETIC_PREFERENCES, SYNTHETIC_PROMPTS)
SOURCES = DATA_SOURCES


class UserError(ConfigErrors):
    """A mistake the user fixes in the config or the inputs: one line each; exit code 2."""

    def __init__(self, *problems: str):
        super().__init__(list(problems))


class DataError(RuntimeError):
    """A failure found while running (bad data, a download that keeps failing). One line; exit code 1."""


@dataclass(frozen=True)
class RunConfig:
    name: str
    results_dir: str | None
    time_limit: str
    dependency: str
    node_array_size: int


DEMO_MAX_SHARDS = 64  # the standard library's ~450 files at most (~220 at the default 4 MB)


@dataclass(frozen=True)
class DemoConfig:
    num_shards: int = 2
    max_mb: float = 4.0


@dataclass(frozen=True)
class SyntheticConfig:
    """runtime.sft.synthetic.write_demo's arguments (input.source: synthetic_instructions)."""

    num_train: int = 20000
    num_valid: int = 500
    num_test: int = 500
    seed: int = 1234
    vocab_size: int = 512   # its byte-level BPE: 256 bytes, 4 special tokens and merges; at least 300


@dataclass(frozen=True)
class SyntheticPreferencesConfig(SyntheticConfig):
    """runtime.alignment.synthetic.write_demo's arguments (input.source: synthetic_preferences)."""

    num_valid: int = 256
    num_test: int = 512


@dataclass(frozen=True)
class SyntheticPromptsConfig:
    """runtime.rl.synthetic.write_demo's arguments (input.source: synthetic_prompts). Its tokenizer is word level:
    no vocab_size to choose, the symbols are its vocabulary."""

    num_train: int = 600
    num_valid: int = 100
    num_test: int = 200
    seed: int = 1234
    num_symbols: int = 10          # the letters a.. a prompt's symbols are drawn from (2..26)
    symbols_per_prompt: int = 3    # num_symbols ** symbols_per_prompt distinct prompts


@dataclass(frozen=True)
class InputConfig:
    source: str
    files: tuple[str, ...] = ()
    urls: tuple[str, ...] = ()
    file_numbers: str | None = None
    text_key: str = "text"
    on_bad_line: str = "skip"
    max_record_mb: float = 16.0       # the longest record (a JSON line or array value) read; see rules.py
    on_long_record: str = "skip"


@dataclass(frozen=True)
class DownloadConfig:
    dir: str | None = None
    checksums: Mapping[str, str] | str | None = None   # {file name: "sha256:<hex>"} or a sha256sum file
    retries: int = 5
    timeout_s: float = 60.0
    backoff_s: float = 2.0
    remove_after_preprocess: bool = False


@dataclass(frozen=True)
class TrainConfig:
    model_type: str = "bpe"
    vocab_size: int = 32000
    special_tokens: tuple[str, ...] = ("<|endoftext|>",)
    min_frequency: int = 2
    max_mb: float = 1024.0
    files: tuple[str, ...] = ()
    sentencepiece_args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenizerConfig:
    library: str = "huggingface"
    model: str | None = None          # tokenizer.json (huggingface) or .model (sentencepiece): path or URL
    vocab_file: str | None = None     # GPT-2 BPE vocab.json: path or URL
    merge_file: str | None = None     # GPT-2 BPE merges.txt: path or URL
    train: TrainConfig | None = None
    eod_token: str | None = None      # default: <|endoftext|> (huggingface), the model's eos (sentencepiece)
    add_special_tokens: bool = False
    engine: str = "auto"              # what runs a huggingface tokenizer: see fast_bpe.py
    wait_timeout_s: float = 7200.0


@dataclass(frozen=True)
class OutputConfig:
    append_eod: bool = True
    dtype: str = "auto"
    blend_weights: Mapping[str, float] | None = None


@dataclass(frozen=True)
class StageConfig:
    run: RunConfig
    output_dir: str
    input: InputConfig
    tokenizer: TokenizerConfig
    workers_per_node: int = 1
    output: OutputConfig = OutputConfig()
    download: DownloadConfig = DownloadConfig()
    demo: DemoConfig = DemoConfig()
    synthetic_instructions: SyntheticConfig = SyntheticConfig()
    synthetic_preferences: SyntheticPreferencesConfig = SyntheticPreferencesConfig()
    synthetic_prompts: SyntheticPromptsConfig = SyntheticPromptsConfig()
    chunk_mb: float = 1.0
    log_interval_s: float = 30.0
    max_array_tasks: int = 1000


def _run(s: Section) -> dict:
    # run.* belongs to the launcher as much as to us: extra keys there are its business (no done()).
    return dict(name=s.str("name", "data_preparation"), results_dir=s.str("results_dir", None),
                time_limit=s.str("time_limit", "4:00:00"), dependency=s.str("dependency", "singleton"),
                node_array_size=s.int("node_array_size", 1, minimum=1))


def _input(s: Section) -> dict:
    numbers = s.raw("file_numbers", None)
    if numbers is not None and (isinstance(numbers, bool) or not isinstance(numbers, (str, int))):
        s.report.error(f"{s.key('file_numbers')}: {numbers!r} must be a string like \"0,3,5-7\"")
    values = dict(source=s.choice("source", SOURCES), files=s.strings("files"), urls=s.strings("urls"),
                  file_numbers=None if numbers is None else str(numbers), text_key=s.str("text_key", "text"),
                  on_bad_line=s.choice("on_bad_line", BAD_LINE_POLICIES, "skip"),
                  max_record_mb=s.float("max_record_mb", InputConfig.max_record_mb),
                  on_long_record=s.choice("on_long_record", BAD_LINE_POLICIES, "skip"))
    s.done()
    if values["max_record_mb"] is not None:
        s.report.error(rules.max_record_mb(values["max_record_mb"], P))
    if values["source"] == "files" and values["files"] == ():
        s.report.error(f"{s.key('files')}: empty but {s.key('source')} is 'files'; list paths or globs")
    if values["source"] == "urls" and values["urls"] == ():
        s.report.error(f"{s.key('urls')}: empty but {s.key('source')} is 'urls'; list URLs or a URL pattern")
    return values


def _train(s: Section) -> dict | None:
    if not s.data:
        return None
    values = dict(model_type=s.str("model_type", "bpe"), vocab_size=s.int("vocab_size", minimum=2),
                  special_tokens=s.strings("special_tokens") if "special_tokens" in s.data
                  else TrainConfig.special_tokens,
                  min_frequency=s.int("min_frequency", 2, minimum=0), max_mb=s.float("max_mb", 1024.0, above=0.0),
                  files=s.strings("files"), sentencepiece_args=s.mapping("sentencepiece_args") or {})
    s.done()
    return values


def _synthetic(s: Section, defaults: SyntheticConfig) -> dict:
    values = {name: s.int(name, getattr(defaults, name), minimum=1)
              for name in ("num_train", "num_valid", "num_test")}
    values.update(seed=s.int("seed", defaults.seed),
                  vocab_size=s.int("vocab_size", defaults.vocab_size, minimum=300))
    s.done()
    return values


def _synthetic_prompts(s: Section) -> dict:
    defaults = SyntheticPromptsConfig()
    values = {name: s.int(name, getattr(defaults, name), minimum=1)
              for name in ("num_train", "num_valid", "num_test", "symbols_per_prompt")}
    values.update(seed=s.int("seed", defaults.seed),
                  num_symbols=s.int("num_symbols", defaults.num_symbols, minimum=2, maximum=26))
    s.done()
    return values


def _tokenizer(s: Section, source: str | None) -> dict:
    train = s.section("train")
    values = dict(library=s.choice("library", TOKENIZER_FORMATS, "huggingface"), model=s.str("model", None),
                  vocab_file=s.str("vocab_file", None), merge_file=s.str("merge_file", None),
                  train=_train(train), eod_token=s.str("eod_token", None),
                  add_special_tokens=s.bool("add_special_tokens", False),
                  engine=s.choice("engine", TOKENIZER_ENGINES, "auto"),
                  wait_timeout_s=s.float("wait_timeout_s", 7200.0, above=0.0))
    s.done()
    error, path = s.report.error, s.path
    given = [k for k in ("model", "vocab_file", "train") if values[k]]
    if source in SYNTHETIC_SOURCES:
        if given:
            error(f"{path}.{given[0]}: input.source {source!r} writes its own tokenizer (tokenizer.json and "
                  f"tokenizer_config.json in output_dir); remove {path}")
        return values
    if not given:
        error(f"{path}: set one of model (a tokenizer file), vocab_file + merge_file (GPT-2 BPE), or train (a new "
              "tokenizer trained on the corpus)")
    if len(given) > 1:
        error(f"{path}: {' and '.join(given)} are both set; keep exactly one tokenizer source")
    if (values["vocab_file"] is None) != (values["merge_file"] is None):
        error(f"{path}.vocab_file and {path}.merge_file go together (GPT-2 BPE); set both")
    library = values["library"]
    if values["engine"] == "tiktoken" and library != "huggingface":
        error(f"{path}.engine: 'tiktoken' runs byte-level BPE tokenizer.json files; with library {library!r} use "
              "engine: auto")
    if values["vocab_file"] and library != "huggingface":
        error(f"{path}.library: {library!r}: vocab_file + merge_file need 'huggingface'")
    trained = values["train"]
    if trained and library:
        types = TRAINABLE_TOKENIZERS
        if trained["model_type"] not in types:
            error(f"{path}.train.model_type: {trained['model_type']!r} with library {library!r} must be one of "
                  f"{', '.join(types)}")
        if trained["sentencepiece_args"] and library != "sentencepiece":
            error(f"{path}.train.sentencepiece_args is set but {path}.library is {library!r}; set library: "
                  "sentencepiece or remove it")
    return values


def _output(s: Section) -> dict:
    weights = s.mapping("blend_weights")
    for name, weight in (weights or {}).items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            s.report.error(f"{s.key('blend_weights')}.{name}: {weight!r} must be a number >= 0")
    values = dict(append_eod=s.bool("append_eod", True), dtype=s.choice("dtype", TOKEN_DTYPES, "auto"),
                  blend_weights=weights)
    s.done()
    return values


def _download(s: Section) -> dict:
    checksums = s.raw("checksums", None)
    if checksums is not None and not isinstance(checksums, (str, Mapping)):
        s.report.error(f"{s.key('checksums')}: {checksums!r} must be {{file name: checksum}} or a file path")
    values = dict(dir=s.str("dir", None), checksums=dict(checksums) if isinstance(checksums, Mapping) else checksums,
                  retries=s.int("retries", 5, minimum=0), timeout_s=s.float("timeout_s", 60.0, above=0.0),
                  backoff_s=s.float("backoff_s", 2.0, minimum=0.0),
                  remove_after_preprocess=s.bool("remove_after_preprocess", False))
    s.done()
    return values


def parse_config(data: Any) -> StageConfig:
    """The resolved stage mapping as a StageConfig, or UserError with one line per problem."""
    report = Report()
    top = Section(data, P.rstrip("."), report)
    run = _run(top.section("run"))
    demo = top.section("demo")
    demo_values = dict(num_shards=demo.int("num_shards", 2, minimum=1, maximum=DEMO_MAX_SHARDS, why=(
        " (the demo corpus is a few hundred files of this Python's standard library: more shards would be near "
        "empty)")), max_mb=demo.float("max_mb", 4.0, above=0.0))
    demo.done()
    synthetic = _synthetic(top.section(SYNTHETIC), SyntheticConfig())
    preferences = _synthetic(top.section(SYNTHETIC_PREFERENCES), SyntheticPreferencesConfig())
    prompts = _synthetic_prompts(top.section(SYNTHETIC_PROMPTS))
    values = dict(output_dir=top.str("output_dir"), workers_per_node=top.int("workers_per_node", 1, minimum=1),
                  chunk_mb=top.float("chunk_mb", 1.0, above=0.0),
                  log_interval_s=top.float("log_interval_s", 30.0, above=0.0),
                  max_array_tasks=top.int("max_array_tasks", 1000, minimum=1))
    inputs = _input(top.section("input"))
    tokenizer = _tokenizer(top.section("tokenizer"), inputs["source"])
    output, download = _output(top.section("output")), _download(top.section("download"))
    top.done()
    if inputs["source"] == "urls" and not download["dir"]:
        report.error(f"{P}download.dir: missing; input.source 'urls' needs a directory for the downloads")
    if tokenizer["train"] and inputs["source"] == "urls" and not tokenizer["train"]["files"]:
        report.error(f"{P}tokenizer.train.files: empty but input.source is 'urls'; tokenizer training reads local "
                     "files, so list some (downloaded shards, for example) or use an existing tokenizer")
    if report.errors:
        raise UserError(*report.errors)
    train = tokenizer.pop("train")
    return StageConfig(run=RunConfig(**run), input=InputConfig(**inputs),
                       tokenizer=TokenizerConfig(train=TrainConfig(**train) if train else None, **tokenizer),
                       output=OutputConfig(**output), download=DownloadConfig(**download),
                       demo=DemoConfig(**demo_values), synthetic_instructions=SyntheticConfig(**synthetic),
                       synthetic_preferences=SyntheticPreferencesConfig(**preferences),
                       synthetic_prompts=SyntheticPromptsConfig(**prompts), **values)


def trained_vocab_size(cfg: StageConfig, tokenizer: str) -> int | None:
    """The vocabulary of the tokenizer this stage trains, when `tokenizer` is where the stage writes it
    (<output_dir>/tokenizer.json, runtime/data_prep/tokenizer.py): what a model trained on the stage's output is
    sized for before the stage has run (tokenizer.train.vocab_size, special tokens included). None for any other
    path, and for a stage that takes an existing tokenizer: that one's size is its file's."""
    if cfg.tokenizer.train is None or cfg.input.source in SYNTHETIC_SOURCES:
        return None
    written = os.path.normpath(os.path.join(cfg.output_dir, "tokenizer.json"))
    return cfg.tokenizer.train.vocab_size if os.path.normpath(str(tokenizer)) == written else None
