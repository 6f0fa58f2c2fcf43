"""Code-execution reward for coding tasks: run the completion's Python against the row's `test_cases`.

The reward is the fraction of test cases that pass (`assert add(1, 2) == 3` runs without raising).
All tests of one completion run in one fresh interpreter; completions run in parallel on a few
threads. Config name: `code_execution`; the prompts table needs a `test_cases` column.

What the sandbox is (layers, outermost first):

- a child process `python -I -S -B` (isolated mode: no PYTHON* variables, no user site, no script
  folder on sys.path; no site-packages at all, so only the standard library imports), with an
  empty environment, started in a new session so the whole process group is killed at the end;
- where `unshare` works without privileges here (user namespaces enabled), new user, network and
  PID namespaces: no network interface but a down loopback, no capabilities over the host, and no
  view of (or signals to) the host's processes; the probe falls back to fewer namespaces, then none;
- resource limits set before exec: CPU seconds (SIGKILL when reached), address space, file size,
  open files, no core dumps; a wall-clock timeout kills the process group; RLIMIT_NPROC is set to 0
  by the prelude once the interpreter runs (not in preexec_fn: `unshare --fork` still needs one
  fork, and the per-user count is racy with parallel samples);
- a prelude with a `sys.addaudithook` hook (PEP 578): it refuses opening, listing or changing paths
  outside a throwaway working folder (the standard library and a few /dev files stay readable),
  sockets, fork/exec/spawn/subprocess/os.system, kill, ctypes, setrlimit, tracing, gc
  introspection, sub-interpreters, and loading native extensions from outside the standard
  library; it also removes the few functions that act without an audit event (os.mknod,
  os.pidfd_open, os.setns, os.chroot, _posixsubprocess.fork_exec, _imp.create_builtin of posix).
  The working folder, the job file and the output file are deleted afterwards.

What it is not: a security boundary against code written to escape. Audit hooks are documented as
not being a sandbox (PEP 578): interpreter bugs, memory-corruption tricks, or frame introspection
can defeat them. The child runs as the trainer's user (root stays root-owner inside the user
namespace), so file access outside the working folder rests on the hook alone; as root, RLIMIT_NPROC
is not enforced by the kernel, so forks rest on the hook too (the PID namespace still reaps them);
`stat`, `readlink` and `access` of host paths are not audited and leak existence and metadata. The results
are tagged with a per-run random nonce so printing fake results does not score, but code that walks
the interpreter's frames can read it, and a solution returning an object whose `__eq__` is always
True passes `==` asserts. For untrusted policies at scale, run the reward workers inside a container
or VM (gVisor, nsjail, bubblewrap) as an unprivileged user; this module is the inner layer.

Run: `posttrain` with `score.reward_funcs: [code_execution]`; limits: `SandboxLimits` (wrap the
function in your own module to change them, e.g. `def strict(**kw): return code_execution(**kw,
limits=SandboxLimits(cpu_s=5))` and name it `my_module.strict`). A batch of n completions that all
hang takes about ceil(n / workers) * wall_s seconds: keep `score.reward_timeout_s` above that.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

from stages.scoring.rewards.common import completion_text


@dataclass(frozen=True)
class SandboxLimits:
    """Per-completion limits: one interpreter runs the code and all its tests."""

    cpu_s: int = 2
    """CPU seconds (RLIMIT_CPU, SIGKILL when reached). Higher: slow-but-correct solutions pass; a
    looping completion costs that much CPU."""
    wall_s: float = 6.0
    """Wall-clock seconds before the process group is killed (catches sleeps and blocked reads)."""
    memory_mb: int = 512
    """Address-space limit in MiB (RLIMIT_AS); the interpreter itself needs about 30."""
    file_size_mb: int = 8
    """Largest file the code may write, in MiB (RLIMIT_FSIZE); also caps the results output."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_file_writes: int = 64
    """Files the code may open for writing in its working folder (bounds disk use with file_size_mb)."""
    workers: int = 4
    """Completions run in parallel (threads, each waiting on one child process)."""


DEFAULT_LIMITS = SandboxLimits()

_FENCE = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}


