"""EBFT (stages/training/ebft.py): the feature-matching reward against a hand-computed example, the pooling and
whitening against independent computations, the config's validation, and a tiny run whose reward rises."""

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny_say_policy

from flows.config import ConfigError, load_config
from stages.rollout import rollout
from stages.rollout.engines import Policy
from stages.training import ebft, grpo

R2 = math.sqrt(2.0)


def test_reward_matches_hand_computed_example():
    """One prompt, three completions, features not unit length (the reward normalizes them first):
    ref (2, 0) -> (1, 0); completions (3, 0) -> (1, 0), (0, 5) -> (0, 1), (1, 1) -> (1, 1)/sqrt 2.
    alignment_j = 2 cos(phi_j, phi_ref) = 2, 0, sqrt 2.
    diversity_j = 2/(n-1) sum_{j'!=j} phi_j.phi_j' with phi_1.phi_2 = 0, phi_1.phi_3 = phi_2.phi_3 = 1/sqrt 2:
    1/sqrt 2, 1/sqrt 2, sqrt 2.
    feature distance ||mean_j phi_j - phi_ref||^2 = ((1 + 1/sqrt2)/3 - 1)^2 + ((1 + 1/sqrt2)/3)^2."""
    gen = torch.tensor([[3.0, 0.0], [0.0, 5.0], [1.0, 1.0]])
    ref = torch.tensor([[2.0, 0.0]])
    out = ebft.feature_matching_rewards(gen, ref, 3)
    assert out["alignment"].tolist() == pytest.approx([2.0, 0.0, R2])
    assert out["diversity"].tolist() == pytest.approx([1 / R2, 1 / R2, R2])
    assert out["reward"].tolist() == pytest.approx([2 - 1 / R2, -1 / R2, 0.0], abs=1e-6)
    m = (1 + 1 / R2) / 3
    assert out["feature_distance"].item() == pytest.approx((m - 1) ** 2 + m**2)
    weighted = ebft.feature_matching_rewards(gen, ref, 3, alignment_coef=0.5, diversity_coef=2.0)
    assert weighted["reward"].tolist() == pytest.approx([1 - 2 / R2, -2 / R2, R2 / 2 - 2 * R2], abs=1e-6)
    # RLOO: r_j minus the mean of the other two rewards
    r = [2 - 1 / R2, -1 / R2, 0.0]
    rloo = ebft.advantages(torch.tensor(r, dtype=torch.float64), 3, "rloo")
    assert rloo.tolist() == pytest.approx([r[0] - (r[1] + r[2]) / 2, r[1] - (r[0] + r[2]) / 2,
                                           r[2] - (r[0] + r[1]) / 2])
    assert ebft.advantages(torch.tensor(r), 3, "reinforce").tolist() == pytest.approx(r)
    grpo_adv = ebft.advantages(torch.tensor(r, dtype=torch.float64), 3, "grpo", "none")
    assert grpo_adv.tolist() == pytest.approx([x - sum(r) / 3 for x in r])


def test_groups_are_scored_separately():
    """Two prompts: each completion's diversity counts only its own group, each alignment its own reference."""
    gen = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    out = ebft.feature_matching_rewards(gen, torch.tensor([[1.0, 0.0], [1.0, 0.0]]), 2)
    assert out["alignment"].tolist() == pytest.approx([2.0, 2.0, 0.0, 0.0])
    assert out["diversity"].tolist() == pytest.approx([2.0, 2.0, 2.0, 2.0])
    assert out["feature_distance"].item() == pytest.approx((0.0 + 2.0) / 2)  # group 2's mean (0, 1) is sqrt 2 away


