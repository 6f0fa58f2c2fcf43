"""The artifact store: the one place that maps a stage and its inputs to a folder.

`artifacts/<stage>/<key>/`, key = content hash of (stage name, stage code version,
canonical JSON of the stage's config section, input artifact keys). The code version hashes the
stage module and the project modules it imports (`code_version`); the tasks add digests of the
user code and of the files a section names by path to the section (`path_digest`). A folder is written
in a temp folder beside it, `_manifest.json` last, then renamed into place; a folder
without a valid manifest does not exist and is recomputed.

Two runs sharing an artifacts folder compute each key once: `write` holds an exclusive lock
per (stage, key) — `artifacts/.locks/<stage>/<key>.lock`, flock(2) across processes plus a
threading.Lock across the threads of one process — and, once it has the lock, returns the
artifact another run finished meanwhile instead of computing it again. A process that dies
holding the lock releases it (the kernel drops flock locks with the process); its temp folder
is never read and is deleted by the next writer of that key.

Reuse checks each listed file's size (cheap, every time); `posttrain verify` checks every sha256.
A folder that fails either is damaged: reruns recompute it (and only it: its key is unchanged, so
the stages after it are reused). A write the disk refuses (full, read-only, no permission) raises
StorageError naming the path, after removing its temp folder.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import shutil
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from stages.runtime.imports import source_digest

MANIFEST = "_manifest.json"
PRODUCERS = ("torch", "transformers", "trl", "peft", "pyarrow")
LOCKS = ".locks"  # under the artifacts root: <stage>/<key>.lock per key ever written (stage folders hold only keys)
DAMAGED = ".damaged"  # under a stage folder: `posttrain verify --repair` moves damaged key folders here
WORK = ".work"  # under the artifacts root: <stage>/<key>/, a stage's resumable checkpoints
# until its folder is published

log = logging.getLogger(__name__)

STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
"""OSError numbers that mean the disk refused a write (full, over quota, read-only, not allowed, too big)."""


class StorageError(RuntimeError):
    """The disk refused a write under the artifacts folder; the message names the path and what to do."""

    RERUN = ("Nothing of it was kept and finished stages are untouched: free space or make the folder writable, "
             "then run the same command again (finished stages are reused).")

    def __init__(self, what: str, path: Path | str, error: OSError, advice: str = RERUN):
        super().__init__(f"{what}: cannot write {error.filename or path}: {error.strerror or error}. {advice}")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_first_versions: dict[str, str] = {}  # module name -> its code version when this process first used it


def code_version(*modules) -> str:
    """Hash of the modules' source and of every project module they import, transitively
    (stages/runtime/imports.py `source_digest`): editing a stage's code, or code it calls, changes its keys.

    The code that runs is the code this process imported. Should a module's files change on disk after
    their first use here, the process would store the old code's results under the new code's key, so
    it stops with an error instead: restart it (a new `posttrain run`) to run the new code."""
    digest = hashlib.sha256()
    for module in modules:
        version = source_digest(module.__name__) or inspect.getsource(module)
        if _first_versions.setdefault(module.__name__, version) != version:
            raise RuntimeError(f"{module.__file__} (or a project module it imports) changed on disk after this "
                               "process loaded it; its results would be stored under the new code's key. Run "
                               "the command again in a new process to use the new code.")
        digest.update(version.encode())
    return digest.hexdigest()[:12]


_file_digests: dict[tuple, str] = {}


def path_digest(path: str | Path) -> str | None:
    """sha256 of a file, or of a folder's files (sorted relative paths and their bytes); None if
    nothing is there. Each file is hashed once per process while its mtime and size stay the same."""
    path = Path(path).expanduser()
    if path.is_file():
        files = [(path.name, path)]
    elif path.is_dir():
        files = sorted((f.relative_to(path).as_posix(), f) for f in path.rglob("*") if f.is_file())
    else:
        return None
    digest = hashlib.sha256()
    for name, f in files:
        st = f.stat()
        stamp = (str(f.resolve()), st.st_mtime_ns, st.st_size)
        if stamp not in _file_digests:
            _file_digests[stamp] = sha256_file(f)
        digest.update(f"{name}\0{_file_digests[stamp]}\0".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class Artifact:
    """A finished stage output: its folder and manifest."""

    stage: str
    key: str
    path: Path
    manifest: dict
    reused: bool = field(default=False, compare=False)
    """True when it was not computed by the call that returned it: a cache hit (materialize), or
    another run (process or thread) held the key's lock, finished the folder, and `write` returned
    that folder once the lock was free."""

    def file(self, name: str) -> Path:
        return self.path / name


class ArtifactStore:
    """Resolves, reads and atomically writes stage folders under `root`."""

    def __init__(self, root: Path | str):
        self.root = Path(root).resolve()

    def key(self, stage: str, version: str, config: Any, input_keys: list[str]) -> str:
        payload = canonical_json({"stage": stage, "version": version, "config": config, "inputs": list(input_keys)})
        return hashlib.sha256(payload.encode()).hexdigest()[:20]

    def path(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def work_path(self, stage: str, key: str) -> Path:
        """Where a stage computing `key` keeps what a rerun of the same key resumes from (trainer
        checkpoints, stages/runtime/checkpoints.py). Used only under the key's lock; deleted once the key's
        folder is published."""
        return self.root / WORK / stage / key

    def get(self, stage: str, key: str) -> Artifact | None:
        """The finished artifact, or None if its folder or manifest is missing or a listed file is missing or
        has another size than the manifest says."""
        return self.lookup(stage, key)[0]

    def lookup(self, stage: str, key: str) -> tuple[Artifact | None, list[str]]:
        """`get`, and what is wrong with an existing folder of this key (sizes only; empty when it is fine or
        absent): one read of the manifest for both."""
        folder = self.path(stage, key)
        manifest, problems = check_folder(folder)
        if not problems:
            return Artifact(stage, key, folder, manifest), []
        return None, problems if folder.exists() else []

    def artifact_folders(self) -> Iterator[tuple[str, str, Path]]:
        """(stage, key, folder) of every key folder with a manifest file, sorted."""
        for manifest in sorted(self.root.glob(f"*/*/{MANIFEST}")):
            folder = manifest.parent
            if not folder.name.startswith(".") and not folder.parent.name.startswith("."):
                yield folder.parent.name, folder.name, folder

    def write(self, stage: str, key: str, produce: Callable[[Path], dict], *, inputs: dict[str, str],
              config: Any) -> Artifact:
        """Run produce(tmp_dir) -> summary dict, then publish the folder with its manifest.

        Holds the (stage, key) lock throughout. If a valid folder exists once the lock is held
        (another run computed it while this one waited), returns it with `reused=True` and does
        not call produce."""
        final = self.path(stage, key)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with key_lock(self.root / LOCKS / stage / f"{key}.lock", f"{stage}/{key}"):
                found = self.get(stage, key)
                if found is not None:
                    return replace(found, reused=True)
                for stale in final.parent.glob(f".tmp-{key}-*"):  # left by a writer killed holding this lock
                    shutil.rmtree(stale, ignore_errors=True)
                return self._write_locked(stage, key, final, produce, inputs, config)
        except OSError as e:
            if self._refused_write(e):
                raise StorageError(f"stage {stage} ({key})", final, e) from e
            raise

    def _refused_write(self, error: OSError) -> bool:
        """Whether `error` is the disk refusing a write here (a stage failing to read its own input with
        "Permission denied" is not: that error names a file outside the artifacts folder)."""
        if error.errno not in STORAGE_ERRNOS:
            return False
        if error.filename is None:
            return error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
        return Path(error.filename).resolve().is_relative_to(self.root)

    def _write_locked(self, stage: str, key: str, final: Path, produce: Callable[[Path], dict],
                      inputs: dict[str, str], config: Any) -> Artifact:
        tmp = final.parent / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        started = time.time()
        try:
            summary = produce(tmp) or {}
            manifest = {
                "stage": stage,
                "key": key,
                "inputs": inputs,
                "config": config,
                "summary": summary,
                "files": self._describe_files(tmp),
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "wall_time_s": round(time.time() - started, 3),
                "producers": {p: _version(p) for p in PRODUCERS},
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
            if final.exists():  # an unfinished folder from a killed run: moved aside in one step, then deleted
                trash = final.parent / f".tmp-{key}-{os.getpid()}-old-{uuid.uuid4().hex[:8]}"
                os.replace(final, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(tmp, final)
        except BaseException as e:
            # Libraries report a full disk in their own ways (torch, safetensors): judge by the space left.
            full = not isinstance(e, OSError) and isinstance(e, Exception) and _bytes_free(tmp) < 1 << 20
            shutil.rmtree(tmp, ignore_errors=True)
            if full:
                raise StorageError(f"stage {stage} ({key})", tmp,
                                   OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))) from e
            raise
        shutil.rmtree(self.work_path(stage, key), ignore_errors=True)
        return Artifact(stage, key, final, manifest)

    @staticmethod
    def _describe_files(folder: Path) -> dict:
        files = {}
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            meta = {"size": f.stat().st_size, "sha256": sha256_file(f)}
            if f.suffix == ".parquet":
                import pyarrow.parquet as pq

                meta["rows"] = pq.ParquetFile(f).metadata.num_rows
                meta["schema"] = f.stem
            files[str(f.relative_to(folder))] = meta
        return files


_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()
_held = threading.local()  # .paths: the lock paths this thread holds (a nested key_lock is a no-op)
_held_fds: set[int] = set()  # lock files this process holds, closed in forked children


@contextmanager
def key_lock(path: Path, what: str = "") -> Iterator[None]:
    """Exclusive lock on `path` for the block: a threading.Lock per path serializes this process's
    threads, flock(2) serializes processes; re-entering it in the thread that holds it is a no-op.
    The kernel releases the flock when the holder exits or is killed; forked children close their
    copy so they never keep it held (spawned and exec'd children do not inherit it at all)."""
    held = _held.__dict__.setdefault("paths", set())
    if str(path) in held:
        yield
        return
    with _thread_locks_guard:
        thread_lock = _thread_locks.setdefault(str(path), threading.Lock())
    with thread_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        _held_fds.add(fd)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("%s: another run holds it; waiting (lock %s)", what or path, path)
                fcntl.flock(fd, fcntl.LOCK_EX)
            held.add(str(path))
            try:
                yield
            finally:
                held.discard(str(path))
        finally:
            _held_fds.discard(fd)
            os.close(fd)  # releases the flock


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's locks: close its copies of the lock files and
    start with fresh thread locks (one may have been held by a parent thread at the fork)."""
    global _thread_locks, _thread_locks_guard, _held
    for fd in list(_held_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    _held_fds.clear()
    _thread_locks, _thread_locks_guard, _held = {}, threading.Lock(), threading.local()


os.register_at_fork(after_in_child=_after_fork_in_child)


def check_folder(folder: Path, full: bool = False) -> tuple[dict | None, list[str]]:
    """(its manifest, what is wrong with the folder): the manifest missing or unreadable, a listed file
    missing or of another size, and with `full` of other content (sha256). No problems: usable."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, [f"{MANIFEST} is missing or unreadable ({type(e).__name__})"]
    problems = []
    for name, meta in files.items():
        f = folder / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != meta["size"]:
            problems.append(f"{name} has {f.stat().st_size} bytes, the manifest says {meta['size']}")
        elif full and sha256_file(f) != meta["sha256"]:
            problems.append(f"{name} has other content than the manifest's sha256")
    return manifest, problems


def _bytes_free(path: Path) -> int:
    try:
        stats = os.statvfs(path)
    except OSError:
        return 1 << 62
    return stats.f_bavail * stats.f_frsize


def check_writable(folder: Path) -> None:
    """Raise StorageError if a file cannot be created in `folder` (read-only, no permission, full)."""
    probe = Path(folder) / f".write-check-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        if e.errno in STORAGE_ERRNOS:
            raise StorageError("artifacts_dir", folder, e, "Point artifacts_dir at a writable folder, or make this "
                               "one writable (it needs free space too).") from e
        raise


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
