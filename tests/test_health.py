"""Health checks: each range on hand-written metric dicts, NaN/Inf always fatal, the collapse metrics on
hand-made completions (and in the score stage's summary), and the pipeline's warnings (MLflow tags,
summary.json, Prefect summary) and stops (TrainingUnhealthy, checkpoints kept, a NaN round's optimize
folder set aside)."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from stages.evaluation.health import Finding, HealthConfig, TrainingUnhealthy, check_round, quarantine
from stages.scoring.collapse import collapse_metrics

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
    ("train/grad_norm", 25.0, "[0.001, 10]"), ("train/grad_norm", 0.0001, "[0.001, 10]"),
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


# --- policy collapse ---------------------------------------------------------------------------------
# The measured failure: the demo task "Which is the largest of 3, 8, 1, 6, 4?", where 9 is the gold answer
# of most prompts, and a policy that answers <answer>9</answer> to every one of them.

GOLD = ["9", "9", "7", "9", "8", "9", "6", "9", "5", "9"]  # 10 prompts, 60% "9"


def round_of(answers_per_prompt: list[list[str]], gold: list[str] | None = GOLD) -> dict:
    """collapse_metrics of a round laid out as the rollouts table: one row per completion, group by group."""
    ids = [f"p{i}" for i, group in enumerate(answers_per_prompt) for _ in group]
    completions = [f"<answer>{a}</answer>" for group in answers_per_prompt for a in group]
    golds = None if gold is None else [gold[i] for i, group in enumerate(answers_per_prompt) for _ in group]
    return collapse_metrics(ids, completions, golds)


def test_collapse_metrics_on_hand_made_completions():
    m = collapse_metrics(["a", "a", "a", "b", "b", "b", "c", "c", "c"],
                         ["<answer>9</answer>", "<answer>9</answer>", "<answer> 9 </answer>",  # 2 texts, 1 answer
                          "<answer>7</answer>", "<answer>7</answer>", "<answer>9</answer>",  # 2 texts, 2 answers
                          "<answer>7</answer>", "6", "x <answer>6</answer>"],  # 3 texts, 2 answers
                         gold_answers=["9"] * 3 + ["7"] * 3 + [6] * 3)  # non-strings are compared as text
    assert m == {
        "rollout/distinct_completions_per_group": pytest.approx((2 + 2 + 3) / 3),
        "rollout/frac_identical_groups": 0.0,
        "rollout/distinct_answers": 3,  # 9, 7, 6
        "rollout/top_answer_frac": pytest.approx(4 / 9),  # "9" 4 times, "7" 3 times, "6" twice
        "top_answer": "9",
        "rollout/gold_top_answer_frac": pytest.approx(1 / 3),  # one gold answer per prompt, not per row
    }
    same = collapse_metrics(["a", "a", "b", "b"], ["<answer>9</answer>"] * 4)
    assert same["rollout/frac_identical_groups"] == 1.0 and same["rollout/distinct_completions_per_group"] == 1.0
    assert same["rollout/top_answer_frac"] == 1.0 and "rollout/gold_top_answer_frac" not in same
    # one completion per prompt: no group to be identical; a gold answer None is left out
    single = collapse_metrics(["a", "b"], ["1", "2"], [None, "2"])
    assert "rollout/frac_identical_groups" not in single and single["rollout/gold_top_answer_frac"] == 1.0
    assert collapse_metrics([], []) == {}
    with pytest.raises(ValueError, match="3 prompt ids, 2 completions"):
        collapse_metrics(["a", "a", "b"], ["1", "2"])


def collapse_findings(metrics: dict, cfg: HealthConfig | None = None) -> list[Finding]:
    """check_round as the pipeline calls it: the top answer's text travels as rollout/top_answer."""
    numbers = {k: v for k, v in metrics.items() if k != "top_answer"}
    return check_round({**HEALTHY, **numbers, "rollout/top_answer": metrics["top_answer"]}, cfg or HealthConfig(), 256)


def test_constant_answer_is_a_collapse_even_when_it_is_often_right():
    collapsed = round_of([["9", "9", "9", "9"]] * len(GOLD))
    assert collapsed["rollout/top_answer_frac"] == 1.0 and collapsed["rollout/gold_top_answer_frac"] == 0.6
    findings = collapse_findings(collapsed)
    assert metrics_of(findings) == ["rollout/top_answer_frac", "rollout/frac_identical_groups"]
    top = findings[0]
    assert (top.value, top.range, top.fatal) == (1.0, "<= 0.9", False)
    assert top.message.startswith("policy collapse: 100% of completions answer '9' (gold answers: at most 60% share "
                                  "one answer); the policy gives one answer regardless of the prompt")
    # no gold column: the bound alone decides, and the message says so
    (no_gold,) = [f for f in collapse_findings(round_of([["9"] * 4] * 10, gold=None))
                  if f.metric == "rollout/top_answer_frac"]
    assert "no gold answers to compare" in no_gold.message
    # a long answer (no <answer> tag: the whole completion) is cut in the message
    long = collapse_metrics(["a", "b"], ["x" * 500] * 2)
    assert len(long["top_answer"]) == 200 and "'xxx" in collapse_findings(long)[0].message
    assert len(collapse_findings(long)[0].message) < 400


