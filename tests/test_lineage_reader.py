"""tasks/lineage_reader.py: the read-only commands' MLflow calls answered from the sqlite file without MLflow, call
for call as MlflowClient answers them on the same store."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.lineage_reader import Page, RunNotFound, StoreReader, reader_or_client

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two experiments (one deleted), pipeline runs with nested stage runs, metric histories with repeated steps
    and a NaN, params, tags, a run without a name column (named by its tag), a deleted run, equal start times."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    uri = f"sqlite:///{path}"
    client = MlflowClient(tracking_uri=uri)
    kept, gone = client.create_experiment("kept"), client.create_experiment("gone")
    parents = []
    for i in range(5):
        run = client.create_run(kept, run_name=f"run-{i}", start_time=1000 + (i // 2),  # pairs start together
                                tags={"posttrain.pid": str(i)})
        parents.append(run.info.run_id)
        client.log_batch(run.info.run_id, metrics=[Metric("eval/accuracy", 0.1 * s, 5000 + s, s) for s in range(3)]
                         + [Metric("eval/accuracy", 0.9, 4000, 1), Metric("train/loss", float("nan"), 6000, 0)],
                         params=[Param("grpo.rounds", "3"), Param("model.path", "/m")],
                         tags=[RunTag("posttrain.config_hash", f"h{i}")])
        for stage in ("sft", "score r0"):
            child = client.create_run(kept, run_name=stage, start_time=2000 + len(stage),
                                      tags={"mlflow.parentRunId": run.info.run_id, "posttrain.stage": stage})
            client.log_metric(child.info.run_id, "wall_time_s", 1.5)
            client.set_terminated(child.info.run_id, "FINISHED", end_time=3000)
        if i == 1:
            client.set_terminated(run.info.run_id, "FAILED", end_time=9000)
    deleted = client.create_run(kept, run_name="deleted")
    client.delete_run(deleted.info.run_id)
    client.create_run(gone, run_name="in-a-deleted-experiment")
    client.delete_experiment(gone)
    unnamed = client.create_run(kept, tags={"mlflow.runName": "from-the-tag"})
    return {"uri": uri, "client": client, "kept": kept, "parents": parents, "unnamed": unnamed.info.run_id}


def as_tuple(run) -> tuple:
    info, data = run.info, run.data
    metrics = {k: ("nan" if math.isnan(v) else v) for k, v in data.metrics.items()}
    return (info.run_id, info.run_name, info.experiment_id, info.user_id, info.status, info.start_time,
            info.end_time, info.lifecycle_stage, info.artifact_uri, metrics, dict(data.params), dict(data.tags))


def test_experiments_and_runs_as_mlflow_gives_them(store):
    reader, client = StoreReader(store["uri"]), store["client"]
    assert ({e.experiment_id: e.name for e in reader.search_experiments()}
            == {e.experiment_id: e.name for e in client.search_experiments()})
    ids = [e.experiment_id for e in client.search_experiments()]
    for filter_string in ("tags.mlflow.parentRunId IS NULL", f"tags.mlflow.parentRunId = '{store['parents'][2]}'",
                          ""):
        for order in (["attributes.start_time DESC"], ["attributes.start_time ASC"], None):
            got = reader.search_runs(ids, filter_string=filter_string, max_results=1000, order_by=order)
            expected = client.search_runs(ids, filter_string=filter_string, max_results=1000, order_by=order)
            assert [as_tuple(r) for r in got] == [as_tuple(r) for r in expected], (filter_string, order)
            assert got.token is None
    assert len(reader.search_runs(ids, "tags.mlflow.parentRunId IS NULL")) == 6  # 5 + the unnamed one
    for run_id in (*store["parents"], store["unnamed"]):
        assert as_tuple(reader.get_run(run_id)) == as_tuple(client.get_run(run_id))
        for key in ("eval/accuracy", "train/loss", "never-logged"):
            got = [(m.key, m.step, m.timestamp, "nan" if math.isnan(m.value) else m.value)
                   for m in reader.get_metric_history(run_id, key)]
            expected = [(m.key, m.step, m.timestamp, "nan" if math.isnan(m.value) else m.value)
                        for m in client.get_metric_history(run_id, key)]
            assert got == expected, key
    assert reader.get_run(store["unnamed"]).info.run_name == "from-the-tag"


def test_pages_follow_each_other_as_mlflows(store):
    reader, client = StoreReader(store["uri"]), store["client"]
    ids = [store["kept"]]
    got, expected, token, mlflow_token = [], [], None, None
    while True:
        page = reader.search_runs(ids, "tags.mlflow.parentRunId IS NULL", max_results=2,
                                  order_by=["attributes.start_time DESC"], page_token=token)
        assert isinstance(page, Page) and len(page) <= 2
        got += [r.info.run_id for r in page]
        token = page.token
        if token is None:
            break
    while True:
        page = client.search_runs(ids, "tags.mlflow.parentRunId IS NULL", max_results=2,
                                  order_by=["attributes.start_time DESC"], page_token=mlflow_token)
        expected += [r.info.run_id for r in page]
        mlflow_token = page.token
        if not mlflow_token:
            break
    assert got == expected and len(got) == 6


def test_unknown_run_other_calls_and_other_stores(store):
    reader = StoreReader(store["uri"])
    with pytest.raises(RunNotFound, match="f" * 32):
        reader.get_run("f" * 32)
    with pytest.raises(ValueError, match="parent run filters only"):
        reader.search_runs([store["kept"]], "metrics.loss > 1")
    assert reader.get_experiment_by_name("kept").experiment_id == store["kept"]  # MlflowClient's, on first use
    assert isinstance(reader_or_client(store["uri"]), StoreReader)
    assert not isinstance(reader_or_client("http://127.0.0.1:9"), StoreReader)  # a tracking server: MlflowClient


def test_the_read_only_commands_do_not_import_mlflow(store):
    """`posttrain runs` (and report, diff, trace, compare: the same open_client) in a process: no MLflow import."""
    artifacts = Path(store["uri"].removeprefix("sqlite:///")).parent
    check = ("import sys\nfrom flows.compare import runs_command\n"
             f"print(runs_command({str(artifacts)!r}))\n"
             "assert 'mlflow' not in sys.modules, 'imported mlflow'")
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(artifacts)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "run-4" in out.stdout and "from-the-tag" in out.stdout
