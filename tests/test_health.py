"""Health checks: each range on hand-written metric dicts, NaN/Inf always fatal, and the pipeline's
warnings (MLflow tags, summary.json, Prefect summary) and stops (TrainingUnhealthy, checkpoints kept,
a NaN round's optimize folder set aside)."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from stages.health import Finding, HealthConfig, TrainingUnhealthy, check_round, quarantine

HEALTHY = {  # inside every default range (axolotl's healthy values)
    "train/reward_mean": 0.4, "train/reward_std": 0.3, "train/frac_reward_zero_std": 0.5, "train/entropy": 0.3,
    "train/grad_norm": 0.5, "train/kl": 0.1, "train/clip_ratio": 0.05, "train/completion_length": 120.0,
    "train/loss": 0.01, "rollout/truncated_frac": 0.1, "rollout/staleness": 0, "time/optimize_s": 3.2,
}


def metrics_of(findings: list[Finding]) -> list[str]:
    return [f.metric for f in findings]


def test_healthy_round_has_no_findings():
    assert check_round(HEALTHY, HealthConfig(), 256) == []
    assert check_round({}, HealthConfig(), 256) == []  # nothing logged: nothing checked


@pytest.mark.parametrize("metric, value, healthy_range", [
    ("train/reward_std", 0.0, "> 0"),
    ("train/frac_reward_zero_std", 1.0, "<= 0.99"),
    ("train/entropy", 0.005, "[0.01, 1]"),
    ("train/entropy", 2.5, "[0.01, 1]"),
    ("train/grad_norm", 25.0, "<= 10"),
    ("train/kl", 3.0, "<= 2"),
    ("train/clip_ratio", 0.5, "<= 0.3"),
    ("train/completion_length", 0.2, ">= 1"),
    ("rollout/truncated_frac", 0.9, "<= 0.8"),
])
def test_each_default_range(metric, value, healthy_range):
    (finding,) = check_round({**HEALTHY, metric: value}, HealthConfig(), 256)
    assert (finding.metric, finding.value, finding.range, finding.fatal) == (metric, value, healthy_range, False)
    assert finding.message


def test_bounds_are_overridable_and_edges_are_healthy():
    cfg = HealthConfig(max_grad_norm=0.1, min_entropy=0.2, max_entropy=0.25, max_kl=0.05)
    assert metrics_of(check_round(HEALTHY, cfg, 256)) == ["train/entropy", "train/grad_norm", "train/kl"]
    edges = {"train/grad_norm": 10.0, "train/entropy": 1.0, "train/kl": 2.0, "train/clip_ratio": 0.3,
             "train/completion_length": 1.0, "rollout/truncated_frac": 0.8, "train/reward_std": 1e-6}
    assert check_round(edges, HealthConfig(), 256) == []


def test_completion_length_at_the_cap_counts_as_truncated_without_the_rollout_fraction():
    (finding,) = check_round({"train/completion_length": 16.0}, HealthConfig(), 16)
    assert finding.range == "< 16" and "max_completion_length (16 tokens)" in finding.message
    assert check_round({"train/completion_length": 15.0}, HealthConfig(), 16) == []
    # the measured fraction wins over the estimate from the mean
    assert check_round({"train/completion_length": 16.0, "rollout/truncated_frac": 0.5}, HealthConfig(), 16) == []


@pytest.mark.parametrize("metric", ["train/loss", "train/grad_norm", "train/kl", "train/reward_mean",
                                    "rollout/tokens_per_s"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_are_always_fatal(metric, bad):
    for cfg in (HealthConfig(on_unhealthy="warn"), HealthConfig(max_grad_norm=1e9, max_kl=1e9)):
        findings = check_round({**HEALTHY, metric: bad}, cfg, 256)
        assert findings[0].metric == metric and findings[0].fatal and findings[0].range == "finite"
        assert all(not f.fatal for f in findings[1:])


def test_per_reward_function_nan_means_not_applicable():
    assert check_round({**HEALTHY, "rewards/code/mean": math.nan, "rewards/code/std": math.nan},
                       HealthConfig(), 256) == []


def test_config_is_strict_and_validated():
    with pytest.raises(ValidationError, match="on_unhealthy"):
        HealthConfig(on_unhealthy="panic")
    with pytest.raises(ValidationError, match="max_grad_norms"):
        HealthConfig(max_grad_norms=1.0)
    with pytest.raises(ValidationError):
        HealthConfig(max_clip_ratio=1.5)


def test_training_unhealthy_names_round_metric_value_and_the_checkpoint(tmp_path):
    (finding,) = check_round({"train/grad_norm": 25.0}, HealthConfig(), 256)
    err = str(TrainingUnhealthy(3, [finding]))
    assert "round 3" in err and "train/grad_norm = 25" in err and "intact" in err
    folder = tmp_path / "optimize" / "abc123"
    folder.mkdir(parents=True)
    (folder / "_manifest.json").write_text("{}")
    moved = quarantine(folder)
    assert moved == folder.with_name("abc123.unhealthy") and (moved / "_manifest.json").exists()
    assert not folder.exists()
    folder.mkdir()  # quarantined again: the older copy is replaced
    assert quarantine(folder) == moved and not (moved / "_manifest.json").exists()
    (nan,) = check_round({"train/loss": math.nan}, HealthConfig(), 256)
    err = str(TrainingUnhealthy(0, [nan], moved))
    assert "round 0" in err and "train/loss = nan" in err and str(moved) in err


@pytest.mark.slow
def test_pipeline_warns_stops_and_sets_nan_weights_aside(prefect_harness, tmp_path, tiny_config_text, monkeypatch):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    import flows.pipeline as pipeline
    from tasks.store import ArtifactStore

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = tmp_path / "tiny.yaml"
    config.write_text(tiny_config_text.replace("name: test-tiny", "name: test-health"))
    root = tmp_path / "artifacts"
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    # a bound no completion meets (rollout.max_completion_length is 8): the warning must fire. (The tiny
    # model's groups all get one reward, so its grad_norm is 0 and a tiny max_grad_norm would not.)
    common = ["grpo.rounds=1", "export.model_name=test-health", "health.min_completion_length=9"]

    # warn (default): the run finishes; the warning is a tag, a summary.json entry and a summary line
    results = pipeline.posttrain_pipeline(str(config), common, quiet=True)
    assert "train/completion_length" in [f["metric"] for f in results["health"]]
    tags = client.get_run(results["mlflow_run_id"]).data.tags
    assert tags["health"] == "warnings" and tags["health.warning.train/completion_length"].startswith("round 0: ")
    summary = json.loads((root / "runs" / results["run_name"] / "summary.json").read_text())
    (length,) = [f for f in summary["health"] if f["metric"] == "train/completion_length"]
    assert length["round"] == 0 and length["range"] == ">= 9" and not length["fatal"]
    with get_client(sync_client=True) as prefect:
        (markdown,) = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="test-health-summary")))
    assert "Health warnings" in markdown.data and "`train/completion_length`" in markdown.data

    # stop: the same round (cached) ends the run; every checkpoint stays
    store = ArtifactStore(root)
    (optimize_dir,) = [p for p in (root / "optimize").iterdir() if p.is_dir() and not p.name.startswith(".")]
    with pytest.raises(TrainingUnhealthy, match=r"round 0.*\n(.*\n)*.*train/completion_length = ") as stopped:
        pipeline.posttrain_pipeline(str(config), common + ["health.on_unhealthy=stop"], quiet=True)
    assert stopped.value.quarantined is None and store.get("optimize", optimize_dir.name) is not None
    (failed,) = client.search_runs([client.get_experiment_by_name("test-health").experiment_id],
                                   filter_string="tags.health = 'stopped'")
    assert failed.info.status == "FAILED" and "health.warning.train/completion_length" in failed.data.tags

    # NaN: stops even with warn, and the round's optimize folder is set aside; the policy before it stays
    real = pipeline.check_round
    monkeypatch.setattr(pipeline, "check_round", lambda m, cfg, n: real({**m, "train/loss": math.nan}, cfg, n))
    with pytest.raises(TrainingUnhealthy, match="train/loss = nan") as nan:
        pipeline.posttrain_pipeline(str(config), common + ["health.min_completion_length=0"], quiet=True)
    assert nan.value.quarantined == optimize_dir.with_name(optimize_dir.name + ".unhealthy")
    assert str(nan.value.quarantined) in str(nan.value) and (nan.value.quarantined / "_manifest.json").exists()
    assert store.get("optimize", optimize_dir.name) is None
    (sft_dir,) = [p for p in (root / "sft").iterdir() if not p.name.startswith(".")]
    assert store.get("sft", sft_dir.name) is not None
