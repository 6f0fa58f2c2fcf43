"""A pool of spawned worker processes that run reward functions.

Each worker imports the reward functions once and runs every call in its main thread
(so functions that use `signal.alarm`, like math-verify's timeouts, work). A call that
raises, returns the wrong number of values, exceeds `timeout_s`, or kills its worker
raises `RewardFunctionError` naming the function and the sample; the pool is then
shut down so no worker is left hanging. Async reward functions are awaited.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import multiprocessing as mp
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

from stages.imports import load_function


class RewardFunctionError(RuntimeError):
    """A reward function failed on a sample; the message says which and how."""


REWARD_MODEL_PREFIX = "reward_model:"
"""`reward_model:/path/to/folder`: a trained reward model (AutoModelForSequenceClassification) as a
reward function. In a config, plain `reward_model` means this run's reward_model stage."""


def resolve_reward(name: str, load: bool = True) -> Callable | None:
    """A built-in reward by name, `module.fn`, or `reward_model:<folder>` (loaded once per process).
    With `load=False` a reward model's folder is only checked, not loaded."""
    if name.startswith(REWARD_MODEL_PREFIX):
        folder = Path(name[len(REWARD_MODEL_PREFIX):])
        if not (folder / "config.json").exists():
            raise ValueError(f"reward_funcs: {name!r}: no model folder (config.json) at {folder}")
        if not load:
            return None
        from stages.reward_model import reward_model_function

        return reward_model_function(folder)
    from stages.rewards import BUILTIN_REWARDS

    return load_function(name, "reward_funcs", BUILTIN_REWARDS)


def call_reward(fn: Callable, batch: dict) -> list:
    """Call fn with TRL's keyword signature and await it if it is async."""
    values = fn(**batch)
    if inspect.isawaitable(values):
        values = asyncio.run(values)
    return list(values)


def _first_failing_sample(fn: Callable, batch: dict) -> int:
    """Re-run a failed batch one sample at a time to find the sample that raises."""
    n = len(batch["completions"])
    for i in range(n):
        try:
            call_reward(fn, {k: v[i : i + 1] for k, v in batch.items()})
        except BaseException:
            return i
    return 0


def _worker_main(conn, sources: dict[str, str]) -> None:
    funcs = {name: resolve_reward(source) for name, source in sources.items()}
    while True:
        message = conn.recv()
        if message is None:
            return
        name, batch = message
        try:
            conn.send(("ok", call_reward(funcs[name], batch)))
        except BaseException as e:  # report, never die on a user error
            index = _first_failing_sample(funcs[name], batch)
            conn.send(("error", (index, f"{type(e).__name__}: {e}", traceback.format_exc(limit=-3))))


class RewardWorkerPool:
    """`num_workers` spawned processes that score batches with named reward functions."""

    def __init__(self, names: list[str], num_workers: int, timeout_s: float, sources: dict[str, str] | None = None):
        """`sources` maps a reward's name (as jobs and results call it) to what resolves it, when
        they differ, e.g. {"reward_model": "reward_model:/artifacts/reward_model/<key>"}."""
        self.sources = {name: (sources or {}).get(name, name) for name in names}
        for name in self.sources.values():
            resolve_reward(name, load=False)  # fail fast in the parent with a clear message
        self.names = list(names)
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self.workers = []
        for _ in range(num_workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, self.sources), daemon=True)
            proc.start()
            child.close()
            self.workers.append((proc, parent))
        self.broken = False

    def alive(self) -> bool:
        return not self.broken and all(p.is_alive() for p, _ in self.workers)

    def close(self) -> None:
        for proc, conn in self.workers:
            try:
                if proc.is_alive() and not self.broken:
                    conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc, conn in self.workers:
            proc.join(timeout=1)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()
        self.workers = []

    def _fail(self, message: str):
        self.broken = True
        for proc, _ in self.workers:
            if proc.is_alive():
                proc.kill()
        self.close()
        raise RewardFunctionError(message)

    def score(self, jobs: list[tuple[str, dict, list[str]]]) -> list[list]:
        """Run jobs (function name, keyword batch, sample ids) across the workers.

        Returns one list of values per job, in order.
        """
        results: list = [None] * len(jobs)
        pending = list(range(len(jobs)))
        idle = list(range(len(self.workers)))
        running: dict[int, tuple[int, float]] = {}  # worker -> (job, deadline)
        while pending or running:
            while pending and idle:
                w, j = idle.pop(), pending.pop(0)
                self.workers[w][1].send((jobs[j][0], jobs[j][1]))
                running[w] = (j, time.monotonic() + self.timeout_s)
            nearest = min(deadline for _, deadline in running.values())
            ready = wait([self.workers[w][1] for w in running], timeout=max(0.0, nearest - time.monotonic()))
            for w in list(running):
                proc, conn = self.workers[w]
                j, deadline = running[w]
                name, batch, ids = jobs[j]
                where = f"samples {ids[0]}..{ids[-1]}" if len(ids) > 1 else f"sample {ids[0]}"
                if conn in ready:
                    try:
                        status, payload = conn.recv()
                    except (EOFError, OSError):
                        proc.join(timeout=1)
                        self._fail(f"reward function {name!r}: its worker process died "
                                   f"(exit code {proc.exitcode}) while scoring {where}")
                    if status == "error":
                        index, error, tb = payload
                        self._fail(f"reward function {name!r} raised on sample {ids[index]}: {error}\n{tb}")
                    if len(payload) != len(ids):
                        self._fail(f"reward function {name!r} returned {len(payload)} values for {len(ids)} "
                                   f"completions ({where}); it must return one float (or None) per completion")
                    results[j] = payload
                    del running[w]
                    idle.append(w)
                elif time.monotonic() >= deadline:
                    self._fail(f"reward function {name!r} did not return within reward_timeout_s="
                               f"{self.timeout_s:g}s on {where}")
        return results


_POOLS: dict[tuple, RewardWorkerPool] = {}


def shared_pool(names: list[str], num_workers: int, timeout_s: float,
                sources: dict[str, str] | None = None) -> RewardWorkerPool:
    """A pool kept alive across calls in this process (spawning costs seconds); replaced if broken."""
    key = (tuple(names), num_workers, timeout_s, tuple(sorted((sources or {}).items())))
    pool = _POOLS.get(key)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _POOLS[key] = RewardWorkerPool(names, num_workers, timeout_s, sources)
    return pool


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
