"""Two runs on one artifacts folder at the same time, with real processes: a (stage, key) is
computed once and the other run reuses it, a writer killed holding the lock leaves nothing
that is read, and several processes write one MLflow sqlite store without errors."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

KEY = "0123456789abcdef0123"
SPAWN = multiprocessing.get_context("spawn")


def _write(root: str, counter: str, text: str, sleep_s: float, barrier, queue, marker: str = "") -> None:
    """A child process: write stage "s", key KEY with a produce that logs itself to `counter`."""
    from tasks.store import ArtifactStore

    def produce(out: Path) -> dict:
        with open(counter, "a") as f:
            f.write(f"{text}\n")
        (out / "data.txt").write_text("half")
        if marker:
            Path(marker).touch()
        time.sleep(sleep_s)
        (out / "data.txt").write_text(text)
        return {"writer": text}

    try:
        if barrier is not None:
            barrier.wait(60)
        art = ArtifactStore(root).write("s", KEY, produce, inputs={}, config={})
        queue.put(("ok", text, str(art.path), art.reused, art.manifest))
    except BaseException:
        queue.put(("error", text, traceback.format_exc(), None, None))


def _results(queue, n: int) -> list[tuple]:
    results = [queue.get(timeout=60) for _ in range(n)]
    errors = [r[2] for r in results if r[0] == "error"]
    assert not errors, "\n".join(errors)
    return results


def test_two_processes_compute_one_key_once(tmp_path):
    root, counter = tmp_path / "artifacts", tmp_path / "produced.txt"
    barrier, queue = SPAWN.Barrier(2), SPAWN.Queue()
    procs = [SPAWN.Process(target=_write, args=(str(root), str(counter), name, 1.0, barrier, queue))
             for name in ("A", "B")]
    for p in procs:
        p.start()
    results = _results(queue, 2)
    for p in procs:
        p.join(30)

    assert len(counter.read_text().split()) == 1  # produce ran once in total
    (_, _, path_1, reused_1, manifest_1), (_, _, path_2, reused_2, manifest_2) = results
    assert path_1 == path_2 and manifest_1 == manifest_2
    assert sorted([reused_1, reused_2]) == [False, True]
    from tasks.store import ArtifactStore

    art = ArtifactStore(root).get("s", KEY)
    assert art is not None and art.manifest == manifest_1
    assert (art.path / "data.txt").read_text() == manifest_1["summary"]["writer"]
    assert not list((root / "s").glob(".tmp-*"))


def _waiting_on(lock: Path, timeout_s: float) -> bool:
    """Whether some process is blocked on `lock` (a `->` line for its inode in /proc/locks)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        inode = f":{os.stat(lock).st_ino} "
        if any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines()):
            return True
        time.sleep(0.05)
    return False


def test_writer_killed_holding_the_lock(tmp_path):
    """A is SIGKILLed mid-produce while B waits for the key: B computes it, and A's half-written
    temp folder is neither read nor left behind."""
    root, counter, marker = tmp_path / "artifacts", tmp_path / "produced.txt", tmp_path / "a-started"
    queue = SPAWN.Queue()
    a = SPAWN.Process(target=_write, args=(str(root), str(counter), "A", 120.0, None, queue, str(marker)))
    a.start()
    deadline = time.time() + 30
    while not marker.exists():
        assert a.is_alive() and time.time() < deadline, "writer A never reached produce"
        time.sleep(0.05)
    assert [p.name for p in (root / "s").iterdir() if p.name.startswith(".tmp-")]  # A's half-written folder

    b = SPAWN.Process(target=_write, args=(str(root), str(counter), "B", 0.0, None, queue))
    b.start()
    assert _waiting_on(root / ".locks" / "s" / f"{KEY}.lock", 30), "B never blocked on A's lock"
    a.kill()
    a.join(10)
    (_, name, path, reused, manifest), = _results(queue, 1)
    b.join(30)

    assert name == "B" and not reused and manifest["summary"] == {"writer": "B"}
    assert counter.read_text().split() == ["A", "B"]  # A started, B recomputed
    assert (Path(path) / "data.txt").read_text() == "B"
    from tasks.store import ArtifactStore

    assert ArtifactStore(root).get("s", KEY).manifest == manifest
    assert not list((root / "s").glob(".tmp-*"))


