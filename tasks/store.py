"""The artifact store: the one place that maps a stage and its inputs to a folder.

`artifacts/<stage>/<key>/`, key = content hash of (stage name, stage code version,
canonical JSON of the stage's config section, input artifact keys). The code version hashes the
stage module and the project modules it imports (`code_version`); the section is the key of the stage's call
(tasks/calls.py), which holds digests of the user code and of the files it reads by path (`path_digest`). A
folder is written in a temp folder beside it, `_manifest.json` last, then renamed into place; a folder
without a valid manifest does not exist and is recomputed.

Two runs sharing an artifacts folder compute each key once: `write` holds an exclusive lock
per (stage, key) — `artifacts/.locks/<stage>/<key>.lock`, flock(2) across processes plus a
threading.Lock across the threads of one process — and, once it has the lock, returns the
artifact another run finished meanwhile instead of computing it again. A process that dies
holding the lock releases it (the kernel drops flock locks with the process); its temp folder
is never read and is deleted by the next writer of that key.

Reuse checks each listed file's size and sha256 before serving it. A file is hashed when its stat stamp
(device, inode, size, mtime, ctime) differs from the one recorded the last time its bytes were hashed and
matched, at its write or at a reuse (`artifacts/.verified/<stage>/<key>.json`), so a cached rerun reads no
file it read before. Every change made through the filesystem (a write, a truncate, `os.utime` putting the
mtime back, a copy) gives the file a new ctime, which no user call can set back; what this misses is a
change beneath the filesystem (a failing disk's bit rot), which `posttrain verify` finds: it hashes every
file. A folder that fails a check is damaged: a rerun sets it aside under `<stage>/.damaged/` (as
`posttrain verify --repair` does) and recomputes it (and only it: its key is unchanged, so the stages after
it are reused). A write the disk refuses (full, read-only, no permission) raises StorageError naming the
path, after removing its temp folder, whichever library reported it (`refused_write`).
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
VERIFIED = ".verified"  # under the artifacts root: <stage>/<key>.json, {file: [sha256, *stat stamp]} of files
# whose bytes matched the manifest (the stamp: what the file was when they were hashed)
WORK = ".work"  # under the artifacts root: <stage>/<key>/, a stage's resumable checkpoints
# until its folder is published

log = logging.getLogger(__name__)

STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
"""OSError numbers that mean the disk refused a write (full, over quota, read-only, not allowed, too big)."""
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
"""Those a library's own error reports in its message (os.strerror's words)."""
DISK_MESSAGES = {"database or disk is full": errno.ENOSPC, "attempt to write a readonly database": errno.EROFS,
                 **{os.strerror(n): n for n in DISK_ERRNOS}}
"""Message text -> the errno it means: sqlite's SQLITE_FULL and SQLITE_READONLY (through sqlite3, SQLAlchemy,
MLflow), and the OS's own words, which safetensors (Rust: "No space left on device (os error 28)"), torch and
subprocess errors carry."""


def refused_write(error: BaseException, root: Path | None = None) -> OSError | None:
    """The OSError saying the disk refused a write, if `error` or an error it was raised from is one: an OSError
    with a storage errno (EACCES and EPERM only on a file under `root`: a stage failing to read its own input
    with "Permission denied" is not a storage error), or a library's error whose message says the disk is full
    or read-only (DISK_MESSAGES). None otherwise."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
            if error.errno not in (errno.EACCES, errno.EPERM):
                return error
            if error.filename is not None and root is not None and Path(error.filename).resolve().is_relative_to(root):
                return error
        elif isinstance(error, Exception):
            for words, number in DISK_MESSAGES.items():
                if words in str(error):
                    return OSError(number, os.strerror(number))
        error = error.__cause__ or error.__context__
    return None


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
        has another size or sha256 than the manifest says."""
        return self.lookup(stage, key)[0]

    def lookup(self, stage: str, key: str) -> tuple[Artifact | None, list[str]]:
        """`get`, and what is wrong with an existing folder of this key (empty when it is fine or absent): one
        read of the manifest for both. A file is hashed only if it changed since its bytes last matched
        (module docstring); those that match now are recorded."""
        folder = self.path(stage, key)
        verified = self.root / VERIFIED / stage / f"{key}.json"
        try:
            known = json.loads(verified.read_text())
        except (OSError, ValueError):
            known = {}
        if not isinstance(known, dict):
            known = {}
        before = dict(known)
        manifest, problems = check_folder(folder, full=True, known=known)
        if not problems:
            if known != before:
                _write_quietly(verified, json.dumps(known))
            return Artifact(stage, key, folder, manifest), []
        return None, problems if folder.exists() else []

    def key_folders(self) -> Iterator[tuple[str, str, Path]]:
        """(stage, key, folder) of every key folder of a stage, with a manifest or without, sorted. The stages:
        those the store has locked a key of (`.locks/<stage>/<key>.lock`; a stage name may hold a slash, as
        the data versions' `data/<name>` do) and those with a manifest two levels down."""
        locks = self.root / LOCKS
        stages = {stage for stage, _, _ in self.artifact_folders()}
        stages |= {lock.parent.relative_to(locks).as_posix() for lock in locks.rglob("*.lock")}
        for stage in sorted(stages):
            if (self.root / stage).is_dir() and not any(part.startswith(".") for part in stage.split("/")):
                for folder in sorted((self.root / stage).iterdir()):
                    if folder.is_dir() and not folder.name.startswith("."):
                        yield stage, folder.name, folder

    def artifact_folders(self) -> Iterator[tuple[str, str, Path]]:
        """(stage, key, folder) of every key folder with a manifest file, sorted."""
        for manifest in sorted(self.root.glob(f"*/*/{MANIFEST}")):
            folder = manifest.parent
            if not folder.name.startswith(".") and not folder.parent.name.startswith("."):
                yield folder.parent.name, folder.name, folder

    def write(self, stage: str, key: str, produce: Callable[[Path], dict], *, inputs: dict[str, str],
              config: Any, cost: Callable[[Path, dict], dict] | None = None) -> Artifact:
        """Run produce(tmp_dir) -> summary dict, then publish the folder with its manifest; `cost(tmp_dir,
        summary)`, called once produce has returned, gives the manifest's `cost` record (tasks/costs.py).

        Holds the (stage, key) lock throughout. If a valid folder exists once the lock is held
        (another run computed it while this one waited), returns it with `reused=True` and does
        not call produce."""
        final = self.path(stage, key)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with key_lock(self.root / LOCKS / stage / f"{key}.lock", f"{stage}/{key}"):
                found, damage = self.lookup(stage, key)
                if found is not None:
                    return replace(found, reused=True)
                for stale in final.parent.glob(f".tmp-{key}-*"):  # left by a writer killed holding this lock
                    shutil.rmtree(stale, ignore_errors=True)
                if final.exists():  # damaged (or its manifest lost): kept for inspection, never read
                    aside = set_aside(final)
                    log.warning("%s/%s is damaged (%s); moved to %s, recomputing it", stage, key,
                                "; ".join(damage), aside)
                return self._write_locked(stage, key, final, produce, inputs, config, cost)
        except OSError as e:
            refused = refused_write(e, self.root)
            if refused is not None:
                raise StorageError(f"stage {stage} ({key})", final, refused) from e
            raise

    def _write_locked(self, stage: str, key: str, final: Path, produce: Callable[[Path], dict],
                      inputs: dict[str, str], config: Any, cost: Callable[[Path, dict], dict] | None = None
                      ) -> Artifact:
        tmp = final.parent / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        started = time.time()
        try:
            summary = produce(tmp) or {}
            files, stamps = self._describe_files(tmp)
            manifest = {
                "stage": stage,
                "key": key,
                "inputs": inputs,
                "config": config,
                "summary": summary,
                "files": files,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "wall_time_s": round(time.time() - started, 3),
                **({"cost": cost(tmp, summary)} if cost else {}),  # what computing it took (not in its key)
                "producers": {p: _version(p) for p in PRODUCERS},
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
            os.replace(tmp, final)
        except BaseException as e:
            # A write the disk refused, however the library reports it (its own error naming the OS's words, or
            # an error of its own with no words, e.g. torch's "file write failed": then judged by the space left).
            refused = refused_write(e, self.root)
            if refused is None and isinstance(e, Exception) and not isinstance(e, OSError) and (
                    _bytes_free(tmp) < 1 << 20):
                refused = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            shutil.rmtree(tmp, ignore_errors=True)
            if refused is not None:
                raise StorageError(f"stage {stage} ({key})", final, refused) from e
            raise
        _write_quietly(self.root / VERIFIED / stage / f"{key}.json", json.dumps(stamps))  # renaming the folder
        # changes no file's stamp
        shutil.rmtree(self.work_path(stage, key), ignore_errors=True)
        return Artifact(stage, key, final, manifest)

    @staticmethod
    def _describe_files(folder: Path) -> tuple[dict, dict]:
        """The manifest's files ({name: size, sha256, and a table's rows and schema}), and {name: [sha256, *stat
        stamp]} for `lookup` (the stamp taken before the bytes are read: a change while they are makes another)."""
        files, stamps = {}, {}
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            stat = f.stat()
            meta = {"size": stat.st_size, "sha256": sha256_file(f)}
            if f.suffix == ".parquet":
                import pyarrow.parquet as pq

                meta["rows"] = pq.ParquetFile(f).metadata.num_rows
                meta["schema"] = f.stem
            name = str(f.relative_to(folder))
            files[name] = meta
            stamps[name] = [meta["sha256"], *_stamp(stat)]
        return files, stamps


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


def check_folder(folder: Path, full: bool = False, known: dict | None = None) -> tuple[dict | None, list[str]]:
    """(its manifest, what is wrong with the folder): the manifest missing or unreadable, a listed file
    missing or of another size, and with `full` of other content (sha256). No problems: usable.

    `known` ({name: [sha256, *stat stamp]}, `lookup`'s record): with `full`, a file whose stamp and manifest
    sha256 are recorded there is not read again; each file hashed and found right is added to it."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, [f"{MANIFEST} is missing or unreadable ({type(e).__name__})"]
    problems = []
    for name, meta in files.items():
        f = folder / name
        try:
            stat = f.stat()
        except OSError:
            stat = None
        if stat is None or not f.is_file():
            problems.append(f"{name} is missing")
        elif stat.st_size != meta["size"]:
            problems.append(f"{name} has {stat.st_size} bytes, the manifest says {meta['size']}")
        elif full:
            stamp = [meta["sha256"], *_stamp(stat)]
            if known is not None and known.get(name) == stamp:
                continue
            if sha256_file(f) != meta["sha256"]:
                problems.append(f"{name} has other content than the manifest's sha256")
            elif known is not None:
                known[name] = stamp
    return manifest, problems


def _stamp(stat: os.stat_result) -> list[int]:
    """What changes whenever a file's bytes change through the filesystem: ctime included, which a write, a
    truncate or `os.utime` (putting an mtime back) sets to now and nothing a user runs can set back."""
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _write_quietly(path: Path, text: str) -> None:
    """Write `path` whole (temp file + rename), or not at all where the disk refuses: a record that only saves
    work later (`lookup`'s) must not fail what it records."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def set_aside(folder: Path) -> Path:
    """Move a damaged key folder to <stage>/.damaged/<key>-<time>/ in one rename (kept for inspection, never
    read); return where it went."""
    target = folder.parent / DAMAGED / f"{folder.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    target.parent.mkdir(exist_ok=True)
    while target.exists():  # set aside twice in one second
        target = target.with_name(f"{target.name}-{uuid.uuid4().hex[:4]}")
    os.replace(folder, target)
    return target


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
