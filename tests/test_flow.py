"""The whole pipeline under the Prefect test harness: every stage runs, artifacts,
MLflow runs and the exported model are left behind, a second run computes nothing, and
a stage folder that lost its manifest is recomputed."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from conftest import computed
from tasks.store import MANIFEST

pytestmark = pytest.mark.slow


@pytest.mark.first_run  # asserts that a first run computes every stage
def test_pipeline_end_to_end_then_cached_then_heals(prefect_harness, tiny_config, tmp_path):
    from flows.pipeline import posttrain_pipeline

    root = tmp_path / "artifacts"
    first = posttrain_pipeline(str(tiny_config), ["grpo.rounds=2"], quiet=True)
    stages = [row["stage"] for row in first["stages"]]
    assert stages == ["demo_data", "transform", "base_model", "sft", "eval base", "rollout r0", "score r0",
                      "optimize r0", "rollout r1", "score r1", "optimize r1", "export", "eval final"]
    assert computed(first) == stages

    # Parquet artifacts with the shared schemas
    rollouts = pq.read_table(next((root / "rollout").glob("*/rollouts.parquet")))
    assert {"prompt_token_ids", "completion_token_ids", "sampling_logprobs", "policy_version", "finish_reason",
            "engine"} <= set(rollouts.column_names)
    scored = pq.read_table(next((root / "score").glob("*/scored.parquet")))
    assert {"rewards", "reward", "advantage", "errors"} <= set(scored.column_names)
    for folder in (root / "optimize").iterdir():
        manifest = json.loads((folder / MANIFEST).read_text())
        assert "adapter_model.safetensors" in manifest["files"] and manifest["inputs"]["scored"].startswith("score/")

    # exported model loads with plain transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export_dir = Path(first["exported_model"])
    assert (export_dir / "model.safetensors").exists() and (export_dir / "README.md").exists()
    AutoModelForCausalLM.from_pretrained(export_dir)
    assert AutoTokenizer.from_pretrained(export_dir).chat_template

    # MLflow: parent with tags, params, per-round metrics, eval at step 0 and last, nested stage runs, registry
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    parent = client.get_run(first["mlflow_run_id"])
    for tag in ("prefect.flow_run_id", "git_commit", "config_hash", "artifact_root"):
        assert parent.data.tags.get(tag), tag
    assert parent.data.params["grpo.rounds"] == "2"
    history = client.get_metric_history(parent.info.run_id, "train/reward_mean")
    assert [m.step for m in history] == [1, 2]
    for name in ("train/reward_std", "train/kl", "train/loss", "train/clip_ratio", "train/completion_length",
                 "train/grad_norm"):
        assert len(client.get_metric_history(parent.info.run_id, name)) == 2, name
    assert sorted(m.step for m in client.get_metric_history(parent.info.run_id, "eval/accuracy")) == [0, 2]
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {c.data.tags["posttrain.stage"] for c in children} >= {"sft", "rollout r0", "optimize r1", "export"}
    for child in children:  # a stage's step-by-step metrics are not logged a second time from its summary
        for key in child.data.metrics:
            steps = [m.step for m in client.get_metric_history(child.info.run_id, key)]
            assert len(steps) == len(set(steps)), (child.data.tags["posttrain.stage"], key, steps)
    assert [d.dataset.name for d in parent.inputs.dataset_inputs] == ["prompts-train", "prompts-eval"]
    versions = client.search_model_versions("name='test-tiny'")
    assert len(versions) == 1 and versions[0].run_id == parent.info.run_id
    assert len(client.get_metric_history(parent.info.run_id, "rewards/accuracy/mean")) == 2  # per reward function

    # what a user sees of the completions: an MLflow table per round, Prefect table/markdown artifacts
    tables = [f.path for f in client.list_artifacts(parent.info.run_id, "completions")]
    assert tables == ["completions/round_000.json", "completions/round_001.json"]
    table = json.loads(Path(client.download_artifacts(parent.info.run_id, tables[0], str(tmp_path))).read_text())
    assert {"prompt", "completion", "reward", "advantage", "reward/accuracy", "errors"} <= set(table["columns"])
    assert len(table["data"]) == 8
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as prefect:
        keys = {a.key: a.type for a in prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="test-tiny")))}
    assert keys == {"test-tiny-completions": "table", "test-tiny-rounds": "table", "test-tiny-summary": "markdown"}

    # the same command again computes nothing
    second = posttrain_pipeline(str(tiny_config), ["grpo.rounds=2"], quiet=True)
    assert computed(second) == []
    assert second["final_accuracy"] == first["final_accuracy"]
    # and its MLflow run shows what the first one's does (the cached rounds are logged in one go)
    assert second["mlflow_run_id"] != parent.info.run_id
    assert [m.step for m in client.get_metric_history(second["mlflow_run_id"], "train/reward_mean")] == [1, 2]
    assert [f.path for f in client.list_artifacts(second["mlflow_run_id"], "completions")] == tables
    for run_id in (parent.info.run_id, second["mlflow_run_id"]):  # listed as tables in the MLflow UI
        logged = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
        assert [t["path"] for t in logged if t["path"].startswith("completions/")] == tables

    # a stage folder whose manifest is gone does not exist: only it is recomputed
    victim = next((root / "score").iterdir())
    (victim / MANIFEST).unlink()
    third = posttrain_pipeline(str(tiny_config), ["grpo.rounds=2"], quiet=True)
    assert len(computed(third)) == 1 and computed(third)[0].startswith("score")
    assert (victim / MANIFEST).exists()

    # a file deleted under a manifest: the run says which folder is damaged and recomputes that stage alone
    next((root / "rollout").glob("*/rollouts.parquet")).unlink()
    healed = posttrain_pipeline(str(tiny_config), ["grpo.rounds=2"], quiet=True)
    assert len(computed(healed)) == 1 and computed(healed)[0].startswith("rollout")
    assert [w for w in healed["warnings"] if "rollouts.parquet is missing" in w]

    # a file changed in place (same size): `posttrain verify` hashes every file (a run checks it before reuse too),
    # --repair sets the folder aside, and the next run recomputes that stage alone
    from flows.cli import main as cli

    changed = next((root / "score").glob("*/scored.parquet"))
    data = bytearray(changed.read_bytes())
    data[len(data) // 2] ^= 0xFF
    changed.write_bytes(bytes(data))
    assert cli(["verify", "--artifacts", str(root)]) == 1
    assert cli(["verify", "--artifacts", str(root), "--repair"]) == 0
    assert not changed.exists() and list((root / "score" / ".damaged").iterdir())
    assert cli(["verify", "--artifacts", str(root)]) == 0
    repaired = posttrain_pipeline(str(tiny_config), ["grpo.rounds=2"], quiet=True)
    assert len(computed(repaired)) == 1 and computed(repaired)[0].startswith("score")

    # one more round reuses rounds 0 and 1
    fourth = posttrain_pipeline(str(tiny_config), ["grpo.rounds=3"], quiet=True)
    assert computed(fourth) == ["rollout r2", "score r2", "optimize r2", "export", "eval final"]


def test_async_prefetch_is_stale_by_one_and_staleness_zero_equals_sync(prefect_harness, tiny_config, tmp_path):
    from flows.pipeline import posttrain_pipeline

    root = tmp_path / "artifacts"
    common = ["grpo.rounds=3", "grpo.vllm_importance_sampling_mode=sequence_mask"]
    sync = posttrain_pipeline(str(tiny_config), common, quiet=True)

    # max_staleness 0 is the synchronous schedule: the very same artifacts, nothing to compute
    same = posttrain_pipeline(str(tiny_config), common + ["rollout.async_prefetch=true", "rollout.max_staleness=0"],
                              quiet=True)
    assert computed(same) == [] and same["final_accuracy"] == sync["final_accuracy"]

    stale = posttrain_pipeline(str(tiny_config), common + ["rollout.async_prefetch=true"], quiet=True)
    # round 0 samples the base policy either way; rounds 1 and 2 sample one round behind
    assert sorted(computed(stale)) == sorted(["rollout r1", "score r1", "optimize r1", "rollout r2", "score r2",
                                              "optimize r2", "export", "eval final"])  # concurrent: any order
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")

    def history(results, name):
        return [m.value for m in sorted(client.get_metric_history(results["mlflow_run_id"], name),
                                        key=lambda m: m.step)]

    assert history(stale, "rollout/staleness") == [0, 1, 1]
    assert history(sync, "rollout/staleness") == [0, 0, 0]
    # on-policy rounds: ratios are 1 up to float noise and nothing is masked
    assert all(abs(v - 1) < 1e-3 for v in history(sync, "train/is_ratio_mean"))
    assert history(sync, "train/off_policy_masked_frac") == [0, 0, 0]
    for name in ("time/generate_s", "time/score_s", "time/optimize_s", "time/waiting_s", "rollout/tokens_per_s",
                 "train/is_ratio_max"):
        assert len(history(stale, name)) == 3, name
    versions = []
    for r in range(3):
        folder = stale["stages"][[row["stage"] for row in stale["stages"]].index(f"rollout r{r}")]["path"]
        table = pq.read_table(Path(folder) / "rollouts.parquet", columns=["round_index", "policy_version"])
        versions.append(set(zip(*table.to_pydict().values())))
    assert versions == [{(0, 0)}, {(1, 0)}, {(2, 1)}]


def test_serve_vllm_prints_a_server_command_for_the_starting_policy(prefect_harness, tiny_config, tmp_path, capsys):
    from flows.cli import main

    assert main(["serve-vllm", str(tiny_config), "--print", "--quiet", "--port", "8123"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    sft_dirs = list((tmp_path / "artifacts" / "sft").iterdir())
    assert len(sft_dirs) == 1 and (sft_dirs[0] / MANIFEST).exists()  # the policy was built and cached
    assert f"--model {sft_dirs[0]}" in line and "--port 8123" in line
    # on CPU lora_sync auto loads each round's adapter merged into the weights (POST /collective_rpc): no LoRA
    assert "--worker-extension-cls" in line and "--enable-lora" not in line
    assert line.startswith("VLLM_SERVER_DEV_MODE=1")


def test_dpo_pipeline_end_to_end_then_cached(prefect_harness, tiny_config, tmp_path):
    import yaml

    from flows.pipeline import posttrain_pipeline

    root = tmp_path / "artifacts"
    config = yaml.safe_load(tiny_config.read_text())
    for section in ("rollout", "score", "grpo"):  # a DPO-family run reads none of them (set there: an error)
        config.pop(section)
    tiny_config.write_text(yaml.safe_dump(config))
    overrides = ["rl=dpo", "demo_pairs.num_train=32", "demo_pairs.num_eval=16", "dpo.max_steps=4",
                 "dpo.micro_batch_size=8", "dpo.logging_steps=1", "dpo.learning_rate=1e-3"]
    first = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    assert [row["stage"] for row in first["stages"]] == ["demo_data", "transform", "base_model", "sft", "eval base",
                                                          "preferences", "dpo", "export", "eval final"]
    assert first["preference_accuracy_base"] is not None and first["preference_accuracy_final"] is not None
    prefs = pq.read_table(next((root / "preferences").glob("*/train.parquet")))
    assert prefs.num_rows == 32 and set(prefs.column("kind").to_pylist()) == {"pair"}

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    parent = client.get_run(first["mlflow_run_id"])
    assert parent.data.params["rl"] == "dpo" and parent.data.params["dpo.rl"] == "dpo"
    steps = sorted(m.step for m in client.get_metric_history(parent.info.run_id, "eval/preference_accuracy"))
    assert steps == [0, 1]
    assert {"prompts-train", "prompts-eval", "preferences-train", "preferences-eval"} <= {
        d.dataset.name for d in parent.inputs.dataset_inputs}
    (dpo_run,) = client.search_runs([parent.info.experiment_id],
                                    filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                                                  "and tags.`posttrain.stage` = 'dpo'")
    margins = client.get_metric_history(dpo_run.info.run_id, "preference/rewards/margins")
    assert [m.step for m in margins] == [1, 2, 3, 4]  # per optimizer step, nested under the pipeline run
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(first["exported_model"])

    second = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    assert computed(second) == []


def test_reward_model_scores_grpo_and_is_a_recorded_input(prefect_harness, tiny_config, tmp_path):
    from flows.pipeline import posttrain_pipeline

    root = tmp_path / "artifacts"
    overrides = ["grpo.rounds=2", "score.reward_funcs=[reward_model, format]", "score.reward_weights=[1.0, 0.1]",
                 "demo_pairs.num_train=32", "demo_pairs.num_eval=16", "demo_pairs.rejected=mixed",
                 "reward_model.max_steps=4", "reward_model.micro_batch_size=8", "reward_model.logging_steps=1"]
    first = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    stages = [row["stage"] for row in first["stages"]]
    assert stages[5:8] == ["preferences", "reward_model", "rollout r0"]
    rm_dir = next((root / "reward_model").iterdir())
    for folder in (root / "score").iterdir():  # every round's scores name the reward model as an input
        manifest = json.loads((folder / MANIFEST).read_text())
        assert manifest["inputs"]["reward_model"] == f"reward_model/{rm_dir.name}"
        scored = pq.read_table(folder / "scored.parquet").to_pylist()
        assert all(isinstance(r["rewards"]["reward_model"] if isinstance(r["rewards"], dict)
                              else dict(r["rewards"])["reward_model"], float) for r in scored)
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    parent = client.get_run(first["mlflow_run_id"])
    assert "reward_model/eval_pairwise_accuracy" in parent.data.metrics
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert "reward_model" in {c.data.tags["posttrain.stage"] for c in children}
    assert computed(posttrain_pipeline(str(tiny_config), overrides, quiet=True)) == []
