"""GRPO learns: on a tiny random model with a toy reward, a few rounds change the LoRA
weights and raise the mean reward. Stages are called directly (no Prefect, no MLflow)."""

import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny_say_policy

from stages.rollout import rollout
from stages.rollout.engines import Policy
from stages.scoring import score
from stages.training import grpo


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    return tiny_say_policy(tmp_path_factory.mktemp("learning"), num_prompts=32)


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
        rollout.run(rollout_cfg, Policy(root / "model", adapter_dir=adapter, version=r),
                    root / "prompts" / "train.parquet", r, d)
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
    summary = rollout.run(cfg, Policy(root / "model", version=3), root / "prompts" / "train.parquet", 5, d)
    rows = pq.read_table(d / "rollouts.parquet").to_pylist()
    assert summary["rows"] == len(rows) == 8 and summary["staleness"] == 2
    for row in rows:
        assert row["policy_version"] == 3 and row["round_index"] == 5 and row["engine"] == "transformers"
        assert len(row["sampling_logprobs"]) == len(row["completion_token_ids"]) >= 1
        assert all(lp <= 0 for lp in row["sampling_logprobs"])
        assert row["finish_reason"] in ("stop", "length")
        assert (row["finish_reason"] == "length") == (len(row["completion_token_ids"]) == 6 and
                                                       row["completion_token_ids"][-1] != 2)
        assert row["answer"] is not None  # passthrough column kept for reward functions


@pytest.fixture(scope="module")
def scored_round(tiny_policy):
    """One scored round from the base policy (sampling log-probs = the trainer's own)."""
    root = tiny_policy
    d = root / "scored_round"
    d.mkdir()
    rollout.run(rollout.RolloutConfig(num_generations=4, prompts_per_round=8, max_completion_length=6),
                Policy(root / "model"), root / "prompts" / "train.parquet", 0, d)
    score.run(score.ScoreConfig(reward_funcs=["toy_rewards.letters"], reward_num_workers=1),
              d / "rollouts.parquet", 4, d)
    return d / "scored.parquet"


def _optimize(root, scored_path, out_name, **grpo_kwargs):
    """One round; pi_old is always recomputed, so the correction compares the sampler with the trainer."""
    cfg = grpo.GRPOConfig(micro_batch_size=16, gradient_accumulation_steps=2, reuse_sampling_logps=False,
                          **grpo_kwargs)
    out = root / out_name
    out.mkdir()
    return grpo.run(cfg, root / "model", None, scored_path, 0, 1.0, 6, out)


@pytest.mark.parametrize("do_sample", [False, True])
def test_shared_prompt_cache_changes_nothing(tiny_policy, monkeypatch, do_sample):
    """A prompt repeated in a batch (a GRPO group) is prefilled once; the completions and their log-probs are
    those of the plain batched generate (same seed)."""
    from stages.rollout.engines import Sampling, hf
    from stages.runtime.policy import load_policy

    model, tokenizer = load_policy(tiny_policy / "model")
    rows = pq.read_table(tiny_policy / "prompts" / "train.parquet").to_pylist()[:6]
    prompts = [list(r["prompt"]) for r in rows for _ in range(4)] + [list(rows[0]["prompt"])]
    sampling = Sampling(max_new_tokens=6, do_sample=do_sample, seed=3)

    def run():
        torch.manual_seed(3)
        return hf.generate(model, tokenizer, prompts, sampling, batch_size=16)

    shared = run()
    cache = hf.shared_prompt_cache(model, tokenizer([tokenizer.apply_chat_template(p, tokenize=False,
                                   add_generation_prompt=True) for p in prompts[:16]], return_tensors="pt",
                                   padding=True, add_special_tokens=False), [str(p) for p in prompts[:16]])
    assert cache is not None and cache.get_seq_length() > 0
    monkeypatch.setattr(hf, "shared_prompt_cache", lambda *args: None)
    plain = run()
    for a, b in zip(shared, plain, strict=True):
        assert a["completion_token_ids"] == b["completion_token_ids"] and a["prompt_token_ids"] == b["prompt_token_ids"]
        assert a["sampling_logprobs"] == pytest.approx(b["sampling_logprobs"], abs=1e-5)


def test_on_policy_rollouts_have_unit_ratios_and_nothing_masked(tiny_policy, scored_round):
    metrics = _optimize(tiny_policy, scored_round, "on_policy", vllm_importance_sampling_mode="sequence_mask",
                        off_policy_mask_threshold=0.5)
    # sampling and trainer log-probs come from the same weights: only float noise separates them
    assert metrics["is_ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["is_ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["off_policy_masked_frac"] == 0.0


def test_forced_large_ratio_is_truncated_or_masked(tiny_policy, scored_round):
    import pyarrow as pa

    table = pq.read_table(scored_round)
    rows = table.to_pylist()
    for i, row in enumerate(rows):
        if i % 2 == 0:  # the sampler "thought" these tokens 20x less likely than the trainer does
            row["sampling_logprobs"] = [lp - 3.0 for lp in row["sampling_logprobs"]]
    forced = scored_round.parent / "forced.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), forced)

    masked = _optimize(tiny_policy, forced, "seq_mask", vllm_importance_sampling_mode="sequence_mask",
                       vllm_importance_sampling_cap=3.0)
    assert masked["off_policy_masked_frac"] == pytest.approx(0.5)  # exactly the forced half

    truncated = _optimize(tiny_policy, forced, "tok_trunc", vllm_importance_sampling_mode="token_truncate",
                          vllm_importance_sampling_cap=3.0)
    assert truncated["is_ratio_max"] == pytest.approx(3.0)  # e^3 = 20 truncated at the cap
    assert truncated["off_policy_masked_frac"] == 0.0

    uncorrected = _optimize(tiny_policy, forced, "no_is", vllm_importance_sampling_correction=False)
    assert "is_ratio_mean" not in uncorrected and uncorrected["off_policy_masked_frac"] == 0.0


def test_full_fine_tuning_writes_a_complete_model(tiny_policy, scored_round):
    from transformers import AutoModelForCausalLM

    metrics = _optimize(tiny_policy, scored_round, "full_ft", adapter="none", learning_rate=1e-2, beta=0.04)
    out = tiny_policy / "full_ft"
    assert metrics["optimizer_steps"] == 1 and metrics["kl"] >= 0
    tuned = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tiny_policy / "model")
    changed = [n for (n, a), (_, b) in zip(tuned.named_parameters(), base.named_parameters()) if not torch.equal(a, b)]
    assert changed, "full fine-tuning changed no weight"
    assert (out / "tokenizer.json").exists() and (out / "optimizer.pt").exists()


