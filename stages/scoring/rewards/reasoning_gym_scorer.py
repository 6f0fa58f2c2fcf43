"""The `reasoning_gym` reward: a reasoning-gym task's own scorer on the answer a completion states.

Rows of a `path: reasoning_gym` source (stages/data/reasoning_gym_source.py) carry a `reasoning_gym` column, the
JSON record of their entry and of how the package makes it. The answer is what reasoning-gym's own
`utils.extract_answer` reads (the last `<answer>...</answer>` block); a completion without one states none, and the
task's `score_answer(None, entry)` scores that as the task does (0.0 for most, 0.01 for countdown).
"""

from __future__ import annotations

import json

from stages.data import reasoning_gym_source as gym
from stages.scoring.rewards.common import SampleError, completion_text


def stated(text: str) -> str | None:
    """The answer a completion states, as reasoning-gym reads it: its last `<answer>` block, stripped; None
    without one.

    >>> stated("<answer>1</answer> no, <answer> 7 </answer>"), stated("the answer is 7")
    ('7', None)
    """
    from reasoning_gym.utils import extract_answer

    return extract_answer(text)


def reasoning_gym_reward(prompts=None, completions=None, *, reasoning_gym, **kwargs) -> list[float]:
    """The task's own `score_answer(answer, entry)` (0.0 to 1.0; partial credit where the task gives it) for the
    answer each completion states, with the entry its row's `reasoning_gym` record names.

    >>> import json
    >>> from stages.data.reasoning_gym_source import rows
    >>> row = rows("leg_counting", 1, 1, {})[0]
    >>> row["answer"]
    '292'
    >>> reasoning_gym_reward(completions=["<answer>292</answer>", "<answer>291</answer>", "292"],
    ...                      reasoning_gym=[row["reasoning_gym"]] * 3)
    [1.0, 0.0, 0.0]
    """
    if len(reasoning_gym) != len(completions):
        raise ValueError(f"reasoning_gym: {len(completions)} completions but {len(reasoning_gym)} rows")
    scores = []
    for completion, record in zip(completions, reasoning_gym):
        try:
            dataset, entry = gym.entry_of(json.loads(record))
        except (gym.TaskError, TypeError, KeyError, json.JSONDecodeError) as e:
            scores.append(SampleError(f"reasoning_gym: the row's record cannot be read ({type(e).__name__}: {e})"))
            continue
        try:
            scores.append(float(dataset.score_answer(stated(completion_text(completion)), entry)))
        except Exception as e:  # the task's scorer on an answer it did not expect: this sample only
            scores.append(SampleError(f"reasoning_gym: {entry['metadata'].get('source_dataset')} score_answer "
                                      f"raised {type(e).__name__}: {e}"))
    return scores
