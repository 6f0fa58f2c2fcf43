"""optimize (GRPO): one round of policy-gradient updates on scored rollouts.

Loss (TRL 1.16 GRPOTrainer._compute_loss, DeepSeekMath GRPO with PPO clipping; grpo_loss.py computes it from
one input record, `LossInputs`, which `RoundTrainer.accumulate` assembles per micro-batch):
  ratio_t   = exp(logp_t - old_logp_t)      old = pi_old, the policy at the start of the round
  loss_t    = -min(ratio_t * A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) * A)
            + beta * KL_t,  KL_t = ratio_t * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)
              (k3 estimator, importance-corrected: TRL's use_bias_correction_kl)
aggregated per `loss_type`: grpo (per-sequence mean, then batch mean), bnpo (token mean
over the micro-batch), dr_grpo (sum / (batch * max_completion_length)), dapo (sum /
completion tokens of the whole optimizer step). The reference policy is the base
model with the LoRA adapter disabled (PEFT's `disable_adapter`).

A round: shuffle the scored rows, cut them into optimizer steps of gradient_accumulation_steps
micro-batches, compute pi_old once, then `num_iterations` passes over the steps (TRL's mu). Rows
that share a prompt run it through the model once (`logprobs.batch_logps`); with dapo and beta 0 a step's
rows are regrouped by prompt, since dapo's gradient does not depend on how a step is cut.
Micro-batches with no signal (all advantages 0, or all masked by `mask_truncated_completions`)
are skipped (`skip_zero_advantage_batches`); each step clips the gradient norm to
`max_grad_norm` and sets the learning rate from a schedule over the whole run's steps
(`lr_scheduler_type`, warmup, horizon `lr_schedule_rounds`).

Departures from TRL: pi_old is always the trainer's own policy at the start of the round and
the sampler's recorded log-probs enter only through the importance-sampling correction, so
rollouts from any engine are treated alike -- except that rows the transformers engine sampled
from that very policy bring pi_old with them (`reuse_sampling_logps`: no forward pass for them);
optimizer state is carried between rounds in the adapter folder; warmup step s uses (s + 1) / warmup_steps of the
learning rate (HF: s / ...).

Across processes (`train.num_processes`, launched by stages/runtime/distributed.py): each rank runs every
world_size-th micro-batch of a step and the gradients are summed before the step (`run`'s `group`).
With `train.strategy: fsdp` the model is sharded (FSDP2); every forward then gathers weights from all
ranks, so each rank makes the same number of forward calls: a rank short of a micro-batch runs a one-row
filler whose loss is multiplied by 0, and a micro-batch's log-probs come from one plain forward, not
`logprobs.batch_logps`'s shared prompt pass (two forwards before one backward: FSDP2 reshards a block after the
backward of the second and the first then finds its weights freed). The plain forward's float rounding
differs from the shared pass's by ~1e-7, so AdamW, which turns noise in near-zero gradient entries into
whole steps, ends a few 1e-4 of the learning rate away from a one-process run (SGD: < 1e-6).
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.runtime.imports import LazyModule
from stages.runtime.keys import key_when_set, not_in_key
from stages.scoring.advantages import ZERO_ADVANTAGE
from stages.training import logprobs, scope_rl
from stages.training.grpo_loss import LossConfig, LossInputs, grpo_loss, off_policy_mask, sampling_correction

torch = LazyModule("torch")  # imported on first use: loading a config does not import torch

log = logging.getLogger(__name__)


class GRPOConfig(BaseModel):
    """GRPO optimization (names as in TRL's GRPOConfig and axolotl)."""

    model_config = ConfigDict(extra="forbid")

    rounds: int = not_in_key(12, ge=1)
    """rollout -> score -> optimize cycles."""
    adapter: Literal["lora", "none"] = "lora"
    """lora: train a PEFT LoRA adapter (reference = adapter disabled). none: full fine-tuning
    (reference = the starting model, kept frozen in memory when beta > 0)."""
    learning_rate: float = Field(2e-4, gt=0)
    """Peak learning rate of `optim` for the trainable weights (LoRA, or all with `adapter: none`); the
    schedule (`lr_scheduler_type`, warmup) scales it per optimizer step."""
    beta: float = Field(0.0, ge=0)
    """KL coefficient against the reference (base, adapter disabled). 0 (TRL's default): no reference
    forward pass at all (about a third less optimize compute) and train/kl is 0, as in TRL."""
    epsilon: float = Field(0.2, gt=0)
    """Lower clip range of the ratio (PPO epsilon)."""
    epsilon_high: float | None = None
    """Upper clip range (DAPO's clip-higher); unset: equal to epsilon."""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = "dapo"
    """Loss aggregation; TRL's default is dapo (token-level, no length bias)."""
    micro_batch_size: int = Field(64, ge=1)
    """Completions per forward/backward pass."""
    gradient_accumulation_steps: int = Field(2, ge=1)
    """Micro-batches per optimizer step; a round has rows / (micro_batch_size * this) steps per pass."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Clip the gradient's global L2 norm to this before each optimizer step (TRL's 1.0); the metric
    `grad_norm` is the norm before clipping."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay of the optimizer (AdamW's, Adafactor's); 0 as TRL."""
    adam_beta1: float | None = key_when_set(None, ge=0, lt=1)
    """AdamW's first-moment decay (TRL/HF `adam_beta1`, axolotl's too); unset: 0.9, torch's and TRL's default.
    adamw and adamw_8bit only (another optim refuses it)."""
    adam_beta2: float | None = key_when_set(None, ge=0, lt=1)
    """AdamW's second-moment decay (`adam_beta2`); unset: 0.999. adamw and adamw_8bit only."""
    adam_epsilon: float | None = key_when_set(None, gt=0)
    """AdamW's denominator epsilon (`adam_epsilon`); unset: 1e-8. adamw and adamw_8bit only."""
    optim: Literal["adamw", "adamw_8bit", "adafactor", "sgd"] = "adamw"
    """Optimizer (TRL/axolotl `optim`). adamw: torch AdamW, two fp32 moments per weight. adafactor:
    transformers' Adafactor with a fixed learning rate (scale_parameter=False, relative_step=False):
    factored second moment, no first moment: far less optimizer memory for full fine-tuning, noisier
    steps. adamw_8bit: bitsandbytes' 8-bit AdamW (moments in 8 bits); needs bitsandbytes and the weights
    on a CUDA GPU (train.device): without them the config is refused, naming this key.
    sgd: plain torch SGD (no momentum), the update is learning_rate * gradient: for checks that compare
    gradients through weights (Adam's first step is the gradient's sign and hides its scale).
    The optimizer state is carried from round to round (optimizer.pt); a round whose previous state was
    made by another optimizer starts this one fresh, with a warning."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule over the whole run's optimizer steps (TRL `lr_scheduler_type`). constant
    (default, as before): no decay, nothing depends on how many rounds the run has. linear / cosine: decay
    to 0 at the end of `lr_schedule_rounds` rounds (HF's get_linear/cosine_schedule_with_warmup), which
    must then be set."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps (counted from round 0) of linear warmup: step s < warmup_steps uses
    learning_rate * (s + 1) / warmup_steps (HF uses s / warmup_steps, whose first step does nothing).
    0: none. Needs no horizon, so it works with `constant`. Higher: gentler start of Adam's moments,
    slower early learning. Exclusive with warmup_ratio."""
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    """Warmup as a fraction of the schedule's horizon (TRL `warmup_ratio`): ceil(ratio * lr_schedule_rounds
    * steps per round) steps. Needs lr_schedule_rounds."""
    lr_schedule_rounds: int | None = Field(None, ge=1)
    """Horizon of the schedule in rounds (linear/cosine reach 0 after it; warmup_ratio is a fraction of it).
    Not taken from `rounds` on purpose: a round's artifact key leaves `rounds` out, so that raising
    `rounds` reuses the rounds already trained; the horizon changes every round's learning rate, so it is a
    field of its own and enters every key. Set it to `rounds` (raising it later retrains every round, as it
    must); it may not be below `rounds` for linear/cosine (later rounds would train at 0). Unset: only
    `constant` (with warmup_steps) is allowed. The schedule position of a step is round_index * steps per
    round + its index in the round, assuming every round has as many rows as this one."""
    num_iterations: int = Field(1, ge=1)
    """Optimizer passes over a round's rollouts (TRL `num_iterations`, GRPO's mu). pi_old stays the policy
    at the start of the round, so later passes are PPO-clipped against it; every pass goes through the
    same micro-batches in the same order, as TRL's buffered generation batch. Higher: more updates per
    generated sample (cheaper than generating), staler ratios, more clipping; 1 (TRL's default): one pass."""
    skip_zero_advantage_batches: bool = True
    """Skip micro-batches in which every row has advantage 0 (|A| < 1e-8: its group was all-correct or
    all-wrong) or is masked out by mask_truncated_completions: no forward, no backward. A step
    with only such micro-batches (or a whole round) takes no optimizer step: weights, optimizer state and
    moments stay as they are, where AdamW would otherwise keep moving the weights on its momentum. With
    beta = 0 a kept step's gradient is exactly what it would be without skipping (the loss normalizers
    still count the skipped rows, as TRL's would); with beta > 0 the skipped rows' KL-only pull is dropped.
    Counted in the metrics `skipped_batches` (micro-batches, per pass) and `skipped_steps`. True by
    default: such micro-batches cost a forward and backward for no signal. False: step on them (TRL).
    With loss_type dapo and beta 0 the skipping goes down to rows: only rows with signal run, regrouped so
    a group shares its prompt pass (the step's gradient is the same sum; `trained_rows` counts them)."""
    replay_buffer_size: int = not_in_key(0, ge=0)
    """Cache up to this many groups with signal (nonzero advantages) and swap them, in later rounds, for the
    round's zero-signal groups (axolotl `replay_buffer_size`; stages/scoring/replay.py says how groups are kept and
    drawn). The swapped-in rows are marked `replayed` in the round's replay artifact. Higher: fewer rounds
    whose batch is mostly empty, more training on stale samples. 0 (default): off."""
    replay_recompute_logps: bool = True
    """For replayed rows, take the trainer's round-start log-probs as their sampling log-probs (axolotl
    `replay_recompute_logps`): the stale sample is treated as on-policy, its importance-sampling weight is 1
    and off-policy masking never drops it. False: keep the log-probs of the policy that sampled it, so the
    correction (vllm_importance_sampling_*) and off_policy_mask_threshold weigh it by how stale it is."""
    reroll_start_fraction: float = not_in_key(1.0, gt=0, le=1)
    """Re-roll prompts where every completion failed (all rewards 0) in later rounds, from round
    max(1, int(rounds * this)) on (axolotl `reroll_start_fraction`): the model may solve them after some
    training. Rolled-out rows are marked `rerolled`. 1.0 (default): off."""
    reroll_max_groups: int = not_in_key(1, ge=1)
    """Prompts re-rolled per round at most, taken first-failed first; they replace the last prompts of the
    round's slice (axolotl `reroll_max_groups`). At most rollout.prompts_per_round."""
    streaming_partial_batch: bool = False
    """axolotl's streaming scoring (trl.streaming_partial_batch, its async GRPO): a round's prompt groups are taken
    `streaming_min_groups` at a time in the order they were sampled, each chunk's rows shuffled and cut into
    micro-batches of micro_batch_size that hold that chunk's rows only (its last one may be smaller, which adds
    micro-batches and so optimizer steps), and the score stage computes every advantage statistic within its group
    (score.scale_rewards batch acts as group; normalize_then_sum normalizes the weighted sum per group, not over the
    batch), as axolotl's `_score_streaming` does. Micro-batches of whole groups make zero-advantage skipping finer.
    Exclusive with replay_buffer_size (axolotl's streaming path never swaps replayed groups in). False: every
    micro-batch is drawn from the whole round, shuffled (TRL)."""
    streaming_min_groups: int | None = key_when_set(None, ge=1)
    """Prompt groups per streaming chunk (axolotl's trl.streaming_min_groups); unset: 1, axolotl's default. Higher:
    micro-batches mix more groups. Only with streaming_partial_batch."""
    scope_rl: bool = False
    """SCOPE-RL entropy control (arXiv:2510.08141, axolotl's trl.scope_rl; stages/training/scope_rl.py): each round
    also samples a share scope_alpha of its prompt groups again at the sampling temperature times
    clip(1 + scope_target_entropy - H, scope_temperature_min, scope_temperature_max), H the entropy of the policy
    sampled (its round's mean), keeps those completions whose total reward reaches scope_positive_threshold at
    advantage 1 (the rest 0) and adds them to the loss weighted by scope_alpha (their rows' KL not counted, their
    sampling correction 1). Entropy below the target samples hotter, above it colder, holding it near the target
    where GRPO's falls. Costs about scope_alpha more generation (at least one group a round). loss_type grpo or
    dr_grpo (token-normalized losses would weigh rows by length); rl grpo or gdpo on the round's own prompts; not with
    streaming_partial_batch. False: off."""
    scope_target_entropy: float = Field(0.5, ge=0)
    """SCOPE-RL's target entropy H0 (nats per token, as the optimize stage's `entropy`)."""
    scope_alpha: float = Field(1 / 64, gt=0, le=1)
    """SCOPE-RL's share of prompt groups resampled each round (at least one group), and the weight of their term in
    the loss. 1/64 (axolotl's default): 8 groups of a 512-prompt round."""
    scope_temperature_min: float = Field(0.8, gt=0)
    """Lowest auxiliary temperature, relative to the sampling temperature (entropy above the target)."""
    scope_temperature_max: float = Field(1.2, gt=0)
    """Highest auxiliary temperature, relative to the sampling temperature (entropy collapsed below the target)."""
    scope_positive_threshold: float = 1.0
    """Total reward (score's weighted sum) at or above which an auxiliary completion is kept, at advantage 1."""
    mask_truncated_completions: bool = False
    """Leave completions that hit max_completion_length (finish_reason "length") out of the loss: their
    tokens get mask 0 and do not count in dapo's normalizer (TRL `mask_truncated_completions`, DAPO's
    overlong filtering). True: a cut-off answer is not punished or rewarded for being cut off; fewer tokens
    train. False (TRL's default): every completion trains."""
    lora_r: int = Field(16, ge=1)
    """LoRA rank (adapter: lora; PEFT's `r`). Higher: more trainable weights per layer, more memory.
    The rollout engines' LoRA slots are sized from it."""
    lora_alpha: int = Field(32, ge=1)
    """LoRA scaling numerator (PEFT's `lora_alpha`): the update is scaled by lora_alpha / lora_r."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA branch's input while training (PEFT's `lora_dropout`)."""
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Modules the adapter wraps (PEFT's `target_modules`): by default every attention and MLP projection
    (Qwen2/Llama names)."""
    use_bias_correction_kl: bool = True
    """Multiply the k3 KL term by the importance ratio (TRL's default, DeepSeek-V3.2)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """PPO ratio per token (GRPO) or one length-normalized ratio per sequence (GSPO), as in TRL."""
    vllm_importance_sampling_correction: bool = True
    """Weight each token's loss by pi_old / pi_sampling: corrects for the engine's numerics and for
    stale (prefetched) rollouts. pi_old is the trainer's policy at the start of the round."""
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        "token_truncate")
    """How the correction ratio is formed (per token or per sequence) and bounded (truncated at the cap,
    or masked to 0 above it), as in TRL."""
    vllm_importance_sampling_cap: float = Field(3.0, gt=0)
    """Upper bound C of the correction ratio."""
    off_policy_mask_threshold: float | None = Field(None, gt=0)
    """Drop sequences with negative advantage whose mean KL(pi_sampling || pi_theta) per token exceeds this
    (DeepSeek-V3.2's off-policy sequence masking, TRL's off_policy_mask_threshold); unset: off."""
    reuse_sampling_logps: bool = True
    """Skip the no-grad pi_old pass (pi_old: the policy at the start of the round) where its numbers are at hand,
    saving about a quarter of the optimize compute. (1) A round that is one optimizer step of one pass
    (num_iterations 1, all rows in one step) trains on pi_old itself: pi_old is the step's own forward,
    detached, for every row (TRL does the same when a generation batch is one step). (2) Otherwise, rows the
    transformers engine sampled in this round from the round's starting policy (same weights, float32, log
    softmax(logits / temperature) as here), not replayed, bring pi_old as their sampling log-probs. Rows from
    another engine (vLLM's numerics differ), an older policy (async prefetch), a rollout_func or a replay
    buffer are recomputed. False: recompute every row in a pass of its own (the difference is float
    rounding, ~1e-6 per token)."""
    shared_prompt_pass: bool = True
    """Rows of a micro-batch that share a prompt (a GRPO group) run it through the model once, its KV cache
    copied to each row with gradients flowing back into the one pass (`logprobs.batch_logps`): the same log-probs and
    gradients as a plain forward up to float rounding, for a fraction of the prompt compute (2.3x faster on
    the quickstart's 64-row micro-batches). False: one plain forward over prompt and completion per
    micro-batch, as TRL: half the operators to dispatch (benchmarks/dispatch_ops.py), which is what a small
    model's micro-batch costs on a GPU. FSDP (`train.strategy: fsdp`), `train.gradient_checkpointing` (no KV
    cache) and `train.compile` (a graph per block and pass with the cache, one for all blocks without:
    benchmarks/compile_graphs.py) run the plain forward whatever this says."""
    logps_chunk_tokens: int = not_in_key(0, ge=0)
    """Compute the log-probs from the lm_head a few rows at a time, about this many tokens per chunk
    (`logprobs.chunked_token_logps`): the (rows, positions, vocabulary) logits and their fp32 log-softmax exist for one
    chunk at a time, and the backward recomputes each chunk's (torch.utils.checkpoint), as Liger's fused
    linear losses and TRL's `use_liger_loss` avoid materializing them. With a 150k vocabulary the whole
    micro-batch's logits take much of the optimize stage's memory. Costs one more lm_head matmul per chunk in
    the backward: on an H200 with a 0.5B Qwen2 (micro-batches of 16 rows of 512 tokens), 4096 took peak
    memory from 27.5 to 23.0 GiB (full fine-tuning) and 22.9 to 18.4 GiB (LoRA), for 5% and 17% more time
    (BENCHMARKS.md, issue 26): a memory knob, for micro-batches that would not fit otherwise. 0 (default): off.
    Only for models whose logits are the output embedding of the decoder's last hidden state (checked when
    the round loads the model: another, e.g. with logit soft-capping, stops the round with an error naming
    this key), and not with train.strategy fsdp (a config error). Changes float rounding only, so it is not
    in the artifact key."""
    seed: int = 0
    """Seed of each round's row order and of the adapter's initialization (with the round index)."""

    @model_validator(mode="after")
    def _adam_options_need_adam(self):
        given = [f"adam_{n}" for n in ("beta1", "beta2", "epsilon") if getattr(self, f"adam_{n}") is not None]
        if given and self.optim not in ("adamw", "adamw_8bit"):
            raise ValueError(f"{', '.join(given)}: AdamW's options, but optim is {self.optim}, which does not read "
                             "them; remove them or use optim: adamw")
        return self

    @model_validator(mode="after")
    def _streaming_options_go_together(self):
        if self.streaming_min_groups is not None and not self.streaming_partial_batch:
            raise ValueError(f"streaming_min_groups {self.streaming_min_groups}: the chunk size of "
                             "streaming_partial_batch, which is off; set streaming_partial_batch: true or remove it")
        if self.scope_rl and self.streaming_partial_batch:
            raise ValueError("scope_rl with streaming_partial_batch: SCOPE-RL's auxiliary groups are weighed over "
                             "the whole round, which streaming cuts into chunks (axolotl refuses the pair too); set "
                             "one of them")
        if self.streaming_partial_batch and self.replay_buffer_size:
            raise ValueError(f"streaming_partial_batch with replay_buffer_size {self.replay_buffer_size}: axolotl's "
                             "streaming scorer only stores groups and never swaps them in, so the buffer would do "
                             "nothing; set one of them")
        return self

    @model_validator(mode="after")
    def _scope_rl_fits_the_loss(self):
        if self.scope_rl and self.loss_type not in ("grpo", "dr_grpo"):
            raise ValueError(f"scope_rl with loss_type {self.loss_type}: SCOPE-RL weighs its auxiliary rows against "
                             "the main ones per row, which a token-normalized loss undoes (rows weigh by length); set "
                             "loss_type: grpo or dr_grpo (axolotl requires it too)")
        if self.scope_temperature_min > self.scope_temperature_max:
            raise ValueError(f"scope_temperature_min {self.scope_temperature_min} is above scope_temperature_max "
                             f"{self.scope_temperature_max}; swap them")
        return self

    @model_validator(mode="after")
    def _schedule_has_a_horizon(self):
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("warmup_steps and warmup_ratio are both set; set one (warmup_steps: optimizer steps, "
                             "warmup_ratio: a fraction of lr_schedule_rounds)")
        needs = ([f"lr_scheduler_type: {self.lr_scheduler_type}"] if self.lr_scheduler_type != "constant" else []) + (
            [f"warmup_ratio: {self.warmup_ratio}"] if self.warmup_ratio else [])
        if needs and self.lr_schedule_rounds is None:
            raise ValueError(f"{' and '.join(needs)} {'need' if len(needs) > 1 else 'needs'} a horizon: set "
                             f"lr_schedule_rounds (e.g. to rounds, {self.rounds}), or use warmup_steps with "
                             "lr_scheduler_type: constant")
        if (self.lr_scheduler_type != "constant" and self.lr_schedule_rounds is not None
                and self.lr_schedule_rounds < self.rounds):
            raise ValueError(f"lr_schedule_rounds is {self.lr_schedule_rounds} but rounds is {self.rounds}: the "
                             f"{self.lr_scheduler_type} schedule reaches 0 after round {self.lr_schedule_rounds - 1} "
                             "and later rounds would not learn; set lr_schedule_rounds >= rounds")
        return self


# ---------------------------------------------------------------- schedule and batches


def scheduled_lr(step: int, learning_rate: float, scheduler_type: str, warmup_steps: int,
                 total_steps: int | None) -> float:
    """Learning rate of optimizer step `step` (0-based, counted over the whole run): linear warmup
    lr * (step + 1) / warmup_steps, then constant, or linear / cosine decay reaching 0 at `total_steps`
    (HF's get_{linear,cosine}_schedule_with_warmup after the warmup).

    >>> [round(scheduled_lr(s, 1.0, "constant", 4, None), 2) for s in range(6)]
    [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    >>> [round(scheduled_lr(s, 1.0, "linear", 2, 6), 2) for s in range(7)]
    [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    >>> [round(scheduled_lr(s, 1.0, "cosine", 0, 4), 3) for s in range(5)]
    [1.0, 0.854, 0.5, 0.146, 0.0]
    """
    if step < warmup_steps:
        return learning_rate * (step + 1) / warmup_steps
    if scheduler_type == "constant":
        return learning_rate
    if total_steps is None:
        raise ValueError(f"grpo.lr_scheduler_type: {scheduler_type} needs grpo.lr_schedule_rounds")
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    if scheduler_type == "linear":
        return learning_rate * (1.0 - progress)
    if scheduler_type == "cosine":
        return learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"grpo.lr_scheduler_type: unknown {scheduler_type!r}; use constant, linear or cosine")


def pad(rows: list[list], value, side: str, dtype) -> torch.Tensor:
    """Stack ragged lists into a (B, max_len) tensor padded on `side`: padded as lists, made a tensor in one
    call (a copy per row would be a host operator per row on every micro-batch)."""
    width = max(len(r) for r in rows)
    if side == "left":
        return torch.tensor([[value] * (width - len(r)) + list(r) for r in rows], dtype=dtype)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=dtype)


