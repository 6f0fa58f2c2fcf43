"""Resume: a run stopped mid-round by SIGINT (Ctrl-C), SIGTERM or SIGKILL finishes with the same metrics and
the same exported bytes as an uninterrupted run, in the same MLflow parent run, with no round logged, costed or traced
twice. Real `posttrain` processes, real signals; SIGINT and SIGTERM are answered with one line saying how to resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from conftest import copy_warm_stages

pytestmark = pytest.mark.slow

POSTTRAIN = str(Path(sys.executable).parent / "posttrain")
ROUNDS = 4


API_URL = ""  # the session's Prefect server (conftest.harness_api_url), set by the test


def own_env(artifacts: Path) -> dict:
    """The session's Prefect server (as a `posttrain server` user's runs have one; tests/test_atropos.py kills and
    resumes runs on their own temporary servers), a Prefect home per artifacts folder, MLflow under it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_TRACKING"))}
    return {**env, "PREFECT_HOME": str(artifacts / "prefect"), "PREFECT_API_URL": API_URL}


def posttrain(*args: str, env_root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([POSTTRAIN, *args], capture_output=True, text=True, timeout=600, env=own_env(env_root))


def run_until(artifacts: Path, stage: str, finished_rounds: int, *args: str, sig=signal.SIGKILL,
              group: bool = True) -> tuple[int, str]:
    """Start `posttrain` and send `sig` to its whole process group (as Ctrl-C does; else to it alone, as `kill`
    does) while `stage` is being written (its temp folder exists) once `finished_rounds` optimize rounds are
    done: (its exit code, its stdout and stderr)."""
    log = artifacts.parent / f"killed-{stage}-{finished_rounds}.log"
    process = subprocess.Popen([POSTTRAIN, *args], stdout=open(log, "w"),
                               stderr=subprocess.STDOUT, start_new_session=True, env=own_env(artifacts))
    deadline = time.time() + 300
    while (len(list((artifacts / "optimize").glob("*/_manifest.json"))) < finished_rounds
           or not list((artifacts / stage).glob(".tmp-*"))):
        assert process.poll() is None, f"finished before the kill: {log.read_text()[-2000:]}"
        assert time.time() < deadline, "no progress"
        time.sleep(0.01)
    (os.killpg if group else os.kill)(process.pid, sig)
    process.wait(timeout=120)
    time.sleep(1.0)  # what its workers still print once it is gone
    return process.returncode, log.read_text()


def check_stopped(code: int, output: str, sig: int, run_name: str, artifacts: Path) -> None:
    """SIGINT/SIGTERM: exit 128 + the signal, one line saying how to resume, no traceback (of the flow or of its
    reward workers)."""
    assert code == 128 + sig, output[-3000:]
    lines = [line for line in output.splitlines() if "resume with" in line]
    assert lines == [f"stopped by {signal.Signals(sig).name}; resume with: posttrain resume {run_name} "
                     f"--artifacts {artifacts}"], output[-3000:]
    for noise in ("Traceback", "EOFError", "KeyboardInterrupt", "Crash detected"):
        assert noise not in output, output[-3000:]


def exported_files(summary: dict) -> dict[str, bytes]:
    """The exported model's files, less the manifest (its times) and the model card (its artifacts folder)."""
    folder = Path(summary["exported_model"])
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if p.is_file() and p.name not in ("_manifest.json", "README.md")}


def parent_runs(client: MlflowClient, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    return [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]


def history(client: MlflowClient, run_id: str, name: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))


