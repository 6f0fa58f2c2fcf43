"""SCOPE-RL entropy control (arXiv:2510.08141; axolotl's trl.scope_rl, grpo.scope_* here; stages/training/scope_rl.py):
a share of each round's groups sampled again at clip(1 + H0 - H, t_min, t_max) times the temperature, their rows kept
at advantage 1 where the total reward reaches the threshold (else 0), weighed into the loss as mean(main) + alpha x
mean(auxiliary) with no KL and no sampling correction on them; H the entropy of the round that made the policy."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import tiny_say_policy
from flows.config import ConfigError
from stages.data.schemas import SCORED, write_table
from stages.rollout import rollout
from stages.rollout.engines import Policy
from stages.runtime.devices import DeviceConfig
from stages.training import grpo, scope_rl
from stages.training.grpo import GRPOConfig
from stages.training.grpo_loss import LossConfig, LossInputs, grpo_loss, k3_kl
from tasks.store import MANIFEST
from test_axolotl_async_keys import _config as axolotl  # loads, and the saved config loads as it is

SCOPE = dict(scope_rl=True, loss_type="grpo")


def test_the_auxiliary_groups_and_weights_are_axolotls():
    """axolotl's own cases (tests/core/test_scope.py): 512 groups at alpha 1/64 resample 8, never fewer than one;
    the weights make a mean over all rows mean(main) + alpha * mean(aux), non-positive auxiliary rows counted."""
    assert len(scope_rl.aux_groups(512, 1 / 64, seed=0)) == 8 and len(scope_rl.aux_groups(8, 1e-6, seed=0)) == 1
    assert scope_rl.aux_groups(8, 0.0, seed=0) == [] and scope_rl.aux_groups(0, 0.5, seed=0) == []
    assert scope_rl.aux_groups(32, 0.25, seed=3) == scope_rl.aux_groups(32, 0.25, seed=3)
    losses, aux = torch.tensor([0.0] * 8 + [5.0, 0.0, 0.0, 0.0]), torch.tensor([0.0] * 8 + [1.0] * 4)
    assert (losses * scope_rl.row_weights(aux, 0.25)).mean().item() == pytest.approx(0.25 * 5.0 / 4.0)
    assert scope_rl.row_weights(torch.zeros(4), 0.5).tolist() == [1.0] * 4


def test_the_temperature_follows_the_entropy_of_the_policy_sampled():
    on = GRPOConfig(**SCOPE)
    assert scope_rl.sampling(on, 0.3) == {"scope_alpha": 1 / 64, "scope_temperature": 1.2}  # collapsed: hotter
    assert scope_rl.sampling(on, 0.6)["scope_temperature"] == pytest.approx(0.9)  # above the target: colder
    assert scope_rl.sampling(on, None)["scope_temperature"] == 1.0  # no round yet: the target
    assert scope_rl.sampling(GRPOConfig(), 0.3) == {}


def test_the_loss_is_the_main_mean_plus_alpha_times_the_auxiliary_mean_with_kl_on_the_main_rows():
    """Known answers: ratio 1 (pi = pi_old), so each row's policy term is -A; k3 KL against the reference."""
    logps = torch.log(torch.tensor([[0.5, 0.4], [0.3, 0.6], [0.2, 0.2], [0.7, 0.1]]))
    ref = torch.log(torch.tensor([[0.4, 0.4], [0.5, 0.5], [0.1, 0.3], [0.6, 0.2]]))
    advantages, aux, alpha, beta = torch.tensor([1.0, -1.0, 1.0, 0.0]), torch.tensor([0.0, 0.0, 1.0, 1.0]), 0.25, 0.1
    weights = scope_rl.row_weights(aux, alpha)
    out = grpo_loss(LossInputs(logps, logps, advantages, torch.ones(4, 2), num_items_in_batch=8,
                               gradient_accumulation_steps=1, ref_logps=ref, row_weights=weights,
                               kl_weights=weights * (1 - aux)),
                    LossConfig("grpo", epsilon=0.2, epsilon_high=0.2, beta=beta, max_completion_length=2))
    kl = k3_kl(logps, ref, None).mean(dim=1)
    expected = (-advantages[:2]).mean() + alpha * (-advantages[2:]).mean() + beta * kl[:2].mean()
    assert out.loss.item() == pytest.approx(expected.item(), abs=1e-6)
    plain = grpo_loss(LossInputs(logps, logps, advantages, torch.ones(4, 2), num_items_in_batch=8,
                                 gradient_accumulation_steps=1, ref_logps=ref),
                      LossConfig("grpo", epsilon=0.2, epsilon_high=0.2, beta=beta, max_completion_length=2))
    assert plain.loss.item() != pytest.approx(expected.item(), abs=1e-3)


