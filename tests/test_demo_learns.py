"""The built-in demo learns for real: a shortened quickstart (3 SFT epochs, 8 GRPO rounds) ends above
the best constant answer by a clear margin, with varied answers. Fails when the pipeline hands back a
policy that answers one thing to every prompt (the failure issue 12 measured: "9" to all prompts, scored
0.594 because 9 was the most common gold answer)."""

from pathlib import Path

import pytest
from conftest import computed, copy_warm_stages

pytestmark = pytest.mark.slow

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
SHORT_QUICKSTART = ["sft.num_train_epochs=3", "grpo.rounds=8", "demo_data.num_eval=128",
                    "export.model_name=test-demo-learns", "name=test-demo-learns"]


# Scaled out on this machine: rewards on a local Ray instance's actors, every optimize round on 2 torchrun
# processes (gloo). The same bar: issue 14's "reaches the same accuracy bar". (SFT on 2 processes equals SFT on
# one, 1e-5: tests/test_distributed.py; here both runs start from one SFT.)
SCALED_OUT = ["score.backend=ray", "train.num_processes=2"]


@pytest.fixture(scope="module")
def prepared(prefect_harness, tmp_path_factory):
    """An artifacts folder holding the short quickstart's stages up to its SFT (computed once: ~45% of the
    scaled-out run's CPU); each run below starts from a copy and computes its own rounds."""
    from flows.pipeline import prepare_policy_flow

    store = tmp_path_factory.mktemp("prepared") / "artifacts"
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        prepare_policy_flow(str(QUICKSTART), [f"artifacts_dir={store}", *SHORT_QUICKSTART], quiet=True)
    return store


@pytest.mark.parametrize("where", ["one process", "ray + 2 training processes"])
def test_trained_policy_beats_the_constant_answer(prepared, tmp_path, monkeypatch, where, ray_home):
    from flows.pipeline import posttrain_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    copy_warm_stages(prepared, tmp_path / "artifacts")  # the stages up to SFT (conftest.WARM_STAGES)
    extra = []
    if where != "one process":
        pytest.importorskip("ray")
        monkeypatch.setenv("HOME", str(ray_home))  # Ray 2.60 keeps its auth token under ~/.ray (conftest.py)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        extra = SCALED_OUT
    try:
        results = posttrain_pipeline(str(QUICKSTART), [f"artifacts_dir={tmp_path / 'artifacts'}",
                                                       *SHORT_QUICKSTART, *extra], quiet=True)
    finally:
        if extra:
            import ray

            from stages.scoring import reward_pools

            reward_pools.close_pools()
            ray.shutdown()
    assert "sft" not in computed(results)
    assert [f"optimize r{k}" for k in range(8)] == [s for s in computed(results) if s.startswith("optimize")]
    baseline = results["constant_baseline"]
    assert baseline <= 0.25, "balanced demo answers: no constant answer scores above ~1/5"
    # measured here: base 0.305 -> 0.508 after 8 rounds, 3 distinct answers (top one 48%), baseline 0.203;
    # a policy that answers one thing to every prompt scores at most the baseline
    assert results["final_accuracy"] >= baseline + 0.10, results
    assert results["final_accuracy"] >= results["base_accuracy"] + 0.05, results
    assert results["final_distinct_answers"] >= 2 and not results["final_constant_policy"], results