def extract_code(text: str, strip: bool = True) -> str:
    """The last ```python block of `text` (else the last untagged ``` block, else all of it), stripped (strip:
    False: its trailing whitespace only, so that a block of indented lines keeps its first line's indent).

    >>> extract_code("Here:\\n```python\\nx = 1\\n```\\nDone.")
    'x = 1'
    """
    python_blocks, plain_blocks = [], []
    for match in _FENCE.finditer(text):
        tag = match.group(1).strip().lower()
        if tag in _PYTHON_TAGS:
            python_blocks.append(match.group(2))
        elif not tag:
            plain_blocks.append(match.group(2))
    blocks = python_blocks or plain_blocks
    code = blocks[-1] if blocks else text
    return code.strip() if strip else code.rstrip()


def _tests_of(value, row: int) -> list[str]:
    """A row's test cases: a list of strings, or a JSON string of one (a plain string is one test)."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return [value]
        if isinstance(value, str):
            return [value]
    try:
        return [str(test) for test in value]
    except TypeError:
        raise ValueError(f"code_execution: test_cases of row {row} is a {type(value).__name__}; expected a "
                         "list of test strings such as \"assert add(1, 2) == 3\" or a JSON string of one") from None


# Runs in the child: read the job, lock the interpreter down, run the code, then each test.
# Everything the hook and the result loop use is bound before the solution runs, so patching
# builtins or os from the solution does not change them.
_PRELUDE = r'''
def _sandbox(job_path):
    import builtins, json, posix, posixpath, resource, signal, sys, types, _imp, _posixsubprocess

    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    posix.unlink(job_path)
    nonce, code, tests = job["nonce"], job["code"], job["tests"]

    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # root is exempt (kernel); the hook still blocks forks
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-big write raises instead of killing

    def refuse(*args, **kwargs):
        raise PermissionError("sandbox: not allowed")

    _posixsubprocess.fork_exec = refuse  # forks without an audit event
    create_builtin = _imp.create_builtin  # re-creates posix (with what is removed below) without an audit event

    def create_builtin_checked(spec, _create=create_builtin, _error=PermissionError):
        if spec.name in ("posix", "_posixsubprocess"):
            raise _error("sandbox: not allowed")
        return _create(spec)

    _imp.create_builtin = create_builtin_checked
    for name in ("mknod", "pidfd_open", "setns", "chroot", "unshare"):  # no audit event either
        for module in (posix, sys.modules["os"]):
            if hasattr(module, name):
                delattr(module, name)

    def norm(path, _type=type, _str=str, _bytes=bytes, _getcwd=posix.getcwd, _error=PermissionError):
        if _type(path) is _bytes:
            path = path.decode("utf-8", "surrogateescape")
        elif _type(path) is not _str:
            raise _error("sandbox: path must be str or bytes")
        if not path.startswith("/"):
            path = _getcwd() + "/" + path
        parts = []
        for part in path.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts) + "/"  # trailing slash: prefix tests match whole components

    work = tuple({norm(job["work"]), norm(posixpath.realpath(job["work"]))})
    read_roots = set()
    for entry in sys.path:
        if entry:
            read_roots.update({norm(entry), norm(posixpath.realpath(entry))})
    read_roots.discard("/")
    read_roots = tuple(read_roots)
    read_files = frozenset({"/dev/null/", "/dev/urandom/", "/dev/random/", "/dev/zero/"})
    write_flags = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND
    denied_imports = frozenset({
        "posix", "_posixsubprocess", "ctypes", "_ctypes", "_ctypes_test", "_xxsubinterpreters",
        "_xxinterpchannels", "_testcapi", "_testinternalcapi", "_testmultiphase", "_testbuffer",
        "_testimportmultiple", "_testclinic", "_gdbm", "_dbm", "readline", "_ssl", "_multiprocessing",
        "_posixshmem", "_tkinter",
    })
    denied = frozenset({
        "os.system", "os.kill", "os.killpg", "signal.pthread_kill", "os.fork", "os.forkpty", "os.exec",
        "os.spawn", "os.posix_spawn", "pty.spawn", "subprocess.Popen", "resource.setrlimit",
        "resource.prlimit", "setopencodehook", "sys.settrace", "sys.setprofile", "os.symlink", "os.link",
        "fcntl.ioctl", "code.__new__", "cpython.PyInterpreterState_New", "sys._current_frames",
        "sqlite3.enable_load_extension", "sqlite3.load_extension", "webbrowser.open", "os.startfile",
    })
    denied_prefixes = ("socket.", "ctypes.", "gc.", "ftplib.", "smtplib.", "poplib.", "imaplib.", "nntplib.",
                       "telnetlib.", "http.client.", "urllib.", "syslog.", "winreg.", "_winapi.", "msvcrt.")
    kinds = types.MappingProxyType({  # 1 open, 2 list/read a path, 3 chdir, 4/5 change 1/2 paths, 6 sqlite, 7 import
        "open": 1, "os.listdir": 2, "os.scandir": 2, "os.getxattr": 2, "os.listxattr": 2, "os.chdir": 3,
        "os.chmod": 4, "os.chown": 4, "os.chflags": 4, "os.mkdir": 4, "os.remove": 4, "os.rmdir": 4,
        "os.truncate": 4, "os.utime": 4, "os.setxattr": 4, "os.removexattr": 4, "shutil.chown": 4,
        "os.rename": 5, "sqlite3.connect": 6, "import": 7})

    def hook(event, args, _kinds=kinds, _denied=denied, _prefixes=denied_prefixes, _norm=norm, _work=work,
             _roots=read_roots, _files=read_files, _write_flags=write_flags, _imports=denied_imports,
             _writes=[job["max_file_writes"]], _type=type, _int=int, _str=str, _error=PermissionError):
        kind = _kinds.get(event)
        if kind is None:
            if event in _denied or event.startswith(_prefixes):
                raise _error("sandbox: " + event + " is not allowed")
            return
        if kind == 1:  # open(path, mode, flags); mode is None for os.open
            path, mode, flags = args
            if _type(path) is _int:
                return  # an already-open descriptor
            path = _norm(path)
            writing = flags & _write_flags
            if path.startswith(_work):
                if writing:
                    _writes[0] -= 1
                    if _writes[0] < 0:
                        raise _error("sandbox: too many files opened for writing")
                return
            if mode is not None and ((not writing and (path in _files or path.startswith(_roots)))
                                     or path == "/dev/null/"):
                return
            raise _error("sandbox: no access to " + path[:-1])
        if kind == 7:  # import(name, filename or None, ...)
            name = args[0]
            if _type(name) is _str and (name.partition(".")[0] in _imports or name.rpartition(".")[2] in _imports):
                raise _error("sandbox: import of " + name + " is not allowed")
            if args[1] is not None and not _norm(args[1]).startswith(_roots):
                raise _error("sandbox: native extensions load only from the standard library")
            return
        if kind == 6:  # sqlite3.connect(database)
            database = args[0]
            if database == ":memory:" or database == "":
                return
            if _type(database) is _str and database.startswith("file:"):
                raise _error("sandbox: sqlite URIs are not allowed")
            if _norm(database).startswith(_work):
                return
            raise _error("sandbox: no access to that database path")
        paths = args[:2] if kind == 5 else args[:1]
        for path in paths:
            if path is None and kind == 2:
                continue  # listdir() of the working directory
            if _type(path) is _int:
                if kind in (2, 3):
                    continue  # listing / entering an open directory descriptor
                raise _error("sandbox: " + event + " on a descriptor is not allowed")
            path = _norm(path)
            if path.startswith(_work) or (kind == 2 and path.startswith(_roots)):
                continue
            raise _error("sandbox: " + event + " outside the working folder is not allowed")

    write, exit_now = posix.write, posix._exit
    _exec, _compile, _BaseException = exec, compile, BaseException

    def why(error, _type=type, _str=str, _join=" ".join):  # one line: "ExceptionName: message"
        text = _type(error).__name__
        try:
            message = _str(error)
        except _BaseException:
            message = ""
        if message:
            text = text + ": " + message
        return _join(text.split())[:300].encode("utf-8", "backslashreplace")

    result_lines = [(nonce + " " + str(i) + " ").encode() for i in range(len(tests))]
    sys.stdout = sys.stderr = open("/dev/null", "w")  # the solution's prints go nowhere
    write(1, (nonce + " ready\n").encode())
    sys.addaudithook(hook)
    del job, refuse, create_builtin, create_builtin_checked, norm, hook, kinds, denied, denied_prefixes
    del denied_imports, read_roots, read_files, work

    namespace = {"__name__": "solution", "__builtins__": builtins}
    not_loaded = None
    try:
        _exec(_compile(code, "<solution>", "exec"), namespace)
    except _BaseException as e:
        not_loaded = b"0 the code raised " + why(e) + b"\n"
    i = 0
    for test in tests:
        passed = not_loaded
        if passed is None:
            try:
                _exec(_compile(test, "<test>", "exec"), namespace)
                passed = b"1\n"
            except _BaseException as e:
                passed = b"0 " + why(e) + b"\n"
        write(1, result_lines[i] + passed)
        i += 1
    exit_now(0)  # skip atexit handlers and finalizers the solution may have registered


_sandbox(__import__("sys").argv[1])
'''

_NAMESPACE_FLAGS = (
    ("--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"),
    ("--net", "--pid", "--fork", "--kill-child"),
    ("--user", "--map-root-user", "--net"),
    ("--net",),
)


def _python() -> str:
    return os.path.realpath(sys.executable)


@cache
def isolation_prefix() -> tuple[str, ...]:
    """The `unshare ... --` prefix that works here (probed once per process), or () when none does."""
    unshare = shutil.which("unshare")
    if not unshare:
        return ()
    for flags in _NAMESPACE_FLAGS:
        prefix = (unshare, *flags, "--")
        try:
            probe = subprocess.run([*prefix, _python(), "-I", "-S", "-c", "pass"], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20, env={})
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return prefix
    return ()


def _limit_setter(limits: SandboxLimits):
    """preexec_fn: runs in the child between fork and exec, so it only calls setrlimit."""
    mib = 1024 * 1024
    settings = [
        # soft == hard: the kernel sends SIGKILL, which a PID namespace's init cannot ignore (SIGXCPU it can)
        (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s)),
        (resource.RLIMIT_AS, (limits.memory_mb * mib,) * 2),
        (resource.RLIMIT_FSIZE, (limits.file_size_mb * mib,) * 2),
        (resource.RLIMIT_NOFILE, (limits.open_files,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ]

    def apply():
        for which, values in settings:
            resource.setrlimit(which, values)

    return apply


def _wait_then_kill_group(proc: subprocess.Popen, wall_s: float) -> tuple[bool, float]:
    """Wait up to wall_s for the child to exit, kill its process group, reap it. (Whether it timed out, the CPU
    seconds it and the children it reaped used: `unshare` reports a child the CPU limit killed as exit code 1.)

    The group is killed before the leader is reaped, so its id cannot have been reused."""
    timed_out = False
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            timed_out = not select.select([pidfd], [], [], wall_s)[0]
        finally:
            os.close(pidfd)
    else:
        deadline, delay = time.monotonic() + wall_s, 0.001
        while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            if time.monotonic() >= deadline:
                timed_out = True
                break
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return timed_out, usage.ru_utime + usage.ru_stime


def _remove_tree(root: str) -> None:
    """Delete the folder even where the code removed permissions from its subfolders."""
    for folder, subfolders, _ in os.walk(root):
        for name in subfolders:
            try:
                os.chmod(os.path.join(folder, name), 0o700, follow_symlinks=False)
            except OSError:
                pass
    shutil.rmtree(root, ignore_errors=True)


def run_tests(code: str, tests: list[str], limits: SandboxLimits = DEFAULT_LIMITS) -> list[bool]:
    """Run `code`, then each test, in one sandboxed interpreter; whether each test passed.

    Tests that had not finished when the process was killed count as failed.

    >>> run_tests("def double(x):\\n    return 2 * x", ["assert double(2) == 4", "assert double(2) == 5"])
    [True, False]
    """
    return [failure is None for failure in run_tests_explained(code, tests, limits)]


def run_tests_explained(code: str, tests: list[str], limits: SandboxLimits = DEFAULT_LIMITS) -> list[str | None]:
    """run_tests, saying why each test failed: None where it passed, else one line (the exception the code or the
    test raised, a refusal of the sandbox, or the limit that killed the process before the test finished).

    >>> run_tests_explained("def double(x):\\n    return 2 * x", ["assert double(2) == 4", "assert double(2) == 5"])
    [None, 'AssertionError']
    """
    if not tests:
        return []
    root = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    try:
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        nonce = secrets.token_hex(16)
        job_path = os.path.join(root, "job.json")
        with open(job_path, "w", encoding="utf-8") as f:
            json.dump({"nonce": nonce, "code": code, "tests": list(tests), "work": work,
                       "max_file_writes": limits.max_file_writes}, f)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work}
        command = [*isolation_prefix(), _python(), "-I", "-S", "-B", "-c", _PRELUDE, job_path]
        with open(os.path.join(root, "out"), "w+b") as out, open(os.path.join(root, "err"), "w+b") as err:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=work, env=env,
                                    preexec_fn=_limit_setter(limits), start_new_session=True, close_fds=True)
            timed_out, cpu_s = _wait_then_kill_group(proc, limits.wall_s)
            out.seek(0)
            lines = out.read(1 << 20).decode("utf-8", "replace").splitlines()
            if f"{nonce} ready" not in lines and not timed_out:
                err.seek(0)
                detail = err.read(4000).decode("utf-8", "replace").strip()
                raise RuntimeError(f"code_execution: the sandbox interpreter did not start (exit code "
                                   f"{proc.returncode}): {detail or 'no output'}. Check SandboxLimits "
                                   f"(memory_mb={limits.memory_mb}, open_files={limits.open_files}).")
    finally:
        _remove_tree(root)
    unfinished = _killed(limits, timed_out, cpu_s, proc.returncode)
    failures: list[str | None] = [unfinished] * len(tests)
    for line in lines:
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[0] == nonce and parts[1].isdigit() and int(parts[1]) < len(tests):
            failures[int(parts[1])] = None if parts[2] == "1" else (parts[3] if len(parts) > 3 else "failed")
    return failures


def _killed(limits: SandboxLimits, timed_out: bool, cpu_s: float, returncode: int) -> str:
    """Why a test the process did not finish failed: the wall-clock timeout, the CPU limit, a signal, or the code
    ending the process."""
    if timed_out:
        return f"TimeoutError: killed after {limits.wall_s:g} s of wall-clock time (SandboxLimits.wall_s)"
    if cpu_s >= limits.cpu_s / 2:  # the kernel's SIGKILL at the limit; rusage reports ~85% of it
        return f"TimeoutError: killed at {limits.cpu_s} CPU seconds (SandboxLimits.cpu_s): a loop that never ends?"
    if returncode < 0:
        return f"crashed: killed by {signal.Signals(-returncode).name}"
    return f"crashed: the process exited with code {returncode} before the test finished"


def code_execution(prompts=None, completions=None, test_cases=None, *, limits: SandboxLimits = DEFAULT_LIMITS,
                   **kwargs) -> list[float]:
    r"""Fraction of the row's `test_cases` the completion's Python code passes; 0.0 when it has no code.

    The code is the last ```python block of the completion, else the whole text. `test_cases` holds per row
    a list of test strings (or a JSON string of that list); each runs after the code, in its namespace.

    >>> code_execution(completions=["```python\ndef add(a, b):\n    return a + b\n```"],
    ...                test_cases=[["assert add(1, 2) == 3", "assert add(0, 0) == 0"]])
    [1.0]
    """
    if test_cases is None:
        raise ValueError("code_execution needs a `test_cases` column in the prompts table: per row a list of "
                         "test strings such as \"assert add(1, 2) == 3\" (or a JSON string of that list)")
    if len(test_cases) != len(completions):
        raise ValueError(f"code_execution: {len(completions)} completions but {len(test_cases)} test_cases rows")
    jobs = [(extract_code(completion_text(c)), _tests_of(t, row))
            for row, (c, t) in enumerate(zip(completions, test_cases))]

    def score(job) -> float:
        code, tests = job
        if not code or not tests:
            return 0.0
        return sum(run_tests(code, tests, limits)) / len(tests)

    with ThreadPoolExecutor(max_workers=max(1, min(limits.workers, len(jobs)))) as pool:
        return list(pool.map(score, jobs))
