"""MLflow lineage behind a narrow interface.

MLflow's active run is per-thread and Prefect runs tasks in worker threads, so every
call here takes a run id explicitly and goes through `MlflowClient`; nothing relies on
the fluent active run. Default store: sqlite:///<artifacts>/mlflow.db, unless
MLFLOW_TRACKING_URI is set.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the read-only commands read the store without MLflow (lineage_reader.py)
    from mlflow import MlflowClient

MAX_PARAM_LEN = 6000
MAX_METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch request


# The MLflow UI opens an experiment in the view its kind names: its runs, metric charts and models ("Model
# training"), not the GenAI traces view it infers for an experiment without the tag.
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
CODE_ARTIFACTS, CODE_TAG_PREFIX = "code", "code."  # a run's user code: its source files, each module's digest


def tracking_uri(artifacts_root: Path) -> str:
    """The MLflow store in use: MLFLOW_TRACKING_URI, else the sqlite file under artifacts/."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{artifacts_root / 'mlflow.db'}"


def store_lock(uri: str):
    """A context manager serializing, across processes, a process's first calls on a sqlite store.

    MLflow creates a missing store's tables on the first call, and two processes doing it at once
    break the schema ("table latest_metrics already exists", alembic "expected to match one row");
    two get-or-create of one experiment race the same way. Hold this around both (the lock file is
    `<db>.lock` beside the database). Concurrent writes after that need nothing: MLflow sets
    `PRAGMA busy_timeout = 20000` on every session. Other stores: no lock."""
    from contextlib import nullcontext

    from tasks.store import key_lock

    path = sqlite_path(uri)
    if not path:
        return nullcontext()
    return key_lock(Path(f"{path}.lock"), f"MLflow store {path}")


def sqlite_path(uri: str) -> str:
    """The database file of a sqlite:/// URI; "" for other stores (and in-memory sqlite)."""
    path = uri.removeprefix("sqlite:///").split("?")[0] if uri.startswith("sqlite:///") else ""
    return "" if path == ":memory:" else path


def create_store_whole(uri: str) -> None:
    """Create a missing sqlite store in `<db>.creating` and rename it into place, so a process killed
    while MLflow creates its tables leaves no half-made database (the next one would fail on it with
    "table ... already exists"). The tables come from a copy of `empty_store_template` where one can be kept;
    MLflow's first client on the store adds its Default experiment, as on a store it made. Call under
    `store_lock`."""
    path = sqlite_path(uri)
    if not path or Path(path).exists():
        return
    creating = Path(f"{path}.creating")
    creating.unlink(missing_ok=True)  # left by a process killed while creating it
    try:
        template = empty_store_template()
        if template is not None:
            shutil.copyfile(template, creating)
        else:
            make_tables(creating)
        os.replace(creating, path)
    except Exception as e:
        raise_if_refused(e, path)
        raise


def make_tables(db: Path) -> None:
    """MLflow's tables in a new sqlite file `db`, by its own migrations (~2-4 s of CPU)."""
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments(max_results=1)