def test_healthy_rounds_are_not_a_collapse():
    # diverse, mostly right answers: the top answer is about as common as among the gold answers
    right = round_of([[g, g, g, "1"] for g in GOLD])
    assert right["rollout/top_answer_frac"] == pytest.approx(0.45)
    assert collapse_findings(right) == []
    # a policy that has learned the task: every completion right (and identical in its group) -- the identical
    # groups warn, the answers do not
    perfect = round_of([[g] * 4 for g in GOLD])
    assert metrics_of(collapse_findings(perfect)) == ["rollout/frac_identical_groups"]
    # gold answers all the same, and the policy gives it: right, not collapsed
    yes = round_of([["yes", "yes", "yes", "yes "]] * 10, gold=["yes"] * 10)
    assert yes["rollout/top_answer_frac"] == 1.0 and collapse_findings(yes) == []
    # gold answers concentrated (90% "9") and the policy a bit more so (92.5%): within gold + 0.1
    leaning = round_of([["9", "9", "9", "9 "]] * 9 + [["9", "7", "7", "7"]], gold=["9"] * 9 + ["7"])
    assert leaning["rollout/top_answer_frac"] == pytest.approx(0.925) and collapse_findings(leaning) == []


def test_collapse_bounds_are_overridable_and_edges_are_healthy():
    edge = {"rollout/top_answer_frac": 0.9, "rollout/frac_identical_groups": 0.9, "rollout/top_answer": "9"}
    assert check_round(edge, HealthConfig(), 256) == []
    assert check_round({**edge, "rollout/gold_top_answer_frac": 0.5}, HealthConfig(), 256) == []
    strict = HealthConfig(max_top_answer_frac=0.5, max_frac_identical_groups=0.5)
    assert metrics_of(check_round(edge, strict, 256)) == ["rollout/top_answer_frac", "rollout/frac_identical_groups"]
    # the gold answers' concentration raises the bound (0.85 + 0.1), never lowers it
    (finding,) = check_round({"rollout/top_answer_frac": 0.97, "rollout/gold_top_answer_frac": 0.85}, strict, 256)
    assert finding.range == "<= 0.95" and "give one answer" in finding.message  # no top answer text given
    off = HealthConfig(max_top_answer_frac=1, max_frac_identical_groups=1)
    assert check_round({**edge, "rollout/top_answer_frac": 1.0, "rollout/frac_identical_groups": 1.0}, off, 256) == []


def test_identical_groups_finding():
    (finding,) = check_round({**HEALTHY, "rollout/frac_identical_groups": 0.95}, HealthConfig(), 256)
    assert (finding.metric, finding.value, finding.range, finding.fatal) == \
        ("rollout/frac_identical_groups", 0.95, "<= 0.9", False)
    assert "identical" in finding.message and "zero advantages" in finding.message


def test_collapsed_round_stops_the_run_with_on_unhealthy_stop():
    """As flows/rounds.py RoundLog.check_health: with stop, every finding stops the run; the weights are kept."""
    cfg = HealthConfig(on_unhealthy="stop")
    findings = collapse_findings(round_of([["9", "9", "9", "9"]] * len(GOLD)), cfg)
    stop = [f for f in findings if f.fatal or cfg.on_unhealthy == "stop"]
    assert metrics_of(stop) == ["rollout/top_answer_frac", "rollout/frac_identical_groups"]
    err = str(TrainingUnhealthy(2, stop))
    assert "round 2" in err and "rollout/top_answer_frac = 1 (healthy: <= 0.9): policy collapse: 100%" in err
    assert "answer '9'" in err and "intact" in err
    assert not any(f.fatal for f in findings)  # warn (the default): logged and tagged, the run goes on


def test_score_summary_carries_the_collapse_metrics(tmp_path, out_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages.data.schemas import ROLLOUTS
    from stages.scoring import reward_pools, score

    rows = [{"rollout_id": f"r0-p{p}-g{g}", "prompt_id": f"p{p}", "group_index": g,
             "prompt": [{"role": "user", "content": f"Which is the largest of {gold}, 1?"}],
             "completion": "<answer>9</answer>", "prompt_token_ids": [1], "completion_token_ids": [1, 2],
             "sampling_logprobs": [-0.5, -0.5], "round_index": 0, "policy_version": 0, "engine": "hf",
             "finish_reason": "stop", "rerolled": False, "answer": gold}
            for p, gold in enumerate(["9", "9", "7"]) for g in range(2)]
    path = tmp_path / "rollouts.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema(list(ROLLOUTS) + [pa.field("answer", pa.string())])),
                   path)
    try:
        metrics = score.run(score.ScoreConfig(reward_funcs=["format"], reward_num_workers=1), path, 2, out_dir)
    finally:
        reward_pools.close_pools()
    assert metrics["rollout/top_answer_frac"] == 1.0 and metrics["top_answer"] == "9"
    assert metrics["rollout/gold_top_answer_frac"] == pytest.approx(2 / 3)
    assert metrics["rollout/frac_identical_groups"] == 1.0 and metrics["rollout/distinct_answers"] == 1
    json.dumps(metrics)  # the manifest summary is JSON


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
    import flows.rounds

    real = flows.rounds.check_round
    monkeypatch.setattr(flows.rounds, "check_round",
                        lambda m, cfg, n, **kw: real({**m, "train/loss": math.nan}, cfg, n, **kw))
    with pytest.raises(TrainingUnhealthy, match="train/loss = nan") as nan:
        pipeline.posttrain_pipeline(str(config), common + ["health.min_completion_length=0"], quiet=True)
    assert nan.value.quarantined == optimize_dir.with_name(optimize_dir.name + ".unhealthy")
    assert str(nan.value.quarantined) in str(nan.value) and (nan.value.quarantined / "_manifest.json").exists()
    assert store.get("optimize", optimize_dir.name) is None
    (sft_dir,) = [p for p in (root / "sft").iterdir() if not p.name.startswith(".")]
    assert store.get("sft", sft_dir.name) is not None
