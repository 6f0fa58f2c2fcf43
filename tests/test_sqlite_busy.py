"""The SQLite stores under locks other processes hold (issue 25, item 5): an MLflow write waits out a lock
longer than MLflow's own busy timeout and succeeds; a lock that outlasts the bounded retry fails with an error
naming the database file; what `posttrain run` sets before Prefect starts its temporary server (analytics off,
more client retries, no forced offline hub) and that the server prints no telemetry error."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tasks import lineage as lineage_module
from tasks.lineage import Lineage, StoreBusyError, retry_busy

ROOT = Path(__file__).resolve().parents[1]
MLFLOW_BUSY_TIMEOUT_S = 20  # MLflow's `PRAGMA busy_timeout = 20000` in every session (mlflow/store/db/utils.py)


def hold_write_lock(db: Path, seconds: float) -> threading.Event:
    """Take an EXCLUSIVE lock on the sqlite file from another connection (as another process writing it would)
    and keep it for `seconds` in a thread; the returned event is set once the lock is held."""
    held = threading.Event()

    def hold() -> None:
        con = sqlite3.connect(db, timeout=30, isolation_level=None, check_same_thread=False)
        con.execute("BEGIN EXCLUSIVE")
        held.set()
        time.sleep(seconds)
        con.execute("ROLLBACK")
        con.close()

    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(30), f"could not lock {db}"
    return held


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A Lineage on a fresh sqlite store with an open parent run, and the store's file."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "artifacts"
    root.mkdir()
    config_yaml = tmp_path / "config.yaml"
    config_yaml.write_text("a: 1\n")
    lineage = Lineage(root, "busy")
    lineage.start("busy-run", {}, {"a": 1}, config_yaml)
    return lineage, root / "mlflow.db"


@pytest.mark.slow  # a whole run or process kill: `make test`, not `make test-fast`
def test_a_write_outlasts_a_lock_longer_than_mlflows_busy_timeout_then_a_stuck_lock_names_the_file(
        store, monkeypatch):
    lineage, db = store
    hold_write_lock(db, MLFLOW_BUSY_TIMEOUT_S + 6)
    started = time.monotonic()

    # past the bounded retry (shortened here): a clear error naming the store file, MLflow's error as its cause
    monkeypatch.setattr(lineage_module, "BUSY_RETRY_S", 1.0)
    with pytest.raises(StoreBusyError, match=f"MLflow store {db} stayed locked") as failed:
        lineage.log_metrics(lineage.parent_id, {"loss": 1.0}, step=1)
    assert "database is locked" in str(failed.value.__cause__)
    assert time.monotonic() - started < MLFLOW_BUSY_TIMEOUT_S + 6  # it gave up while the lock was still held

    # within the retry budget: the write waits until the lock is gone and succeeds
    monkeypatch.setattr(lineage_module, "BUSY_RETRY_S", 120.0)
    lineage.log_metrics(lineage.parent_id, {"loss": 0.5}, step=2)
    assert time.monotonic() - started >= MLFLOW_BUSY_TIMEOUT_S + 5  # it did wait for the lock
    lineage.finish()
    run = lineage.client.get_run(lineage.parent_id)
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in lineage.client.get_metric_history(run.info.run_id, "loss")] == [(2, 0.5)]


def test_retry_is_bounded_and_only_for_locks_and_insert_races():
    import sqlalchemy.exc

    def failing(errors: list[Exception]):
        calls = []

        def call(x):
            calls.append(x)
            if len(calls) <= len(errors):
                raise errors[len(calls) - 1]
            return x * 2

        return call, calls

    locked = sqlalchemy.exc.OperationalError("INSERT ...", {}, sqlite3.OperationalError("database is locked"))
    call, calls = failing([locked, locked, locked])
    assert retry_busy(call, 21, _store="/x/mlflow.db") == 42 and len(calls) == 4

    call, calls = failing([ValueError("not a lock")])
    with pytest.raises(ValueError):
        retry_busy(call, 1)
    assert len(calls) == 1  # anything else is raised at once

    call, calls = failing([locked] * 1000)
    started = time.monotonic()
    with pytest.raises(StoreBusyError, match="MLflow store /x/mlflow.db stayed locked"):
        retry_busy(call, 1, _store="/x/mlflow.db", _budget_s=2.0)
    assert time.monotonic() - started < 4 and 2 < len(calls) < 20


def test_the_read_only_commands_read_through_the_same_bounded_retry(store, monkeypatch):
    """`posttrain runs/compare/report/diff/trace` read the store (tasks/lineage_reader.py, without MLflow) while
    runs write it: a read waits out a writer's lock, and one that outlasts the bounded retry names the file."""
    from flows import compare
    from tasks import lineage_reader

    lineage, db = store
    client = compare.open_client(db.parent)
    assert isinstance(client, lineage_reader.StoreReader) and client._path == str(db)
    assert [r.info.run_name for r in compare.search_parent_runs(client)] == ["busy-run"]

    monkeypatch.setattr(lineage_reader, "BUSY_TIMEOUT_S", 0.2)  # sqlite's own wait per try, shortened here
    monkeypatch.setattr(lineage_module, "BUSY_RETRY_S", 1.0)
    hold_write_lock(db, 2.5)
    started = time.monotonic()
    with pytest.raises(StoreBusyError, match=f"MLflow store {db} stayed locked") as failed:
        compare.search_parent_runs(client)
    assert "database is locked" in str(failed.value.__cause__) and time.monotonic() - started < 2.5
    monkeypatch.setattr(lineage_module, "BUSY_RETRY_S", 60.0)
    assert [r.info.run_name for r in compare.search_parent_runs(client)] == ["busy-run"]  # once the lock is gone
    assert time.monotonic() - started >= 2


