"""The built-in demo learns for real: a shortened quickstart (3 SFT epochs, 8 GRPO rounds) ends above
the best constant answer by a clear margin, with varied answers. Fails when the pipeline hands back a
policy that answers one thing to every prompt (the failure issue 12 measured: "9" to all prompts, scored
0.594 because 9 was the most common gold answer)."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
SHORT_QUICKSTART = ["sft.num_train_epochs=3", "grpo.rounds=8", "demo_data.num_eval=128",
                    "export.model_name=test-demo-learns", "name=test-demo-learns"]


# Scaled out on this machine: rewards on a local Ray instance's actors, every optimize round on 2 torchrun
# processes (gloo), its own rounds (rollout.seed 1: other prompts and samples). The same bar: issue 14's "reaches
# the same accuracy bar". It shares the one-process run's artifacts folder, so it starts from that run's SFT
# (train.* and score.backend are in no key); SFT on 2 processes equal to 1 is tests/test_distributed.py's.
SCALED_OUT = ["score.backend=ray", "train.num_processes=2", "rollout.seed=1"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """One artifacts folder for both runs (run in this order; either alone computes its own SFT)."""
    return tmp_path_factory.mktemp("demo-learns") / "artifacts"


@pytest.mark.parametrize("where", ["one process", "ray + 2 training processes"])
def test_trained_policy_beats_the_constant_answer(prefect_harness, artifacts, monkeypatch, where, ray_home):
    from flows.pipeline import posttrain_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    extra = []
    if where != "one process":
        pytest.importorskip("ray")
        monkeypatch.setenv("HOME", str(ray_home))  # Ray 2.60 keeps its auth token under ~/.ray (conftest.py)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        extra = SCALED_OUT
    try:
        results = posttrain_pipeline(str(QUICKSTART), [f"artifacts_dir={artifacts}",
                                                       *SHORT_QUICKSTART, *extra], quiet=True)
    finally:
        if extra:
            import ray

            from stages.scoring import reward_pools

            reward_pools.close_pools()
            ray.shutdown()
    baseline = results["constant_baseline"]
    assert baseline <= 0.25, "balanced demo answers: no constant answer scores above ~1/5"
    # measured here: base 0.305 -> 0.508 after 8 rounds, 3 distinct answers (top one 48%), baseline 0.203;
    # a policy that answers one thing to every prompt scores at most the baseline
    assert results["final_accuracy"] >= baseline + 0.10, results
    assert results["final_accuracy"] >= results["base_accuracy"] + 0.05, results
    assert results["final_distinct_answers"] >= 2 and not results["final_constant_policy"], results
    assert {row["stage"] for row in results["stages"] if row["status"] == "computed"} >= {
        f"{stage} r{r}" for stage in ("rollout", "score", "optimize") for r in range(8)}  # its own rounds
