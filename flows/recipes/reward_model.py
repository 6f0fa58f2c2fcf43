"""A reward model on its own (rl: reward_model; axolotl's reward_model: true / process_reward_model: true): base
model -> preferences -> reward model (stages/training/reward_model.py,
TRL's RewardTrainer or a token-classification PRM),
registered in MLflow; no policy is trained, exported or evaluated, so this recipe is the whole run. A GRPO run
scores with the result as score.reward_funcs: [reward_model:<its folder>].
"""

from __future__ import annotations

from pathlib import Path

from flows.run import log_preferences, prepare_policy, run_cost, save_results
from tasks.lineage import ui_command
from tasks.stage_tasks import RunContext, preferences_task, reward_model_task


def run(ctx: RunContext, parent: str, run_dir: Path) -> dict:
    """rl: reward_model: base model -> preferences -> reward model, registered in MLflow; return the results
    (pairwise or step accuracy on the preferences' eval split before and after training, the model's folder)."""
    cfg, lineage = ctx.config, ctx.lineage
    try:
        _, base, _ = prepare_policy(ctx, parent)  # sft is off: the reward model starts from model.path
        prefs = log_preferences(ctx, parent, preferences_task(ctx))
        trained = reward_model_task(ctx, base, prefs)
        summary = trained.manifest["summary"]
        accuracy = "eval_step_accuracy" if cfg.reward_model.kind == "prm" else "eval_pairwise_accuracy"
        for step, key in ((0, f"{accuracy}_before"), (1, accuracy)):
            if summary.get(key) is not None:
                lineage.log_metrics(parent, {f"reward_model/{accuracy}": summary[key]}, step=step)
        version = lineage.register_model(parent, trained.path, cfg.export.model_name)
        lineage.set_tags(parent, {"registered_model": f"{cfg.export.model_name}/{version}",
                                  "reward_model": str(trained.path)})
        results = {
            "run_name": run_dir.name, "mlflow_run_id": parent, "experiment": cfg.name, "rl": "reward_model",
            "reward_model_kind": cfg.reward_model.kind, "reward_model": str(trained.path),
            "registered_model_version": version,
            "accuracy_metric": accuracy, "accuracy_before": summary.get(f"{accuracy}_before"),
            "accuracy_after": summary.get(accuracy),
            "eval_rows": summary.get("eval_rows" if cfg.reward_model.kind == "prm" else "eval_pairs"),
            "score_with": f"score.reward_funcs: [reward_model:{trained.path}]",
            "stages": ctx.reporter.rows, "cost": run_cost(ctx, parent), "warnings": ctx.reporter.warnings,
            "mlflow_ui": ui_command(Path(cfg.artifacts_dir).resolve()),
        }
        save_results(ctx, parent, run_dir, results)
    except BaseException:
        lineage.finish("FAILED")
        raise
    lineage.finish("FINISHED")
    if not ctx.reporter.quiet:
        ctx.reporter.summary(results)
    return results