@pytest.mark.slow  # a whole run or process kill: `make test`, not `make test-fast`
def test_run_defaults_and_two_first_temporary_servers_print_no_error(tmp_path):
    """What `posttrain run` sets before Prefect loads, then two runs' temporary servers started at once on a new
    artifacts folder, up and idle for a while: one migrates the new database while the other waits (no
    "duplicate column name", no server that exits), no telemetry (neither "Failed to send telemetry" nor its
    database write) and no memo store under ~/.prefect."""
    script = f"""
import json, os, sys, time
sys.path.insert(0, {str(ROOT)!r})
for name in ("PREFECT_API_URL", "PREFECT_HOME", "HF_HUB_OFFLINE", "PREFECT_SERVER_ANALYTICS_ENABLED",
             "PREFECT_CLIENT_MAX_RETRIES", "PREFECT_MEMO_STORE_PATH"):
    os.environ.pop(name, None)
from flows.launch import embedded_defaults, start_temporary_prefect_server
embedded_defaults({str(tmp_path / 'artifacts')!r})
print(json.dumps({{k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "PREFECT_SERVER_ANALYTICS_ENABLED",
                                                  "PREFECT_CLIENT_MAX_RETRIES", "PREFECT_MEMO_STORE_PATH")}}), flush=True)
start_temporary_prefect_server()(timeout_s=150)
time.sleep(4)  # Prefect's telemetry service runs as soon as the server is up
"""
    starts = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path) for _ in range(2)]
    home = tmp_path / "artifacts" / "prefect"
    for start in starts:
        stdout, stderr = start.communicate(timeout=300)
        out = stdout + stderr
        assert start.returncode == 0, out[-4000:]
        settings = json.loads(stdout.splitlines()[0])
        assert settings == {"HF_HUB_OFFLINE": None,  # the hub is reachable unless the user says otherwise
                            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_CLIENT_MAX_RETRIES": "7",
                            "PREFECT_MEMO_STORE_PATH": str(home / "memo_store.toml")}
        for line in ("telemetry", "Application startup failed", "duplicate column", "database is locked",
                     "Unable to write to memo_store"):
            assert line.lower() not in out.lower(), out[-4000:]
    assert (home / "memo_store.toml").exists()  # the next start skips block registration
    assert list(home.glob(".server-ready-*"))  # and takes no lock
