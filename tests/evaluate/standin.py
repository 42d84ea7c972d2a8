"""A stand-in lm-eval model over characters: tokens are code points, scores come from a LogprobFn the test
builds by hand, so what lm-eval computes from them (through this repository's task files) is known exactly."""
from __future__ import annotations

from lm_eval.api.model import TemplateLM

from runtime.evaluate import harness, lm_tasks
from runtime.evaluate.scoring import loglikelihood
from runtime.evaluate.tasks import Task, write_normalized


class CharLM(TemplateLM):
    """Code points below 128 as tokens (others clipped to 127); NUL is end of text."""

    def __init__(self, forward_logprobs, *, max_length: int = 64, batch_size: int = 3):
        super().__init__()
        self._forward, self._max_length, self._batch_size = forward_logprobs, max_length, batch_size

    @property
    def eot_token_id(self) -> int:
        return 0

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return [min(ord(c), 127) for c in string]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        return loglikelihood([(context, continuation) for _, context, continuation in requests], self._forward,
                             max_length=self._max_length, batch_size=self._batch_size)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("not used by these tests")

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("not used by these tests")


def score(task: Task, forward_logprobs, directory, **lm_options) -> dict:
    """One local task as the evaluation stage runs it: normalized, through its task file, scored by lm-eval; the
    stage's result row."""
    data = write_normalized(task, directory / f"{task.name}.lm_eval.jsonl")
    output = harness.run(CharLM(forward_logprobs, **lm_options), [lm_tasks.local_task(task.name, task.kind, data)],
                         task_manager=lm_tasks.task_manager(None, defaults=False), num_fewshot=None, limit=None,
                         apply_chat_template=False, fewshot_as_multiturn=False, bootstrap_iters=100)
    [row] = harness.result_rows(output)
    return row
