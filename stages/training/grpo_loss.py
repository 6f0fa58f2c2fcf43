"""GRPO's loss and its off-policy corrections: pure functions over tensors, as TRL 1.16 computes them.

`grpo_loss` mirrors `GRPOTrainer._compute_loss` (ratio, clip, KL, aggregation per loss_type); the stage's
docstring (stages/training/grpo.py) gives the formulas. `sampling_correction` (TRL's vllm importance sampling)
and `off_policy_mask` (TRL's get_off_policy_mask) weigh rows sampled by another policy than pi_old.
Tested on hand-written tensors and against TRL on the same batch (tests/test_grpo_loss.py).
"""

from __future__ import annotations

from stages.runtime.imports import LazyModule

torch = LazyModule("torch")  # imported on first use

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


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
    importance_sampling_level: str = "token",
    is_weights: torch.Tensor | None = None,
    off_policy_keep: torch.Tensor | None = None,
    stats_as_tensors: bool = False,
) -> tuple[torch.Tensor, dict]:
    """The loss of one micro-batch, scaled for accumulation exactly as TRL scales it. One function on purpose: it
    mirrors TRL's GRPOTrainer._compute_loss as one piece (ratio, clip, masks, KL, aggregation per loss_type, clip
    statistics), so the two read side by side; its body is 50 lines, the rest is signature and docstring.

    Shapes: logps, old_logps, ref_logps, mask (B, T); advantages (B,).
    `num_items_in_batch`: completion tokens in the whole optimizer step (dapo's normalizer).
    `is_weights`: sampling correction, (B, T) or (B, 1), from `sampling_correction`.
    `off_policy_keep`: (B, 1) 1 = keep, 0 = drop, from `off_policy_mask`.

    >>> t = torch.zeros(1, 2); m = torch.ones(1, 2)
    >>> loss, _ = grpo_loss(t, t, None, torch.tensor([1.0]), m, loss_type="grpo", epsilon=0.2, epsilon_high=0.2,
    ...                     beta=0.0, max_completion_length=2, num_items_in_batch=2, gradient_accumulation_steps=1)
    >>> loss.item()  # ratio 1, advantage 1: loss -1
    -1.0
    """
    mask = mask.to(logps.dtype)
    advantages = advantages.unsqueeze(1)
    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif importance_sampling_level != "token":
        raise ValueError(f"grpo.importance_sampling_level: unknown {importance_sampling_level!r}; "
                         "use token or sequence")
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if off_policy_keep is not None:
        per_token_loss = per_token_loss * off_policy_keep
    if is_weights is not None:
        per_token_loss = per_token_loss * is_weights
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
        clipped = clipped.expand_as(mask)
        stats = {
            "clip_ratio": (clipped.to(mask.dtype) * mask).sum() / tokens,
            # pi / pi_old over the completion tokens (axolotl's guide: mean_ratio, healthy near 1)
            "mean_ratio": (coef_1.expand_as(mask) * mask).sum() / tokens,
            "kl": ((per_token_kl * mask).sum() / tokens if per_token_kl is not None
                   else torch.zeros((), device=mask.device)),
            "tokens": mask.sum(),
        }
    if stats_as_tensors:  # 0-dim tensors on the loss's device: read them once per step (one host sync)
        return loss, stats
    return loss, {k: float(v) for k, v in stats.items()}


def sampling_correction(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                        cap: float) -> torch.Tensor:
    """pi_old / pi_sampling per token (B, T) or per sequence (B, 1), truncated at or masked above `cap`.

    >>> old = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.9]])); m = torch.ones(2, 2)
    >>> sampling = torch.log(torch.tensor([[0.5, 0.1], [0.9, 0.9]]))
    >>> sampling_correction(old, sampling, m, "token_truncate", 3.0).tolist()
    [[1.0, 3.0], [1.0, 1.0]]
    >>> sampling_correction(old, sampling, m, "sequence_mask", 3.0).flatten().tolist()
    [0.0, 1.0]
    """
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    if mode.endswith("mask"):
        return ratio.masked_fill(ratio > cap, 0.0)
    raise ValueError(f"grpo.vllm_importance_sampling_mode: unknown {mode!r}")


def off_policy_mask(advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B, 1): 0 for sequences with negative advantage whose mean per-token log(pi_sampling / pi_theta)
    exceeds `threshold`, else 1 (TRL's get_off_policy_mask)."""
    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages.unsqueeze(-1) >= 0) | (mean_kl <= threshold)).to(mask.dtype)
