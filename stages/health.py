"""Health checks: each GRPO round's metrics against healthy ranges.

After a round's metrics are logged (flows/pipeline.py `grpo_rounds`), `check_round` compares them with
the ranges in `HealthConfig` and returns a `Finding` per value outside its range. The pipeline logs each
one, tags the MLflow parent run (`health.warning.<metric>`, `health: warnings`) and lists it in the run
summary; with `health.on_unhealthy: stop` the first unhealthy round ends the run with `TrainingUnhealthy`.
A NaN or Inf metric always ends it, and that round's optimize folder is renamed `<folder>.unhealthy`
(`quarantine`), so a resume recomputes the round instead of continuing from NaN weights.

The default bounds are the red flags of axolotl's training-stability guide, "Key Metrics for RL (GRPO)"
(https://docs.axolotl.ai/docs/training_stability.html); each field says the guide's healthy range, which
is narrower -- tighten a bound to be warned earlier. Departure from the guide: it reads per-step curves,
these checks read one value per round (the mean over the round's optimizer steps), so a single spiky
step is averaged in rather than seen on its own.

    posttrain run configs/demo.yaml health.on_unhealthy=stop health.max_kl=0.5
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


NOT_APPLICABLE_NAN = "rewards/"
"""Metric names starting with this may be NaN in a healthy run: a reward function's mean/std over the
completions it applies to, NaN when it applies to none (score.py, as TRL's nanmean/nanstd)."""


class HealthConfig(BaseModel):
    """Healthy ranges of the per-round training metrics, and what an out-of-range round does."""

    model_config = ConfigDict(extra="forbid")

    on_unhealthy: Literal["warn", "stop"] = "warn"
    """warn: log it, tag the MLflow parent run and list it in the summary, and go on. stop: also end the
    run after that round (its checkpoint is kept; fix the cause, then `posttrain resume`). NaN/Inf in
    any metric stops the run either way."""
    min_reward_std: float = Field(0.0, ge=0)
    """train/reward_std must be above this. axolotl: healthy > 0 on most steps; always 0 means no
    learning signal (every completion got the same reward)."""
    max_frac_reward_zero_std: float = Field(0.99, ge=0, le=1)
    """train/frac_reward_zero_std (share of prompt groups whose completions all got one reward, so zero
    advantage and no gradient) at most this. axolotl: healthy < 0.8, red flag 1.0 on every step."""
    min_entropy: float = Field(0.01, ge=0)
    """train/entropy (mean per-token policy entropy, nats) at least this. axolotl: healthy 0.05--0.5;
    < 0.01 suggests mode collapse (completions nearly identical)."""
    max_entropy: float = Field(1.0, gt=0)
    """train/entropy at most this. axolotl: > 1.0 suggests the model is not converging. Randomly
    initialized test models sit far above it (about ln(vocab_size)); raise it for those."""
    max_grad_norm: float = Field(10.0, gt=0)
    """train/grad_norm (total gradient norm before grpo.max_grad_norm clips it, mean over the round's
    optimizer steps) at most this. axolotl: healthy 0.001--1.0; > 10 is unstable."""
    max_kl: float = Field(2.0, ge=0)
    """train/kl (KL to the reference policy; 0 when grpo.beta is 0) at most this. axolotl: healthy
    0.0--0.5; > 2.0 suggests the policy has diverged too far from the reference."""
    max_clip_ratio: float = Field(0.3, ge=0, le=1)
    """train/clip_ratio (share of tokens whose ratio left [1 - epsilon, 1 + epsilon_high]) at most this.
    axolotl: healthy < 0.1; > 0.3 means PPO clipping is too aggressive."""
    min_completion_length: float = Field(1.0, ge=0)
    """train/completion_length (mean tokens per completion) at least this: below, completions have
    collapsed to (nearly) empty."""
    max_truncated_frac: float = Field(0.8, ge=0, le=1)
    """rollout/truncated_frac (share of completions cut at rollout.max_completion_length) at most this.
    axolotl (completions/clipped_ratio): healthy < 0.3; > 0.8 means most completions hit the cap. Without
    that metric, a mean completion_length at the cap counts as all truncated."""


@dataclass(frozen=True)
class Finding:
    """One metric outside its healthy range (or not finite) in one round."""

    metric: str
    value: float
    range: str
    """The healthy range, e.g. `<= 10` or `[0.01, 1]`; `finite` for NaN/Inf."""
    message: str
    fatal: bool = False
    """NaN/Inf: always stops the run, whatever health.on_unhealthy says."""

    def as_dict(self) -> dict:
        return asdict(self)


class TrainingUnhealthy(RuntimeError):
    """A round's metrics made the run stop: NaN/Inf, or out of range with health.on_unhealthy: stop."""

    def __init__(self, round_index: int, findings: list[Finding], quarantined: Path | None = None):
        self.round_index, self.findings, self.quarantined = round_index, findings, quarantined
        lines = [f"round {round_index}: training is unhealthy, stopping the run:"]
        lines += [f"  {f.metric} = {f.value:.6g} (healthy: {f.range}): {f.message}" for f in findings]
        if quarantined is not None:
            lines.append(f"round {round_index}'s optimize output was moved to {quarantined}, so a resume "
                         "recomputes that round instead of continuing from its weights; the checkpoints of "
                         "the earlier rounds are intact. NaN/Inf always stops a run.")
        else:
            lines.append(f"every checkpoint so far, round {round_index}'s included, is intact. Fix the cause "
                         "and `posttrain resume`, or widen the range (health.*) or set health.on_unhealthy: warn "
                         "(with --allow-config-change).")
        super().__init__("\n".join(lines))


def check_round(metrics: dict, cfg: HealthConfig, max_completion_length: int) -> list[Finding]:
    """The findings for one round's metrics (parent-run names, as flows/pipeline.py logs them); a
    metric the dict lacks is not checked. A NaN/Inf value is a fatal finding, except in the
    per-reward-function statistics, where NaN means the function applied to no completion (TRL's
    `rewards/<name>/mean`).

    >>> cfg = HealthConfig()
    >>> check_round({"train/grad_norm": 0.4, "train/entropy": 0.3, "train/kl": 0.1}, cfg, 256)
    []
    >>> [(f.metric, f.range) for f in check_round({"train/grad_norm": 42.0, "train/entropy": 0.001}, cfg, 256)]
    [('train/entropy', '[0.01, 1]'), ('train/grad_norm', '<= 10')]
    >>> [(f.metric, f.fatal) for f in check_round({"train/loss": float("nan"), "rewards/code/mean": float("nan")},
    ...                                           cfg, 256)]
    [('train/loss', True)]
    >>> check_round({"rollout/truncated_frac": 0.9}, cfg, 256)[0].message
    'completions are cut at rollout.max_completion_length (256 tokens): raise it, or look for reward hacking by length'
    """
    numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    findings = [Finding(k, v, "finite", "not a number: the weights of this round cannot be trusted "
                        "(lower grpo.learning_rate; check the rewards and the data of this round)", fatal=True)
                for k, v in numbers.items() if not math.isfinite(v) and not k.startswith(NOT_APPLICABLE_NAN)]
    values = {k: v for k, v in numbers.items() if math.isfinite(v)}

    def check(metric: str, low: float | None, high: float | None, why_low: str = "", why_high: str = "",
              low_strict: bool = False) -> None:
        if metric not in values:
            return
        v = values[metric]
        too_low = low is not None and (v <= low if low_strict else v < low)
        too_high = high is not None and v > high
        if not (too_low or too_high):
            return
        if low is not None and high is not None:
            healthy = f"[{low:g}, {high:g}]"
        else:
            healthy = (f"> {low:g}" if low_strict else f">= {low:g}") if low is not None else f"<= {high:g}"
        findings.append(Finding(metric, v, healthy, why_low if too_low else why_high))

    check("train/reward_std", cfg.min_reward_std, None, low_strict=True,
          why_low="no learning signal: the completions got (nearly) the same reward (test the reward functions "
                  "on a few completions; the task may be too hard or too easy for the policy)")
    check("train/frac_reward_zero_std", None, cfg.max_frac_reward_zero_std,
          why_high="(almost) every prompt group got one reward for all its completions: zero advantages, "
                   "no gradient (more rollout.num_generations, a higher rollout.temperature, or easier prompts)")
    check("train/entropy", cfg.min_entropy, cfg.max_entropy,
          why_low="mode collapse: the completions are nearly identical (raise rollout.temperature, lower "
                  "grpo.learning_rate, or add a KL penalty with grpo.beta)",
          why_high="the policy is close to random and not converging (lower grpo.learning_rate; check the "
                   "SFT stage and rollout.temperature)")
    check("train/grad_norm", None, cfg.max_grad_norm,
          why_high="unstable gradients (lower grpo.learning_rate, more grpo.gradient_accumulation_steps; "
                   "grpo.max_grad_norm clips the update)")
    check("train/kl", None, cfg.max_kl,
          why_high="the policy has diverged far from the reference (raise grpo.beta or lower grpo.learning_rate)")
    check("train/clip_ratio", None, cfg.max_clip_ratio,
          why_high="PPO clipping is too aggressive: the policy moves too far per round (lower "
                   "grpo.learning_rate, or fewer optimizer steps per round)")
    check("train/completion_length", cfg.min_completion_length, None,
          why_low="the completions have collapsed to (nearly) empty (check the rewards for a length "
                  "incentive, and the stop tokens)")
    cut = (f"completions are cut at rollout.max_completion_length ({max_completion_length} tokens): raise it, "
           "or look for reward hacking by length")
    if "rollout/truncated_frac" in numbers:
        check("rollout/truncated_frac", None, cfg.max_truncated_frac, why_high=cut)
    elif values.get("train/completion_length", 0.0) >= max_completion_length:  # a mean at the cap: all cut
        findings.append(Finding("train/completion_length", values["train/completion_length"],
                                f"< {max_completion_length}", cut))
    return findings


def quarantine(folder: Path) -> Path:
    """Rename an artifact folder to `<folder>.unhealthy` (replacing an older one), so the artifact store
    no longer finds it and recomputes it; the files stay there to inspect. Returns the new path.

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp())
    >>> (root / "abc").mkdir()
    >>> quarantine(root / "abc").name, (root / "abc").exists()
    ('abc.unhealthy', False)
    """
    target = folder.with_name(folder.name + ".unhealthy")
    if target.exists():
        shutil.rmtree(target)
    os.replace(folder, target)
    return target
