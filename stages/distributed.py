"""Training across processes (`train.num_processes`): a stage function run data-parallel on N ranks.

`launch("stages.grpo:run", kwargs, train, label, ...)` runs the function under torchrun
(`python -m torch.distributed.run --nproc_per_node N -m stages.distributed <spec>`) as a child of
the flow's process and waits for it. Every rank calls the function with the same kwargs plus
`group=Group(rank, world_size, strategy)`; the function splits the work by rank and sums gradients
across ranks itself (stages/grpo.py), or lets HF Trainer run DDP over the process group (stages/sft.py,
dpo.py, reward_model.py; each rank takes micro_batch_size / world_size rows).
Rank 0 alone writes the output folder, and streams `on_metrics` / `on_step` as JSON lines to a file
the parent tails while it waits, so MLflow step metrics and the progress bar work as in one process;
its return value comes back as JSON. Backend: gloo for CPU tensors, NCCL for CUDA tensors.

Failure handling: torchrun stops every rank when one fails; a non-zero exit raises `DistributedError`
naming the stage and quoting the workers' log. The children run in a session of their own, which the
parent kills on any exception (KeyboardInterrupt included) and at interpreter exit; each rank also
exits by itself when the flow's process is gone (killed with SIGKILL), as rollout and reward workers do.

Single node only: torchrun's `--nnodes` / rendezvous across machines is not wired.
"""

from __future__ import annotations

import atexit
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

from pydantic import BaseModel, ConfigDict, Field, model_validator

LOG_TAIL_LINES = 40


