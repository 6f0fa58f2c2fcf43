"""GRPO's loss and its off-policy corrections: pure functions over tensors, as TRL 1.16 computes them.

`grpo_loss(LossInputs, LossConfig) -> LossOutputs(loss, metrics)` (prime-rl's loss shape) is TRL's
`GRPOTrainer._compute_loss` in named steps: `log_ratio` (per token, or GSPO's per sequence), `clipped_loss` (PPO
clip with DAPO's clip-higher), the off-policy weights, `k3_kl` (with TRL's use_bias_correction_kl), `aggregate`
per loss_type. The training step forms the weights before the loss: `sampling_correction` (TRL's vllm importance
sampling, truncated or masked at a cap) and `off_policy_mask` (TRL's get_off_policy_mask). The stage's docstring
(stages/training/grpo.py) gives the formulas. Tested on hand-written tensors and against TRL on the same batch
(tests/test_grpo_loss.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.runtime.imports import LazyModule

torch = LazyModule("torch")  # imported on first use

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")


@dataclass(frozen=True)
class LossConfig:
    """The loss's settings, named as grpo.* (epsilon_high resolved); `max_completion_length`: dr_grpo's divisor."""

    loss_type: str
    epsilon: float
    epsilon_high: float
    beta: float
    max_completion_length: int
    use_bias_correction_kl: bool = True
    importance_sampling_level: str = "token"


@dataclass
class LossInputs:
    """One micro-batch. Shapes: logps, old_logps, ref_logps, mask (B, T); advantages (B,)."""

    logps: torch.Tensor  # pi_theta, with gradient
    old_logps: torch.Tensor  # pi_old: the policy at the start of the round
    advantages: torch.Tensor
    mask: torch.Tensor  # 1: a completion token the loss counts
    num_items_in_batch: float  # completion tokens of the whole optimizer step (dapo's divisor)
    gradient_accumulation_steps: int  # micro-batches of the step (grpo, bnpo and dr_grpo divide by it)
    ref_logps: torch.Tensor | None = None  # the reference policy's; None: no KL
    is_weights: torch.Tensor | None = None  # (B, T) or (B, 1), from `sampling_correction`
    off_policy_keep: torch.Tensor | None = None  # (B, 1) 1 = keep, 0 = drop, from `off_policy_mask`
    row_weights: torch.Tensor | None = None  # (B,) the policy term's weight per row (SCOPE-RL: scope_rl.row_weights)
    kl_weights: torch.Tensor | None = None  # (B,) the KL term's weight per row (SCOPE-RL: 0 on its auxiliary rows)


@dataclass
class LossOutputs:
    """The micro-batch's loss, scaled for accumulation as TRL scales it, and its metrics: 0-dim tensors on the
    loss's device (read them once per step): clip_ratio, mean_ratio, kl (token means), tokens, dropped (rows
    the corrections zero), and with is_weights is_sum (over the tokens) and is_max."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def grpo_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutputs:
    """TRL's GRPOTrainer._compute_loss, step by step, on one micro-batch.

    >>> t = torch.zeros(1, 2); m = torch.ones(1, 2)
    >>> out = grpo_loss(LossInputs(t, t, torch.tensor([1.0]), m, num_items_in_batch=2, gradient_accumulation_steps=1),
    ...                 LossConfig("grpo", epsilon=0.2, epsilon_high=0.2, beta=0.0, max_completion_length=2))
    >>> out.loss.item()  # ratio 1, advantage 1: loss -1
    -1.0
    """
    mask = inputs.mask.to(inputs.logps.dtype)
    advantages = inputs.advantages.unsqueeze(1)
    ratio = torch.exp(log_ratio(inputs.logps, inputs.old_logps, mask, cfg.importance_sampling_level))
    per_token_loss = clipped_loss(ratio, advantages, cfg.epsilon, cfg.epsilon_high)
    if inputs.off_policy_keep is not None:
        per_token_loss = per_token_loss * inputs.off_policy_keep
    if inputs.is_weights is not None:
        per_token_loss = per_token_loss * inputs.is_weights
    if inputs.row_weights is not None:
        per_token_loss = per_token_loss * inputs.row_weights.unsqueeze(1)
    kl = None
    if inputs.ref_logps is not None:
        kl = k3_kl(inputs.logps, inputs.ref_logps, ratio if cfg.use_bias_correction_kl else None)
        if cfg.beta != 0.0:
            weighted = kl if inputs.kl_weights is None else kl * inputs.kl_weights.unsqueeze(1)
            per_token_loss = per_token_loss + cfg.beta * weighted
    loss = aggregate(per_token_loss, mask, cfg.loss_type, cfg.max_completion_length, inputs.num_items_in_batch,
                     inputs.gradient_accumulation_steps)
    with torch.no_grad():
        metrics = {**loss_metrics(ratio, advantages, kl, mask, cfg.epsilon, cfg.epsilon_high),
                   **correction_metrics(inputs)}
    return LossOutputs(loss, metrics)


