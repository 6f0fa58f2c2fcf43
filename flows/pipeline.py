"""The GRPO pipeline flow: which tasks run, in which order, per round.

demo_data -> transform -> base_model -> sft -> eval(base)
  -> [rollout(r) -> score(r) -> optimize(r)] x grpo.rounds -> export -> eval(final)

Every stage is a cached artifact (tasks/store.py): running the same config again
computes nothing. MLflow gets one parent run per pipeline run, a nested run per
computed stage, per-round metrics, the eval accuracies and the registered model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml
from prefect import flow
from prefect.runtime import flow_run

from flows.config import PipelineConfig, load_config
from tasks.lineage import Lineage, git_commit, ui_command
from tasks.reporting import Reporter
from tasks.stage_tasks import (
    RunContext,
    base_model_task,
    demo_data_task,
    eval_task,
    export_task,
    optimize_task,
    rollout_task,
    score_task,
    sft_task,
    transform_task,
)
from tasks.store import ArtifactStore


def normalize_overrides(overrides: list[str] | dict | None) -> list[str]:
    """Accept ["grpo.rounds=2"] (CLI) or {"grpo.rounds": 2} (Prefect parameters)."""
    if not overrides:
        return []
    if isinstance(overrides, dict):
        return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()]
    return list(overrides)


ROUND_METRICS = {  # parent-run metric name -> (stage, summary key)
    "train/reward_mean": ("score", "reward_mean"),
    "train/reward_std": ("score", "reward_std"),
    "train/frac_reward_zero_std": ("score", "frac_reward_zero_std"),
    "train/kl": ("optimize", "kl"),
    "train/loss": ("optimize", "loss"),
    "train/clip_ratio": ("optimize", "clip_ratio"),
    "train/completion_length": ("optimize", "completion_length"),
    "train/grad_norm": ("optimize", "grad_norm"),
    "train/entropy": ("optimize", "entropy"),
}


@flow(name="posttrain", flow_run_name="{config_path}")
def posttrain_pipeline(config_path: str, overrides: list[str] | dict | None = None, quiet: bool = False) -> dict:
    """Run the GRPO pipeline for a YAML config (plus dotted overrides); return the results."""
    override_list = normalize_overrides(overrides)
    cfg: PipelineConfig = load_config(config_path, override_list)
    root = Path(cfg.artifacts_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    store = ArtifactStore(root)
    lineage = Lineage(root, cfg.name)
    reporter = Reporter(root, quiet=quiet)
    run_name = f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = root / "runs" / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = run_dir / "config.yaml"
    resolved.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    tags = {
        "prefect.flow_run_id": str(flow_run.get_id() or ""),
        "git_commit": git_commit(),
        "config_hash": cfg.hash(),
        "config_path": str(config_path),
        "overrides": " ".join(override_list),
        "artifact_root": str(root),
    }
    parent = lineage.start(run_name, tags, cfg.model_dump(mode="json"), resolved)
    ctx = RunContext(cfg, store, lineage, reporter)
    try:
        raw = None if cfg.transform.paths else demo_data_task(ctx)
        prompts = transform_task(ctx, raw)
        for split in ("train", "eval"):
            meta = prompts.manifest["files"][f"{split}.parquet"]
            lineage.log_dataset(parent, f"prompts-{split}", prompts.file(f"{split}.parquet"), meta["sha256"],
                                context="training" if split == "train" else "evaluation", rows=meta["rows"])
        base = base_model_task(ctx, prompts)
        policy = sft_task(ctx, base, prompts) if cfg.sft.enabled else base
        base_eval = eval_task(ctx, policy, prompts, label="base")
        lineage.log_metrics(parent, {"eval/accuracy": base_eval.manifest["summary"]["accuracy"]}, step=0)

        adapter = None
        lineage_keys = {"prompts": prompts.key, "base_model": base.key, "policy": f"{policy.stage}/{policy.key}"}
        round_metrics: dict = {}
        for r in range(cfg.grpo.rounds):
            rollouts = rollout_task(ctx, policy, adapter, prompts, r)
            scored = score_task(ctx, rollouts, r)
            adapter = optimize_task(ctx, policy, adapter, scored, r)
            summaries = {"score": scored.manifest["summary"], "optimize": adapter.manifest["summary"]}
            round_metrics = {name: summaries[stage][key] for name, (stage, key) in ROUND_METRICS.items()}
            round_metrics["rollout/tokens"] = rollouts.manifest["summary"]["tokens"]
            lineage.log_metrics(parent, round_metrics, step=r + 1)
            lineage_keys[f"round_{r}"] = {"rollout": rollouts.key, "score": scored.key, "optimize": adapter.key}

        exported = export_task(ctx, policy, adapter, lineage_keys, round_metrics)
        final_eval = eval_task(ctx, exported, prompts, label="final")
        base_acc = base_eval.manifest["summary"]["accuracy"]
        final_acc = final_eval.manifest["summary"]["accuracy"]
        lineage.log_metrics(parent, {"eval/accuracy": final_acc}, step=cfg.grpo.rounds)
        lineage.log_metrics(parent, {"eval/accuracy_base": base_acc, "eval/accuracy_final": final_acc,
                                     "eval/accuracy_gain": final_acc - base_acc})
        version = lineage.register_model(parent, exported.path, cfg.export.model_name)
        lineage.set_tags(parent, {"registered_model": f"{cfg.export.model_name}/{version}",
                                  "exported_model": str(exported.path)})
        results = {
            "run_name": run_name,
            "mlflow_run_id": parent,
            "experiment": cfg.name,
            "base_accuracy": base_acc,
            "final_accuracy": final_acc,
            "eval_prompts": final_eval.manifest["summary"]["num_prompts"],
            "exported_model": str(exported.path),
            "registered_model_version": version,
            "stages": reporter.rows,
            "mlflow_ui": ui_command(root),
        }
        (run_dir / "summary.json").write_text(json.dumps(results, indent=2))
        lineage.client.log_artifact(parent, str(run_dir / "summary.json"))
    except BaseException:
        lineage.finish("FAILED")
        raise
    lineage.finish("FINISHED")
    if not quiet:
        reporter.summary(results)
    return results
