"""Replay buffer and re-roll (issue 6 part 4): which groups are cached, which replace what, which prompts
are sampled again, and that a whole run trains on exactly that, the same way on every rerun."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from stages.data.schemas import SCORED, write_table
from stages.rollout.rollout import with_rerolls
from stages.scoring import replay
from stages.scoring.replay import CachedGroup, ReplayBuffer, RoundSignals, group_signals
from tasks.store import MANIFEST

N = 4  # completions per prompt


def _group(prompt_id: str, round_index: int, rewards: list[float], advantages: list[float] | None = None):
    """One prompt's scored rows; advantages default to reward minus the group mean."""
    mean = sum(rewards) / len(rewards)
    advantages = advantages if advantages is not None else [r - mean for r in rewards]
    return [{"rollout_id": f"r{round_index}-{prompt_id}-g{g}", "prompt_id": prompt_id, "group_index": g,
             "prompt": [{"role": "user", "content": prompt_id}], "completion": f"c{g}",
             "prompt_token_ids": [1, 2], "completion_token_ids": [3, 4 + g], "sampling_logprobs": [-1.0, -1.0],
             "round_index": round_index, "policy_version": round_index, "engine": "transformers",
             "finish_reason": "stop", "rerolled": False, "rewards": [("toy", r)], "reward": r, "advantage": a,
             "errors": []}
            for g, (r, a) in enumerate(zip(rewards, advantages))]


def _write(path: Path, rows: list[dict]) -> Path:
    write_table(pa.Table.from_pylist(rows, schema=SCORED), path, SCORED)
    return path


def test_group_signals_tell_signal_failure_and_score():
    rows = (_group("a", 0, [1, 0, 0, 1]) + _group("failed", 0, [0, 0, 0, 0]) + _group("solved", 0, [1, 1, 1, 1])
            + _group("strong", 0, [1, 0, 0, 0]))
    signals = {s.prompt_id: s for s in group_signals(rows)}
    assert signals["a"].has_signal and not signals["a"].all_failed
    assert not signals["failed"].has_signal and signals["failed"].all_failed
    assert not signals["solved"].has_signal and not signals["solved"].all_failed  # all right is no failure
    assert signals["solved"].score == 0.0
    assert signals["a"].score == pytest.approx(4 * 0.5 * 0.5)  # sum |A| * std(reward)


def test_group_with_only_not_applicable_rewards_is_not_a_failure():
    rows = _group("x", 0, [0, 0, 0, 0])
    for row in rows:
        row["rewards"] = [("toy", None)]
    assert not group_signals(rows)[0].all_failed


def _cached(prompt_id, score, round_index=0):
    return CachedGroup(Path("unused"), "score/k", round_index, prompt_id, score)


def test_replay_buffer_keeps_the_highest_scores_newer_first_on_ties():
    buffer = ReplayBuffer(2)
    buffer.add([_cached("low", 0.1), _cached("high", 2.0), _cached("mid", 1.0)])
    assert [g.prompt_id for g in buffer.groups] == ["high", "mid"]
    buffer.add([_cached("tie", 1.0, round_index=1)])
    assert [g.prompt_id for g in buffer.groups] == ["high", "tie"]  # the newer of two equal scores stays


def test_replay_draws_are_distinct_and_follow_the_score():
    buffer = ReplayBuffer(3)
    buffer.add([_cached("big", 9.0), _cached("small", 1.0), _cached("tiny", 0.1)])
    rng = random.Random(0)
    firsts = [buffer.draw(1, rng)[0].prompt_id for _ in range(2000)]
    assert firsts.count("big") > firsts.count("small") > firsts.count("tiny")
    assert firsts.count("big") / 2000 == pytest.approx(9 / 10.1, abs=0.03)
    drawn = buffer.draw(5, rng)
    assert sorted(g.prompt_id for g in drawn) == ["big", "small", "tiny"]  # at most the buffer, no repeats


def test_zero_signal_groups_are_replaced_by_earlier_rounds_groups_only(tmp_path):
    signals = RoundSignals(replay_buffer_size=4, reroll_start_round=None, reroll_max_groups=1, seed=0)
    r0 = _write(tmp_path / "r0.parquet", _group("a", 0, [1, 0, 0, 1]) + _group("b", 0, [1, 1, 1, 1]))
    assert signals.after_scoring(0, r0, "score/r0") == []  # nothing cached before round 0: b stays empty
    assert [g.prompt_id for g in signals.buffer.groups] == ["a"]

    r1 = _write(tmp_path / "r1.parquet", _group("c", 1, [0, 0, 0, 0]) + _group("d", 1, [0, 1, 1, 1])
                + _group("e", 1, [1, 1, 1, 1]))
    replacements = signals.after_scoring(1, r1, "score/r1")
    # two empty groups (c, e) but one cached group: c gets a, e stays; d has signal and is never replaced
    assert [(r.replaced_prompt_id, r.group.prompt_id, r.group.round_index) for r in replacements] == [("c", "a", 0)]
    assert {g.prompt_id for g in signals.buffer.groups} == {"a", "d"}  # entries stay after a replay

    out = tmp_path / "batch"
    out.mkdir()
    summary = replay.run(r1, replacements, 1, out)
    rows = pq.read_table(out / "scored.parquet").to_pylist()
    assert [r["rollout_id"] for r in rows] == ([f"r0-a-g{g}" for g in range(N)] + [f"r1-d-g{g}" for g in range(N)]
                                               + [f"r1-e-g{g}" for g in range(N)])
    replayed = [r for r in rows if r["replayed"]]
    assert [r["advantage"] for r in replayed] == [0.5, -0.5, -0.5, 0.5]  # as scored in round 0
    assert all(r["round_index"] == 0 for r in replayed)
    assert summary == {"rows": 12, "replaced_groups": 1, "replayed_rows": 4, "replay_age_rounds_mean": 1.0}


