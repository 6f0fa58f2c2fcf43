"""What a posttrain process does around a flow run: library defaults set before Prefect and torch load, the
temporary Prefect server started early, bad-input errors reported by their message, not a traceback, and
SIGINT/SIGTERM turned into one line saying how to resume. Used by `posttrain run` (flows/cli.py) and `posttrain
resume` (flows/resume.py)."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Callable

def embedded_defaults(artifacts_dir: str) -> None:
    """Point Prefect at a home under artifacts/ when no server or home is configured, and set
    library defaults that only take effect before the library loads. Each is a default: a variable
    already set in the environment wins.

    Must run before `prefect` and `torch` are imported: they read these settings at import time.
    """
    if not os.environ.get("PREFECT_API_URL"):
        os.environ.setdefault("PREFECT_HOME", str(Path(artifacts_dir).resolve() / "prefect"))
        home = Path(os.environ["PREFECT_HOME"])
        home.mkdir(parents=True, exist_ok=True)
        # Prefect 3.7.7 documents $PREFECT_HOME/memo_store.toml but reads ~/.prefect/memo_store.toml, so
        # every temporary server re-registered all block types (a burst of writes to the database that
        # concurrent runs share) and warned when ~/.prefect did not exist
        os.environ.setdefault("PREFECT_MEMO_STORE_PATH", str(home / "memo_store.toml"))
    # the temporary (or Prefect's own ephemeral) server: no telemetry ("Failed to send telemetry" offline)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect's server answers 503 when its SQLite database stays locked (past its 60 s busy timeout, or at
    # once when a read-then-write transaction loses to another writer); its client retries a 503 5 times by
    # default, 2, 4, ... 32 s apart, then raises (in the flow run's own state change: the run crashes).
    # Concurrent runs in one artifacts folder share that database: 7 retries, 2 ... 128 s apart (~4 min).
    os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", "7")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # How long torch's OpenMP threads (libgomp) spin between parallel regions before they sleep. Its default
    # (300,000 iterations) made torch 10-45x slower whenever another busy process shared the 2 cores (a second
    # run, a rollout worker process, CI); sleeping at once (OMP_WAIT_POLICY=PASSIVE) made the quickstart's
    # optimize stage 1.8x slower alone at 2 threads (slower than at 1 thread). 1,000 (microseconds of spinning)
    # keeps nearly all of the speed alone and costs 1.5x beside another busy process
    # (benchmarks/omp_wait.py, BENCHMARKS.md). A set OMP_WAIT_POLICY still wins over it.
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")


def start_temporary_prefect_server() -> Callable[[], None] | None:
    """With no PREFECT_API_URL, start now the temporary Prefect server Prefect itself would start when
    the flow begins (the command of prefect/server/api/server.py `SubprocessASGIServer`, prefect 3.7.7),
    so it boots in its own process while this one imports MLflow and the flow: about 10 s less per run.
    Returns a function that waits until the server answers (None when a server is configured). The server
    stops when this process exits (atexit; on Linux also when it is killed). The first servers of a new
    Prefect home start one at a time (`FirstStart`)."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    import atexit
    import importlib.util
    import socket
    import subprocess
    import time

    first_start = FirstStart(Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect"))
    with socket.socket() as sock:  # a free loopback port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    site_packages = Path(importlib.util.find_spec("prefect").origin).parent.parent

    def die_with_parent() -> None:  # Linux: SIGTERM the server when this process dies, even by SIGKILL
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    def launch() -> subprocess.Popen:
        # its own session: a Ctrl-C at the terminal (SIGINT to the foreground process group) reaches this process,
        # which marks its flow run crashed through the server, not the server too
        return subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(site_packages), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "error", "--lifespan", "on"],
            env={**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                 "PREFECT__SERVER_FINAL": "1"},
            preexec_fn=die_with_parent if sys.platform == "linux" else None, start_new_session=True,
        )

    server = launch()
    url = f"http://127.0.0.1:{port}/api"
    os.environ["PREFECT_API_URL"] = url

    def stop() -> None:
        server.terminate()
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()

    atexit.register(stop)

    def wait_until_ready(timeout_s: float = 120.0, attempts: int = 3) -> None:
        import httpx

        from stages.runtime.http import client

        nonlocal server
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if server.poll() is not None:
                # e.g. two runs started together on one new artifacts folder after FirstStart's wait ran out:
                # both servers migrate its Prefect database and the loser exits ("duplicate column name");
                # a second start finds it migrated
                attempts -= 1
                if attempts <= 0:
                    first_start.release()
                    raise RuntimeError(f"the temporary Prefect server exited with code {server.returncode}; "
                                       "set PREFECT_API_URL to a running server (`posttrain server`) instead")
                time.sleep(1.0)
                server = launch()
                continue
            try:
                if client().get(f"{url}/health", timeout=2).status_code == 200:
                    first_start.done()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        first_start.release()
        raise RuntimeError(f"the temporary Prefect server did not answer on {url} within {timeout_s:.0f} s")

    return wait_until_ready


