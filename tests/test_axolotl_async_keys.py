"""axolotl's async-GRPO `trl:` keys (docs/grpo.qmd "Async Training Features", docs/ebft.qmd; flows/axolotl.py
`_async_moves`, `_synced_round`): each one lands on the posttrain setting of the same meaning, says through
`posttrain validate` why it changes nothing where posttrain does the thing anyway, or is an error naming it.
"""

from __future__ import annotations

import re

import pytest

from flows.cli import main
from flows.config import ConfigError, PipelineConfig, load_config

BATCH = "rl: grpo\nmicro_batch_size: 2\ngradient_accumulation_steps: 4\n"
"""One TRL generation batch of 8 completions (steps_per_generation = gradient_accumulation_steps), one step."""


def _config(tmp_path, text: str) -> PipelineConfig:
    path = tmp_path / "axolotl.yaml"
    path.write_text(text)
    cfg = load_config(path)
    assert PipelineConfig.model_validate(cfg.run_config()) == cfg  # the saved config loads as it is
    return cfg


def _validate(tmp_path, capsys, text: str) -> str:
    """What `posttrain validate` prints to stderr (its notes) for `text`; it must succeed."""
    path = tmp_path / "axolotl.yaml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 0
    return capsys.readouterr().err


def test_the_async_grpo_example_loads_as_written(tmp_path, capsys):
    """docs/rlhf.qmd's "Full Async GRPO Example" trl keys: each lands where it means the same, the no-ops say so
    (its streaming_partial_batch: true: tests/test_axolotl_streaming.py)."""
    text = (BATCH + "adapter: lora\ntrl:\n  use_data_producer: true\n  use_vllm: true\n  async_prefetch: true\n"
            "  prefetch_depth: 1\n  vllm_sync_interval: 2\n  vllm_lora_sync: true\n"
            "  vllm_importance_sampling_correction: true\n  off_policy_mask_threshold: 0.5\n"
            "  importance_sampling_level: token\n  num_generations: 8\n  max_completion_length: 512\nmax_steps: 200\n")
    cfg = _config(tmp_path, text)
    assert (cfg.rollout.engine, cfg.rollout.async_prefetch, cfg.rollout.prefetch_depth, cfg.rollout.lag()) == (
        "vllm", True, 1, 1)
    assert cfg.rollout.vllm.lora_sync == "adapter"
    assert cfg.grpo.vllm_importance_sampling_correction is True and cfg.grpo.off_policy_mask_threshold == 0.5
    # vllm_sync_interval 2 with one step per generation batch: a round is the 2 batches between pushes
    assert (cfg.rollout.prompts_per_round, cfg.grpo.rounds) == (2, 100)
    err = _validate(tmp_path, capsys, text)
    assert "note: trl.use_data_producer: true (axolotl's key) is not needed here" in err
    assert "rollout.async_prefetch, on in this config" in err
    assert "one round is the 2 generation batches between two weight pushes" in err
    streamed = _config(tmp_path, text.replace("  num_generations",
                                              "  streaming_partial_batch: true\n  num_generations"))
    assert streamed.grpo.streaming_partial_batch and streamed.grpo.rounds == 100


@pytest.mark.parametrize("key, value, field, expected", [
    ("async_prefetch", "true", "rollout.async_prefetch", True),
    ("vllm_importance_sampling_correction", "false", "grpo.vllm_importance_sampling_correction", False),
    ("vllm_importance_sampling_mode", "sequence_mask", "grpo.vllm_importance_sampling_mode", "sequence_mask"),
    ("vllm_importance_sampling_cap", "2.0", "grpo.vllm_importance_sampling_cap", 2.0),
    ("off_policy_mask_threshold", "0.5", "grpo.off_policy_mask_threshold", 0.5),
    ("use_bias_correction_kl", "false", "grpo.use_bias_correction_kl", False),
    ("vllm_lora_sync", "true", "rollout.vllm.lora_sync", "adapter"),
    ("vllm_lora_sync", "false", "rollout.vllm.lora_sync", "merged"),
    ("replay_buffer_size", "16", "grpo.replay_buffer_size", 16),
    ("replay_recompute_logps", "false", "grpo.replay_recompute_logps", False),
    ("reroll_start_fraction", "0.5", "grpo.reroll_start_fraction", 0.5),
    ("reroll_max_groups", "2", "grpo.reroll_max_groups", 2),
    ("skip_zero_advantage_batches", "false", "grpo.skip_zero_advantage_batches", False),
    ("reward_num_workers", "3", "score.reward_num_workers", 3),
])
def test_keys_of_the_same_meaning_land_on_posttrains(tmp_path, key, value, field, expected):
    adapter = "adapter: lora\n" if key == "vllm_lora_sync" else ""  # (no `adapter:`: axolotl's full fine-tuning)
    cfg = _config(tmp_path, f"{BATCH}{adapter}trl:\n  use_vllm: true\n  {key}: {value}\n")
    target = cfg
    for part in field.split("."):
        target = getattr(target, part)
    assert target == expected


