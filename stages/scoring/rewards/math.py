"""Answer-checking rewards for math and arithmetic tasks."""

from __future__ import annotations

import re

from stages.scoring.rewards.common import completion_text

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
FORMAT = re.compile(r"^\s*<answer>[^<]*</answer>\s*$", re.DOTALL)
NUMBER = r"(-?\d+(?:\.\d+)?)"
BARE_NUMBER = re.compile(rf"^\s*{NUMBER}\s*\.?\s*$")
# A closing statement: "... is 7.", "answer: 7", "= 7" at the very end of the text (markdown bold and $ allowed).
CLOSING_STATEMENT = re.compile(rf"(?:\bis|=|:)\s*[*$]*\s*{NUMBER}\s*[*$]*\s*\.?\s*$", re.IGNORECASE)


def extract_answer(text: str) -> str:
    """The text inside the first `<answer>...</answer>`, stripped; the whole text, stripped, without one.

    >>> extract_answer("I think <answer> 7 </answer>"), extract_answer("7")
    ('7', '7')
    """
    match = ANSWER_TAG.search(text)
    return match.group(1).strip() if match else text.strip()


def stated_answer(text: str) -> str | None:
    """The answer a completion states, or None when it states none: the text of its first
    `<answer>...</answer>`; else the number it consists of; else the number of its closing statement
    ("... is 7.", "answer: 7", "= 7" ending the text). Reasoning cut off mid-way states nothing, even
    when its last number happens to be the gold one.

    >>> stated_answer("The largest of 3, 8, 1 is 8."), stated_answer(" 8 "), stated_answer("<answer>8</answer>")
    ('8', '8', '8')
    >>> stated_answer("To find the largest of 3, 8, 1, 6") is None
    True
    """
    match = ANSWER_TAG.search(text)
    if match:
        return match.group(1).strip()
    match = BARE_NUMBER.search(text) or CLOSING_STATEMENT.search(text)
    return match.group(1) if match else None


def same_answer(predicted: str, gold) -> bool:
    """True when `predicted` equals `gold` as text or mathematically (math-verify).

    `gold` is an expression (`$...$` added when absent). `predicted` may be free text: math-verify reads it as
    it is (its last answer-like expression) and only then as one `$...$` expression. Wrapped first, a sentence
    would become a product of letters ("The largest is 5" -> t*h*e*...*5, never 5).

    >>> same_answer("The largest of the three is 5", "5"), same_answer("0.5", "1/2"), same_answer("x^2", "x^2")
    (True, True, True)
    """
    from math_verify import parse, verify

    gold_text = str(gold)
    if predicted == gold_text:
        return True
    gold_parsed = parse(gold_text if "$" in gold_text else f"${gold_text}$")
    pred_parsed = parse(predicted) or ([] if "$" in predicted else parse(f"${predicted}$"))
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed))


def accuracy_reward(prompts=None, completions=None, answer=None, **kwargs) -> list[float]:
    """1.0 where the completion's answer equals `answer` mathematically (math-verify), else 0.0.

    The text inside `<answer>...</answer>` is checked when present, else the whole completion.

    >>> accuracy_reward(completions=[[{"role": "assistant", "content": "<answer>12</answer>"}], "<answer>13</answer>"],
    ...                 answer=["12", "12"])
    [1.0, 0.0]
    >>> accuracy_reward(completions=["the answer is $\\\\frac{1}{2}$"], answer=["0.5"])
    [1.0]
    """
    if answer is None or any(gold is None for gold in answer):
        raise ValueError("accuracy_reward needs a gold `answer` for every prompt; the prompts table has "
                         + ("no answer column" if answer is None else "prompts without one (the transform returned "
                            "none)"))
    return [1.0 if same_answer(extract_answer(completion_text(c)), gold) else 0.0
            for c, gold in zip(completions, answer)]


def stated_accuracy_reward(prompts=None, completions=None, answer=None, **kwargs) -> list[float]:
    """1.0 where the answer the completion states (`stated_answer`) equals `answer`, else 0.0.

    Stricter than `accuracy` on free text: math-verify reads the last number of a completion without
    `<answer>` tags, so reasoning cut off at max_completion_length scores whenever that number is the
    gold one ("The largest is 6, which is the sum of 1 to 9" scores 1 for 9); here only a stated answer does.

    >>> stated_accuracy_reward(completions=["The largest of 3, 9, 1 is 9.", "Of 3, 9, 1 the largest is 3, then 9",
    ...                                     "<answer>9</answer>"], answer=["9", "9", "9"])
    [1.0, 0.0, 1.0]
    """
    if answer is None or any(gold is None for gold in answer):
        raise ValueError("stated_accuracy_reward needs a gold `answer` for every prompt; the prompts table has "
                         + ("no answer column" if answer is None else "prompts without one (the transform returned "
                            "none)"))
    scores = []
    for completion, gold in zip(completions, answer):
        predicted = stated_answer(completion_text(completion))
        scores.append(1.0 if predicted is not None and same_answer(predicted, gold) else 0.0)
    return scores


def format_reward(prompts=None, completions=None, **kwargs) -> list[float]:
    """1.0 where the whole completion is one `<answer>...</answer>` block, else 0.0.

    >>> format_reward(completions=["<answer>7</answer>", "7", "<answer>7</answer> and more"])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if FORMAT.match(completion_text(c)) else 0.0 for c in completions]
