"""Reward scoring on Ray actors (`score.backend: ray`, stages/scoring/ray_rewards.py) against a real two-node Ray
cluster on loopback: a head and a second node started with `ray start` (tests/cluster.py)."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import cluster
import pyarrow.parquet as pq
import pytest

if importlib.util.find_spec("ray") is None:  # not imported: collection on every pytest-xdist worker would import it
    pytest.skip("ray is not installed", allow_module_level=True)

from stages.scoring import reward_pools, score  # noqa: E402
from stages.scoring.reward_workers import RewardFunctionError  # noqa: E402
from stages.scoring.score import ScoreConfig  # noqa: E402
from test_score import COMPLETIONS, IDS, _scored, _write_rollouts, user_rewards  # noqa: E402, F401


DASHBOARD_PORT = cluster.free_port()


@pytest.fixture(scope="module")
def ray_cluster(ray_home):
    """The address of a head node (with Ray's dashboard on DASHBOARD_PORT) and one worker node, stopped (with
    this process's Ray client) after."""
    with cluster.joined_ray_cluster(ray_home, nodes=2, dashboard_port=DASHBOARD_PORT) as address:
        try:
            yield address
        finally:
            reward_pools.close_pools()


@pytest.fixture(autouse=True)
def close_pools():
    """Each test's actors leave the cluster's two CPUs to the next test's."""
    yield
    reward_pools.close_pools()


@pytest.fixture
def rollouts_path(tmp_path: Path) -> Path:
    return _write_rollouts(tmp_path / "rollouts.parquet", COMPLETIONS)


def on_ray(cfg: ScoreConfig, address: str) -> ScoreConfig:
    return ScoreConfig(**{**cfg.model_dump(), "backend": "ray", "ray": {"address": address}})


def test_actors_on_two_nodes_score_as_the_local_pool(ray_cluster, rollouts_path, tmp_path, user_rewards):
    cfg = ScoreConfig(reward_funcs=["accuracy", "format", f"{user_rewards}.sees_columns", f"{user_rewards}.uses_alarm",
                                    f"{user_rewards}.async_length", f"{user_rewards}.tagged_only"],
                      reward_batch_size=2)
    (tmp_path / "local").mkdir(), (tmp_path / "ray").mkdir()
    local = score.run(cfg, rollouts_path, 2, tmp_path / "local")
    remote = score.run(on_ray(cfg, ray_cluster), rollouts_path, 2, tmp_path / "ray")

    assert pq.read_table(tmp_path / "ray" / "scored.parquet").equals(
        pq.read_table(tmp_path / "local" / "scored.parquet"))
    without_workers = lambda metrics: {k: v for k, v in metrics.items() if not k.startswith("workers/")}  # noqa: E731
    assert without_workers(remote) == without_workers(local)
    assert remote["workers/count"] == 2 and remote["workers/ray_nodes"] == 2  # (in the MLflow score run)
    assert all(remote[f"workers/{slot}/samples_per_s"] > 0 for slot in (0, 1))
    rows = _scored(tmp_path / "ray")
    assert {dict(r["rewards"])[f"{user_rewards}.uses_alarm"] for r in rows} == {2.0}  # signal.alarm in the actor
    assert [r["errors"] for r in rows] == [[], [], [], []]


def test_actor_killed_mid_batch_costs_only_its_samples(ray_cluster, rollouts_path, tmp_path, user_rewards):
    name = f"{user_rewards}.exits_on_done"
    cfg = on_ray(ScoreConfig(reward_funcs=["format", name], scale_rewards="none", reward_batch_size=4,
                               max_error_rate=1.0), ray_cluster)

    metrics = score.run(cfg, rollouts_path, 2, tmp_path)

    rows = _scored(tmp_path)
    assert [dict(r["rewards"])[name] for r in rows] == [1.0, 1.0, 1.0, 0.0]  # reward_on_error for the last only
    assert [r["errors"][0].split(" (Ray actor died")[0] if r["errors"] else None for r in rows] == \
        [None, None, None, f"{name}: worker process died"]
    assert metrics["score/errors"] == 1
    assert [dict(r["rewards"])["format"] for r in rows] == [1.0, 0.0, 1.0, 0.0]
    # The dead actor was replaced: the same pool scores the next call in full.
    assert score.run(cfg, rollouts_path, 2, tmp_path)["score/errors"] == 1


def test_hanging_function_times_out_on_its_sample_only(ray_cluster, rollouts_path, tmp_path, user_rewards, caplog):
    caplog.set_level(logging.WARNING, logger="stages.scoring.reward_workers")
    name = f"{user_rewards}.hangs_on_guess"
    cfg = on_ray(ScoreConfig(reward_funcs=[name], reward_timeout_s=2, reward_batch_size=2, max_error_rate=1.0),
                 ray_cluster)

    metrics = score.run(cfg, rollouts_path, 2, tmp_path)

    rows = _scored(tmp_path)
    assert [r["reward"] for r in rows] == [1.0, 0.0, 1.0, 1.0]
    assert [r["errors"] for r in rows] == [[], [f"{name}: TimeoutError after 2 s"], [], []]
    assert metrics["score/errors"] == 1
    assert (f"reward function {name!r} failed on sample {IDS[1]}: TimeoutError after 2 s"
            in (tmp_path / "reward_errors.log").read_text())


def test_reward_that_cannot_load_on_an_actor_names_itself(ray_cluster, rollouts_path, tmp_path, monkeypatch):
    # Imports here (the stage checks every function before it starts workers), fails in the actors.
    (tmp_path / "only_here.py").write_text(
        f"import os\nif os.getpid() != {os.getpid()}:\n    raise ImportError('a module missing on the node')\n\n"
        "def reward(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "out").mkdir()
    cfg = on_ray(ScoreConfig(reward_funcs=["only_here.reward"]), ray_cluster)

    with pytest.raises(RewardFunctionError, match="'only_here.reward' could not be loaded.*missing on the node"):
        score.run(cfg, rollouts_path, 2, tmp_path / "out")


def test_reward_model_scores_on_actors_as_locally(ray_cluster, rollouts_path, tmp_path):
    from conftest import tiny_preference_model
    from stages.training import reward_model as rm

    tiny = tiny_preference_model(tmp_path / "rm", num_train=16, num_eval=4)
    cfg = rm.RewardModelConfig(max_steps=2, adapter="none", micro_batch_size=8, logging_steps=1)
    rm.run(cfg, tiny / "model", tiny / "prefs", tiny / "orm")
    # The folder is read by the actors: on a real cluster it must be on a filesystem every node sees.
    scoring = ScoreConfig(reward_funcs=[f"reward_model:{tiny / 'orm'}"], reward_num_workers=1)
    (tmp_path / "local").mkdir(), (tmp_path / "ray").mkdir()
    score.run(scoring, rollouts_path, 2, tmp_path / "local")
    score.run(on_ray(scoring, ray_cluster), rollouts_path, 2, tmp_path / "ray")

    local, remote = _scored(tmp_path / "local"), _scored(tmp_path / "ray")
    assert [r["reward"] for r in remote] == pytest.approx([r["reward"] for r in local], abs=1e-6)
    assert len({r["reward"] for r in remote}) > 1 and all(not r["errors"] for r in remote)


def test_the_dashboard_shows_the_reward_actors(ray_cluster, rollouts_path, tmp_path, user_rewards):
    """While a pool is open (pools stay open for the next round), Ray's dashboard lists its actors, alive, one on
    each node, under this run's job; the dashboard's own page answers."""
    import httpx
    import ray
    from ray.util.state import list_actors

    cfg = on_ray(ScoreConfig(reward_funcs=["accuracy", f"{user_rewards}.sees_columns"]), ray_cluster)
    score.run(cfg, rollouts_path, 2, tmp_path)
    actors = list_actors(address=f"http://127.0.0.1:{DASHBOARD_PORT}",
                         filters=[("class_name", "=", "RewardActor"), ("state", "=", "ALIVE")])
    assert len(actors) == 2 and len({a["node_id"] for a in actors}) == 2, actors
    assert {a["job_id"] for a in actors} == {ray.get_runtime_context().get_job_id()}
    assert httpx.get(f"http://127.0.0.1:{DASHBOARD_PORT}/", timeout=10).status_code == 200
