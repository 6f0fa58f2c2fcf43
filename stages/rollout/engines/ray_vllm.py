"""The `ray_vllm` rollout engine: `rollout.ray_vllm.num_engines` vLLM engines, each in a Ray actor.

Each actor holds one in-process vLLM engine (stages/rollout/engines/vllm_local.py: LoRA adapters as new
`LoRARequest`s, full fine-tuned weights taken in place), started on first use and kept across
rounds. A call's prompts are dealt out in turn, one share per live engine; every prompt keeps the
seed of its index in the whole call, so the completions do not depend on how many engines there
are or which one sampled a prompt. The policy is synced by path: each round the actors read the
round's adapter (or weights) folder, so the artifacts folder must be on a filesystem every node
mounts. An engine whose actor dies (killed, out of memory, its node lost) is dropped with a warning
and its share re-cut among the others; the next call starts a replacement.

Actors get this pipeline's engine code shipped with their arguments (stages/runtime/ray_cluster.py); nodes
need vLLM and torch installed. Resources per actor: `num_cpus_per_engine`, and `num_gpus_per_engine`
(default: `rollout.vllm.tensor_parallel_size` when the cluster has GPUs, else 0).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Callable

from stages.rollout.engines import Policy, Prompt, Sampling
from stages.runtime.ray_cluster import connect, install_code, ship_by_value, source_files

log = logging.getLogger(__name__)


class RayVLLMError(RuntimeError):
    """No engine could be started or none is left; the message says how many and why."""


def _first_error_lines(text: str, lines: int = 12) -> str:
    """The end of the actor's traceback, where its error is (Ray puts its own wording first)."""
    return "\n".join(text.strip().splitlines()[-lines:])


