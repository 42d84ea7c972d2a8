"""The data_preparation stage config: the launcher's resolved YAML loaded into small frozen dataclasses.

Standard library only, because the launcher imports it (through plan.py) at render time. Every mistake is
reported as one line naming the key, the bad value and what would be accepted.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SOURCES = ("demo", "files", "urls")
LIBRARIES = ("huggingface", "sentencepiece")
BAD_LINE_POLICIES = ("skip", "fail")
DTYPES = ("auto", "uint16", "int32", "int64")
HF_MODEL_TYPES = ("bpe", "unigram")
ENGINES = ("auto", "huggingface", "tiktoken")
SPM_MODEL_TYPES = ("bpe", "unigram")     # what converts to the tokenizer.json training reads


class UserError(ValueError):
    """A mistake the user fixes in the config or the inputs. Printed as one line; exit code 2."""


class DataError(RuntimeError):
    """A failure found while running (bad data, a download that keeps failing). One line; exit code 1."""


@dataclass(frozen=True)
class RunConfig:
    name: str
    results_dir: str | None
    time_limit: str
    dependency: str
    node_array_size: int


@dataclass(frozen=True)
class DemoConfig:
    num_shards: int = 2
    max_mb: float = 4.0


@dataclass(frozen=True)
class InputConfig:
    source: str
    files: tuple[str, ...] = ()
    urls: tuple[str, ...] = ()
    file_numbers: str | None = None
    text_key: str = "text"
    on_bad_line: str = "skip"


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
    chunk_mb: float = 1.0
    log_interval_s: float = 30.0
    max_array_tasks: int = 1000


_REQUIRED = object()


class _Section:
    """Reads one mapping of the config, checking each value's type; `done()` rejects unknown keys."""

    def __init__(self, data: Any, path: str, allow_extra: bool = False):
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise UserError(f"{path or 'the stage config'} = {data!r}: expected a mapping of keys")
        self.data, self.path, self.allow_extra, self.seen = data, path, allow_extra, set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def raw(self, name: str, default: Any = _REQUIRED) -> Any:
        self.seen.add(name)
        if name in self.data and self.data[name] is not None:
            return self.data[name]
        if default is _REQUIRED:
            raise UserError(f"{self.key(name)} is missing; set it in the data_preparation config")
        return default

    def str_(self, name: str, default: Any = _REQUIRED, choices: Sequence[str] | None = None) -> Any:
        value = self.raw(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise UserError(f"{self.key(name)} = {value!r}: expected a string")
        value = str(value)
        if choices is not None and value not in choices:
            raise UserError(f"{self.key(name)} = {value!r}: must be one of {', '.join(choices)}")
        return value

    def int_(self, name: str, default: Any = _REQUIRED, minimum: int = 0) -> int:
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UserError(f"{self.key(name)} = {value!r}: expected an integer >= {minimum}")
        return value

    def float_(self, name: str, default: Any = _REQUIRED, zero_ok: bool = False) -> float:
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or \
                (value == 0 and not zero_ok):
            raise UserError(f"{self.key(name)} = {value!r}: expected a number {'>=' if zero_ok else '>'} 0")
        return float(value)

    def bool_(self, name: str, default: Any = _REQUIRED) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise UserError(f"{self.key(name)} = {value!r}: expected true or false")
        return value

    def str_list(self, name: str) -> tuple[str, ...]:
        """A string or a list of strings (a single path is the common case)."""
        value = self.raw(name, ())
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
            raise UserError(f"{self.key(name)} = {value!r}: expected a string or a list of strings")
        return tuple(value)

    def mapping(self, name: str) -> Mapping[str, Any] | None:
        value = self.raw(name, None)
        if value is not None and not isinstance(value, Mapping):
            raise UserError(f"{self.key(name)} = {value!r}: expected a mapping")
        return None if value is None else dict(value)

    def section(self, name: str, allow_extra: bool = False) -> "_Section":
        self.seen.add(name)
        return _Section(self.data.get(name), self.key(name), allow_extra)

    def done(self) -> None:
        unknown = sorted(str(k) for k in self.data if k not in self.seen)
        if unknown and not self.allow_extra:
            valid = ", ".join(sorted(self.seen))
            raise UserError(f"{self.key(unknown[0])}: unknown key; valid keys here are: {valid}")


def _run(s: _Section) -> RunConfig:
    # run.* belongs to the launcher as much as to us: extra keys there are its business.
    run = RunConfig(name=s.str_("name", "data_preparation"), results_dir=s.str_("results_dir", None),
                    time_limit=s.str_("time_limit", "4:00:00"), dependency=s.str_("dependency", "singleton"),
                    node_array_size=s.int_("node_array_size", 1, minimum=1))
    s.done()
    return run


def _input(s: _Section) -> InputConfig:
    numbers = s.raw("file_numbers", None)
    if numbers is not None and (isinstance(numbers, bool) or not isinstance(numbers, (str, int))):
        raise UserError(f"{s.key('file_numbers')} = {numbers!r}: expected a string like \"0,3,5-7\"")
    cfg = InputConfig(source=s.str_("source", choices=SOURCES), files=s.str_list("files"), urls=s.str_list("urls"),
                      file_numbers=None if numbers is None else str(numbers), text_key=s.str_("text_key", "text"),
                      on_bad_line=s.str_("on_bad_line", "skip", BAD_LINE_POLICIES))
    s.done()
    if cfg.source == "files" and not cfg.files:
        raise UserError(f"{s.key('files')} is empty but {s.key('source')} = 'files'; list paths or globs")
    if cfg.source == "urls" and not cfg.urls:
        raise UserError(f"{s.key('urls')} is empty but {s.key('source')} = 'urls'; list URLs or a URL pattern")
    return cfg


def _train(s: _Section) -> TrainConfig | None:
    if not s.data:
        return None
    cfg = TrainConfig(model_type=s.str_("model_type", "bpe"), vocab_size=s.int_("vocab_size", minimum=2),
                      special_tokens=s.str_list("special_tokens") if "special_tokens" in s.data
                      else TrainConfig.special_tokens,
                      min_frequency=s.int_("min_frequency", 2), max_mb=s.float_("max_mb", 1024.0),
                      files=s.str_list("files"), sentencepiece_args=s.mapping("sentencepiece_args") or {})
    s.done()
    return cfg


def _tokenizer(s: _Section) -> TokenizerConfig:
    cfg = TokenizerConfig(library=s.str_("library", "huggingface", LIBRARIES), model=s.str_("model", None),
                          vocab_file=s.str_("vocab_file", None), merge_file=s.str_("merge_file", None),
                          train=_train(s.section("train")), eod_token=s.str_("eod_token", None),
                          add_special_tokens=s.bool_("add_special_tokens", False),
                          engine=s.str_("engine", "auto", ENGINES), wait_timeout_s=s.float_("wait_timeout_s", 7200.0))
    s.done()
    given = [k for k, v in (("model", cfg.model), ("vocab_file", cfg.vocab_file), ("train", cfg.train)) if v]
    if not given:
        raise UserError(f"{s.path}: set one of model (a tokenizer file), vocab_file + merge_file (GPT-2 BPE), "
                        "or train (a new tokenizer trained on the corpus)")
    if len(given) > 1:
        raise UserError(f"{s.path}: {' and '.join(given)} are both set; keep exactly one tokenizer source")
    if (cfg.vocab_file is None) != (cfg.merge_file is None):
        raise UserError(f"{s.path}.vocab_file and {s.path}.merge_file go together (GPT-2 BPE); set both")
    if cfg.engine == "tiktoken" and cfg.library != "huggingface":
        raise UserError(f"{s.path}.engine = 'tiktoken' runs byte-level BPE tokenizer.json files; with library "
                        f"{cfg.library!r} use engine: auto")
    if cfg.vocab_file and cfg.library != "huggingface":
        raise UserError(f"{s.path}.library = {cfg.library!r}: vocab_file + merge_file need 'huggingface'")
    if cfg.train:
        types = HF_MODEL_TYPES if cfg.library == "huggingface" else SPM_MODEL_TYPES
        if cfg.train.model_type not in types:
            raise UserError(f"{s.path}.train.model_type = {cfg.train.model_type!r}: with library "
                            f"{cfg.library!r} it must be one of {', '.join(types)}")
        if cfg.train.sentencepiece_args and cfg.library != "sentencepiece":
            raise UserError(f"{s.path}.train.sentencepiece_args is set but {s.path}.library = {cfg.library!r}; "
                            "set library: sentencepiece or remove it")
    return cfg


def _output(s: _Section) -> OutputConfig:
    weights = s.mapping("blend_weights")
    for name, weight in (weights or {}).items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            raise UserError(f"{s.key('blend_weights')}.{name} = {weight!r}: expected a number >= 0")
    cfg = OutputConfig(append_eod=s.bool_("append_eod", True), dtype=s.str_("dtype", "auto", DTYPES),
                       blend_weights=weights)
    s.done()
    return cfg


def _download(s: _Section) -> DownloadConfig:
    checksums = s.raw("checksums", None)
    if checksums is not None and not isinstance(checksums, (str, Mapping)):
        raise UserError(f"{s.key('checksums')} = {checksums!r}: expected {{file name: checksum}} or a file path")
    cfg = DownloadConfig(dir=s.str_("dir", None), checksums=dict(checksums) if isinstance(checksums, Mapping)
                         else checksums, retries=s.int_("retries", 5), timeout_s=s.float_("timeout_s", 60.0),
                         backoff_s=s.float_("backoff_s", 2.0, zero_ok=True),
                         remove_after_preprocess=s.bool_("remove_after_preprocess", False))
    s.done()
    return cfg


def parse_config(data: Any) -> StageConfig:
    """Turns the resolved stage mapping into a StageConfig, or raises UserError naming the first bad key."""
    top = _Section(data, "")
    run = _run(top.section("run", allow_extra=True))
    demo = top.section("demo")
    demo_cfg = DemoConfig(num_shards=demo.int_("num_shards", 2, minimum=1), max_mb=demo.float_("max_mb", 4.0))
    demo.done()
    cfg = StageConfig(run=run, output_dir=top.str_("output_dir"), input=_input(top.section("input")),
                      tokenizer=_tokenizer(top.section("tokenizer")),
                      workers_per_node=top.int_("workers_per_node", 1, minimum=1),
                      output=_output(top.section("output")), download=_download(top.section("download")),
                      demo=demo_cfg, chunk_mb=top.float_("chunk_mb", 1.0),
                      log_interval_s=top.float_("log_interval_s", 30.0),
                      max_array_tasks=top.int_("max_array_tasks", 1000, minimum=1))
    top.done()
    if cfg.input.source == "urls" and not cfg.download.dir:
        raise UserError("download.dir is missing; input.source = 'urls' needs a directory for the downloads")
    if cfg.tokenizer.train and cfg.input.source == "urls" and not cfg.tokenizer.train.files:
        raise UserError("tokenizer.train.files is empty but input.source = 'urls'; tokenizer training reads local "
                        "files, so list some (downloaded shards, for example) or use an existing tokenizer")
    return cfg
