"""Opening a run and what every method starts from: the config and its MLflow parent run (`open_run`, resumes
included), the prompts, base model and starting policy (`prepare_policy`), and the datasets logged as the
parent run's inputs. flows/pipeline.py and the recipes (flows/recipes/) call these; nothing here trains."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import yaml
from prefect.runtime import flow_run

from flows import preflight
from flows.config import ConfigError, PipelineConfig, code_dirs, config_differences, load_config
from tasks.lineage import Lineage, git_commit, process_alive
from tasks.reporting import Reporter
from tasks.stage_tasks import RunContext, base_model_task, demo_data_task, sft_task, transform_task
from stages.runtime.imports import add_code_dirs
from tasks.store import ArtifactStore

log = logging.getLogger("posttrain")

OPENED: list[tuple[str, Path]] = []
"""(run name, artifacts folder) of each training run this process opened or continued, newest last: the run a
signal-stopped `posttrain run` or `resume` names in its "resume with" line (flows/launch.py `stopped_message`)."""

CODE_DIRS_TAG = "posttrain.code_dirs"
"""Parent-run tag: the folders user modules were found in (flows/config.py `code_dirs`), as JSON; a resume, which
reads the run's saved config from artifacts/runs/<name>/, adds them again."""


def normalize_overrides(overrides: list[str] | dict | None) -> list[str]:
    """Accept ["grpo.rounds=2"] (CLI) or {"grpo.rounds": 2} (Prefect parameters)."""
    if not overrides:
        return []
    if isinstance(overrides, dict):
        return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()]
    return list(overrides)


EVAL_METRICS = ("accuracy", "constant_baseline", "distinct_answers", "answer_entropy", "format_rate",
                "feature_distance", "exact_blocks")
"""eval summary keys (stages/evaluation/evaluate.py; ebft strided: stages/training/ebft_strided.py)
logged to the parent run as
eval/<key> at each evaluated step."""


def eval_metrics(summary: dict) -> dict:
    """The parent-run eval/* metrics of one eval artifact's summary (and its pass_at_k, eval.num_samples > 1)."""
    return {f"eval/{k}": v for k, v in summary.items() if k in EVAL_METRICS or k.startswith("pass_at_")}


def crash_flow_run(previous_id: str, current_id: str) -> None:
    """Mark the Prefect flow run of an attempt whose process was killed CRASHED: nothing else would, and
    the Prefect UI would show it running forever. Best effort: a failure here only logs a warning."""
    if not previous_id or previous_id == current_id:
        return
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    try:
        with get_client(sync_client=True) as client:
            if client.read_flow_run(previous_id).state.is_running():
                client.set_flow_run_state(previous_id, Crashed(message=f"its process died; flow run {current_id} "
                                                                       "continues its pipeline run"), force=True)
    except Exception as e:  # an old server without that run, a network error: the run itself is not affected
        logging.getLogger(__name__).warning("could not mark flow run %s crashed: %s", previous_id, e)