class VLLMActor:
    """One Ray actor: installs the shipped engine code, then samples with a VLLMEngine kept for its life."""

    def __init__(self, files: dict[str, str], base_dir: str, options: dict):
        import importlib

        if Path(base_dir).is_absolute() and not Path(base_dir).is_dir():  # before vLLM's import (~10 s of CPU)
            raise FileNotFoundError(f"{base_dir}: no such folder on this node (the artifacts folder must be on a "
                                    "filesystem every node mounts)")
        install_code(files, "posttrain-vllm-code-")
        self.engine = importlib.import_module("stages.rollout.engines.vllm_local").VLLMEngine(base_dir, **options)
        self.engine.start()  # built now, so the driver's start-up wait covers it and a failure names itself

    def generate(self, policy: dict, prompts: list, sampling: dict, indices: list[int]) -> list[dict]:
        from stages.rollout.engines import Policy, Sampling

        policy = Policy(**{k: Path(v) if k.endswith("_dir") and v is not None else v for k, v in policy.items()})
        return self.engine.generate(policy, prompts, Sampling(**sampling), indices=indices)

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id) of this actor."""
        import os

        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()


class RayVLLMEngine:
    """`num_engines` VLLMActor's on the Ray cluster at `address` (else RAY_ADDRESS, else a local instance)."""

    name = "ray_vllm"

    def __init__(self, base_dir, num_engines: int = 1, address: str | None = None, num_cpus_per_engine: float = 1.0,
                 num_gpus_per_engine: float | None = None, startup_timeout_s: float = 900.0, **vllm_options):
        self.base_dir = Path(base_dir)
        self.num_engines = num_engines
        self.address = address
        self.num_cpus = num_cpus_per_engine
        self.num_gpus = num_gpus_per_engine
        self.startup_timeout_s = startup_timeout_s
        self.vllm_options = vllm_options
        self.actors: list = []
        self.last_call: dict = {}  # per-engine completions of the last generate call
        self._actor_class = None
        self._files = None

    def _start(self) -> None:
        """Connect, then start actors until there are num_engines."""
        import ray

        if self._actor_class is None:
            self.where = connect(self.address)
            ship_by_value(sys.modules[__name__], sys.modules[install_code.__module__])
            gpus = self.num_gpus
            if gpus is None:
                gpus = self.vllm_options.get("tensor_parallel_size", 1) if ray.cluster_resources().get("GPU") else 0
            self._gpus = gpus
            self._actor_class = ray.remote(num_cpus=self.num_cpus, num_gpus=gpus, max_restarts=0)(VLLMActor)
            self._files = ray.put(source_files(["stages.rollout.engines.vllm_local"]))
        missing = self.num_engines - len(self.actors)
        if missing > 0:
            if self.actors:
                log.warning("ray_vllm: starting %d engine(s) in place of those lost", missing)
            started = [self._actor_class.remote(self._files, str(self.base_dir), self.vllm_options)
                       for _ in range(missing)]
            self.actors += started
            self._wait_started(started)

    def _wait_started(self, actors: list) -> None:
        """Wait until the new actors have built their engines: one that cannot be placed and built in time is an
        error naming the resources asked and free; one whose engine fails to build is an error quoting why."""
        import ray
        from ray.exceptions import RayActorError

        refs = [a.where.remote() for a in actors]
        ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=self.startup_timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as exc:  # the engine could not be built: every engine would fail the same way
                self.close()
                raise RayVLLMError(f"ray_vllm: a vLLM engine on {self.base_dir} failed to start on its Ray actor: "
                                   f"{_first_error_lines(str(exc))}") from None
        if waiting:
            self.close()
            free = ray.available_resources()
            raise RayVLLMError(
                f"ray_vllm: {len(waiting)} of {len(refs)} engine(s) not started within {self.startup_timeout_s:.0f} s "
                f"(Ray at {self.where}; each asks {self.num_cpus:g} CPU, {self._gpus:g} GPU; free now: "
                f"{free.get('CPU', 0):g} CPU, {free.get('GPU', 0):g} GPU); lower rollout.ray_vllm.num_engines or "
                "its per-engine resources, add nodes, or raise rollout.ray_vllm.startup_timeout_s")

    def generate(self, policy: Policy, prompts: list[Prompt], sampling: Sampling,
                 on_progress: Callable[[int], None] | None = None) -> list[dict]:
        """One completion per prompt, in order; the prompts shared out among the engines."""
        import ray
        from ray.exceptions import RayActorError

        self._start()
        engines = list(self.actors)
        results: list[dict | None] = [None] * len(prompts)
        served = {id(a): 0 for a in engines}
        policy_fields = {k: None if v is None else str(v) if isinstance(v, Path) else v
                         for k, v in dataclasses.asdict(policy).items()}
        sampling_fields = dataclasses.asdict(sampling)
        pending = list(range(len(prompts)))
        lost: list[str] = []
        while pending:
            if not self.actors:
                raise RayVLLMError(f"ray_vllm: every engine was lost with {len(pending)} of {len(prompts)} prompts "
                                   f"left ({'; '.join(lost)})")
            shares = [pending[i::len(self.actors)] for i in range(len(self.actors))]  # pending is sorted: so are they
            calls = {actor.generate.remote(policy_fields, [prompts[i] for i in share], sampling_fields, share):
                     (actor, share) for actor, share in zip(self.actors, shares) if share}
            pending = []
            waiting = list(calls)
            while waiting:
                ready, waiting = ray.wait(waiting, num_returns=1)
                actor, share = calls[ready[0]]
                try:
                    rows = ray.get(ready[0])
                except RayActorError as exc:  # the actor died: its share goes to the others
                    why = str(exc).strip().splitlines()[0][:200]
                    lost.append(why)
                    self.actors = [a for a in self.actors if a is not actor]
                    log.warning("ray_vllm: an engine was lost (%s); its %d prompts go to the %d other engine(s)",
                                why, len(share), len(self.actors))
                    pending += share
                    continue
                for i, row in zip(share, rows):
                    results[i] = row
                served[id(actor)] += len(rows)
                if on_progress:
                    on_progress(len(rows))
            pending.sort()
        self.last_call = {f"engine{index}": {"completions": served[id(a)], "lost": a not in self.actors}
                          for index, a in enumerate(engines)}
        return results

    def placement(self) -> list[tuple[str, int]]:
        """(Ray node id, process id) of each engine actor, for logs and tests."""
        import ray

        return ray.get([a.where.remote() for a in self.actors])

    def close(self) -> None:
        """End the engine actors (the cluster keeps running)."""
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone, or Ray shut down at exit
                pass
        self.actors = []
