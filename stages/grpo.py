"""optimize (GRPO): one round of policy-gradient updates on scored rollouts.

Loss (TRL 1.16 GRPOTrainer._compute_loss, DeepSeekMath GRPO with PPO clipping):
  ratio_t   = exp(logp_t - old_logp_t)      old = the recorded sampling log-probs
  loss_t    = -min(ratio_t * A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) * A)
            + beta * KL_t,  KL_t = ratio_t * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)
              (k3 estimator, importance-corrected: TRL's use_bias_correction_kl)
aggregated per `loss_type`: grpo (per-sequence mean, then batch mean), bnpo (token mean
over the micro-batch), dr_grpo (sum / (batch * max_completion_length)), dapo (sum /
completion tokens of the whole optimizer step). The reference policy is the base
model with the LoRA adapter disabled (PEFT's `disable_adapter`).

Departures from TRL: the old policy is always the sampler's recorded log-probs (TRL uses
the trainer's own log-probs unless it samples with vLLM), so rollouts from any engine
are treated alike; optimizer state is carried between rounds in the adapter folder.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


class GRPOConfig(BaseModel):
    """GRPO optimization (names as in TRL's GRPOConfig and axolotl)."""

    model_config = ConfigDict(extra="forbid")

    rounds: int = Field(12, ge=1)
    """rollout -> score -> optimize cycles."""
    learning_rate: float = Field(2e-4, gt=0)
    """AdamW learning rate for the LoRA weights (constant)."""
    beta: float = Field(0.0, ge=0)
    """KL coefficient against the reference (base, adapter disabled). TRL's default is 0.0."""
    epsilon: float = Field(0.2, gt=0)
    """Lower clip range of the ratio (PPO epsilon)."""
    epsilon_high: float | None = None
    """Upper clip range (DAPO's clip-higher); unset: equal to epsilon."""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = "dapo"
    """Loss aggregation; TRL's default is dapo (token-level, no length bias)."""
    micro_batch_size: int = Field(64, ge=1)
    """Completions per forward/backward pass."""
    gradient_accumulation_steps: int = Field(2, ge=1)
    """Micro-batches per optimizer step; a round has rows / (micro_batch_size * this) steps."""
    max_grad_norm: float = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    use_bias_correction_kl: bool = True
    """Multiply the k3 KL term by the importance ratio (TRL's default, DeepSeek-V3.2)."""
    seed: int = 0


# ---------------------------------------------------------------- the math, pure functions


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[index] along the last dim."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def completion_logps(model, input_ids, attention_mask, logits_to_keep: int, temperature: float):
    """Per-token log-probs (and entropies) of the last `logits_to_keep` tokens under logits / temperature."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = logits[:, -logits_to_keep - 1 : -1, :] / temperature
    logps = selective_log_softmax(logits, input_ids[:, -logits_to_keep:])
    with torch.no_grad():
        log_p = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
    return logps, entropy


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon: float,
    epsilon_high: float,
    beta: float,
    max_completion_length: int,
    num_items_in_batch: float,
    gradient_accumulation_steps: int,
    use_bias_correction_kl: bool = True,
) -> tuple[torch.Tensor, dict]:
    """The loss of one micro-batch, scaled for accumulation exactly as TRL scales it.

    Shapes: logps, old_logps, ref_logps, mask (B, T); advantages (B,).
    `num_items_in_batch`: completion tokens in the whole optimizer step (dapo's normalizer).

    >>> t = torch.zeros(1, 2); m = torch.ones(1, 2)
    >>> loss, _ = grpo_loss(t, t, None, torch.tensor([1.0]), m, loss_type="grpo", epsilon=0.2, epsilon_high=0.2,
    ...                     beta=0.0, max_completion_length=2, num_items_in_batch=2, gradient_accumulation_steps=1)
    >>> loss.item()  # ratio 1, advantage 1: loss -1
    -1.0
    """
    mask = mask.to(logps.dtype)
    advantages = advantages.unsqueeze(1)
    coef_1 = torch.exp(logps - old_logps)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token_kl = None
    if ref_logps is not None:
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1  # not detached, as in TRL
        if beta != 0.0:
            per_token_loss = per_token_loss + beta * per_token_kl

    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / gradient_accumulation_steps
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / gradient_accumulation_steps
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
        loss = loss / gradient_accumulation_steps
    elif loss_type == "dapo":
        loss = (per_token_loss * mask).sum() / max(float(num_items_in_batch), 1.0)
    else:
        raise ValueError(f"grpo.loss_type: unknown {loss_type!r}; use one of {LOSS_TYPES}")

    with torch.no_grad():
        tokens = mask.sum().clamp(min=1.0)
        clipped = ((coef_1 < 1 - epsilon) & (advantages < 0)) | ((coef_1 > 1 + epsilon_high) & (advantages > 0))
        stats = {
            "clip_ratio": float((clipped.to(mask.dtype) * mask).sum() / tokens),
            "kl": float((per_token_kl * mask).sum() / tokens) if per_token_kl is not None else 0.0,
            "tokens": float(mask.sum()),
        }
    return loss, stats


def pad(rows: list[list], value, side: str, dtype) -> torch.Tensor:
    """Stack ragged lists into a (B, max_len) tensor padded on `side`."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            if side == "left":
                out[i, width - len(r) :] = torch.tensor(r, dtype=dtype)
            else:
                out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def collate(rows: list[dict], pad_token_id: int) -> dict:
    """TRL's layout: prompts left-padded, completions right-padded, masks alongside."""
    prompts = [r["prompt_token_ids"] for r in rows]
    completions = [r["completion_token_ids"] for r in rows]
    return {
        "prompt_ids": pad(prompts, pad_token_id, "left", torch.long),
        "prompt_mask": pad([[1] * len(p) for p in prompts], 0, "left", torch.long),
        "completion_ids": pad(completions, pad_token_id, "right", torch.long),
        "completion_mask": pad([[1] * len(c) for c in completions], 0, "right", torch.long),
        "old_per_token_logps": pad([r["sampling_logprobs"] for r in rows], 0.0, "right", torch.float32),
        "advantages": torch.tensor([r["advantage"] for r in rows], dtype=torch.float32),
    }


# ---------------------------------------------------------------- one round


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
) -> dict:
    """Train the LoRA adapter on one round of scored rollouts; save it (and optimizer state) to out_dir."""
    import pyarrow.parquet as pq
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(cfg.seed * 100_003 + round_index)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    if prev_adapter_dir is not None:
        model = PeftModel.from_pretrained(base, prev_adapter_dir, is_trainable=True)
    else:
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM")
        model = get_peft_model(base, lora)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    if prev_adapter_dir is not None and (prev_adapter_dir / "optimizer.pt").exists():
        optimizer.load_state_dict(torch.load(prev_adapter_dir / "optimizer.pt", weights_only=True))

    rows = pq.read_table(scored_path).to_pylist()
    random.Random(cfg.seed * 100_003 + round_index).shuffle(rows)
    step_size = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    steps = [rows[i : i + step_size] for i in range(0, len(rows), step_size)]
    epsilon_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon

    history = []
    for step_index, step_rows in enumerate(steps):
        micro_batches = [step_rows[i : i + cfg.micro_batch_size] for i in range(0, len(step_rows), cfg.micro_batch_size)]
        num_items = sum(len(r["completion_token_ids"]) for r in step_rows)
        step_stats = {"loss": 0.0, "kl": 0.0, "clip_ratio": 0.0, "entropy": 0.0, "tokens": 0.0}
        for rows_mb in micro_batches:
            batch = collate(rows_mb, tokenizer.pad_token_id)
            input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            keep = batch["completion_ids"].size(1)
            logps, entropy = completion_logps(model, input_ids, attention_mask, keep, temperature)
            with torch.no_grad(), model.disable_adapter():
                ref_logps, _ = completion_logps(model, input_ids, attention_mask, keep, temperature)
            loss, stats = grpo_loss(
                logps, batch["old_per_token_logps"], ref_logps, batch["advantages"], batch["completion_mask"],
                loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=epsilon_high, beta=cfg.beta,
                max_completion_length=max_completion_length, num_items_in_batch=num_items,
                gradient_accumulation_steps=len(micro_batches), use_bias_correction_kl=cfg.use_bias_correction_kl,
            )
            loss.backward()
            mask = batch["completion_mask"].float()
            step_stats["loss"] += float(loss.detach())
            for key in ("kl", "clip_ratio"):
                step_stats[key] += stats[key] * stats["tokens"]
            step_stats["entropy"] += float((entropy * mask).sum())
            step_stats["tokens"] += stats["tokens"]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(f"round {round_index} step {step_index}: gradient norm is {grad_norm}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens = max(step_stats.pop("tokens"), 1.0)
        history.append({"loss": step_stats["loss"], "kl": step_stats["kl"] / tokens,
                        "clip_ratio": step_stats["clip_ratio"] / tokens, "entropy": step_stats["entropy"] / tokens,
                        "grad_norm": float(grad_norm)})
        if on_step:
            on_step(step_index + 1, len(steps))

    model.save_pretrained(out_dir)
    torch.save(optimizer.state_dict(), out_dir / "optimizer.pt")
    lengths = [len(r["completion_token_ids"]) for r in rows]
    metrics = {k: sum(h[k] for h in history) / len(history) for k in history[0]}
    metrics.update(completion_length=sum(lengths) / len(lengths), optimizer_steps=len(steps))
    return metrics