@pytest.fixture
def environ_restored():
    """os.environ as it was before the test, after it: an in-process `posttrain run` sets library defaults
    there (flows/launch.py embedded_defaults) that would stay for the worker's later tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_killed_run_resumes_to_the_same_result(tiny_config_text, tiny_warm_store, tmp_path, harness_api_url,
                                               environ_restored, monkeypatch, capsys):
    monkeypatch.setitem(globals(), "API_URL", harness_api_url)
    config = tmp_path / "tiny.yaml"
    config.write_text(tiny_config_text)
    common = [f"grpo.rounds={ROUNDS}", "--quiet"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for artifacts in (straight, killed):  # both start after SFT; the kills come in the rounds and the export
        copy_warm_stages(tiny_warm_store, artifacts)

    from flows.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # each run's MLflow store in its artifacts folder
    # the in-process runs use the session's server too: without PREFECT_API_URL `posttrain run` would start a
    # temporary one that lives as long as this pytest worker
    monkeypatch.setenv("PREFECT_API_URL", harness_api_url)
    assert main(["run", str(config), f"artifacts_dir={straight}", *common]) == 0  # uninterrupted, in this process

    args = ["run", str(config), f"artifacts_dir={killed}", *common]
    code, output = run_until(killed, "rollout", 1, *args, sig=signal.SIGINT)  # Ctrl-C while round 1 samples
    (run_name,) = [p.name for p in (killed / "runs").iterdir()]
    check_stopped(code, output, signal.SIGINT, run_name, killed)

    # a resume with another config is refused, naming the key (in this process: a refusal needs no signal)
    capsys.readouterr()
    assert main(["resume", run_name, "--artifacts", str(killed), "grpo.learning_rate=0.5"]) == 2
    refused = capsys.readouterr().err
    assert "grpo.learning_rate" in refused, refused[-2000:]

    resume = ["resume", run_name, "--artifacts", str(killed), "--quiet"]
    code, output = run_until(killed, "score", 2, *resume, sig=signal.SIGTERM, group=False)  # `kill` mid-score r2
    check_stopped(code, output, signal.SIGTERM, run_name, killed)
    _, output = run_until(killed, "export", ROUNDS, *args)  # the same command again; killed while exporting
    assert f"continuing run {run_name} (its last attempt failed)" in output, output[-3000:]  # says so, once
    assert output.count("continuing run") == 1
    again = posttrain(*resume, env_root=killed)
    assert again.returncode == 0, again.stderr[-3000:]

    a = json.loads(next((straight / "runs").glob("*/summary.json")).read_text())
    b = json.loads((killed / "runs" / run_name / "summary.json").read_text())
    assert b["final_accuracy"] == a["final_accuracy"] and b["base_accuracy"] == a["base_accuracy"]
    assert [s["status"] for s in b["stages"] if s["stage"] == "optimize r0"] == ["cached"]
    assert exported_files(b) == exported_files(a) and "model.safetensors" in exported_files(a)  # byte for byte

    client_a = MlflowClient(f"sqlite:///{straight / 'mlflow.db'}")
    client_b = MlflowClient(f"sqlite:///{killed / 'mlflow.db'}")
    (run_a,), (run_b,) = parent_runs(client_a, "test-tiny"), parent_runs(client_b, "test-tiny")
    assert run_b.info.run_id == b["mlflow_run_id"] and run_b.info.status == "FINISHED"
    assert run_b.data.tags["posttrain.resumed"] == "true" and run_b.data.tags["posttrain.resume_count"] == "3"
    for name in ("train/reward_mean", "train/loss", "eval/accuracy"):
        ha, hb = history(client_a, run_a.info.run_id, name), history(client_b, run_b.info.run_id, name)
        assert [s for s, _ in hb] == [s for s, _ in ha], name  # every round once, none twice
        assert [v for _, v in hb] == pytest.approx([v for _, v in ha], abs=1e-6), name
    # nested runs of stages the kills interrupted are closed, not left RUNNING
    exp = client_b.get_experiment_by_name("test-tiny")
    assert not client_b.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'")

    # costs (tasks/costs.py): no work counted twice. The stages finished before a kill are reused (cost 0 in the
    # last attempt, their manifest's cost avoided), the ones it computed are spent; each finished stage once. What a
    # kill cut off left no manifest and no cost: its stage run is KILLED, without cost metrics.
    spent = [s for s in b["stages"] if s["status"] == "computed"]
    reused = [s for s in b["stages"] if s["status"] == "cached"]
    assert {s["stage"] for s in spent} >= {"export", "eval final"} and "optimize r0" in {s["stage"] for s in reused}
    assert len({s["path"] for s in b["stages"]}) == len(b["stages"])
    for row in spent + reused:
        recorded = json.loads((Path(row["path"]) / "_manifest.json").read_text())["cost"]
        assert row.get("cost" if row in spent else "avoided") == recorded, row["stage"]
    for name in ("wall_s", "cpu_s"):
        assert b["cost"]["spent"][name] == pytest.approx(sum(s["cost"][name] for s in spent), abs=0.01)
        assert b["cost"]["avoided"][name] == pytest.approx(sum(s["avoided"][name] for s in reused), abs=0.01)
    killed_runs = client_b.search_runs([exp.experiment_id], "attributes.status = 'KILLED'")
    assert killed_runs and not any("cost_cpu_s" in r.data.metrics for r in killed_runs)

    # `posttrain trace` (flows/trace.py) of the resumed run tells one prompt's story as the straight run's does:
    # every round once (none the kills cut off twice), the same rollouts, rewards and artifact chain
    last_scored = next(Path(s["path"]) for s in b["stages"] if s["stage"] == f"score r{ROUNDS - 1}")
    prompt_id = pq.read_table(last_scored / "scored.parquet").column("prompt_id")[0].as_py()
    trace_a = trace_json(capsys, a["run_name"], prompt_id, straight)
    trace_b = trace_json(capsys, run_name, prompt_id, killed)
    assert [r["round"] for r in trace_b["rounds"]] == list(range(ROUNDS)) and trace_b["rounds"][-1]["trained_on_prompt"]
    for field in ("rounds", "chain", "source", "eval", "split"):
        assert trace_b[field] == trace_a[field], field


def trace_json(capsys, run: str, prompt_id: str, artifacts: Path) -> dict:
    from flows.cli import main

    capsys.readouterr()
    assert main(["trace", run, prompt_id, "--artifacts", str(artifacts), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_mlflow_store_is_created_whole_and_a_cut_off_start_is_completed_on_resume(tmp_path, monkeypatch):
    """What a kill can cut off before any stage runs: MLflow creating its sqlite tables (left as
    mlflow.db.creating, never as a half-made mlflow.db), and the parent run's params and config.yaml."""
    from tasks.lineage import Lineage

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "mlflow.db.creating").write_bytes(b"half a database")  # a process killed while creating it
    lineage = Lineage(tmp_path, "exp")
    assert (tmp_path / "mlflow.db").is_file() and not (tmp_path / "mlflow.db.creating").exists()

    config = {"name": "exp", "grpo": {"rounds": 2, "seed": 0}}
    config_yaml = tmp_path / "config.yaml"
    config_yaml.write_text("name: exp\n")
    run = lineage.client.create_run(lineage.experiment_id, run_name="cut-off")  # killed right after this
    lineage.client.log_param(run.info.run_id, "name", "exp")
    Lineage(tmp_path, "exp").resume(run.info.run_id, config, config_yaml)
    resumed = lineage.client.get_run(run.info.run_id)
    assert resumed.data.params == {"name": "exp", "grpo.rounds": "2", "grpo.seed": "0"}
    assert [f.path for f in lineage.client.list_artifacts(run.info.run_id)] == ["config.yaml"]