def collate(rows: list[dict], pad_token_id: int) -> dict:
    """TRL's layout: prompts left-padded, completions right-padded, masks alongside; `prompt_distinct` /
    `prompt_index` (which rows share a prompt, for `logprobs.batch_logps`) are worked out here, on the host, so that a
    batch on a GPU needs no read back."""
    from stages.rollout.engines.hf import repeats

    prompts = [r["prompt_token_ids"] for r in rows]
    completions = [r["completion_token_ids"] for r in rows]
    distinct, index = repeats([tuple(p) for p in prompts])  # left-padded alike: same ids, same mask
    return {
        "prompt_distinct": torch.tensor(distinct, dtype=torch.long),
        "prompt_index": torch.tensor(index, dtype=torch.long),
        "prompt_ids": pad(prompts, pad_token_id, "left", torch.long),
        "prompt_mask": pad([[1] * len(p) for p in prompts], 0, "left", torch.long),
        "completion_ids": pad(completions, pad_token_id, "right", torch.long),
        "completion_mask": pad([[1] * len(c) for c in completions], 0, "right", torch.long),
        "old_per_token_logps": pad([r["sampling_logprobs"] for r in rows], 0.0, "right", torch.float32),
        "advantages": torch.tensor([r["advantage"] for r in rows], dtype=torch.float32),
    }


