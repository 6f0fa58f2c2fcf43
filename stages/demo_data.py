"""Offline demo task: "Which is the largest of 3, 8, 1, 6, 4?", made procedurally (no download).

Three disjoint splits of raw rows {question, answer, teacher_completion}:

- `sft`: demonstrations from a *noisy teacher* that answers correctly only
  `teacher_accuracy` of the time and otherwise just repeats the first number listed.
  The SFT warm start imitates it, so the base policy is right on some prompts (those
  whose first number is the largest, and a few more) while still sampling the right
  answer now and then: the signal GRPO with a verifier reward amplifies.
- `train`: prompts for RL rollouts.
- `eval`: held-out prompts for accuracy.

The numbers of one question are distinct (with `number_digits: 2`, their tens digits
are), so "largest" never hinges on a tie. Run `python -m stages.demo_data` to print a few rows.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from stages.schemas import write_table

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
    seed: int = 1234


def format_answer(value: int | str) -> str:
    """The completion format every demo component agrees on."""
    return f"<answer>{value}</answer>"


def _question(rng: random.Random, k: int, digits: int) -> tuple[int, ...]:
    leading = rng.sample(range(1, 10), k)
    if digits == 1:
        return tuple(leading)
    return tuple(10 * t + rng.randrange(10) for t in leading)


def run(cfg: DemoDataConfig, out_dir: Path) -> dict:
    """Write sft/train/eval raw-row Parquet files into out_dir; return row counts."""
    rng = random.Random(cfg.seed)
    sizes = {"eval": cfg.num_eval, "sft": cfg.num_sft, "train": cfg.num_train}  # eval first: stable held-out set
    seen: set[tuple[int, ...]] = set()
    counts = {}
    for split, size in sizes.items():
        rows = []
        attempts = 0
        while len(rows) < size:
            attempts += 1
            if attempts > 50 * (size + 10):
                raise ValueError(f"demo_data: cannot draw {size} distinct {split} questions; lower the counts")
            numbers = _question(rng, cfg.numbers_per_question, cfg.number_digits)
            if numbers in seen:
                continue
            seen.add(numbers)
            answer = max(numbers)
            teacher = answer if rng.random() < cfg.teacher_accuracy else numbers[0]
            rows.append(
                {
                    "question": f"Which is the largest of {', '.join(map(str, numbers))}?",
                    "answer": str(answer),
                    "teacher_completion": format_answer(teacher),
                }
            )
        write_table(rows, out_dir / f"{split}.parquet", RAW)
        counts[split] = len(rows)
    return counts


if __name__ == "__main__":
    import tempfile

    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as d:
        print(run(DemoDataConfig(num_sft=5, num_train=5, num_eval=5), Path(d)))
        for row in pq.read_table(Path(d) / "sft.parquet").to_pylist():
            print(row)
