"""`posttrain trace`: one prompt of a real tiny run (tests/conftest.py's tiny config, two GRPO rounds) traced to its
sources, in a store made once for this module. A run resumed after kills: tests/test_resume.py (its trace equals the
uninterrupted run's, every round once)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import warm_tiny_folder

from flows.cli import main
from tasks.store import MANIFEST


@pytest.fixture(scope="module")
def run(prefect_harness, tiny_warm_store, empty_mlflow_store, tmp_path_factory):
    """(artifacts, pipeline result) of one finished tiny GRPO run."""
    from flows.pipeline import posttrain_pipeline

    root = tmp_path_factory.mktemp("trace")
    artifacts = warm_tiny_folder(root, tiny_warm_store, empty_mlflow_store)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        result = posttrain_pipeline(str(root / "tiny.yaml"), [], quiet=True)
    return artifacts, result


def trace_json(capsys, *argv) -> dict:
    assert main(["trace", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def stage_path(artifacts: Path, name: str, label: str) -> Path:
    summary = json.loads((artifacts / "runs" / name / "summary.json").read_text())
    return Path(next(s["path"] for s in summary["stages"] if s["stage"] == label))


def test_eval_row_chain_and_completion(run, capsys):
    artifacts, result = run
    name = result["run_name"]
    data = trace_json(capsys, name, "eval-000003", "--artifacts", str(artifacts))
    final = stage_path(artifacts, name, "eval final")
    row = next(r for r in pq.read_table(final / "eval.parquet").to_pylist() if r["prompt_id"] == "eval-000003")
    assert data["eval"]["completion"] == row["completion"] and data["eval"]["correct"] == row["correct"]
    assert data["eval"]["artifact"] == f"eval/{final.name}" and data["split"] == "eval"
    stages = [c["stage"] for c in data["chain"]]
    assert stages == ["eval", "export", "optimize", "optimize", "sft", "base_model", "transform", "demo_data"]
    assert data["chain"][1]["artifact"] == f"export/{stage_path(artifacts, name, 'export').name}"
    assert data["chain"][2]["artifact"] == f"optimize/{stage_path(artifacts, name, 'optimize r1').name}"
    for entry in data["chain"]:
        assert (artifacts / entry["artifact"] / MANIFEST).exists()
        assert json.loads((artifacts / entry["artifact"] / MANIFEST).read_text())["inputs"] == entry["inputs"]
    # held out: no round trained on it, each round's summary instead
    assert [r["round"] for r in data["rounds"]] == [0, 1]
    assert not any(r["trained_on_prompt"] for r in data["rounds"]) and all(r["in_chain"] for r in data["rounds"])
    assert data["rounds"][1]["summary"]["policy_versions"] == [1]
    assert data["source"]["row"] == 3 and data["source"]["file"].endswith("eval.parquet")
    assert set(data["reward_code"]["reward_funcs"]) == {"accuracy", "format"}
    assert trace_json(capsys, name, "--eval-row", "3", "--artifacts", str(artifacts)) == data
    assert main(["trace", name, "eval-000003", "--artifacts", str(artifacts)]) == 0
    text = capsys.readouterr().out
    assert row["completion"][:10] in text.replace("\\n", "\n") and "<- base_model/" in text


def test_train_prompt_rollouts_per_round(run, capsys):
    artifacts, result = run
    name = result["run_name"]
    scored = {r: pq.read_table(stage_path(artifacts, name, f"score r{r}") / "scored.parquet").to_pylist()
              for r in (0, 1)}
    prompt_id = scored[1][0]["prompt_id"]
    data = trace_json(capsys, result["mlflow_run_id"], prompt_id, "--artifacts", str(artifacts))
    assert data["eval"]["row"] is None and data["split"] == "train"
    for entry in data["rounds"]:
        want = [r for r in scored[entry["round"]] if r["prompt_id"] == prompt_id]
        assert entry["trained_on_prompt"] == bool(want)
        got = entry["rollout_rows"]
        assert [r["rollout_id"] for r in got] == [r["rollout_id"] for r in want]
        assert [(r["policy_version"], r["engine"], r["finish_reason"], r["reward"], r["advantage"]) for r in got] == [
            (r["policy_version"], r["engine"], r["finish_reason"], r["reward"], r["advantage"]) for r in want]
        assert [r["rewards"] for r in got] == [dict(r["rewards"]) for r in want]
    assert data["rounds"][1]["trained_on_prompt"]


def test_listing(run, capsys):
    artifacts, result = run
    data = trace_json(capsys, result["run_name"], "--artifacts", str(artifacts))
    assert data["eval_rows"] == 24 and [r["prompt_id"] for r in data["listed"]][:2] == ["eval-000000", "eval-000001"]


@pytest.mark.parametrize("argv, named", [
    (["no-such-run"], "unknown run 'no-such-run'"),
    (["{run}", "train-999999"], "prompt id 'train-999999' is not in run"),
    (["{run}", "--eval-row", "24"], "--eval-row 24 is not in run"),
])
def test_bad_input_exits_2(run, capsys, argv, named):
    artifacts, result = run
    assert main(["trace", *[a.format(run=result["run_name"]) for a in argv], "--artifacts", str(artifacts)]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1


def test_no_store_exits_2(tmp_path, capsys):
    assert main(["trace", "some-run", "--artifacts", str(tmp_path)]) == 2
    assert "no MLflow store" in capsys.readouterr().err
