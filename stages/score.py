"""score: reward functions over a round's rollouts, weighted total, group-relative advantages.

Rewards run in `reward_num_workers` spawned subprocesses (stages/reward_workers.py).
Advantages follow TRL's GRPOTrainer: A = r - mean_group(r), divided by (std + 1e-4)
where std is the group's (`scale_rewards: group`), the batch's (`batch`), or not at all
(`none`, Dr. GRPO's recommendation). A reward function may return None for a sample it
does not apply to; that sample counts as 0 in the weighted sum, as TRL's nansum does.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.reward_workers import RewardFunctionError, shared_pool
from stages.schemas import ROLLOUTS, SCORED, write_table

__all__ = ["ScoreConfig", "group_advantages", "run", "RewardFunctionError"]


class ScoreConfig(BaseModel):
    """Rewards and advantages (names as in TRL's GRPOConfig)."""

    model_config = ConfigDict(extra="forbid")

    reward_funcs: list[str] = Field(default_factory=lambda: ["accuracy", "format"], min_length=1)
    """Built-in names (accuracy, format) or `module.fn` with TRL's signature."""
    reward_weights: list[float] | None = None
    """One weight per reward function; unset: all 1.0."""
    reward_num_workers: int = Field(2, ge=1)
    """Worker subprocesses scoring in parallel."""
    reward_timeout_s: float = Field(60.0, gt=0)
    """Seconds one batch call may take before the stage fails naming the function and samples."""
    reward_batch_size: int = Field(64, ge=1)
    """Completions per call of a reward function."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's std (GRPO), the batch's std, or nothing (Dr. GRPO)."""

    @model_validator(mode="after")
    def _weights_match(self):
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} values for {len(self.reward_funcs)} reward_funcs"
            )
        return self


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """Group-relative advantages for rewards laid out group by group (TRL's GRPOTrainer).

    >>> group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, "none").tolist()
    [0.5, -0.5, 0.0, 0.0]
    >>> [round(a, 3) for a in group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, "group").tolist()]
    [0.707, -0.707, 0.0, 0.0]
    """
    grouped = rewards.view(-1, num_generations)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
    if scale_rewards == "group":
        std = grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
    elif scale_rewards == "batch":
        std = rewards.std().expand_as(rewards)
    else:
        return advantages
    return advantages / (std + 1e-4)


def run(cfg: ScoreConfig, rollouts_path: Path, num_generations: int, out_dir: Path,
        reward_model_dir: Path | None = None) -> dict:
    """Score rollouts into out_dir/scored.parquet; return reward metrics. `reward_model_dir`: the
    folder the reward function named `reward_model` scores with (this run's reward_model stage)."""
    sources = {}
    if "reward_model" in cfg.reward_funcs:
        if reward_model_dir is None:
            raise ValueError("score.reward_funcs: 'reward_model' needs a reward model; this run trains none "
                             "(or name a folder: reward_model:/path/to/model)")
        sources["reward_model"] = f"reward_model:{Path(reward_model_dir).resolve()}"
    table = pq.read_table(rollouts_path)
    rows = table.to_pylist()
    n = len(rows)
    if n % num_generations:
        raise ValueError(f"{rollouts_path}: {n} rows is not a multiple of num_generations={num_generations}")
    columns = [c for c in table.column_names if c not in ROLLOUTS.names or c in ("prompt_id",)]
    weights = cfg.reward_weights or [1.0] * len(cfg.reward_funcs)

    jobs = []
    for name in cfg.reward_funcs:
        for start in range(0, n, cfg.reward_batch_size):
            chunk = rows[start : start + cfg.reward_batch_size]
            batch = {
                "prompts": [r["prompt"] for r in chunk],
                "completions": [[{"role": "assistant", "content": r["completion"]}] for r in chunk],
                "completion_ids": [r["completion_token_ids"] for r in chunk],
                **{c: [r[c] for r in chunk] for c in columns},
            }
            jobs.append((name, batch, [r["rollout_id"] for r in chunk]))
    pool = shared_pool(cfg.reward_funcs, cfg.reward_num_workers, cfg.reward_timeout_s, sources)
    outputs = pool.score(jobs)

    per_function: dict[str, list] = {name: [] for name in cfg.reward_funcs}
    for (name, _, ids), values in zip(jobs, outputs):
        for rid, v in zip(ids, values):
            if v is not None and not isinstance(v, numbers.Real):
                raise RewardFunctionError(
                    f"reward function {name!r} returned {v!r} ({type(v).__name__}) for sample {rid}; "
                    "expected a float or None"
                )
            per_function[name].append(float("nan") if v is None else float(v))

    matrix = torch.tensor([per_function[name] for name in cfg.reward_funcs], dtype=torch.float64).T  # (n, F)
    totals = torch.nansum(matrix * torch.tensor(weights, dtype=torch.float64), dim=1)
    advantages = group_advantages(totals, num_generations, cfg.scale_rewards)

    rewards_column = [
        [(name, None if math.isnan(matrix[i, f]) else float(matrix[i, f])) for f, name in enumerate(cfg.reward_funcs)]
        for i in range(n)
    ]
    scored = (
        table.append_column("rewards", pa.array(rewards_column, type=SCORED.field("rewards").type))
        .append_column("reward", pa.array(totals.tolist(), type=pa.float64()))
        .append_column("advantage", pa.array(advantages.tolist(), type=pa.float64()))
        .append_column("errors", pa.array([[] for _ in range(n)], type=pa.list_(pa.string())))
    )
    write_table(scored, out_dir / "scored.parquet", SCORED, extra_ok=True)

    grouped = totals.view(-1, num_generations)
    metrics = {
        "reward_mean": float(totals.mean()),
        "reward_std": float(totals.std()),
        "frac_reward_zero_std": float((grouped.std(dim=1) < 1e-8).float().mean()),
    }
    for f, name in enumerate(cfg.reward_funcs):
        col = matrix[:, f]
        metrics[f"rewards/{name.rsplit('.', 1)[-1]}/mean"] = float(torch.nanmean(col))
    return metrics
