"""posttrain as an Atropos trainer (rollout.source: atropos): each round pulls one scored batch that Atropos
environments made by sampling the policy posttrain serves (stages/rollout/atropos.py), stores it as the round's rollouts
and scores, and optimizes on it with GRPO's loss. The environments sample and score: score.reward_funcs, replay and
re-rolls are not read (flows/config.py refuses them set).

Departures from Atropos' example trainer: batches are artifacts (a resumed run never pulls a batch twice), and the
policy server answers OpenAI's and vLLM's routes from one of our engines.
"""

from __future__ import annotations

import time

from flows.rounds import Trained, eval_round, finish_round, logged_rounds
from tasks.stage_tasks import (RunContext, atropos_batch_size, atropos_batch_task, atropos_score_task,
                               optimize_task, placement, policy_for)


def train(ctx: RunContext, parent: str, policy, prompts) -> Trained:
    """The rounds from `policy`, served to the environments as it trains."""
    return logged_rounds(ctx, parent, [], lambda log_round: atropos_rounds(ctx, policy, prompts, log_round))


def atropos_rounds(ctx: RunContext, policy, prompts, log_round) -> tuple:
    """rollout.source: atropos (stages/rollout/atropos.py): each round pulls one scored batch from the Atropos API,
    stores it (rollouts, then scored), and optimizes on it; the policy server samples the newest policy."""
    from stages.rollout import atropos
    from stages.rollout.engines import get_engine
    from stages.rollout.rollout import engine_options

    cfg = ctx.config
    session = atropos.AtroposSession(
        cfg.rollout.atropos, lambda: get_engine(cfg.rollout.engine, policy.path,
                                                engine_options(cfg.rollout, cfg.grpo.lora_r, placement(ctx))),
        atropos_batch_size(ctx), cfg.grpo.rounds, ctx.store.root)
    adapter, lineage_keys, metrics = None, {}, {}
    try:
        for r in range(cfg.grpo.rounds):
            session.serve(policy_for(ctx, policy, adapter, r))
            started = time.perf_counter()
            rollouts = atropos_batch_task(ctx, session, policy, adapter, r)
            scored = atropos_score_task(ctx, rollouts, r)
            waited = time.perf_counter() - started
            started = time.perf_counter()
            adapter = optimize_task(ctx, policy, adapter, scored, r)
            optimize_s = time.perf_counter() - started
            eval_round(ctx, policy, prompts, adapter, r)
            metrics = finish_round(r, rollouts, scored, adapter, {"optimize_s": optimize_s, "waiting_s": waited},
                                   log_round, lineage_keys)
    finally:
        session.close()
    return adapter, lineage_keys, metrics
