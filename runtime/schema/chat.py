"""Chat templates rendered as Hugging Face's apply_chat_template renders them, and the assistant-only loss mask.

The tokenizer is a `tokenizer.json` read with the `tokenizers` library (the runtime does not depend on
transformers); `tokenizer_config.json` beside it may give `chat_template`, `bos_token`, `eos_token`, `pad_token`.
Templates run in jinja2's immutable sandbox with trim_blocks and lstrip_blocks, the settings transformers uses,
so a model's own template renders here exactly as it did for the people who trained it.

Where the assistant turns are: for assistant message i, render(messages[:i], add_generation_prompt=True) and
render(messages[:i+1]) are both prefixes of render(messages); the text between them is the turn, with the
end-of-turn marker the template writes after it (<|im_end|>, <|eot_id|>, eos), so the model learns to stop.
Each piece is tokenized on its own, so no token straddles the edge of a turn and the mask is exact.

Part of the schema because a launch counts preference prompts with it (preference_pairs.py) exactly as the job
will; jinja2 (a launcher dependency) and tokenizers (a runtime one) are imported only when a tokenizer is loaded.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from runtime.schema.records import Message, read_all

TEMPLATE_KEY = "model.data.chat_template"
TOKENIZER_KEY = "model.tokenizer.model"

# Each built-in: its jinja text and the special tokens it writes, which must be single tokens of the tokenizer.
BUILTIN_TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "chatml": ("{% for message in messages %}"
               "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
               "{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
               ("<|im_start|>", "<|im_end|>")),
    # Llama-3 instruct: <|begin_of_text|>, then <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>.
    "llama3": ("{{ '<|begin_of_text|>' }}"
               "{% for message in messages %}"
               "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
               " + '<|eot_id|>' }}"
               "{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
               ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    # Text markers only, for tokenizers without chat tokens; the answer ends with eos (checked in _check_tokens).
    "plain": ("{{ bos_token }}"
              "{% for message in messages %}"
              "{% if message['role'] == 'assistant' %}{{ '### Assistant:\\n' + message['content'] + eos_token }}"
              "{% else %}{{ '### ' + message['role'] | capitalize + ':\\n' + message['content'] }}{% endif %}"
              "{{ '\\n\\n' }}"
              "{% endfor %}"
              "{% if add_generation_prompt %}{{ '### Assistant:\\n' }}{% endif %}",
              ()),
}


def tokenizer_files(tokenizer_path: str | os.PathLike) -> tuple[Path, Path]:
    """(tokenizer.json, the tokenizer_config.json beside it, which may not exist); a directory means its files."""
    path = Path(tokenizer_path)
    tokenizer_json = path / "tokenizer.json" if path.is_dir() else path
    if not tokenizer_json.is_file():
        raise ValueError(f"{TOKENIZER_KEY} = {os.fspath(tokenizer_path)!r}: no such tokenizer.json; point it at a "
                         "Hugging Face tokenizer.json or the directory holding one")
    return tokenizer_json, tokenizer_json.parent / "tokenizer_config.json"


class ChatTokenizer:
    """A tokenizer and a chat template, loaded once: training examples with their loss masks, prompts to generate
    from, decoding, and the ids that end an assistant turn."""

    def __init__(self, tokenizer_path: str | os.PathLike, chat_template: str | None = None):
        from tokenizers import Tokenizer

        self.tokenizer_json, self.config_json = tokenizer_files(tokenizer_path)
        try:
            self.tokenizer = Tokenizer.from_file(str(self.tokenizer_json))
        except Exception as err:  # the library raises a bare Exception for a file it cannot parse
            raise ValueError(f"{self.tokenizer_json}: not a Hugging Face tokenizer.json ({err}); fix "
                             f"{TOKENIZER_KEY}") from None
        config = _read_config(self.config_json)
        self.bos_token, self.eos_token, self.pad_token = (token_text(config.get(k)) for k in
                                                          ("bos_token", "eos_token", "pad_token"))
        self.name, self.template_text = self._choose_template(chat_template, config)
        self._template = _compile(self.template_text, self.name)
        self._rendered: dict[tuple, str] = {}  # render()'s last results
        pad = next((t for t in (self.pad_token, self.eos_token) if t and self._single_id(t) is not None), None)
        self.pad_id = self._single_id(pad) if pad else 0
        self.stop_ids = self._find_stop_ids()

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        # Locating the turns renders each conversation's prompts (the prefixes before its assistant turns, with the
        # generation prompt), and a preference pair's two examples and its prompt share theirs: 3 renders of one.
        # A template call costs several times the key; without this, jinja's per-call setup was most of a
        # preference dataset's encoding time.
        key = _render_key(messages) if add_generation_prompt else None
        if key is not None and key in self._rendered:
            return self._rendered[key]
        from jinja2.exceptions import TemplateError

        try:
            text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         pad_token=self.pad_token or "")
        except (TemplateError, TypeError) as err:
            raise ValueError(f"chat template {self.name} failed ({err}); fix the record or the template") from None
        if key is not None:
            if len(self._rendered) >= _RENDERS_KEPT:
                self._rendered.pop(next(iter(self._rendered)))  # the oldest: dicts keep insertion order
            self._rendered[key] = text
        return text

    def encode_example(self, messages: list[Message]) -> tuple[list[int], list[int]]:
        """(token ids, 1 where the token belongs to an assistant turn and 0 elsewhere) for one conversation."""
        return self.encode_examples([messages])[0]

    def encode_examples(self, conversations: list[list[Message]],
                        where: list[str] | None = None) -> list[tuple[list[int], list[int]]]:
        """encode_example for each conversation, with one tokenizer call for all (the library spreads a batch over
        threads); `where` names each conversation (file:line) in errors."""
        cut = []
        for number, messages in enumerate(conversations):
            try:
                cut.append(self._pieces(messages, add_generation_prompt=False))
            except ValueError as err:
                raise ValueError(f"{where[number]}: {err}" if where else str(err)) from None
        encodings = iter(self._encode_texts([text for pieces in cut for text, _ in pieces]))
        examples = []
        for pieces in cut:
            ids: list[int] = []
            mask: list[int] = []
            for _, is_assistant in pieces:
                encoding = next(encodings)
                ids += encoding
                mask += [int(is_assistant)] * len(encoding)
            examples.append((ids, mask))
        return examples

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The tokens before the final assistant message, ending with the generation prompt; the same tokens
        training saw before that message (the pieces are cut the same way)."""
        return self.prompts_ids([messages])[0]

    def prompts_ids(self, conversations: list[list[Message]], where: list[str] | None = None) -> list[list[int]]:
        """prompt_ids for each conversation, with one tokenizer call for all; `where` names each in errors."""
        cut = []
        for number, messages in enumerate(conversations):
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
            try:
                cut.append(self._pieces(messages[:last], add_generation_prompt=True))
            except ValueError as err:
                raise ValueError(f"{where[number]}: {err}" if where else str(err)) from None
        encodings = iter(self._encode_texts([text for pieces in cut for text, _ in pieces]))
        return [[i for _ in pieces for i in next(encodings)] for pieces in cut]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _pieces(self, messages: list[Message], add_generation_prompt: bool) -> list[tuple[str, bool]]:
        """The rendered conversation cut into (text, is_assistant_turn) pieces, in order, none empty."""
        full = self.render(messages, add_generation_prompt)
        pieces, cursor = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = len(self._prefix(full, messages[:i], True))
            # The conversation's own last turn ends where the whole does: no second render of it.
            last = i + 1 == len(messages) and not add_generation_prompt
            end = len(full) if last else len(self._prefix(full, messages[:i + 1], False))
            if start < cursor or end < start:
                raise ValueError(self._unstable(f"the generation prompt before message {i} is not after the "
                                                "previous assistant turn"))
            pieces += [(full[cursor:start], False), (full[start:end], True)]
            cursor = end
        pieces.append((full[cursor:], False))
        return [(text, is_assistant) for text, is_assistant in pieces if text]

    def _prefix(self, full: str, messages: list[Message], add_generation_prompt: bool) -> str:
        text = self.render(messages, add_generation_prompt)
        if not full.startswith(text):
            prompt = " with add_generation_prompt" if add_generation_prompt else ""
            raise ValueError(self._unstable(f"rendering the first {len(messages)} messages{prompt} does not give "
                                            "the start of the whole conversation"))
        return text

    def _unstable(self, what: str) -> str:
        return (f"chat template {self.name} is not prefix-stable: {what}, so the assistant turns cannot be "
                f"located; set {TEMPLATE_KEY} to a built-in ({', '.join(BUILTIN_TEMPLATES)})")

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        # add_special_tokens=False: the template writes BOS and the like itself; special tokens in the text still
        # come out as their single ids, because the tokenizer knows them as added tokens.
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)] if texts else []

    def _single_id(self, token: str) -> int | None:
        """The id of `token` when the tokenizer reads it as one token, else None."""
        token_id = self.tokenizer.token_to_id(token)
        ids = self.tokenizer.encode(token, add_special_tokens=False).ids
        return token_id if token_id is not None and ids == [token_id] else None

    def _choose_template(self, chat_template: str | None, config: dict[str, Any]) -> tuple[str, str]:
        if chat_template is None:
            text = config.get("chat_template")
            if isinstance(text, list):  # the named-templates form: [{"name": "default", "template": ...}, ...]
                text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"),
                            None)
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{TEMPLATE_KEY} is unset and {self.config_json} has no chat_template; set "
                                 f"{TEMPLATE_KEY} to a built-in ({', '.join(BUILTIN_TEMPLATES)})")
            return f"{self.config_json}:chat_template", text
        if chat_template not in BUILTIN_TEMPLATES:
            if Path(chat_template).is_file():  # a jinja2 file of the user's own
                return chat_template, Path(chat_template).read_text(encoding="utf-8")
            raise ValueError(f"{TEMPLATE_KEY} = {chat_template!r} is neither a built-in "
                             f"({', '.join(BUILTIN_TEMPLATES)}) nor a jinja2 file; or set it to null for "
                             f"{self.config_json}'s chat_template")
        text, tokens = BUILTIN_TEMPLATES[chat_template]
        if chat_template == "plain" and not self.eos_token:
            raise ValueError(f"{TEMPLATE_KEY} = 'plain' ends answers with the eos token, but {self.config_json} "
                             "names no eos_token; add one there or choose chatml or llama3")
        missing = [t for t in (*tokens, self.eos_token if chat_template == "plain" else None)
                   if t and self._single_id(t) is None]
        if missing:
            raise ValueError(f"{TEMPLATE_KEY} = {chat_template!r} needs the special token {missing[0]}, which "
                             f"{self.tokenizer_json} lacks; choose a template this tokenizer has tokens for "
                             f"({', '.join(BUILTIN_TEMPLATES)}) or null for the tokenizer's own")
        return chat_template, text

    def _find_stop_ids(self) -> set[int]:
        """eos, plus the first special token the template writes after an assistant's content (its end of turn)."""
        eos = self._single_id(self.eos_token) if self.eos_token else None
        stops = set() if eos is None else {eos}
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        try:
            turn = self._pieces(probe, add_generation_prompt=False)
        except ValueError:
            return stops  # a template that cannot render the probe fails on the first real record instead
        after = next((text for text, is_assistant in turn if is_assistant), "").partition("Hello")[2]
        special = {i for i, token in self.tokenizer.get_added_tokens_decoder().items() if token.special}
        end_of_turn = next((i for i in self._encode_texts([after])[0] if i in special), None) if after else None
        return stops if end_of_turn is None else stops | {end_of_turn}


