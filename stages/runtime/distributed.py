"""Training across processes (`train.num_processes`): a stage function run data-parallel on N ranks.

`launch("stages.training.grpo:run", kwargs, train, label, ...)` runs the function under torchrun
(`python -m torch.distributed.run --nproc_per_node N -m stages.runtime.distributed <folder>`) as a child of
the flow's process and waits for it. Every rank calls the function with the same kwargs plus
`group=Group(rank, world_size, strategy)`; the function splits the work by rank and sums gradients
across ranks itself (stages/training/grpo.py), or lets HF Trainer run DDP over the process group
(stages/training/sft.py,
dpo.py, reward_model.py; each rank takes micro_batch_size / world_size rows).
Rank 0 alone writes the output folder, and streams `on_metrics` / `on_step` as JSON lines to a file
the parent tails while it waits, so MLflow step metrics and the progress bar work as in one process;
its return value comes back as JSON. Backend: gloo for CPU tensors, NCCL for CUDA tensors.

Warm ranks: inside `warm_ranks()` (a pipeline run, flows/pipeline.py) the ranks outlive a launch and run the
next one of the same shape: SFT and every optimize round share one torchrun, which imports and joins the process
group once. Each launch is a job folder (`job-<k>/spec.pkl`) the ranks wait for; rank 0 writes its result there
once every rank has finished it.

Failure handling: torchrun stops every rank when one fails; a non-zero exit raises `DistributedError`
naming the stage and quoting the workers' log. The children run in a session of their own, which the
parent kills on any exception (KeyboardInterrupt included) and at interpreter exit; each rank also
exits by itself when the flow's process is gone (killed with SIGKILL), as rollout and reward workers do.

`train.strategy: fsdp` (optimize stage): `shard_model` shards the model with FSDP2, and the stage runs
filler passes so every rank makes as many forward/backward calls as the others; its files are written
whole (`full_state_dict`, `full_optimizer_state`), the same as a one-process run's, so either can resume
the other.

Across machines: `train.backend: ray` runs the ranks as Ray Train workers (stages/runtime/ray_training.py
`launch_on_ray`, same arguments) instead of torchrun's processes on this machine; the caller picks one of the
two launchers by `train.backend` (tasks/stage_tasks.py `LAUNCHERS`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from stages.runtime.devices import DeviceConfig

LOG_TAIL_LINES = 40


class RayTrainConfig(BaseModel):
    """Where `train.backend: ray` places the ranks (stages/runtime/ray_training.py)."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = None
    """Ray cluster to join (`host:6379`); unset: RAY_ADDRESS, else a local Ray instance."""
    num_cpus_per_process: float = Field(1.0, gt=0)
    """CPUs Ray reserves for each rank; its torch threads follow (at least 1)."""
    num_gpus_per_process: float = Field(0.0, ge=0)
    """GPUs per rank (0: CPU training with gloo; 1: one GPU each, NCCL for CUDA tensors)."""
    placement: Literal["spread", "pack"] = "spread"
    """spread: ranks on as many nodes as possible (Ray's SPREAD); pack: as few as possible (PACK, less
    traffic between machines)."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """Seconds the ranks may wait for the cluster's free resources before the stage fails, naming them."""


