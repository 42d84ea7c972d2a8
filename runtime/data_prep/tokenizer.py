"""Which tokenizer the stage uses, made available as files in output_dir before any shard is tokenized.

Whatever the source (a tokenizer.json, GPT-2 vocab.json + merges.txt, a SentencePiece .model, or training
on the corpus), the result is `<output_dir>/tokenizer.json`: the file the training stage points
`model.tokenizer.model` at. SentencePiece also keeps `<output_dir>/tokenizer.model`, which is what encodes
(the .json is a conversion for reading the vocabulary).

Array tasks run this concurrently. A trained tokenizer is trained once: the first task to create
`tokenizer.lock` trains while it refreshes the lock's mtime; the others wait for `tokenizer.json`. If the
holder dies (its lock goes stale), a waiter breaks the lock and trains instead. Training is deterministic and
files are published first-writer-wins (runtime.io.files.publish_first), so even two tasks training at once agree.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from runtime.data_prep import plan
from runtime.schema.data_preparation import DataError, StageConfig, UserError
from runtime.data_prep.demo import write_demo_shard
from runtime.data_prep.download import download
from runtime.data_prep.encode import EncoderSpec
from runtime.io.files import atomic_write_json, publish_first_bytes, read_json, temp_name
from runtime.data_prep.indexed import token_dtype

LOCK_STALE_S = 120.0     # a lock untouched this long belongs to a dead task (the holder touches it every 10 s)
_HEARTBEAT_S = 10.0
_POLL_S = 2.0


def prepare_tokenizer(cfg: StageConfig, shards: list[plan.Shard], log: Callable[[str], None]) -> EncoderSpec:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = cfg.tokenizer
    if tok.train:
        _ensure_trained(cfg, shards, log)
    elif tok.library == "huggingface":
        _publish_same(out / "tokenizer.json", _huggingface_json(cfg, log), "tokenizer")
    else:
        model = _fetch(tok.model, cfg, log).read_bytes()
        _publish_same(out / "tokenizer.model", model, "tokenizer.model")
        _publish_spm_json(out)
    return encoder_spec(cfg)


def encoder_spec(cfg: StageConfig) -> EncoderSpec:
    """The spec workers load, from the published files in output_dir."""
    out, tok = Path(cfg.output_dir), cfg.tokenizer
    if tok.library == "sentencepiece":
        import sentencepiece

        path = out / "tokenizer.model"
        processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        vocab_size = processor.get_piece_size()
        if tok.eod_token:
            eod = processor.piece_to_id(tok.eod_token)
            eod = None if eod == processor.unk_id() and tok.eod_token != processor.id_to_piece(eod) else eod
        else:
            eod = processor.eos_id() if processor.eos_id() >= 0 else None
        eod_name = tok.eod_token or "the model's eos"
    else:
        from tokenizers import Tokenizer

        path = out / "tokenizer.json"
        tokenizer = Tokenizer.from_file(str(path))
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        eod_name = tok.eod_token or "<|endoftext|>"
        eod = tokenizer.token_to_id(eod_name)
    if cfg.output.append_eod and eod is None:
        raise UserError(f"tokenizer.eod_token = {eod_name!r}: the tokenizer has no such token; name its "
                        "end-of-document token (</s>, <|endoftext|>, ...) or set output.append_eod: false")
    try:
        dtype = token_dtype(vocab_size, cfg.output.dtype)
    except ValueError as err:
        raise UserError(str(err)) from None
    return EncoderSpec(library=tok.library, path=str(path), vocab_size=vocab_size,
                       eod_id=eod if cfg.output.append_eod else None, add_special_tokens=tok.add_special_tokens,
                       dtype=dtype.name, text_key=cfg.input.text_key, engine=_engine(cfg, path))


def _engine(cfg: StageConfig, path: Path) -> str:
    """tiktoken for GPT-2-style byte-level BPE when it is installed (same ids, several times faster)."""
    from runtime.data_prep import fast_bpe

    tok = cfg.tokenizer
    if tok.library == "sentencepiece":
        return "sentencepiece"
    if tok.engine == "huggingface":
        return "huggingface"
    reason = fast_bpe.ineligible(json.loads(path.read_text(encoding="utf-8")), tok.add_special_tokens)
    if reason is None and not fast_bpe.available():
        reason = "tiktoken is not installed (pip install tiktoken)"
    if reason is not None and tok.engine == "tiktoken":
        raise UserError(f"tokenizer.engine = 'tiktoken' cannot run {path}: {reason}; use engine: auto")
    return "huggingface" if reason else "tiktoken"


def _fetch(location: str, cfg: StageConfig, log: Callable[[str], None]) -> Path:
    """A local tokenizer file as is; a URL downloaded into <output_dir>/tokenizer_src/ (small: no resume)."""
    if not plan.looks_like_url(location):
        return Path(os.path.expanduser(location))
    dest = Path(cfg.output_dir) / "tokenizer_src" / plan.url_basename(location)
    return download(location, dest, retries=cfg.download.retries, timeout_s=cfg.download.timeout_s,
                    backoff_s=cfg.download.backoff_s, resume=False, log=log)


def _huggingface_json(cfg: StageConfig, log: Callable[[str], None]) -> bytes:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = cfg.tokenizer
    if tok.model:
        path = _fetch(tok.model, cfg, log)
        try:
            Tokenizer.from_file(str(path))
        except Exception as err:    # tokenizers raises a bare Exception for a file it cannot parse
            raise UserError(f"tokenizer.model = {tok.model!r}: not a HF tokenizer.json ({err}); for a "
                            "SentencePiece .model set tokenizer.library: sentencepiece") from None
        return path.read_bytes()
    # GPT-2's BPE: byte-level pre-tokenization (GPT-2's regex), merges applied by rank; no prefix space.
    vocab, merges = _fetch(tok.vocab_file, cfg, log), _fetch(tok.merge_file, cfg, log)
    try:
        tokenizer = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    except Exception as err:
        raise UserError(f"tokenizer.vocab_file / merge_file = {tok.vocab_file!r}, {tok.merge_file!r}: not a "
                        f"GPT-2 vocab.json + merges.txt pair ({err})") from None
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str(pretty=True).encode()


def _publish_same(final: Path, data: bytes, what: str) -> None:
    """Publishes `data` as `final`, or checks that the file already there is the same."""
    if not final.exists():
        publish_first_bytes(data, final)
    if final.read_bytes() != data:
        raise UserError(f"{final} differs from the configured {what}: it was made for another config; delete "
                        "it together with the outputs made with it, or set output_dir elsewhere")


def _publish_spm_json(out: Path) -> None:
    from runtime.data_prep.tokenizer_train import sentencepiece_to_json

    # Converted from the *published* model, so every task derives the same tokenizer.json.
    import sentencepiece
    from tokenizers import Tokenizer

    text = sentencepiece_to_json((out / "tokenizer.model").read_bytes())
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model")).get_piece_size()
    converted = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
    assert converted == pieces, f"tokenizer.json has {converted} tokens, tokenizer.model {pieces}"
    _publish_same(out / "tokenizer.json", text.encode(), "tokenizer (converted from tokenizer.model)")


def _fingerprint(cfg: StageConfig, files: list[str]) -> dict:
    """What the trained tokenizer depends on; a tokenizer.json trained from anything else is not reused."""
    train = cfg.tokenizer.train
    if cfg.input.source == "demo" and not train.files:
        corpus = {"demo": [cfg.demo.num_shards, cfg.demo.max_mb], "python": list(sys.version_info[:2])}
    else:
        corpus = {"files": [[f, os.path.getsize(f)] for f in files]}
    return {"library": cfg.tokenizer.library, "model_type": train.model_type, "vocab_size": train.vocab_size,
            "special_tokens": list(train.special_tokens), "min_frequency": train.min_frequency,
            "max_mb": train.max_mb, "sentencepiece_args": dict(train.sentencepiece_args),
            "text_key": cfg.input.text_key, "corpus": corpus}


def _ensure_trained(cfg: StageConfig, shards: list[plan.Shard], log: Callable[[str], None]) -> None:
    out = Path(cfg.output_dir)
    final, lock = out / "tokenizer.json", out / "tokenizer.lock"
    if cfg.input.source == "demo" and not cfg.tokenizer.train.files:
        for shard in shards:     # the sample spans every shard: make sure they all exist (cheap, idempotent)
            write_demo_shard(shard.location, shard.index, cfg.demo.num_shards, cfg.demo.max_mb,
                             cfg.input.text_key)
    errors: list[str] = []
    files = (plan.expand_files(cfg.tokenizer.train.files, None, "tokenizer.train.files", errors)
             if cfg.tokenizer.train.files else [s.local_path(cfg) for s in shards])
    if errors:
        raise UserError(errors[0])
    fingerprint = _fingerprint(cfg, files)
    deadline = time.monotonic() + cfg.tokenizer.wait_timeout_s
    waiting = False
    while True:
        if final.exists():
            meta = read_json(out / "tokenizer_meta.json")
            if meta is None or meta.get("fingerprint") != fingerprint:
                raise UserError(f"{final} was trained with other tokenizer.train settings or data; delete it "
                                "(and the outputs made with it) to retrain, or set output_dir elsewhere")
            return
        if _try_lock(lock):
            try:
                with _Heartbeat(lock):
                    if not final.exists():
                        _train_and_publish(cfg, files, fingerprint, log)
            finally:
                lock.unlink(missing_ok=True)
            continue
        if _age(lock) > LOCK_STALE_S:
            log(f"{lock} has not been refreshed for {LOCK_STALE_S:.0f}s (its task died?); taking over training")
            try:
                os.replace(lock, temp_name(lock))   # only one waiter's rename finds the lock
                temp_name(lock).unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            continue
        if time.monotonic() > deadline:
            raise DataError(f"gave up after {cfg.tokenizer.wait_timeout_s:.0f}s waiting for {final} (being trained "
                            f"by the task in {lock}); raise tokenizer.wait_timeout_s")
        if not waiting:
            log(f"waiting for another task to train the tokenizer ({lock})")
            waiting = True
        time.sleep(_POLL_S)


def _train_and_publish(cfg: StageConfig, files: list[str], fingerprint: dict, log: Callable[[str], None]) -> None:
    from runtime.data_prep import tokenizer_train

    out, train = Path(cfg.output_dir), cfg.tokenizer.train
    started = time.monotonic()
    log(f"training a {cfg.tokenizer.library} {train.model_type} tokenizer (vocab {train.vocab_size}) on up to "
        f"{train.max_mb:g} MB from {len(files)} files")
    atomic_write_json(out / "tokenizer_meta.json", {"fingerprint": fingerprint})
    texts = tokenizer_train.training_texts(files, cfg.input.text_key, train.max_mb,
                                           int(cfg.input.max_record_mb * 1e6))
    if cfg.tokenizer.library == "huggingface":
        publish_first_bytes(tokenizer_train.train_huggingface(texts, train).encode("utf-8"), out / "tokenizer.json")
    else:
        publish_first_bytes(tokenizer_train.train_sentencepiece(texts, train, cfg.workers_per_node),
                            out / "tokenizer.model")
        _publish_spm_json(out)
    log(f"tokenizer trained in {time.monotonic() - started:.1f}s -> {out / 'tokenizer.json'}")


def _try_lock(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")
    return True


def _age(lock: Path) -> float:
    try:
        return time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return 0.0


class _Heartbeat:
    """Touches the lock every few seconds while training runs, so waiters can tell a live holder from a dead one."""

    def __init__(self, lock: Path):
        self.lock, self.stop = lock, threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self.stop.wait(_HEARTBEAT_S):
            try:
                os.utime(self.lock)
            except FileNotFoundError:
                return

    def __enter__(self) -> "_Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