def generation_examples(files: list[str | os.PathLike], chat: ChatTokenizer,
                        limit: int | None = None) -> list[tuple[list[int], str]]:
    """(prompt ids, the final assistant message's content) per record, for exact-match evaluation."""
    examples = []
    for record in read_all(files)[:limit]:
        final = next(m for m in reversed(record.messages) if m["role"] == "assistant")
        try:
            examples.append((chat.prompt_ids(record.messages), final["content"]))
        except ValueError as err:
            raise ValueError(f"{record.where}: {err}") from None
    return examples


# More than a preference chunk's prompts (chunks() in preference_pairs.py): its examples are all cut before its
# prompts are encoded.
_RENDERS_KEPT = 4096


def _render_key(messages: list[Message]) -> tuple | None:
    """A conversation as a hashable value, or None for one that holds something unhashable (a list of content
    parts, say): such a conversation is simply rendered each time."""
    key = tuple(tuple(m.items()) for m in messages)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _compile(text: str, name: str):
    from jinja2 import TemplateSyntaxError
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    try:
        return environment.from_string(text)
    except TemplateSyntaxError as err:
        raise ValueError(f"chat template {name}: line {err.lineno}: {err.message}; fix the template or set "
                         f"{TEMPLATE_KEY} to a built-in ({', '.join(BUILTIN_TEMPLATES)})") from None


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); fix the file or remove it") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object; fix the file or remove it")
    return config