def open_run(config_path: str, overrides: list[str] | dict | None, quiet: bool, purpose: str = "train",
             resume: str | None = None, allow_config_change: bool = False):
    """Load the config, open (or continue) the MLflow parent run, save the resolved config:
    (ctx, parent run id, run dir).

    A training run continues an unfinished one instead of opening a new run when `resume` names it
    (`posttrain resume`), when this Prefect flow run opened it before (`prefect flow-run retry`), or
    when the newest run of the same config failed or its process died (the same command again).
    Finished stages and rounds are then cache hits; the parent run goes on where it stopped.
    """
    override_list = normalize_overrides(overrides)
    cfg: PipelineConfig = load_config(config_path, override_list)
    root = Path(cfg.artifacts_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    lineage = Lineage(root, cfg.name)
    flow_run_id = str(flow_run.get_id() or "")
    continued = None  # why this start continues an earlier run by itself (not `posttrain resume`)
    if purpose == "train" and resume is None:
        resume = lineage.unfinished_run(cfg.hash(), flow_run_id)
        continued = resume
    previous = lineage.client.get_run(resume) if resume else None
    if previous is not None:  # its user modules are found where the first attempt found them (its config's folder)
        add_code_dirs(json.loads(previous.data.tags.get(CODE_DIRS_TAG) or "[]"))
    checked = preflight.check(cfg, config_path) if purpose == "train" else None  # before any stage; exit 2
    if resume:
        run_name = previous.info.run_name
        run_dir = root / "runs" / run_name
        if purpose == "train":
            OPENED.append((run_name, root))
        changed = config_differences(yaml.safe_load((run_dir / "config.yaml").read_text()), cfg.run_config())
        if changed and not allow_config_change:
            raise ConfigError(f"resume {run_name}: the config differs from the run's in {', '.join(changed)}; "
                              "resume with the run's own config, or pass --allow-config-change")
        lineage.resume(resume, cfg.run_config(), run_dir / "config.yaml")
        if not process_alive(previous.data.tags.get("posttrain.pid", "")):
            crash_flow_run(previous.data.tags.get("prefect.flow_run_id", ""), flow_run_id)
        lineage.set_tags(resume, {"prefect.flow_run_id": flow_run_id, "git_commit": git_commit(),
                                  **({"posttrain.config_changed": ", ".join(changed)} if changed else {})})
        if changed:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.run_config(), sort_keys=False))
        if checked:
            lineage.log_code(resume, checked.functions)
        ctx = RunContext(cfg, ArtifactStore(root), lineage, Reporter(root, quiet=quiet))
        if continued:
            announce(ctx, continuing_message(previous, run_name, flow_run_id), logging.WARNING)
        return ctx, resume, run_dir
    run_name = f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}" + ("" if purpose == "train" else f"-{purpose}")
    base, n = run_name, 1
    while True:  # another run of this config started in the same second: <name>-2, -3, ...
        run_dir = root / "runs" / run_name
        try:
            run_dir.mkdir(parents=True)
            break
        except FileExistsError:
            n += 1
            run_name = f"{base}-{n}"
    resolved = run_dir / "config.yaml"
    resolved.write_text(yaml.safe_dump(cfg.run_config(), sort_keys=False))
    tags = {
        "prefect.flow_run_id": flow_run_id,
        "git_commit": git_commit(),
        "config_hash": cfg.hash(),
        "config_path": str(config_path),
        "overrides": " ".join(override_list),
        "artifact_root": str(root),
        "posttrain.purpose": purpose,
        "posttrain.pid": str(os.getpid()),
        "posttrain.host": socket.gethostname(),  # with the pid: `posttrain runs` shows a run whose process died KILLED
        CODE_DIRS_TAG: json.dumps(code_dirs(config_path)),
    }
    parent = lineage.start(run_name, tags, cfg.run_config(), resolved)
    if purpose == "train":
        OPENED.append((run_name, root))
        lineage.log_code(parent, checked.functions)
    return RunContext(cfg, ArtifactStore(root), lineage, Reporter(root, quiet=quiet)), parent, run_dir


def continuing_message(previous, run_name: str, flow_run_id: str) -> str:
    """The line a start that continues an unfinished run of the same config by itself shows (`open_run`)."""
    if flow_run_id and previous.data.tags.get("prefect.flow_run_id") == flow_run_id:
        why = "this Prefect flow run started it"
    elif previous.info.status == "FAILED":
        why = "its last attempt failed"
    else:
        why = "its process died before it finished"
    return (f"continuing run {run_name} ({why}): the stages and rounds it finished are reused, the same MLflow run "
            "goes on; to start a new run instead, change the config (name, a seed) or set artifacts_dir elsewhere")


def announce(ctx: RunContext, message: str, level: int) -> None:
    """Log `message` and show it on the console (a warning in yellow) unless the run is quiet."""
    log.log(level, message)
    if not ctx.reporter.quiet:
        ctx.reporter.console.print(message, soft_wrap=True, markup=False,
                                   style="yellow" if level >= logging.WARNING else None)


