"""Tests for stages/scoring/score.py and the reward worker pool it uses (stages/scoring/reward_workers.py)."""

from __future__ import annotations

import importlib
import logging
import math
import multiprocessing as mp
import os
import textwrap
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import torch

from stages.data.schemas import ROLLOUTS, SCORED
from stages.scoring import reward_pools, score
from stages.scoring.reward_pools import shared_pool
from stages.scoring.reward_workers import RewardFunctionError
from stages.scoring.score import ScoreConfig, gdpo_advantages, group_advantages

EPS = 1e-4

# Two prompts x num_generations=2, laid out group by group as the rollout stage writes them.
PROMPT_TEXT = {"p0": "What is 2+3?", "p1": "Write 1/2 as a decimal."}
ANSWERS = {"p0": "5", "p1": "0.5"}
COMPLETIONS = [
    ("p0", "<answer>5</answer>"),  # accuracy 1, format 1
    ("p0", "I think 6"),  # accuracy 0, format 0
    ("p1", "<answer>0.5</answer>"),  # accuracy 1, format 1
    ("p1", "<answer>\\frac{1}{2}</answer> done"),  # accuracy 1 (math-verify), format 0
]
IDS = [f"r0-{pid}-g{i % 2}" for i, (pid, _) in enumerate(COMPLETIONS)]


@pytest.fixture(autouse=True)
def close_pools():
    """No test leaves reward workers behind: cached pools (an earlier module's runs' too) are closed around each test."""
    reward_pools.close_pools()
    yield
    reward_pools.close_pools()
    assert mp.active_children() == []


def _write_rollouts(path: Path, completions: list[tuple[str, str]], num_generations: int = 2) -> Path:
    """A rollouts table of (prompt id, completion) rows, laid out group by group."""
    rows = []
    for i, (pid, completion) in enumerate(completions):
        rows.append({
            "rollout_id": f"r0-{pid}-g{i % num_generations}",
            "prompt_id": pid,
            "group_index": i % num_generations,
            "prompt": [{"role": "user", "content": PROMPT_TEXT[pid]}],
            "completion": completion,
            "prompt_token_ids": [1, 2, 3],
            "completion_token_ids": list(range(len(completion))),
            "sampling_logprobs": [-0.5] * len(completion),
            "policy_version": 0,
            "engine": "hf",
            "finish_reason": "stop",
            "answer": ANSWERS[pid],
        })
    schema = pa.schema(list(ROLLOUTS) + [pa.field("answer", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


@pytest.fixture
def rollouts_path(tmp_path: Path) -> Path:
    return _write_rollouts(tmp_path / "rollouts.parquet", COMPLETIONS)


USER_REWARDS = '''
import asyncio
import math
import os
import signal
import threading
import time

from stages.scoring.rewards import completion_text

CALLS = []


def length(completions, **kwargs):
    return [float(len(completion_text(c))) for c in completions]


def sees_columns(prompts, completions, completion_ids, prompt_id, answer, **kwargs):
    # TRL's keyword signature: prompts, completions, completion_ids and every passthrough column.
    assert prompts[0][0]["role"] == "user"
    return [float(len(ids)) + (100.0 if a == "5" else 0.0) + (1000.0 if p == "p1" else 0.0)
            for ids, a, p in zip(completion_ids, answer, prompt_id)]


def boom(completions, **kwargs):
    raise ValueError("boom")


def raises_on_done(completions, **kwargs):
    out = []
    for c in completions:
        if completion_text(c).endswith("done"):
            raise ValueError("cannot grade trailing text")
        out.append(1.0)
    return out


def hangs_on_guess(completions, **kwargs):
    # Sleeps forever on "I think 6" (the second sample), 1.0 elsewhere.
    if any(completion_text(c).startswith("I") for c in completions):
        time.sleep(3600)
    return [1.0] * len(completions)


def one_too_many(completions, **kwargs):
    return [1.0] * (len(completions) + 1)


def exits_on_done(completions, **kwargs):
    # Kills its worker on the last sample (trailing "done"), 1.0 elsewhere.
    if any(completion_text(c).endswith("done") for c in completions):
        os._exit(3)
    return [1.0] * len(completions)


def returns_scalar(completions, **kwargs):
    return 1.0


def returns_text(completions, **kwargs):
    return ["high" if completion_text(c).startswith("I") else 1.0 for c in completions]


async def async_length(completions, **kwargs):
    await asyncio.sleep(0.01)
    return [float(len(completion_text(c))) for c in completions]


def tagged_only(completions, **kwargs):
    # Applies only to completions that start with an <answer> tag.
    return [1.0 if completion_text(c).startswith("<answer>") else None for c in completions]


def nonfinite(completions, **kwargs):
    # nan on "I think 6" (a 0/0 in a grader), inf on the trailing "done", 1.0 elsewhere.
    return [math.nan if completion_text(c).startswith("I") else math.inf if completion_text(c).endswith("done")
            else 1.0 for c in completions]


def minus_inf_on_done(completions, **kwargs):
    return [-math.inf if completion_text(c).endswith("done") else 1.0 for c in completions]


def uses_alarm(completions, **kwargs):
    # math-verify style: signal.alarm only works in the main thread of the process.
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        signal.alarm(1)
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    main = threading.current_thread() is threading.main_thread()
    return [2.0 if fired and main else -1.0 for _ in completions]


def alarm_guarded(completions, **kwargs):
    # math-verify's pattern: SIGALRM as a per-call timeout, cancelled when done. signal.signal raises
    # ValueError outside the main thread.
    def on_timeout(signum, frame):
        raise TimeoutError("grading took too long")

    previous = signal.signal(signal.SIGALRM, on_timeout)
    signal.alarm(5)
    try:
        return [float(len(completion_text(c))) for c in completions]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
'''


@pytest.fixture
def user_rewards(tmp_path: Path, monkeypatch) -> str:
    """A module of user reward functions in tmp_path, importable here and in spawned workers."""
    name = f"user_rewards_{uuid.uuid4().hex[:10]}"
    module_dir = tmp_path / "user_code"
    module_dir.mkdir()
    (module_dir / f"{name}.py").write_text(textwrap.dedent(USER_REWARDS))
    monkeypatch.syspath_prepend(str(module_dir))
    existing = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(module_dir) + (os.pathsep + existing if existing else ""))
    return name


def _scored(out_dir: Path) -> list[dict]:
    return pq.read_table(out_dir / "scored.parquet").to_pylist()


# --- group_advantages ---------------------------------------------------------------------------

REWARDS_3 = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0], dtype=torch.float64)  # two groups of 3


