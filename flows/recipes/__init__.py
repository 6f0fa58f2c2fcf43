"""One recipe per training method, each reading top to bottom: what it trains from the starting policy and
how its rounds (if any) go. flows/pipeline.py opens the run, prepares the policy, calls `RECIPES[method]` and
finishes (export, final eval, registry, promotion, summary). `method` is `rl`, or `atropos` when an Atropos
setup makes the rollouts (rollout.source: atropos). rl: reward_model trains no policy: its recipe is a whole
run (`WHOLE_RUNS`). A method whose evals are not eval_task's (EBFT's strided mode: raw documents' blocks) names
its eval task in `EVALUATORS`; every eval of the run uses it.
"""

from __future__ import annotations

from flows.recipes import atropos, ebft, grpo, preference, reward_model
from tasks.stage_tasks import eval_task

RECIPES = {"grpo": grpo.train, "gdpo": grpo.train, "ebft": ebft.train, "atropos": atropos.train,
           **{rl: preference.train for rl in ("dpo", "ipo", "kto", "orpo", "simpo")}}
"""method -> train(ctx, parent run id, starting policy, prompts) -> flows.rounds.Trained."""

WHOLE_RUNS = {"reward_model": reward_model.run}
"""rl -> run(ctx, parent run id, run dir) -> the run's results, for the methods that train no policy."""


EVALUATORS = {"ebft": ebft.evaluator}
"""method -> evaluator(cfg, starting policy) -> its eval task, for the methods whose evals are not eval_task's."""


def evaluator(cfg, policy):
    """The eval task every eval of a run uses (base, periodic, final, the champion's): the method's own
    (EVALUATORS), else eval_task; called as task(ctx, model, prompts, label, adapter=None, version=-1)."""
    own = EVALUATORS.get(method(cfg))
    return own(cfg, policy) if own else eval_task


def method(cfg) -> str:
    """The recipe a config runs: `atropos` under rollout.source: atropos, else `rl`."""
    return "atropos" if cfg.rollout.source == "atropos" else cfg.rl