class TrainConfig(DeviceConfig):
    """Where training runs: on which device in which precision (DeviceConfig, stages/runtime/devices.py; every stage
    that runs a model follows them), on how many processes, with which data-parallel strategy. Only the
    precision is part of stage keys: a 2-process run trains the same weights as a 1-process run, a GPU
    run as a CPU run (within float rounding)."""

    model_config = ConfigDict(extra="forbid")

    num_processes: int = Field(1, ge=1)
    """Data-parallel processes (ranks) of the training stages (optimize, sft, the dpo family, reward_model):
    on this machine with torchrun, or on a Ray cluster's nodes (`backend: ray`). The global batch stays the config's
    (micro_batch_size *
    gradient_accumulation_steps), split across ranks, so the result equals one process's up to float rounding;
    the HF Trainer stages need their micro_batch_size divisible by it. 1 (default): train in the flow's process.
    Higher: the step's micro-batches run in parallel; each process loads the model, and torch's threads are
    divided between them (no speed-up when the machine has fewer cores than processes x threads)."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """ddp: every rank holds the whole model, gradients are summed across ranks before each optimizer step.
    fsdp: the optimize stage shards its trainable model with FSDP2 (`fully_shard` per transformer block):
    each rank holds 1/num_processes of the weights, gradients and optimizer state between steps and gathers
    a block's weights only while it computes it. Less memory per rank, more communication; same result.
    The HF Trainer stages (sft, the dpo family, reward_model) train with ddp under either setting."""
    master_port: int | None = Field(None, ge=1, le=65535)
    """backend torchrun: TCP port of the ranks' rendezvous on 127.0.0.1. Unset: a free port is picked
    (torchrun --standalone)."""
    backend: Literal["torchrun", "ray"] = "torchrun"
    """torchrun: the ranks are processes of this machine. ray: the ranks are Ray Train workers
    (TorchTrainer) placed on the nodes of a Ray cluster (`train.ray`), which sets up the process group
    across machines; the artifacts folder must then be mounted at the same path on every node."""
    ray: RayTrainConfig = Field(default_factory=RayTrainConfig)


def per_device(micro_batch_size: int, num_processes: int, key: str) -> int:
    """Rows per micro-batch on each of `num_processes` ranks, so that the global batch stays micro_batch_size."""
    if micro_batch_size % num_processes:
        raise ValueError(f"{key} is {micro_batch_size}, not divisible by train.num_processes = {num_processes}: "
                         f"each process takes {key} / num_processes rows, so that the global batch is one "
                         f"process's; set {key} to a multiple of {num_processes}")
    return micro_batch_size // num_processes


def world_size() -> int:
    """Ranks of this process's initialized process group (HF Trainer runs DDP over it); 1 without one."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass(frozen=True)
class Group:
    """This process's place among the ranks of a launched stage (the process group is already initialized)."""

    rank: int
    world_size: int
    strategy: str = "ddp"

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum (or max) of `values` over the ranks, in float64 (gloo cannot reduce bf16; float64 keeps
        sums of per-rank statistics exact to ~1e-16)."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor.tolist()

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def sum_gradients(self, params: list) -> None:
        """Replace each parameter's gradient by its sum over the ranks (one flat all-reduce; a rank that
        ran no backward in this step contributes zeros). Losses here are already scaled for the whole
        global step, so the sum is the one-process gradient (DDP would average: a world-size factor)."""
        import torch
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()


# ---------------------------------------------------------------- FSDP2 (train.strategy: fsdp)


def shard_model(model, group: Group) -> None:
    """Shard `model` across the group's ranks in place with FSDP2: `fully_shard` on each transformer block
    (the classes HF lists in `_no_split_modules`), then on the whole model for what is left (embeddings,
    norm, head). Gradients are reduce-scattered as sums, not means: the losses here are already scaled for
    the global step (as `Group.sum_gradients`). Every rank must then run the same number of forward and
    backward passes of the model, since each one gathers and scatters with the others."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (group.world_size,))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a PEFT wrapper
    block_names = set(getattr(base, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"train.strategy fsdp: found no transformer blocks to shard in {type(base).__name__} "
                         f"(its _no_split_modules is {sorted(block_names)}); use train.strategy: ddp")
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


def whole(value):
    """A sharded tensor (DTensor) gathered whole on every rank (a collective); anything else as it is."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def full_state_dict(model) -> dict:
    """The model's state dict with every sharded tensor gathered (all ranks call it; same keys as unsharded).
    A weight shared by two names (tied embeddings) is gathered once, so both names hold one tensor and
    `save_pretrained` writes it once, as it does for the unsharded model."""
    gathered: dict[int, object] = {}
    state = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) not in gathered:
            gathered[id(value)] = whole(value.detach())
        state[name] = gathered[id(value)]
    return state