def test_auxiliary_rows_are_not_corrected_for_their_sampling_temperature():
    """Their sampling log-probs are at another temperature on purpose: their importance weight is 1, their KL
    weight 0; the main rows keep theirs."""
    batch = {"completion_mask": torch.ones(2, 2), "keep": torch.ones(2), "advantages": torch.tensor([1.0, 1.0]),
             "old_per_token_logps": torch.log(torch.tensor([[0.2, 0.2], [0.2, 0.2]])),
             "scope_weight": torch.tensor([1.5, 0.5]), "scope_aux": torch.tensor([0.0, 1.0])}
    old = torch.log(torch.tensor([[0.4, 0.4], [0.4, 0.4]]))
    inputs = grpo.loss_inputs(GRPOConfig(**SCOPE), batch, old, old, None, 4, 1)
    assert inputs.is_weights.flatten().tolist() == pytest.approx([2.0, 2.0, 1.0, 1.0])
    assert inputs.row_weights.tolist() == [1.5, 0.5] and inputs.kl_weights.tolist() == [1.5, 0.0]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A tiny "say i" policy and 8 prompts under the folder."""
    return tiny_say_policy(tmp_path_factory.mktemp("scope"), num_prompts=8)


def sample(root, out, **scope) -> list[dict]:
    (out).mkdir()
    cfg = rollout.RolloutConfig(num_generations=4, prompts_per_round=4, max_completion_length=6, temperature=0.9)
    summary = rollout.run(cfg, Policy(root / "model"), root / "prompts" / "train.parquet", 0, out, **scope)
    return pq.read_table(out / "rollouts.parquet").to_pylist(), summary


def test_the_rollout_samples_its_auxiliary_groups_again_at_their_temperature(policy_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    plain, _ = sample(policy_dir, tmp_path / "plain")
    rows, summary = sample(policy_dir, tmp_path / "scope", scope_alpha=0.5, scope_temperature=1.2)
    main, aux = rows[:16], rows[16:]
    assert [r["completion"] for r in main] == [r["completion"] for r in plain]  # the round's own, as without
    assert len(aux) == 8 and all(r["scope_aux"] for r in aux) and not any(r["scope_aux"] for r in main)
    assert [r["group_index"] for r in aux] == [0, 1, 2, 3] * 2 and all("-aux-" in r["rollout_id"] for r in aux)
    assert {r["prompt_id"] for r in aux} < {r["prompt_id"] for r in main}  # whole groups of the round's prompts
    assert (summary["scope/temperature"], summary["scope/aux_rows"], summary["rows"]) == (1.2, 8, 24)
    model = AutoModelForCausalLM.from_pretrained(policy_dir / "model")
    for row in aux:  # the recorded log-probs are those of logits / (0.9 x 1.2), not / 0.9
        ids = torch.tensor([row["prompt_token_ids"] + row["completion_token_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(row["prompt_token_ids"]) - 1: -1]
        tokens = torch.tensor(row["completion_token_ids"])
        hotter = torch.log_softmax(logits / (0.9 * 1.2), -1)[torch.arange(len(tokens)), tokens]
        plain_t = torch.log_softmax(logits / 0.9, -1)[torch.arange(len(tokens)), tokens]
        assert row["sampling_logprobs"] == pytest.approx(hotter.tolist(), abs=1e-4)
        assert row["sampling_logprobs"] != pytest.approx(plain_t.tolist(), abs=1e-4)


def test_the_score_keeps_positive_auxiliary_rows_at_advantage_one_and_reports_the_main_rows(policy_dir, tmp_path):
    from stages.scoring import reward_pools, score

    sample(policy_dir, tmp_path / "scope", scope_alpha=0.5, scope_temperature=1.2)
    cfg = score.ScoreConfig(reward_funcs=["toy_rewards.letters"], reward_num_workers=1)
    path = tmp_path / "scope" / "rollouts.parquet"
    main_only = tmp_path / "main.parquet"
    pq.write_table(pq.read_table(path).slice(0, 16).drop_columns(["scope_aux"]), main_only)
    try:
        (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
        with pytest.raises(ValueError, match="need grpo.scope_positive_threshold"):
            score.run(cfg, path, 4, tmp_path / "a")
        metrics = score.run(cfg, path, 4, tmp_path / "a", scope_positive_threshold=0.5)
        alone = score.run(cfg, main_only, 4, tmp_path / "b")
    finally:
        reward_pools.close_pools()
    scored = pq.read_table(tmp_path / "a" / "scored.parquet").to_pylist()
    assert [r["advantage"] for r in scored[16:]] == [1.0 if r["reward"] >= 0.5 else 0.0 for r in scored[16:]]
    assert metrics["scope/positive_frac"] == sum(r["reward"] >= 0.5 for r in scored[16:]) / 8
    reference = pq.read_table(tmp_path / "b" / "scored.parquet").to_pylist()
    assert [r["advantage"] for r in scored[:16]] == pytest.approx([r["advantage"] for r in reference])
    assert metrics["reward_mean"] == pytest.approx(alone["reward_mean"])  # the round's statistics: its main rows


WITH_AUX = SCORED.append(pa.field("scope_aux", pa.bool_()))


def scored_rows(n_main: int, n_aux: int) -> list[dict]:
    """Scored rows of a SCOPE-RL round: groups of 4, main ones alternating advantages, auxiliary ones 1 / 0."""
    return [{"rollout_id": f"r0-p{i // 4}-{'aux-' if i >= n_main else ''}g{i % 4}", "prompt_id": f"p{i // 4 % 2}",
             "group_index": i % 4, "prompt": [{"role": "user", "content": "say 1"}], "completion": "7",
             "prompt_token_ids": [1, 2], "completion_token_ids": [5, 6], "sampling_logprobs": [-1.0, -1.0],
             "round_index": 0, "policy_version": 0, "engine": "transformers", "finish_reason": "stop",
             "rerolled": False, "rewards": [("letters", 1.0)], "reward": 1.0,
             "advantage": (1.0 - 2 * (i % 2)) if i < n_main else float(i % 2), "errors": [],
             "scope_aux": i >= n_main} for i in range(n_main + n_aux)]


def test_the_optimize_stage_weighs_the_auxiliary_rows_over_the_round(policy_dir, tmp_path):
    rows = scored_rows(8, 4)
    plan = grpo.plan_round(GRPOConfig(**SCOPE, scope_alpha=0.25), [dict(r) for r in rows], 0)
    weights = {r["rollout_id"]: r["scope_weight"] for r in plan.rows}
    assert {w for k, w in weights.items() if "aux" in k} == {0.25 * 12 / 4} and \
        {w for k, w in weights.items() if "aux" not in k} == {12 / 8}
    with pytest.raises(ValueError, match="need grpo.scope_rl on"):
        grpo.plan_round(GRPOConfig(), [dict(r) for r in rows], 0)
    write_table(pa.Table.from_pylist(rows, schema=WITH_AUX), tmp_path / "scored.parquet", SCORED, extra_ok=True)
    (tmp_path / "out").mkdir()
    metrics = grpo.run(GRPOConfig(**SCOPE, micro_batch_size=4, gradient_accumulation_steps=3, learning_rate=1e-2),
                       policy_dir / "model", None, tmp_path / "scored.parquet", 0, 1.0, 6, tmp_path / "out",
                       devices=DeviceConfig(device="cpu"))
    assert metrics["optimizer_steps"] == 1 and metrics["grad_norm"] > 0


def test_replay_and_rerolls_leave_the_auxiliary_groups_alone(tmp_path):
    """An auxiliary group with no signal is not replaced, cached nor queued for a re-roll; replay keeps it."""
    from stages.scoring.replay import RoundSignals, run

    rows = scored_rows(4, 4)
    for row in rows:  # the main group has no signal and failed; the auxiliary one has signal
        row.update(advantage=0.0 if not row["scope_aux"] else row["advantage"], rewards=[("letters", 0.0)], reward=0.0)
    rows[4:] = [{**r, "prompt_id": "p0"} for r in rows[4:]]  # the same prompt as the main group
    write_table(pa.Table.from_pylist(rows, schema=WITH_AUX), tmp_path / "r0.parquet", SCORED, extra_ok=True)
    signals = RoundSignals(replay_buffer_size=4, reroll_start_round=0, reroll_max_groups=1, seed=0)
    assert signals.after_scoring(0, tmp_path / "r0.parquet", "score/r0") == []  # nothing cached to draw yet
    assert list(signals.reroll_queue) == ["p0"] and len(signals.buffer) == 0  # the main group's failure only
    (tmp_path / "out").mkdir()
    from stages.scoring.replay import CachedGroup, Replacement

    cached = CachedGroup(tmp_path / "r0.parquet", "score/r0", 0, "p0", 1.0)
    run(tmp_path / "r0.parquet", [Replacement("p0", cached)], 1, tmp_path / "out")
    out = pq.read_table(tmp_path / "out" / "scored.parquet").to_pylist()
    assert [r["scope_aux"] for r in out] == [False] * 4 + [True] * 4 and [r["replayed"] for r in out[4:]] == [False] * 4


AXOLOTL_SCOPE = ("rl: grpo\nmicro_batch_size: 4\ngradient_accumulation_steps: 2\ntrl:\n  use_data_producer: true\n"
                 "  async_prefetch: true            # REQUIRED -- auxiliary rollout runs only on this path\n"
                 "  loss_type: grpo                 # REQUIRED -- TRL defaults to dapo, which is incompatible\n"
                 "  scope_rl: true\n  scope_target_entropy: 0.5       # H0\n"
                 "  scope_alpha: 0.015625           # 1/64: share of groups resampled AND loss weight\n"
                 "  scope_positive_threshold: 1.0   # total reward counting as a positive sample\n")
"""axolotl's GRPO guide's SCOPE-RL block (docs/agents/grpo.md) on a config of a user's."""


