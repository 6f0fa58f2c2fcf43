"""axolotl's streaming scoring (trl.streaming_partial_batch, trl.streaming_min_groups; grpo.streaming_* here): a
round's prompt groups are taken a chunk at a time, each chunk's rows shuffled and cut into micro-batches of their
own, and every advantage statistic is its group's, as axolotl's AsyncGRPOTrainer._score_streaming and
_compute_streaming_group_scores do; axolotl streams only with trl.async_prefetch, and the keys say so otherwise."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from conftest import tiny_round, write_scored
from test_axolotl_async_keys import _config as axolotl  # loads, and the saved config loads as it is
from flows.config import ConfigError
from stages.runtime.devices import DeviceConfig
from stages.scoring.advantages import gdpo_advantages, group_advantages, streaming_advantages
from stages.training import grpo
from stages.training.grpo import GRPOConfig, plan_round, round_steps


def rows(groups: int, generations: int) -> list[dict]:
    """A round's scored rows laid out group by group, as the score stage writes them (advantages all nonzero)."""
    return [{"rollout_id": f"p{g}-{i}", "prompt_id": f"p{g}", "group_index": i, "advantage": 1.0 - 2 * (i % 2)}
            for g in range(groups) for i in range(generations)]


def test_each_chunks_micro_batches_hold_only_its_own_groups_in_sampled_order():
    """5 groups of 4, 2 groups a chunk, micro_batch_size 3: chunks of 8, 8 and 4 rows, each shuffled and cut into
    3 + 3 + 2 (the last 4: 3 + 1), 8 micro-batches, 4 steps of 2; every row once."""
    cfg = GRPOConfig(streaming_partial_batch=True, streaming_min_groups=2, micro_batch_size=3,
                     gradient_accumulation_steps=2)
    plan = plan_round(cfg, rows(5, 4), round_index=0)
    cut = [mb for step in plan.steps for mb in step]
    assert [len(mb) for mb in cut] == [3, 3, 2, 3, 3, 2, 3, 1] and [len(s) for s in plan.steps] == [2, 2, 2, 2]
    chunk_of = {f"p{g}": g // 2 for g in range(5)}
    assert [{chunk_of[r["prompt_id"]] for r in mb} for mb in cut] == [{0}] * 3 + [{1}] * 3 + [{2}] * 2
    assert sorted(r["rollout_id"] for mb in cut for r in mb) == sorted(r["rollout_id"] for r in rows(5, 4))
    assert plan.steps_per_round == round_steps(cfg, 20, 4) == 4
    assert [r["prompt_id"] for r in cut[0] + cut[1] + cut[2]] != [r["prompt_id"] for r in rows(2, 4)]  # shuffled


def test_without_streaming_a_micro_batch_draws_from_the_whole_round():
    """TRL's (and posttrain's default) cut: the round shuffled as a whole, so groups of different chunks meet."""
    cfg = GRPOConfig(micro_batch_size=3, gradient_accumulation_steps=2)
    cut = [mb for step in plan_round(cfg, rows(5, 4), round_index=0).steps for mb in step]
    assert [len(mb) for mb in cut] == [3] * 6 + [2]
    assert any(len({int(r["prompt_id"][1:]) // 2 for r in mb}) > 1 for mb in cut)
    assert round_steps(cfg, 20, 4) == 4


def test_round_steps_counts_the_smaller_last_micro_batch_of_each_chunk():
    """axolotl cuts each chunk on its own: one group of 4 per chunk with micro_batch_size 8 makes a micro-batch
    of 4 per group, twice TRL's count; a chunk that fills its micro-batches counts the same as TRL."""
    half = GRPOConfig(streaming_partial_batch=True, micro_batch_size=8, gradient_accumulation_steps=2)
    assert [len(mb) for step in plan_round(half, rows(6, 4), 0).steps for mb in step] == [4] * 6
    assert round_steps(half, 24, 4) == plan_round(half, rows(6, 4), 0).steps_per_round == 3
    assert round_steps(half.model_copy(update={"streaming_partial_batch": False}), 24, 4) == 2
    full = GRPOConfig(streaming_partial_batch=True, streaming_min_groups=2, micro_batch_size=8,
                      gradient_accumulation_steps=2)
    assert round_steps(full, 24, 4) == round_steps(full.model_copy(update={"streaming_partial_batch": False}), 24, 4)


def test_streaming_advantages_are_each_groups_own():
    """axolotl's _compute_streaming_group_scores: the group's mean and std only (scale_rewards batch acts as group;
    GDPO's last normalization is per group), on hand-written rewards with known answers."""
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [3.0, 1.0], [3.0, 0.0]], dtype=torch.float64)  # 2 groups of 2
    weights = torch.tensor([1.0, 1.0], dtype=torch.float64)
    totals = rewards.sum(dim=1)  # 1, 0, 4, 3
    batch = streaming_advantages(totals, rewards, weights, 2, "sum_then_normalize", "batch")
    assert batch.tolist() == pytest.approx([0.5 / (0.5 ** 0.5 + 1e-4), -0.5 / (0.5 ** 0.5 + 1e-4)] * 2)
    assert batch.tolist() == pytest.approx(group_advantages(totals, 2, "group").tolist())
    assert batch.tolist() != pytest.approx(group_advantages(totals, 2, "batch").tolist())  # TRL's batch std differs
    assert streaming_advantages(totals, rewards, weights, 2, "sum_then_normalize", "none").tolist() == \
        pytest.approx([0.5, -0.5, 0.5, -0.5])
    gdpo = streaming_advantages(totals, rewards, weights, 2, "normalize_then_sum", "group")
    # per function within the group: f0 group 1 is (0, 0) -> 0; f1 (1, 0) -> +-0.707; group 2: f0 (0, 0) -> 0 (3 = 3,
    # std 0), f1 (1, 0) -> +-0.707; the sums +-0.707 normalized within each group again: +-0.707
    first = 0.5 / (0.5 ** 0.5 + 1e-4)
    assert gdpo.tolist() == pytest.approx([first / (2 * first ** 2) ** 0.5, -first / (2 * first ** 2) ** 0.5] * 2,
                                          rel=1e-3)
    assert gdpo.tolist() != pytest.approx(gdpo_advantages(rewards, weights, 2).tolist(), rel=1e-3)


@pytest.fixture(scope="module")
def round_rows(tmp_path_factory):
    """A tiny policy and one round of its rollouts (4 prompts x 4 completions) under the folder."""
    root = tmp_path_factory.mktemp("streaming")
    return root, tiny_round(root, num_prompts=4, prompts_per_round=4)


def test_the_score_stage_normalizes_per_group_when_streaming(round_rows, tmp_path):
    """score.run with `streaming` (what grpo.streaming_partial_batch hands it): scale_rewards batch divides by each
    group's std, the group's own advantages; without it, by the round's."""
    from stages.scoring import reward_pools, score

    root, _ = round_rows
    cfg = score.ScoreConfig(reward_funcs=["toy_rewards.letters"], scale_rewards="batch", reward_num_workers=1)
    seen = {}
    try:
        for streaming in (True, False):
            out = tmp_path / str(streaming)
            out.mkdir()
            score.run(cfg, root / "rollouts" / "rollouts.parquet", 4, out, streaming=streaming)
            table = pq.read_table(out / "scored.parquet")
            totals = torch.tensor(table.column("reward").to_pylist(), dtype=torch.float64)
            expected = group_advantages(totals, 4, "group" if streaming else "batch")
            seen[streaming] = table.column("advantage").to_pylist()
            assert seen[streaming] == pytest.approx(expected.tolist())
    finally:
        reward_pools.close_pools()
    assert seen[True] != pytest.approx(seen[False])


def test_a_streaming_round_trains_on_its_chunks_and_takes_the_counted_steps(round_rows, tmp_path):
    root, rollouts = round_rows
    write_scored(tmp_path / "scored.parquet", rollouts, [(1.0, -0.5, 0.8, -1.3)[r["group_index"]] for r in rollouts])
    cfg = GRPOConfig(streaming_partial_batch=True, micro_batch_size=8, gradient_accumulation_steps=2,
                     learning_rate=1e-2, skip_zero_advantage_batches=False)
    (tmp_path / "out").mkdir()
    metrics = grpo.run(cfg, root / "model", None, tmp_path / "scored.parquet", 0, 1.0, 6, tmp_path / "out",
                       devices=DeviceConfig(device="cpu"))
    # 4 groups of 4, one group a chunk: 4 micro-batches of 4 (not TRL's 2 of 8), 2 steps
    assert metrics["optimizer_steps"] == round_steps(cfg, 16, 4) == 2
    assert metrics["grad_norm"] > 0


def test_streaming_reaches_the_score_key(key_of, tmp_path):
    from tasks import stage_tasks
    from tasks.store import Artifact

    rollouts = Artifact("rollout", "round-0", tmp_path, {})
    plain = key_of(stage_tasks.score_task, {}, rollouts, 0)
    assert key_of(stage_tasks.score_task, {"grpo": {"streaming_partial_batch": True}}, rollouts, 0) != plain
    assert key_of(stage_tasks.score_task, {"grpo": {"streaming_partial_batch": False}}, rollouts, 0) == plain


ASYNC = "rl: grpo\nmicro_batch_size: 8\ngradient_accumulation_steps: 2\ntrl:\n  use_data_producer: true\n" \
        "  async_prefetch: true\n"
"""axolotl's async GRPO (docs/grpo.qmd "Async Training Features"), where its streaming path runs."""


def test_the_grpo_guides_streaming_block_streams(tmp_path):
    """docs/grpo.qmd's "Streaming partial batch" block under its async section; docs/rlhf.qmd's full async example
    sets streaming_partial_batch: true alone (axolotl's default chunk, 1 group)."""
    cfg = axolotl(tmp_path, ASYNC + "  streaming_partial_batch: true\n  streaming_min_groups: 1\n")
    assert (cfg.grpo.streaming_partial_batch, cfg.grpo.streaming_min_groups) == (True, 1)
    cfg = axolotl(tmp_path, ASYNC + "  streaming_partial_batch: true\n  streaming_min_groups: 3\n")
    assert cfg.grpo.streaming_min_groups == 3
    cfg = axolotl(tmp_path, ASYNC + "  streaming_partial_batch: true\n")
    assert (cfg.grpo.streaming_partial_batch, cfg.grpo.streaming_min_groups) == (True, None)


def test_axolotl_max_steps_under_streaming_counts_its_smaller_micro_batches(tmp_path):
    """max_steps 12 with one group of 4 a chunk and micro_batch_size 8: axolotl's micro-batches hold 4 rows, so a
    generation batch of 8 prompts (micro_batch_size 8 x steps_per_generation 4 = 32 completions) is 4 steps where
    TRL's would be 2: 3 rounds, not 6."""
    text = ASYNC.replace("gradient_accumulation_steps: 2", "gradient_accumulation_steps: 2\nmax_steps: 12") + \
        "  num_generations: 4\n  steps_per_generation: 4\n"
    streamed = axolotl(tmp_path, text + "  streaming_partial_batch: true\n")
    plain = axolotl(tmp_path, text)
    assert (streamed.rollout.prompts_per_round, plain.rollout.prompts_per_round) == (8, 8)
    assert (streamed.grpo.rounds, plain.grpo.rounds) == (3, 6)


def test_a_note_says_where_streaming_changes_the_advantages(tmp_path):
    cfg = axolotl(tmp_path, ASYNC + "  streaming_partial_batch: true\n  scale_rewards: batch\n")
    assert any("every advantage statistic is its group's" in n and "scale_rewards batch acts as group" in n
               for n in cfg.translation_notes)
    cfg = axolotl(tmp_path, ASYNC.replace("rl: grpo", "rl: gdpo") + "  streaming_partial_batch: true\n")
    assert any("normalize_then_sum's last normalization is per group" in n for n in cfg.translation_notes)
    cfg = axolotl(tmp_path, ASYNC + "  streaming_partial_batch: true\n")
    assert not any("advantage statistic" in n for n in cfg.translation_notes)  # group scaling: nothing changes


@pytest.mark.parametrize("text, message", [
    ("rl: grpo\ntrl:\n  streaming_partial_batch: true\n",
     r"trl.streaming_partial_batch: true: axolotl streams only on its async path \(trl.async_prefetch: true\)"),
    (ASYNC + "  streaming_min_groups: 2\n",
     r"trl.streaming_min_groups: 2: the chunk size of trl.streaming_partial_batch, which is unset"),
    (ASYNC + "  streaming_partial_batch: false\n  streaming_min_groups: 2\n",
     r"trl.streaming_min_groups: 2: the chunk size of trl.streaming_partial_batch, which is false"),
    (ASYNC + "  streaming_partial_batch: true\n  streaming_min_groups: 0\n",
     r"trl.streaming_min_groups: 0; expected a whole number >= 1"),
    (ASYNC + "  streaming_partial_batch: yes please\n",
     r"trl.streaming_partial_batch: 'yes please'; use true or false"),
    (ASYNC + "  streaming_partial_batch: true\n  replay_buffer_size: 16\n",
     r"streaming_partial_batch with replay_buffer_size 16: axolotl's streaming scorer only stores groups"),
    ("grpo:\n  streaming_min_groups: 2\n", r"grpo.*streaming_min_groups 2: the chunk size of streaming_partial_batch"),
    ("rl: ebft\ngrpo:\n  streaming_partial_batch: true\nscore:\n  scale_rewards: batch\n",
     r"grpo.streaming_partial_batch with score.scale_rewards batch: .*rl: ebft"),
])
def test_what_streaming_cannot_mean_is_one_error_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        axolotl(tmp_path, text)