def test_replay_choices_are_the_same_on_every_rebuild(tmp_path):
    def rewards(i):  # every third group has no signal
        return [1, 1, 1, 1] if i % 3 == 0 else [i % 2, 1, 0, i % 4]

    tables = [_write(tmp_path / f"r{r}.parquet", sum((_group(f"p{r}{i}", r, rewards(i)) for i in range(6)), []))
              for r in range(4)]

    def choices():
        signals = RoundSignals(3, None, 1, seed=7)
        return [[rep.as_key() for rep in signals.after_scoring(r, path, f"score/{r}")] for r, path in enumerate(tables)]

    first = choices()
    assert any(first) and first == choices()


def test_failed_prompts_are_rerolled_from_the_start_round_first_failed_first(tmp_path):
    signals = RoundSignals(replay_buffer_size=0, reroll_start_round=2, reroll_max_groups=2, seed=0)
    r0 = _write(tmp_path / "r0.parquet", _group("f1", 0, [0, 0, 0, 0]) + _group("ok", 0, [1, 1, 1, 1])
                + _group("f2", 0, [0, 0, 0, 0]) + _group("mixed", 0, [0, 1, 0, 0]))
    assert signals.after_scoring(0, r0, "score/r0") == []
    assert list(signals.reroll_queue) == ["f1", "f2"]  # all-zero groups only
    assert signals.prompts_to_reroll(1) == []  # before reroll_start_round
    r1 = _write(tmp_path / "r1.parquet", _group("f3", 1, [0, 0, 0, 0]) + _group("f1", 1, [0, 0, 0, 0]))
    signals.after_scoring(1, r1, "score/r1")
    assert list(signals.reroll_queue) == ["f1", "f2", "f3"]  # f1 is queued once
    assert signals.prompts_to_reroll(2) == ["f1", "f2"]  # reroll_max_groups, first failed first
    assert signals.prompts_to_reroll(3) == ["f3"]
    assert signals.metrics(0, 1) == {"reroll/rerolled_prompts": 1, "reroll/queue_size": 0}


def test_reroll_start_round_follows_axolotl():
    assert replay.reroll_start_round(1.0, 10) is None
    assert replay.reroll_start_round(0.5, 10) == 5
    assert replay.reroll_start_round(0.01, 10) == 1  # never round 0: nothing has failed yet


def test_rerolled_prompts_take_the_place_of_the_last_of_the_slice():
    rows = [{"prompt_id": f"p{i}"} for i in range(10)]
    picked = rows[:4]
    prompts, rerolled = with_rerolls(picked, rows, ["p8", "p9"])
    assert [p["prompt_id"] for p in prompts] == ["p0", "p1", "p8", "p9"] and rerolled == {"p8", "p9"}
    prompts, _ = with_rerolls(picked, rows, ["p1", "p9"])  # p1 is in the slice already: replaces nothing
    assert [p["prompt_id"] for p in prompts] == ["p0", "p1", "p2", "p9"]
    with pytest.raises(ValueError, match="p42"):
        with_rerolls(picked, rows, ["p42"])


def test_reroll_max_groups_above_the_round_is_a_config_error(tmp_path):
    from flows.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("rollout: {prompts_per_round: 4}\ngrpo: {reroll_max_groups: 5}\n")
    with pytest.raises(ConfigError, match="reroll_max_groups"):
        load_config(path)


# ---------------------------------------------------------------- a whole run


def _round_artifacts(root: Path) -> dict[int, dict[str, str]]:
    """round -> {stage: key} for optimize, its input (replay or score), score and rollout, read backwards
    from each optimize manifest's inputs."""
    def manifest(ref: str) -> dict:
        return json.loads((root / ref / MANIFEST).read_text())

    rounds = {}
    for path in (root / "optimize").glob(f"*/{MANIFEST}"):
        m = json.loads(path.read_text())
        found = {"optimize": path.parent.name}
        ref = m["inputs"]["scored"]
        if ref.startswith("replay/"):
            found["replay"] = ref.split("/")[1]
            ref = manifest(ref)["inputs"]["scored"]
        found["score"] = ref.split("/")[1]
        found["rollout"] = manifest(ref)["inputs"]["rollouts"].split("/")[1]
        rounds[m["config"]["round_index"]] = found
    return rounds


