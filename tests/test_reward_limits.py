"""score.reward_memory_mb: the OS caps each reward worker's memory (stages/scoring/reward_workers.py
`limit_memory`); a sample whose call allocates past it fails alone, reported like a timeout, and the field is in
the score stage's key when set."""

from __future__ import annotations

import multiprocessing as mp
import sys

import pytest

from stages.scoring.reward_workers import RewardWorkerPool
from stages.scoring.score import ScoreConfig

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_DATA covers mmap on Linux only")

GREEDY = '''
def allocates(prompts, completions, **columns):
    """1.0 per completion; a completion saying "greedy" first asks for 2 GiB (zeroed pages: no real memory)."""
    for c in completions:
        if c[0]["content"] == "greedy":
            bytearray(2 * 2**30)
    return [1.0 for _ in completions]
'''


@pytest.fixture
def greedy(tmp_path, monkeypatch):
    (tmp_path / "greedy_rewards.py").write_text(GREEDY)
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned workers get the parent's sys.path
    return "greedy_rewards.allocates"


def score(name: str, memory_mb: float | None) -> tuple[list, dict]:
    before = set(mp.active_children())  # pools an earlier test's run keeps for this process (reward_pools.py)
    pool = RewardWorkerPool([name], 1, 60.0, memory_mb=memory_mb)
    try:
        texts = ["fine", "greedy", "fine"]
        batch = {"prompts": [[{"role": "user", "content": "q"}]] * 3,
                 "completions": [[{"role": "assistant", "content": t}] for t in texts]}
        ((values, errors),) = pool.score([(name, batch, ["r0-a", "r0-b", "r0-c"])])
        return values, errors
    finally:
        pool.close()
        assert set(mp.active_children()) <= before  # this pool's workers are gone


def test_an_allocation_past_the_cap_fails_only_its_sample_and_says_why(greedy, caplog):
    values, errors = score(greedy, memory_mb=512)
    assert values == [1.0, None, 1.0]
    assert errors == {1: f"{greedy}: MemoryError past score.reward_memory_mb = 512 MB"}
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"{greedy!r} failed on sample r0-b: MemoryError past" in m for m in warned), warned
    assert not any("Traceback" in m for m in warned), warned  # reported as a timeout is


def test_without_a_cap_the_same_allocation_succeeds(greedy):
    assert score(greedy, memory_mb=None) == ([1.0, 1.0, 1.0], {})


def test_the_cap_is_in_the_score_key_when_set():
    from stages.runtime.keys import key_fields

    assert "reward_memory_mb" not in key_fields(ScoreConfig())  # older keys stay valid
    assert key_fields(ScoreConfig(reward_memory_mb=512))["reward_memory_mb"] == 512
    with pytest.raises(ValueError):
        ScoreConfig(reward_memory_mb=0)


def test_a_memory_cap_with_ray_workers_is_refused():
    """Ray actors are not capped: the option would be silently ignored there, so it is refused."""
    from stages.scoring.score import ScoreConfig

    with pytest.raises(ValueError, match="reward_memory_mb caps local reward workers only"):
        ScoreConfig(reward_memory_mb=512, backend="ray")
    assert ScoreConfig(reward_memory_mb=512).reward_memory_mb == 512


def test_the_score_stage_hands_the_cap_to_its_workers(greedy, tmp_path):
    """score.reward_memory_mb reaches the workers the stage scores with: the greedy sample gets
    reward_on_error and its error names the cap; the others score."""
    import pyarrow.parquet as pq

    from stages.scoring import reward_pools, score as score_stage
    from test_score import _write_rollouts

    rollouts = _write_rollouts(tmp_path / "rollouts.parquet", [("p0", "fine"), ("p0", "greedy")])
    out = tmp_path / "scored"
    out.mkdir()
    cfg = ScoreConfig(reward_funcs=[greedy], reward_num_workers=1, reward_memory_mb=512, reward_on_error=-1.0,
                      max_error_rate=1.0)
    try:
        score_stage.run(cfg, rollouts, 2, out)
    finally:
        reward_pools.close_pools()
    rows = pq.read_table(out / "scored.parquet").to_pylist()
    assert [r["reward"] for r in rows] == [1.0, -1.0]
    assert rows[1]["errors"] == [f"{greedy}: MemoryError past score.reward_memory_mb = 512 MB"]
