"""Signs of a collapsed policy in one round's completions: how many distinct texts and answers, how many groups
wrote one text, how often the most common answer comes up. The score stage (and the Atropos and EBFT scoring)
adds them to the round's summary; the health checks (stages/evaluation/health.py) read them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from stages.scoring.rewards.math import extract_answer


def collapse_metrics(prompt_ids: Sequence, completions: Sequence[str],
                     gold_answers: Sequence | None = None) -> dict:
    """Signs of a collapsed policy in one round's completions (one row per completion, as the rollouts
    table; rows of one prompt id form its group). An answer is `stages.scoring.rewards.math.extract_answer` of the
    completion: the text in `<answer>...</answer>`, else the whole completion.

    - `rollout/distinct_completions_per_group`: mean over the groups of the number of distinct texts.
    - `rollout/frac_identical_groups`: share of the groups (of 2+ completions) whose texts are all one;
      absent where no group has 2.
    - `rollout/distinct_answers`: distinct answers across the round.
    - `rollout/top_answer_frac`: share of the completions giving the most common answer, `top_answer`
      (the text, cut to 200 characters; not a metric).
    - `rollout/gold_top_answer_frac` (with `gold_answers`, a row's gold answer, e.g. the prompts'
      `answer` column): share of the prompts whose gold answer is the most common one. None is left out.

    >>> m = collapse_metrics(["a", "a", "b", "b"], ["<answer>9</answer>"] * 3 + ["<answer> 9 </answer>"],
    ...                      gold_answers=["9", "9", "7", "7"])
    >>> m["rollout/top_answer_frac"], m["top_answer"], m["rollout/gold_top_answer_frac"]
    (1.0, '9', 0.5)
    >>> m["rollout/distinct_completions_per_group"], m["rollout/frac_identical_groups"]
    (1.5, 0.5)
    """
    if len(prompt_ids) != len(completions) or (gold_answers is not None and len(gold_answers) != len(completions)):
        raise ValueError(f"collapse_metrics: {len(prompt_ids)} prompt ids, {len(completions)} completions"
                         + ("" if gold_answers is None else f", {len(gold_answers)} gold answers")
                         + "; expected one of each per rollout row")
    if not completions:
        return {}
    groups: dict = {}
    for pid, text in zip(prompt_ids, completions):
        groups.setdefault(pid, []).append(text)
    distinct = [len(set(texts)) for texts in groups.values()]
    multi = [len(set(texts)) == 1 for texts in groups.values() if len(texts) > 1]
    answers = Counter(extract_answer(text) for text in completions)
    top_answer, top_count = answers.most_common(1)[0]
    metrics = {
        "rollout/distinct_completions_per_group": sum(distinct) / len(distinct),
        **({"rollout/frac_identical_groups": sum(multi) / len(multi)} if multi else {}),
        "rollout/distinct_answers": len(answers),
        "rollout/top_answer_frac": top_count / len(completions),
        "top_answer": top_answer[:200],
    }
    if gold_answers is not None:
        gold = {}
        for pid, answer in zip(prompt_ids, gold_answers):
            if answer is not None:
                gold.setdefault(pid, str(answer).strip())
        if gold:
            metrics["rollout/gold_top_answer_frac"] = Counter(gold.values()).most_common(1)[0][1] / len(gold)
    return metrics