# ---------------------------------------------------------------- the loss's inputs


def loss_config(cfg: GRPOConfig, max_completion_length: int) -> LossConfig:
    """grpo_loss's settings from the stage's config (epsilon_high unset: epsilon)."""
    return LossConfig(loss_type=cfg.loss_type, epsilon=cfg.epsilon,
                      epsilon_high=cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon, beta=cfg.beta,
                      max_completion_length=max_completion_length, use_bias_correction_kl=cfg.use_bias_correction_kl,
                      importance_sampling_level=cfg.importance_sampling_level)


def loss_inputs(cfg: GRPOConfig, batch: dict, logps: torch.Tensor, old_logps: torch.Tensor,
                ref_logps: torch.Tensor | None, num_items: float, micro_batches: int) -> LossInputs:
    """A collated micro-batch's LossInputs: the loss mask (completion tokens, less the rows
    mask_truncated_completions leaves out) and the off-policy corrections of the rows' sampling log-probs:
    pi_old / pi_sampling (vllm_importance_sampling_*) and the off-policy mask (off_policy_mask_threshold)."""
    mask = batch["completion_mask"].float() * batch["keep"].unsqueeze(1)
    sampling_logps = batch["old_per_token_logps"]
    is_weights = keep = None
    if cfg.vllm_importance_sampling_correction:
        is_weights = sampling_correction(old_logps, sampling_logps, mask, cfg.vllm_importance_sampling_mode,
                                         cfg.vllm_importance_sampling_cap)
    if cfg.off_policy_mask_threshold is not None:
        keep = off_policy_mask(batch["advantages"], logps, sampling_logps, mask, cfg.off_policy_mask_threshold)
    row_weights = kl_weights = None
    if "scope_aux" in batch:  # SCOPE-RL: its rows weighed, not corrected (sampled hotter or colder on purpose), no KL
        aux = batch["scope_aux"]
        row_weights, kl_weights = batch["scope_weight"], batch["scope_weight"] * (1 - aux)
        if is_weights is not None:
            is_weights = torch.where(aux.bool().unsqueeze(1), torch.ones_like(is_weights), is_weights)
    return LossInputs(logps, old_logps, batch["advantages"], mask, num_items_in_batch=num_items,
                      gradient_accumulation_steps=micro_batches, ref_logps=ref_logps, is_weights=is_weights,
                      off_policy_keep=keep, row_weights=row_weights, kl_weights=kl_weights)