class FirstStart:
    """Serializes the first temporary servers of a Prefect home, which create and migrate its database: two at
    once break each other's migration ("duplicate column name", alembic "expected to match one row") and the
    loser exits. Until a server of this home and Prefect version has answered once (marker file
    `.server-ready-<version>` in the home), a start waits for the flock on `.server-start.lock` there (at most
    `wait_s`, then it goes ahead: a server that exits is started again), keeps it until its server answers
    (`done`, which writes the marker) or fails (`release`). Later starts take no lock."""

    def __init__(self, home: Path, wait_s: float = 300.0):
        import fcntl
        import importlib.metadata
        import time

        self.marker = home / f".server-ready-{importlib.metadata.version('prefect')}"
        self.fd: int | None = None
        if self.marker.exists():
            return
        home.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(home / ".server-start.lock", os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:  # polled, so a holder that hangs delays this start by wait_s at most
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        if self.marker.exists():  # the holder's server migrated the database meanwhile
            self.release()

    def done(self) -> None:
        if self.fd is not None:
            self.marker.touch()
        self.release()

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: the run stops where it is, as at Ctrl-C (Prefect marks the flow run crashed,
    MLflow the parent run failed), and `posttrain resume` continues it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on_signals() -> Callable[[], None]:
    """From now on SIGINT and SIGTERM raise `Stopped` in the main thread; a second one ends the process at once
    (exit 128 + its number, no cleanup). Returns a function that puts the previous handlers back."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stopping = False

    def handler(signum, frame):
        nonlocal stopping
        if stopping:  # a second Ctrl-C while the first one unwinds: leave now
            os._exit(128 + signum)
        stopping = True
        raise Stopped(signum)

    for s in previous:
        signal.signal(s, handler)

    def restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h)

    return restore


def stopped_message(signum: int) -> str:
    """The line a signal-stopped run prints: how to continue it (`posttrain resume`, flows/resume.py)."""
    from flows.run import OPENED

    name = signal.Signals(signum).name
    if not OPENED:
        return f"stopped by {name} before the run opened; nothing to resume"
    run_name, root = OPENED[-1]
    try:
        artifacts = os.path.relpath(root) if not os.path.relpath(root).startswith("..") else str(root)
    except ValueError:  # another drive (Windows)
        artifacts = str(root)
    return f"stopped by {name}; resume with: posttrain resume {run_name} --artifacts {shlex.quote(artifacts)}"


def report_errors(run: Callable[[], int], debug: bool) -> int:
    """Call run() and return its exit code. A health check that stopped training prints its message
    (exit 3); a bad-input error (`input_errors`) prints its message without a traceback (exit 2), unless
    `debug`. Prefect still records the flow run as failed with the traceback. SIGINT (Ctrl-C) or SIGTERM stop
    the run with one line, "stopped by SIGINT; resume with: posttrain resume <run> --artifacts <dir>", and exit
    130 or 143 (128 + the signal's number, as a shell reports a process the signal ended); with `debug`, the
    traceback too."""
    from stages.evaluation.health import TrainingUnhealthy

    user_errors = input_errors()
    if not debug:
        hide_tracebacks_of(user_errors + (KeyboardInterrupt,))
    restore = stop_on_signals() if _main_thread() else None
    try:
        return run()
    except KeyboardInterrupt as e:  # Stopped, or a KeyboardInterrupt someone raised
        restore = None  # the handlers stay: a second signal while this process exits ends it at once
        if debug:
            raise
        signum = getattr(e, "signum", signal.SIGINT)
        print(stopped_message(signum), file=sys.stderr, flush=True)
        return 128 + signum
    except TrainingUnhealthy as e:  # a health check stopped the run: the message says what and where
        print(f"stopped: {e}", file=sys.stderr)
        return 3
    except user_errors as e:
        if debug:
            raise
        print(f"error: {e}\n(the run is recorded as failed; `--debug` shows the traceback)", file=sys.stderr)
        return 2
    except Exception as e:  # a full disk that reached us as another library's error (Prefect's server: HTTP 500)
        full = full_disk_message(e)
        if full is None or debug:
            raise
        print(f"error: {full}", file=sys.stderr)
        return 2
    finally:
        if restore:
            restore()


FULL_DISK_BYTES = 1 << 20
"""Free bytes under which the artifacts folder's disk counts as full."""


def full_disk_message(error: BaseException) -> str | None:
    """One line for an error the full (or read-only) disk of the artifacts folder caused but a library reported
    in its own words: the error names a refused write (tasks/store.py `refused_write`), or the artifacts folder's
    disk has under FULL_DISK_BYTES free (Prefect's temporary server keeps its database there, and answers a write
    it cannot make with HTTP 500). None for any other error."""
    from flows.run import OPENED
    from tasks.store import refused_write

    root = OPENED[-1][1] if OPENED else None
    refused = refused_write(error, root)
    if refused is None and root is not None:
        try:
            stats = os.statvfs(root)
        except OSError:
            return None
        if stats.f_bavail * stats.f_frsize >= FULL_DISK_BYTES:
            return None
    elif refused is None:
        return None
    reason = refused.strerror if refused is not None else "No space left on device"
    if root is None:
        return (f"the disk refused a write ({reason}; {type(error).__name__} from a library writing there): free "
                "space or make it writable, then run the same command again (finished stages are reused)")
    return (f"the disk holding {root} refused a write ({reason}; {type(error).__name__} from a library writing "
            f"there): free space or make it writable, then `posttrain resume {OPENED[-1][0]} --artifacts {root}` "
            "(finished stages are reused)")


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def input_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input (a data row or file, a model or dataset source, a reward function, a missing
    file or folder, a vLLM server that does not answer, a disk that refuses writes, an MLflow store other
    processes kept locked past the retries), each raised with a message that names what and where: the CLI prints
    that message, not a traceback."""
    from flows.config import ConfigError
    from flows.retrain import RetrainError
    from stages.data.model_source import ModelSourceError
    from stages.data.sources import SourceError
    from stages.data.sources import BadRowError
    from stages.rollout.engines.vllm_server import VLLMServerError
    from stages.scoring.reward_workers import RewardFunctionError
    from tasks.lineage import StoreBusyError
    from tasks.store import StorageError

    return (ConfigError, RetrainError, RewardFunctionError, BadRowError, FileNotFoundError, VLLMServerError,
            StorageError, StoreBusyError, ModelSourceError, SourceError)


def hide_tracebacks_of(errors: tuple[type[BaseException], ...]) -> None:
    """Keep Prefect's console handler from printing the traceback of these errors (the flow and task run
    loggers still send it, with the failed state, to the Prefect server), and, with KeyboardInterrupt among them,
    its "Crash detected! Execution was aborted by an interrupt (a termination) signal" lines."""
    import logging

    class InputErrorTraceback(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not (record.name.startswith("prefect") and record.exc_info
                        and (isinstance(record.exc_info[1], errors) or full_disk_message(record.exc_info[1])))

    class InterruptNotice(logging.Filter):  # a signal-stopped run says so in one line (report_errors)
        def filter(self, record: logging.LogRecord) -> bool:
            return not (record.name.startswith("prefect") and KeyboardInterrupt in errors
                        and "Execution was aborted by" in record.getMessage())  # an interrupt, a termination

    for handler in logging.getLogger().handlers:
        handler.addFilter(InputErrorTraceback())
        handler.addFilter(InterruptNotice())