def test_whitening_is_the_inverse_square_root_of_the_group_gram():
    """whiten: phi W with W = (phi^T phi)^(-1/2) on phi's row space (numpy eigendecomposition, independently)."""
    g = torch.Generator().manual_seed(0)
    phi = torch.randn(4, 6, generator=g, dtype=torch.float64)
    ref = torch.randn(1, 6, generator=g, dtype=torch.float64)
    w_phi, w_ref = ebft.whiten(phi, ref)
    vals, vecs = np.linalg.eigh(phi.numpy().T @ phi.numpy())
    keep = vals > 1e-10 * vals.max()
    w = (vecs[:, keep] / np.sqrt(vals[keep])) @ vecs[:, keep].T
    np.testing.assert_allclose(w_phi.numpy(), phi.numpy() @ w, atol=1e-8)
    np.testing.assert_allclose(w_ref.numpy(), ref.numpy() @ w, atol=1e-8)
    whitened = ebft.feature_matching_rewards(phi, ref, 4, use_whitening=True)
    # whitened completions are orthonormal: no pairwise similarity left, so no diversity penalty
    assert whitened["diversity"].abs().max().item() < 1e-8


def test_pooling_methods():
    hidden = torch.arange(2 * 4 * 1, dtype=torch.float32).view(2, 4, 1)  # values 0..3 and 4..7
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    prompt_lengths = torch.tensor([1, 2])
    assert ebft.pool(hidden, "last_token", mask).flatten().tolist() == [2.0, 7.0]
    assert ebft.pool(hidden, "mean_pooling", mask).flatten().tolist() == [1.0, 5.5]
    assert ebft.pool(hidden, "completion_mean", mask, prompt_lengths).flatten().tolist() == [1.5, 6.5]
    # tokens at length // 4, length // 2, 3 * length // 4: (0, 1, 2) and (1, 2, 3)
    assert ebft.pool(hidden, "concat", mask).tolist() == [[0.0, 1.0, 2.0], [5.0, 6.0, 7.0]]
    assert ebft.layer_indices([0.25, 0.5, 0.75, 1.0], 4) == [1, 2, 3, 4]


def test_reference_template_names_missing_column():
    assert ebft.reference_text("<answer>{answer}</answer>", {"answer": "7"}, "x") == "<answer>7</answer>"
    with pytest.raises(ValueError, match=r"x: ebft.ground_truth '\{ground_truth\}' names column 'ground_truth'.*"
                                         r"\['answer', 'prompt_id'\]"):
        ebft.reference_text("{ground_truth}", {"answer": "7", "prompt_id": "p"}, "x")
    assert ebft.strip_special([5, 6, 2, 0], {0, 2}) == [5, 6]


def _config(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path)