def test_axolotls_scope_rl_block_lands_on_grpo_scope(tmp_path):
    cfg = axolotl(tmp_path, AXOLOTL_SCOPE)
    assert (cfg.grpo.scope_rl, cfg.grpo.scope_target_entropy, cfg.grpo.scope_alpha, cfg.grpo.scope_positive_threshold,
            cfg.grpo.loss_type, cfg.rollout.async_prefetch) == (True, 0.5, 0.015625, 1.0, "grpo", True)
    cfg = axolotl(tmp_path, AXOLOTL_SCOPE + "  scope_temperature_min: 0.9\n  scope_temperature_max: 1.1\n")
    assert (cfg.grpo.scope_temperature_min, cfg.grpo.scope_temperature_max) == (0.9, 1.1)


@pytest.mark.parametrize("text, message", [
    (AXOLOTL_SCOPE.replace("  loss_type: grpo ", "  #"), r"scope_rl with loss_type dapo: .*set loss_type: grpo"),
    (AXOLOTL_SCOPE + "  streaming_partial_batch: true\n", r"scope_rl with streaming_partial_batch"),
    (AXOLOTL_SCOPE + "  scope_temperature_min: 1.3\n", r"scope_temperature_min 1.3 is above scope_temperature_max"),
    (AXOLOTL_SCOPE + "  scope_alpha: 0\n", r"scope_alpha"),
    ("rl: ebft\ngrpo:\n  scope_rl: true\n  loss_type: grpo\n", r"grpo.scope_rl under rl: ebft"),
])
def test_what_scope_rl_cannot_mean_is_one_error_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        axolotl(tmp_path, text)