class TrainConfig(BaseModel):
    """Where training runs: on how many processes, with which data-parallel strategy. Not part of any
    stage's key: a 2-process run trains the same weights as a 1-process run (within float rounding)."""

    model_config = ConfigDict(extra="forbid")

    num_processes: int = Field(1, ge=1)
    """Data-parallel processes (ranks) of the training stages (optimize, sft, the dpo family, reward_model) on
    this machine, launched with torchrun. The global batch stays the config's (micro_batch_size *
    gradient_accumulation_steps), split across ranks, so the result equals one process's up to float rounding;
    the HF Trainer stages need their micro_batch_size divisible by it. 1 (default): train in the flow's process.
    Higher: the step's micro-batches run in parallel; each process loads the model, and torch's threads are
    divided between them (no speed-up when the machine has fewer cores than processes x threads)."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """ddp: every rank holds the whole model, gradients are summed across ranks before each optimizer step.
    fsdp (FSDP2 fully_shard: weights, gradients and optimizer state sharded across ranks) is not built yet."""
    master_port: int | None = Field(None, ge=1, le=65535)
    """TCP port of the ranks' rendezvous on 127.0.0.1. Unset: a free port is picked (torchrun --standalone)."""

    @model_validator(mode="after")
    def _strategy_is_built(self):
        if self.strategy == "fsdp":
            raise ValueError("train.strategy: fsdp is not built yet; use ddp (every rank holds the whole model, "
                             "gradients summed across ranks)")
        return self


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
    """What failed first: torchrun's "Root Cause" rank with its Python error if it raised one (the other ranks
    mostly report losing their peer), else how it ended, with the last lines of the workers' log."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    found = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*([^\n]*)", text, re.S)
    if found:  # a rank killed by a signal leaves no error file, and the others' errors are about losing it
        errors = [p for p in [scratch / f"rank{found.group(1)}.error"] if p.exists()]
    else:
        errors = sorted(scratch.glob("rank*.error"), key=lambda p: p.stat().st_mtime)
    if errors:
        rank = errors[0].stem.removeprefix("rank")
        return f"rank {rank} raised:\n{_tail(errors[0], 20)}\n(all ranks' output: {log_path})"
    how = f"rank {found.group(1)} ended with exit code {found.group(2).strip()}" if found else "no rank raised an error"
    return (f"{how}, without a Python error (killed, out of memory, or a crash); the last lines of the workers' "
            f"log {log_path}:\n{_tail(log_path, 15)}")


def launch(target: str, kwargs: dict, train: TrainConfig, label: str,
           on_metrics: Callable[[dict, int], None] | None = None,
           on_step: Callable[[int, int], None] | None = None, poll_s: float = 0.2) -> dict:
    """Run `target` ("module:function") on train.num_processes ranks with torchrun and return rank 0's
    return value. `kwargs` are pickled to the ranks (configs, paths); each rank gets them plus
    `group`, and rank 0 also those of `on_metrics` / `on_step` given here, whose calls reach them.
    Raises DistributedError, naming `label`, if any rank fails."""
    n = train.num_processes
    scratch = Path(tempfile.mkdtemp(prefix="posttrain-ranks-"))
    spec, events, result, log_path = (scratch / "spec.pkl", scratch / "events.jsonl", scratch / "result.json",
                                      scratch / "workers.log")
    threads = _threads_per_rank(n)
    spec.write_bytes(pickle.dumps({"target": target, "kwargs": kwargs, "strategy": train.strategy,
                                   "events": str(events), "result": str(result), "threads": threads,
                                   "parent_pid": os.getpid(),
                                   "callbacks": [name for name, fn in (("on_metrics", on_metrics), ("on_step", on_step))
                                                 if fn is not None]}))
    events.touch()
    rendezvous = (["--standalone"] if train.master_port is None else
                  ["--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(train.master_port)])
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc_per_node", str(n),
               "-m", "stages.distributed", str(spec)]
    path = [p for p in sys.path if p]  # the ranks import what this process imports (stages, user reward code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _running.add(proc)
    try:
        with open(events) as stream:
            pending = ""
            while True:
                done = proc.poll() is not None
                *lines, pending = (pending + stream.read()).split("\n")  # a line still being written waits
                for line in lines:
                    event = json.loads(line)
                    if event["kind"] == "metrics" and on_metrics:
                        on_metrics(event["metrics"], event["step"])
                    elif event["kind"] == "step" and on_step:
                        on_step(event["done"], event["total"])
                if done:
                    break
                time.sleep(poll_s)
        if proc.returncode != 0 or not result.exists():
            raise DistributedError(f"{label}: training on {n} processes failed (torchrun exit code {proc.returncode})"
                                   f"; {_root_cause(scratch, log_path)}")
    except BaseException:
        _kill_group(proc)
        raise
    finally:
        _running.discard(proc)
    value = json.loads(result.read_text())
    shutil.rmtree(scratch, ignore_errors=True)
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


def _main(spec_path: str) -> None:
    """One rank: join the process group, run the target, rank 0 streams events and writes the result."""
    import torch
    import torch.distributed as dist

    spec = pickle.loads(Path(spec_path).read_bytes())
    torch.set_num_threads(spec["threads"])
    threading.Thread(target=_watch_parent, args=(spec["parent_pid"],), daemon=True).start()
    # one group for both kinds of tensor: collectives on CPU tensors use gloo, on CUDA tensors NCCL
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    group = Group(dist.get_rank(), dist.get_world_size(), spec["strategy"])
    module, name = spec["target"].split(":")
    function = getattr(importlib.import_module(module), name)
    callbacks = {}
    if group.rank == 0:
        stream = open(spec["events"], "a")

        def emit(event: dict) -> None:
            stream.write(json.dumps(event, default=float) + "\n")
            stream.flush()

        callbacks = {"on_metrics": lambda metrics, step=0: emit({"kind": "metrics", "metrics": metrics, "step": step}),
                     "on_step": lambda done, total: emit({"kind": "step", "done": done, "total": total})}
        callbacks = {name: fn for name, fn in callbacks.items() if name in spec["callbacks"]}
    try:
        value = function(**spec["kwargs"], **callbacks, group=group)
        if group.rank == 0:
            temp = Path(spec["result"] + ".tmp")
            temp.write_text(json.dumps(value, default=str))
            temp.replace(spec["result"])
    except BaseException:  # for the parent's message; torchrun then stops the other ranks
        Path(spec["result"]).with_name(f"rank{group.rank}.error").write_text(traceback.format_exc())
        raise
    dist.destroy_process_group()

if __name__ == "__main__":
    _main(sys.argv[1])