def test_config_ebft_options(tmp_path):
    cfg = _config(tmp_path, "rl: ebft\nebft: {n_samples_per_prompt: 4, generate_max_len: 12}\n")
    assert cfg.uses_rounds and cfg.rollout.num_generations == 4 and cfg.rollout.max_completion_length == 12
    assert _config(tmp_path, "rl: ebft\nrollout: {num_generations: 6}\n").rollout.num_generations == 6
    # axolotl's name for group normalization
    assert _config(tmp_path, "rl: ebft\nebft: {advantage_estimator: group_norm}\n").ebft.advantage_estimator == "grpo"
    with pytest.raises(ConfigError, match="did you mean 'ebft.alignment_coef'"):
        _config(tmp_path, "rl: ebft\nebft: {alignment_cof: 1.0}\n")
    with pytest.raises(ConfigError, match="did you mean 'ebft.n_samples_per_prompt'"):
        _config(tmp_path, "rl: ebft\nebft: {n_sample_per_prompt: 4}\n")
    with pytest.raises(ConfigError, match="ebft.n_samples_per_prompt is 4 but rollout.num_generations is 8"):
        _config(tmp_path, "rl: ebft\nebft: {n_samples_per_prompt: 4}\nrollout: {num_generations: 8}\n")
    with pytest.raises(ConfigError, match="ebft.generate_max_len is 8 but rollout.max_completion_length is 16"):
        _config(tmp_path, "rl: ebft\nebft: {generate_max_len: 8}\nrollout: {max_completion_length: 16}\n")
    # axolotl's strided sampling keys are rollout's under rl: ebft (both modes)
    sampled = _config(tmp_path, "rl: ebft\nebft: {temperature: 0.6, top_p: 0.9}\n").rollout
    assert (sampled.temperature, sampled.top_p) == (0.6, 0.9)
    with pytest.raises(ConfigError, match="ebft.temperature is 0.6 but rollout.temperature is 1.0"):
        _config(tmp_path, "rl: ebft\nebft: {temperature: 0.6}\nrollout: {temperature: 1.0}\n")
    with pytest.raises(ConfigError, match="ebft.rl_coef and ebft.ce_coef are both 0"):
        _config(tmp_path, "rl: ebft\nebft: {rl_coef: 0}\n")
    with pytest.raises(ConfigError, match="ebft.stride belongs to mode: strided"):
        _config(tmp_path, "rl: ebft\nebft: {stride: 8}\n")
    with pytest.raises(ConfigError, match=r"feature_layers are fractions .* got \[2.0\]"):
        _config(tmp_path, "rl: ebft\nebft: {feature_layers: [0.5, 2.0]}\n")
    with pytest.raises(ConfigError, match="name the prompt row's column"):
        _config(tmp_path, "rl: ebft\nebft: {ground_truth: answer}\n")
    with pytest.raises(ConfigError, match="ebft.embed_method: got 'last'.*'last_token'"):
        _config(tmp_path, "rl: ebft\nebft: {embed_method: last}\n")
    with pytest.raises(ConfigError, match="ebft.advantage_estimator: got 'ppo'.*'rloo'"):
        _config(tmp_path, "rl: ebft\nebft: {advantage_estimator: ppo}\n")


@pytest.fixture(scope="module")
def say_prompts(tmp_path_factory):
    """tiny_say_policy (untrained: root / "model") and "say i" prompts whose `ground_truth` column (the default
    ebft.ground_truth template reads it) is "7" for every prompt."""
    import json

    from stages.data import transform

    root = tiny_say_policy(tmp_path_factory.mktemp("ebft"), num_prompts=32)
    raw = [{"question": f"say {i}", "answer": str(i), "ground_truth": "7"} for i in range(32)]
    (root / "ebft.jsonl").write_text("\n".join(json.dumps(r) for r in raw))
    (root / "ebft_prompts").mkdir()
    transform.run(transform.TransformConfig(), {"train": root / "ebft.jsonl"}, root / "ebft_prompts")
    return root


@pytest.fixture(scope="module")
def tiny_policy(say_prompts):
    """say_prompts with root / "policy": its model SFT'd on "say i" -> "i" or "i + 1" (so it answers with digits)."""
    import json

    from stages.data import transform
    from stages.training import sft

    root = say_prompts
    raw = [{"question": f"say {i % 32}", "answer": str(i % 32), "teacher_completion": str(i % 32 + i % 2)}
           for i in range(320)]
    (root / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in raw))
    (root / "sft_prompts").mkdir()
    transform.run(transform.TransformConfig(), {"sft": root / "sft.jsonl"}, root / "sft_prompts")
    sft.run(sft.SFTConfig(num_train_epochs=40, learning_rate=1e-2, save_steps=None), root / "model",
            root / "sft_prompts" / "sft.parquet", root / "policy")
    return root


