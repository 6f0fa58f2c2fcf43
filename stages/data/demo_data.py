"""Offline demo task: "Which is the largest of 3, 8, 1, 6, 4?", made procedurally (no download).

Three splits of raw rows {question, answer, teacher_completion}:

- `sft`: demonstrations from a *noisy teacher* that answers correctly only
  `teacher_accuracy` of the time and otherwise names the second largest number.
  The SFT warm start imitates it: greedy, the base policy mostly says the runner-up;
  sampled, it names the largest number about a third of the time: the signal GRPO
  with a verifier reward amplifies.
- `train`: prompts for RL rollouts.
- `eval`: held-out prompts for accuracy, distinct, never seen in `sft` or `train`.

The numbers of one question are distinct (with `number_digits: 2`, their tens digits
are), so "largest" never hinges on a tie. With `balanced_answers` (default) every possible
largest number is equally likely, so no constant answer scores above ~1/5.
Run `python -m stages.data.demo_data` to print a few rows.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from stages.data.schemas import write_table
from stages.runtime.keys import key_when_set

RAW = pa.schema([("question", pa.string()), ("answer", pa.string()), ("teacher_completion", pa.string())])
SPLITS = ("sft", "train", "eval")


class DemoDataConfig(BaseModel):
    """The built-in "largest number" task."""

    model_config = ConfigDict(extra="forbid")

    numbers_per_question: int = Field(5, ge=2, le=9)
    """How many numbers each question lists. More: harder, lower base accuracy."""
    number_digits: Literal[1, 2] = 1
    """1: distinct numbers 1..9 (learned in a few hundred SFT steps); 2: 10..99 with
    distinct tens digits (the model must also learn to copy the units digit)."""
    num_sft: int = Field(4000, ge=1)
    """Teacher demonstrations for the SFT warm start."""
    num_train: int = Field(4000, ge=1)
    """RL prompts. Rounds draw `rollout.prompts_per_round` of them."""
    num_eval: int = Field(256, ge=1)
    """Held-out prompts for eval/accuracy (at least 200 for a meaningful number)."""
    teacher_accuracy: float = Field(0.4, ge=0.0, le=1.0)
    """How often the noisy teacher picks the largest number. Lower: weaker base policy."""
    teacher_mistake: Literal["second_largest", "first", "random"] = "second_largest"
    """What the teacher says when it is wrong. second_largest (default): the runner-up; both of the
    teacher's answers depend on which numbers the question holds, so SFT learns to compare them on
    every seed (measured, BENCHMARKS.md). first: the first number listed; learning that takes a
    positional lookup the small model found on some seeds and not on others (then its policy ignored
    the question). random: another number of the question."""
    balanced_answers: bool = True
    """true: each digit that can lead the largest number (5..9 for five numbers) does so for an equal
    share of every split's rows, so the best constant answer is right on only ~1/5 of the prompts. false: numbers
    drawn uniformly, so 9 is the answer of ~56% of the questions and "always 9" looks like skill."""
    records_per_document: int | None = key_when_set(None, ge=1)
    """Set: each row is a raw document (column `text`, for transform.type: text and ebft.mode: strided) of this
    many questions written out as prose, "The largest of 3, 8, 1, 5, 2 is 8." one per line; num_* then count
    documents. The sft split states the teacher's answers (teacher_accuracy), train and eval the true ones.
    Unset: one question/answer row per question."""
    seed: int = 1234
    """Seed of the questions, their answers and the teacher's mistakes: another seed, another demo dataset."""


def format_answer(value: int | str) -> str:
    """The completion format every demo component agrees on."""
    return f"<answer>{value}</answer>"


def _question(rng: random.Random, k: int, digits: int, top: int | None) -> tuple[int, ...]:
    """k numbers with distinct leading digits; `top`: the largest one's leading digit (None: any)."""
    if top is not None:  # the others below it, then shuffled
        leading = [top, *rng.sample(range(1, top), k - 1)]
        rng.shuffle(leading)
    else:
        leading = rng.sample(range(1, 10), k)
    if digits == 1:
        return tuple(leading)
    return tuple(10 * t + rng.randrange(10) for t in leading)


