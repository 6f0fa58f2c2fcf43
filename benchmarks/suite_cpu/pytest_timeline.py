"""A pytest plugin (`-p pytest_timeline`, this folder on PYTHONPATH): each test's start, end and the CPU seconds of
the pytest worker's own process during it, one tab-separated line per test in TIMELINE_FILE."""

import os
import time

_started: dict[str, tuple[float, float]] = {}


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = (time.time(), _cpu())


def pytest_runtest_logfinish(nodeid, location):
    path = os.environ.get("TIMELINE_FILE")
    if not path:
        return
    start, cpu = _started.pop(nodeid, (time.time(), _cpu()))
    with open(path, "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\t{start:.1f}\t{time.time():.1f}\t"
                f"{_cpu() - cpu:.1f}\t{nodeid}\n")