def test_the_rollout_task_samples_at_the_temperature_of_the_adapters_entropy(tmp_path, monkeypatch):
    """Round r's rollout gets the entropy of the optimize round that made its policy (its summary's `entropy`)."""
    from flows.config import PipelineConfig
    from tasks import stage_tasks
    from tasks.store import Artifact, ArtifactStore

    from conftest import Quiet

    monkeypatch.setattr(stage_tasks, "materialize", lambda ctx, stage, call, **_: call.arguments)
    ctx = stage_tasks.RunContext(PipelineConfig.model_validate({"grpo": {**SCOPE, "scope_target_entropy": 0.4}}),
                                 ArtifactStore(tmp_path), lineage=None, reporter=Quiet())
    policy, prompts = Artifact("sft", "p", tmp_path, {}), Artifact("transform", "t", tmp_path, {})
    adapter = Artifact("optimize", "a", tmp_path, {"summary": {"entropy": 0.25}})
    args = stage_tasks.rollout_task.fn(ctx, policy, adapter, prompts, 1, 1)
    assert (args["scope_alpha"], args["scope_temperature"]) == (1 / 64, pytest.approx(1.15))
    assert stage_tasks.rollout_task.fn(ctx, policy, None, prompts, 0, 0)["scope_temperature"] == 1.0


