"""demo pairs: preference rows for the built-in "largest number" task, made here with no download.

`kind: pair` gives a right and a wrong answer per question (DPO, `reward_model.kind: orm`); `kind: stepwise`
a running-maximum solution as steps with one label per step (`reward_model.kind: prm`). Questions are drawn
as stages/data/demo_data.py draws the prompts task's, and eval questions are held out of both. The rows are
the preferences table (stages/data/preferences.py's schema and normalization), written as the `preferences`
stage writes it.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Literal

import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from stages.data import demo_data
from stages.data.demo_data import DemoDataConfig, format_answer
from stages.data.preferences import normalize_row, write_split


class DemoPairsConfig(BaseModel):
    """Preference rows for the built-in demo task: pairs (chosen is right, rejected is wrong), or
    stepwise solutions with a label per step (for a process reward model)."""

    model_config = ConfigDict(extra="forbid")

    num_train: int = Field(2000, ge=1)
    """Preference pairs (or stepwise solutions) in the train split."""
    num_eval: int = Field(200, ge=1)
    """Pairs in the eval split, held out of train; the reward model's and DPO's held-out accuracy is measured on them."""
    kind: Literal["pair", "stepwise"] = "pair"
    """pair: a right and a wrong answer per question (DPO, `reward_model.kind: orm`); stepwise: a solution
    as steps ("Compare 3 and 8: keep 8", ..., "<answer>8</answer>") with one label per step
    (`reward_model.kind: prm`)."""
    rejected: Literal["first", "random", "second_largest", "mixed"] = "first"
    """pair: the wrong answer: the first number listed (another number when the first is the
    largest), a random other number, the runner-up (the demo teacher's mistake), or `mixed`, drawn per
    row: the runner-up (1/4), any other number of the question's size, in the question or not (1/2), or
    a larger number that is not in it (1/4). That covers every answer a policy can give: a reward model
    that never saw unlisted numbers scores them like the right one and GRPO drifts to them, without the
    larger ones GRPO learns to answer "99", and the runner-up is the SFT policy's own mistake."""
    mistake_rate: float = Field(0.5, ge=0, le=1)
    """stepwise: fraction of solutions with a mistake (a comparison that keeps the smaller number, or a
    wrong final answer) at a random step; that step and every later one are labelled bad (Math-Shepherd's
    convention). Higher: more bad steps to learn from, fewer fully right solutions."""
    answer_only_rate: float = Field(0.25, ge=0, le=1)
    """stepwise: fraction of solutions that are only the answer step (`<answer>N</answer>`, what the demo
    policy writes), so a PRM scoring GRPO rollouts has seen one-step solutions."""
    system_prompt: str | None = None
    """Prepended as a system message when set (match the prompts transform's)."""
    seed: int = 4321
    """Seed of the questions and of the wrong answers paired with the right ones."""


def demo_eval_questions(demo: DemoDataConfig) -> set[str]:
    """The questions of the demo task's eval split, exactly as `demo_data.run(demo, ...)` draws them."""
    with tempfile.TemporaryDirectory() as d:
        demo_data.run(demo, Path(d))
        return set(pq.read_table(Path(d) / "eval.parquet", columns=["question"]).column("question").to_pylist())


def _question_text(numbers: tuple[int, ...]) -> str:
    return f"Which is the largest of {', '.join(map(str, numbers))}?"  # as stages/data/demo_data.py words it


def demo_steps(numbers: tuple[int, ...], mistake_at: int | None = None,
               wrong_answer: int | None = None) -> tuple[list[str], list[bool]]:
    """A running-maximum solution of the demo task as steps, and its step labels.

    Step i < len(numbers) - 1 compares the number kept so far with the next one; the last step is the
    answer. With `mistake_at`, that step goes wrong (a comparison keeps the smaller number and the
    solution carries on from it; the answer step says `wrong_answer`), and it and every later step are
    labelled bad, even where the chain gets back to the right number.

    >>> demo_steps((3, 8, 1))
    (['Compare 3 and 8: keep 8', 'Compare 8 and 1: keep 8', '<answer>8</answer>'], [True, True, True])
    >>> demo_steps((3, 8, 1), mistake_at=0)
    (['Compare 3 and 8: keep 3', 'Compare 3 and 1: keep 3', '<answer>3</answer>'], [False, False, False])
    """
    steps, kept = [], numbers[0]
    for i, n in enumerate(numbers[1:]):
        new = min(kept, n) if i == mistake_at else max(kept, n)
        steps.append(f"Compare {kept} and {n}: keep {new}")
        kept = new
    last = len(numbers) - 1
    steps.append(format_answer(wrong_answer if mistake_at == last and wrong_answer is not None else kept))
    labels = [mistake_at is None or i < mistake_at for i in range(len(steps))]
    return steps, labels


def _demo_stepwise(cfg: DemoPairsConfig, rng: random.Random, numbers: tuple[int, ...]) -> dict:
    """One stepwise row (before normalize_row): a full solution or, at `answer_only_rate`, just its answer."""
    best = max(numbers)
    answer_only = rng.random() < cfg.answer_only_rate
    wrong = rng.random() < cfg.mistake_rate
    wrong_answer = rng.choice([n for n in numbers if n != best])
    if answer_only:
        return {"prompt": _question_text(numbers), "completions": [format_answer(wrong_answer if wrong else best)],
                "labels": [not wrong]}
    mistake_at = rng.randrange(len(numbers)) if wrong else None
    steps, labels = demo_steps(numbers, mistake_at, wrong_answer)
    return {"prompt": _question_text(numbers), "completions": steps, "labels": labels}


def demo_pair_rows(cfg: DemoPairsConfig, demo: DemoDataConfig | None = None) -> dict[str, list[dict]]:
    """Train/eval preference rows (of `cfg.kind`) for the demo task, drawn as `demo` draws its questions
    (numbers per question, digits, balanced answers). Eval questions are distinct and disjoint from the
    train rows and from the demo task's eval split; train questions avoid both and repeat only when no
    new one turns up."""
    demo = demo or DemoDataConfig()
    excluded = demo_eval_questions(demo)
    rng = random.Random(cfg.seed)
    out: dict[str, list[dict]] = {}
    for split, size in (("eval", cfg.num_eval), ("train", cfg.num_train)):  # eval first: held out of train
        rows, seen = [], set()
        while len(rows) < size:
            try:
                numbers = demo_data.draw_question(rng, demo, len(rows), excluded, seen, split == "eval",
                                                  50 * (size + 10), key=_question_text)
            except ValueError:
                raise ValueError(f"demo pairs: cannot draw {size} new {split} questions; lower the counts") from None
            question = _question_text(numbers)
            seen.add(question)
            if split == "eval":
                excluded.add(question)
            if cfg.kind == "stepwise":
                row = normalize_row(_demo_stepwise(cfg, rng, numbers), system_prompt=cfg.system_prompt)
                row["pair_id"] = f"{split}-{len(rows):06d}"
                rows.append(row)
                continue
            best = max(numbers)
            others = [n for n in numbers if n != best]
            kind = cfg.rejected
            if kind == "mixed":  # a reward model must also learn that a number not in the question is wrong
                # drawn, not cycled by row: a cycle of 5 kinds would pair each of the 5 balanced answers
                # with one kind only (the answer cycles with the row too)
                kind = rng.choice(("second_largest", "any", "any", "larger"))
            low = 1 if demo.number_digits == 1 else 10 ** (demo.number_digits - 1)
            unlisted = [n for n in range(low, 10 ** demo.number_digits) if n not in numbers]
            if kind == "any":  # any other number of the question's size, in it or not
                wrong = rng.choice(unlisted + others)
            elif kind == "larger":
                wrong = rng.choice([n for n in range(best + 1, 10 ** (demo.number_digits + 1)) if n not in numbers])
            elif kind == "first" and numbers[0] != best:
                wrong = numbers[0]
            elif kind == "second_largest":
                wrong = max(others)
            else:
                wrong = rng.choice(others)
            new = {"prompt": question, "chosen": format_answer(best), "rejected": format_answer(wrong)}
            row = normalize_row(new, system_prompt=cfg.system_prompt)
            row["pair_id"] = f"{split}-{len(rows):06d}"
            rows.append(row)
        out[split] = rows
    return {"train": out["train"], "eval": out["eval"]}


def write_demo_pairs(cfg: DemoPairsConfig, out_dir: Path, demo: DemoDataConfig | None = None) -> dict:
    """Write demo rows as out_dir/train.parquet and eval.parquet; return the same summary shape as `run`."""
    summary = {}
    for split, rows in demo_pair_rows(cfg, demo).items():
        write_split(rows, Path(out_dir) / f"{split}.parquet")
        summary[split] = {"kinds": {cfg.kind: len(rows)}, "kept": len(rows), "dropped": 0,
                          "dropped_indices": [], "dropped_fields": {}}
    return summary