def _hammer(root: str, config_yaml: str, runs: int, steps: int, barrier, queue, lock_first_use: bool) -> None:
    """A child process: a pipeline-like MLflow load through Lineage (parent run, nested runs, metrics)."""
    try:
        from tasks.lineage import Lineage, store_lock, tracking_uri

        barrier.wait(60)
        if lock_first_use:
            with store_lock(tracking_uri(Path(root))):
                lineage = Lineage(Path(root), "stress")
        else:
            lineage = Lineage(Path(root), "stress")
        parent = lineage.start(f"stress-{os.getpid()}", {"posttrain.pid": str(os.getpid())},
                               {"a": {"b": 1}, "c": [1, 2]}, Path(config_yaml))
        for i in range(runs):
            run_id = lineage.stage_run(f"stage {i}", f"key{i}", {"lr": 0.1, "i": i}, {"prompts": "transform/x"})
            for step in range(steps):
                lineage.log_metrics(run_id, {"loss": 1.0 / (step + 1), "reward": step}, step)
                lineage.log_metrics(parent, {"round/reward": step}, i * steps + step)
            lineage.set_tags(run_id, {"posttrain.done": "yes"})
            lineage.client.set_terminated(run_id)
        lineage.finish()
        queue.put(("ok", parent, None, None, None))
    except BaseException:
        queue.put(("error", None, traceback.format_exc(), None, None))


def hammer_one_store(tmp_path, monkeypatch, lock_first_use: bool, procs: int = 4, runs: int = 3, steps: int = 3):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "artifacts"
    root.mkdir()
    config_yaml = tmp_path / "config.yaml"
    config_yaml.write_text("a: {b: 1}\n")
    barrier, queue = SPAWN.Barrier(procs), SPAWN.Queue()
    children = [SPAWN.Process(target=_hammer, args=(str(root), str(config_yaml), runs, steps, barrier, queue,
                                                    lock_first_use)) for _ in range(procs)]
    for p in children:
        p.start()
    try:
        results = [queue.get(timeout=180) for _ in children]
    finally:
        for p in children:
            p.join(30)
    errors = [r[2] for r in results if r[0] == "error"]
    assert not errors, f"{len(errors)} of {procs} processes failed:\n" + "\n".join(errors)

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("stress").experiment_id
    for parent in (r[1] for r in results):
        assert client.get_run(parent).info.status == "FINISHED"
        assert len(client.get_metric_history(parent, "round/reward")) == runs * steps
        children_runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
        assert len(children_runs) == runs
        for child in children_runs:
            assert child.info.status == "FINISHED" and child.data.tags["posttrain.done"] == "yes"
            assert len(client.get_metric_history(child.info.run_id, "loss")) == steps


@pytest.mark.slow  # a whole run or process kill: `make test`, not `make test-fast`
def test_four_processes_write_one_mlflow_store(tmp_path, monkeypatch):
    """Fresh store, first use under `store_lock`, then 4 processes write at once: no 'database is
    locked' (MLflow's 20 s sqlite busy timeout covers it) and nothing lost."""
    hammer_one_store(tmp_path, monkeypatch, lock_first_use=True)


# These two need Lineage.__init__ to create its client and experiment inside `store_lock` (client wrapped in
# RetryingClient), materialize to report `cached=artifact.reused`, and open_run to give two runs started
# in the same second different run folders; without them they fail most of the time (they are races).


@pytest.mark.slow
def test_four_lineages_start_on_a_fresh_store(tmp_path, monkeypatch):
    """Plain Lineage() in 4 processes at once on a fresh store: its tables and experiment are created once."""
    hammer_one_store(tmp_path, monkeypatch, lock_first_use=False, runs=1, steps=1)


@pytest.mark.slow
def test_two_pipeline_runs_on_one_artifacts_folder(tmp_path, tiny_config_text, monkeypatch, harness_api_url):
    """Two `posttrain run` of one config, started together on one artifacts folder: both finish,
    and every stage key was computed by exactly one of them. Both on the session's Prefect server (two first
    runs each starting a temporary server: tests/test_sqlite_busy.py)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PREFECT_API_URL", harness_api_url)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    config = tmp_path / "tiny.yaml"
    config.write_text(tiny_config_text)
    posttrain = Path(sys.executable).with_name("posttrain")
    runs = [subprocess.Popen([str(posttrain), "run", str(config), "--quiet"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=tmp_path) for _ in range(2)]
    outputs = [p.communicate(timeout=900)[0] for p in runs]
    for p, out in zip(runs, outputs):
        assert p.returncode == 0, out[-6000:]

    root = tmp_path / "artifacts"
    summaries = [json.loads(f.read_text()) for f in sorted((root / "runs").glob("*/summary.json"))]
    assert len(summaries) == 2
    status: dict[str, list[str]] = {}
    for summary in summaries:
        for row in summary["stages"]:
            status.setdefault(row["path"], []).append(row["status"])
    assert all(len(s) == 2 for s in status.values())  # both runs went through the same folders
    computed_twice = [path for path, s in status.items() if s.count("computed") != 1]
    assert not computed_twice, f"computed by both runs or by neither: {computed_twice}"
    assert not list(root.glob("*/.tmp-*"))
