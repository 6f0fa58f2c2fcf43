"""The posttrain flow: open the run, prepare the starting policy, train it with the method's recipe, finish.

demo_data -> transform -> base_model -> sft -> eval(base)
  -> RECIPES[method] (flows/recipes/: GRPO/GDPO, EBFT or Atropos rounds of rollout -> score -> optimize,
     or one DPO-family stage)
  -> export -> eval(final) -> registered model, champion/challenger, summary
(demo_data, sft and the evals only where the config asks for them: your own rows skip demo_data, a train
split alone skips the evals and the promotion, a DPO-family run on your preferences skips the prompts.)

Every stage is a cached artifact (tasks/store.py): running the same config again
computes nothing. MLflow gets one parent run per pipeline run, a nested run per
stage (computed: its cost; cached: the cost it avoided, tasks/costs.py), per-round metrics, the eval accuracies,
the run's cost totals and the registered model.
rl: reward_model trains no policy: its recipe is the whole run (flows/recipes/reward_model.py).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.recipes import RECIPES, WHOLE_RUNS, evaluator, method
from flows.run import eval_metrics, open_run, prepare_policy, run_cost, save_results
from stages.runtime.distributed import warm_ranks
from tasks.lineage import ui_command
from tasks.stage_tasks import export_task


@flow(name="posttrain-prepare-policy", flow_run_name="prepare {config_path}")
def prepare_policy_flow(config_path: str, overrides: list[str] | dict | None = None, quiet: bool = False) -> str:
    """Materialize (or find cached) the policy a run starts from; return its folder (what serve-vllm serves)."""
    ctx, parent, _ = open_run(config_path, overrides, quiet, purpose="prepare")
    try:
        _, _, policy = prepare_policy(ctx, parent)
    except BaseException:
        ctx.lineage.finish("FAILED")
        raise
    ctx.lineage.finish("FINISHED")
    return str(policy.path)


@flow(name="posttrain", flow_run_name="{config_path}")
def posttrain_pipeline(config_path: str, overrides: list[str] | dict | None = None, quiet: bool = False,
                       resume: str | None = None, allow_config_change: bool = False) -> dict:
    """Run the pipeline for a YAML config (plus dotted overrides); return the results. `resume`: the
    MLflow run id of an unfinished run to continue (see `open_run` for when that happens by itself)."""
    ctx, parent, run_dir = open_run(config_path, overrides, quiet, resume=resume,
                                    allow_config_change=allow_config_change)
    with warm_ranks():  # train.num_processes > 1: SFT and every optimize round on the same torchrun ranks
        if ctx.config.rl in WHOLE_RUNS:  # rl: reward_model trains no policy
            return WHOLE_RUNS[ctx.config.rl](ctx, parent, run_dir)
        return train_policy(ctx, parent, run_dir, quiet)


def train_policy(ctx, parent: str, run_dir: Path, quiet: bool) -> dict:
    """The run of a method that trains a policy: prepare it, evaluate, train by the method's recipe, export,
    evaluate again, register and promote; return the results. Without an eval split (`runs_eval`) the evals
    and the promotion are left out, and the results say so."""
    cfg, lineage, reporter = ctx.config, ctx.lineage, ctx.reporter
    root = Path(cfg.artifacts_dir).resolve()
    run_name = run_dir.name
    reporter.line(f"run {run_name}: MLflow run {parent} (experiment {cfg.name!r}, under Model training); "
                  f"watch it with: {ui_command(root)}")
    try:
        prompts, base, policy = prepare_policy(ctx, parent)
        evaluate = evaluator(cfg, policy) if cfg.runs_eval else None  # the method's eval task, if any
        base_eval = evaluate(ctx, policy, prompts, label="base") if evaluate else None
        if base_eval:
            lineage.log_metrics(parent, eval_metrics(base_eval.manifest["summary"]), step=0)

        trained = RECIPES[method(cfg)](ctx, parent, policy, prompts)
        lineage_keys = {**({"prompts": prompts.key} if prompts else {}), "base_model": base.key,
                        "policy": f"{policy.stage}/{policy.key}", **trained.lineage}
        exported = export_task(ctx, policy, trained.adapter, lineage_keys, trained.metrics)
        final_eval = evaluate(ctx, exported, prompts, label="final") if evaluate else None
        scores = (eval_results(lineage, parent, base_eval, final_eval, trained) if evaluate
                  else training_results(cfg, trained))
        version = lineage.register_model(parent, exported.path, cfg.export.model_name)
        lineage.set_tags(parent, {"registered_model": f"{cfg.export.model_name}/{version}",
                                  "exported_model": str(exported.path)})
        from flows import retrain

        promotion = (retrain.promote(ctx, parent, version, exported, final_eval, prompts, evaluate=evaluate)
                     if evaluate else retrain.not_ranked(ctx, parent, version, scores["no_eval_reason"]))
        if not quiet:
            reporter.console.print(f"promotion: {promotion['reason']}", soft_wrap=True, markup=False)
        results = {
            "run_name": run_name,
            "mlflow_run_id": parent,
            "experiment": cfg.name,
            **scores,
            "exported_model": str(exported.path),
            "registered_model_version": version,
            "promotion": promotion,
            "rounds_wall_s": trained.wall_s,
            "health": trained.findings,  # the rounds' out-of-range metrics (stages/evaluation/health.py)
            "dropped_rows": prompts.manifest["summary"].get("dropped", {}) if prompts else {},  # on_bad_rows: drop
            "source_rows": prompts.manifest["summary"].get("sources", []) if prompts else [],  # rows per source
            **trained.results,  # the recipe's own (the DPO family: preference accuracy before and after)
            "stages": reporter.rows,
            "cost": run_cost(ctx, parent),  # spent, avoided by the cache, per 1k training tokens and accepted sample
            "warnings": reporter.warnings,  # e.g. damaged artifact folders that were recomputed
            "mlflow_ui": ui_command(root),
        }
        from flows.report import run_report

        results["report"] = run_report(ctx, parent, run_dir, results)  # the run's HTML page; None: not written
        save_results(ctx, parent, run_dir, results, trained.history)
    except BaseException:
        lineage.finish("FAILED")
        raise
    lineage.finish("FINISHED")
    if not quiet:
        reporter.summary(results)
    return results


def eval_results(lineage, parent: str, base_eval, final_eval, trained) -> dict:
    """The held-out accuracies base -> final and the final eval's metrics, logged to the parent run; the
    run's results entries for them (with the constant baseline and the answers' spread)."""
    base_summary, final_summary = base_eval.manifest["summary"], final_eval.manifest["summary"]
    base_acc, final_acc = base_summary["accuracy"], final_summary["accuracy"]
    constant_baseline = final_summary.get("constant_baseline")  # same prompts as base: same baseline
    lineage.log_metrics(parent, eval_metrics(final_summary), step=trained.steps)
    lineage.log_metrics(parent, {"eval/accuracy_base": base_acc, "eval/accuracy_final": final_acc,
                                 "eval/accuracy_gain": final_acc - base_acc,
                                 **({"eval/gain_over_baseline": final_acc - constant_baseline}
                                    if constant_baseline is not None else {})})
    return {
        "held_out_eval": True,
        "base_accuracy": base_acc,
        "final_accuracy": final_acc,
        "eval_prompts": final_summary["num_prompts"],
        # a constant answer's accuracy on the same prompts, and how spread the predicted answers are
        "constant_baseline": constant_baseline,
        "baseline_answer": final_summary.get("baseline_answer"),
        "gain_over_baseline": final_acc - constant_baseline if constant_baseline is not None else None,
        **{f"{which}_{k}": summary.get(k) for which, summary in (("base", base_summary), ("final", final_summary))
           for k in ("format_rate", "distinct_answers", "answer_entropy", "top_answer", "top_answer_frac",
                     "constant_policy")},
    }


def training_results(cfg, trained) -> dict:
    """A run without a prompt eval (`runs_eval` false): no held-out accuracy, and why; the training reward of the
    first and last rounds (on train prompts, each under the policy of its round), which the summary shows
    instead (a DPO-family run: its preference accuracy, in the recipe's results)."""
    rewards = [row["train/reward_mean"] for row in trained.history if row.get("train/reward_mean") is not None]
    why = (f"rl: {cfg.rl} on your preferences alone has no prompts to evaluate on; held-out preference accuracy is "
           "measured on the preferences' eval split (test_datasets or val_set_size) where it has pairs"
           if not cfg.reads_prompts else
           "your rows are a train split only; transform.test_datasets, val_set_size or transform.paths.eval give a "
           "held-out accuracy")
    return {"held_out_eval": False, "no_eval_reason": why, "base_accuracy": None, "final_accuracy": None,
            "eval_prompts": 0,
            "train_reward_first": rewards[0] if rewards else None,
            "train_reward_last": rewards[-1] if rewards else None, "train_rounds": len(trained.history)}
