"""Reward scoring on Ray actors (`score.backend: ray`): the reward worker pool of stages/reward_workers.py
with Ray actors in place of local processes, on any machine of a Ray cluster.

The contract is the local pool's, because the dispatch loop is the same code: one call at a time per
actor, in the actor's main thread (so `signal.alarm` graders work), async functions awaited, a call past
`reward_timeout_s` or an actor that dies costs only its samples (the actor is killed and replaced, the
batch re-scored one sample at a time, each failing sample gets `reward_on_error` and its `errors` entry),
and a function that cannot be loaded or returns the wrong shape stops the stage with RewardFunctionError.

Code shipping: each actor gets, with its arguments, the source files it imports: this pipeline's
modules it needs and the project-local modules of every `module.fn` reward (stages/imports.py
`local_modules`, the same files the stage's key hashes), and imports them from a folder of its own. So a
cluster node needs only the installed libraries (torch, math-verify, ...), not a copy of your project,
and runs exactly the code whose digest is in the artifact key. (Ray's `runtime_env` working_dir would
upload a folder too, but only once per driver process, at `ray.init`; a reward edited between two pools
of one process would not reach the actors.)

Where: `score.ray.address`, else `RAY_ADDRESS`, else a local Ray instance started in this process.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from stages.imports import local_modules
from stages.reward_workers import STARTUP_TIMEOUT_S, RewardWorkerPool, _Worker, split_reward_funcs

_CONNECT_LOCK = threading.Lock()


def connect(address: str | None) -> str:
    """Join the Ray cluster at `address` (or RAY_ADDRESS), or start a local instance; once per process.
    Returns where: the address, or "local"."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    with _CONNECT_LOCK:
        if not ray.is_initialized():
            if address:
                ray.init(address=address, log_to_driver=True)
            else:  # a local instance, small: it shares the machine with training
                ray.init(include_dashboard=False, object_store_memory=200 * 1024 * 1024, log_to_driver=True)
    return address or "local"


def _module_path(name: str, file: str) -> str:
    """Where module `name` lives relative to a sys.path entry: a/b.py, or a/b/__init__.py for a package."""
    parts = name.split(".")
    if os.path.basename(file) == "__init__.py":
        return os.path.join(*parts, "__init__.py")
    return os.path.join(*parts[:-1], parts[-1] + ".py")


def code_files(reward_sources: list[str]) -> dict[str, str]:
    """{path relative to a sys.path entry: source} of what an actor imports: stages.reward_workers' local
    closure and that of each `module.fn` reward."""
    modules: dict[str, str] = dict(local_modules("stages.reward_workers"))
    for source in split_reward_funcs(reward_sources)[0]:
        if "." in source:
            modules.update(local_modules(source.rpartition(".")[0]))
    return {_module_path(name, file): Path(file).read_text() for name, file in modules.items()}


class RewardActor:
    """One Ray actor: writes the shipped code into a folder of its own, imports the reward functions from
    it once, and answers calls (replies as the local workers'). Pickled by value (its module is registered
    with Ray's cloudpickle), so a node imports nothing of this pipeline before the shipped code is there."""

    def __init__(self, files: dict[str, str], sources: dict[str, str]):
        import importlib
        import tempfile

        root = tempfile.mkdtemp(prefix="posttrain-reward-code-")
        for relative, text in files.items():
            path = os.path.join(root, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        sys.path.insert(0, root)
        workers = importlib.import_module("stages.reward_workers")
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
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        self._files = ray.put(code_files([(sources or {}).get(n, n) for n in names]))
        self._actor_class = ray.remote(num_cpus=num_cpus, max_restarts=0, max_concurrency=1)(RewardActor)
        super().__init__(names, num_workers, timeout_s, sources)

    def placement(self) -> list[tuple[str, int]]:
        """(Ray node id, process id) of each actor, for logs and tests."""
        import ray

        return ray.get([w.proc.where.remote() for w in self.workers])

    def _spawn(self) -> _Worker:
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