def test_vllm_lora_sync_on_the_server_is_adapter_or_merged_weights(tmp_path):
    """Two terminals: true registers each round's adapter on the server (/v1/load_lora_adapter), false loads the
    adapter merged into the weights (the server's /collective_rpc), as TRL merges before its NCCL push."""
    for value, expected in (("true", "adapter"), ("false", "merged")):
        cfg = _config(tmp_path, f"{BATCH}adapter: lora\ntrl:\n  vllm_lora_sync: {value}\n"
                                "rollout:\n  engine: vllm_server\n")
        assert (cfg.rollout.engine, cfg.rollout.vllm.lora_sync) == ("vllm_server", expected)


def test_prefetch_depth_is_rollout_prefetch_depth_with_the_lag_it_asks_for(tmp_path, capsys):
    """axolotl's background thread samples prefetch_depth generation batches ahead with no other cap; posttrain's lag
    is the smaller of prefetch_depth and max_staleness, so an unset max_staleness follows the depth."""
    text = BATCH + "trl:\n  async_prefetch: true\n  prefetch_depth: 2\n"
    cfg = _config(tmp_path, text)
    assert (cfg.rollout.prefetch_depth, cfg.rollout.max_staleness, cfg.rollout.lag()) == (2, 2, 2)
    assert ("note: trl.prefetch_depth: 2 (axolotl's key) -> rollout.prefetch_depth: 2, rollout.max_staleness: 2"
            in _validate(tmp_path, capsys, text))
    cfg = _config(tmp_path, text + "rollout:\n  max_staleness: 3\n")
    assert (cfg.rollout.prefetch_depth, cfg.rollout.max_staleness) == (2, 3)


@pytest.mark.parametrize("text, note", [
    (BATCH + "trl:\n  use_data_producer: true\n  async_prefetch: false\n",
     "trl.use_data_producer: true (axolotl's key) is not needed here: each round's rollout stage is posttrain's data "
     "producer"),
    (BATCH + "trl:\n  streaming_partial_batch: false\n",
     "trl.streaming_partial_batch: false (axolotl's key): what posttrain does"),
    (BATCH + "adapter:\ntrl:\n  use_vllm: true\n  vllm_lora_sync: false\n",
     "trl.vllm_lora_sync: false (axolotl's key): what posttrain does under full fine-tuning"),
    (BATCH + "trl:\n  use_vllm: true\n  vllm_sync_interval: 1\n",
     "trl.vllm_sync_interval 1: the engine gets the policy once per round"),
])
def test_keys_posttrain_honours_anyway_say_why_in_validate(tmp_path, capsys, text, note):
    notes = [line for line in _validate(tmp_path, capsys, text).splitlines() if line.startswith("note: ")]
    assert any(note in line for line in notes), notes


