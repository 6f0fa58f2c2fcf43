"""Read an MLflow SQLite store without importing MLflow (the read-only commands: report, runs, compare, diff, trace).

`posttrain report RUN` in a new process spent most of its ~5-6 s importing MLflow (~3 s of CPU) to run a handful of
queries. `StoreReader` answers the MlflowClient calls those commands make, on a `sqlite:///` store, with the
standard library's sqlite3 (SELECTs only): `search_experiments`, `search_runs` (the two filters they use:
pipeline runs, `tags.mlflow.parentRunId IS NULL`, and one run's stage runs, `tags.mlflow.parentRunId = '<id>'`),
`get_run` and `get_metric_history`, with MLflow's own ordering (runs: start time, then run id; a metric's history:
timestamp, step, value) and its entities' fields. Any other call (`download_artifacts`, ...) goes to a real
MlflowClient, built on first use. tests/test_lineage_reader.py checks every call against MlflowClient on the same
store.

Another process may be writing the store (a run in progress): sqlite waits for its lock (busy timeout), then the
read is retried as `tasks.lineage.retry_busy` retries MLflow's calls, and StoreBusyError names the file."""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from tasks.lineage import retry_busy, sqlite_path

BUSY_TIMEOUT_S = 20.0  # as MLflow's sessions (PRAGMA busy_timeout = 20000)
PARENT_FILTER = "tags.mlflow.parentRunId IS NULL"  # pipeline runs (a stage run has its pipeline run as parent)
_PARENT_IS = re.compile(r"tags\.mlflow\.parentRunId = '([0-9a-f]{32})'")


def stage_runs_filter(run_id: str) -> str:
    """The search_runs filter of a pipeline run's stage runs (the other filter the reader answers)."""
    return f"tags.mlflow.parentRunId = '{run_id}'"


class RunNotFound(LookupError):
    """No run with this id in the store (MlflowClient raises an MlflowException there)."""


@dataclass
class Experiment:
    experiment_id: str
    name: str
    artifact_location: str
    lifecycle_stage: str


@dataclass
class RunInfo:
    run_id: str
    run_name: str
    experiment_id: str
    user_id: str
    status: str
    start_time: int | None
    end_time: int | None
    lifecycle_stage: str
    artifact_uri: str


@dataclass
class RunData:
    metrics: dict[str, float] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class Run:
    info: RunInfo
    data: RunData


@dataclass
class Metric:
    key: str
    value: float
    timestamp: int
    step: int


class Page(list):
    """A list of runs and the token of the next page (None: the last), as MLflow's PagedList."""

    def __init__(self, items, token: str | None = None):
        super().__init__(items)
        self.token = token


def reader_or_client(uri: str):
    """A StoreReader for a sqlite:/// store, else a retrying MlflowClient (tasks.lineage.retrying_client)."""
    if sqlite_path(uri):
        return StoreReader(uri)
    from tasks.lineage import retrying_client

    return retrying_client(uri)


