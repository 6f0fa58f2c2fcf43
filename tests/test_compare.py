"""`posttrain runs` and `posttrain compare` on a real MLflow sqlite store, filled the way
flows/pipeline.py fills it (tasks/lineage.Lineage: parent run, params, per-round metrics,
runs/<name>/config.yaml and summary.json), plus a run that failed midway."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from flows.compare import RunData, artifact_rows, config_diff_rows, summarize_stages
from tasks.lineage import Lineage

A, B, FAILED = "cmp-20260101-000001", "cmp-20260101-000002", "cmp-20260101-000003"


def make_run(root: Path, name: str, temperature: float, metrics: list[tuple[dict, int]], stages: list[dict] | None,
             status: str, stage_runs: list[tuple[str, str, str]] = ()) -> str:
    """A parent run as open_run + posttrain_pipeline record it; stage_runs: (label, key, status) nested runs."""
    config = {"name": "cmp", "artifacts_dir": str(root), "grpo": {"rounds": 2, "learning_rate": 1e-5},
              "rollout": {"temperature": temperature, "num_generations": 4}, "score": {"reward_funcs": ["accuracy"]}}
    run_dir = root / "runs" / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    lineage = Lineage(root, "cmp")
    parent = lineage.start(name, {"artifact_root": str(root), "posttrain.purpose": "train"}, config,
                           run_dir / "config.yaml")
    for label, key, stage_status in stage_runs:
        run_id = lineage.stage_run(label, key, {}, {})
        lineage.log_metrics(run_id, {"wall_time_s": 1.5})
        lineage.client.set_terminated(run_id, status=stage_status)
    for values, step in metrics:
        lineage.log_metrics(parent, values, step=step)
    if stages is not None:
        (run_dir / "summary.json").write_text(json.dumps({"run_name": name, "mlflow_run_id": parent,
                                                          "stages": stages}))
    lineage.finish(status)
    return parent


def stage(label: str, path: Path, seconds: float = 2.0, status: str = "computed") -> dict:
    return {"stage": label, "kind": label.split()[0], "status": status, "seconds": seconds, "path": str(path)}


@pytest.fixture(autouse=True)
def sqlite_store_under_artifacts(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Three runs of experiment 'cmp': A and B finished (rollout.temperature differs, demo_data shared,
    sft and rollout r0 different), FAILED stopped after round 0."""
    root = tmp_path_factory.mktemp("compare") / "artifacts"
    root.mkdir()
    saved = os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        shared = root / "demo_data" / "d0d0d0d0"
        ids = {}
        ids[A] = make_run(root, A, 1.0, [
            ({"eval/accuracy": 0.25}, 0), ({"train/reward_mean": 0.30, "time/generate_s": 1.0}, 1),
            ({"train/reward_mean": 0.40, "time/generate_s": 2.0}, 2), ({"eval/accuracy": 0.5}, 2),
            ({"eval/accuracy_base": 0.25, "eval/accuracy_final": 0.5, "time/rounds_wall_s": 9.0}, 0)],
            [stage("demo_data", shared, 0.5), stage("sft", root / "sft" / "aaaa1111", 30.0),
             stage("rollout r0", root / "rollout" / "rrrr1111")], "FINISHED")
        ids[B] = make_run(root, B, 0.7, [
            ({"eval/accuracy": 0.25}, 0), ({"train/reward_mean": 0.35}, 1), ({"train/reward_mean": 0.45}, 2),
            ({"eval/accuracy": 0.625}, 2), ({"eval/accuracy_base": 0.25, "eval/accuracy_final": 0.625}, 0)],
            [stage("demo_data", shared, 0.0, "cached"), stage("sft", root / "sft" / "bbbb2222", 31.0),
             stage("rollout r0", root / "rollout" / "rrrr2222")], "FINISHED")
        ids[FAILED] = make_run(root, FAILED, 1.0, [({"eval/accuracy": 0.25}, 0), ({"train/reward_mean": 0.2}, 1)],
                               None, "FAILED", [("demo_data", "d0d0d0d0", "FINISHED"),
                                                ("rollout r0", "rrrr3333", "FAILED")])
    finally:
        if saved is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved
    return root, ids