# ---------------------------------------------------------------- one round


def _load_trainable(cfg: GRPOConfig, base_dir: Path, prev_dir: Path | None, devices=None):
    """(policy model with trainable params, frozen reference model or None for "disable the adapter"), placed
    and cast by stages/runtime/devices.py: trained weights in fp32, the reference and a LoRA adapter's base in the
    compute dtype (bf16 on a GPU)."""
    from transformers import AutoModelForCausalLM

    from stages.runtime import devices as placement

    if cfg.adapter == "none":
        model = placement.load_trainable(AutoModelForCausalLM, prev_dir or base_dir, devices)
        ref = placement.load_frozen(AutoModelForCausalLM, base_dir, devices) if cfg.beta != 0.0 else None
        return model, ref
    from peft import LoraConfig, PeftModel, get_peft_model

    base = placement.load_frozen(AutoModelForCausalLM, base_dir, devices)
    base = placement.compiled(placement.checkpointed(base, devices), devices)
    if prev_dir is not None:
        model = PeftModel.from_pretrained(base, prev_dir, is_trainable=True)
    else:
        model = get_peft_model(base, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                                lora_dropout=cfg.lora_dropout,
                                                target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM"))
    return placement.adapter_inputs_uncast(model, devices), None


def dapo_normalizer(steps: list[list[list[dict]]], step_index: int, masked_out: set[str]) -> float:
    """dapo's loss divisor for optimizer step `step_index` of a round (`steps[s]`: its micro-batches): the
    completion tokens of all the step's rows, those of skipped micro-batches included, those masked by
    mask_truncated_completions left out (the tokens TRL's `num_items_in_batch` counts). TRL divides by the
    generation batch's tokens over its steps_per_generation (the mean per step); the same number when a round
    is one step (benchmarks/ablations.py compares the two)."""
    return sum(len(r["completion_token_ids"]) for mb in steps[step_index] for r in mb
               if r["rollout_id"] not in masked_out)


def make_optimizer(cfg: GRPOConfig, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer named by `grpo.optim` over `params`, at the peak learning rate."""
    adam = {"betas": (0.9 if cfg.adam_beta1 is None else cfg.adam_beta1, 0.999 if cfg.adam_beta2 is None else
                      cfg.adam_beta2), "eps": 1e-8 if cfg.adam_epsilon is None else cfg.adam_epsilon}
    if cfg.optim == "adamw":
        return torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, **adam)
    if cfg.optim == "sgd":
        return torch.optim.SGD(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    if cfg.optim == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=cfg.learning_rate, scale_parameter=False, relative_step=False,
                         warmup_init=False, weight_decay=cfg.weight_decay)
    if cfg.optim == "adamw_8bit":
        device = params[0].device if params else torch.device("cpu")
        if device.type != "cuda":
            raise ValueError(f"grpo.optim: adamw_8bit is bitsandbytes' 8-bit AdamW, which needs a CUDA GPU; this "
                             f"optimize stage trains on the {device.type}. Use grpo.optim: adamw (or adafactor for "
                             "less optimizer memory).")
        try:
            import bitsandbytes
        except ImportError as e:
            raise ValueError(f"grpo.optim: adamw_8bit needs bitsandbytes, which does not import here ({e}); "
                             "pip install bitsandbytes (its 8-bit optimizers need a CUDA GPU), "
                             "or use grpo.optim: adamw") from e
        return bitsandbytes.optim.AdamW8bit(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, **adam)
    raise ValueError(f"grpo.optim: unknown {cfg.optim!r}; use adamw, adamw_8bit, adafactor or sgd")


def _load_optimizer_state(cfg: GRPOConfig, optimizer: torch.optim.Optimizer, prev_dir: Path | None,
                          sharded: bool = False) -> str:
    """Continue from the previous round's optimizer.pt: 'loaded', 'new' (none there) or 'reset' (made by
    another optimizer or for other weights: this one starts fresh, with a warning). `sharded`: the
    optimizer's parameters are FSDP shards, and the file's whole tensors are cut to match."""
    path = prev_dir / "optimizer.pt" if prev_dir is not None else None
    if path is None or not path.exists():
        return "new"
    saved = torch.load(path, weights_only=True, map_location="cpu")  # load_state_dict moves it to the weights
    # {"optim", "state_dict"}; before grpo.optim existed the file was AdamW's bare state dict
    saved_optim, state = (saved["optim"], saved["state_dict"]) if "optim" in saved else ("adamw", saved)
    if saved_optim != cfg.optim:
        log.warning("grpo.optim is %s but %s holds %s state; starting %s fresh", cfg.optim, path, saved_optim,
                    cfg.optim)
        return "reset"
    try:
        if sharded:
            from stages.runtime.distributed import shard_optimizer_state

            state = shard_optimizer_state(state, optimizer)
        optimizer.load_state_dict(state)
    except ValueError as e:  # another set of trainable weights
        log.warning("%s does not fit these trainable weights (%s); starting %s fresh", path, e, cfg.optim)
        return "reset"
    return "loaded"


def _is_truncated(row: dict) -> bool:
    return row.get("finish_reason") == "length"


def _has_signal(row: dict, masked_out: set[str]) -> bool:
    """The row's loss is not 0: its advantage is not 0 and it is not masked out."""
    return abs(row["advantage"]) >= ZERO_ADVANTAGE and row["rollout_id"] not in masked_out


def _trains(cfg: GRPOConfig, micro_batch: list[dict], masked_out: set[str]) -> bool:
    """False for a micro-batch with no signal (every row's advantage 0 or its loss masked) that
    skip_zero_advantage_batches skips."""
    return not cfg.skip_zero_advantage_batches or any(_has_signal(r, masked_out) for r in micro_batch)


def _step_runs(cfg: GRPOConfig, micro_batches: list[list[dict]], masked_out: set[str]) -> list[list[dict]]:
    """The micro-batches an optimizer step runs forward and backward. dapo with beta 0: the step's rows,
    less those without signal when skip_zero_advantage_batches is on (their loss and gradient are 0),
    with a group's rows side by side so that they share one prompt pass (logprobs.batch_logps), cut again into
    micro_batch_size: dapo divides by the whole step's token count, so the step's gradient is the same
    sum over the same rows however they are cut. Other losses normalize per micro-batch: the
    micro-batches as cut, those without signal skipped."""
    live = [mb for mb in micro_batches if _trains(cfg, mb, masked_out)]
    if not (cfg.loss_type == "dapo" and cfg.beta == 0.0) or not live:
        return live
    rows = [r for mb in live for r in mb if _has_signal(r, masked_out) or not cfg.skip_zero_advantage_batches]
    rows.sort(key=lambda r: r["prompt_id"])  # stable: the shuffled order within a group stays
    return [rows[i : i + cfg.micro_batch_size] for i in range(0, len(rows), cfg.micro_batch_size)]


@dataclass
class RoundPlan:
    """What every rank makes alike of a round's scored rows (`plan_round`)."""

    rows: list[dict]  # shuffled by the round's seed
    steps: list[list[list[dict]]]  # steps[s]: the micro-batches of optimizer step s as cut, the same in every pass
    runs: list[list[list[dict]]]  # runs[s]: the micro-batches step s computes (_step_runs)
    masked_out: set[str]  # rollout ids whose loss mask_truncated_completions zeroes
    replayed: list[dict]  # rows the replay buffer put back
    pi_old_is_step: bool  # pi_old is the round's one step's own forward: no pass of its own
    steps_per_round: int  # optimizer steps over all num_iterations passes, skipped ones included


def round_steps(cfg: GRPOConfig, rows: int, num_generations: int) -> int:
    """Optimizer steps a round of `rows` scored rows (groups of `num_generations`) takes over its num_iterations
    passes, skipped ones included (`plan_round`'s steps_per_round): gradient_accumulation_steps micro-batches per
    step, the last step of a pass taking what is left; a micro-batch is micro_batch_size rows, or under
    streaming_partial_batch what is left of its chunk. flows/axolotl.py turns TRL's max_steps into rounds with it.

    >>> round_steps(GRPOConfig(micro_batch_size=4, gradient_accumulation_steps=2, num_iterations=3), 20, 4)
    9
    >>> round_steps(GRPOConfig(micro_batch_size=8, gradient_accumulation_steps=2, streaming_partial_batch=True), 24, 4)
    3
    """
    if not cfg.streaming_partial_batch:
        micro_batches = -(-rows // cfg.micro_batch_size)
    else:  # each chunk of streaming_min_groups groups is cut on its own
        chunk = (cfg.streaming_min_groups or 1) * num_generations
        micro_batches = (rows // chunk) * -(-chunk // cfg.micro_batch_size) + -(-(rows % chunk) // cfg.micro_batch_size)
    return -(-micro_batches // cfg.gradient_accumulation_steps) * cfg.num_iterations


def _prompt_groups(rows: list[dict]) -> list[list[dict]]:
    """The round's rows as its prompt groups, in table order (a group starts at group_index 0)."""
    groups: list[list[dict]] = []
    for row in rows:
        if not groups or row["group_index"] == 0 or row["prompt_id"] != groups[-1][-1]["prompt_id"]:
            groups.append([])
        groups[-1].append(row)
    return groups


def micro_batches(cfg: GRPOConfig, rows: list[dict], rng: random.Random) -> list[list[dict]]:
    """The round's micro-batches, in order (`rows` is shuffled in place). TRL: the rows shuffled, cut into
    micro_batch_size. streaming_partial_batch (axolotl's `_score_streaming`): the prompt groups taken
    streaming_min_groups at a time in table order, each chunk's rows shuffled and cut on their own."""
    if not cfg.streaming_partial_batch:
        rng.shuffle(rows)
        return [rows[i : i + cfg.micro_batch_size] for i in range(0, len(rows), cfg.micro_batch_size)]
    groups, size, cut = _prompt_groups(rows), cfg.streaming_min_groups or 1, []
    rows.clear()
    for start in range(0, len(groups), size):
        chunk = [row for group in groups[start : start + size] for row in group]
        rng.shuffle(chunk)
        rows += chunk
        cut += [chunk[i : i + cfg.micro_batch_size] for i in range(0, len(chunk), cfg.micro_batch_size)]
    return cut


def _weigh_scope_rows(cfg: GRPOConfig, rows: list[dict]) -> None:
    """SCOPE-RL's rows (a round with `scope_aux` rows): each row's `scope_weight` over the whole round
    (scope_rl.row_weights: the loss is mean(main) + scope_alpha * mean(auxiliary)); none in other rounds."""
    if not rows or scope_rl.AUX_COLUMN not in rows[0]:
        return
    if not cfg.scope_rl:
        raise ValueError("scored rows with SCOPE-RL's auxiliary rows (scope_aux) need grpo.scope_rl on")
    weights = scope_rl.row_weights(torch.tensor([float(r[scope_rl.AUX_COLUMN]) for r in rows]), cfg.scope_alpha)
    for row, weight in zip(rows, weights.tolist()):
        row["scope_weight"] = weight


def plan_round(cfg: GRPOConfig, rows: list[dict], round_index: int) -> RoundPlan:
    """Shuffle the round's rows, cut them into micro-batches (`micro_batches`) and those into optimizer steps of
    gradient_accumulation_steps, and decide what each step computes and whether pi_old needs a pass of its own."""
    cut = micro_batches(cfg, rows, random.Random(cfg.seed * 100_003 + round_index))
    steps = [cut[i : i + cfg.gradient_accumulation_steps] for i in range(0, len(cut), cfg.gradient_accumulation_steps)]
    masked_out = {r["rollout_id"] for r in rows if cfg.mask_truncated_completions and _is_truncated(r)}
    replayed = [r for r in rows if r.get("replayed")]
    # pi_old: the policy at the start of the round, before any update (TRL computes it when a generation batch
    # spans several optimizer steps or num_iterations > 1, and always when it corrects for vLLM); every pass of
    # the round is clipped against it. One step of one pass: the step's own forward.
    pi_old_is_step = (cfg.reuse_sampling_logps and cfg.num_iterations == 1 and len(steps) == 1
                      and not (replayed and cfg.replay_recompute_logps))
    _weigh_scope_rows(cfg, rows)
    return RoundPlan(rows, steps, [_step_runs(cfg, mbs, masked_out) for mbs in steps], masked_out, replayed,
                     pi_old_is_step, len(steps) * cfg.num_iterations)


class RoundTrainer:
    """The round's trainable policy (and reference), optimizer and placement, on this rank (`run`'s docstring)."""

    def __init__(self, cfg: GRPOConfig, base_dir: Path, prev_adapter_dir: Path | None, round_index: int,
                 temperature: float, devices=None, group=None):
        from transformers import AutoTokenizer

        from stages.runtime import devices as placement
        from stages.runtime.policy import MODEL_LOADING

        self.cfg, self.round_index, self.temperature, self.devices, self.group = (cfg, round_index, temperature,
                                                                                  devices, group)
        self.placement = placement
        self.tokenizer = AutoTokenizer.from_pretrained(base_dir)
        # The round's own randomness (round 0's LoRA init, dropout when lora_dropout > 0) comes from torch's
        # global RNG, seeded here; seeding and construction hold the model lock, so no other thread's load
        # runs in between. Nothing else in the process draws from it meanwhile: rollouts sample from
        # generators of their own (stages/rollout/engines/hf.py), loads and eval draw nothing
        # (stages/runtime/policy.py).
        with MODEL_LOADING:
            torch.manual_seed(cfg.seed * 100_003 + round_index)
            self.model, self.ref_model = _load_trainable(cfg, base_dir, prev_adapter_dir, devices)
        self.model.train()
        self.rank, self.world_size = (group.rank, group.world_size) if group is not None else (0, 1)
        self.sharded = group is not None and group.strategy == "fsdp"
        if self.sharded:
            from stages.runtime.distributed import shard_model

            shard_model(self.model, group)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(cfg, self.params)
        self.optimizer_state = _load_optimizer_state(cfg, self.optimizer, prev_adapter_dir, self.sharded)
        self.scaler = placement.grad_scaler(devices)  # fp16 only
        # the shared prompt pass needs the KV cache, which gradient checkpointing turns off; compiled blocks
        # would be compiled per block and per pass with it, and share one graph without (devices.compiled)
        self.plain_forward = (self.sharded or not cfg.shared_prompt_pass
                              or (devices is not None and (devices.gradient_checkpointing or devices.compile)))
        self.chunk_tokens = self._logps_chunk_tokens()

    def _logps_chunk_tokens(self) -> int:
        """grpo.logps_chunk_tokens, checked: an error naming it for a model whose logits are not its lm_head
        of its decoder's hidden states (`logprobs.logits_from_hidden`) or a sharded one (flows/config.py refuses it with
        fsdp before a run starts)."""
        wanted = self.cfg.logps_chunk_tokens
        if not wanted:
            return 0
        if self.sharded:
            raise ValueError("grpo.logps_chunk_tokens is not built with train.strategy: fsdp; set it to 0")
        with self.placement.autocast(self.devices):  # as every forward of the trained model runs
            plain_head = logprobs.logits_from_hidden(self.model)
        if not plain_head:
            raise ValueError(f"grpo.logps_chunk_tokens: {type(self.model).__name__}'s logits are more than its "
                             "lm_head applied to its decoder's hidden states (logit soft-capping or scaling), "
                             "which the chunks compute; set grpo.logps_chunk_tokens: 0 for this model")
        return wanted

    def forward_logps(self, module, batch: dict):
        """(log-probs, entropies) of a collated batch, under autocast: one plain forward when sharded (module
        docstring), with gradient checkpointing or compile, or when grpo.shared_prompt_pass is off; the head's
        log-probs a chunk of rows at a time where `chunk_tokens` says so."""
        with self.placement.autocast(self.devices):
            if self.plain_forward:
                return logprobs.completion_logps(module, *logprobs.plain_inputs(batch), self.temperature,
                                                 self.chunk_tokens)
            return logprobs.batch_logps(module, batch, self.temperature, self.chunk_tokens)

    def collated(self, micro_batch: list[dict], masked_out: set[str], old: dict | None = None) -> dict:
        """The micro-batch's tensors on the models' device, with its loss mask's per-row `keep` and, given
        `old` (rollout id -> log-probs), pi_old's log-probs `old_logps`: built on the host, copied once."""
        batch = collate(micro_batch, self.tokenizer.pad_token_id)
        batch["keep"] = torch.tensor([r["rollout_id"] not in masked_out for r in micro_batch], dtype=torch.float32)
        if "scope_weight" in micro_batch[0]:  # SCOPE-RL's round: the rows' weights and which are auxiliary
            batch["scope_weight"] = torch.tensor([r["scope_weight"] for r in micro_batch], dtype=torch.float32)
            batch["scope_aux"] = torch.tensor([r[scope_rl.AUX_COLUMN] for r in micro_batch], dtype=torch.float32)
        if old is not None:
            batch["old_logps"] = pad([old[r["rollout_id"]] for r in micro_batch], 0.0, "right", torch.float32)
        return self.placement.to_device(batch, self.devices)

    def rank_share(self, micro_batches: list[list[dict]]) -> tuple[list[list[dict]], int]:
        """(this rank's micro-batches of a step, how many passes it runs): with fsdp every rank runs as many
        as the rank with the most; the passes past its own micro-batches are fillers."""
        mine = micro_batches[self.rank::self.world_size]
        return mine, (-(-len(micro_batches) // self.world_size) if self.sharded else len(mine))

    def pi_old(self, plan: RoundPlan) -> tuple[dict[str, list[float]], int]:
        """(pi_old's log-probs of the rows this rank trains, by rollout id; how many came with their rows, summed
        over ranks): the rows the transformers engine sampled from this very policy bring them
        (reuse_sampling_logps), the others get a no-grad forward. Nothing when pi_old is the step's own."""
        old_logps: dict[str, list[float]] = {}
        reused = 0
        with torch.no_grad():
            for run in plan.runs if not plan.pi_old_is_step else []:
                mine, passes = self.rank_share(run)
                for slot in range(passes):
                    chunk = []
                    for row in mine[slot] if slot < len(mine) else []:
                        if self._sampled_by_round_start(row):
                            old_logps[row["rollout_id"]] = list(row["sampling_logprobs"])
                            reused += 1
                        else:
                            chunk.append(row)
                    if not chunk:
                        if self.sharded:  # the filler forward the other ranks' passes need
                            self.forward_logps(self.model, self.collated(run[0][:1], plan.masked_out))
                        continue
                    logps, _ = self.forward_logps(self.model, self.collated(chunk, plan.masked_out))
                    for row, lp in zip(chunk, logps.cpu()):  # one read back per pass
                        old_logps[row["rollout_id"]] = lp[: len(row["completion_token_ids"])].tolist()
        if self.group is not None:
            reused = int(self.group.all_reduce([reused])[0])
        return old_logps, reused

    def _sampled_by_round_start(self, row: dict) -> bool:
        """The row's sampling log-probs are pi_old's own (grpo.reuse_sampling_logps)."""
        return (self.cfg.reuse_sampling_logps and row.get("engine") == "transformers" and not row.get("replayed")
                and row.get("policy_version") == self.round_index and not row.get(scope_rl.AUX_COLUMN))

    def reference_logps(self, batch: dict):
        """The reference policy's log-probs, or None when nothing weighs the KL (beta 0, as TRL) or there is
        no reference (full fine-tuning without one)."""
        cfg = self.cfg
        with torch.no_grad():
            if cfg.beta == 0.0:
                return None
            if self.ref_model is not None:
                return self.forward_logps(self.ref_model, batch)[0]
            if cfg.adapter == "lora":
                with self.model.disable_adapter():
                    return self.forward_logps(self.model, batch)[0]
            return None

    def accumulate(self, plan: RoundPlan, micro_batches: list[list[dict]], live: list[list[dict]],
                   old_logps: dict, num_items: float, max_completion_length: int, ce_coef: float,
                   rl_coef: float = 1.0) -> dict:
        """Forward and backward of one optimizer step's micro-batches on this rank (gradients accumulate in
        the parameters); return the step's statistics, summed over ranks. Per micro-batch: log-probs of the policy
        (and the reference), pi_old, the loss's inputs with their corrections (`loss_inputs`), `grpo_loss`. The loss
        is rl_coef times GRPO's plus ce_coef times the reference cross-entropy (rl: ebft's weights; GRPO: 1 and 0)."""
        settings = loss_config(self.cfg, max_completion_length)
        sums, sequences = StepSums(), 0
        mine, passes = self.rank_share(live)
        for slot in range(passes):
            if slot >= len(mine):
                self._filler_pass(live[0][:1], plan.masked_out)
                continue
            rows = mine[slot]
            batch = self.collated(rows, plan.masked_out, None if plan.pi_old_is_step else old_logps)
            logps, entropy = self.forward_logps(self.model, batch)
            ref_logps = self.reference_logps(batch)
            old = logps.detach() if plan.pi_old_is_step else batch["old_logps"]
            inputs = loss_inputs(self.cfg, batch, logps, old, ref_logps, num_items, len(micro_batches))
            out = grpo_loss(inputs, settings)
            loss = out.loss if rl_coef == 1.0 else rl_coef * out.loss
            if ce_coef:  # rl: ebft's term, divided like the loss by the step's micro-batches
                with self.placement.autocast(self.devices):
                    ce = reference_cross_entropy(self.model, rows, self.tokenizer.pad_token_id)
                sums.add("ce_loss", ce.detach() / len(micro_batches))
                loss = loss + ce_coef * ce / len(micro_batches)
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            sums.add_micro_batch(loss, out.metrics, entropy, inputs.mask)
            sequences += len(rows)
        return self._step_stats(sums, sequences, bool(ce_coef))

    def _filler_pass(self, rows: list[dict], masked_out: set[str]) -> None:
        """fsdp, a rank short of a step's micro-batches: the forward passes (policy, reference) and a backward of
        0 on one row, so that it joins every weight gather and gradient reduce-scatter, adding nothing."""
        batch = self.collated(rows, masked_out)
        logps, _ = self.forward_logps(self.model, batch)
        self.reference_logps(batch)
        (logps.sum() * 0.0).backward()

    def _step_stats(self, sums: StepSums, sequences: int, tracks_ce: bool) -> dict:
        """The step's statistics as floats (one read back), summed over ranks; the gradients summed over ranks."""
        step_stats = {"loss": 0.0, "kl": 0.0, "clip_ratio": 0.0, "mean_ratio": 0.0, "entropy": 0.0, "tokens": 0.0,
                      "sequences": float(sequences), **sums.read_back()}
        if self.group is not None:
            if not self.sharded:  # FSDP summed them in each backward (reduce-scatter)
                self.group.sum_gradients(self.params)
            step_stats = _sum_step_stats(self.group, step_stats, self.cfg.vllm_importance_sampling_correction,
                                         tracks_ce)
        return step_stats

    def step(self, learning_rate: float, position: int) -> float:
        """Clip the accumulated gradient, take the optimizer step at `learning_rate`; return the gradient norm
        (a non-finite one ends the round, naming the step, unless fp16's scaler skips the step)."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        if self.sharded:
            from stages.runtime.distributed import whole

            grad_norm = whole(grad_norm)
        if not torch.isfinite(grad_norm) and not self.scaler:  # fp16: the scaler skips the step, lowers its scale
            raise FloatingPointError(f"round {self.round_index} step {position}: gradient norm is {grad_norm}")
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = learning_rate
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def save(self, out_dir: Path) -> None:
        """The policy (adapter, or with adapter: none a whole model folder) and the optimizer state, written by
        rank 0; under fsdp gathered whole first (every rank takes part), so the files are one process's."""
        weights = optimizer_file = None
        if self.sharded:
            from stages.runtime.distributed import full_optimizer_state, full_state_dict

            weights, optimizer_file = full_state_dict(self.model), full_optimizer_state(self.optimizer)
        if self.rank == 0:  # every replica holds the same weights and optimizer state
            self.model.save_pretrained(out_dir, **({"state_dict": weights} if self.sharded else {}))
            if self.cfg.adapter == "none":
                self.tokenizer.save_pretrained(out_dir)  # a complete model folder: engines and export load it as is
            torch.save({"optim": self.cfg.optim, "state_dict": optimizer_file or self.optimizer.state_dict()},
                       out_dir / "optimizer.pt")
        if self.group is not None:
            self.group.barrier()  # the folder is complete before any rank returns

    def trainable_params(self) -> int:
        """Trainable weights this rank holds: all of them, or its 1/world_size shard under fsdp."""
        return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in self.params)


def run(
    cfg: GRPOConfig,
    base_dir: Path,
    prev_adapter_dir: Path | None,
    scored_path: Path,
    round_index: int,
    temperature: float,
    max_completion_length: int,
    out_dir: Path,
    on_step: Callable[[int, int], None] | None = None,
    on_metrics: Callable[[dict, int], None] | None = None,
    group=None,
    ce_coef: float = 0.0,
    devices=None,
    rl_coef: float = 1.0,
) -> dict:
    """Train on one round of scored rollouts; save the policy (LoRA adapter, or with `adapter: none`
    the whole model) and the optimizer state to out_dir. `prev_adapter_dir` is the previous
    round's output folder (None in round 0). `on_step(done, total)` reports progress over the round's
    optimizer steps (all passes, skipped ones included); `on_metrics(metrics, step)` receives each taken
    step's loss, kl, clip_ratio, entropy, grad_norm, learning_rate, ... with its position in the run's
    schedule (round_index * steps per round + step in the round).

    `group` (a stages.runtime.distributed.Group, when launched on several ranks by stages.runtime.distributed.launch):
    every rank makes the same plan (shuffle, steps, skips, dapo's token count) from the same rows, runs
    micro-batches rank, rank + world_size, ... of each step, and the gradients and step statistics are
    summed across ranks before the optimizer step, so each replica takes the one-process step (up to the
    order of float additions). Rank 0 alone saves. None: this process alone. `ce_coef` (rl: ebft): add that
    times each micro-batch's `reference_cross_entropy`, divided like the loss by the step's micro-batches;
    `rl_coef` (rl: ebft): the weight of the policy-gradient loss itself (1: GRPO's loss as it is).
    `devices` (stages/runtime/devices.py; None: auto): where the models run and in which precision -- fp32 weights
    and optimizer state, forward and backward under autocast in bf16/fp16 (fp16 with a gradient scaler)."""
    import pyarrow.parquet as pq

    trainer = RoundTrainer(cfg, base_dir, prev_adapter_dir, round_index, temperature, devices, group)
    plan = plan_round(cfg, pq.read_table(scored_path).to_pylist(), round_index)
    old_logps, reused = trainer.pi_old(plan)
    if cfg.replay_recompute_logps:  # the stale sample counts as drawn from pi_old (docstring of the option)
        for row in plan.replayed:
            if row["rollout_id"] in old_logps:
                row["sampling_logprobs"] = old_logps[row["rollout_id"]]
    lr_at = _lr_schedule(cfg, round_index, plan.steps_per_round)

    history = []
    counts = {"skipped_batches": 0, "skipped_steps": 0, "trained_rows": 0, "tokens_trained": 0}
    for iteration in range(cfg.num_iterations):
        for step_index, (micro_batches, live) in enumerate(zip(plan.steps, plan.runs)):
            position = iteration * len(plan.steps) + step_index
            counts["skipped_batches"] += sum(not _trains(cfg, mb, plan.masked_out) for mb in micro_batches)
            counts["trained_rows"] += sum(len(mb) for mb in live)
            counts["tokens_trained"] += sum(len(r["prompt_token_ids"]) + len(r["completion_token_ids"])
                                            for mb in live for r in mb)
            if live:  # else no signal in the whole step: no optimizer step, no state change
                history.append(_take_step(trainer, plan, step_index, position, old_logps, lr_at(position),
                                          max_completion_length, ce_coef, rl_coef))
                if on_metrics:
                    on_metrics(history[-1], round_index * plan.steps_per_round + position)
            else:
                counts["skipped_steps"] += 1
            if on_step:
                on_step(position + 1, plan.steps_per_round)
    trainer.save(out_dir)
    return _round_metrics(cfg, trainer, plan, history, counts, lr_at(plan.steps_per_round - 1), reused)


def _lr_schedule(cfg: GRPOConfig, round_index: int, steps_per_round: int) -> Callable[[int], float]:
    """The learning rate at a step's position in this round (over all its passes): the schedule runs over the
    whole run's steps, this round's coming after round_index rounds of steps_per_round steps."""
    total_steps = cfg.lr_schedule_rounds * steps_per_round if cfg.lr_schedule_rounds is not None else None
    warmup_steps = cfg.warmup_steps or (math.ceil(cfg.warmup_ratio * total_steps) if cfg.warmup_ratio else 0)

    def lr_at(position: int) -> float:
        return scheduled_lr(round_index * steps_per_round + position, cfg.learning_rate, cfg.lr_scheduler_type,
                            warmup_steps, total_steps)

    return lr_at


def _take_step(trainer: RoundTrainer, plan: RoundPlan, step_index: int, position: int, old_logps: dict,
               learning_rate: float, max_completion_length: int, ce_coef: float, rl_coef: float) -> dict:
    """Forward and backward of the round's optimizer step `step_index` (at `position` over all passes), then the
    optimizer step at `learning_rate`; return the step's metrics."""
    step_stats = trainer.accumulate(plan, plan.steps[step_index], plan.runs[step_index], old_logps,
                                    dapo_normalizer(plan.steps, step_index, plan.masked_out),
                                    max_completion_length, ce_coef, rl_coef)
    grad_norm = trainer.step(learning_rate, position)
    return {**_step_metrics(step_stats, grad_norm), "learning_rate": learning_rate}


def _round_metrics(cfg: GRPOConfig, trainer: RoundTrainer, plan: RoundPlan, history: list[dict], counts: dict,
                   learning_rate: float, reused: int) -> dict:
    """`run`'s summary: the means of the taken steps' metrics (is_ratio_max: their max), what was skipped and
    trained, the learning rate at the round's last step and how the round ran."""
    lengths = [len(r["completion_token_ids"]) for r in plan.rows]
    metrics = {}
    if history:  # means over the steps taken
        metrics = {k: sum(h[k] for h in history) / len(history) for k in history[0]
                   if k not in ("is_ratio_max", "learning_rate")}
        if "is_ratio_max" in history[0]:
            metrics["is_ratio_max"] = max(h["is_ratio_max"] for h in history)
    metrics.update(completion_length=sum(lengths) / len(lengths), optimizer_steps=len(history),
                   skipped_steps=counts["skipped_steps"], skipped_batches=counts["skipped_batches"],
                   learning_rate=learning_rate,  # at the round's last step
                   optimizer_state=trainer.optimizer_state, reused_sampling_logps=reused,
                   pi_old_from_step=int(plan.pi_old_is_step),  # 1: pi_old was the round's one step's own forward
                   trainable_params_per_rank=trainer.trainable_params(),
                   trained_rows=counts["trained_rows"] / cfg.num_iterations,  # rows through forward/backward per pass
                   tokens_trained=counts["tokens_trained"],  # their prompt + completion tokens, every pass counted
                   **trainer.placement.describe(trainer.devices))
    if plan.replayed:
        metrics["replayed_rows"] = len(plan.replayed)
    if cfg.mask_truncated_completions:
        metrics["truncated_masked"] = len(plan.masked_out)  # completions left out of the loss
    return metrics


def reference_cross_entropy(model, rows: list[dict], pad_token_id: int) -> torch.Tensor:
    """rl: ebft's `ce_coef` term (stages/training/ebft.py; axolotl's ce_loss on ground-truth tokens): the mean token NLL
    -log pi(reference | prompt) of the references (`reference_token_ids`) of the rows' distinct prompts."""
    seen, sequences, starts = set(), [], []
    for r in rows:
        if r["prompt_id"] in seen or not r.get("reference_token_ids"):
            continue
        seen.add(r["prompt_id"])
        sequences.append(list(r["prompt_token_ids"]) + list(r["reference_token_ids"]))
        starts.append(len(r["prompt_token_ids"]))
    device = next(model.parameters()).device
    if not sequences:
        return torch.zeros((), device=device)
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [pad_token_id] * (width - len(s)) for s in sequences], device=device)
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=device)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    targets = ids[:, 1:]
    positions = torch.arange(1, width, device=device).unsqueeze(0)
    mask = (positions >= torch.tensor(starts, device=device).unsqueeze(1)) & attention[:, 1:].bool()
    nll = -torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (nll * mask).sum() / mask.sum().clamp(min=1)


class StepSums:
    """A step's statistics summed over its micro-batches as float64 tensors on the device (is_max: their max),
    read back once after the step (one host sync per step, not per micro-batch)."""

    def __init__(self):
        self.values: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor) -> None:
        self.values[key] = self.values[key] + value.double() if key in self.values else value.double()

    def add_micro_batch(self, loss: torch.Tensor, metrics: dict, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        """A micro-batch's loss and `grpo_loss` metrics, its token means turned into sums over its tokens."""
        self.add("loss", loss.detach())
        for key in ("kl", "clip_ratio", "mean_ratio"):
            self.add(key, metrics[key].double() * metrics["tokens"].double())
        self.add("entropy", (entropy * mask).sum())
        self.add("tokens", metrics["tokens"])
        self.add("dropped", metrics["dropped"])
        if "is_sum" in metrics:
            self.add("is_sum", metrics["is_sum"])
            top = metrics["is_max"]
            self.values["is_max"] = (torch.maximum(self.values["is_max"], top) if "is_max" in self.values
                                     else top.clamp(min=0.0))

    def read_back(self) -> dict[str, float]:
        """The sums as Python floats, in one transfer."""
        if not self.values:
            return {}
        return dict(zip(self.values, torch.stack(list(self.values.values())).tolist()))


_SUMMED_STATS = ("loss", "kl", "clip_ratio", "mean_ratio", "entropy", "tokens", "sequences", "dropped", "is_sum")


def _sum_step_stats(group, step_stats: dict, tracks_is: bool, tracks_ce: bool = False) -> dict:
    """A step's statistics over all ranks: sums (is_max: max); a rank that ran no micro-batch of the step
    contributes zeros. The keys are those one process has after a taken step."""
    summed = _SUMMED_STATS + (("ce_loss",) if tracks_ce else ())
    sums = group.all_reduce([step_stats.get(k, 0.0) for k in summed])
    total = dict(zip(summed, sums))
    if tracks_is:
        total["is_max"] = group.all_reduce([step_stats.get("is_max", 0.0)], op="max")[0]
    else:
        del total["is_sum"]
    return total


def _step_metrics(step_stats: dict, grad_norm: float) -> dict:
    tokens = max(step_stats["tokens"], 1.0)
    out = {"loss": step_stats["loss"], "kl": step_stats["kl"] / tokens, "clip_ratio": step_stats["clip_ratio"] / tokens,
           "mean_ratio": step_stats["mean_ratio"] / tokens, "entropy": step_stats["entropy"] / tokens,
           "grad_norm": grad_norm}
    if "is_sum" in step_stats:
        out.update(is_ratio_mean=step_stats["is_sum"] / tokens, is_ratio_max=step_stats["is_max"])
    # sequences whose loss is zeroed by the correction's mask mode or by off-policy masking
    out["off_policy_masked_frac"] = step_stats.get("dropped", 0.0) / max(step_stats["sequences"], 1.0)
    if "ce_loss" in step_stats:  # rl: ebft with ce_coef (this rank's micro-batches)
        out["ce_loss"] = step_stats["ce_loss"]
    return out
