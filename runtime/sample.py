"""Print a model's answer to one prompt, from the newest complete checkpoint of a run (or a named one).

    python -m runtime.sample --checkpoint results/sft_demo/fine_tuning/checkpoints --prompt "add: 17 + 25"
    python -m runtime.sample --checkpoint results/gpt_tiny/training/checkpoints --prompt "def main(" --raw \\
        --max-new-tokens 64 --temperature 0.8 --top-p 0.95 --seed 1
    torchrun --nproc-per-node 2 -m runtime.sample --checkpoint <dir> --prompt "..."    # tensor parallel, tp=2

The prompt becomes one user message rendered with the chat template, with its generation prompt, when there is
a template (--chat-template, else the run's model.data.chat_template, else the tokenizer_config.json's beside the
tokenizer); otherwise, or with --raw, the text itself is the prompt. Generation stops at the end of the turn (or
eos), or after --max-new-tokens. Greedy unless --temperature is above 0. A checkpoint of any layout loads, LoRA
runs included (runtime/evaluate/model.py load_model); every rank of a torchrun is one tensor-parallel rank.
Mistakes end with one `error: ...` line and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from runtime.evaluate.report import print_user_error
from runtime.schema.facts import USER_ERROR_EXIT_CODE
from runtime.schema.choices import ACCELERATORS, CHAT_TEMPLATES


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    stop_ids: set[int]
    pad_id: int
    vocab_size: int                     # the tokenizer's: the model's vocabulary is padded past it
    decode: Callable[[list[int]], str]
    rendered_as: str                    # for the log: which template, or raw text


def encode_prompt(text: str, tokenizer_path: str, chat_template: str | None, raw: bool) -> Prompt:
    """The prompt's tokens and how to stop and decode, with the chat template when there is one and not raw."""
    from runtime.schema.chat import ChatTokenizer, tokenizer_files

    tokenizer_json, config_json = tokenizer_files(tokenizer_path)
    config = json.loads(config_json.read_text(encoding="utf-8")) if config_json.is_file() else {}
    if not raw and (chat_template or config.get("chat_template")):
        chat = ChatTokenizer(tokenizer_json, chat_template)
        return Prompt(chat.prompt_ids([{"role": "user", "content": text}]), set(chat.stop_ids), chat.pad_id,
                      chat.tokenizer.get_vocab_size(with_added_tokens=True), chat.decode,
                      f"chat template {chat.name}")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = tokenizer.token_to_id(eos) if isinstance(eos, str) else None
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise ValueError("--prompt: the text encodes to no tokens; give a non-empty prompt")
    return Prompt(ids, set() if eos_id is None else {eos_id}, eos_id or 0,
                  tokenizer.get_vocab_size(with_added_tokens=True),
                  lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True), "raw text")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.sample", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a run's checkpoint directory (its newest complete checkpoint) or one step_* directory")
    parser.add_argument("--name", default=None, help="one checkpoint's directory name inside --checkpoint")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one the run trained with)")
    parser.add_argument("--prompt", required=True, help="the user message (or, with --raw, the text to continue)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: all)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed; the same seed, the same text")
    parser.add_argument("--chat-template", choices=CHAT_TEMPLATES, default=None,
                        help="a built-in template (default: the run's, else the tokenizer's own)")
    parser.add_argument("--raw", action="store_true", help="continue the prompt text as is, with no template")
    parser.add_argument("--accelerator", choices=list(ACCELERATORS), default=None,
                        help="cpu, gpu or neuron (default: gpu when torch sees one, else cpu)")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0") or 0)
    device = None
    try:
        import torch

        from runtime.device import init_device, shutdown
        from runtime.evaluate.model import load_model
        from runtime.generate import check_settings, generate

        check_settings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
        accelerator = args.accelerator or ("gpu" if torch.cuda.is_available() else "cpu")
        device = init_device(accelerator)
        loaded = load_model(args.checkpoint, args.name, tp=device.world_size, pp=1, vpp=None, device=device,
                            tokenizer_path=args.tokenizer)
        model_section = loaded.training.get("model") or {}
        tokenizer_path = args.tokenizer or model_section["tokenizer"]["model"]
        run_template = (model_section.get("data") or {}).get("chat_template")
        prompt = encode_prompt(args.prompt, str(tokenizer_path), args.chat_template or run_template, args.raw)
        if device.is_main:
            print(f"# {loaded.location} (step {loaded.step}) at {loaded.topo!r}; prompt: {prompt.rendered_as}, "
                  f"{len(prompt.ids)} tokens", file=sys.stderr, flush=True)
        (tokens,) = generate(loaded.model, [prompt.ids], max_new_tokens=args.max_new_tokens,
                             stop_ids=prompt.stop_ids, temperature=args.temperature, top_p=args.top_p,
                             seed=args.seed, pad_id=prompt.pad_id, vocab_size=prompt.vocab_size)
        if device.is_main:
            print(prompt.decode(tokens), flush=True)
    except (ValueError, FileNotFoundError, KeyError) as error:
        if rank == 0:
            print_user_error(error)
        return USER_ERROR_EXIT_CODE
    finally:
        if device is not None:
            shutdown(device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
