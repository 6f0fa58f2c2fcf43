"""GRPO and GDPO (rl: grpo | gdpo): rollout -> score -> optimize rounds on our own rollouts, scored by
score.reward_funcs (verifiers, your functions, remote verifiers, and/or a reward model this run trains first on the
preferences). gdpo is the same rounds with score.multi_objective_aggregation normalize_then_sum (flows/config.py).

Departures from TRL's GRPOTrainer (stages/training/grpo.py says more): a round is one generation batch of
rollout.prompts_per_round x num_generations completions, cached as artifacts; pi_old is the policy at the start of
the round; rollouts may be prefetched rounds ahead (rollout.async_prefetch), and zero-signal groups replaced from a
replay buffer (grpo.replay_buffer_size) or re-rolled, as axolotl does.
"""

from __future__ import annotations

from flows.rounds import Trained, logged_rounds, sampled_rounds
from flows.run import log_preferences
from stages.scoring.score import metric_name
from tasks.stage_tasks import RunContext, preferences_task, resolve_reward_models, reward_model_task, score_task


def train(ctx: RunContext, parent: str, policy, prompts) -> Trained:
    """The rounds from `policy`, logged to the parent run; a reward model among score.reward_funcs is trained
    first, on the preferences, from the same policy."""
    scoring, lineage = (score_task, {"reward_models": resolve_reward_models(ctx)}), {}  # one commit for the run
    if "reward_model" in ctx.config.score.reward_funcs:
        prefs = log_preferences(ctx, parent, preferences_task(ctx))
        reward_model = reward_model_task(ctx, policy, prefs)
        summary = reward_model.manifest["summary"]
        for key in ("eval_pairwise_accuracy", "eval_step_accuracy"):  # ORM / PRM
            if summary.get(key) is not None:
                ctx.lineage.log_metrics(parent, {f"reward_model/{key}": summary[key]})
        lineage = {"preferences": prefs.key, "reward_model": reward_model.key}
        scoring = (score_task, {**scoring[1], "reward_model": reward_model})
    verifiers = [metric_name(n) for n in ctx.config.score.reward_funcs if metric_name(n) != "reward_model"]
    trained = logged_rounds(ctx, parent, verifiers,
                            lambda log_round: sampled_rounds(ctx, policy, prompts, log_round, scoring))
    trained.lineage.update(lineage)
    return trained