@pytest.mark.slow  # a whole run or process kill: `make test`, not `make test-fast`
def test_tiny_run_raises_the_feature_matching_reward(tiny_policy):
    """Rollout -> EBFT score (features of the frozen starting policy) -> GRPO optimize, 8 rounds: the mean
    feature-matching reward rises and the feature distance to the reference falls (measured: reward -2.6 ->
    0.04, distance 2.7 -> 0.03), with a CE term on the reference (ce_coef)."""
    root = tiny_policy
    model = root / "policy"
    rollout_cfg = rollout.RolloutConfig(num_generations=8, prompts_per_round=32, max_completion_length=3)
    cfg = ebft.EBFTConfig(embed_method="completion_mean", ce_coef=0.01)
    grpo_cfg = grpo.GRPOConfig(learning_rate=2e-2, micro_batch_size=64, gradient_accumulation_steps=1, lora_r=8,
                               lora_alpha=16)
    adapter, history = None, []
    for r in range(8):
        d = root / f"r{r}"
        d.mkdir()
        rollout.run(rollout_cfg, Policy(model, adapter_dir=adapter, version=r),
                    root / "ebft_prompts" / "train.parquet", r, d)
        history.append(ebft.run(cfg, d / "rollouts.parquet", model, 8, "group", d))
        metrics = grpo.run(grpo_cfg, model, adapter, d / "scored.parquet", r, 1.0, 3, d, ce_coef=cfg.ce_coef)
        assert metrics["ce_loss"] > 0
        adapter = d
    rows = pq.read_table(root / "r0" / "scored.parquet").to_pylist()
    terms = dict(rows[0]["rewards"])
    assert set(terms) == {"alignment", "diversity"}  # per-sample terms in the lineage
    assert rows[0]["reward"] == pytest.approx(terms["alignment"] - terms["diversity"])
    assert rows[0]["reference_token_ids"]
    rewards = [h["reward_mean"] for h in history]
    distances = [h["ebft/feature_distance"] for h in history]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.5, rewards
    assert sum(distances[-2:]) / 2 < sum(distances[:2]) / 2 - 0.5, distances


def test_rl_coef_weights_the_policy_gradient_loss(say_prompts, tmp_path):
    """axolotl's rl_coef: loss = rl_coef * GRPO's + ce_coef * CE. Doubling it doubles the step's gradient (one
    step, from the same weights); at 0 the loss is the CE term alone. (The untrained policy: any weights do.)"""
    root, model = say_prompts, say_prompts / "model"
    rollout.run(rollout.RolloutConfig(num_generations=8, prompts_per_round=32, max_completion_length=3),
                Policy(model, version=0), root / "ebft_prompts" / "train.parquet", 0, tmp_path)
    ebft.run(ebft.EBFTConfig(embed_method="completion_mean"), tmp_path / "rollouts.parquet", model, 8, "group",
             tmp_path)
    one_step = grpo.GRPOConfig(learning_rate=2e-2, micro_batch_size=256, gradient_accumulation_steps=1, lora_r=8,
                               lora_alpha=16)

    def step(rl_coef: float, ce_coef: float) -> dict:
        out = tmp_path / f"rl{rl_coef}-ce{ce_coef}"
        return grpo.run(one_step, model, None, tmp_path / "scored.parquet", 0, 1.0, 3, out, ce_coef=ce_coef,
                        rl_coef=rl_coef)

    plain, double = step(1.0, 0.0), step(2.0, 0.0)
    assert plain["optimizer_steps"] == 1 and plain["grad_norm"] > 0
    assert double["grad_norm"] == pytest.approx(2 * plain["grad_norm"], rel=1e-4)
    ce_only = step(0.0, 0.01)
    assert ce_only["loss"] == pytest.approx(0.01 * ce_only["ce_loss"], rel=1e-5)