@pytest.mark.parametrize("trl, mbs_gas, max_steps, prompts, rounds", [
    ("num_generations: 4\n  vllm_sync_interval: 3", (2, 4), 20, 6, 7),  # docs/ebft.qmd: 3 one-step batches a round
    ("num_generations: 8\n  vllm_sync_interval: 1", (2, 4), 20, 1, 20),  # a push every batch: TRL's round
    # a generation batch of 2 steps (steps_per_generation 8): axolotl checks the interval only when it samples, so
    # 3 means a push every 6 steps, 3 batches
    ("num_generations: 8\n  steps_per_generation: 8\n  vllm_sync_interval: 3", (2, 4), 24, 6, 4),
    # 2 generation batches make a step (steps_per_generation 2): a push every 2 steps is 4 batches
    ("num_generations: 2\n  steps_per_generation: 2\n  vllm_sync_interval: 2", (2, 4), 10, 8, 5),
])
def test_vllm_sync_interval_makes_a_round_the_batches_between_two_pushes(tmp_path, trl, mbs_gas, max_steps, prompts,
                                                                         rounds):
    from stages.training.grpo import round_steps

    mbs, gas = mbs_gas
    cfg = _config(tmp_path, f"rl: grpo\nmicro_batch_size: {mbs}\ngradient_accumulation_steps: {gas}\n"
                            f"trl:\n  use_vllm: true\n  {trl}\nmax_steps: {max_steps}\n")
    assert (cfg.rollout.prompts_per_round, cfg.grpo.rounds) == (prompts, rounds)
    interval = int(re.search(r"vllm_sync_interval: (\d+)", trl).group(1))
    steps = round_steps(cfg.grpo, prompts * cfg.rollout.num_generations, cfg.rollout.num_generations)
    assert steps % interval == 0 or interval % steps == 0  # one engine load per round: every push, and only those


@pytest.mark.parametrize("text, message", [
    (BATCH + "trl:\n  streaming_partial_batch: true\n", r"trl.streaming_partial_batch: true: axolotl streams only on "
                                                        r"its async path"),
    (BATCH + "trl:\n  prefetch_depth: 2\n", r"trl.prefetch_depth: 2: how far trl.async_prefetch samples ahead, but "
                                           r"async_prefetch is off"),
    (BATCH + "trl:\n  async_prefetch: true\n  prefetch_depth: 3\nrollout:\n  max_staleness: 2\n",
     r"trl.prefetch_depth 3 and rollout.max_staleness 2"),
    (BATCH + "adapter:\ntrl:\n  use_vllm: true\n  vllm_lora_sync: true\n",
     r"trl.vllm_lora_sync: true sends vLLM a LoRA adapter, but this run trains the full model"),
    (BATCH + "trl:\n  vllm_lora_sync: true\n", r"trl.vllm_lora_sync: true: how a LoRA adapter reaches vLLM, but this "
                                              r"run samples with rollout.engine transformers"),
    (BATCH + "trl:\n  vllm_sync_interval: 2\n",
     r"trl.vllm_sync_interval: 2: how often axolotl pushes the trainer's weights to vLLM, but this run samples with "
     r"rollout.engine transformers"),
    (BATCH + "trl:\n  use_vllm: true\n  vllm_sync_interval: 3\nrollout:\n  prompts_per_round: 1\n",
     r"trl.vllm_sync_interval 3 and rollout.prompts_per_round 1: posttrain loads the policy into the engine once per "
     r"round"),
    (BATCH + "trl:\n  use_vllm: true\n  num_iterations: 2\n  vllm_sync_interval: 4\n",
     r"trl.vllm_sync_interval 4 with num_iterations 2"),
    (BATCH + "trl:\n  use_vllm: true\n  vllm_sync_interval: 0\n", r"trl.vllm_sync_interval: 0; expected a whole "
                                                                  r"number >= 1"),
    ("rl: dpo\ntrl:\n  vllm_sync_interval: 2\n", r"trl.vllm_sync_interval: TRL's GRPO generation batch and its weight "
                                                 r"pushes to vLLM; rl is 'dpo'"),
    (BATCH + "trl:\n  streaming_min_groups: 1\n",
     r"trl.streaming_min_groups: 1: the chunk size of trl.streaming_partial_batch, which is unset"),
])
def test_what_posttrain_cannot_honour_is_an_error_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, text)


def test_vllm_sync_interval_under_the_users_own_round_must_be_its_steps(tmp_path):
    cfg = _config(tmp_path, BATCH + "trl:\n  use_vllm: true\n  num_generations: 4\n  vllm_sync_interval: 2\n"
                                    "rollout:\n  prompts_per_round: 4\n")
    assert cfg.rollout.prompts_per_round == 4  # 16 completions: 2 steps of 8, one push
