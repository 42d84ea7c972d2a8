"""lm-evaluation-harness (EleutherAI lm-eval) over the runtime: its tasks, prompts and metrics, our model.

`RuntimeLM` is an lm-eval model backend (a `TemplateLM`, as lm-eval's own `hf` backend is) over a checkpoint loaded
under any layout (runtime/evaluate/model.py): `loglikelihood` (lm-eval's own context/continuation split),
`loglikelihood_rolling` (lm-eval's own rolling windows) and `generate_until` (greedy, lm-eval's own stop-sequence
handling), with the chat template applied when a task asks for it. Everything that decides a score is lm-eval's or
mirrors its `hf` backend, so a checkpoint scores what its Hugging Face export scores there:
- tokens: the checkpoint's tokenizer.json through the tokenizers library (the same file and rules
  transformers' fast tokenizer runs), special tokens added as `hf` adds them, the same bos/eos the export writes
  (runtime/schema/chat.py special_tokens);
- requests: sorted longest first and right-padded (causal attention never looks at the padding), context cut from
  the left to max_length + 1 tokens; summed in float64;
- generation: contexts cut to max_length - max_gen_toks, greedy argmax over the whole (padded) vocabulary as the
  exported model has it, stopping at the export's generation eos ids (the chat end token too) or once the decoded
  text holds a stop string, then cut at the first stop string.

Every rank runs lm-eval identically (it sees one process: rank 0 of 1), so tasks, few-shot draws and metrics are the
same everywhere; the model calls inside are collective. Data-parallel ranks split the batches (batch k on DP rank
k mod dp) and sum the results over DP; tensor- and pipeline-parallel ranks run every batch of their DP rank
together. Results are written by the main rank.
"""
from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from runtime.evaluate.model import LoadedModel, forward_logprobs_fn, greedy_tokens_fn
from runtime.evaluate.scoring import loglikelihood
from runtime.generate import generate
from runtime.parallel import collectives as C
from runtime.schema.chat import chat_stop_ids, special_tokens, token_id, tokenizer_files