def full_optimizer_state(optimizer) -> dict:
    """`optimizer.state_dict()` with sharded state gathered: the file a one-process run writes (all ranks call)."""
    saved = optimizer.state_dict()
    return {**saved, "state": {index: {k: whole(v) for k, v in state.items()}
                               for index, state in saved["state"].items()}}


def shard_optimizer_state(saved: dict, optimizer) -> dict:
    """The inverse of `full_optimizer_state`: each whole state tensor of a sharded parameter cut the way the
    parameter is (a collective), so that `optimizer.load_state_dict` takes a one-process run's file."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entry in saved["state"].items():
        param = params[index] if isinstance(index, int) and index < len(params) else None
        if isinstance(param, DTensor):
            entry = {k: distribute_tensor(v, param.device_mesh, param.placements)
                     if getattr(v, "shape", None) == param.shape and v.dim() > 0 else v for k, v in entry.items()}
        state[index] = entry
    return {**saved, "state": state}


class DistributedError(RuntimeError):
    """A launched stage failed on one of its ranks (the message quotes the workers' log)."""


_running: set[subprocess.Popen] = set()


def _kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the launcher's whole session (torchrun and its ranks), SIGKILL what is left after grace_s."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@atexit.register
def _kill_all() -> None:
    for proc in list(_running):
        _kill_group(proc, grace_s=1.0)


def _threads_per_rank(num_processes: int) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // num_processes)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def _root_cause(scratch: Path, log_path: Path) -> str:
    """What failed first: a rank killed by a signal (torchrun's failure summary: the other ranks' errors are about
    losing it), else the rank whose Python error was written first (the others raise on losing it afterwards:
    torchrun's own "Root Cause" may name one of those when both exit within one of its polls), else how the ranks
    ended, with the last lines of the workers' log."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    ended = {}  # rank -> exit code, from torchrun's "Failures:" and "Root Cause" blocks
    for rank, code in re.findall(r"^\s*rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", text, re.M):
        ended.setdefault(rank, int(code))
    # killed by a signal, but not SIGTERM: torchrun's own stop of the other ranks once one has failed
    killed = [rank for rank, code in ended.items() if code < 0 and code != -signal.SIGTERM]
    errors = sorted(scratch.glob("rank*.error"), key=lambda p: p.stat().st_mtime)
    if errors and not killed:
        rank = errors[0].stem.removeprefix("rank")
        return f"rank {rank} raised:\n{_tail(errors[0], 20)}\n(all ranks' output: {log_path})"
    cause = killed[0] if killed else next(iter(ended), None)
    how = f"rank {cause} ended with exit code {ended[cause]}" if cause is not None else "no rank raised an error"
    return (f"{how}, without a Python error (killed, out of memory, or a crash); the last lines of the workers' "
            f"log {log_path}:\n{_tail(log_path, 15)}")


class _Ranks:
    """torchrun's launcher and its train.num_processes ranks, started once and running the jobs written into
    `folder` one at a time (job-0, job-1, ...) until `close()`; `key` says which launches may share them."""

    def __init__(self, train: TrainConfig, key: tuple, path: tuple[str, ...]):
        self.key, self.path, self.jobs, self.n = key, path, 0, train.num_processes
        self.folder = Path(tempfile.mkdtemp(prefix="posttrain-ranks-"))
        self.log_path = self.folder / "workers.log"
        threads = _threads_per_rank(self.n)
        (self.folder / "ranks.json").write_text(json.dumps({"threads": threads, "parent_pid": os.getpid()}))
        rendezvous = (["--standalone"] if train.master_port is None else
                      ["--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(train.master_port)])
        command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc_per_node", str(self.n),
                   "-m", "stages.runtime.distributed", str(self.folder)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": str(threads),
               "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        _running.add(self.proc)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, target: str, kwargs: dict, strategy: str, label: str, on_metrics, on_step, poll_s: float) -> dict:
        """Run one job on every rank and return rank 0's return value; DistributedError if a rank failed (the
        ranks are then gone)."""
        job = self.folder / f"job-{self.jobs}"
        self.jobs += 1
        job.mkdir()
        events, result = job / "events.jsonl", job / "result.json"
        events.touch()
        callbacks = [name for name, fn in (("on_metrics", on_metrics), ("on_step", on_step)) if fn is not None]
        (job / "spec.tmp").write_bytes(pickle.dumps({"target": target, "kwargs": kwargs, "strategy": strategy,
                                                     "callbacks": callbacks}))
        (job / "spec.tmp").replace(job / "spec.pkl")  # the ranks wait for this name: it appears whole
        with open(events) as stream:
            pending = ""
            while True:
                done = result.exists() or not self.alive()
                *lines, pending = (pending + stream.read()).split("\n")  # a line still being written waits
                for line in lines:
                    deliver(json.loads(line), on_metrics, on_step)
                if done:
                    break
                time.sleep(poll_s)
        if not result.exists():
            self.proc.wait()
            raise DistributedError(f"{label}: training on {self.n} processes failed (torchrun exit code "
                                   f"{self.proc.returncode}); {_root_cause(job, self.log_path)}")
        return json.loads(result.read_text())

    def close(self, grace_s: float = 30.0) -> None:
        """Let the ranks leave the process group and exit; killed if they have not after grace_s."""
        (self.folder / "close").touch()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _kill_group(self.proc)
        self.kill()

    def kill(self) -> None:
        _kill_group(self.proc)
        _running.discard(self.proc)
        shutil.rmtree(self.folder, ignore_errors=True)


_idle: dict[tuple, _Ranks] = {}  # warm ranks between two launches of a warm_ranks() scope
_warm_scopes = 0
_warm_lock = threading.Lock()


@contextlib.contextmanager
def warm_ranks():
    """Within this scope (one pipeline run), `launch` keeps its ranks alive for the next launch of the same
    shape: SFT and every optimize round run on the same processes, which import torch, transformers and
    the stage code and join the process group once (~10 s a launch on CPU; on a GPU also CUDA and NCCL's
    setup), not once a stage. On leaving the scope the ranks exit. Outside one, each launch starts its own."""
    global _warm_scopes
    with _warm_lock:
        _warm_scopes += 1
    try:
        yield
    finally:
        with _warm_lock:
            _warm_scopes -= 1
            leaving = list(_idle.values()) if _warm_scopes == 0 else []
            if _warm_scopes == 0:
                _idle.clear()
        for ranks in leaving:
            ranks.close()


RAY_OWN_PATH = f"{os.sep}ray{os.sep}thirdparty_files"
"""What `import ray` adds to sys.path (its vendored packages): training ranks never import from there, so a run
whose score stage starts Ray between SFT and the first round keeps its warm ranks."""


def _take_ranks(train: TrainConfig) -> _Ranks:
    """The idle warm ranks of this shape, if they can import what this process can (its sys.path then, less
    RAY_OWN_PATH: a user's code folder added since needs new ranks), else new ones (the old ones exit)."""
    key = (train.num_processes, train.master_port)
    # the ranks import what this process imports (stages, user code)
    path = tuple(p for p in sys.path if p and not p.endswith(RAY_OWN_PATH))
    with _warm_lock:
        ranks = _idle.pop(key, None)
    if ranks is not None and ranks.alive() and set(path) <= set(ranks.path):
        return ranks
    if ranks is not None:
        ranks.close()
    return _Ranks(train, key, path)


def _give_back(ranks: _Ranks) -> None:
    """Keep the ranks for the next launch inside a warm_ranks() scope, else let them exit."""
    with _warm_lock:
        keep = _warm_scopes > 0 and ranks.key not in _idle
        if keep:
            _idle[ranks.key] = ranks
    if not keep:
        ranks.close()


def launch(target: str, kwargs: dict, train: TrainConfig, label: str,
           on_metrics: Callable[[dict, int], None] | None = None,
           on_step: Callable[[int, int], None] | None = None, poll_s: float = 0.2) -> dict:
    """Run `target` ("module:function") on train.num_processes ranks with torchrun and return rank 0's
    return value. `kwargs` are pickled to the ranks (configs, paths); each rank gets them plus
    `group`, and rank 0 also those of `on_metrics` / `on_step` given here, whose calls reach them.
    Raises DistributedError, naming `label`, if any rank fails. Inside `warm_ranks()` the ranks of the last
    launch run this one too. `train.backend: ray` runs the ranks as Ray Train workers on a cluster's nodes
    instead (stages/runtime/ray_training.py `launch_on_ray`, the same contract)."""
    if train.backend != "torchrun":
        raise ValueError(f"train.backend {train.backend!r}: this launcher runs torchrun ranks; "
                         "tasks/stage_tasks.py LAUNCHERS has the one for each backend")
    ranks = _take_ranks(train)
    try:
        value = ranks.run(target, kwargs, train.strategy, label, on_metrics, on_step, poll_s)
    except BaseException:
        ranks.kill()
        raise
    _give_back(ranks)
    return value


def _watch_parent(pid: int) -> None:
    """Exit this rank when the flow's process is gone (it was killed and could not stop us)."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:
            pass


def run_rank(spec: dict, group: Group, emit: Callable[[dict], None] | None):
    """Call spec's target on this rank with spec's kwargs and `group`; on rank 0 (`emit` given) its
    on_metrics / on_step calls become events for the parent ({"kind": "metrics" | "step", ...})."""
    module, name = spec["target"].split(":")
    function = getattr(importlib.import_module(module), name)
    callbacks = {}
    if emit is not None:
        callbacks = {"on_metrics": lambda metrics, step=0: emit({"kind": "metrics", "metrics": metrics, "step": step}),
                     "on_step": lambda done, total: emit({"kind": "step", "done": done, "total": total})}
        callbacks = {name: fn for name, fn in callbacks.items() if name in spec["callbacks"]}
    return function(**spec["kwargs"], **callbacks, group=group)


def deliver(event: dict, on_metrics, on_step) -> None:
    """Parent side: hand one of rank 0's events to the stage's callbacks."""
    if event["kind"] == "metrics" and on_metrics:
        on_metrics(event["metrics"], event["step"])
    elif event["kind"] == "step" and on_step:
        on_step(event["done"], event["total"])


def _next_job(folder: Path, k: int) -> dict | None:
    """Wait for the parent's k-th job (None once it asks the ranks to close)."""
    spec = folder / f"job-{k}" / "spec.pkl"
    while not spec.exists():
        if (folder / "close").exists():
            return None
        time.sleep(0.05)
    return pickle.loads(spec.read_bytes())


def _run_job(job: dict, job_dir: Path, rank: int, world: int) -> None:
    """One job on this rank; rank 0 streams its events and, once every rank is done, writes its result."""
    import torch
    import torch.distributed as dist

    stream = open(job_dir / "events.jsonl", "a") if rank == 0 else None

    def emit(event: dict) -> None:
        stream.write(json.dumps(event, default=float) + "\n")
        stream.flush()

    try:
        value = run_rank(job, Group(rank, world, job["strategy"]), emit if rank == 0 else None)
        dist.all_reduce(torch.zeros(1))  # a CPU tensor (gloo): every rank has finished this job
        if rank == 0:
            temp = job_dir / "result.tmp"
            temp.write_text(json.dumps(value, default=str))
            temp.replace(job_dir / "result.json")
    except BaseException:  # for the parent's message; torchrun then stops the other ranks
        (job_dir / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        if stream is not None:
            stream.close()


def _main(folder: str) -> None:
    """One rank: join the process group, then run the parent's jobs in order until it writes `close`."""
    import gc

    import torch
    import torch.distributed as dist

    root = Path(folder)
    setup = json.loads((root / "ranks.json").read_text())
    torch.set_num_threads(setup["threads"])
    threading.Thread(target=_watch_parent, args=(setup["parent_pid"],), daemon=True).start()
    # one group for both kinds of tensor: collectives on CPU tensors use gloo, on CUDA tensors NCCL (each rank
    # on its LOCAL_RANK's GPU, the one stages/runtime/devices.py places its models on)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    k = 0
    while (job := _next_job(root, k)) is not None:
        _run_job(job, root / f"job-{k}", rank, world)
        k += 1
        gc.collect()  # the job's models and optimizer state, before the next job loads its own
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1])
