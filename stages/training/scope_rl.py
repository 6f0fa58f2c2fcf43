"""SCOPE-RL entropy control (arXiv:2510.08141; axolotl's trl.scope_rl, grpo.scope_* here): each round resamples a
share `scope_alpha` of its prompt groups at temperature T = clip(1 + H0 - H(pi_old), t_min, t_max) times the sampling
temperature, keeps the completions whose total reward reaches `scope_positive_threshold` at advantage 1 (the others
0), and adds them to the loss as a term weighted by alpha: mean(main) + alpha * mean(auxiliary), Eq. 11, with the KL
penalty on the main rows only. Entropy below the target H0 samples hotter, above it colder.

Where each part runs: the rollout stage samples the auxiliary groups (`aux_groups`, at `sampling`'s temperature), the
score stage sets their advantages, the optimize stage weighs their rows (`row_weights`). As axolotl's
ScopeRLAsyncGRPOTrainer, whose helpers these follow; departure: H is the mean entropy of the round that made the
policy being sampled (the optimize stage's `entropy`), where axolotl reads the trainer's last step.
"""

from __future__ import annotations

import random

from stages.runtime.imports import LazyModule

torch = LazyModule("torch")  # imported on first use

AUX_COLUMN = "scope_aux"
"""The rollouts' and scored rows' column marking the auxiliary rows (present only in a SCOPE-RL round)."""


def scope_temperature(entropy: float, target_entropy: float, t_min: float, t_max: float) -> float:
    """The auxiliary rows' temperature relative to the sampling temperature: clip(1 + H0 - H, t_min, t_max).

    >>> [scope_temperature(entropy, 0.5, 0.8, 1.2) for entropy in (0.4, 0.0, 0.5, 5.0)]
    [1.1, 1.2, 1.0, 0.8]
    """
    return min(max(1.0 + (target_entropy - entropy), t_min), t_max)


def aux_groups(num_groups: int, alpha: float, seed: int) -> list[int]:
    """Indices of the prompt groups resampled: round(alpha x groups) of them, at least one, drawn with `seed`,
    in order (axolotl's scope_aux_indices, by group).

    >>> len(aux_groups(512, 1 / 64, seed=0)), aux_groups(4, 1e-6, seed=0) == sorted(aux_groups(4, 1e-6, seed=0))
    (8, True)
    """
    if num_groups == 0 or alpha <= 0:
        return []
    count = min(num_groups, max(1, round(alpha * num_groups)))
    return sorted(random.Random(seed).sample(range(num_groups), count))


def row_weights(aux: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-row loss weights over a round's rows (`aux` 1 for an auxiliary row) that turn a mean over all of them into
    mean(main) + alpha * mean(auxiliary) (axolotl's scope_weights); every auxiliary row counts in its mean, positive
    or not.

    >>> losses, aux = torch.arange(10.0), torch.tensor([0.0] * 8 + [1.0] * 2)
    >>> round((losses * row_weights(aux, 0.25)).mean().item(), 4), round((3.5 + 0.25 * 8.5), 4)
    (5.625, 5.625)
    """
    n, num_aux = aux.numel(), aux.sum()
    return torch.where(aux.bool(), alpha * n / num_aux.clamp(min=1), n / (n - num_aux).clamp(min=1))


def sampling(cfg, entropy: float | None) -> dict:
    """The rollout stage's SCOPE-RL arguments from grpo's settings (`cfg`) and the entropy of the policy it samples
    (None before any round: the target, T 1.0): {} when scope_rl is off."""
    if not cfg.scope_rl:
        return {}
    measured = cfg.scope_target_entropy if entropy is None else entropy
    return {"scope_alpha": cfg.scope_alpha, "scope_temperature": scope_temperature(
        measured, cfg.scope_target_entropy, cfg.scope_temperature_min, cfg.scope_temperature_max)}
