"""A long-lived rollout process: generation with its own interpreter, torch threads and CPU cores.

With `rollout.worker_process: true` the rollout stage runs in this spawned process instead
of the flow's. A prefetched rollout and the optimizer then no longer take turns on one
Python GIL (a tiny model's step is mostly Python), and `rollout.worker_cpus` /
`rollout.trainer_cpus` give each side its own cores -- the CPU analogue of verl's and
OpenRLHF's separate generation workers. The engine lives in the worker and is kept
across rounds, so a vLLM engine starts once per flow run as in-process.

The worker runs `stages.rollout.rollout.run` unchanged, so the rollouts it writes are the same
table the in-process path writes. If the process dies, the round fails with its exit code
and the next round starts a fresh worker. Signals are the flow's business, as for the reward workers
(stages/scoring/reward_workers.py `parent_handles_signals`): the worker ignores SIGINT, a flow stopped
mid-rollout kills it, and the end of its pipe (the flow's process is gone) ends it quietly.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import threading
import traceback
from pathlib import Path
from typing import Callable

from stages.scoring.reward_workers import parent_handles_signals, start_quietly


class RolloutWorkerError(RuntimeError):
    """The rollout failed inside the worker process (the message carries the worker's error)."""


def _main(conn, cpus: list[int] | None, torch_threads: int | None) -> None:
    """The worker's loop: one job at a time, progress messages while it runs; until None, or until the pipe
    ends (the flow's process is gone: exit quietly)."""
    parent_handles_signals()
    try:
        _serve(conn, cpus, torch_threads)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass


def _serve(conn, cpus: list[int] | None, torch_threads: int | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    import torch

    torch.set_num_threads(torch_threads or (len(cpus) if cpus else torch.get_num_threads()))
    from stages.rollout import rollout
    from stages.rollout.engines import close_engines

    try:
        while True:
            job = conn.recv()
            if job is None:
                break
            cfg_json, policy, prompts_path, round_index, out_dir, engine_settings, reroll_prompt_ids = job
            try:
                summary = rollout.run(rollout.RolloutConfig.model_validate(cfg_json), policy, Path(prompts_path),
                                      round_index, Path(out_dir), engine_settings,
                                      on_progress=lambda done, total: conn.send(("progress", done, total)),
                                      reroll_prompt_ids=reroll_prompt_ids)
                reply = ("done", summary)
            except (BrokenPipeError, ConnectionResetError):  # a progress message found the flow gone
                raise
            except Exception as exc:  # sent back whole: the flow re-raises it with the worker's traceback
                reply = ("error", type(exc).__name__, str(exc), traceback.format_exc())
            _release_gpu_cache()  # before the reply: the trainer may start on the same GPU when it comes
            conn.send(reply)
    finally:
        close_engines()


def _release_gpu_cache() -> None:
    """Hand the GPU memory this process's caching allocator holds but no tensor uses (the round's KV caches
    and logits) back to the driver: the trainer beside it on the same GPU is another process, whose
    allocator cannot reuse it. The engine's weights stay. No-op without CUDA."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class RolloutWorker:
    """One spawned rollout process; `run` is `stages.rollout.rollout.run` executed there."""

    def __init__(self, cpus: list[int] | None = None, torch_threads: int | None = None):
        self.cpus, self.torch_threads = cpus, torch_threads
        self._lock = threading.Lock()  # one job at a time (two prefetched rounds may call at once)
        self._process = None
        self._conn = None

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self._process = context.Process(target=_main, args=(child, self.cpus, self.torch_threads),
                                        name="posttrain-rollout", daemon=True)
        start_quietly(self._process)
        child.close()
        self._conn = parent

    def pid(self) -> int:
        """The worker process's id, started if it is not running (tasks/costs.py counts its CPU as the rollout's)."""
        with self._lock:
            if self._process is None or not self._process.is_alive():
                self._start()
            return self._process.pid

    def run(self, cfg, policy, prompts_path: Path, round_index: int, out_dir: Path,
            engine_settings: dict | None = None, on_progress: Callable[[int, int], None] | None = None,
            reroll_prompt_ids: list[str] = ()) -> dict:
        """Sample the round's rollouts in the worker process; return the stage summary."""
        with self._lock:
            if self._process is None or not self._process.is_alive():
                self._start()
            self._conn.send((cfg.model_dump(mode="json"), policy, str(prompts_path), round_index, str(out_dir),
                             engine_settings, list(reroll_prompt_ids)))
            try:
                return self._wait(round_index, on_progress)
            except RolloutWorkerError:  # the job is over (failed, or its worker died)
                raise
            except BaseException:  # stopped (Ctrl-C, SIGTERM) mid-job: the job is abandoned, and so is the worker
                self._process.kill()
                self._process.join(5)
                self._process = None
                raise

    def _wait(self, round_index: int, on_progress: Callable[[int, int], None] | None) -> dict:
        """The worker's reply to the job sent; its progress messages go to `on_progress`."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, ConnectionResetError):
                self._process.join(5)
                code = self._process.exitcode
                self._process = None
                raise RolloutWorkerError(
                    f"rollout r{round_index}: the rollout worker process died (exit code {code}); "
                    "the next round starts a new one") from None
            if message[0] == "progress":
                if on_progress:
                    on_progress(message[1], message[2])
            elif message[0] == "done":
                return message[1]
            else:
                _, name, text, worker_traceback = message
                raise RolloutWorkerError(f"rollout r{round_index} failed in the rollout worker: {name}: {text}\n"
                                         f"worker traceback:\n{worker_traceback}")

    def close(self) -> None:
        """Stop the process (its engines are closed first)."""
        with self._lock:
            if self._process is None:
                return
            try:
                self._conn.send(None)
                self._process.join(30)
            except (BrokenPipeError, OSError):
                pass
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
            self._process = None


_WORKERS: dict[tuple, RolloutWorker] = {}
_WORKERS_LOCK = threading.Lock()


def shared_worker(cpus: list[int] | None, torch_threads: int | None) -> RolloutWorker:
    """The process-wide rollout worker for these settings (started on first use)."""
    key = (tuple(cpus or ()), torch_threads)
    with _WORKERS_LOCK:
        return _WORKERS.setdefault(key, RolloutWorker(list(cpus) if cpus else None, torch_threads))


def close_workers() -> None:
    """Stop every rollout worker this process started (the flow's last step, and at exit)."""
    with _WORKERS_LOCK:
        workers = list(_WORKERS.values())
        _WORKERS.clear()
    for worker in workers:
        worker.close()


atexit.register(close_workers)