def test_keys_cover_the_feature_model_and_the_ebft_options(monkeypatch, tmp_path):
    """The score key of rl: ebft changes with the frozen feature model and any ebft option it reads; ce_coef and
    rl_coef enter the optimize key (and only when not 0 and 1: a GRPO run's optimize keys stay as they were)."""
    from conftest import Quiet
    from test_cache_keys import artifact

    from flows.config import PipelineConfig
    from tasks import stage_tasks
    from tasks.store import ArtifactStore

    monkeypatch.setattr(stage_tasks, "materialize", lambda ctx, stage, call, **_:
                        stage_tasks.artifact_key(ctx.store, stage, call))

    def context(config: dict):
        return stage_tasks.RunContext(PipelineConfig.model_validate(config), ArtifactStore(tmp_path / "artifacts"),
                                      lineage=None, reporter=Quiet())

    rollouts, policy, scored = (artifact(s, tmp_path) for s in ("rollout", "sft", "score"))

    def score_key(config: dict, feature_model: str = "policy") -> str:
        if config.get("rl") == "ebft":
            return stage_tasks.ebft_score_task.fn(context(config), rollouts, 0, artifact(feature_model, tmp_path))
        return stage_tasks.score_task.fn(context(config), rollouts, 0)

    def optimize_key(config: dict) -> str:  # with the ce_coef and rl_coef flows/recipes/ebft.py hands the task
        ebft_section = context(config).config.ebft if config.get("rl") == "ebft" else None
        weights = (ebft_section.ce_coef, ebft_section.rl_coef) if ebft_section else (0.0, 1.0)
        return stage_tasks.optimize_task.fn(context(config), policy, None, scored, 0, *weights)

    ebft_run = {"rl": "ebft"}
    keys = {score_key(ebft_run), score_key(ebft_run, "other_policy"), score_key({"rl": "grpo"}),
            score_key({"rl": "ebft", "ebft": {"diversity_coef": 0.5}}),
            score_key({"rl": "ebft", "ebft": {"ground_truth": "<answer>{answer}</answer>"}}),
            score_key({"rl": "ebft", "score": {"scale_rewards": "none"}})}
    assert len(keys) == 6
    assert optimize_key(ebft_run) == optimize_key({"rl": "grpo"})
    assert optimize_key({"rl": "ebft", "ebft": {"ce_coef": 0.1}}) != optimize_key(ebft_run)
    assert optimize_key({"rl": "ebft", "ebft": {"rl_coef": 0.5}}) != optimize_key(ebft_run)
    # sampling keys are rollout's: the score key does not hold them (the rollout key holds rollout.temperature)
    assert score_key({"rl": "ebft", "ebft": {"temperature": 0.6}}) == score_key(ebft_run)


@pytest.mark.slow
def test_ebft_pipeline_end_to_end_then_cached(prefect_harness, tiny_config, tmp_path):
    """rl: ebft through the flow: the GRPO round stages, score artifacts with the SFT policy as the frozen
    feature model among their inputs, ebft/* metrics per round in MLflow, and a rerun that computes nothing."""
    import json

    from mlflow import MlflowClient

    from conftest import computed
    from flows.pipeline import posttrain_pipeline
    from tasks.store import MANIFEST

    root = tmp_path / "artifacts"
    overrides = ["rl=ebft", "grpo.rounds=2", 'ebft.ground_truth="<answer>{answer}</answer>"']
    first = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    assert [row["stage"] for row in first["stages"]] == [
        "demo_data", "transform", "base_model", "sft", "eval base", "rollout r0", "score r0", "optimize r0",
        "rollout r1", "score r1", "optimize r1", "export", "eval final"]
    sft_key = next(row["path"] for row in first["stages"] if row["stage"] == "sft").rsplit("/", 1)[-1]
    for folder in (root / "score").iterdir():
        manifest = json.loads((folder / MANIFEST).read_text())
        assert manifest["inputs"]["feature_model"] == f"sft/{sft_key}"
        assert {"ebft/alignment", "ebft/diversity", "ebft/feature_distance"} <= set(manifest["summary"])
        rows = pq.read_table(folder / "scored.parquet").to_pylist()
        assert all(set(dict(r["rewards"])) == {"alignment", "diversity"} for r in rows)
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    for name in ("ebft/alignment", "ebft/diversity", "ebft/feature_distance", "rewards/alignment/mean"):
        assert [m.step for m in client.get_metric_history(first["mlflow_run_id"], name)] == [1, 2], name
    second = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    assert computed(second) == []