def test_user_rollout_func_goes_through_the_same_schema(tiny_policy):
    root = tiny_policy
    d = root / "user_rollout"
    d.mkdir()
    cfg = rollout.RolloutConfig(num_generations=2, prompts_per_round=4, max_completion_length=6,
                                rollout_func="toy_rollouts.retry_unformatted")
    summary = rollout.run(cfg, Policy(root / "model"), root / "prompts" / "train.parquet", 0, d)
    rows = pq.read_table(d / "rollouts.parquet").to_pylist()
    assert summary["rows"] == len(rows) == 8
    for row in rows:
        assert row["engine"] == "transformers+toy_rollouts.retry_unformatted"
        assert len(row["sampling_logprobs"]) == len(row["completion_token_ids"]) >= 1
    # the retried rows carry the longer, two-turn prompt they were sampled from
    assert any(len(r["prompt_token_ids"]) > min(len(x["prompt_token_ids"]) for x in rows) for r in rows)
    score.run(score.ScoreConfig(reward_funcs=["toy_rewards.letters"], reward_num_workers=1),
              d / "rollouts.parquet", 2, d)  # and they score like any rollouts


@pytest.mark.parametrize("fn, message", [
    ("one_short", "returned 7 items for 8 prompts"),
    ("mismatched_logprobs", "item 0: .* completion_token_ids but .* sampling_logprobs"),
])
def test_broken_rollout_func_is_named(tiny_policy, fn, message):
    d = tiny_policy / f"broken_{fn}"
    d.mkdir()
    cfg = rollout.RolloutConfig(num_generations=2, prompts_per_round=4, max_completion_length=6,
                                rollout_func=f"toy_rollouts.{fn}")
    with pytest.raises(ValueError, match=f"rollout.rollout_func toy_rollouts.{fn}: {message}"):
        rollout.run(cfg, Policy(tiny_policy / "model"), tiny_policy / "prompts" / "train.parquet", 0, d)
    assert not (d / "rollouts.parquet").exists()


@pytest.mark.slow  # a whole run or process kill: `make test`, not `make test-fast`
def test_rollout_worker_process_writes_what_the_flow_process_writes(tiny_policy):
    """rollout.worker_process: same rollouts table (same seeds, same re-rolled prompts), progress
    forwarded, worker errors and a killed worker surface as clear errors, and the next call starts a
    new worker."""
    from stages.rollout.rollout_worker import RolloutWorker, RolloutWorkerError

    root = tiny_policy
    cfg = rollout.RolloutConfig(num_generations=2, prompts_per_round=4, max_completion_length=6)
    prompts = root / "prompts" / "train.parquet"
    here, there = root / "worker_here", root / "worker_there"
    here.mkdir(), there.mkdir()
    reroll = [pq.read_table(prompts, columns=["prompt_id"]).column("prompt_id")[-1].as_py()]
    rollout.run(cfg, Policy(root / "model", version=1), prompts, 2, here, reroll_prompt_ids=reroll)
    worker = RolloutWorker(torch_threads=1)
    seen = []
    try:
        summary = worker.run(cfg, Policy(root / "model", version=1), prompts, 2, there,
                             on_progress=lambda done, total: seen.append((done, total)), reroll_prompt_ids=reroll)
        assert summary["rows"] == 8 and summary["staleness"] == 1 and seen[-1] == (8, 8)
        assert summary["rerolled_prompts"] == 1
        columns = ["rollout_id", "completion_token_ids", "policy_version", "engine", "rerolled"]
        assert pq.read_table(there / "rollouts.parquet", columns=columns).to_pylist() == \
            pq.read_table(here / "rollouts.parquet", columns=columns).to_pylist()
        for a, b in zip(pq.read_table(there / "rollouts.parquet").column("sampling_logprobs").to_pylist(),
                        pq.read_table(here / "rollouts.parquet").column("sampling_logprobs").to_pylist()):
            assert a == pytest.approx(b, abs=1e-4)  # another process, another thread count: float noise only

        broken = rollout.RolloutConfig(num_generations=2, prompts_per_round=4, max_completion_length=6,
                                       rollout_func="toy_rollouts.one_short")
        (root / "worker_broken").mkdir()
        with pytest.raises(RolloutWorkerError, match="rollout.rollout_func toy_rollouts.one_short: returned 7"):
            worker.run(broken, Policy(root / "model"), prompts, 0, root / "worker_broken")

        worker._process.kill()
        (root / "worker_killed").mkdir()
        with pytest.raises(RolloutWorkerError, match="rollout worker process died"):
            worker.run(cfg, Policy(root / "model"), prompts, 0, root / "worker_killed")
        (root / "worker_again").mkdir()
        assert worker.run(cfg, Policy(root / "model"), prompts, 0, root / "worker_again")["rows"] == 8
    finally:
        worker.close()
    assert worker._process is None
