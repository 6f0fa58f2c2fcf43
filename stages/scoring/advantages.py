"""Group-relative advantages (TRL's GRPOTrainer: GRPO's sum-then-normalize, GDPO's normalize-then-sum) and the
reward statistics of a round's prompt groups. Used by the score stage, EBFT's and Atropos' scoring, the replay
buffer and the optimize stage (which rows carry signal)."""

from __future__ import annotations

from stages.runtime.imports import LazyModule

torch = LazyModule("torch")  # imported on first use: loading a config does not import torch

ZERO_ADVANTAGE = 1e-8  # |A| below this is float noise of a group whose rewards are all equal


def reward_spread(totals: torch.Tensor, num_generations: int) -> dict[str, float]:
    """The round's reward statistics, as TRL logs them: `reward_mean`; `reward_std`, the mean over prompt groups
    of the std within each group (what the advantages see); `reward_std_batch`, the std over all completions;
    `frac_reward_zero_std`, the share of groups whose completions all got one reward (no gradient)."""
    grouped = totals.view(-1, num_generations).double()
    group_std = grouped.std(dim=1)
    return {"reward_mean": float(totals.mean()), "reward_std": float(group_std.mean()),
            "reward_std_batch": float(totals.std()), "frac_reward_zero_std": float((group_std < 1e-8).float().mean())}


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


def _nanstd(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Unbiased std along dim ignoring NaN (TRL's `nanstd`); NaN where fewer than 2 values."""
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keepdim)
    squares = torch.nansum((x - torch.nanmean(x, dim=dim, keepdim=True)) ** 2, dim=dim, keepdim=keepdim)
    return torch.sqrt(squares / (count - 1).clamp(min=0))


def streaming_advantages(totals: torch.Tensor, rewards_per_func: torch.Tensor, weights: torch.Tensor,
                         num_generations: int, aggregation: str, scale_rewards: str) -> torch.Tensor:
    """Advantages as axolotl's streaming scorer computes them (trl.streaming_partial_batch,
    AsyncGRPOTrainer._compute_streaming_group_scores): a chunk of groups is scored before the rest of the batch
    exists, so every statistic is one group's. sum_then_normalize: the weighted `totals` less the group mean,
    divided by the group's std unless scale_rewards is none (batch acts as group). normalize_then_sum: GDPO's
    per-function group normalization, weighted sum, then a group normalization where TRL's is over the batch.

    >>> r = torch.tensor([[1.0], [0.0], [3.0], [1.0]])
    >>> [round(a, 3) for a in streaming_advantages(r[:, 0], r, torch.tensor([1.0]), 2, "sum_then_normalize",
    ...                                            "batch").tolist()]
    [0.707, -0.707, 0.707, -0.707]
    """
    if aggregation == "sum_then_normalize":
        return group_advantages(totals, num_generations, "none" if scale_rewards == "none" else "group")
    summed = gdpo_advantages(rewards_per_func, weights, num_generations, final="none")
    grouped = summed.view(-1, num_generations)
    centred = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    return torch.nan_to_num(centred / (_nanstd(grouped, dim=1, keepdim=True) + 1e-4), nan=0.0).view(-1)


def gdpo_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                    final: str = "batch") -> torch.Tensor:
    """GDPO advantages (`multi_objective_aggregation: normalize_then_sum`) for rewards (n, F) laid out
    group by group; NaN (a None reward) is left out of the group's mean and std and adds 0 to the sum.

    As TRL's GRPOTrainer with `multi_objective_aggregation="normalize_then_sum"` (which axolotl's
    `rl: gdpo` sets) and the GDPO paper (arXiv 2601.05242), with unbiased stds:
    A_k = (r_k - mean_group(r_k)) / (std_group(r_k) + 1e-4) for each function k,
    A = sum_k w_k A_k, then (A - mean_batch(A)) / (std_batch(A) + 1e-4).

    (format, correct) = (1, 0) and (0, 1) have the same sum, hence the same GRPO advantage; not here:

    >>> rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])  # one group of 4
    >>> [round(a, 3) for a in group_advantages(rewards.sum(dim=1), 4, "group").tolist()]
    [-0.5, -0.5, -0.5, 1.5]
    >>> [round(a, 3) for a in gdpo_advantages(rewards, torch.tensor([1.0, 1.0]), 4).tolist()]
    [-0.398, -0.689, -0.398, 1.486]

    `final` "none": the weighted sums before the batch normalization (NaN where every function returned None), for
    `streaming_advantages`.
    """
    # TRL: GRPOTrainer._generate_and_score_completions, branch multi_objective_aggregation == "normalize_then_sum".
    num_funcs = rewards_per_func.shape[1]
    grouped = rewards_per_func.reshape(-1, num_generations, num_funcs)
    per_func = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (_nanstd(grouped, dim=1, keepdim=True) + 1e-4)
    summed = torch.nansum(per_func.reshape(-1, num_funcs) * weights.to(per_func.dtype), dim=1)
    # As TRL 1.16: a row where every function returned None is left out of the batch stats, advantage 0.
    summed[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
    if final == "none":
        return summed
    std = _nanstd(summed, dim=0) if summed.numel() > 1 else torch.zeros((), dtype=summed.dtype)
    return torch.nan_to_num((summed - torch.nanmean(summed)) / (std + 1e-4), nan=0.0)