def prepare_policy(ctx: RunContext, parent: str) -> tuple:
    """demo_data -> transform -> base_model -> sft: (prompts, base model, starting policy) artifacts; prompts
    None for a run that reads none (`reads_prompts`: a DPO-family run on your preferences and model)."""
    from flows import retrain

    cfg = ctx.config
    if not cfg.reads_prompts:
        announce(ctx, f"rl: {cfg.rl} on your preferences and {cfg.model.path}: no prompts, SFT or prompt eval",
                 logging.INFO)
        base = base_model_task(ctx, None)
        return None, base, retrain.starting_policy(ctx, parent) or base
    raw = None if cfg.transform.paths or cfg.transform.datasets else demo_data_task(ctx)
    prompts = transform_task(ctx, raw)
    for source in prompts.manifest["summary"].get("sources", []):  # transform.datasets: rows per source
        splits = ", ".join(f"{split} {rows}" for split, rows in source["splits"].items())
        message = (f"transform: {source['key']} {source['source']}: {source['rows']} rows ({splits})"
                   + (f", {source['dropped']} dropped" if source["dropped"] else ""))
        announce(ctx, message, logging.INFO)
        ctx.lineage.set_tags(parent, {f"transform.source_rows.{source['key']}": source["rows"],
                                      f"transform.source.{source['key']}": source["source"]})
    for split, dropped in prompts.manifest["summary"].get("dropped", {}).items():  # transform.on_bad_rows: drop
        message = (f"transform: dropped {dropped['rows']} bad row(s) of split {split!r} (transform.on_bad_rows: "
                   f"drop), rows {dropped['indices'][:10]}: {dropped['reasons'][0]}")
        announce(ctx, message, logging.WARNING)
        ctx.lineage.set_tags(parent, {f"transform.dropped_rows.{split}": dropped["rows"]})
    base = base_model_task(ctx, prompts)
    announce(ctx, f"sft: warm start on split {cfg.sft.split!r} ({cfg.sft.completion_field})" if cfg.sft.enabled else
             "sft: off, the policy starts from the base model as it is (sft.enabled: true warm-starts it)",
             logging.INFO)
    champion = retrain.starting_policy(ctx, parent)  # promotion.start_from_champion: the champion's model
    policy = champion or (sft_task(ctx, base, prompts) if cfg.sft.enabled else base)
    prompts = retrain.data_version_prompts(ctx, parent, raw, prompts)  # data.version: its rows are the train split
    if not cfg.runs_eval:
        announce(ctx, "eval: none, your rows are a train split only (transform.test_datasets, val_set_size or "
                      "transform.paths.eval make one); the run reports its training metrics", logging.WARNING)
    for split in [s for s in ("train", "eval") if f"{s}.parquet" in prompts.manifest["files"]]:
        meta = prompts.manifest["files"][f"{split}.parquet"]
        ctx.lineage.log_dataset(parent, f"prompts-{split}", prompts.file(f"{split}.parquet"), meta["sha256"],
                                context="training" if split == "train" else "evaluation", rows=meta["rows"])
    return prompts, base, policy


def log_preferences(ctx: RunContext, parent: str, prefs):
    """Record the preference tables as the parent run's dataset inputs; return the artifact."""
    for name, meta in prefs.manifest["files"].items():
        if name.endswith(".parquet"):
            ctx.lineage.log_dataset(parent, f"preferences-{name.removesuffix('.parquet')}", prefs.file(name),
                                    meta["sha256"], context="training", rows=meta.get("rows", 0))
    return prefs


def run_cost(ctx: RunContext, parent: str) -> dict:
    """What the run cost, from its stages' rows (tasks/costs.py `run_totals`: spent, avoided by the cache, per 1k
    training tokens and per accepted sample), logged to the parent run as cost/* metrics; the results' `cost`."""
    from tasks import costs

    totals = costs.run_totals(ctx.reporter.rows, ctx.store.root)
    ctx.lineage.log_metrics(parent, costs.totals_metrics(totals))
    return totals


def save_results(ctx: RunContext, parent: str, run_dir: Path, results: dict, history: list[dict] = ()) -> None:
    """The run's results as runs/<run>/summary.json, logged to the MLflow parent run, and as Prefect artifacts
    (the summary, and each round's metrics in `history`)."""
    from tasks.publish import publish_summary

    (run_dir / "summary.json").write_text(json.dumps(results, indent=2))
    publish_summary(ctx.config.name, results, list(history))
    ctx.lineage.client.log_artifact(parent, str(run_dir / "summary.json"))