def test_a_new_store_is_a_copy_of_the_kept_empty_store_with_mlflows_own_default_experiment(tmp_path, monkeypatch):
    """MLflow's migrations run once per MLflow version (the template in posttrain's cache folder); each new store
    is a copy with the same schema, and MLflow's first client adds the Default experiment where it would on a store
    it made itself. A damaged template is made again; a cache folder that cannot be written costs only the time."""
    import sqlite3

    from tasks.lineage import Lineage, create_store_whole, empty_store_template, make_tables

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    make_tables(tmp_path / "by-mlflow.db")
    template = empty_store_template()
    assert template is not None and template.parent == tmp_path / "cache" / "posttrain"

    def schema(db: Path) -> list:
        """Every table, index and column, and the schema version (MLflow's own migrations write a table's
        constraints in an order that varies from one run to the next: compared as sets of lines)."""
        with sqlite3.connect(db) as conn:
            items = conn.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
            version = conn.execute("SELECT * FROM alembic_version").fetchall()
        return sorted((kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
                      for kind, name, sql in items) + version

    lineage = Lineage(tmp_path / "run", "exp")
    copy = tmp_path / "run" / "mlflow.db"
    assert schema(copy) == schema(tmp_path / "by-mlflow.db")
    default = lineage.client.get_experiment("0")
    by_mlflow = MlflowClient(f"sqlite:///{tmp_path / 'by-mlflow.db'}").get_experiment("0")
    assert (default.name, default.artifact_location) == (by_mlflow.name, by_mlflow.artifact_location)
    assert lineage.client.get_experiment(lineage.experiment_id).name == "exp"

    template.write_bytes(b"not a database")  # damaged: made again, and the store is whole
    create_store_whole(f"sqlite:///{tmp_path / 'again.db'}")
    assert schema(tmp_path / "again.db") == schema(copy)
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no-cache-here")  # cannot be written: the tables made in place
    assert empty_store_template() is None
    create_store_whole(f"sqlite:///{tmp_path / 'in-place.db'}")
    assert schema(tmp_path / "in-place.db") == schema(copy)
