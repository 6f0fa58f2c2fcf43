"""Health checks: each GRPO round's metrics against healthy ranges.

After a round's metrics are logged (flows/rounds.py `RoundLog`), `check_round` compares them with
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

Collapse checks read what the policy wrote rather than how it trained (`collapse_metrics`, computed by the
score stage from the round's completions): a policy that gives one answer to every prompt can still raise
the reward when that answer is often right (measured: `<answer>9</answer>` to every "Which is the largest
of ...?" prompt, where 9 is the gold answer of 59% of them), so its reward curve looks like learning.

    posttrain run configs/demo.yaml health.on_unhealthy=stop health.max_kl=0.5
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field



NOT_APPLICABLE_NAN = "rewards/"
"""Metric names starting with this may be NaN in a healthy run: a reward function's mean/std over the
completions it applies to, NaN when it applies to none (score.py, as TRL's nanmean/nanstd)."""

GOLD_MARGIN = 0.1
"""A round's top answer is a collapse only if its share of the completions exceeds the share of prompts
whose gold answer is the most common one by more than this: a policy that is right on a task whose gold
answers are concentrated (all "yes", 85% "9") is not collapsed."""


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
    """train/entropy at most this, or at most `max_entropy_growth` times the first round's entropy if that
    is higher. axolotl: > 1.0 suggests the model is not converging -- a bound for a policy that has been
    RL-trained a while. A pretrained model sampled at temperature 1 starts well above it (SmolLM2-135M-Instruct
    with its 49152-token vocabulary: 1.7 nats at round 0, measured, in a run whose accuracy rose 0.30 -> 0.53),
    and a randomly initialized one near ln(vocab_size); what says "not converging" for those is entropy
    rising above where the run started, which the growth factor reads."""
    max_entropy_growth: float = Field(1.5, ge=1)
    """How far train/entropy may rise above the first round's (a factor) before it is flagged, where the
    first round's is above max_entropy. Higher: fewer warnings on a policy that explores more as it learns;
    lower: warned earlier that it is drifting towards random."""
    min_grad_norm: float = Field(0.001, ge=0)
    """train/grad_norm at least this in a round that stepped the optimizer. axolotl: healthy 0.001--1.0; below,
    the gradients have vanished (the advantages are ~0, or the trained weights do not reach the loss)."""
    min_reward_rise: float = Field(0.15, ge=0)
    """Each verifier's mean (`rewards/<name>/mean`, TRL's name; not a reward model's, whose scores are logits
    on no fixed scale) should have risen above this within `reward_rise_steps` optimizer steps. axolotl: a reward
    still below 0.15 after 20 steps is a red flag (the
    task is too hard for the policy, or the reward function is wrong). 0 turns it off."""
    reward_rise_steps: int = Field(20, ge=1)
    """The optimizer steps (summed over the rounds) `min_reward_rise` waits for."""
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
    max_top_answer_frac: float = Field(0.9, ge=0, le=1)
    """rollout/top_answer_frac (share of the round's completions giving its single most common answer,
    `extract_answer`) at most this -- or, where the prompts have gold answers, at most their own
    concentration (rollout/gold_top_answer_frac) + 0.1 if that is higher. Above both: the policy gives one
    answer regardless of the prompt (policy collapse), which a reward that is often right for that answer
    does not see. 0.9: a healthy policy on a task with varied answers stays well below; lower it to be
    warned earlier, at the risk of warning on tasks whose answers are few (yes/no, small integers) and have
    no gold column to compare with; 1 turns it off."""
    max_frac_identical_groups: float = Field(0.9, ge=0, le=1)
    """rollout/frac_identical_groups (share of prompt groups whose completions are all the same text, so
    the same reward, zero advantage and no gradient) at most this. 0.9: GRPO learns only from groups with
    variation; above it the round is (nearly) all collapsed groups. A fully converged policy (right on
    every prompt, the same way every time) can reach it too, so read it as a warning, not proof of a fault;
    raise it to 1 to turn it off."""


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


def check_round(metrics: dict, cfg: HealthConfig, max_completion_length: int,
                first_entropy: float | None = None, history: Sequence[dict] = (),
                verifiers: Sequence[str] = ()) -> list[Finding]:
    """The findings for one round's metrics (parent-run names, as flows/rounds.py logs them); a
    metric the dict lacks is not checked. A NaN/Inf value is a fatal finding, except in the
    per-reward-function statistics, where NaN means the function applied to no completion (TRL's
    `rewards/<name>/mean`). `first_entropy`: the run's first round's train/entropy, which sets the
    entropy's upper bound where it is above `max_entropy` (a pretrained model's real vocabulary). `history`:
    the earlier rounds' metrics, for the checks over several rounds; `verifiers`: the reward functions whose
    `rewards/<name>/mean` should rise above min_reward_rise (score.reward_funcs' verifiers, not a reward model's
    logits nor EBFT's feature-matching terms).

    >>> cfg = HealthConfig()
    >>> check_round({"train/grad_norm": 0.4, "train/entropy": 0.3, "train/kl": 0.1}, cfg, 256)
    []
    >>> [(f.metric, f.range) for f in check_round({"train/grad_norm": 42.0, "train/entropy": 0.001}, cfg, 256)]
    [('train/entropy', '[0.01, 1]'), ('train/grad_norm', '[0.001, 10]')]
    >>> check_round({"train/grad_norm": 0.0, "train/optimizer_steps": 0}, cfg, 256)  # no step, no gradient
    []

    A reward that has not risen above min_reward_rise once reward_rise_steps optimizer steps are done:

    >>> early = [{"rewards/accuracy/mean": 0.05, "rewards/format/mean": 0.9, "train/optimizer_steps": 8}] * 2
    >>> [(f.metric, f.message[:60]) for f in check_round({"rewards/accuracy/mean": 0.1, "rewards/format/mean": 1.0,
    ...                                                   "train/optimizer_steps": 8}, cfg, 256, history=early,
    ...                                                  verifiers=["accuracy", "format"])]
    [('rewards/accuracy/mean', 'below 0.15 in all 24 optimizer steps so far: the task may be')]
    >>> [(f.metric, f.fatal) for f in check_round({"train/loss": float("nan"), "rewards/code/mean": float("nan")},
    ...                                           cfg, 256)]
    [('train/loss', True)]
    >>> check_round({"train/entropy": 1.9}, cfg, 256, first_entropy=1.7)  # a real model, near where it started
    []
    >>> [(f.metric, f.range) for f in check_round({"train/entropy": 2.9}, cfg, 256, first_entropy=1.7)]
    [('train/entropy', '[0.01, 2.55]')]
    >>> check_round({"rollout/truncated_frac": 0.9}, cfg, 256)[0].message
    'completions are cut at rollout.max_completion_length (256 tokens): raise it, or look for reward hacking by length'

    A top answer is a collapse above max_top_answer_frac and the gold answers' own concentration + 0.1;
    its text travels as `rollout/top_answer`:

    >>> collapsed = {"rollout/top_answer_frac": 0.97, "rollout/gold_top_answer_frac": 0.59, "rollout/top_answer": "9"}
    >>> check_round(collapsed, cfg, 256)[0].message[:96]
    "policy collapse: 97% of completions answer '9' (gold answers: at most 59% share one answer); the"
    >>> check_round({**collapsed, "rollout/gold_top_answer_frac": 0.95}, cfg, 256)  # gold is that concentrated
    []
    """
    numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    values = {k: v for k, v in numbers.items() if math.isfinite(v)}
    return [*_not_finite(numbers),
            *_learning_signal(values, cfg),
            *_entropy(values, cfg, first_entropy),
            *_grad_norm(values, cfg),
            *_reward_rise(values, history, cfg, verifiers),
            *_policy_drift(values, cfg),
            *_completion_length(values, cfg, max_completion_length, "rollout/truncated_frac" in numbers),
            *_collapse(metrics, values, cfg)]


def _not_finite(numbers: dict) -> list[Finding]:
    """A fatal finding per NaN/Inf metric, except the per-reward-function statistics (NOT_APPLICABLE_NAN)."""
    return [Finding(k, v, "finite", "not a number: the weights of this round cannot be trusted "
                    "(lower grpo.learning_rate; check the rewards and the data of this round)", fatal=True)
            for k, v in numbers.items() if not math.isfinite(v) and not k.startswith(NOT_APPLICABLE_NAN)]


def _out_of_range(values: dict, metric: str, low: float | None, high: float | None, why_low: str = "",
                  why_high: str = "", low_strict: bool = False) -> list[Finding]:
    """A finding if `metric` is in `values` and below `low` (at or below, with `low_strict`) or above `high`
    (None: no bound on that side), with `why_low` or `why_high` as its message; else none."""
    if metric not in values:
        return []
    v = values[metric]
    too_low = low is not None and (v <= low if low_strict else v < low)
    too_high = high is not None and v > high
    if not (too_low or too_high):
        return []
    if low is not None and high is not None:
        healthy = f"[{low:g}, {high:g}]"
    else:
        healthy = (f"> {low:g}" if low_strict else f">= {low:g}") if low is not None else f"<= {high:g}"
    return [Finding(metric, v, healthy, why_low if too_low else why_high)]


def _learning_signal(values: dict, cfg: HealthConfig) -> list[Finding]:
    """train/reward_std above min_reward_std, train/frac_reward_zero_std at most max_frac_reward_zero_std."""
    return [*_out_of_range(
                values, "train/reward_std", cfg.min_reward_std, None, low_strict=True,
                why_low="no learning signal: the completions got (nearly) the same reward (test the reward "
                        "functions on a few completions; the task may be too hard or too easy for the policy)"),
            *_out_of_range(
                values, "train/frac_reward_zero_std", None, cfg.max_frac_reward_zero_std,
                why_high="(almost) every prompt group got one reward for all its completions: zero advantages, "
                         "no gradient (more rollout.num_generations, a higher rollout.temperature, or easier "
                         "prompts)")]


def _entropy(values: dict, cfg: HealthConfig, first_entropy: float | None) -> list[Finding]:
    """train/entropy within [min_entropy, max_entropy], the upper bound raised to max_entropy_growth times
    `first_entropy` (the first round's) where that is higher."""
    max_entropy = max(cfg.max_entropy, cfg.max_entropy_growth * first_entropy if first_entropy else 0.0)
    return _out_of_range(
        values, "train/entropy", cfg.min_entropy, round(max_entropy, 6),
        why_low="mode collapse: the completions are nearly identical (raise rollout.temperature, lower "
                "grpo.learning_rate, or add a KL penalty with grpo.beta)",
        why_high="the policy is close to random and not converging" + (
            f" (its entropy rose to over {cfg.max_entropy_growth:g}x the first round's {first_entropy:.3g})"
            if max_entropy > cfg.max_entropy else "")
        + " (lower grpo.learning_rate; check the starting policy, its SFT stage where the run has one, and "
           "rollout.temperature)")


def _grad_norm(values: dict, cfg: HealthConfig) -> list[Finding]:
    """train/grad_norm at most max_grad_norm, and at least min_grad_norm in a round that stepped the optimizer."""
    stepped = values.get("train/optimizer_steps", 1) > 0
    return _out_of_range(
        values, "train/grad_norm", cfg.min_grad_norm if stepped else None, cfg.max_grad_norm,
        why_low="vanishing gradients: the update is ~0 (are the advantages all ~0? is the adapter attached to "
                "the layers the loss reaches?)",
        why_high="unstable gradients (lower grpo.learning_rate, more grpo.gradient_accumulation_steps; "
                 "grpo.max_grad_norm clips the update)")


def _policy_drift(values: dict, cfg: HealthConfig) -> list[Finding]:
    """train/kl at most max_kl, train/clip_ratio at most max_clip_ratio."""
    return [*_out_of_range(
                values, "train/kl", None, cfg.max_kl,
                why_high="the policy has diverged far from the reference (raise grpo.beta or lower "
                         "grpo.learning_rate)"),
            *_out_of_range(
                values, "train/clip_ratio", None, cfg.max_clip_ratio,
                why_high="PPO clipping is too aggressive: the policy moves too far per round (lower "
                         "grpo.learning_rate, or fewer optimizer steps per round)")]


def _completion_length(values: dict, cfg: HealthConfig, max_completion_length: int,
                       truncated_frac_logged: bool) -> list[Finding]:
    """train/completion_length at least min_completion_length; rollout/truncated_frac at most max_truncated_frac,
    or, where the round did not log it (`truncated_frac_logged`), a mean completion_length below the cap."""
    findings = _out_of_range(
        values, "train/completion_length", cfg.min_completion_length, None,
        why_low="the completions have collapsed to (nearly) empty (check the rewards for a length "
                "incentive, and the stop tokens)")
    cut = (f"completions are cut at rollout.max_completion_length ({max_completion_length} tokens): raise it, "
           "or look for reward hacking by length")
    if truncated_frac_logged:
        findings += _out_of_range(values, "rollout/truncated_frac", None, cfg.max_truncated_frac, why_high=cut)
    elif values.get("train/completion_length", 0.0) >= max_completion_length:  # a mean at the cap: all cut
        findings.append(Finding("train/completion_length", values["train/completion_length"],
                                f"< {max_completion_length}", cut))
    return findings


def _collapse(metrics: dict, values: dict, cfg: HealthConfig) -> list[Finding]:
    """rollout/top_answer_frac at most max_top_answer_frac (or the gold answers' own concentration + GOLD_MARGIN
    if higher), its text from `metrics`' rollout/top_answer; rollout/frac_identical_groups at most
    max_frac_identical_groups."""
    findings = []
    if "rollout/top_answer_frac" in values:  # collapse: one answer whatever the prompt
        top, gold = values["rollout/top_answer_frac"], values.get("rollout/gold_top_answer_frac")
        bound = cfg.max_top_answer_frac if gold is None else max(cfg.max_top_answer_frac, gold + GOLD_MARGIN)
        if top > bound:
            answer = metrics.get("rollout/top_answer")
            answer = f"answer {_short(answer)}" if isinstance(answer, str) else "give one answer"
            compared = ("no gold answers to compare" if gold is None
                        else f"gold answers: at most {gold:.0%} share one answer")
            findings.append(Finding(
                "rollout/top_answer_frac", top, f"<= {bound:g}",
                f"policy collapse: {top:.0%} of completions {answer} ({compared}); the policy gives one answer "
                "regardless of the prompt, and the reward rewards it as often as that answer is right (check "
                "the rewards for that shortcut; raise rollout.temperature or grpo.beta, lower grpo.learning_rate)"))
    findings += _out_of_range(
        values, "rollout/frac_identical_groups", None, cfg.max_frac_identical_groups,
        why_high="(almost) every prompt group's completions are one identical text: no variation within "
                 "the group, zero advantages (mode collapse, or a fully converged policy; raise "
                 "rollout.temperature, lower grpo.learning_rate, or add a KL penalty with grpo.beta)")
    return findings

def _reward_rise(values: dict, history: Sequence[dict], cfg: HealthConfig, verifiers: Sequence[str]) -> list[Finding]:
    """A finding per verifier whose mean has not exceeded cfg.min_reward_rise in any round, in the round where
    the optimizer steps so far first reach cfg.reward_rise_steps (once: later rounds are not re-flagged)."""
    if not cfg.min_reward_rise or "train/optimizer_steps" not in values:
        return []
    before = sum(float(h.get("train/optimizer_steps") or 0) for h in history)
    now = before + values["train/optimizer_steps"]
    if not before < cfg.reward_rise_steps <= now:
        return []
    findings = []
    for name in sorted(f"rewards/{v}/mean" for v in set(verifiers) if f"rewards/{v}/mean" in values):
        seen = [values[name]] + [float(h[name]) for h in history if isinstance(h.get(name), (int, float))
                                 and math.isfinite(float(h[name]))]
        if max(seen) <= cfg.min_reward_rise:
            findings.append(Finding(name, values[name], f"> {cfg.min_reward_rise:g} by step {cfg.reward_rise_steps}",
                                    f"below {cfg.min_reward_rise:g} in all {now:g} optimizer steps so far: the task "
                                    "may be too hard for the policy or the reward function wrong (read a few "
                                    "completions with their rewards; easier prompts, an SFT warm start, a format "
                                    "reward)"))
    return findings


def _short(text: str, limit: int = 40) -> str:
    """repr of a text, cut to `limit` characters for a one-line message."""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


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
