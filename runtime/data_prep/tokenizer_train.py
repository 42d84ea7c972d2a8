"""Training a tokenizer on the corpus (HF `tokenizers` or SentencePiece), and SentencePiece -> tokenizer.json.

Training must be reproducible: if the task that holds the training lock dies, another task trains again, and
the two results must agree. So the corpus sample is read in a fixed order (each file in turn, up to an equal
share of `max_mb`), and SentencePiece is told not to shuffle or subsample.
"""
from __future__ import annotations

import io
import json
from collections.abc import Iterator

from runtime.schema.data_preparation import DataError, TrainConfig
from runtime.data_prep.readers import DEFAULT_MAX_RECORD_BYTES, iter_chunks


def training_texts(paths: list[str], text_key: str, max_mb: float,
                   max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[str]:
    """Documents from each file in turn, each file contributing up to max_mb / len(paths) of text. Records over
    max_record_bytes are left out (the shard pass reports those of the inputs)."""
    share = max(1, int(max_mb * 1e6 / max(1, len(paths))))
    for path in paths:
        taken = 0
        for chunk in iter_chunks(path, text_key, max_record_bytes=max_record_bytes):
            for text in _chunk_texts(chunk, text_key):
                yield text
                taken += len(text)
                if taken >= share:
                    break
            if taken >= share:
                break


def _chunk_texts(chunk, text_key: str) -> Iterator[str]:
    if chunk.kind in ("lines", "values"):
        records = []
        for item in chunk.payload.split(b"\n") if chunk.kind == "lines" else chunk.payload:
            try:
                records.append(json.loads(item))
            except ValueError:
                continue              # blank, malformed or left out: the shard pass reports these with numbers
    else:
        records = [{text_key: text} for text in chunk.payload]
    for record in records:
        text = record.get(text_key) if isinstance(record, dict) else None
        if isinstance(text, str) and text.strip():
            yield text


def train_huggingface(texts: Iterator[str], train: TrainConfig) -> str:
    """A byte-level BPE (GPT-2 style: no unknown tokens) or a Unigram model; returns tokenizer.json text.

    Special tokens take the first ids, in the order listed (so <|endoftext|> first makes it id 0).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    specials = list(train.special_tokens)
    if train.model_type == "bpe":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=train.vocab_size, min_frequency=train.min_frequency,
                                      special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        if "<unk>" not in specials:
            specials.append("<unk>")
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.normalizer = normalizers.NFKC()
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=train.vocab_size, special_tokens=specials,
                                          unk_token="<unk>", show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.get_vocab_size() <= len(specials):
        raise DataError("tokenizer training saw no text; check input.text_key and the input files")
    return tokenizer.to_str(pretty=True)


def train_sentencepiece(texts: Iterator[str], train: TrainConfig, threads: int) -> bytes:
    """Returns the serialized .model. Documents are fed line by line, since SentencePiece skips long lines."""
    import sentencepiece

    def sentences() -> Iterator[str]:
        for text in texts:
            for line in text.splitlines():
                if line.strip():
                    yield line

    args = {"character_coverage": 0.9995, "max_sentence_length": 16384}
    args.update(train.sentencepiece_args)
    # Reproducible across tasks: every sentence, in order, no sampling.
    args.update(input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2)
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=sentences(), model_writer=model,
                                                 model_type=train.model_type, vocab_size=train.vocab_size,
                                                 num_threads=threads, **args)
    except (RuntimeError, ValueError) as err:
        raise DataError(f"sentencepiece training failed: {err}".splitlines()[0]) from None
    return model.getvalue()


def sentencepiece_to_json(model: bytes) -> str:
    """The same tokenizer as HF tokenizer.json, so the training stage can read the vocabulary with
    `tokenizers.Tokenizer.from_file`. Handles SentencePiece's bpe and unigram models."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as err:   # the generated module needs protobuf
        raise DataError(f"converting the SentencePiece model to tokenizer.json needs protobuf ({err}); "
                        "pip install protobuf") from None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    unk_id = spec.unk_id
    if spec.model_type == 1:     # UNIGRAM
        tokenizer = Tokenizer(models.Unigram([(p, s) for p, s, _ in pieces], unk_id, spec.byte_fallback))
    elif spec.model_type == 2:   # BPE
        vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
        tokenizer = Tokenizer(models.BPE(vocab, _bpe_merges(pieces, vocab), unk_token=pieces[unk_id][0],
                                         fuse_unk=True, byte_fallback=spec.byte_fallback))
    else:
        raise DataError(f"cannot convert a SentencePiece model of type {spec.model_type} to tokenizer.json; "
                        "train with model_type bpe or unigram")
    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    if steps:
        tokenizer.normalizer = normalizers.Sequence(steps)
    scheme = "always" if norm.add_dummy_prefix else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse()] + ([decoders.Strip(" ", 1, 0)] if
                                                                 norm.add_dummy_prefix else []))
    # CONTROL (<s>, </s>, ...) pieces are special tokens; USER_DEFINED ones are matched verbatim in text.
    control = [AddedToken(p, special=True, normalized=False) for p, _, t in pieces if t == 3]
    user = [AddedToken(p, special=False, normalized=False) for p, _, t in pieces if t == 4]
    tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)
    return tokenizer.to_str(pretty=True)


def _bpe_merges(pieces: list[tuple[str, float, int]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece BPE stores pieces in merge order (by score), not merges: every split of a piece into two
    known pieces is a merge, ranked by the merged piece's id, then by its parts' ids."""
    merges = []
    for piece, _, kind in pieces:
        if kind != 1:            # only NORMAL pieces come from merges
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((vocab[piece], vocab[left], vocab[right], left, right))
    merges.sort()
    return [(left, right) for _, _, _, left, right in merges]
