"""Reward scoring on Ray actors (`score.backend: ray`): the reward worker pool of stages/scoring/reward_workers.py
with Ray actors in place of local processes, on any machine of a Ray cluster.

The contract is the local pool's, because the dispatch loop is the same code: one call at a time per
actor, in the actor's main thread (so `signal.alarm` graders work), async functions awaited, a call past
`reward_timeout_s` or an actor that dies costs only its samples (the actor is killed and replaced, the
batch re-scored one sample at a time, each failing sample gets `reward_on_error` and its `errors` entry),
and a function that cannot be loaded or returns the wrong shape stops the stage with RewardFunctionError.

Code shipping (stages/runtime/ray_cluster.py): each actor gets the source of stages.scoring.reward_workers and of
every `module.fn` reward with their project-local imports, so a node needs only the installed libraries.

Where: `score.ray.address`, else `RAY_ADDRESS`, else a local Ray instance started in this process.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from stages.runtime.ray_cluster import connect, install_code, ship_by_value, source_files
from stages.scoring.reward_workers import STARTUP_TIMEOUT_S, RewardWorkerPool, _Worker, split_reward_funcs

log = logging.getLogger(__name__)


def code_files(reward_sources: list[str]) -> dict[str, str]:
    """{path relative to a sys.path entry: source} of what an actor imports: stages.scoring.reward_workers' local
    closure and that of each `module.fn` reward."""
    modules = ["stages.scoring.reward_workers"] + [source.rpartition(".")[0]
                                                   for source in split_reward_funcs(reward_sources)[0]
                                                   if "." in source]
    return source_files(modules)


class RewardActor:
    """One Ray actor: writes the shipped code into a folder of its own, imports the reward functions from
    it once, and answers calls (replies as the local workers'). Pickled by value (its module is registered
    with Ray's cloudpickle), so a node imports nothing of this pipeline before the shipped code is there."""

    def __init__(self, files: dict[str, str], sources: dict[str, str]):
        import importlib

        install_code(files, "posttrain-reward-code-")
        workers = importlib.import_module("stages.scoring.reward_workers")
        self.answer = workers.answer
        self.funcs, self.load_error = workers.load_rewards(sources)

    def ready(self) -> tuple:
        return self.load_error or ("ready", os.getpid(), None)

    def call(self, name: str, batch: dict) -> tuple:
        return self.answer(self.funcs, name, batch)

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()


class RayRewardPool(RewardWorkerPool):
    """`num_workers` Ray actors (`num_cpus` each) scoring like the local pool's processes."""

    def __init__(self, names: list[str], num_workers: int, timeout_s: float, sources: dict[str, str] | None = None,
                 address: str | None = None, num_cpus: float = 1.0):
        import ray

        self.where, self.num_cpus = connect(address), num_cpus
        ship_by_value(sys.modules[__name__], sys.modules[install_code.__module__])
        self._files = ray.put(code_files([(sources or {}).get(n, n) for n in names]))
        self._actor_class = ray.remote(num_cpus=num_cpus, max_restarts=0, max_concurrency=1)(RewardActor)
        free = ray.available_resources().get("CPU", 0)
        if free < num_workers * num_cpus:  # e.g. ray_vllm engines hold them: say so now, not at the time limit
            log.warning("score: Ray at %s has %g free CPUs and the %d reward actors ask for %g; those that do not fit "
                        "wait for CPUs to free up (at most %.0f s). Other actors of this run (rollout.ray_vllm "
                        "engines) keep theirs for the whole run: lower score.reward_num_workers, "
                        "score.ray.num_cpus_per_actor or rollout.ray_vllm.num_cpus_per_engine, or add nodes",
                        self.where, free, num_workers, num_workers * num_cpus, STARTUP_TIMEOUT_S)
        super().__init__(names, num_workers, timeout_s, sources)

    def placement(self) -> list[tuple[str, int]]:
        """(Ray node id, process id) of each actor, for logs and tests."""
        import ray

        return ray.get([w.proc.where.remote() for w in self.workers])

    def _spawn(self, index: int = 0) -> _Worker:  # Ray gives each actor its own GPUs (CUDA_VISIBLE_DEVICES)
        actor = self._actor_class.remote(self._files, self.sources)
        return _Worker(actor, actor.ready.remote(), deadline=time.monotonic() + STARTUP_TIMEOUT_S)

    def _kill(self, worker: _Worker, grace_s: float = 0.0) -> None:
        import ray

        try:
            ray.kill(worker.proc, no_restart=True)
        except Exception:  # already gone, or Ray shut down at exit
            pass

    def _alive(self, worker: _Worker) -> bool:
        return worker.death is None

    def _send(self, worker: _Worker, message: tuple | None) -> bool:
        if message is None:  # close(): ray.kill ends the actor
            return True
        worker.conn = worker.proc.call.remote(*message)
        return True

    def _receive(self, busy: list[_Worker], timeout: float) -> dict[_Worker, tuple | None]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        refs = [w.conn for w in busy]
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:  # and whatever else has finished by now
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        replies: dict[_Worker, tuple | None] = {}
        done = set(ready)
        for w in busy:
            if w.conn not in done:
                continue
            try:
                reply = ray.get(w.conn)
            except RayActorError as e:  # the actor died (killed, OOM, its node lost)
                w.death = str(e).strip().splitlines()[0][:200]
                reply = None
            except RayTaskError as e:  # the reply could not be sent back (e.g. values that do not serialize)
                reply = ("bad", f"a reply Ray could not return ({type(e.cause).__name__})", None)
            w.conn = None
            replies[w] = reply
        return replies

    def _startup_hint(self) -> str:
        import ray

        return (f" (Ray at {self.where}: {len(self.workers)} actors of {self.num_cpus:g} CPU each; free now: "
                f"{ray.available_resources().get('CPU', 0):g} CPU; lower score.reward_num_workers or "
                "score.ray.num_cpus_per_actor, or add nodes)")

    def _death(self, worker: _Worker) -> str:
        return f"Ray actor died: {worker.death}"