@pytest.mark.slow
def test_a_run_trains_on_replayed_groups_and_rerolls_failed_prompts(prefect_harness, tiny_config, tmp_path,
                                                                     monkeypatch):
    from flows.pipeline import posttrain_pipeline

    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # toy_rewards, also for the spawned reward workers
    overrides = ["grpo.rounds=3", "score.reward_funcs=[toy_rewards.by_prompt]", "grpo.replay_buffer_size=8",
                 "grpo.reroll_start_fraction=0.34", "grpo.reroll_max_groups=2"]
    first = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    root = tmp_path / "artifacts"
    rounds = _round_artifacts(root)

    def table(r: int, stage: str, name: str) -> list[dict]:
        return pq.read_table(root / stage / rounds[r][stage] / name).to_pylist()

    # round 0: nothing cached yet, nothing queued: it trains on its own scored rows
    assert sorted(rounds) == [0, 1, 2] and "replay" not in rounds[0]
    signals0 = group_signals(table(0, "score", "scored.parquet"))
    failed0 = [s.prompt_id for s in signals0 if s.all_failed]
    with_signal0 = {s.prompt_id for s in signals0 if s.has_signal}
    assert failed0 and with_signal0  # the toy reward makes both kinds
    assert not any(r["rerolled"] for r in table(0, "rollout", "rollouts.parquet"))

    # round 1 (int(3 * 0.34) = 1) re-rolls the first two prompts that failed in round 0
    rerolled = [r["prompt_id"] for r in table(1, "rollout", "rollouts.parquet") if r["rerolled"]]
    assert sorted(set(rerolled)) == sorted(failed0[:2]) and len(rerolled) == 2 * N

    # round 1 trains on its scored rows with its zero-signal groups swapped for round 0's groups with signal
    empty1 = [s.prompt_id for s in group_signals(table(1, "score", "scored.parquet")) if not s.has_signal]
    assert empty1 and "replay" in rounds[1]  # the re-rolled prompts fail again, at least
    batch1 = table(1, "replay", "scored.parquet")
    replayed = [r for r in batch1 if r["replayed"]]
    assert {r["prompt_id"] for r in replayed} <= with_signal0 and all(r["round_index"] == 0 for r in replayed)
    swapped = min(len(empty1), len(with_signal0))
    assert len(replayed) == N * swapped and len(batch1) == len(table(1, "score", "scored.parquet"))
    fresh = group_signals([r for r in batch1 if not r["replayed"]])
    assert sum(not s.has_signal for s in fresh) == len(empty1) - swapped

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")

    def history(name):
        return [m.value for m in sorted(client.get_metric_history(first["mlflow_run_id"], name), key=lambda m: m.step)]

    assert history("replay/replaced_groups")[:2] == [0, swapped]
    assert history("train/replayed_rows")[0] == N * swapped  # logged by the rounds that replayed
    assert history("reroll/rerolled_prompts")[:2] == [0, 2]

    # the choices are rebuilt the same on a rerun: every artifact is found, nothing is computed
    second = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    assert [r["stage"] for r in second["stages"] if r["status"] == "computed"] == []


@pytest.mark.slow
def test_with_async_prefetch_in_a_worker_process_rerolls_follow_the_lag(prefect_harness, tiny_config, tmp_path,
                                                                       monkeypatch):
    """Lag 1: round r's rollout is submitted once round r-2 is scored, so the first re-rolls come in
    round 2 (round 1 was already sampling when round 0's failures were known); the rollout worker
    process samples them; a rerun makes the same choices."""
    from flows.pipeline import posttrain_pipeline

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    overrides = ["grpo.rounds=3", "score.reward_funcs=[toy_rewards.by_prompt]", "grpo.replay_buffer_size=8",
                 "grpo.reroll_start_fraction=0.34", "grpo.reroll_max_groups=2", "rollout.async_prefetch=true",
                 "rollout.worker_process=true"]
    posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    root = tmp_path / "artifacts"
    rounds = _round_artifacts(root)

    def table(r: int, stage: str, name: str) -> list[dict]:
        return pq.read_table(root / stage / rounds[r][stage] / name).to_pylist()

    failed0 = [s.prompt_id for s in group_signals(table(0, "score", "scored.parquet")) if s.all_failed]
    assert not any(r["rerolled"] for r in table(1, "rollout", "rollouts.parquet"))
    rerolled2 = sorted({r["prompt_id"] for r in table(2, "rollout", "rollouts.parquet") if r["rerolled"]})
    assert rerolled2 == sorted(failed0[:2])
    assert "replay" in rounds[1] and "replay" in rounds[2]
    second = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    assert [r["stage"] for r in second["stages"] if r["status"] == "computed"] == []
