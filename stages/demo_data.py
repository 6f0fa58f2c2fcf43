"""Offline demo task: two-number addition, made procedurally (no download).

Three disjoint splits of raw rows {question, answer, teacher_completion}:

- `sft`: demonstrations from a *noisy teacher* that forgets the carry from the units
  column `1 - teacher_carry_accuracy` of the time (it writes a + b - 10). The SFT warm
  start imitates it, so the base policy answers the no-carry problems and usually gets
  carry problems wrong, while still sampling the right answer sometimes: the signal
  GRPO with a verifier reward can amplify.
- `train`: prompts for RL rollouts.
- `eval`: held-out prompts for accuracy.

Run: `python -m stages.demo_data` prints a few rows.
"""

from __future__ import annotations

import random
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from stages.schemas import write_table
import pyarrow as pa

RAW = pa.schema([("question", pa.string()), ("answer", pa.string()), ("teacher_completion", pa.string())])
SPLITS = ("sft", "train", "eval")


class DemoDataConfig(BaseModel):
    """The built-in arithmetic task."""

    model_config = ConfigDict(extra="forbid")

    min_operand: int = Field(10, ge=0)
    max_operand: int = Field(99, ge=1)
    """Operands are drawn from min_operand..max_operand. 10..99: two-digit numbers (fixed
    digit positions, which a tiny model learns quickly), 45% of sums with a units carry."""
    num_sft: int = Field(3000, ge=1)
    """Teacher demonstrations for the SFT warm start."""
    num_train: int = Field(3000, ge=1)
    """RL prompts. Rounds draw `rollout.prompts_per_round` of them."""
    num_eval: int = Field(256, ge=1)
    """Held-out prompts for eval/accuracy. The issue's acceptance asks for at least 200."""
    teacher_carry_accuracy: float = Field(0.3, ge=0.0, le=1.0)
    """How often the noisy teacher carries correctly. Lower: weaker base policy, more for RL to fix."""
    seed: int = 1234


def format_answer(value: int | str) -> str:
    """The completion format every demo component agrees on."""
    return f"<answer>{value}</answer>"


def run(cfg: DemoDataConfig, out_dir: Path) -> dict:
    """Write sft/train/eval raw-row Parquet files into out_dir; return row counts."""
    total = cfg.num_sft + cfg.num_train + cfg.num_eval
    operands = range(cfg.min_operand, cfg.max_operand + 1)
    pairs = [(a, b) for a in operands for b in operands]
    if total > len(pairs):
        raise ValueError(
            f"demo_data: asked for {total} distinct problems but operands {cfg.min_operand}..{cfg.max_operand} "
            f"gives only {len(pairs)}; lower num_sft/num_train/num_eval or raise max_operand"
        )
    rng = random.Random(cfg.seed)
    rng.shuffle(pairs)
    # eval first, so changing num_sft/num_train never changes the held-out set
    bounds = {"eval": (0, cfg.num_eval), "sft": (cfg.num_eval, cfg.num_eval + cfg.num_sft)}
    bounds["train"] = (bounds["sft"][1], total)
    counts = {}
    for split in SPLITS:
        lo, hi = bounds[split]
        rows = []
        for a, b in pairs[lo:hi]:
            answer = a + b
            carries = (a % 10) + (b % 10) >= 10
            teacher = answer if (not carries or rng.random() < cfg.teacher_carry_accuracy) else answer - 10
            rows.append(
                {"question": f"What is {a} + {b}?", "answer": str(answer), "teacher_completion": format_answer(teacher)}
            )
        write_table(rows, out_dir / f"{split}.parquet", RAW)
        counts[split] = len(rows)
    return counts


if __name__ == "__main__":
    import tempfile

    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as d:
        print(run(DemoDataConfig(num_sft=5, num_train=5, num_eval=5), Path(d)))
        print(pq.read_table(Path(d) / "sft.parquet").to_pylist())