def token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a token as a string or as {"content": ..., ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


# The special tokens a tokenizer.json without a tokenizer_config.json has: the first of each name it holds (GPT-2
# uses <|endoftext|> for bos and eos). The export writes them into its tokenizer_config.json, and the lm-eval
# backend reads the same, so our scores and transformers' on the export condition on the same tokens.
SPECIAL_TOKEN_NAMES = {
    "bos_token": ("<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>"),
    "eos_token": ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>"),
    "unk_token": ("<unk>",),
    "pad_token": ("<pad>", "<|pad|>"),
}


def special_tokens(tokenizer: dict, config: dict[str, Any]) -> dict[str, str]:
    """{"bos_token": text, ...} of a parsed tokenizer.json: its tokenizer_config.json's (`config`) where it names
    them, else the first known name in its vocabulary."""
    known = {entry["content"] for entry in tokenizer.get("added_tokens", [])}
    vocab = (tokenizer.get("model") or {}).get("vocab") or {}
    known |= set(vocab) if isinstance(vocab, dict) else {piece for piece, _ in vocab}  # Unigram: [piece, score]
    found = {key: next((t for t in names if t in known), None) for key, names in SPECIAL_TOKEN_NAMES.items()}
    found.update({key: token for key in SPECIAL_TOKEN_NAMES if (token := token_text(config.get(key)))})
    return {key: token for key, token in found.items() if token is not None}


def token_id(tokenizer: dict, token: str) -> int:
    """The id of `token` in a parsed tokenizer.json (its added tokens first, then its vocabulary)."""
    for entry in tokenizer.get("added_tokens", []):
        if entry["content"] == token:
            return int(entry["id"])
    vocab = tokenizer["model"]["vocab"]
    pieces = vocab if isinstance(vocab, dict) else {piece: i for i, (piece, _) in enumerate(vocab)}
    if token not in pieces:
        raise ValueError(f"tokenizer: the special token {token!r} its tokenizer_config.json names is neither an "
                         f"added token nor in the vocabulary of its tokenizer.json; fix the name or add the token")
    return int(pieces[token])


def end_of_document_id(tokenizer_path: str | os.PathLike) -> int | None:
    """The id that ends a document in pretraining data: the tokenizer's eos (Megatron's tokenizer.eod: GPT-2's
    <|endoftext|>, Llama 3's <|end_of_text|>), by the export's rule (special_tokens), or None when it has none."""
    tokenizer_json, config_json = tokenizer_files(tokenizer_path)
    parsed = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    eos = special_tokens(parsed, _read_config(config_json)).get("eos_token")
    return None if eos is None else token_id(parsed, eos)


def chat_stop_ids(tokenizer_path: str | os.PathLike, config: dict[str, Any]) -> list[int]:
    """The ids a chat model's generation ends at besides eos: its template's end-of-turn tokens (<|im_end|>,
    <|eot_id|>), when the tokenizer_config.json (`config`) holds a chat template, as the generation_config.json of
    Llama 3 and Qwen instruct models lists them; [] otherwise. The export writes them, lm-eval's backend stops at them."""
    if not config.get("chat_template"):
        return []
    return sorted(ChatTokenizer(tokenizer_path).stop_ids)