def cache_dir() -> Path:
    """posttrain's cache of things any run can reuse: $XDG_CACHE_HOME/posttrain, else ~/.cache/posttrain."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "posttrain"


def empty_store_template() -> Path | None:
    """An MLflow sqlite store with every table of the installed MLflow's schema and no experiment, made once per
    MLflow version in `cache_dir()` (written whole: a temporary file renamed into place), so each new artifacts
    folder copies it instead of running MLflow's ~60 migrations again. None where it cannot be kept (a read-only
    home, say): the caller creates the tables itself."""
    import sqlite3
    from importlib.metadata import version

    template = cache_dir() / f"mlflow-{version('mlflow')}-empty.db"
    if template.is_file():
        try:
            with contextlib.closing(sqlite3.connect(f"file:{template}?mode=ro", uri=True)) as db:
                if db.execute("SELECT count(*) FROM alembic_version").fetchone()[0] == 1:
                    return template
        except sqlite3.Error:
            pass  # not a store (damaged by hand): made again below
    making = template.with_name(f"{template.name}.{os.getpid()}.tmp")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        making.unlink(missing_ok=True)
        make_tables(making)
        with contextlib.closing(sqlite3.connect(making)) as db, db:  # the Default experiment is the store's own
            db.execute("DELETE FROM experiments WHERE experiment_id = 0")
        os.replace(making, template)
        return template
    except Exception:  # noqa: BLE001 - a cache that cannot be written is no error: the store is made in place
        making.unlink(missing_ok=True)
        return None


BUSY_RETRY_S = 180.0
"""How long an MLflow call keeps retrying while other processes hold the sqlite store's lock, before it fails
with StoreBusyError. Each try also waits inside sqlite (MLflow's busy timeout: 20 s in its sessions, 5 s on a
new client's first schema check), so a call gives up after at most about BUSY_RETRY_S + 20 s."""


class StoreBusyError(RuntimeError):
    """An MLflow store that other processes kept locked past the bounded retry; the message names the file."""


STORE_REFUSED = ("What was logged before is kept: free space (or make the folder writable), then run the same "
                 "command again or `posttrain resume RUN` (finished stages are reused).")


def raise_if_refused(e: BaseException, store: str) -> None:
    """Raise StorageError naming the store (or the file an artifact upload could not write) if `e` is the disk
    refusing a write: sqlite's "database or disk is full" or "readonly database" (an MlflowException or a
    SQLAlchemy error around sqlite3's), or an OSError such as ENOSPC (tasks/store.py `refused_write`)."""
    from tasks.store import StorageError, refused_write

    refused = refused_write(e)
    if refused is not None:
        raise StorageError("MLflow", store or "its store", refused, STORE_REFUSED) from e


def store_locked(e: BaseException) -> bool:
    """Whether `e` is sqlite's "database is locked" (SQLITE_BUSY), as MLflow raises it (an MlflowException with
    the sqlalchemy error as its message, or the sqlalchemy error itself from a new client's schema check)."""
    return "database is locked" in str(e)


class _RetriedLockLog(logging.Filter):
    """Drops MLflow's own traceback log of a "database is locked" error (mlflow.store.db.utils logs each one
    with `_logger.exception` before raising it): `retry_busy` retries it, and a lock that outlasts the retries
    is raised as StoreBusyError with that error as its cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        from tasks.store import DISK_MESSAGES

        message = record.getMessage()  # a full or read-only disk: raised as StorageError (`raise_if_refused`)
        return "database is locked" not in message and not any(words in message for words in DISK_MESSAGES)


_RETRIED_LOCK_LOG = _RetriedLockLog()  # (and of a full or read-only disk's error, raised as StorageError)
logging.getLogger("mlflow.store.db.utils").addFilter(_RETRIED_LOCK_LOG)  # also before the first retry_busy


def retry_busy(call, *args, _store: str = "", _budget_s: float | None = None, **kwargs):
    """call(*args, **kwargs), repeated with jittered backoff (0.1 s doubling, at most 5 s) while it fails only
    because another process writes the same store: sqlite's "database is locked" (past the busy timeout, or at
    once where waiting could deadlock), or a UNIQUE constraint that a concurrent insert of the same row won
    (MLflow's log_inputs looks the dataset up, then inserts it). The failed call's transaction was rolled back,
    so repeating it is safe. Bounded: after `_budget_s` (default BUSY_RETRY_S) seconds a lock raises
    StoreBusyError naming `_store` (the database file); a UNIQUE conflict re-raises after 8 tries. A disk that
    refuses the write (full, read-only) raises StorageError naming `_store` at once."""
    import random

    budget_s = BUSY_RETRY_S if _budget_s is None else _budget_s
    logging.getLogger("mlflow.store.db.utils").addFilter(_RETRIED_LOCK_LOG)  # once: a filter is added once
    started = time.monotonic()
    for attempt in range(1000):  # ends by time (locks) or after 8 tries (conflicts) well before that
        try:
            return call(*args, **kwargs)
        except Exception as e:
            raise_if_refused(e, _store)
            locked = store_locked(e)
            conflict = getattr(e, "error_code", "") in ("TEMPORARILY_UNAVAILABLE", "BAD_REQUEST") and (
                "UNIQUE constraint failed" in str(e))
            delay = min(5.0, 0.1 * 2**attempt) * random.uniform(0.5, 1.5)
            elapsed = time.monotonic() - started
            if locked and elapsed + delay > budget_s:
                what = getattr(call, "__name__", "an MLflow call")
                raise StoreBusyError(
                    f"MLflow store {_store or 'in use'} stayed locked by other processes for {elapsed:.0f} s "
                    f"({attempt + 1} tries of {what}): other runs in this artifacts folder, an `mlflow ui` or "
                    "`mlflow server` on it, or a sqlite3 shell holding a transaction. Nothing computed is lost: "
                    "run the same command again (finished stages are cached) or `posttrain resume RUN`; for "
                    "many runs at once, point MLFLOW_TRACKING_URI at a database server.") from e
            if not (locked or (conflict and attempt < 7)):
                raise
            time.sleep(delay)
    raise AssertionError("not reached")


class RetryingClient:
    """An MlflowClient whose every method call goes through `retry_busy` (errors name its sqlite file)."""

    def __init__(self, client: MlflowClient):
        self._client = client
        self._store = sqlite_path(client.tracking_uri) or client.tracking_uri

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr
        return lambda *args, **kwargs: retry_busy(attr, *args, _store=self._store, **kwargs)


def retrying_client(uri: str) -> RetryingClient:
    """A RetryingClient on a tracking store (and the same registry store), for reads and writes outside a run."""
    from mlflow import MlflowClient

    return RetryingClient(MlflowClient(tracking_uri=uri, registry_uri=uri))


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


def process_alive(pid: str) -> bool:
    """Whether the process that opened a run (tag posttrain.pid, this host) still runs."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def find_run(client: MlflowClient, ref: str):
    """A pipeline run by run name, MLflow run id or Prefect flow-run id; error naming a few known runs."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    for condition in (f"attributes.run_name = '{ref}'", f"tags.`prefect.flow_run_id` = '{ref}'"):
        found = [r for r in client.search_runs(experiments, condition, order_by=["attributes.start_time DESC"])
                 if "mlflow.parentRunId" not in r.data.tags]
        if found:
            return found[0]
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(ref)
    except MlflowException:  # no such run id (a StoreBusyError is not this)
        known = [r.info.run_name for r in client.search_runs(experiments, "", max_results=50,
                                                             order_by=["attributes.start_time DESC"])
                 if "mlflow.parentRunId" not in r.data.tags][:5]
        raise LookupError(f"no pipeline run named {ref!r} (run name, MLflow run id or Prefect flow-run id) in "
                          f"{client.tracking_uri}; newest runs: {', '.join(known) or 'none'}") from None


class Lineage:
    """One pipeline run in MLflow: a parent run and nested runs per stage."""

    def __init__(self, artifacts_root: Path, experiment: str):
        self.artifacts_root = artifacts_root
        self.uri = tracking_uri(artifacts_root)
        with store_lock(self.uri):  # one process at a time creates a fresh store's tables and the experiment
            create_store_whole(self.uri)
            self.client = retrying_client(self.uri)
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                location = None
                if self.uri.startswith("sqlite:") and not os.environ.get("MLFLOW_TRACKING_URI"):
                    location = (artifacts_root / "mlruns").as_uri()
                self.experiment_id = self.client.create_experiment(
                    experiment, artifact_location=location, tags={EXPERIMENT_KIND: MODEL_TRAINING})
            else:
                self.experiment_id = found.experiment_id
                if EXPERIMENT_KIND not in found.tags:  # made by an older posttrain, or by hand
                    self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
        self.parent_id: str | None = None
        self._logged: set[tuple[str, int]] = set()  # (metric, step) the parent had before a resume

    def log_code(self, run_id: str, functions: list[str]) -> dict[str, str]:
        """The source of the user code a run calls (reward functions, transforms, rollout_func): each local module
        of each `module.fn` (and the local modules it imports) as artifacts under code/, and each named module's
        digest as tag `code.<module>` (what `posttrain compare` diffs). Installed packages are not logged.
        Returns {module: digest}."""
        from stages.runtime.imports import local_modules, source_digest

        digests: dict[str, str] = {}
        files: dict[str, str] = {}  # module name -> file, each logged once (two modules may import a third)
        for module in dict.fromkeys(name.rpartition(".")[0] for name in functions):
            digest = source_digest(module)
            if digest is None:
                continue
            digests[module] = digest
            files.update(local_modules(module))
        for name, path in files.items():
            relative = Path(*name.split("."))
            folder = relative if Path(path).name == "__init__.py" else relative.parent
            self.client.log_artifact(run_id, str(path), artifact_path=str(Path(CODE_ARTIFACTS) / folder))
        if digests:
            self.set_tags(run_id, {f"{CODE_TAG_PREFIX}{module}": digest for module, digest in digests.items()})
        return digests

    def start(self, run_name: str, tags: dict[str, str], config: dict, config_yaml: Path) -> str:
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        self.parent_id = run.info.run_id
        self._log_config(run, config, config_yaml)
        return self.parent_id

    def _log_config(self, run, config: dict, config_yaml: Path) -> None:
        """The config as params and as the config.yaml artifact; what the run has already is not logged again
        (a process killed in between left the rest)."""
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flatten(config).items() if k not in run.data.params]
        for i in range(0, len(params), 100):
            self.client.log_batch(run.info.run_id, params=params[i : i + 100])
        if not any(f.path == config_yaml.name for f in self.client.list_artifacts(run.info.run_id)):
            self.client.log_artifact(run.info.run_id, str(config_yaml))

    def resume(self, run_id: str, config: dict, config_yaml: Path) -> None:
        """Continue an unfinished parent run: RUNNING again, tagged `posttrain.resumed`, its nested
        stage runs left RUNNING by a killed process marked KILLED, params and config.yaml a kill cut off
        logged, and every (metric, step) it already has skipped by `log_metrics` (cached rounds are not
        logged twice)."""
        run = self.client.get_run(run_id)
        self.parent_id = run_id
        self._log_config(run, config, config_yaml)
        self._logged = {(key, m.step) for key in run.data.metrics
                        for m in self.client.get_metric_history(run_id, key)}
        count = int(run.data.tags.get("posttrain.resume_count", "0")) + 1
        self.client.update_run(run_id, status="RUNNING")
        self.set_tags(run_id, {"posttrain.resumed": "true", "posttrain.resume_count": count,
                               "posttrain.pid": os.getpid()})
        for child in self.client.search_runs([self.experiment_id],
                                             f"tags.mlflow.parentRunId = '{run_id}' and attributes.status = 'RUNNING'"):
            self.client.set_terminated(child.info.run_id, status="KILLED")

    def unfinished_run(self, config_hash: str, flow_run_id: str = "") -> str | None:
        """The parent run a new start of the same pipeline should continue, or None: the one this
        Prefect flow run already opened (a `prefect flow-run retry`), else the newest run of the same
        config (hash) that failed or whose process died without finishing it."""
        runs = self.client.search_runs([self.experiment_id], f"tags.config_hash = '{config_hash}'",
                                       order_by=["attributes.start_time DESC"], max_results=20)
        runs = [r for r in runs if "mlflow.parentRunId" not in r.data.tags
                and r.data.tags.get("posttrain.purpose", "train") == "train"]
        for run in runs:
            if flow_run_id and run.data.tags.get("prefect.flow_run_id") == flow_run_id:
                return run.info.run_id
        for run in runs:
            if run.info.status == "FINISHED":
                return None  # the newest attempt finished: a rerun is a new run (that computes nothing)
            if run.info.status == "FAILED" or not process_alive(run.data.tags.get("posttrain.pid", "")):
                return run.info.run_id
        return None

    def already_logged(self, metric: str, step: int) -> bool:
        """Whether the parent run had this (metric, step) before it was resumed."""
        return (metric, step) in self._logged

    def finish(self, status: str = "FINISHED") -> None:
        """Mark the parent run ended. A failed run's mark that the disk refuses is skipped with a log line, so
        the error the run failed with is the one shown (the run stays resumable: its process is gone)."""
        from tasks.store import StorageError

        if self.parent_id:
            try:
                self.client.set_terminated(self.parent_id, status=status)
            except StorageError as e:
                if status == "FINISHED":
                    raise
                logging.getLogger(__name__).warning("could not mark run %s %s: %s", self.parent_id, status, e)

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        self.log_metric_steps(run_id, [(metrics, step)])

    def log_metric_steps(self, run_id: str, steps: list[tuple[dict[str, float], int]]) -> None:
        """Log (metrics, step) pairs in as few requests as MLflow allows (1000 metrics per batch)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for metrics, step in steps for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not (run_id == self.parent_id and (k, step) in self._logged)]
        for start in range(0, len(batch), MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=batch[start : start + MAX_METRICS_PER_BATCH])

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def stage_run(self, stage: str, key: str, config: dict, inputs: dict[str, str],
                  tags: dict[str, str] | None = None) -> str:
        """A nested run under the parent for one stage: computed, or read from the cache (`tags`
        posttrain.cached: true, tasks/stage_tasks.py `record_cached`)."""
        from mlflow.entities import Param

        run = self.client.create_run(
            self.experiment_id,
            run_name=stage,
            tags={"mlflow.parentRunId": self.parent_id, "posttrain.stage": stage, "posttrain.artifact_key": key,
                  **{f"posttrain.input.{k}": v for k, v in inputs.items()}, **(tags or {})},
        )
        params = [Param(k, v) for k, v in flatten(config).items()][:100]
        if params:
            self.client.log_batch(run.info.run_id, params=params)
        return run.info.run_id

    def log_dataset(self, run_id: str, name: str, path: Path, digest: str, context: str, rows: int) -> None:
        """Record a Parquet file as a dataset input, carrying its sha256 digest."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        dataset = Dataset(name=name, digest=digest[:36], source_type="local", source=json.dumps({"uri": str(path)}),
                          profile=json.dumps({"num_rows": rows}))
        self.client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])])

    def register_model(self, run_id: str, folder: Path, name: str) -> str:
        """Log the exported folder under the run and register it; returns the model version."""
        from mlflow.exceptions import MlflowException

        self.client.log_artifacts(run_id, str(folder), artifact_path="model")
        try:
            self.client.create_registered_model(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":  # registered before (by this or another run): fine
                raise
        source = f"{self.client.get_run(run_id).info.artifact_uri}/model"
        version = self.client.create_model_version(name, source=source, run_id=run_id,
                                                   description="merged policy exported by posttrain")
        return version.version

    def version_by_alias(self, name: str, alias: str):
        """The registered model version carrying `alias` (e.g. champion), or None when there is none yet."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version_by_alias(name, alias)
        except MlflowException as e:
            if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):  # no such model / alias
                return None
            raise

    def set_alias(self, name: str, alias: str, version: str, tags: dict[str, str] | None = None) -> None:
        """Point `alias` at this model version (MLflow moves it off any other version), and tag the version."""
        self.client.set_registered_model_alias(name, alias, str(version))
        for key, value in (tags or {}).items():
            self.client.set_model_version_tag(name, str(version), key, str(value))
