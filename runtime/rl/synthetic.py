"""A synthetic prompt set with exact answers that a tiny model learns by reinforcement alone, from random init.

    # train / valid / test {"prompt", "answer"} records, a word-level tokenizer and its ChatML tokenizer_config.json
    python -m runtime.rl.synthetic --output-dir data/rl_demo
    python -m runtime.rl.synthetic --output-dir data/rl_demo --num-symbols 8 --symbols-per-prompt 2 --seed 7

Each record is {"prompt": "repeat: c a f", "answer": "c a f"}: copy the symbols after "repeat:". The symbols are
the first num_symbols letters; the test prompts are drawn first and never appear in valid or train.

Why this task and this tokenizer. GRPO learns only from differences between the rewards of a prompt's sampled
completions, so a random policy has to earn some reward already. The tokenizer is word level: every symbol, the
task word, ':', the role names and the ChatML tokens are one token each, about 20 in all, so a random model
(nearly uniform over its vocabulary) puts about 1/20 of its mass on the right first symbol, and
runtime.rl.rewards:prefix_match gives partial credit for each right symbol from the start, so that first symbol
alone already scores. The prompts (num_symbols ** symbols_per_prompt of them) are combinations, so the held-out ones
were never seen: the model has to learn to copy by position, not to memorize answers.

Measured (defaults but num_test 100; tests/rl/test_rl_demo.py runs the first 100 steps): a Llama of hidden 64, 2
layers, 4 heads, 2 KV groups, ffn 128 from random init; GRPO with 32 prompts x 8 completions per step, temperature
1, max_completion_length 4, beta 0, loss dapo, AdamW lr 1e-3 constant (betas 0.9/0.99, no weight decay), clip 1.0;
one CPU thread, about 0.25 s a step. Greedy mean reward on 50 validation prompts, model seeds 0 / 1 / 2 / 3: step 0
0.00 / 0.03 / 0.00 / 0.03, step 50 0.16 / 0.13 / 0.16 / 0.13, step 100 0.36 / 0.40 / 0.42 / 0.41, step 150
0.71 / 0.70 / 1.00 / 1.00; on all 100 (another model seed) 1.00, every answer exact, at step 200. Higher rates
collapse the policy early (every completion of a prompt the same, so no signal left): on 2-symbol prompts lr 2e-3
stalled near 0.65 and 1e-2 near 0.05, where 1e-3 reached 1.00.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys
from pathlib import Path

from runtime.io.files import atomic_write_bytes, atomic_write_json
from runtime.schema.facts import USER_ERROR_EXIT_CODE
from runtime.sft.synthetic import already_written
from runtime.sft.synthetic import SPECIAL_TOKENS, tokenizer_config

TASK = "repeat"
UNKNOWN = "<unk>"
# The words the ChatML template writes besides the special tokens; "system" so a system prompt still tokenizes.
ROLE_WORDS = ("user", "assistant", "system")
FILES = ("train.jsonl", "valid.jsonl", "test.jsonl", "tokenizer.json", "tokenizer_config.json")
MAX_SYMBOLS = len(string.ascii_lowercase)


def symbols(num_symbols: int) -> list[str]:
    return list(string.ascii_lowercase[:num_symbols])


def make_splits(num_train: int, num_valid: int, num_test: int, seed: int, num_symbols: int = 10,
                symbols_per_prompt: int = 3) -> dict[str, list[dict]]:
    """Distinct prompts drawn test first, then valid, then train, so a larger num_train keeps the same test set and
    no prompt is in two splits."""
    _check(num_train=num_train, num_valid=num_valid, num_test=num_test, num_symbols=num_symbols,
           symbols_per_prompt=symbols_per_prompt)
    total, distinct = num_test + num_valid + num_train, num_symbols ** symbols_per_prompt
    if total > distinct:
        raise ValueError(f"num_train + num_valid + num_test = {total} is more than the {distinct} distinct prompts "
                         f"of num_symbols={num_symbols} and symbols_per_prompt={symbols_per_prompt}; ask for fewer "
                         "records or more symbols")
    rng, alphabet = random.Random(seed), symbols(num_symbols)
    # A sample of the prompts' numbers, each read as symbols_per_prompt digits in base num_symbols: distinct by
    # construction, with no redraws however close total comes to every prompt there is.
    records = []
    for number in rng.sample(range(distinct), total):
        digits = []
        for _ in range(symbols_per_prompt):
            number, digit = divmod(number, num_symbols)
            digits.append(alphabet[digit])
        answer = " ".join(digits)
        records.append({"prompt": f"{TASK}: {answer}", "answer": answer})
    return {"test": records[:num_test], "valid": records[num_test:num_test + num_valid],
            "train": records[num_test + num_valid:]}


def tokenizer_json(num_symbols: int) -> str:
    """A word-level tokenizer.json: SPECIAL_TOKENS (ids 0..3), <unk>, the role words, the task word, ':' and the
    symbols. Whitespace splits words and punctuation; decoding joins tokens with single spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [*SPECIAL_TOKENS, UNKNOWN, *ROLE_WORDS, TASK, ":", *symbols(num_symbols)]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([*SPECIAL_TOKENS, UNKNOWN])
    return tokenizer.to_str(pretty=True)