def draw_question(rng: random.Random, cfg: DemoDataConfig, row_index: int, held_out: set, seen: set,
                  distinct: bool, max_tries: int, key: Callable = tuple) -> tuple[int, ...]:
    """The numbers of row `row_index`'s question: never one whose `key` is in `held_out`; not one in
    `seen` if `distinct`, else only once 100 tries found nothing new. Balanced: the largest number's
    leading digit cycles through k..9 with the row index; once a digit's questions run out (200 tries)
    any digit may lead. ValueError after `max_tries`."""
    k = cfg.numbers_per_question
    top = k + row_index % (10 - k) if cfg.balanced_answers else None
    for tries in range(max_tries):
        if cfg.balanced_answers and tries >= 200:
            top = rng.randrange(k, 10)
        numbers = _question(rng, k, cfg.number_digits, top)
        if key(numbers) in held_out or (key(numbers) in seen and (distinct or tries < 100)):
            continue
        return numbers
    raise ValueError(f"gave up after {max_tries} tries")


def _mistake(rng: random.Random, numbers: tuple[int, ...], kind: str) -> int:
    if kind == "first":
        return numbers[0]
    if kind == "second_largest":
        return sorted(numbers)[-2]
    return rng.choice([n for n in numbers if n != max(numbers)])


def run(cfg: DemoDataConfig, out_dir: Path) -> dict:
    """Write sft/train/eval raw-row Parquet files into out_dir; return row counts.

    Eval questions are distinct and never appear in sft or train; sft and train questions repeat only
    when no new one turns up (five balanced one-digit numbers have only 120 questions whose largest is 5)."""
    rng = random.Random(cfg.seed)
    per_row = cfg.records_per_document or 1
    sizes = {"eval": cfg.num_eval * per_row, "sft": cfg.num_sft * per_row,  # eval first: stable held-out set
             "train": cfg.num_train * per_row}
    held_out: set[tuple[int, ...]] = set()
    counts = {}
    for split, size in sizes.items():
        rows, seen = [], set()
        while len(rows) < size:
            try:
                numbers = draw_question(rng, cfg, len(rows), held_out, seen, split == "eval", 50 * (size + 10))
            except ValueError:
                raise ValueError(f"demo_data: cannot draw {size} distinct {split} questions outside the eval "
                                 "split; lower demo_data.num_eval or raise demo_data.numbers_per_question") from None
            seen.add(numbers)
            answer = max(numbers)
            teacher = answer if rng.random() < cfg.teacher_accuracy else _mistake(rng, numbers, cfg.teacher_mistake)
            rows.append(
                {
                    "question": f"Which is the largest of {', '.join(map(str, numbers))}?",
                    "answer": str(answer),
                    "teacher_completion": format_answer(teacher),
                }
            )
        if split == "eval":
            held_out = seen
        rng.shuffle(rows)
        if cfg.records_per_document:
            rows = documents(rows, cfg.records_per_document, teacher=split == "sft")
            write_table(rows, out_dir / f"{split}.parquet", DOCUMENTS)
        else:
            write_table(rows, out_dir / f"{split}.parquet", RAW)
        counts[split] = len(rows)
    return counts


DOCUMENTS = pa.schema([("text", pa.string())])


def documents(rows: list[dict], per_document: int, teacher: bool) -> list[dict]:
    """Question rows written out as documents of `per_document` lines, "The largest of 3, 8, 1 is 8."; the
    stated answer is the teacher's (`teacher`) or the true one.

    >>> documents([{"question": "Which is the largest of 3, 8, 1?", "answer": "8",
    ...             "teacher_completion": "<answer>3</answer>"}], 1, teacher=True)
    [{'text': 'The largest of 3, 8, 1 is 3.\\n'}]
    """
    def line(row: dict) -> str:
        numbers = row["question"].removeprefix("Which is the largest of ").removesuffix("?")
        answer = (row["teacher_completion"].removeprefix("<answer>").removesuffix("</answer>") if teacher
                  else row["answer"])
        return f"The largest of {numbers} is {answer}.\n"

    return [{"text": "".join(line(r) for r in rows[i : i + per_document])}
            for i in range(0, len(rows), per_document)]


if __name__ == "__main__":
    import tempfile

    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as d:
        print(run(DemoDataConfig(num_sft=5, num_train=5, num_eval=5), Path(d)))
        for row in pq.read_table(Path(d) / "sft.parquet").to_pylist():
            print(row)
