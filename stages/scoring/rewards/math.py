"""Answer-checking rewards for math and arithmetic tasks."""

from __future__ import annotations

import functools
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


OPERATOR = re.compile(r"[-+*/^×÷]|\\(?:frac|cdot|times|div)")


def same_answer(predicted: str, gold, question: str | None = None) -> bool:
    """True when `predicted` equals `gold` as text or mathematically (math-verify).

    `gold` is an expression (`$...$` added when absent). `predicted` may be free text: math-verify reads it as
    it is (its last answer-like expression) and only then as one `$...$` expression. Wrapped first, a sentence
    would become a product of letters ("The largest is 5" -> t*h*e*...*5, never 5). An expression that only
    restates `question`'s ("43 + 14" for "What is 43 + 14?") is no answer, whatever it evaluates to.

    >>> same_answer("The largest of the three is 5", "5"), same_answer("0.5", "1/2"), same_answer("x^2", "x^2")
    (True, True, True)
    >>> same_answer("The answer is 43 + 14", "57", question="What is 43 + 14?")
    False
    """
    gold_text = str(gold)
    if predicted == gold_text:
        return True
    return _verified_same(predicted, gold_text, question)


@functools.lru_cache(maxsize=16384)
def _verified_same(predicted: str, gold_text: str, question: str | None) -> bool:
    """same_answer's math-verify check, once per distinct (answer, gold, question) in a process: a group's
    completions often state the same answer (a reward worker scores ~2-3 ms a call in math-verify, ~0 again)."""
    from math_verify import parse, verify

    gold_parsed = parse(gold_text if "$" in gold_text else f"${gold_text}$")
    pred_parsed = parse(predicted) or ([] if "$" in predicted else parse(f"${predicted}$"))
    if question and pred_parsed and restates(str(pred_parsed[-1]), question, gold_text):
        return False
    return bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed))


def restates(expression: str, question: str, gold: str = "") -> bool:
    """True when `expression` (math-verify's matched text) is an expression with an operator that appears in
    `question` as it is, spaces aside, and is not the gold answer's text: a restated question, not an answer
    ("43 + 14" in "What is 43+14?"; "3/4" stays an answer to "Which is larger, 3/4 or 1/2?" when it is the gold).

    >>> restates("43 + 14", "What is 43+14?"), restates("57", "What is 43 + 14? 57 is wrong"), restates("-3", "-3, 2")
    (True, False, False)
    >>> restates("3/4", "Which is larger, 3/4 or 1/2?", gold="3/4")
    False
    """
    def compact(text: str) -> str:
        return "".join(text.split()).strip("$").rstrip(".")

    operand = compact(expression).lstrip("+-")  # a signed number is no expression
    return (bool(OPERATOR.search(operand)) and compact(expression) in compact(question)
            and compact(expression) != compact(gold))


def prompt_text(prompt) -> str:
    """The text of a prompt given as a string or a list of chat messages (all of them: system and user).

    >>> prompt_text([{"role": "user", "content": "What is 2+2?"}])
    'What is 2+2?'
    """
    if prompt is None:
        return ""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):  # one message
        return str(prompt.get("content", ""))
    return "\n".join(prompt_text(m) for m in prompt)


def questions_of(prompts, completions) -> list:
    """Each completion's prompt text, or None for each where the prompts do not come one per completion."""
    if prompts is None or len(prompts) != len(completions):
        return [None] * len(completions)
    return [prompt_text(p) for p in prompts]


def accuracy_reward(prompts=None, completions=None, answer=None, **kwargs) -> list[float]:
    """1.0 where the completion's answer equals `answer` mathematically (math-verify), else 0.0.

    The answer the completion states (`stated_answer`: inside `<answer>...</answer>`, a bare number, or a closing
    "... is N." / "= N") is checked when it states one, else the whole completion (math-verify reads its last
    answer-like expression). An expression that only restates the prompt's ("43 + 14" for "What is 43 + 14?") is
    not credited, whatever it evaluates to.

    >>> accuracy_reward(completions=[[{"role": "assistant", "content": "<answer>12</answer>"}], "<answer>13</answer>"],
    ...                 answer=["12", "12"])
    [1.0, 0.0]
    >>> accuracy_reward(completions=["the answer is $\\\\frac{1}{2}$"], answer=["0.5"])
    [1.0]
    >>> accuracy_reward(prompts=["What is 43 + 14?"] * 2, answer=["57"] * 2,
    ...                 completions=["The final answer to the given arithmetic problem is 43 + 14 = 18.", "It is 57."])
    [0.0, 1.0]
    """
    if answer is None or any(gold is None for gold in answer):
        raise ValueError("accuracy_reward needs a gold `answer` for every prompt; the prompts table has "
                         + ("no answer column" if answer is None else "prompts without one (the transform returned "
                            "none)"))
    questions = questions_of(prompts, completions)
    scores = []
    for c, gold, question in zip(completions, answer, questions):
        text = completion_text(c)
        predicted = stated_answer(text)
        scores.append(1.0 if same_answer(text.strip() if predicted is None else predicted, gold, question) else 0.0)
    return scores


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
    questions = questions_of(prompts, completions)
    scores = []
    for completion, gold, question in zip(completions, answer, questions):
        predicted = stated_answer(completion_text(completion))
        scores.append(1.0 if predicted is not None and same_answer(predicted, gold, question) else 0.0)
    return scores


def format_reward(prompts=None, completions=None, **kwargs) -> list[float]:
    """1.0 where the whole completion is one `<answer>...</answer>` block, else 0.0.

    >>> format_reward(completions=["<answer>7</answer>", "7", "<answer>7</answer> and more"])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if FORMAT.match(completion_text(c)) else 0.0 for c in completions]