def test_group_advantages_none():
    # group means 3 and 1
    expected = [-2.0, -1.0, 3.0, -1.0, -1.0, 2.0]
    assert group_advantages(REWARDS_3, 3, "none").tolist() == pytest.approx(expected, abs=1e-12)


def test_group_advantages_group():
    # unbiased stds: sqrt((4+1+9)/2) = sqrt(7) and sqrt((1+1+4)/2) = sqrt(3)
    s1, s2 = math.sqrt(7) + EPS, math.sqrt(3) + EPS
    expected = [-2 / s1, -1 / s1, 3 / s1, -1 / s2, -1 / s2, 2 / s2]
    assert group_advantages(REWARDS_3, 3, "group").tolist() == pytest.approx(expected, abs=1e-12)


def test_group_advantages_batch():
    # batch mean 2; squared deviations 1+0+16+4+4+1 = 26; unbiased var 26/5; still centred per group
    s = math.sqrt(26 / 5) + EPS
    expected = [-2 / s, -1 / s, 3 / s, -1 / s, -1 / s, 2 / s]
    assert group_advantages(REWARDS_3, 3, "batch").tolist() == pytest.approx(expected, abs=1e-12)


def test_group_advantages_zero_std_group_is_zero():
    rewards = torch.tensor([2.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    s = math.sqrt(0.5) + EPS
    assert group_advantages(rewards, 2, "group").tolist() == pytest.approx([0.0, 0.0, 0.5 / s, -0.5 / s], abs=1e-12)


def test_group_advantages_groups_are_contiguous():
    # num_generations=2 groups are [1, 0] and [3, 3], not [1, 3] and [0, 3]
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0], dtype=torch.float64)
    assert group_advantages(rewards, 2, "none").tolist() == [0.5, -0.5, 0.0, 0.0]


def test_gdpo_per_function_then_batch_normalization():
    # Two groups of 3, two functions, weights 1 and 2.
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0],
                            [1.0, 5.0], [1.0, 5.0], [1.0, 2.0]], dtype=torch.float64)
    s = 1 / math.sqrt(3) + EPS  # std of (1, 0, 0) and of (0, 1, 0)
    t = math.sqrt(3) + EPS  # std of (5, 5, 2); std of (1, 1, 1) is 0: that function adds 0
    summed = torch.tensor([(2 / 3 - 2 / 3) / s, (-1 / 3 + 4 / 3) / s, (-1 / 3 - 2 / 3) / s,  # w1 * A_1 + w2 * A_2
                           2 * 1 / t, 2 * 1 / t, 2 * -2 / t], dtype=torch.float64)
    expected = (summed - summed.mean()) / (summed.std() + EPS)

    advantages = gdpo_advantages(rewards, torch.tensor([1.0, 2.0]), 3)

    assert advantages.tolist() == pytest.approx(expected.tolist(), abs=1e-9)


def test_gdpo_none_is_left_out():
    nan = float("nan")
    # Function 2 does not apply to sample 1: its group stats come from samples 0 and 2 only.
    rewards = torch.tensor([[1.0, 1.0], [0.0, nan], [0.0, 0.0], [nan, nan]], dtype=torch.float64)
    s1 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2) + EPS  # (1, 0, 0): mean 1/3
    s2 = math.sqrt(2 * 0.5**2) + EPS  # (1, 0): mean 0.5
    summed = torch.tensor([(2 / 3) / s1 + 0.5 / s2, -(1 / 3) / s1, -(1 / 3) / s1 - 0.5 / s2], dtype=torch.float64)
    expected = ((summed - summed.mean()) / (summed.std() + EPS)).tolist() + [0.0]  # all-None row: advantage 0

    advantages = gdpo_advantages(rewards, torch.tensor([1.0, 1.0]), 4)

    assert advantages.tolist() == pytest.approx(expected, abs=1e-9)


