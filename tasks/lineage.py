"""MLflow lineage behind a narrow interface.

MLflow's active run is per-thread and Prefect runs tasks in worker threads, so every
call here takes a run id explicitly and goes through `MlflowClient`; nothing relies on
the fluent active run. Default store: sqlite:///<artifacts>/mlflow.db, unless
MLFLOW_TRACKING_URI is set.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

MAX_PARAM_LEN = 6000


def tracking_uri(artifacts_root: Path) -> str:
    """The MLflow store in use: MLFLOW_TRACKING_URI, else the sqlite file under artifacts/."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{artifacts_root / 'mlflow.db'}"


def ui_command(artifacts_root: Path) -> str:
    uri = tracking_uri(artifacts_root)
    if uri.startswith("sqlite:"):
        return f"mlflow ui --backend-store-uri {uri}"
    return f"open {uri}"


def flatten(config: Any, prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}} -> {"a.b": "1"}; lists become JSON."""
    if isinstance(config, dict):
        out = {}
        for k, v in config.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    value = json.dumps(config) if isinstance(config, (list, tuple)) else str(config)
    return {prefix[:-1]: value[:MAX_PARAM_LEN]}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Lineage:
    """One pipeline run in MLflow: a parent run and nested runs per stage."""

    def __init__(self, artifacts_root: Path, experiment: str):
        self.artifacts_root = artifacts_root
        self.uri = tracking_uri(artifacts_root)
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            location = None
            if self.uri.startswith("sqlite:") and not os.environ.get("MLFLOW_TRACKING_URI"):
                location = (artifacts_root / "mlruns").as_uri()
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        else:
            self.experiment_id = found.experiment_id
        self.parent_id: str | None = None

    def start(self, run_name: str, tags: dict[str, str], config: dict, config_yaml: Path) -> str:
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.parent_id = run.info.run_id
        params = [Param(k, v) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.parent_id, params=params[i : i + 100])
        self.client.log_artifact(self.parent_id, str(config_yaml))
        return self.parent_id

    def finish(self, status: str = "FINISHED") -> None:
        if self.parent_id:
            self.client.set_terminated(self.parent_id, status=status)

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if isinstance(v, (int, float))]
        if batch:
            self.client.log_batch(run_id, metrics=batch)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def stage_run(self, stage: str, key: str, config: dict, inputs: dict[str, str]) -> str:
        """A nested run under the parent for one computed stage."""
        run = self.client.create_run(
            self.experiment_id,
            run_name=stage,
            tags={"mlflow.parentRunId": self.parent_id, "posttrain.stage": stage, "posttrain.artifact_key": key,
                  **{f"posttrain.input.{k}": v for k, v in inputs.items()}},
        )
        params = [Param(k, v) for k, v in flatten(config).items()][:100]
        if params:
            self.client.log_batch(run.info.run_id, params=params)
        return run.info.run_id

    def log_dataset(self, run_id: str, name: str, path: Path, digest: str, context: str, rows: int) -> None:
        """Record a Parquet file as a dataset input, carrying its sha256 digest."""
        dataset = Dataset(name=name, digest=digest[:36], source_type="local", source=json.dumps({"uri": str(path)}),
                          profile=json.dumps({"num_rows": rows}))
        self.client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])])

    def register_model(self, run_id: str, folder: Path, name: str) -> str:
        """Log the exported folder under the run and register it; returns the model version."""
        self.client.log_artifacts(run_id, str(folder), artifact_path="model")
        try:
            self.client.create_registered_model(name)
        except Exception:  # already registered
            pass
        source = f"{self.client.get_run(run_id).info.artifact_uri}/model"
        version = self.client.create_model_version(name, source=source, run_id=run_id,
                                                   description="merged policy exported by posttrain")
        return version.version
