"""Training across machines: a stage's ranks as Ray Train workers (`train.backend: ray`).

`launch_on_ray` is `stages.runtime.distributed.launch` for a Ray cluster: Ray Train's TorchTrainer starts
`train.num_processes` workers on the cluster's nodes (`train.ray`: CPUs/GPUs each, spread or pack),
joins them in one torch process group (gloo for CPU tensors, NCCL for CUDA tensors when they have
GPUs), and each worker runs the stage function exactly as a torchrun rank does
(`distributed.run_rank`: same kwargs plus `group`), so ddp, fsdp and the equal-to-one-process result
hold unchanged. Rank 0's step metrics and progress come back through a Ray queue while the stage runs,
and its return value at the end, with `train_nodes` (how many machines the ranks ran on) added.

The workers get this pipeline's source with their config (stages/runtime/ray_cluster.py, as reward and engine
actors do), so a node needs the installed libraries but no checkout. Paths in the stage's arguments
(model, rollouts, the output folder rank 0 writes) must be the same on every node: the artifacts folder
on a filesystem every node mounts at the same path (docs/SCALING.md).

Failure handling: a rank that raises or dies fails the whole stage (no restarts: `max_failures=0`), a
DistributedError names the stage and quotes Ray's error; nothing is published, as with torchrun.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Callable

from stages.runtime.distributed import DistributedError, TrainConfig, deliver

RESULT = "result"
"""Kind of the queue event that carries rank 0's return value."""


def _worker_loop(config: dict) -> None:
    """One Ray Train worker = one rank: install the shipped code, then run the stage like a torchrun rank."""
    import ray
    import ray.train
    import torch
    import torch.distributed as dist

    from stages.runtime.ray_cluster import install_code

    install_code(config["files"], "posttrain-train-")
    from stages.runtime.distributed import Group, run_rank  # the shipped copy, the code whose digest is in the keys

    torch.set_num_threads(config["threads"])
    context = ray.train.get_context()
    group = Group(context.get_world_rank(), context.get_world_size(), config["strategy"])
    events = config["events"]
    # a worker placed after the launcher gave up finds the queue gone and fails here, before any training
    events.put({"kind": "node", "rank": group.rank, "node": ray.get_runtime_context().get_node_id()})
    emit = events.put if group.rank == 0 else None
    value = run_rank(config, group, emit)
    if group.rank == 0:
        events.put({"kind": RESULT, "value": value})
    dist.barrier()  # rank 0's result is queued before any worker ends


def launch_on_ray(target: str, kwargs: dict, train: TrainConfig, label: str,
                  on_metrics: Callable[[dict, int], None] | None = None,
                  on_step: Callable[[int, int], None] | None = None, poll_s: float = 0.2):
    """Run `target` ("module:function") on train.num_processes Ray Train workers; return rank 0's value
    (a dict gets `train_nodes`). Raises DistributedError, naming `label`, if the workers fail or cannot
    be placed within train.ray.startup_timeout_s."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.queue import Queue

    from stages.runtime import ray_cluster

    options, n = train.ray, train.num_processes
    where = ray_cluster.connect(options.address)
    ray_cluster.ship_by_value(sys.modules[__name__])
    module = target.split(":")[0]
    gpus = options.num_gpus_per_process > 0
    resources = {"CPU": options.num_cpus_per_process, **({"GPU": options.num_gpus_per_process} if gpus else {})}
    _check_fits(resources, n, label, where)  # before the events queue: a refused launch leaves no actor behind
    events = Queue()
    config = {"target": target, "kwargs": kwargs, "strategy": train.strategy, "events": events,
              "threads": max(1, int(options.num_cpus_per_process)),
              "files": ray_cluster.source_files(["stages.runtime.distributed", "stages.runtime.ray_cluster", module]),
              "callbacks": [name for name, fn in (("on_metrics", on_metrics), ("on_step", on_step)) if fn]}
    storage = tempfile.mkdtemp(prefix="posttrain-ray-train-")  # Ray Train's run state (no checkpoints: ours)
    trainer = TorchTrainer(
        _worker_loop, train_loop_config=config,
        torch_config=TorchConfig(backend="cpu:gloo,cuda:nccl" if gpus else "gloo"),
        scaling_config=ScalingConfig(num_workers=n, use_gpu=gpus, resources_per_worker=resources,
                                     placement_strategy=options.placement.upper()),
        run_config=RunConfig(name=f"posttrain-{label.replace(' ', '-')}-{os.getpid()}-{time.time_ns()}",
                             storage_path=storage,
                             failure_config=FailureConfig(max_failures=0)))
    outcome = _fit_in_thread(trainer, label)
    nodes: dict[int, str] = {}
    value = None
    started = time.monotonic()
    try:
        while True:
            for event in events.get_nowait_batch(events.qsize()) if events.qsize() else []:
                if event["kind"] == "node":
                    nodes[event["rank"]] = event["node"]
                elif event["kind"] == RESULT:
                    value = event["value"]
                else:
                    deliver(event, on_metrics, on_step)
            if outcome.get("done") and not events.qsize():
                break
            if len(nodes) < n and time.monotonic() - started > options.startup_timeout_s:
                free = ray.available_resources()
                raise DistributedError(
                    f"{label}: only {len(nodes)} of {n} ranks started on the Ray cluster ({where}) within "
                    f"train.ray.startup_timeout_s = {options.startup_timeout_s:g} s; each asks {resources}, "
                    f"the cluster has {({k: v for k, v in free.items() if k in ('CPU', 'GPU')})} free")
            time.sleep(poll_s)
    finally:  # also cancels: a worker that starts after this fails at its first put
        ray.kill(events.actor)
        if outcome.get("done"):
            shutil.rmtree(storage, ignore_errors=True)
    if "error" in outcome:
        raise DistributedError(f"{label}: training on {n} Ray Train workers ({where}) failed: "
                               f"{outcome['error']}") from outcome["error"]
    if value is None:
        raise DistributedError(f"{label}: the Ray Train workers ({where}) ended without rank 0's result")
    return {**value, "train_nodes": len(set(nodes.values()))} if isinstance(value, dict) else value


def _check_fits(resources: dict, n: int, label: str, where: str) -> None:
    """Raise DistributedError, naming `label`, if n ranks asking `resources` each exceed the Ray cluster's
    total resources (cluster `where`)."""
    import ray

    total = ray.cluster_resources()
    short = {k: f"{n * v:g} asked, {total.get(k, 0):g} in the cluster" for k, v in resources.items()
             if n * v > total.get(k, 0)}
    if short:
        raise DistributedError(f"{label}: train.num_processes = {n} ranks with {resources} each cannot fit on the "
                               f"Ray cluster ({where}): {short}; lower train.ray.num_cpus_per_process / "
                               "num_gpus_per_process or train.num_processes, or add nodes")


def _fit_in_thread(trainer, label: str) -> dict:
    """Start trainer.fit() on a daemon thread; the returned dict gets "error" if it raised and "done" when it
    ends, for `launch_on_ray`'s waiting loop to report."""
    outcome: dict = {}

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # reported by the waiting loop in launch_on_ray
            outcome["error"] = e
        finally:
            outcome["done"] = True

    threading.Thread(target=fit, name=f"ray-train {label}", daemon=True).start()
    return outcome
