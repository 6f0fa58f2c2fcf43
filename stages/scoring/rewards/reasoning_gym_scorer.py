"""The `reasoning_gym` reward: a reasoning-gym task's own scorer on the answer a completion states.

Rows of a `path: reasoning_gym` source (stages/data/reasoning_gym_source.py) carry a `reasoning_gym` column, the
JSON record of their entry and of how the package makes it. The answer is what reasoning-gym's own
`utils.extract_answer` reads (the last `<answer>...</answer>` block); without one, the number a completion states as
its answer the way `accuracy` and `stated_accuracy` read it (a completion that is only the number, or one that ends
"... is 7." / "= 7"): a model not prompted for tags answers arithmetic and counting tasks that way (SmolLM2-135M on
chain_sum: 0 of 128 completions used tags). Anything else states nothing, and the task's `score_answer(None, entry)`
scores that as the task does (0.0 for most, 0.01 for countdown).
"""

from __future__ import annotations

import json

from stages.data import reasoning_gym_source as gym
from stages.scoring.rewards.common import SampleError, completion_text
from stages.scoring.rewards.math import stated_answer


def stated(text: str) -> str | None:
    """The answer a completion states: its last `<answer>` block, stripped, as reasoning-gym reads it; without
    one, the number it states as its answer (math.stated_answer); else None.

    >>> stated("<answer>1</answer> no, <answer> 7 </answer>"), stated("So the answer is 7."), stated(" 7 ")
    ('7', '7', '7')
    >>> stated("8 - 4 = 4"), stated("First 8 - 4, then")
    ('4', None)
    """
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(text)
    return tagged if tagged is not None else stated_answer(text)


def reasoning_gym_reward(prompts=None, completions=None, *, reasoning_gym, **kwargs) -> list[float]:
    """The task's own `score_answer(answer, entry)` (0.0 to 1.0; partial credit where the task gives it) for the
    answer each completion states, with the entry its row's `reasoning_gym` record names.

    >>> import json
    >>> from stages.data.reasoning_gym_source import rows
    >>> row = rows("leg_counting", 1, 1, {})[0]
    >>> row["answer"]
    '292'
    >>> reasoning_gym_reward(completions=["<answer>292</answer>", "<answer>291</answer>", "292", "They have 292 legs"],
    ...                      reasoning_gym=[row["reasoning_gym"]] * 4)
    [1.0, 0.0, 1.0, 0.0]
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
