"""eval: greedy accuracy of a policy on the held-out prompts.

A completion is correct when the `accuracy` reward (math-verify) gives it 1.0. Writes
every prompt's completion and verdict to out_dir/eval.parquet for inspection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field


class EvalConfig(BaseModel):
    """Held-out evaluation."""

    model_config = ConfigDict(extra="forbid")

    split: str = "eval"
    """Prompts split to evaluate on."""
    max_prompts: int | None = Field(None, ge=1)
    """Evaluate on the first N prompts only; unset: all."""
    max_completion_length: int = Field(16, ge=1)
    batch_size: int = Field(256, ge=1)


def run(cfg: EvalConfig, model_dir: Path, adapter_dir: Path | None, prompts_path: Path, out_dir: Path,
        on_progress: Callable[[int, int], None] | None = None) -> dict:
    """Greedy-decode every eval prompt; return {"accuracy", "num_prompts", "format_rate"}."""
    import torch

    from stages.policy import load_policy
    from stages.rewards import accuracy_reward, format_reward
    from stages.engines import Sampling
    from stages.engines.hf import generate

    rows = pq.read_table(prompts_path).to_pylist()[: cfg.max_prompts]
    model, tokenizer = load_policy(model_dir, adapter_dir)
    done = 0

    def progress(n):
        nonlocal done
        done += n
        if on_progress:
            on_progress(done, len(rows))

    torch.manual_seed(0)
    outputs = generate(model, tokenizer, [r["prompt"] for r in rows],
                       Sampling(max_new_tokens=cfg.max_completion_length, do_sample=False), cfg.batch_size, progress)
    completions = [o["completion"] for o in outputs]
    correct = accuracy_reward(completions=completions, answer=[r["answer"] for r in rows])
    formatted = format_reward(completions=completions)
    pq.write_table(
        pa.table({"prompt_id": [r["prompt_id"] for r in rows], "answer": [r["answer"] for r in rows],
                  "completion": completions, "correct": correct}),
        out_dir / "eval.parquet",
    )
    return {"accuracy": sum(correct) / len(rows), "format_rate": sum(formatted) / len(rows), "num_prompts": len(rows)}
