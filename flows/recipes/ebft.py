"""EBFT (rl: ebft): GRPO's rounds, scored by feature matching against each prompt's reference completion, with
the starting policy frozen as the feature network (stages/training/ebft.py; strided mode,
stages/training/ebft_strided.py, samples
blocks of raw documents). score.reward_funcs are not read; the health checks have no verifier to watch rise.

Departures from axolotl's EBFT trainers: stages/training/ebft.py lists them (reward scaling, advantage estimators, the
reference's cross-entropy term).
"""

from __future__ import annotations

from functools import partial

from flows.rounds import Trained, logged_rounds, sampled_rounds
from tasks.stage_tasks import (
    RunContext,
    ebft_score_task,
    eval_task,
    rollout_task,
    strided_eval_task,
    strided_rollout_task,
)


def evaluator(cfg, policy):
    """The eval task of an EBFT run: strided mode scores the held-out documents' blocks under the features of
    `policy`, the starting policy (for every eval: base, periodic, final, the champion's); structured mode is
    eval_task's greedy accuracy."""
    return partial(strided_eval_task, feature_model=policy) if cfg.ebft.mode == "strided" else eval_task


def train(ctx: RunContext, parent: str, policy, prompts) -> Trained:
    """The rounds from `policy`, which is also the frozen feature model; structured mode samples completions of
    the prompts, strided mode blocks of the documents."""
    scoring = (ebft_score_task, {"feature_model": policy})
    sample = strided_rollout_task if ctx.config.ebft.mode == "strided" else rollout_task
    return logged_rounds(ctx, parent, [], lambda log_round: sampled_rounds(
        ctx, policy, prompts, log_round, scoring, evaluate=evaluator(ctx.config, policy), sample=sample,
        ce_coef=ctx.config.ebft.ce_coef, rl_coef=ctx.config.ebft.rl_coef))
