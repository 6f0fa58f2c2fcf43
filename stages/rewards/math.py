"""Answer-checking rewards for math and arithmetic tasks."""

from __future__ import annotations

import re

from stages.rewards.common import completion_text

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
FORMAT = re.compile(r"^\s*<answer>[^<]*</answer>\s*$", re.DOTALL)


def extract_answer(text: str) -> str:
    """The text inside the first `<answer>...</answer>`, stripped; the whole text, stripped, without one.

    >>> extract_answer("I think <answer> 7 </answer>"), extract_answer("7")
    ('7', '7')
    """
    match = ANSWER_TAG.search(text)
    return match.group(1).strip() if match else text.strip()


def accuracy_reward(prompts=None, completions=None, answer=None, **kwargs) -> list[float]:
    """1.0 where the completion's answer equals `answer` mathematically (math-verify), else 0.0.

    The text inside `<answer>...</answer>` is checked when present, else the whole completion.

    >>> accuracy_reward(completions=[[{"role": "assistant", "content": "<answer>12</answer>"}], "<answer>13</answer>"],
    ...                 answer=["12", "12"])
    [1.0, 0.0]
    >>> accuracy_reward(completions=["the answer is $\\\\frac{1}{2}$"], answer=["0.5"])
    [1.0]
    """
    from math_verify import parse, verify

    if answer is None:
        raise ValueError("accuracy_reward needs an `answer` column in the prompts table")
    scores = []
    for completion, gold in zip(completions, answer):
        predicted = extract_answer(completion_text(completion))
        gold_text = str(gold)
        if predicted == gold_text:
            scores.append(1.0)
            continue
        gold_parsed = parse(gold_text if "$" in gold_text else f"${gold_text}$")
        pred_parsed = parse(predicted if "$" in predicted else f"${predicted}$")
        scores.append(1.0 if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed) else 0.0)
    return scores


def format_reward(prompts=None, completions=None, **kwargs) -> list[float]:
    """1.0 where the whole completion is one `<answer>...</answer>` block, else 0.0.

    >>> format_reward(completions=["<answer>7</answer>", "7", "<answer>7</answer> and more"])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if FORMAT.match(completion_text(c)) else 0.0 for c in completions]
