# Verifiable rewards: plain functions reward(completion: str, answer: str) -> float, named in a config by a dotted
# path ("runtime.rl.rewards:exact_match", or "my_pkg.my_module.my_reward"), so a user's own reward is a function in
# an importable module. load_reward() turns a bad path into one error line; score() turns a reward that raises, or
# returns something that is no number, into one line naming the reward and the prompt.
from __future__ import annotations

import math
import numbers
import re
from typing import Sequence

# The loader is the schema's, which a launch checks rl.grpo.reward with (runtime/schema/prompts.py).
from runtime.schema.prompts import Reward, load_reward, one_line as _one_line  # noqa: F401

def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is the answer (also stripped), else 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def regex_match(completion: str, answer: str) -> float:
    """1.0 when the stripped completion matches the answer read as a regular expression (the whole of it: answer
    '4|four' accepts 'four' but not 'fourteen'), else 0.0. An answer that is no regex is a user error."""
    try:
        pattern = re.compile(answer)
    except re.error as error:
        raise ValueError(f"the answer {answer!r} is not a regular expression ({error})") from None
    return 1.0 if pattern.fullmatch(completion.strip()) else 0.0


def prefix_match(completion: str, answer: str) -> float:
    """Partial credit that is 1.0 only for an exact answer: the words (split on whitespace) the completion gets right
    from the start, before its first wrong one, over the longer of the two word counts. 'c a f' for 'c a f' is 1.0,
    'c a x' 2/3, 'c a f g' 3/4 (an extra word costs like a wrong one), 'x a f' 0. A random policy's first right word
    already scores, which is what GRPO needs to start learning (runtime/rl/synthetic.py)."""
    got, want = completion.split(), answer.split()
    if not got and not want:
        return 1.0
    right = 0
    for a, b in zip(got, want):
        if a != b:
            break
        right += 1
    return right / max(len(got), len(want))


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(completion: str, answer: str) -> float:
    """1.0 when the last number in the completion equals the answer's number (GSM8K style: '... so 1,234.'),
    commas ignored, else 0.0."""
    found = _NUMBER.findall(completion)
    try:
        return 1.0 if found and float(found[-1].replace(",", "")) == float(answer.replace(",", "")) else 0.0
    except ValueError:
        return 0.0


def score(reward: Reward, completions: Sequence[str], answers: Sequence[str], prompt_indices: Sequence[int],
          name: str | None = None) -> list[float]:
    """reward(completion, answer) of each completion. A reward that raises, or returns something that is no finite
    number, is a ValueError of one line naming it (`name`, else its qualified name) and the prompt's index."""
    name = name or f"{getattr(reward, '__module__', '?')}:{getattr(reward, '__qualname__', repr(reward))}"
    out = []
    for completion, answer, index in zip(completions, answers, prompt_indices, strict=True):
        try:
            value = reward(completion, answer)
        except Exception as error:
            raise ValueError(f"reward {name} failed on prompt {index}: {_one_line(error)}") from None
        if not isinstance(value, numbers.Real) or not math.isfinite(value):  # bools and numpy scalars count
            raise ValueError(f"reward {name} returned {value!r} on prompt {index}; a reward is a finite number")
        out.append(float(value))
    return out
