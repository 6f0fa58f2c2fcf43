"""EBFT (rl: ebft): GRPO's rounds, scored by feature matching against each prompt's reference completion, with
the starting policy frozen as the feature network (stages/training/ebft.py; strided mode,
stages/training/ebft_strided.py, samples
blocks of raw documents). score.reward_funcs are not read; the health checks have no verifier to watch rise.

Departures from axolotl's EBFT trainers: stages/training/ebft.py lists them (reward scaling, advantage estimators, the
reference's cross-entropy term).
"""

from __future__ import annotations

from flows.rounds import Trained, logged_rounds, sampled_rounds
from tasks.stage_tasks import RunContext, ebft_score_task, rollout_task, strided_rollout_task


def train(ctx: RunContext, parent: str, policy, prompts) -> Trained:
    """The rounds from `policy`, which is also the frozen feature model; structured mode samples completions of
    the prompts, strided mode blocks of the documents."""
    scoring = (ebft_score_task, {"feature_model": policy})
    sample = strided_rollout_task if ctx.config.ebft.mode == "strided" else rollout_task
    trained = logged_rounds(ctx, parent, [], lambda log_round: sampled_rounds(
        ctx, policy, prompts, log_round, scoring, features=policy, sample=sample, ce_coef=ctx.config.ebft.ce_coef,
        rl_coef=ctx.config.ebft.rl_coef))
    trained.feature_model = policy  # the final eval and the promotion compare features under it too
    return trained
