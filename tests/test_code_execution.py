"""The code-execution reward: scores from real sandboxed runs, and escapes that must score 0.0.

Every escape's code is harmless if the sandbox failed (bounded forks, signal 0, a file in tmp_path),
and the ones that can run here run once unsandboxed too, to show the test would see an escape.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from stages.scoring.rewards import BUILTIN_REWARDS
from stages.scoring.rewards.sandbox import SandboxLimits, code_execution, extract_code, run_tests

PROJECT_FILE = Path(__file__).resolve().parents[1] / "pyproject.toml"
FAST = SandboxLimits(cpu_s=1, wall_s=3)


@pytest.fixture
def sandbox_root(tmp_path, monkeypatch):
    """Sandbox folders go under tmp_path, so leftovers (folders, processes) can be found by its name."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = set(_children())  # e.g. the session's Prefect test server, started by an earlier test
    yield tmp_path
    assert not list(tmp_path.glob("posttrain-sandbox-*")), "sandbox folder not deleted"
    deadline = time.monotonic() + 5  # SIGKILLed members of a group can take a moment to exit on a loaded machine
    while _processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_mentioning(str(tmp_path)) == [], "sandbox processes left running"
    assert sorted(set(_children()) - before) == [], "child processes left behind"


def _proc_entries():
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in _proc_entries():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(pid)
    return found


def _children() -> list[int]:
    found = []
    for pid in _proc_entries():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # after "pid (comm)": state, ppid, ...
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append(pid)
    return found


def _fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nIt adds the numbers."


ADD = "def add(a, b):\n    return a + b"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]


def test_registered_as_builtin():
    assert BUILTIN_REWARDS["code_execution"] is code_execution


def test_scores_pass_fraction(sandbox_root):
    completions = [
        _fenced(ADD),  # correct
        _fenced("def add(a, b):\n    return 3"),  # passes the first test only
        _fenced("def add(a, b:\n    return a + b"),  # syntax error
        "I am not sure how to do this.",  # no code: the whole text is not Python
        "",  # nothing at all
        [{"role": "assistant", "content": _fenced(ADD)}],  # chat format
        ADD,  # no fence: the whole text is the code
    ]
    test_cases = [ADD_TESTS] * 6 + ['["assert add(1, 2) == 3", "assert add(2, 2) == 5"]']  # last: a JSON string
    scores = code_execution(prompts=[""] * len(completions), completions=completions, test_cases=test_cases)
    assert scores == [1.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.5]


def test_extract_code_prefers_the_last_python_block():
    text = "```bash\npip install x\n```\n```python\nx = 1\n```\nthen\n```python\nx = 2\n```"
    assert extract_code(text) == "x = 2"
    assert extract_code("```\ny = 3\n```") == "y = 3"
    assert extract_code("```python\nz = 4") == "z = 4"  # cut off before the closing fence
    assert extract_code("w = 5\n") == "w = 5"


def test_missing_column_says_what_to_add():
    with pytest.raises(ValueError, match="test_cases"):
        code_execution(prompts=["p"], completions=[ADD])


def test_printed_fake_results_do_not_score(sandbox_root):
    code = ("import os\nfor i in range(3):\n    print(f'PASS {i} 1')\n    os.write(1, f'ok {i} 1\\n'.encode())\n"
            "def add(a, b):\n    return 0")
    assert run_tests(code, ["assert add(1, 2) == 3", "assert add(2, 2) == 4"], FAST) == [False, False]


def _listening_server():
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    return server


ESCAPES = {
    "read_project_file": (f"def escape():\n    return 'posttrain' in open({str(PROJECT_FILE)!r}).read()", True),
    "import_project": "def escape():\n    import stages\n    return True",
    "socket": ("import socket\ndef escape():\n    socket.create_connection(('127.0.0.1', PORT), timeout=1).close()\n"
               "    return True", True),
    # A fork bomb, bounded so that a broken sandbox cannot hurt the machine: each child exits at once.
    "fork_loop": ("import os\ndef escape():\n    n = 0\n    for _ in range(20):\n        try:\n"
                  "            pid = os.fork()\n        except OSError:\n            continue\n"
                  "        if pid == 0:\n            os._exit(0)\n        os.waitpid(pid, 0)\n        n += 1\n"
                  "    return n > 0"),
    "subprocess": "import subprocess\ndef escape():\n    return subprocess.run(['/bin/true']).returncode == 0",
    "signal_host": ("import os\ndef escape():\n    os.kill(HOST_PID, 0)\n    return True", True),
    "write_outside": "def escape():\n    open(TARGET, 'w').write('x')\n    return True",
    "allocate_10_gb": "def escape():\n    return len(bytearray(10 * 1024 ** 3)) > 0",
}


@pytest.mark.parametrize("name", list(ESCAPES))
def test_escapes_score_zero_and_leave_host_alone(name, sandbox_root):
    code, control = ESCAPES[name] if isinstance(ESCAPES[name], tuple) else (ESCAPES[name], False)
    server = _listening_server()
    target = sandbox_root / "pwned"
    code = (code.replace("PORT", str(server.getsockname()[1])).replace("HOST_PID", str(os.getpid()))
            .replace("TARGET", repr(str(target))))
    try:
        if control:  # unsandboxed, the same code succeeds: the test would see an escape
            namespace = {}
            exec(code, namespace)
            assert namespace["escape"]()
            if name == "socket":
                server.accept()[0].close()
        start = time.monotonic()
        scores = code_execution(completions=[_fenced(code)], test_cases=[["assert escape()"]], limits=FAST)
        elapsed = time.monotonic() - start
        assert scores == [0.0]
        assert elapsed < 2.5
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing connected from the sandbox
        assert not target.exists()
    finally:
        server.close()


def test_infinite_loop_killed_by_cpu_limit_keeps_earlier_results(sandbox_root):
    code = _fenced(ADD + "\ndef spin():\n    while True:\n        pass")
    start = time.monotonic()
    scores = code_execution(completions=[code], test_cases=[["assert add(1, 2) == 3", "spin()"]],
                            limits=SandboxLimits(cpu_s=1, wall_s=10))
    assert scores == [0.5]
    assert time.monotonic() - start < 4  # killed at 1 CPU second, well before the wall clock


def test_sleep_killed_by_wall_clock(sandbox_root):
    start = time.monotonic()
    assert run_tests("import time\ntime.sleep(60)", ["assert True"], SandboxLimits(cpu_s=1, wall_s=1.5)) == [False]
    assert time.monotonic() - start < 4