class RuntimeLM(TemplateLM):
    """lm-eval's model interface over a LoadedModel; see the module docstring for what it mirrors."""

    backend = "causal"

    def __init__(self, loaded: LoadedModel, device, *, tokenizer_path: str, batch_size: int, max_length: int,
                 max_gen_toks: int = 256, progress: Callable[[str, int, int], None] | None = None):
        super().__init__()
        from tokenizers import Tokenizer

        self._loaded, self._device, self._batch_size, self._max_length = loaded, device, batch_size, max_length
        self._max_gen_toks, self._progress = max_gen_toks, progress
        self._tokenizer_json, config_json = tokenizer_files(tokenizer_path)
        self.tok = Tokenizer.from_file(str(self._tokenizer_json))
        parsed = json.loads(self._tokenizer_json.read_text(encoding="utf-8"))
        self._config = json.loads(config_json.read_text(encoding="utf-8")) if config_json.is_file() else {}
        specials = {key: token_id(parsed, text) for key, text in special_tokens(parsed, self._config).items()}
        self._eos, self._bos = specials.get("eos_token"), specials.get("bos_token")
        # Where the export's generation_config.json stops (runtime/convert/hf.py): a chat model's end of turn, else eos.
        stops = chat_stop_ids(self._tokenizer_json, self._config)
        self._stop_ids = set(stops) if stops else ({self._eos} if self._eos is not None else set())
        self._forward = forward_logprobs_fn(loaded, device)
        self._greedy = greedy_tokens_fn(loaded, device) if loaded.topo.pp.size > 1 else None
        self._dp = loaded.topo.dp

    # ---- what lm-eval asks of a model ------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int | None:  # None only for a tokenizer without one: see prefix_token_id
        return self._eos

    @property
    def prefix_token_id(self) -> int:  # what an empty context conditions on, as `hf`: bos, else eos
        if self._bos is None and self._eos is None:
            raise ValueError(f"{self._tokenizer_json}: no beginning- or end-of-text token, which an empty context "
                             f"and a rolling window start from; name one (bos_token, eos_token) in the "
                             f"tokenizer_config.json beside it")
        return self._bos if self._bos is not None else self._eos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self._tokenizer_json.parent).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        # As `hf`: the tokenizer's own special tokens unless told otherwise, and none where the text already
        # starts with the prefix token (a chat template that writes its bos).
        if add_special_tokens is None:
            prefix = self._bos if self._bos is not None else self._eos
            add_special_tokens = prefix is None or not string.startswith(self.tok_decode([prefix], False))
        ids = self.tok.encode(string, add_special_tokens=add_special_tokens).ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        return self.tok.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(context, continuation) for _, context, continuation in requests]
        return self._score(pairs, "loglikelihood")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for number, (text,) in enumerate(request.args for request in requests):
            for window in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(window)
                owners.append(number)
        totals = [0.0] * len(requests)
        for number, (value, _) in zip(owners, self._score(windows, "loglikelihood_rolling")):
            totals[number] += value
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = None if self._eos is None else self.tok_decode([self._eos], skip_special_tokens=False)
        groups: dict[str, list[int]] = {}  # requests with the same generation settings generate together
        for number, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(number)
        out: list[str] = [""] * len(requests)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self._max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise ValueError("generate_until: this backend decodes greedily; the task asks to sample "
                                 f"({ {k: v for k, v in kwargs.items() if k in ('do_sample', 'temperature')} }): "
                                 "set the task's generation_kwargs do_sample: false")
            if max_gen_toks >= self.max_length:
                raise ValueError(f"generate_until: max_gen_toks {max_gen_toks} leaves no context within the "
                                 f"model's max_length {self.max_length}; lower the task's max_gen_toks")
            keep = self.max_length - max_gen_toks
            # An empty context (no bos added) starts from the prefix token, as an empty loglikelihood context does.
            contexts = [self.tok_encode(requests[n].args[0], left_truncate_len=keep) or [self.prefix_token_id]
                        for n in members]
            for n, tokens in zip(members, self._generate(contexts, max_gen_toks, until)):
                out[n] = postprocess_generated_text(self.tok_decode(tokens), stop=until, think_end_token=None)
        return out

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return render_chat(self._chat, chat_history, add_generation_prompt)

    @functools.cached_property
    def _chat(self):
        from runtime.schema.chat import ChatTokenizer

        return ChatTokenizer(self._tokenizer_json)  # the tokenizer's own template (tokenizer_config.json)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        template = self._config.get("chat_template")
        if not isinstance(template, str) or not template:
            raise ValueError(f"apply_chat_template: {self._tokenizer_json.parent / 'tokenizer_config.json'} has no "
                             "chat_template; evaluate without apply_chat_template or give the tokenizer one")
        return template

    # ---- the model calls, shared over data parallelism ---------------------------------------------------------

    def _owns(self, batch: int) -> bool:
        return batch % self._dp.size == self._dp.rank

    def _score(self, pairs: list[tuple[list[int], list[int]]], what: str) -> list[tuple[float, bool]]:
        report = (lambda done, total: self._progress(what, done, total)) if self._progress else None
        mine = loglikelihood(pairs, self._forward, max_length=self.max_length, batch_size=self._batch_size,
                             progress=report, owns=self._owns if self._dp.size > 1 else None)
        if self._dp.size == 1:
            return mine
        # [float32 high part, float32 remainder, greedy]: a float64 sum through a float32 collective, to ~1e-15.
        table = torch.zeros(len(pairs), 3, dtype=torch.float32)
        for row, result in enumerate(mine):
            if result is not None:
                high = float(torch.tensor(result[0], dtype=torch.float32))
                table[row] = torch.tensor([high, result[0] - high, float(result[1])])
        table = self._sum_over_dp(table)
        return [(float(high) + float(low), bool(greedy)) for high, low, greedy in table.tolist()]

    def _generate(self, contexts: list[list[int]], max_gen_toks: int, until: list[str]) -> list[list[int]]:
        """Greedy tokens after each context, in batches of similar lengths shared over DP ranks."""
        order = sorted(range(len(contexts)), key=lambda i: (-len(contexts[i]), i))
        batches = [order[start:start + self._batch_size] for start in range(0, len(order), self._batch_size)]
        # Token + 1 per generated position, 0 after the end: rows a DP rank did not generate sum in as zeros.
        table = torch.zeros(len(contexts), max_gen_toks, dtype=torch.float32)
        for number, batch in enumerate(batches):
            if self._dp.size > 1 and not self._owns(number):
                continue
            prompts = [contexts[i] for i in batch]
            stop = lambda row, tokens: any(s and s in self.tok_decode(tokens) for s in until)  # noqa: E731
            if self._greedy is not None:
                outs = self._generate_by_forward(prompts, max_gen_toks, stop)
            else:
                outs = generate(self._loaded.model, prompts, max_new_tokens=max_gen_toks, stop_ids=self._stop_ids,
                                pad_id=self._eos or 0, finished=stop)
            for i, tokens in zip(batch, outs):
                if tokens:
                    table[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.float32) + 1
            if self._progress:
                self._progress("generate_until", sum(len(b) for b in batches[:number + 1]), len(contexts))
        if self._dp.size > 1:
            table = self._sum_over_dp(table)
        return [[int(t) - 1 for t in row if t > 0] for row in table.tolist()]

    def _generate_by_forward(self, prompts: list[list[int]], max_gen_toks: int, stop) -> list[list[int]]:
        """Greedy decoding through whole-prefix forwards (any layout; runtime/generate.py needs pp = 1)."""
        outs: list[list[int]] = [[] for _ in prompts]
        active = [True] * len(prompts)
        positions = self._loaded.cfg.max_position_embeddings
        for _ in range(max_gen_toks):
            rows = [prompt + out for prompt, out in zip(prompts, outs)]
            ids = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.long)  # right padding: never read
            for b, row in enumerate(rows):
                ids[b, :len(row)] = torch.tensor(row, dtype=torch.long)
            for b, token in enumerate(self._greedy(ids, [len(row) for row in rows])):
                if not active[b]:
                    continue
                if token in self._stop_ids:
                    active[b] = False
                    continue
                outs[b].append(token)
                active[b] = len(rows[b]) + 1 <= positions and not stop(b, outs[b])
            if not any(active):
                break
        return outs

    def _sum_over_dp(self, table: torch.Tensor) -> torch.Tensor:
        on_device = table.to(self._device.torch_device)
        C.all_reduce(on_device, self._dp)
        self._device.step_boundary()
        return on_device.cpu()