@pytest.mark.slow
def test_a_scope_rl_run_samples_each_round_at_the_temperature_of_the_last_rounds_entropy(prefect_harness, tiny_config):
    """Two tiny rounds with SCOPE-RL: round 1's auxiliary groups are sampled at clip(1 + H0 - H) where H is round
    0's optimize entropy, and every round scores and trains its auxiliary rows."""
    from flows.pipeline import posttrain_pipeline

    results = posttrain_pipeline(str(tiny_config), ["grpo.scope_rl=true", "grpo.loss_type=grpo",
                                                    "grpo.scope_alpha=0.5", "grpo.scope_positive_threshold=0.5"],
                                 quiet=True)
    stages = {row["stage"]: Path(row["path"]) for row in results["stages"]}
    manifest = {name: json.loads((folder / MANIFEST).read_text()) for name, folder in stages.items()
                if name.startswith(("rollout", "score", "optimize"))}
    entropy = manifest["optimize r0"]["summary"]["entropy"]
    assert manifest["rollout r0"]["summary"]["scope/temperature"] == 1.0 != manifest["rollout r1"]["summary"][
        "scope/temperature"]  # (the tiny policy's entropy is not the target)
    assert manifest["rollout r1"]["summary"]["scope/temperature"] == pytest.approx(
        scope_rl.scope_temperature(entropy, 0.5, 0.8, 1.2))
    for r in (0, 1):
        assert manifest[f"rollout r{r}"]["summary"]["scope/aux_rows"] == 16  # 4 of the 8 groups of 4, again
        assert 0.0 <= manifest[f"score r{r}"]["summary"]["scope/positive_frac"] <= 1.0
        assert manifest[f"optimize r{r}"]["summary"]["optimizer_steps"] >= 1
        table = pq.read_table(stages[f"score r{r}"] / "scored.parquet", columns=["scope_aux", "advantage"])
        aux = [a for a, flag in zip(table.column("advantage").to_pylist(), table.column("scope_aux").to_pylist())
               if flag]
        assert len(aux) == 16 and set(aux) <= {0.0, 1.0}
