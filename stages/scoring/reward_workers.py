"""A pool of spawned worker processes that run reward functions, and survive them.

Each worker imports the reward functions once, then runs one call at a time in its main thread
(so functions that use `signal.alarm`, like math-verify's timeouts, work); async functions are
awaited. A flaky sample does not stop the stage: a call that raises, runs past `timeout_s` or kills
its worker is retried one sample at a time (a hung or dead worker is killed and replaced first), so
the healthy samples of the batch still get their values, and each sample that fails on its own comes
back as an error string ("accuracy: TimeoutError after 60 s") with its traceback: handed to the caller (the
score stage writes them to a file and stops a function that fails too often) or logged as a warning naming the
function and the sample. With `memory_mb` (score.reward_memory_mb) the OS caps each worker's memory; an
allocation past it fails the call (MemoryError in Python), and a sample that breaches it on its own comes back
the same way ("accuracy: MemoryError past score.reward_memory_mb = 2048 MB"). A function may also fail single samples itself, without raising: a
`SampleError` in place of a value (remote verifiers do, for a request that failed).
Bugs do stop the stage with `RewardFunctionError`, naming the function: a reward module that cannot
be loaded in a worker, a function that returns the wrong number of values or something that is not a
number (or None).

Signals are the parent's business: a worker ignores SIGINT (a Ctrl-C reaches the whole process group; the
parent stops the run and closes its pools) and SIGTERM while its parent lives, and takes the end of its pipe
as "the parent is gone": it exits 0, quietly.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing as mp
import numbers
import reprlib
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

from stages.runtime.imports import load_function
from stages.scoring.rewards.common import SampleError  # noqa: F401  (reward functions import it from here too)

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
"""Seconds a worker may take to import the reward functions (a reward model may load for minutes)."""

MAX_ERROR_CHARS = 300
"""Longest error text kept per sample (the Parquet `errors` column); the log has the traceback."""


class RewardFunctionError(RuntimeError):
    """A reward function is broken (not merely failing on a sample); the message says which and how."""


REWARD_MODEL_PREFIX = "reward_model:"
"""`reward_model:/path/to/folder`: a trained reward model (AutoModelForSequenceClassification) as a
reward function. In a config, plain `reward_model` means this run's reward_model stage. The score stage hands
the workers `reward_model:{"folder": ..., "devices": {...}}` (`reward_model_source`): where the scorer runs."""


def reward_model_source(folder: Path | str, devices=None) -> str:
    """What a worker resolves to the reward model in `folder`, placed by `devices` (stages/runtime/devices.py)."""
    import json

    if devices is None:
        return f"{REWARD_MODEL_PREFIX}{folder}"
    return REWARD_MODEL_PREFIX + json.dumps({"folder": str(folder), "devices": devices.model_dump()})


def _reward_model_folder(source: str) -> tuple[Path, dict | None]:
    """(folder, DeviceConfig fields or None) of a `reward_model:` source."""
    import json

    body = source[len(REWARD_MODEL_PREFIX):]
    if body.startswith("{"):
        spec = json.loads(body)
        return Path(spec["folder"]), spec.get("devices")
    return Path(body), None


def is_model_name(name: str) -> bool:
    """A reward model named as TRL's `reward_funcs` and axolotl's `trl.reward_funcs` name one: a hub id
    (`org/name`) or a folder path, told from `module.fn` by its slash (`resolve_model_name` finds its files).

    >>> is_model_name("OpenAssistant/reward-model-deberta-v3-large-v2"), is_model_name("rewards.format_reward")
    (True, False)
    """
    from stages.scoring.rewards.remote import REMOTE_PREFIX

    return "/" in name and not name.startswith((REWARD_MODEL_PREFIX, REMOTE_PREFIX))


def resolve_model_name(name: str, key: str = "score.reward_funcs"):
    """The files of a reward model named TRL's way (`is_model_name`): a local folder, else a hub id resolved through
    the hub cache (downloaded into it when online and absent; read from it under HF_HUB_OFFLINE) to the commit its
    main branch points at (stages/data/model_source.py: a ModelSource whose `commit` the score stage's key holds).
    What cannot be resolved is a ModelSourceError naming `key`."""
    from stages.data import model_source

    try:
        source = model_source.resolve(name, key=key)
    except model_source.ModelSourceError as e:
        raise e if str(e).startswith(key) else model_source.ModelSourceError(f"{key}: {e}") from None
    if source.kind == "gguf":
        raise model_source.ModelSourceError(f"{key}: {name!r} is a GGUF file; a reward model is a transformers "
                                            "sequence-classification folder or hub id")
    return source


def split_reward_funcs(names) -> tuple[list[str], list[str]]:
    """(the functions: built-in names and `module.fn`, the reward-model folders of `reward_model:<folder>`);
    remote verifiers (`remote:...`) and reward models named TRL's way (`is_model_name`: keyed by their resolved
    source, score.run's `reward_models`) are neither."""
    from stages.scoring.rewards.remote import REMOTE_PREFIX

    folders = [n[len(REWARD_MODEL_PREFIX):] for n in names if n.startswith(REWARD_MODEL_PREFIX)]
    return [n for n in names if not n.startswith((REWARD_MODEL_PREFIX, REMOTE_PREFIX)) and not is_model_name(n)], \
        folders


def resolve_reward(name: str, load: bool = True) -> Callable | None:
    """A built-in reward by name, `module.fn`, `reward_model:<folder>` (loaded once per process), a reward model
    named TRL's way (`is_model_name`: a hub id or a folder; the score stage hands workers its resolved folder as
    `reward_model:` instead), or a remote verifier (`remote:{its config as JSON}`, stages/scoring/rewards/remote.py
    `remote_source`). With `load=False` a reward model's folder or a verifier's config is only checked, not loaded."""
    from stages.scoring.rewards.remote import REMOTE_PREFIX, remote_verifier, verifier_from_source

    if is_model_name(name):
        name = REWARD_MODEL_PREFIX + str(resolve_model_name(name).path)
    if name.startswith(REMOTE_PREFIX):
        try:
            cfg = verifier_from_source(name)
        except ValueError:
            raise ValueError(f"reward_funcs: {name!r}: a remote verifier is named in score.remote_verifiers "
                             "and used as remote:<name> in score.reward_funcs") from None
        return remote_verifier(cfg) if load else None
    if name.startswith(REWARD_MODEL_PREFIX):
        folder, placement = _reward_model_folder(name)
        if not (folder / "config.json").exists():
            raise ValueError(f"reward_funcs: {REWARD_MODEL_PREFIX}{folder}: no model folder (config.json) there")
        if not load:
            return None
        from stages.runtime.devices import DeviceConfig
        from stages.scoring.rewards.reward_model import reward_model_function

        return reward_model_function(folder, devices=DeviceConfig(**placement) if placement else None)
    from stages.scoring.rewards import BUILTIN_REWARDS

    return load_function(name, "reward_funcs", BUILTIN_REWARDS)


def call_reward(fn: Callable, batch: dict):
    """Call fn with TRL's keyword signature and await it if it is async."""
    values = fn(**batch)
    if inspect.isawaitable(values):
        values = asyncio.run(values)
    return values


def load_rewards(sources: dict[str, str]) -> tuple[dict[str, Callable], tuple | None]:
    """Resolve every reward function of a worker: ({name: function}, None), or ({}, the "load_error" reply
    naming the one that failed)."""
    funcs = {}
    for name, source in sources.items():
        try:
            funcs[name] = resolve_reward(source)
        except BaseException as e:
            return {}, ("load_error", name, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")
    return funcs, None


def answer(funcs: dict[str, Callable], name: str, batch: dict) -> tuple:
    """One call of a worker, as its reply: ("ok", values, None), ("error", "<Type>: <message>", traceback)
    when the call raised, ("bad", what it returned, None) when that is not a list of values."""
    try:
        values = call_reward(funcs[name], batch)
    except BaseException as e:  # report, never die on a user error
        return ("error", f"{type(e).__name__}: {e}", traceback.format_exc(limit=-3))
    try:
        return ("ok", list(values), None)
    except Exception:  # not iterable
        return ("bad", f"{reprlib.repr(values)} ({type(values).__name__})", None)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def start_quietly(process) -> None:
    """Start a spawned child with SIGINT and SIGTERM blocked (the mask survives fork and exec), so that a Ctrl-C
    while its interpreter starts is held until its main function has set `parent_handles_signals`."""
    if not hasattr(signal, "pthread_sigmask"):  # Windows
        return process.start()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def parent_handles_signals() -> None:
    """In a child started by `start_quietly`: ignore SIGINT, and SIGTERM while the parent lives (the parent
    stops the run and closes its children: a child that died first would look like a crash of its function);
    an orphan exits 0 on SIGTERM. Then take the signals held since the start."""
    import os

    parent = os.getppid()

    def on_sigterm(signum, frame):
        if os.getppid() != parent:
            os._exit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def limit_memory(memory_mb: int) -> None:
    """Cap this process's memory at `memory_mb` MiB, enforced by the kernel: RLIMIT_DATA, its heap and private
    writable mappings (what Python, numpy and torch allocate; not the address space libraries reserve and never
    touch, which RLIMIT_AS would count: importing torch alone reserves ~0.8 GB of it, more with more cores). An
    allocation past it fails: MemoryError in Python, an error naming the allocation in numpy and torch.
    Linux; elsewhere RLIMIT_DATA may not cover mmap, so large allocations can get past it."""
    import resource

    limit = int(memory_mb * 2**20)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def _worker_main(conn, sources: dict[str, str], index: int = 0, memory_mb: int | None = None) -> None:
    """Import every reward function once, say "ready", then answer (name, batch) messages until None, or
    until the pipe ends (the parent is gone: exit quietly).
    Worker `index` is this process's LOCAL_RANK: a reward model on CUDA goes to GPU index % GPUs
    (stages/runtime/devices.py), so the workers of a multi-GPU machine share them out. `memory_mb`: the cap
    (`limit_memory`), set before the user's code is imported."""
    import os

    parent_handles_signals()
    if memory_mb:
        limit_memory(memory_mb)
    os.environ["LOCAL_RANK"] = str(index)
    try:
        funcs, load_error = load_rewards(sources)
        if load_error:
            conn.send(load_error)
            return
        conn.send(("ready", None, None))
        while True:
            message = conn.recv()
            if message is None:
                return
            reply = answer(funcs, *message)
            try:
                conn.send(reply)
            except (BrokenPipeError, ConnectionResetError):
                raise
            except Exception:  # values that cannot be pickled
                conn.send(("bad", f"{reprlib.repr(reply[1])} (not picklable)", None))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the parent is gone
        return


def _exit_reason(proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


@dataclass(eq=False)
class _Worker:
    proc: object  # the process (mp.Process) or Ray actor handle
    conn: object  # its pipe, or the Ray ObjectRef of the reply it owes (None while idle)
    ready: bool = False
    task: tuple[int, int, int] | None = None  # (job, first sample, end) being scored
    deadline: float = 0.0  # of the call, or of the import while not ready
    death: str | None = None  # why it stopped answering, once it has (Ray actors)
    sent: float = 0.0  # when its current call was handed over


class RewardWorkerPool:
    """`num_workers` spawned processes that score batches with named reward functions."""

    def __init__(self, names: list[str], num_workers: int, timeout_s: float, sources: dict[str, str] | None = None,
                 memory_mb: int | None = None):
        """`sources` maps a reward's name (as jobs and results call it) to what resolves it, when
        they differ, e.g. {"reward_model": "reward_model:/artifacts/reward_model/<key>"}. `memory_mb`: each
        worker's memory cap (score.reward_memory_mb; None: none)."""
        self.memory_mb = memory_mb
        self.sources = {name: (sources or {}).get(name, name) for name in names}
        for name in self.sources.values():
            resolve_reward(name, load=False)  # fail fast in the parent with a clear message
        self.names = list(names)
        self.timeout_s = timeout_s
        self.ctx = mp.get_context("spawn")
        self.workers = [self._spawn(i) for i in range(num_workers)]
        self.broken = False
        self._lock = threading.Lock()

    # How the pool reaches its workers: spawned processes and pipes here; RayRewardPool
    # (stages/scoring/ray_rewards.py) overrides these five with Ray actors and ObjectRefs.

    def _spawn(self, index: int = 0) -> _Worker:
        """Worker `index` (its slot in the pool), new, loading the reward functions; its first reply is "ready"
        or "load_error"."""
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=_worker_main, args=(child, self.sources, index, self.memory_mb), daemon=True)
        start_quietly(proc)
        child.close()
        return _Worker(proc, parent, deadline=time.monotonic() + STARTUP_TIMEOUT_S)

    def _kill(self, worker: _Worker, grace_s: float = 0.0) -> None:
        """Stop a worker: after `grace_s` s for one that was asked to exit, at once otherwise."""
        if grace_s:
            worker.proc.join(timeout=grace_s)
        if worker.proc.is_alive():
            worker.proc.kill()
        worker.proc.join()
        worker.conn.close()

    def _alive(self, worker: _Worker) -> bool:
        return worker.proc.is_alive()

    def _send(self, worker: _Worker, message: tuple) -> bool:
        """Hand a (name, batch) call to an idle worker; False when it turns out to be dead."""
        try:
            worker.conn.send(message)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def _receive(self, busy: list[_Worker], timeout: float) -> dict[_Worker, tuple | None]:
        """Wait up to `timeout` s for replies of `busy` workers: {worker: reply, or None if it died}."""
        replies: dict[_Worker, tuple | None] = {}
        ready = wait([w.conn for w in busy], timeout=timeout)
        for w in busy:
            if w.conn in ready:
                try:
                    replies[w] = w.conn.recv()
                except (EOFError, OSError):  # the worker died
                    w.proc.join(timeout=1)
                    replies[w] = None
        return replies

    def _death(self, worker: _Worker) -> str:
        """Why a worker that stopped answering died, in a few words."""
        return _exit_reason(worker.proc)

    def _startup_hint(self) -> str:
        """What to add to a "did not start" error (where the workers were to run)."""
        return ""

    def alive(self) -> bool:
        return not self.broken and bool(self.workers)

    def close(self) -> None:
        for w in self.workers:
            try:
                if self._alive(w) and w.task is None and not self.broken:  # read after importing
                    self._send(w, None)
            except (BrokenPipeError, OSError):
                pass
        for w in self.workers:
            self._kill(w, grace_s=1.0)
        self.workers = []

    def _fail(self, message: str):
        self.broken = True
        self.close()
        raise RewardFunctionError(message)

    def score(self, jobs: list[tuple[str, dict, list[str]]], stats: list | None = None,
              failures: list | None = None) -> list[tuple[list, dict[int, str]]]:
        """Run jobs (function name, keyword batch, sample ids) across the workers.

        Returns per job, in order, (values, errors): one value per sample (a float, or None where the
        function said "not applicable" or failed) and {sample index: "<name>: <what went wrong>"}.
        One call at a time: with async prefetch two rounds' score tasks share this pool from two threads.
        `stats`, if given, receives per worker slot [samples answered, seconds busy] (a replaced worker's
        go to its slot), for the throughput each worker reached. `failures`, if given, receives (function,
        sample id, error, traceback or "") per failed sample, in place of a logged warning each (the score stage
        writes them to a file: 256 tracebacks are no console output).
        """
        with self._lock:
            return self._score(jobs, stats if stats is not None else [], failures)

    def _score(self, jobs: list[tuple[str, dict, list[str]]], stats: list,
               failures: list | None = None) -> list[tuple[list, dict[int, str]]]:
        stats[:] = [[0, 0.0] for _ in self.workers]
        values: list[list] = [[None] * len(ids) for _, _, ids in jobs]
        errors: list[dict[int, str]] = [{} for _ in jobs]
        pending = deque((j, 0, len(ids)) for j, (_, _, ids) in enumerate(jobs))  # whole batches first
        for i, w in enumerate(self.workers):  # died while idle since the last call
            if w.ready and not self._alive(w):
                self._kill(w)
                self.workers[i] = self._spawn(i)

        def failed(task: tuple[int, int, int], error: str, details: str = "") -> None:
            j, lo, hi = task
            hinted = self._memory_hint(error)
            if hinted != error:  # past the memory cap: reported as a timeout is, without the traceback
                error, details = hinted, ""
            name, _, ids = jobs[j]
            if hi - lo > 1:  # isolate the failing samples: re-call the batch one sample at a time
                log.debug("reward function %r failed on samples %s..%s (%s); scoring them one at a time",
                         name, ids[lo], ids[hi - 1], error)
                pending.extend((j, i, i + 1) for i in range(lo, hi))
                return
            errors[j][lo] = f"{name}: {error}"[:MAX_ERROR_CHARS]
            if failures is not None:
                failures.append((name, ids[lo], error, details))
                return
            log.warning("reward function %r failed on sample %s: %s; it gets reward_on_error%s",
                        name, ids[lo], error, f"\n{details}" if details else "")

        while pending or any(w.task is not None for w in self.workers):
            for i, w in enumerate(self.workers):
                if pending and w.ready and w.task is None:
                    j, lo, hi = task = pending.popleft()
                    name, batch, _ = jobs[j]
                    if not self._send(w, (name, {k: v[lo:hi] for k, v in batch.items()})):
                        pending.appendleft(task)  # died while idle: not this task's fault
                        self._kill(w)
                        self.workers[i] = self._spawn(i)
                        continue
                    w.task, w.sent = task, time.monotonic()
                    w.deadline = w.sent + self.timeout_s
            busy = [w for w in self.workers if w.task is not None or not w.ready]
            nearest = min(w.deadline for w in busy)
            replies = self._receive(busy, max(0.0, nearest - time.monotonic()))
            for i, w in enumerate(self.workers):
                if w not in busy:
                    continue
                if w in replies:
                    if replies[w] is None:  # the worker died
                        reason = self._death(w)
                        if not w.ready:
                            hint = (f"; score.reward_memory_mb = {self.memory_mb:g} MB may be less than importing them "
                                    "takes (torch alone: ~1.6 GB on 16 cores)" if self.memory_mb else "")
                            self._fail(f"a reward worker died ({reason}) while importing reward_funcs {self.names}{hint}")
                        self._kill(w)
                        self.workers[i] = self._spawn(i)
                        failed(w.task, f"worker process died ({reason})")
                        continue
                    status, payload, details = replies[w]
                    if status == "load_error":
                        self._fail(f"reward function {payload!r} could not be loaded in a worker process: {details}")
                    if status == "ready":
                        w.ready = True
                        continue
                    task, w.task = w.task, None
                    stats[i][0] += task[2] - task[1]
                    stats[i][1] += time.monotonic() - w.sent
                    if status == "error":
                        failed(task, payload, details)
                    else:
                        self._check(jobs[task[0]], task, status, payload)
                        for i, v in enumerate(payload):  # samples the function failed on itself
                            if isinstance(v, BaseException):
                                payload[i] = None
                                failed((task[0], task[1] + i, task[1] + i + 1),
                                       str(v) if isinstance(v, SampleError) else f"{type(v).__name__}: {v}")
                        values[task[0]][task[1] : task[2]] = payload
                elif time.monotonic() >= w.deadline:
                    if not w.ready:
                        self._fail(f"reward workers did not finish importing reward_funcs {self.names} "
                                   f"within {STARTUP_TIMEOUT_S:g} s{self._startup_hint()}")
                    self._kill(w)
                    self.workers[i] = self._spawn(i)
                    failed(w.task, f"TimeoutError after {self.timeout_s:g} s")
        return list(zip(values, errors))

    def _memory_hint(self, error: str) -> str:
        """An error that an allocation past the memory cap caused, saying so (as a timeout says its seconds)."""
        if not self.memory_mb:
            return error
        if error.startswith("MemoryError"):
            rest = error.removeprefix("MemoryError").lstrip(": ")
            return f"MemoryError past score.reward_memory_mb = {self.memory_mb:g} MB" + (f" ({rest})" if rest else "")
        if "allocate memory" in error or error.startswith("worker process died"):  # torch's alloc error; C code
            return f"{error} (score.reward_memory_mb = {self.memory_mb:g} MB)"
        return error

    def _check(self, job: tuple[str, dict, list[str]], task: tuple[int, int, int], status: str, payload) -> None:
        """Stop the stage on what is a bug in the function, not a flaky sample."""
        name, _, ids = job
        _, lo, hi = task
        where = f"samples {ids[lo]}..{ids[hi - 1]}" if hi - lo > 1 else f"sample {ids[lo]}"
        if status == "bad":
            self._fail(f"reward function {name!r} returned {payload} for {where}; it must return a list with "
                       "one float (or None, or a SampleError) per completion")
        if len(payload) != hi - lo:
            self._fail(f"reward function {name!r} returned {len(payload)} values for {hi - lo} completions "
                       f"({where}); it must return one float (or None) per completion")
        for sample_id, v in zip(ids[lo:hi], payload):
            if v is not None and not isinstance(v, (numbers.Real, BaseException)):
                self._fail(f"reward function {name!r} returned {v!r} ({type(v).__name__}) for sample "
                           f"{sample_id}; expected a float or None")
