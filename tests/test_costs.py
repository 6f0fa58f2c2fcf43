"""What a run cost (tasks/costs.py, issue 46 item 4): each computed stage's manifest and MLflow run record its wall,
CPU and GPU seconds and its tokens; a stage read from the cache costs 0 and records the cost it avoided; the run
summary and `posttrain runs` total them. One tiny run (its warm stages cached), then the same run again."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from conftest import computed
from tasks.costs import COST_FIELDS, recorded_cost

pytestmark = pytest.mark.slow


def manifest(row: dict) -> dict:
    return json.loads((Path(row["path"]) / "_manifest.json").read_text())


def completion_tokens(path: Path) -> int:
    return sum(len(ids) for ids in pq.read_table(path, columns=["completion_token_ids"]).column(0).to_pylist())


def test_stages_record_their_cost_and_a_cached_rerun_records_it_avoided(prefect_harness, tiny_config, tmp_path,
                                                                        capsys):
    import torch

    from flows.cli import main
    from flows.pipeline import posttrain_pipeline

    root = tmp_path / "artifacts"
    overrides = ["grpo.rounds=1", "rollout.worker_process=true"]  # rollouts in a worker process (not in a key)
    first = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    rows = {row["stage"]: row for row in first["stages"]}
    assert computed(first) == ["eval base", "rollout r0", "score r0", "optimize r0", "export", "eval final"]
    cpu = not torch.cuda.is_available()

    for row in first["stages"]:  # every manifest carries the record, exactly these fields
        cost = manifest(row)["cost"]
        assert list(cost) == list(COST_FIELDS), row["stage"]
        assert cost["wall_s"] > 0 and cost["cpu_s"] > 0, (row["stage"], cost)
        assert cost["cpu_s"] < 50 * cost["wall_s"] + 5, (row["stage"], cost)  # no other run's CPU in it
        if cpu:
            assert cost["gpu_s"] is None and cost["gpu_peak_bytes"] is None, row["stage"]
        if row["status"] == "computed":
            assert row["cost"] == cost
        else:  # the warm stages, computed by an earlier run: avoided, nothing spent here
            assert row["avoided"] == cost and "cost" not in row

    # the rollout ran in the worker process, its thread here only waited: the worker's CPU (it imports torch and
    # transformers, then samples) is the rollout's, claimed by it (tasks/costs.py `claim`)
    assert manifest(rows["rollout r0"])["cost"]["cpu_s"] > 1.0

    # tokens from the stages' own outputs
    rollout, score, optimize = (manifest(rows[s]) for s in ("rollout r0", "score r0", "optimize r0"))
    generated = completion_tokens(Path(rows["rollout r0"]["path"]) / "rollouts.parquet")
    assert generated > 0 and rollout["cost"]["tokens_generated"] == generated
    scored_path = root / optimize["inputs"]["scored"] / "scored.parquet"
    assert score["cost"]["tokens_scored"] == completion_tokens(scored_path) == generated
    scored = pq.read_table(scored_path).to_pylist()  # every row trains (skip_zero_advantage_batches: false)
    assert optimize["cost"]["tokens_trained"] == sum(len(r["prompt_token_ids"]) + len(r["completion_token_ids"])
                                                     for r in scored)
    assert manifest(rows["sft"])["cost"]["tokens_trained"] > 0
    assert rollout["cost"]["tokens_trained"] is None and optimize["cost"]["tokens_generated"] is None

    # the run's totals: spent = the computed stages', avoided = the cached ones', per 1k tokens and accepted sample
    total = first["cost"]
    spent = [r["cost"] for r in first["stages"] if r["status"] == "computed"]
    avoided = [r["avoided"] for r in first["stages"] if r["status"] == "cached"]
    for name in ("wall_s", "cpu_s"):
        assert total["spent"][name] == pytest.approx(sum(c[name] for c in spent), abs=0.01)
        assert total["avoided"][name] == pytest.approx(sum(c[name] for c in avoided), abs=0.01)
    assert total["spent"]["tokens_generated"] == generated and total["spent"]["tokens_scored"] == generated
    assert total["spent"]["tokens_trained"] == optimize["cost"]["tokens_trained"]
    assert total["avoided"]["tokens_trained"] == manifest(rows["sft"])["cost"]["tokens_trained"]
    assert total["accepted_samples"] == sum(r["advantage"] != 0 for r in scored)
    trained = total["spent"]["tokens_trained"] + total["avoided"]["tokens_trained"]
    assert total["per_1k_tokens_trained"]["cpu_s"] == pytest.approx(
        (total["spent"]["cpu_s"] + total["avoided"]["cpu_s"]) * 1000 / trained, rel=1e-3)
    if total["accepted_samples"]:
        assert total["per_accepted_sample"]["wall_s"] == pytest.approx(
            (total["spent"]["wall_s"] + total["avoided"]["wall_s"]) / total["accepted_samples"], rel=1e-3)
    summary = json.loads((root / "runs" / first["run_name"] / "summary.json").read_text())
    assert summary["cost"] == total

    # MLflow: each stage run holds its cost (or, read from the cache, the cost it avoided); the parent the totals
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    parent = client.get_run(first["mlflow_run_id"])
    assert parent.data.metrics["cost/cpu_s"] == pytest.approx(total["spent"]["cpu_s"])
    assert parent.data.metrics["cost/avoided_wall_s"] == pytest.approx(total["avoided"]["wall_s"])
    children = {c.data.tags["posttrain.stage"]: c for c in client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    assert set(children) == set(rows)
    assert children["optimize r0"].data.metrics["cost_cpu_s"] == optimize["cost"]["cpu_s"]
    assert children["optimize r0"].data.tags["posttrain.cached"] == "false"
    assert children["sft"].data.tags["posttrain.cached"] == "true"
    assert children["sft"].data.metrics["cost_avoided_wall_s"] == manifest(rows["sft"])["cost"]["wall_s"]
    assert "cost_cpu_s" not in children["sft"].data.metrics

    # the same run again: all cached, nothing spent, the first run's whole cost avoided
    second = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    assert computed(second) == []
    again = second["cost"]
    assert again["spent"]["wall_s"] == 0 and again["spent"]["cpu_s"] == 0
    assert again["spent"]["tokens_trained"] is None and again["stages_computed"] == 0
    for name in ("wall_s", "cpu_s", "tokens_generated", "tokens_trained", "tokens_scored"):
        before = (total["spent"][name] or 0) + (total["avoided"][name] or 0)
        assert again["avoided"][name] == pytest.approx(before, abs=0.01), name
    assert [r["avoided"] for r in second["stages"]] == [recorded_cost(manifest(r)) for r in first["stages"]]
    for name in ("wall_s", "cpu_s"):  # the result cost the same to make, whichever run paid
        assert again["per_1k_tokens_trained"][name] == pytest.approx(total["per_1k_tokens_trained"][name], rel=1e-3)

    # `posttrain runs`: each run's totals
    assert main(["runs", "--artifacts", str(root)]) == 0
    out = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("test-tiny")}
    assert f"{generated}/{total['spent']['tokens_trained']}/{generated}" in out[first["run_name"]]
    assert "/".join(f"{v:.4g}" for v in (total["spent"]["wall_s"], total["spent"]["cpu_s"])) in out[first["run_name"]]
    assert "/".join(f"{v:.4g}" for v in (again["avoided"]["wall_s"], again["avoided"]["cpu_s"])) in \
        out[second["run_name"]] and " 0/0/" in out[second["run_name"]]  # nothing spent, all avoided