def render_chat(chat, history: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """The prompt text of a chat history, as `hf` has transformers render it: with the generation prompt, or
    continuing the final (assistant) message, the text cut right after its content (no end of turn)."""
    text = chat.render(history, add_generation_prompt=add_generation_prompt)
    if add_generation_prompt or not history or history[-1]["role"] != "assistant":
        return text
    final = history[-1]["content"]
    final = final if final in text else final.strip()
    return text[:text.rindex(final) + len(final)]


def run(lm: RuntimeLM, tasks: list[str | dict], *, task_manager, num_fewshot: int | None, limit: float | None,
        apply_chat_template: bool, fewshot_as_multiturn: bool, bootstrap_iters: int, log_samples: bool = False) -> dict:
    """lm-eval's simple_evaluate over `lm` (its default seeds, so few-shot draws are lm-eval's own): its results
    dict (results, n-samples, configs, versions, ...)."""
    import lm_eval

    # lm-eval hands its results back only where LOCAL_RANK is 0 (its tensor-parallel backends compute on every
    # rank and report on one): every rank here runs it as the one process it sees, so each gets them.
    local_rank = os.environ.pop("LOCAL_RANK", None)
    try:
        return lm_eval.simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, batch_size=lm._batch_size,
            apply_chat_template=apply_chat_template,
            fewshot_as_multiturn=fewshot_as_multiturn and apply_chat_template, task_manager=task_manager,
            log_samples=log_samples, bootstrap_iters=bootstrap_iters)
    finally:
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = local_rank


def result_rows(results: dict) -> list[dict[str, Any]]:
    """lm-eval's results -> the stage's rows ({"task", "type": "lm_eval", "num_examples", metric, metric_stderr}):
    one per task and group, metrics under their own names (lm-eval's "acc,none" is "acc"; another filter keeps
    its name after the metric: "exact_match,strict-match" is "exact_match_strict-match")."""
    rows = []
    samples = results.get("n-samples", {})
    for name, metrics in results.get("results", {}).items():
        row: dict[str, Any] = {"task": name, "type": "lm_eval",
                               "num_examples": (samples.get(name) or {}).get("effective", "")}
        for key, value in metrics.items():
            if key == "alias" or "," not in key:
                continue
            metric, _, filter_name = key.partition(",")
            stderr = metric.endswith("_stderr")
            base = metric[:-len("_stderr")] if stderr else metric
            label = base if filter_name == "none" else f"{base}_{filter_name}"
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row[f"{label}_stderr" if stderr else label] = None if math.isnan(value) else float(value)
            elif stderr:
                row[f"{label}_stderr"] = None  # lm-eval writes "N/A" where it has none
        rows.append(row)
    return rows


def results_json(results: dict) -> str:
    """lm-eval's results as its own CLI writes them (numbers, strings, whatever else as text)."""
    return json.dumps(results, indent=2, default=lm_utils.handle_non_serializable, ensure_ascii=False)