def test_runs_lists_pipeline_runs_newest_first(store, capsys):
    root, _ = store
    assert main(["runs", "--artifacts", str(root)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("cmp-")]
    assert [line.split()[0] for line in lines] == [FAILED, B, A]  # newest first, no nested stage runs
    row = {line.split()[0]: line for line in lines}
    assert "FINISHED" in row[A] and "0.25 -> 0.5" in row[A] and "0.4" in row[A]
    assert "0.25 -> 0.625" in row[B] and "0.45" in row[B]
    assert "FAILED" in row[FAILED] and "0.25 -> -" in row[FAILED] and "0.2" in row[FAILED]

    assert main(["runs", "--artifacts", str(root), "--experiment", "cmp"]) == 0
    assert len([x for x in capsys.readouterr().out.splitlines() if x.startswith("cmp-")]) == 3
    assert main(["runs", "--artifacts", str(root), "--experiment", "nope"]) == 2
    assert "no experiment named 'nope'" in capsys.readouterr().err


def test_compare_two_finished_runs(store, capsys, tmp_path):
    root, ids = store
    plot = tmp_path / "curves.png"
    assert main(["compare", A, ids[B], "--artifacts", str(root), "--plot", str(plot)]) == 0  # name and run id
    out = capsys.readouterr().out
    config = out.split("config:")[1].split("final metrics")[0]
    assert "1 of" in config and "rollout.temperature" in config and "1.0" in config and "0.7" in config
    assert "grpo.rounds" not in config and "learning_rate" not in config
    metrics = out.split("final metrics")[1].split("wall time per stage")[0]
    final = next(line for line in metrics.splitlines() if "eval/accuracy_final" in line)
    assert final.split()[1:] == ["0.5", "0.625"]
    reward = next(line for line in metrics.splitlines() if "train/reward_mean" in line)
    assert reward.split()[1:] == ["0.4", "0.45"]
    times = out.split("wall time per stage")[1].split("artifacts (")[0]
    assert "30.0s" in times and "31.0s" in times and "cached" in times and "time/rounds_wall_s" in times
    artifacts = out.split("artifacts (content key per stage)")[1]
    assert "d0d0d0d0" in artifacts and "aaaa1111" in artifacts and "bbbb2222" in artifacts
    assert "shared (reused, same folder in every run): demo_data\n" in artifacts
    assert "different: sft, rollout r0\n" in artifacts
    assert out.rstrip().endswith(f"plot: {plot}")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 1000


def test_compare_failed_run_and_default_plot(store, capsys):
    root, _ = store
    assert main(["compare", A, FAILED, "--artifacts", str(root)]) == 0
    out = capsys.readouterr().out
    assert "config: 0 of" in out
    final = next(line for line in out.splitlines() if "eval/accuracy_final" in line)
    assert final.split()[1:] == ["0.5", "-"]
    assert "no summary.json" in out  # stage list came from the nested MLflow stage runs
    assert "shared (reused, same folder in every run): demo_data\n" in out
    assert "different: rollout r0\n" in out
    sft = next(line for line in out.split("wall time per stage")[1].splitlines() if line.strip().startswith("sft"))
    assert sft.split()[1:] == ["30.0s", "-"]
    plot = root / f"compare-{A}-vs-{FAILED}.png"
    assert f"plot: {plot}" in out and plot.stat().st_size > 1000


def test_unknown_run_names_known_ones(store, capsys):
    root, _ = store
    assert main(["compare", A, "cmp-nope", "--artifacts", str(root)]) == 2
    err = capsys.readouterr().err
    assert "unknown run 'cmp-nope'" in err and A in err and "posttrain runs" in err


def test_missing_store_is_explained(tmp_path, capsys):
    assert main(["runs", "--artifacts", str(tmp_path / "empty")]) == 2
    assert "no MLflow store" in capsys.readouterr().err
    assert not (tmp_path / "empty").exists()


def test_row_builders_without_a_store():
    def run(name, config, stages):
        return RunData(run_id=name, name=name, experiment="x", status="FINISHED", start_ms=0, end_ms=1000,
                       config=config, stages=stages)

    one = run("a", {"k": "1", "same": "s"}, [{"stage": "sft", "key": "k1", "path": "/x/sft/k1"}])
    two = run("b", {"k": "2", "same": "s", "extra": "e"}, [{"stage": "sft", "key": "k1", "path": "/x/sft/k1"},
                                                            {"stage": "export", "key": "k2", "path": "/x/export/k2"}])
    assert config_diff_rows([one, two]) == [["extra", "-", "e"], ["k", "1", "2"]]
    rows, shared, different = artifact_rows([one, two])
    assert shared == ["sft"] and different == [] and rows[1] == ["export", "-", "k2", "not in every run"]
    assert summarize_stages(["sft", "rollout r0", "rollout r1", "rollout r3"]) == "sft, rollout r0-r1, r3"


def test_a_run_whose_process_died_shows_killed_and_a_live_one_running(tmp_path, capsys):
    """A SIGKILL leaves the MLflow run RUNNING; `posttrain runs` shows it KILLED (its pid is gone on this host),
    a run whose process lives RUNNING, and the experiment opens in MLflow's model-training view."""
    import socket
    import subprocess
    import sys

    from tasks.lineage import EXPERIMENT_KIND, MODEL_TRAINING

    root = tmp_path / "artifacts"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    lineage = Lineage(root, "cmp")
    for name, pid in (("cmp-killed", gone.pid), ("cmp-live", os.getpid())):
        run_dir = root / "runs" / name
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text("name: cmp\n")
        lineage.start(name, {"artifact_root": str(root), "posttrain.purpose": "train", "posttrain.pid": str(pid),
                             "posttrain.host": socket.gethostname()}, {"name": "cmp"}, run_dir / "config.yaml")
    assert main(["runs", "--artifacts", str(root)]) == 0
    row = {line.split()[0]: line.split()[2] for line in capsys.readouterr().out.splitlines() if line.startswith("cmp-")}
    assert row == {"cmp-killed": "KILLED", "cmp-live": "RUNNING"}
    assert lineage.client.get_experiment(lineage.experiment_id).tags[EXPERIMENT_KIND] == MODEL_TRAINING


def test_compare_shows_the_diff_of_a_reward_module_that_changed(tmp_path, monkeypatch, capsys):
    """Each run logs its user modules' source (code/ artifacts, tag code.<module>); compare of two runs whose
    reward module differs says which and prints the unified diff (issue 44 item 6)."""
    import sys

    from stages.runtime import imports

    root = tmp_path / "artifacts"
    code = tmp_path / "code"
    code.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(code)])
    lineage = Lineage(root, "cmp")
    ids = []
    for name, body in (("cmp-a", "    return [1.0 for _ in completions]\n"),
                       ("cmp-b", "    return [0.5 for _ in completions]\n")):
        (code / "myrewards.py").write_text("def reward(prompts, completions, **kwargs):\n" + body)
        imports._digests.clear()
        run_dir = root / "runs" / name
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text("name: cmp\n")
        run_id = lineage.start(name, {"artifact_root": str(root), "posttrain.purpose": "train"}, {"name": "cmp"},
                               run_dir / "config.yaml")
        assert set(lineage.log_code(run_id, ["myrewards.reward", "accuracy"])) == {"myrewards"}
        lineage.finish("FINISHED")
        ids.append(run_id)
    assert main(["compare", "cmp-a", "cmp-b", "--artifacts", str(root), "--plot", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "user code differs: myrewards" in out
    assert "--- cmp-a/myrewards.py" in out and "+++ cmp-b/myrewards.py" in out
    assert "-    return [1.0 for _ in completions]" in out and "+    return [0.5 for _ in completions]" in out