def test_gdpo_with_one_function_is_batch_normalized_grpo():
    rewards = REWARDS_3.unsqueeze(1)
    grpo = group_advantages(REWARDS_3, 3, "group")
    expected = (grpo - grpo.mean()) / (grpo.std() + EPS)
    assert gdpo_advantages(rewards, torch.tensor([1.0]), 3).tolist() == pytest.approx(expected.tolist(), abs=1e-6)


# --- score.run with built-in rewards ------------------------------------------------------------


def test_run_builtin_rewards_weighted(rollouts_path, out_dir):
    cfg = ScoreConfig(reward_funcs=["accuracy", "format"], reward_weights=[2.0, 0.5], reward_batch_size=3)

    metrics = score.run(cfg, rollouts_path, num_generations=2, out_dir=out_dir)

    rows = _scored(out_dir)
    table = pq.read_table(out_dir / "scored.parquet")
    assert table.column_names == SCORED.names + ["answer"]
    assert table.schema.field("rewards").type == SCORED.field("rewards").type
    assert [r["rollout_id"] for r in rows] == IDS
    assert [dict(r["rewards"]) for r in rows] == [
        {"accuracy": 1.0, "format": 1.0},
        {"accuracy": 0.0, "format": 0.0},
        {"accuracy": 1.0, "format": 1.0},
        {"accuracy": 1.0, "format": 0.0},
    ]
    totals = [2.5, 0.0, 2.5, 2.0]
    assert [r["reward"] for r in rows] == pytest.approx(totals)
    s0 = math.sqrt(2 * 1.25**2) + EPS  # group [2.5, 0]: mean 1.25
    s1 = math.sqrt(2 * 0.25**2) + EPS  # group [2.5, 2]: mean 2.25
    assert [r["advantage"] for r in rows] == pytest.approx([1.25 / s0, -1.25 / s0, 0.25 / s1, -0.25 / s1])
    assert [r["errors"] for r in rows] == [[], [], [], []]
    assert [r["answer"] for r in rows] == ["5", "5", "0.5", "0.5"]

    assert metrics["reward_mean"] == pytest.approx(1.75)
    assert metrics["reward_std"] == pytest.approx((s0 - EPS + s1 - EPS) / 2)  # TRL's: the mean of the groups' stds
    assert metrics["reward_std_batch"] == pytest.approx(torch.tensor(totals).std().item())
    assert metrics["frac_reward_zero_std"] == 0.0
    assert metrics["rewards/accuracy/mean"] == pytest.approx(0.75)
    assert metrics["rewards/format/mean"] == pytest.approx(0.5)
    assert metrics["rewards/accuracy/std"] == pytest.approx(0.5)  # unbiased std of (1, 0, 1, 1)
    assert metrics["rewards/format/std"] == pytest.approx(math.sqrt(1 / 3))
    assert metrics["score/errors"] == 0

    # The pool is cached: a second run with the same config reuses the same workers.
    pool = shared_pool(cfg.reward_funcs, cfg.reward_num_workers, cfg.reward_timeout_s)
    pids = [w.proc.pid for w in pool.workers]
    metrics_again = score.run(cfg.model_copy(update={"scale_rewards": "none"}), rollouts_path, 2, out_dir)
    assert shared_pool(cfg.reward_funcs, cfg.reward_num_workers, cfg.reward_timeout_s) is pool
    assert [w.proc.pid for w in pool.workers] == pids
    assert metrics_again["reward_mean"] == pytest.approx(1.75)
    assert [r["advantage"] for r in _scored(out_dir)] == pytest.approx([1.25, -1.25, 0.25, -0.25])


def test_run_default_weights_and_batch_scaling(rollouts_path, out_dir):
    cfg = ScoreConfig(scale_rewards="batch", reward_batch_size=1)

    metrics = score.run(cfg, rollouts_path, num_generations=2, out_dir=out_dir)

    rows = _scored(out_dir)
    totals = [2.0, 0.0, 2.0, 1.0]
    assert [r["reward"] for r in rows] == pytest.approx(totals)
    s = torch.tensor(totals, dtype=torch.float64).std().item() + EPS
    assert [r["advantage"] for r in rows] == pytest.approx([1.0 / s, -1.0 / s, 0.5 / s, -0.5 / s])
    assert metrics["reward_mean"] == pytest.approx(1.25)


def test_run_rejects_partial_group(rollouts_path, out_dir):
    with pytest.raises(ValueError, match="4 rows is not a multiple of num_generations=3"):
        score.run(ScoreConfig(), rollouts_path, num_generations=3, out_dir=out_dir)


