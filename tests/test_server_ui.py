"""The UI that `posttrain server --port N` serves talks to the API on port N (issue 13, item 5).

Prefect's UI reads its API URL from /ui-settings, which defaults to PREFECT_API_URL or port 4200, not
the port `prefect server start --port` listens on; flows/server.py pins PREFECT_SERVER_UI_API_URL.
The end-to-end test starts the server on a free port (tests/test_deployments.py's fixture), runs a
two-task flow against it, checks /ui-settings, then renders the flow run's page in headless Chromium
and looks for the task runs' names (the Logs tab labels each task run's lines with its name).
It needs Debian's chromium at /usr/bin/chromium (.ci/run installs it) and is skipped without it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_deployments import ROOT, clean_env, server  # noqa: F401 (server: the `posttrain server` fixture)

from flows.server import api_get, api_post, environments

CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium fails on a machine with no outside network.
# A tall window: the UI's virtual-scrolled lists render only the rows inside the viewport.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,4000"]

FLOW = """
from prefect import flow, task
from prefect.runtime import flow_run

@task(task_run_name="ui-alpha")
def alpha():
    return 1

@task(task_run_name="ui-beta")
def beta(x):
    return x + 1

@flow(name="ui-check")
def ui_check():
    beta(alpha())
    return flow_run.id

print(ui_check())
"""


def test_environments_point_ui_and_worker_at_the_chosen_port(monkeypatch, tmp_path):
    for name in ("PREFECT_API_URL", "PREFECT_UI_API_URL", "PREFECT_UI_URL"):  # a user's other server
        monkeypatch.setenv(name, "http://127.0.0.1:4200/api")
    server_env, worker_env = environments(tmp_path, "http://127.0.0.1:4311", tmp_path / "own-task")
    assert server_env["PREFECT_SERVER_UI_API_URL"] == "http://127.0.0.1:4311/api"
    assert server_env["PREFECT_UI_URL"] == worker_env["PREFECT_UI_URL"] == "http://127.0.0.1:4311"
    assert "PREFECT_API_URL" not in server_env and "PREFECT_UI_API_URL" not in server_env
    assert worker_env["PREFECT_API_URL"] == "http://127.0.0.1:4311/api"
    assert "PREFECT_UI_API_URL" not in worker_env and "PREFECT_SERVER_UI_API_URL" not in worker_env
    assert worker_env["PWD"] == str(tmp_path / "own-task")  # the worker runs in the folder the server serves


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"needs Debian's chromium at {CHROMIUM} (apt-get install -y chromium)")
def test_ui_on_another_port_shows_the_flow_runs_task_runs(server, tmp_path):  # noqa: F811 (the fixture)
    started = time.monotonic()
    server.wait_ready()
    assert server.port != 4200
    base_url = f"http://127.0.0.1:{server.port}"

    ran = subprocess.run([sys.executable, "-c", FLOW], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=clean_env(PREFECT_API_URL=server.api_url, PREFECT_HOME=str(tmp_path / "cli-home")))
    assert ran.returncode == 0, f"{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
    flow_run_id = ran.stdout.split()[-1]

    def task_runs() -> set[str]:  # the server records task runs from events, a moment after the flow returns
        rows = api_post(f"{server.api_url}/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}}) or []
        return {row["name"] for row in rows if row["state_type"] == "COMPLETED"}

    deadline = time.monotonic() + 60
    while task_runs() != {"ui-alpha", "ui-beta"}:
        assert time.monotonic() < deadline, f"task runs of {flow_run_id}: {task_runs()}"
        time.sleep(0.5)

    assert api_get(f"{base_url}/ui-settings")["api_url"] == server.api_url

    # --virtual-time-budget: the page's clock runs until its fetches are answered, then the DOM is dumped.
    page = f"{base_url}/runs/flow-run/{flow_run_id}"
    shown = subprocess.run([str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}",
                            "--virtual-time-budget=15000", "--dump-dom", page],
                           capture_output=True, text=True, timeout=120)
    dom = shown.stdout
    assert shown.returncode == 0, f"Chromium on {page} exited {shown.returncode}:\n{shown.stderr[-3000:]}"
    assert "Can't connect to Server API" not in dom, dom[-3000:]
    assert "ui-check" in dom and "ui-alpha" in dom and "ui-beta" in dom, dom[-3000:]
    print(f"server UI test: {time.monotonic() - started:.0f} s")