def log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log(pi_theta / pi_old): per token (B, T), or GSPO's length-normalized per sequence (B, 1)
    (TRL's importance_sampling_level)."""
    ratio = logps - old_logps
    if level == "sequence":
        return ((ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    if level != "token":
        raise ValueError(f"grpo.importance_sampling_level: unknown {level!r}; use token or sequence")
    return ratio


def clipped_loss(ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float) -> torch.Tensor:
    """PPO's clipped surrogate, negated: -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)."""
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    return -torch.min(ratio * advantages, clipped * advantages)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor, ratio: torch.Tensor | None) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token, times `ratio` when given (TRL's
    use_bias_correction_kl; the ratio is not detached, as in TRL)."""
    kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
    return kl * ratio if ratio is not None else kl


def aggregate(per_token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int,
              num_items_in_batch: float, gradient_accumulation_steps: int) -> torch.Tensor:
    """The micro-batch's loss per `loss_type`, scaled for accumulation: grpo (sequence means, then their mean),
    bnpo (token mean), dr_grpo (sum / (rows * max_completion_length)), each over the step's micro-batches;
    dapo (sum / the step's completion tokens)."""
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        return loss / gradient_accumulation_steps
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / gradient_accumulation_steps
    if loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
        return loss / gradient_accumulation_steps
    if loss_type == "dapo":
        return (per_token_loss * mask).sum() / max(float(num_items_in_batch), 1.0)
    raise ValueError(f"grpo.loss_type: unknown {loss_type!r}; use one of {LOSS_TYPES}")


def loss_metrics(ratio: torch.Tensor, advantages: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor,
                 epsilon: float, epsilon_high: float) -> dict[str, torch.Tensor]:
    """Token means over the mask: clip_ratio (tokens whose clip takes the gradient away), mean_ratio (pi / pi_old,
    axolotl's guide: healthy near 1), kl (0 without a reference); and the token count."""
    tokens = mask.sum().clamp(min=1.0)
    clipped = ((ratio < 1 - epsilon) & (advantages < 0)) | ((ratio > 1 + epsilon_high) & (advantages > 0))
    return {
        "clip_ratio": (clipped.expand_as(mask).to(mask.dtype) * mask).sum() / tokens,
        "mean_ratio": (ratio.expand_as(mask) * mask).sum() / tokens,
        "kl": (kl * mask).sum() / tokens if kl is not None else torch.zeros((), device=mask.device),
        "tokens": mask.sum(),
    }


def correction_metrics(inputs: LossInputs) -> dict[str, torch.Tensor]:
    """dropped: rows whose loss a correction zeroes (a masked sampling ratio on a counted token, or the off-policy
    mask); with is_weights their sum over the counted tokens (is_sum) and max (is_max), in float64."""
    mask = inputs.mask
    dropped = torch.zeros(mask.size(0), dtype=torch.bool, device=mask.device)
    metrics = {}
    if inputs.is_weights is not None:
        per_token = inputs.is_weights.expand_as(mask)
        dropped |= ((per_token == 0) & (mask > 0)).any(-1)
        metrics = {"is_sum": (per_token * mask).sum().double(), "is_max": (per_token * mask).max().double()}
    if inputs.off_policy_keep is not None:
        dropped |= inputs.off_policy_keep.squeeze(-1) == 0
    return {"dropped": dropped.sum(), **metrics}


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