def test_config_validation():
    with pytest.raises(ValueError, match="reward_weights has 1 values for 2 reward_funcs"):
        ScoreConfig(reward_funcs=["accuracy", "format"], reward_weights=[1.0])
    with pytest.raises(ValueError):
        ScoreConfig(scale_rewards="std")
    with pytest.raises(ValueError):
        ScoreConfig(multi_objective_aggregation="gdpo")
    assert ScoreConfig().multi_objective_aggregation == "sum_then_normalize"  # TRL's default
    assert ScoreConfig().reward_on_error == 0.0
    # TRL's booleans, as a YAML file writes them: true is GRPO's group scaling, false Dr. GRPO's none
    assert ScoreConfig.model_validate(yaml.safe_load("scale_rewards: true")).scale_rewards == "group"
    assert ScoreConfig.model_validate(yaml.safe_load("scale_rewards: false")).scale_rewards == "none"


def test_unknown_reward_fails_fast_in_parent(rollouts_path, out_dir):
    with pytest.raises(ValueError, match=r"reward_funcs: cannot import module 'nosuchmodule' for 'nosuchmodule\.fn'"):
        score.run(ScoreConfig(reward_funcs=["nosuchmodule.fn"]), rollouts_path, 2, out_dir)
    with pytest.raises(ValueError, match=r"reward_funcs: 'acc' is neither a built-in"):
        score.run(ScoreConfig(reward_funcs=["acc"]), rollouts_path, 2, out_dir)
    assert mp.active_children() == []


# format and correctness, as in axolotl's GDPO example: (1, 0) and (0, 1) sum to the same total.
GDPO_COMPLETIONS = [
    ("p0", "<answer>6</answer>"),  # format 1, accuracy 0
    ("p0", "<answer>5</answer> done"),  # format 0, accuracy 1
    ("p0", "<answer>7</answer>"),  # format 1, accuracy 0
    ("p0", "<answer>5</answer>"),  # format 1, accuracy 1
] + [("p1", "<answer>0.5</answer>")] * 4  # both 1 everywhere: no signal from this group


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_gdpo_keeps_colliding_reward_combinations_apart(tmp_path, out_dir, aggregation):
    path = _write_rollouts(tmp_path / "rollouts.parquet", GDPO_COMPLETIONS, num_generations=4)
    cfg = ScoreConfig(reward_funcs=["format", "accuracy"], multi_objective_aggregation=aggregation)

    metrics = score.run(cfg, path, num_generations=4, out_dir=out_dir)

    rows = _scored(out_dir)
    assert [r["reward"] for r in rows] == [1.0, 1.0, 1.0, 2.0] + [2.0] * 4  # the raw weighted total either way
    advantages = [r["advantage"] for r in rows]
    if aggregation == "sum_then_normalize":  # GRPO: collapsed, (1, 0) and (0, 1) look the same
        assert advantages[0] == pytest.approx(advantages[1]) == pytest.approx(advantages[2])
        assert advantages[0] == pytest.approx(-0.25 / (0.5 + EPS))
    else:
        f = [(x - 0.75) / (0.5 + EPS) for x in (1, 0, 1, 1)]  # format: mean 3/4, std 1/2
        c = [(x - 0.5) / (1 / math.sqrt(3) + EPS) for x in (0, 1, 0, 1)]  # accuracy: mean 1/2, std 1/sqrt(3)
        summed = torch.tensor([a + b for a, b in zip(f, c)] + [0.0] * 4, dtype=torch.float64)
        expected = (summed - summed.mean()) / (summed.std() + EPS)
        assert advantages == pytest.approx(expected.tolist())
        assert advantages[0] == pytest.approx(advantages[2]) and advantages[0] != pytest.approx(advantages[1])
        assert advantages[4:] == pytest.approx([advantages[4]] * 4)  # the flat group stays flat
    assert metrics["rewards/format/mean"] == pytest.approx(7 / 8)
    assert metrics["rewards/format/std"] == pytest.approx(torch.tensor([1.0, 0, 1, 1, 1, 1, 1, 1]).std().item())
    assert metrics["rewards/accuracy/mean"] == pytest.approx(6 / 8)
    assert metrics["score/errors"] == 0


# --- user reward functions in spawned workers ---------------------------------------------------


def test_user_reward_receives_trl_keywords(rollouts_path, out_dir, user_rewards):
    cfg = ScoreConfig(reward_funcs=[f"{user_rewards}.sees_columns", f"{user_rewards}.length"],
                      reward_weights=[1.0, 0.0], reward_batch_size=2, scale_rewards="none")

    metrics = score.run(cfg, rollouts_path, 2, out_dir)

    lengths = [float(len(c)) for _, c in COMPLETIONS]
    expected = [lengths[0] + 100, lengths[1] + 100, lengths[2] + 1000, lengths[3] + 1000]
    rows = _scored(out_dir)
    assert [dict(r["rewards"])[f"{user_rewards}.sees_columns"] for r in rows] == expected
    assert [dict(r["rewards"])[f"{user_rewards}.length"] for r in rows] == lengths
    assert [r["reward"] for r in rows] == expected  # weight 0 for `length`
    assert metrics[f"rewards/length/mean"] == pytest.approx(sum(lengths) / 4)


