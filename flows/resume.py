"""`posttrain resume RUN`: continue a pipeline run that was killed or failed.

RUN is a run name (artifacts/runs/<name>), an MLflow run id or a Prefect flow-run id. The run's
own resolved config (artifacts/runs/<name>/config.yaml) is run again, continuing the same MLflow
parent run: finished stages and rounds are cache hits (their artifacts are complete, or they do
not exist), the round that was cut off restarts from the last finished round's checkpoint
(adapter + optimizer state; each round seeds its own RNGs), metrics continue without duplicates.
Overrides on the command line are refused when they change the config, unless
--allow-config-change.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml


def add_arguments(parser) -> None:
    parser.add_argument("run", help="run name (e.g. quickstart-20261122-031500), MLflow run id or Prefect flow-run id")
    parser.add_argument("overrides", nargs="*", help="dotted overrides; refused if they change the config")
    parser.add_argument("--artifacts", default="artifacts", help="artifacts folder of the run (default: artifacts)")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume even though the overrides change the config (recorded as a tag)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines or summary table")
    parser.add_argument("--debug", action="store_true",
                        help="on a data, reward-function or file error, show the whole traceback")


def resume_command(args) -> int:
    """Find the run, check the config, run the pipeline flow again on it."""
    from flows.launch import embedded_defaults, start_temporary_prefect_server

    root = Path(args.artifacts).resolve()
    if not (root / "mlflow.db").exists() and not __import__("os").environ.get("MLFLOW_TRACKING_URI"):
        print(f"error: no runs under {root} (no mlflow.db); pass --artifacts", file=sys.stderr)
        return 2
    from flows.config import ConfigError, config_differences, load_config
    from tasks.lineage import StoreBusyError, find_run, retrying_client, tracking_uri

    client = retrying_client(tracking_uri(root))  # runs may be writing the store: wait for its lock, retry
    try:
        run = find_run(client, args.run)
    except (LookupError, StoreBusyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if run.info.status == "FINISHED":
        print(f"{run.info.run_name} finished; nothing to resume (run the config again for a new run)")
        return 0
    saved = Path(run.data.tags.get("artifact_root", root)) / "runs" / run.info.run_name / "config.yaml"
    if not saved.exists():
        print(f"error: {run.info.run_name}: its resolved config {saved} is missing", file=sys.stderr)
        return 2
    try:
        cfg = load_config(saved, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    changed = config_differences(yaml.safe_load(saved.read_text()), cfg.run_config())
    if changed and not args.allow_config_change:
        print(f"error: resume {run.info.run_name}: the overrides change the config: {', '.join(changed)}; "
              "pass --allow-config-change to resume anyway", file=sys.stderr)
        return 2
    _enter_original_folder(Path(run.data.tags.get("artifact_root", root)), Path(cfg.artifacts_dir))
    embedded_defaults(cfg.artifacts_dir)
    server_ready = start_temporary_prefect_server()
    from flows.launch import report_errors
    from flows.pipeline import posttrain_pipeline
    from stages.rollout.engines import import_eagerly

    import_eagerly(trainers=True)  # while the server boots (~3 s sooner to train): a resumed run computes

    def resume() -> int:
        if server_ready:
            server_ready()
        posttrain_pipeline(str(saved), list(args.overrides), quiet=args.quiet, resume=run.info.run_id,
                           allow_config_change=args.allow_config_change)
        return 0

    return report_errors(resume, args.debug)


def _enter_original_folder(artifact_root: Path, artifacts_dir: Path) -> None:
    """A relative artifacts_dir (`artifacts`) meant the folder the run was started from: go there."""
    import os

    if artifacts_dir.is_absolute():
        return
    parts = artifacts_dir.parts
    if len(artifact_root.parts) > len(parts) and artifact_root.parts[-len(parts):] == parts:
        os.chdir(artifact_root.parents[len(parts) - 1])