def write_demo(output_dir: str | os.PathLike, *, num_train: int = 600, num_valid: int = 100, num_test: int = 200,
               seed: int = 1234, num_symbols: int = 10, symbols_per_prompt: int = 3) -> bool:
    """Writes train/valid/test.jsonl, tokenizer.json, tokenizer_config.json and summary.json into output_dir.

    Returns False, writing nothing, when summary.json says the same arguments were already written. Each file is
    replaced atomically and summary.json goes last, so an interrupted run is redone, never taken as done."""
    settings = {"num_train": num_train, "num_valid": num_valid, "num_test": num_test, "seed": seed,
                "num_symbols": num_symbols, "symbols_per_prompt": symbols_per_prompt, "task": TASK}
    out = Path(output_dir)
    if already_written(out, settings, FILES):
        return False
    splits = make_splits(num_train, num_valid, num_test, seed, num_symbols, symbols_per_prompt)
    (out / "summary.json").unlink(missing_ok=True)
    for name, records in splits.items():
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        atomic_write_bytes(out / f"{name}.jsonl", lines.encode("utf-8"))
    text = tokenizer_json(num_symbols)
    atomic_write_bytes(out / "tokenizer.json", text.encode("utf-8"))
    atomic_write_json(out / "tokenizer_config.json", tokenizer_config(text))
    counts = {name: len(records) for name, records in splits.items()}
    vocab = len(json.loads(text)["model"]["vocab"])
    atomic_write_json(out / "summary.json", {**settings, "counts": counts, "vocab_size": vocab,
                                             "files": sorted(FILES)})
    return True




def _check(**values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key}={value!r} must be a positive integer")
    if not 2 <= values["num_symbols"] <= MAX_SYMBOLS:
        raise ValueError(f"num_symbols={values['num_symbols']} must be in 2..{MAX_SYMBOLS} (the letters a-z)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.rl.synthetic",
                                     description="Write a synthetic prompt set with exact answers for GRPO.")
    parser.add_argument("--output-dir", required=True, help="directory for the jsonl splits and tokenizer")
    for name, default, what in (("num-train", 600, "training prompts"), ("num-valid", 100, "validation prompts"),
                                ("num-test", 200, "held-out test prompts"), ("seed", 1234, "everything follows"),
                                ("num-symbols", 10, "letters a.. used"),
                                ("symbols-per-prompt", 3, "symbols to copy")):
        parser.add_argument(f"--{name}", type=int, default=default, help=f"{what} (default {default})")
    args = parser.parse_args(argv)
    try:
        wrote = write_demo(args.output_dir, num_train=args.num_train, num_valid=args.num_valid,
                           num_test=args.num_test, seed=args.seed, num_symbols=args.num_symbols,
                           symbols_per_prompt=args.symbols_per_prompt)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    print(f"{'wrote' if wrote else 'already written, nothing to do:'} {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
