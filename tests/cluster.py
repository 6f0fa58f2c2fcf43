"""Real servers in tests: free ports, finding and stopping their processes, and a Ray cluster on loopback
(a head started with `ray start --head`, more nodes joined with `ray start --address`, one CPU each, in a
HOME of the test's own; Ray 2.60 keeps its auth token under ~/.ray).

Stopping kills only this cluster's processes, found by that HOME in their environment: `ray stop --force`
would kill every Ray process on the machine, other people's clusters included."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_with_env(needle: str) -> list[int]:
    """Pids (other than ours) whose environment contains `needle`; a NUL is put before the first
    variable, so a needle "\\0NAME=value\\0" matches whole entries only."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle.encode() in b"\0" + (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def processes_in_home(home: Path) -> list[int]:
    """Pids (other than ours) started with HOME=home: the cluster's raylets, GCS, agents and workers."""
    return processes_with_env(f"\0HOME={home}\0")


def kill_processes_in_home(home: Path, grace_s: float = 2.0) -> None:
    """SIGTERM every process with HOME=home, SIGKILL what is left after grace_s, wait until none is left.
    (Ray 2.60's GCS, raylets, monitor and runtime-env agent outlive a SIGTERM by more than 8 s, measured: a test
    cluster has nothing to save, so they get 2 s, not `ray stop`'s 16.)"""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for pid in processes_in_home(home):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while processes_in_home(home) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not processes_in_home(home):
            return


@contextmanager
def ray_cluster(home: Path, nodes: int = 2, dashboard_port: int | None = None) -> Iterator[str]:
    """Start a head and nodes - 1 more nodes (1 CPU, 100 MB object store each) with HOME=home; yield the head's
    address; kill the cluster's processes after. With `dashboard_port`, the head serves Ray's dashboard
    (needs `ray[default]`) on 127.0.0.1 at that port."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # RAY_AUTH_MODE: see tests/conftest.py
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    port = free_port()
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus", "1", "--object-store-memory", str(100 * 1024 * 1024), "--disable-usage-stats"]
    dashboard = (["--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port)]
                 if dashboard_port else ["--include-dashboard", "false"])
    started = time.time()
    try:
        subprocess.run([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), *dashboard,
                        *common], env=env, check=True, capture_output=True, timeout=180)
        for _ in range(nodes - 1):
            subprocess.run([RAY, "start", "--address", address, *common], env=env, check=True, capture_output=True,
                           timeout=180)
        yield address
    finally:
        kill_processes_in_home(home)
        # `ray start --head` names the machine's "current cluster" in /tmp/ray; `ray stop` would remove that
        # file, and a later ray.init() without an address would try to join the dead cluster it names
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if current.exists() and current.stat().st_mtime >= started - 1:
            current.unlink(missing_ok=True)


@contextmanager
def joined_ray_cluster(home: Path, nodes: int = 2, dashboard_port: int | None = None) -> Iterator[str]:
    """`ray_cluster` with this process's HOME set to `home` (so its Ray client finds the cluster's token
    files) and RAY_ADDRESS unset while it runs; this process's Ray client is shut down before the cluster."""
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_ADDRESS")}
    os.environ["HOME"] = str(home)
    os.environ.pop("RAY_ADDRESS", None)
    try:
        with ray_cluster(home, nodes=nodes, dashboard_port=dashboard_port) as address:
            try:
                yield address
            finally:
                import ray

                ray.shutdown()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