def test_raising_reward_scores_the_rest_of_its_batch(rollouts_path, out_dir, user_rewards, caplog):
    caplog.set_level(logging.WARNING, logger="stages.scoring.reward_workers")
    name = f"{user_rewards}.raises_on_done"
    cfg = ScoreConfig(reward_funcs=["format", name], reward_batch_size=2, reward_on_error=-1.0,
                      scale_rewards="none", max_error_rate=0.25)  # 1 of 4 samples fails: at the limit, not past it

    metrics = score.run(cfg, rollouts_path, 2, out_dir)

    rows = _scored(out_dir)
    # The batch [IDS[2], IDS[3]] raised; re-scored one by one, only IDS[3] fails and gets reward_on_error.
    assert [dict(r["rewards"])[name] for r in rows] == [1.0, 1.0, 1.0, -1.0]
    assert [r["reward"] for r in rows] == [2.0, 1.0, 2.0, -1.0]
    assert [r["advantage"] for r in rows] == [0.5, -0.5, 1.5, -1.5]
    assert [r["errors"] for r in rows] == [[], [], [], [f"{name}: ValueError: cannot grade trailing text"]]
    assert metrics["score/errors"] == 1
    assert metrics[f"score/errors/raises_on_done"] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no console output per sample
    logged = (out_dir / "reward_errors.log").read_text()  # in the artifact
    assert f"reward function {name!r} failed on sample {IDS[3]}: ValueError: cannot grade trailing text" in logged
    assert "raise ValueError" in logged  # the traceback is in the log, not in the table
    # The pool survives and is reused.
    pool = shared_pool(cfg.reward_funcs, cfg.reward_num_workers, cfg.reward_timeout_s)
    assert pool.alive() and all(w.proc.is_alive() for w in pool.workers)


def test_a_reward_failing_on_more_than_max_error_rate_stops_the_round_with_one_line(rollouts_path, out_dir,
                                                                                     user_rewards, tmp_path, caplog):
    """Issue 44: a function that raises on every sample "succeeded" with reward_on_error and a warning with a
    traceback per sample. Past score.max_error_rate (0.1) it is broken: one RewardFunctionError naming it, its
    first error and the count, its tracebacks in a log file (named), nothing written; under it, no stop."""
    caplog.set_level(logging.DEBUG, logger="stages.scoring.reward_workers")
    name = f"{user_rewards}.boom"
    log_dir = tmp_path / "work"
    with pytest.raises(RewardFunctionError) as info:
        score.run(ScoreConfig(reward_funcs=[name, "format"], reward_batch_size=2), rollouts_path, 2, out_dir,
                  log_dir=log_dir)
    message = str(info.value)
    assert "\n" not in message and ScoreConfig().max_error_rate == 0.1
    assert f"reward function {name!r} failed on 4 of 4 samples (100%, more than score.max_error_rate 0.1)" in message
    assert "first error (sample r0-p" in message and "ValueError: boom" in message
    assert f"traceback is in {log_dir / 'reward_errors.log'}" in message
    logged = (log_dir / "reward_errors.log").read_text()
    assert logged.count(f"reward function {name!r} failed on sample") == 4 and 'raise ValueError("boom")' in logged
    assert not (out_dir / "scored.parquet").exists()  # nothing cached
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no console output per sample

    # one failure in four: over the default share, not over 0.5
    with pytest.raises(RewardFunctionError, match=r"'.*\.raises_on_done' failed on 1 of 4 samples \(25%"):
        score.run(ScoreConfig(reward_funcs=[f"{user_rewards}.raises_on_done"], reward_batch_size=2), rollouts_path,
                  2, out_dir)
    metrics = score.run(ScoreConfig(reward_funcs=[f"{user_rewards}.raises_on_done"], max_error_rate=0.5),
                        rollouts_path, 2, out_dir)
    assert metrics["score/errors"] == 1 and metrics["score/errors/raises_on_done"] == 1


def test_a_round_with_some_failed_samples_is_one_warning_in_the_run_summary(tmp_path):
    """Issue 44: summary.json said `warnings: []` for a run whose reward function failed on its samples. A round
    under score.max_error_rate is one warning (console and summary.json's `warnings`) naming the log file."""
    from types import SimpleNamespace

    from flows.rounds import RoundLog
    from tasks.reporting import Reporter

    reporter = Reporter(tmp_path, quiet=True)
    round_log = RoundLog(SimpleNamespace(reporter=reporter), "parent-run", [])
    folder = tmp_path / "score" / "abc"
    for summary in ({"score/samples": 256, "score/errors": 0}, {"score/samples": 256, "score/errors": 3,
                                                                 "score/errors/check": 3, "score/errors/format": 0}):
        round_log.warn_reward_errors(4, SimpleNamespace(manifest={"summary": summary}, path=folder))
    assert reporter.warnings == [f"score r4: check failed on 3 of 256 samples, which got score.reward_on_error; "
                                 f"tracebacks: {folder / 'reward_errors.log'}"]