class StoreReader:
    """The read-only MlflowClient calls of posttrain's commands, on a sqlite:/// MLflow store."""

    def __init__(self, uri: str):
        self.tracking_uri = uri
        self._path = sqlite_path(uri)
        self._client = None

    def __getattr__(self, name: str):
        """Anything else: a real MlflowClient's method (MLflow imported then)."""
        if name.startswith("_"):
            raise AttributeError(name)
        if self._client is None:
            from tasks.lineage import retrying_client

            self._client = retrying_client(self.tracking_uri)
        return getattr(self._client, name)

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        def read() -> list[tuple]:
            connection = sqlite3.connect(f"{Path(self._path).resolve().as_uri()}?mode=rw", uri=True,  # no new file
                                         timeout=BUSY_TIMEOUT_S)
            try:
                return connection.execute(sql, args).fetchall()
            finally:
                connection.close()

        return retry_busy(read, _store=self._path)

    def search_experiments(self) -> list[Experiment]:
        """The active experiments (MLflow's default view)."""
        rows = self._query("SELECT experiment_id, name, artifact_location, lifecycle_stage FROM experiments "
                           "WHERE lifecycle_stage = 'active' ORDER BY experiment_id")
        return [Experiment(str(i), name, location, stage) for i, name, location, stage in rows]

    def search_runs(self, experiment_ids: list[str], filter_string: str = "", max_results: int = 1000,
                    order_by: list[str] | None = None, page_token: str | None = None) -> Page:
        """Active runs of `experiment_ids` matching `filter_string` (the two filters above, or none), by start time
        (order_by: `attributes.start_time DESC` (the default) or `ASC`), then run id; pages of `max_results`."""
        direction = {(): "DESC", ("attributes.start_time DESC",): "DESC", ("attributes.start_time ASC",): "ASC"}
        order = tuple(order_by or ())
        if order not in direction:
            raise ValueError(f"StoreReader.search_runs: order_by {order_by} (start time only)")
        where, args = ["runs.lifecycle_stage = 'active'"], []
        where.append(f"runs.experiment_id IN ({', '.join('?' * len(experiment_ids))})")
        args += [int(i) for i in experiment_ids]
        parent = _PARENT_IS.fullmatch(filter_string.strip())
        if filter_string.strip() == PARENT_FILTER:
            where.append("NOT EXISTS (SELECT 1 FROM tags WHERE tags.run_uuid = runs.run_uuid "
                         "AND tags.key = 'mlflow.parentRunId')")
        elif parent:
            where.append("EXISTS (SELECT 1 FROM tags WHERE tags.run_uuid = runs.run_uuid "
                         "AND tags.key = 'mlflow.parentRunId' AND tags.value = ?)")
            args.append(parent[1])
        elif filter_string.strip():
            raise ValueError(f"StoreReader.search_runs: filter {filter_string!r} (parent run filters only)")
        offset = int(page_token or 0)
        rows = self._query(f"SELECT run_uuid FROM runs WHERE {' AND '.join(where)} ORDER BY "
                           f"runs.start_time IS NULL, runs.start_time {direction[order]}, runs.run_uuid "
                           "LIMIT ? OFFSET ?", (*args, max_results + 1, offset))
        ids = [row[0] for row in rows]
        token = str(offset + max_results) if len(ids) > max_results else None
        return Page(self._runs(ids[:max_results]), token)

    def get_run(self, run_id: str) -> Run:
        runs = self._runs([run_id])
        if not runs:
            raise RunNotFound(f"Run '{run_id}' not found in {self.tracking_uri}")
        return runs[0]

    def get_metric_history(self, run_id: str, key: str) -> list[Metric]:
        rows = self._query("SELECT key, value, timestamp, step, is_nan FROM metrics WHERE run_uuid = ? AND key = ? "
                           "ORDER BY timestamp, step, value", (run_id, key))
        return [Metric(k, float("nan") if is_nan else value, timestamp, step)
                for k, value, timestamp, step, is_nan in rows]

    def _runs(self, run_ids: list[str]) -> list[Run]:
        """Runs with their latest metrics, params and tags, in the order of `run_ids`."""
        if not run_ids:
            return []
        marks = ", ".join("?" * len(run_ids))
        infos = {row[0]: row for row in self._query(
            "SELECT run_uuid, name, experiment_id, user_id, status, start_time, end_time, lifecycle_stage, "
            f"artifact_uri FROM runs WHERE run_uuid IN ({marks})", tuple(run_ids))}
        data = {run_id: RunData() for run_id in infos}
        for run_id, key, value, is_nan in self._query(
                f"SELECT run_uuid, key, value, is_nan FROM latest_metrics WHERE run_uuid IN ({marks})",
                tuple(run_ids)):
            data[run_id].metrics[key] = float("nan") if is_nan else value
        for table in ("params", "tags"):  # RunData's fields of the same names
            for run_id, key, value in self._query(
                    f"SELECT run_uuid, key, value FROM {table} WHERE run_uuid IN ({marks})", tuple(run_ids)):
                getattr(data[run_id], table)[key] = value
        out = []
        for run_id in run_ids:
            if run_id not in infos:
                continue
            uuid, name, experiment_id, user, status, start, end, stage, artifact_uri = infos[run_id]
            name = name or data[run_id].tags.get("mlflow.runName", "")
            out.append(Run(RunInfo(uuid, name, str(experiment_id), user, status, start, end, stage, artifact_uri),
                           data[run_id]))
        return out
