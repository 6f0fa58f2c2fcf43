"""GRPO learns: on a tiny random model with a toy reward, a few rounds change the LoRA
weights and raise the mean reward. Stages are called directly (no Prefect, no MLflow)."""

import pyarrow.parquet as pq
import pytest
import torch

from stages import base_model, grpo, rollout, score, transform


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    texts = [f"<|im_start|>user\nsay {i}<|im_end|>\n<|im_start|>assistant\n{i * 7}<|im_end|>" for i in range(200)]
    cfg = base_model.BaseModelConfig(vocab_size=300, hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
                                     intermediate_size=128, num_hidden_layers=2)
    base_model.run(cfg, texts, root / "model")
    rows = [{"question": f"say {i}", "answer": str(i)} for i in range(32)]
    (root / "prompts").mkdir()
    import json

    (root / "raw.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    transform.run(transform.TransformConfig(), {"train": root / "raw.jsonl"}, root / "prompts")
    return root


def test_grpo_rounds_change_weights_and_raise_reward(tiny_policy):
    root = tiny_policy
    rollout_cfg = rollout.RolloutConfig(num_generations=8, prompts_per_round=16, max_completion_length=8)
    score_cfg = score.ScoreConfig(reward_funcs=["toy_rewards.letters"], reward_num_workers=1)
    grpo_cfg = grpo.GRPOConfig(learning_rate=5e-2, micro_batch_size=64, gradient_accumulation_steps=1, lora_r=8,
                               lora_alpha=16)
    adapter, rewards = None, []
    for r in range(8):
        d = root / f"r{r}"
        d.mkdir()
        rollout.run(rollout_cfg, root / "model", adapter, root / "prompts" / "train.parquet", r, r, d)
        rewards.append(score.run(score_cfg, d / "rollouts.parquet", 8, d)["reward_mean"])
        metrics = grpo.run(grpo_cfg, root / "model", adapter, d / "scored.parquet", r, 1.0, 8, d)
        adapter = d
        assert metrics["optimizer_steps"] == 2
    from safetensors.torch import load_file

    weights = load_file(str(adapter / "adapter_model.safetensors"))
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    assert lora_b and all(torch.count_nonzero(w) > 0 for w in lora_b)  # LoRA B starts at zero
    assert (adapter / "optimizer.pt").exists()
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.02, rewards


def test_rollout_records_policy_version_and_logprobs(tiny_policy):
    root = tiny_policy
    d = root / "check"
    d.mkdir()
    cfg = rollout.RolloutConfig(num_generations=2, prompts_per_round=4, max_completion_length=6)
    summary = rollout.run(cfg, root / "model", None, root / "prompts" / "train.parquet", 3, 3, d)
    rows = pq.read_table(d / "rollouts.parquet").to_pylist()
    assert summary["rows"] == len(rows) == 8
    for row in rows:
        assert row["policy_version"] == 3 and row["engine"] == "transformers"
        assert len(row["sampling_logprobs"]) == len(row["completion_token_ids"]) >= 1
        assert all(lp <= 0 for lp in row["sampling_logprobs"])
        assert row["finish_reason"] in ("stop", "length")
        assert (row["finish_reason"] == "length") == (len(row["completion_token_ids"]) == 6 and
                                                       row["completion_token_ids"][-1] != 2)
        assert row["answer"] is not None  # passthrough column kept for reward functions