@pytest.mark.timeout(60)
def test_hanging_reward_is_killed_and_replaced(rollouts_path, out_dir, user_rewards, caplog):
    caplog.set_level(logging.WARNING, logger="stages.scoring.reward_workers")
    name = f"{user_rewards}.hangs_on_guess"
    cfg = ScoreConfig(reward_funcs=[name], reward_timeout_s=1, reward_batch_size=2, max_error_rate=1.0)
    pool = shared_pool(cfg.reward_funcs, cfg.reward_num_workers, cfg.reward_timeout_s)
    first_pids = {w.proc.pid for w in pool.workers}

    start = time.monotonic()
    metrics = score.run(cfg, rollouts_path, 2, out_dir)
    elapsed = time.monotonic() - start

    rows = _scored(out_dir)
    # IDS[0] shared its batch with the hanging IDS[1]: re-scored alone, it gets its real value.
    assert [r["reward"] for r in rows] == [1.0, 0.0, 1.0, 1.0]
    assert [r["errors"] for r in rows] == [[], [f"{name}: TimeoutError after 1 s"], [], []]
    assert metrics["score/errors"] == 1
    assert (f"reward function {name!r} failed on sample {IDS[1]}: TimeoutError after 1 s"
            in (out_dir / "reward_errors.log").read_text())
    assert 2 <= elapsed < 30  # the batch's timeout, then the sample's
    # Both hung workers (the batch's and the sample's) were killed; the pool is back to full strength.
    assert len(pool.workers) == 2 and all(w.proc.is_alive() for w in pool.workers)
    assert {w.proc.pid for w in pool.workers} != first_pids
    assert len(mp.active_children()) == 2


def test_worker_death_is_attributed_to_its_sample(rollouts_path, out_dir, user_rewards):
    name = f"{user_rewards}.exits_on_done"
    cfg = ScoreConfig(reward_funcs=["format", name], reward_num_workers=1, scale_rewards="none", max_error_rate=1.0)

    metrics = score.run(cfg, rollouts_path, 2, out_dir)

    rows = _scored(out_dir)
    assert [dict(r["rewards"])[name] for r in rows] == [1.0, 1.0, 1.0, 0.0]  # reward_on_error defaults to 0
    assert [r["errors"] for r in rows] == [[], [], [], [f"{name}: worker process died (exit code 3)"]]
    assert metrics["score/errors"] == 1
    # The same pool, its worker replaced, scores the next call.
    again = score.run(cfg, rollouts_path, 2, out_dir)
    assert again["score/errors"] == 1
    assert [dict(r["rewards"])["format"] for r in _scored(out_dir)] == [1.0, 0.0, 1.0, 0.0]


def test_wrong_number_of_values_names_function(rollouts_path, out_dir, user_rewards):
    name = f"{user_rewards}.one_too_many"

    with pytest.raises(RewardFunctionError) as info:
        score.run(ScoreConfig(reward_funcs=[name], reward_num_workers=1), rollouts_path, 2, out_dir)

    assert f"reward function {name!r} returned 5 values for 4 completions (samples {IDS[0]}..{IDS[3]})" in str(
        info.value)
    assert not (out_dir / "scored.parquet").exists()
    assert mp.active_children() == []  # a failed pool kills its workers
    broken = reward_pools._POOLS[((name,), 1, ScoreConfig().reward_timeout_s, (), None)]
    assert not broken.alive()
    fresh = shared_pool([name], 1, ScoreConfig().reward_timeout_s)
    assert fresh is not broken and fresh.alive()


def test_not_a_list_names_function(rollouts_path, out_dir, user_rewards):
    name = f"{user_rewards}.returns_scalar"

    with pytest.raises(RewardFunctionError, match=rf"reward function {name!r} returned 1\.0 \(float\) for samples "
                                                  rf"{IDS[0]}\.\.{IDS[3]}; it must return a list"):
        score.run(ScoreConfig(reward_funcs=[name], reward_num_workers=1), rollouts_path, 2, out_dir)


def test_module_that_fails_to_load_in_worker_names_function(rollouts_path, out_dir, user_rewards, tmp_path):
    module = f"{user_rewards}_parent_only"
    (tmp_path / "user_code" / f"{module}.py").write_text(textwrap.dedent("""
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            raise ImportError("needs the parent's setup")


        def ok(completions, **kwargs):
            return [1.0] * len(completions)
    """))

    with pytest.raises(RewardFunctionError) as info:
        score.run(ScoreConfig(reward_funcs=[f"{module}.ok"]), rollouts_path, 2, out_dir)

    assert f"reward function '{module}.ok' could not be loaded in a worker process" in str(info.value)
    assert "needs the parent's setup" in str(info.value)
    assert mp.active_children() == []


