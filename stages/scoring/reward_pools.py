"""The reward worker pools a process keeps between calls: local worker processes (stages/scoring/reward_workers.py)
or Ray actors (stages/scoring/ray_rewards.py, `score.backend: ray`), one per set of reward functions and workers."""

from __future__ import annotations

import atexit
import threading

from stages.runtime.imports import user_code
from stages.scoring.reward_workers import RewardWorkerPool, split_reward_funcs

_POOLS: dict[tuple, RewardWorkerPool] = {}
_POOL_CODE: dict[tuple, list] = {}  # per pool: the user_code digests of its functions when its workers imported them


_POOLS_LOCK = threading.Lock()


def shared_pool(names: list[str], num_workers: int, timeout_s: float,
                sources: dict[str, str] | None = None, ray: dict | None = None,
                memory_mb: float | None = None) -> RewardWorkerPool:
    """A pool kept alive across calls in this process (spawning costs seconds); replaced if broken, or
    if the source of a `module.fn` it runs changed since its workers imported it. `ray`: the keyword
    arguments of a RayRewardPool (address, num_cpus) to score on Ray actors instead of local processes. `memory_mb`:
    each local worker's memory cap (score.reward_memory_mb)."""
    from stages.scoring.rewards import BUILTIN_REWARDS

    key = (tuple(names), num_workers, timeout_s, tuple(sorted((sources or {}).items())), memory_mb)
    if ray is not None:
        key += (("ray", tuple(sorted(ray.items()))),)
    resolved = [(sources or {}).get(name, name) for name in names]
    code = user_code(split_reward_funcs(resolved)[0], BUILTIN_REWARDS)
    with _POOLS_LOCK:  # score tasks of two rounds may ask at once (async prefetch)
        pool = _POOLS.get(key)
        if pool is None or not pool.alive() or _POOL_CODE.get(key) != code:
            if pool is not None:
                pool.close()
            if ray is not None:
                from stages.scoring.ray_rewards import RayRewardPool  # imports Ray's client only when asked

                pool = _POOLS[key] = RayRewardPool(names, num_workers, timeout_s, sources, **ray)
            else:
                pool = _POOLS[key] = RewardWorkerPool(names, num_workers, timeout_s, sources, memory_mb=memory_mb)
            _POOL_CODE[key] = code
        return pool


@atexit.register
def close_pools() -> None:
    """Stop every pool of this process (their workers exit)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