def test_non_numeric_value_names_function_and_sample(rollouts_path, out_dir, user_rewards):
    name = f"{user_rewards}.returns_text"

    with pytest.raises(RewardFunctionError) as info:
        score.run(ScoreConfig(reward_funcs=[name]), rollouts_path, 2, out_dir)

    assert f"reward function {name!r} returned 'high' (str) for sample {IDS[1]}" in str(info.value)


def test_async_reward(rollouts_path, out_dir, user_rewards):
    cfg = ScoreConfig(reward_funcs=[f"{user_rewards}.async_length"], reward_batch_size=3, scale_rewards="none")

    metrics = score.run(cfg, rollouts_path, 2, out_dir)

    lengths = [float(len(c)) for _, c in COMPLETIONS]
    rows = _scored(out_dir)
    assert [r["reward"] for r in rows] == lengths
    assert [r["advantage"] for r in rows] == pytest.approx(
        [(lengths[0] - lengths[1]) / 2, (lengths[1] - lengths[0]) / 2,
         (lengths[2] - lengths[3]) / 2, (lengths[3] - lengths[2]) / 2])
    assert metrics["rewards/async_length/mean"] == pytest.approx(sum(lengths) / 4)


def test_none_reward_is_excluded(rollouts_path, out_dir, user_rewards):
    name = f"{user_rewards}.tagged_only"
    cfg = ScoreConfig(reward_funcs=["format", name], reward_weights=[1.0, 2.0], scale_rewards="none")

    metrics = score.run(cfg, rollouts_path, 2, out_dir)

    rows = _scored(out_dir)
    # "I think 6" gets None from tagged_only: stored as null, counted as 0 in the weighted total.
    assert [dict(r["rewards"]) for r in rows] == [
        {"format": 1.0, name: 1.0},
        {"format": 0.0, name: None},
        {"format": 1.0, name: 1.0},
        {"format": 0.0, name: 1.0},
    ]
    assert [r["reward"] for r in rows] == [3.0, 0.0, 3.0, 2.0]
    assert [r["advantage"] for r in rows] == [1.5, -1.5, 0.5, -0.5]
    assert metrics["rewards/tagged_only/mean"] == 1.0  # nanmean over the 3 samples it applies to
    assert metrics["rewards/tagged_only/std"] == 0.0
    assert metrics["reward_mean"] == pytest.approx(2.0)


def test_none_rewards_publish(rollouts_path, out_dir, user_rewards):
    """A None reward (stored as null) reaches the published sample table as None, not a crash (issue 42)."""
    from tasks.publish import sample_completions

    name = f"{user_rewards}.tagged_only"
    score.run(ScoreConfig(reward_funcs=["format", name], reward_num_workers=1), rollouts_path, 2, out_dir)

    samples = sample_completions(out_dir / "scored.parquet", 4)
    assert [s[f"reward/{name}"] for s in samples] == [1.0, None, 1.0, 1.0]
    assert [s["reward"] for s in samples] == [2.0, 0.0, 2.0, 1.0]


@pytest.mark.parametrize("function, value, sample", [("nonfinite", "nan", 1), ("minus_inf_on_done", "-inf", 3)])
def test_a_reward_that_is_not_finite_stops_naming_function_and_sample(rollouts_path, out_dir, user_rewards,
                                                                      function, value, sample):
    name = f"{user_rewards}.{function}"

    with pytest.raises(RewardFunctionError) as info:
        score.run(ScoreConfig(reward_funcs=["format", name], reward_num_workers=1), rollouts_path, 2, out_dir)

    message = str(info.value)
    assert f"reward function {name!r} returned {value} for sample {IDS[sample]}" in message
    assert "score.reward_on_invalid" in message and "\n" not in message
    assert not (out_dir / "scored.parquet").exists()  # nothing a rerun would find cached


def test_a_sample_no_reward_function_scores_stops_naming_it(rollouts_path, out_dir, user_rewards):
    name = f"{user_rewards}.tagged_only"  # None for "I think 6": with no other function, that sample has no reward

    with pytest.raises(RewardFunctionError) as info:
        score.run(ScoreConfig(reward_funcs=[name], reward_num_workers=1), rollouts_path, 2, out_dir)

    assert f"sample {IDS[1]} has no reward: every reward function ({name}) returned None" in str(info.value)
    assert not (out_dir / "scored.parquet").exists()


def test_reward_on_invalid_records_nan_inf_and_no_reward(rollouts_path, out_dir, user_rewards, caplog):
    caplog.set_level(logging.WARNING, logger="stages.scoring.score")
    name, tagged = f"{user_rewards}.nonfinite", f"{user_rewards}.tagged_only"
    cfg = ScoreConfig(reward_funcs=["format", name], reward_num_workers=1, reward_on_invalid=-1.0,
                      scale_rewards="none")

    metrics = score.run(cfg, rollouts_path, 2, out_dir)

    rows = _scored(out_dir)
    assert [dict(r["rewards"])[name] for r in rows] == [1.0, -1.0, 1.0, -1.0]
    assert [r["reward"] for r in rows] == [2.0, -1.0, 2.0, -1.0]
    assert [r["errors"] for r in rows] == [[], [f"{name}: returned nan"], [], [f"{name}: returned inf"]]
    assert metrics["score/errors"] == 2
    assert f"reward function {name!r} returned nan for sample {IDS[1]}; recorded as score.reward_on_invalid " \
           "(-1)" in caplog.text

    metrics = score.run(cfg.model_copy(update={"reward_funcs": [tagged]}), rollouts_path, 2, out_dir)

    rows = _scored(out_dir)
    assert [dict(r["rewards"])[tagged] for r in rows] == [1.0, None, 1.0, 1.0]  # it still did not apply
    assert [r["reward"] for r in rows] == [1.0, -1.0, 1.0, 1.0]
    assert rows[1]["errors"] == ["no reward function returned a value (every one returned None)"]
    assert metrics["score/errors"] == 1
    assert f"sample {IDS[1]} has no reward" in caplog.text


def test_reward_importing_a_namespace_subpackage_from_pythonpath(rollouts_path, out_dir, user_rewards, tmp_path,
                                                                 monkeypatch):
    """A library outside site-packages (`pip install --target DIR`, DIR on PYTHONPATH) with a namespace
    subpackage (no __init__.py) whose parent was never imported: the code digest walks it without a KeyError
    (issue 42), and the workers import it."""
    from stages.runtime.imports import source_digest

    lib = tmp_path / "pythonpath"
    (lib / "ns_gym" / "induction").mkdir(parents=True)
    (lib / "ns_gym" / "__init__.py").write_text("")
    (lib / "ns_gym" / "induction" / "tasks.py").write_text("def score(text):\n    return float(len(text))\n")
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.setenv("PYTHONPATH", f"{lib}{os.pathsep}{os.environ['PYTHONPATH']}")
    module = f"{user_rewards}_gym"
    (tmp_path / "user_code" / f"{module}.py").write_text(
        "from stages.scoring.rewards import completion_text\n\n\ndef graded(completions, **kwargs):\n"
        "    from ns_gym.induction.tasks import score\n\n"
        "    return [score(completion_text(c)) for c in completions]\n")

    assert source_digest(module) is not None

    score.run(ScoreConfig(reward_funcs=[f"{module}.graded"], reward_num_workers=1), rollouts_path, 2, out_dir)
    assert [r["reward"] for r in _scored(out_dir)] == [float(len(c)) for _, c in COMPLETIONS]


def test_reward_using_signal_alarm(rollouts_path, out_dir, user_rewards):
    cfg = ScoreConfig(reward_funcs=[f"{user_rewards}.uses_alarm"], reward_num_workers=1)

    score.run(cfg, rollouts_path, 2, out_dir)

    assert [r["reward"] for r in _scored(out_dir)] == [2.0, 2.0, 2.0, 2.0]


@pytest.mark.timeout(60)
def test_signal_alarm_works_in_replaced_workers(rollouts_path, out_dir, user_rewards):
    hangs, guarded = f"{user_rewards}.hangs_on_guess", f"{user_rewards}.alarm_guarded"
    cfg = ScoreConfig(reward_funcs=[hangs, guarded], reward_num_workers=1, reward_timeout_s=1, scale_rewards="none",
                      max_error_rate=1.0)

    metrics = score.run(cfg, rollouts_path, 2, out_dir)

    # `hangs_on_guess` got the only worker killed twice; `alarm_guarded` then ran on its replacement.
    rows = _scored(out_dir)
    assert [dict(r["rewards"])[guarded] for r in rows] == [float(len(c)) for _, c in COMPLETIONS]
    assert [r["errors"] for r in rows] == [[], [f"{hangs}: TimeoutError after 1 s"], [], []]
    assert metrics["score/errors"] == 1


def test_user_module_is_importable_here(user_rewards):
    # Sanity check of the fixture itself: the parent process imports it from tmp_path too.
    module = importlib.import_module(user_rewards)
    assert module.length(completions=["abc", [{"role": "assistant", "content": "de"}]]) == [3.0, 2.0]


def test_two_threads_share_one_pool():
    """Async prefetch scores two rounds from two threads on the process-wide pool: calls take turns."""
    import threading

    from stages.scoring.reward_pools import shared_pool

    pool = shared_pool(["format"], 2, 30.0)
    jobs = [("format", {"prompts": [[{"role": "user", "content": "?"}]] * 4,
                        "completions": [[{"role": "assistant", "content": "<answer>1</answer>"}]] * 2
                        + [[{"role": "assistant", "content": "1"}]] * 2}, ["a", "b", "c", "d"])] * 8
    results, failures = [], []

    def score():
        try:
            results.append(pool.score(jobs))
        except Exception as e:  # noqa: BLE001 -- the test reports it
            failures.append(e)

    threads = [threading.Thread(target=score) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures and len(results) == 2
    for result in results:
        assert [values for values, _ in result] == [[1.0, 1.0, 0.0, 0.0]] * 8
        assert all(errors == {} for _, errors in result)
