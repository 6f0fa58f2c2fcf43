"""`posttrain server`: a local Prefect server and a process worker, for running configs as deployments.

  posttrain server [--port 4200] [--artifacts artifacts] [--pool posttrain]   (or: make server, python -m flows.server)

Starts `prefect server start --host 127.0.0.1 --port N` with PREFECT_HOME=<artifacts>/prefect-server
(its SQLite database is <artifacts>/prefect-server/prefect.db, its log server.log beside it) and
PREFECT_SERVER_UI_API_URL=http://127.0.0.1:N/api (the UI on port N calls the API on port N),
waits until /api/health answers, creates the process work pool if it is missing, starts
`prefect worker start --pool posttrain --type process` in the folder it is started in (yours, or this
project's) with PREFECT_API_URL pointing at the server, prints the UI address and the commands to deploy
(prefect.yaml where the folder has one, else `posttrain deploy CONFIG`) and run, and stops both on Ctrl-C or
SIGTERM. Runs the worker picks up execute with this Python (the worker's), in the folder the deployment's pull
step names (where it was deployed from), so relative `artifacts_dir` and config paths resolve there, as with
`posttrain run`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

POOL = "posttrain"


def prefect_command(*args: str) -> list[str]:
    """`prefect ARGS` run by this interpreter, so the server, worker and flow runs see this venv."""
    return [sys.executable, "-m", "prefect", *args]


def api_get(url: str, timeout: float = 2.0):
    """GET a JSON document; None if nothing answers or the answer is not 2xx."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read() or b"null")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def api_post(url: str, body: dict, timeout: float = 5.0):
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read() or b"null")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def wait_until(check, timeout_s: float, what: str, process: subprocess.Popen, log: Path | None = None):
    """Poll `check()` until it returns something truthy; fail with a readable message if the
    process exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        if process.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with code {process.returncode}"
                               + (f"; see {log}" if log else ""))
        time.sleep(0.5)
    raise RuntimeError(f"{what}: not ready after {timeout_s:.0f} s" + (f"; see {log}" if log else ""))


def stop(process: subprocess.Popen | None, name: str, grace_s: float = 15.0) -> None:
    """SIGINT the process group (the worker's group holds its flow runs), then SIGKILL after grace_s."""
    if process is None or process.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
    print(f"posttrain server: {name} (pid {process.pid}) did not stop", file=sys.stderr)


def environments(home: Path, base_url: str, folder: Path) -> tuple[dict, dict]:
    """(server env, worker env). Both get PREFECT_HOME=home, so the server's database, profiles and
    local result storage live under the artifacts folder, not ~/.prefect. Settings inherited from the
    caller that point at some other server (API and UI URLs, API key) are dropped, then pinned to
    base_url: the worker gets PREFECT_API_URL; the server gets PREFECT_SERVER_UI_API_URL, which its
    /ui-settings hands to the browser UI (unset, Prefect falls back to PREFECT_API_URL, else
    PREFECT_SERVER_API_PORT's 4200, not the port `--port` chose)."""
    api_url = f"{base_url}/api"
    elsewhere = ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_UI_URL", "PREFECT_UI_API_URL",
                 "PREFECT_SERVER_UI_API_URL")
    base = {k: v for k, v in os.environ.items() if k not in elsewhere}
    base.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_URL=base_url,
                PREFECT_MEMO_STORE_PATH=str(home / "memo_store.toml"))  # else ~/.prefect (flows/cli.py)
    base.setdefault("TOKENIZERS_PARALLELISM", "false")
    base.setdefault("PREFECT_CLIENT_MAX_RETRIES", "7")  # flow runs ride out a locked database (flows/cli.py)
    server = {**base, "PREFECT_SERVER_UI_API_URL": api_url}
    venv_bin = str(Path(sys.executable).parent)
    worker = {**base, "PREFECT_API_URL": api_url, "PWD": str(folder),
              "PATH": venv_bin + os.pathsep + base.get("PATH", "")}
    return server, worker


def ready_message(folder: Path, base_url: str, api_url: str, pool: str) -> str:
    """What to do next: deploy with the folder's prefect.yaml (this project's, or a copy of it beside your
    configs), else with `posttrain deploy CONFIG`; then run a deployment."""
    env_prefix = f"PREFECT_API_URL={api_url}"
    bin_dir = Path(sys.executable).parent
    prefect, posttrain = (shlex.quote(str(bin_dir / name)) for name in ("prefect", "posttrain"))
    if (folder / "prefect.yaml").exists():
        deploy = (f"Deploy with {folder / 'prefect.yaml'}, then run one (from {folder}):\n"
                  f"  {env_prefix} {prefect} deploy --name quickstart --name dpo --name rm_grpo\n"
                  f"  {env_prefix} {prefect} deployment run 'posttrain/quickstart' --param "
                  f"overrides={shlex.quote(json.dumps({'grpo.rounds': 1}))} --watch")
    else:
        deploy = (f"Deploy a config of this folder, then run it (from {folder}):\n"
                  f"  {env_prefix} {posttrain} deploy CONFIG.yaml --pool {pool}\n"
                  f"  {env_prefix} {prefect} deployment run 'posttrain/<config name>-retrain' --watch")
    return f"""
posttrain server: ready.
  UI:      {base_url}
  API:     {api_url}
  worker:  pool {pool!r} (process), runs flows in {folder}
{deploy}
Ctrl-C stops the worker and the server."""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `posttrain server` (shared by flows/cli.py and `python -m flows.server`)."""
    parser.add_argument("--port", type=int, default=4200, help="server port on 127.0.0.1 (default 4200)")
    parser.add_argument("--artifacts", default="artifacts",
                        help="folder for the server's home and SQLite database (default: artifacts)")
    parser.add_argument("--pool", default=POOL, help=f"process work pool to create and serve (default {POOL})")
    parser.add_argument("--startup-timeout", type=float, default=180.0,
                        help="seconds to wait for the server, then the worker, to come up (default 180)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="posttrain server",
                                     description="Local Prefect server + process worker for prefect.yaml's deployments.")
    return serve(add_arguments(parser).parse_args(argv))


def serve(args: argparse.Namespace) -> int:
    """Start the server and the worker, print how to deploy and run, block until Ctrl-C or SIGTERM."""
    home = Path(args.artifacts).resolve() / "prefect-server"
    home.mkdir(parents=True, exist_ok=True)
    base_url = f"http://127.0.0.1:{args.port}"
    api_url = f"{base_url}/api"
    folder = Path.cwd()  # the worker runs here; deployments made from here run here (their pull step)
    server_env, worker_env = environments(home, base_url, folder)
    server_log = home / "server.log"
    with socket.socket() as probe:  # else the health check could pass against whatever holds the port
        if probe.connect_ex(("127.0.0.1", args.port)) == 0:
            print(f"posttrain server: port {args.port} on 127.0.0.1 is in use; pick another with --port",
                  file=sys.stderr)
            return 1

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    server = worker = None
    try:
        with open(server_log, "ab") as log:
            server = subprocess.Popen(
                prefect_command("server", "start", "--host", "127.0.0.1", "--port", str(args.port),
                                "--analytics-off"),
                env=server_env, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        print(f"posttrain server: starting Prefect server on {base_url} (home {home}, log {server_log})",
              flush=True)
        wait_until(lambda: api_get(f"{api_url}/health") is True, args.startup_timeout,
                   f"Prefect server on {base_url}", server, server_log)

        if api_get(f"{api_url}/work_pools/{args.pool}") is None:
            created = subprocess.run(prefect_command("work-pool", "create", args.pool, "--type", "process"),
                                     env=worker_env, cwd=folder, capture_output=True, text=True)
            if created.returncode != 0 and api_get(f"{api_url}/work_pools/{args.pool}") is None:
                raise RuntimeError(f"could not create work pool {args.pool!r}:\n{created.stdout}{created.stderr}")
            print(f"posttrain server: created process work pool {args.pool!r}", flush=True)

        worker = subprocess.Popen(prefect_command("worker", "start", "--pool", args.pool, "--type", "process"),
                                  env=worker_env, cwd=folder, start_new_session=True)
        wait_until(lambda: api_post(f"{api_url}/work_pools/{args.pool}/workers/filter", {}), args.startup_timeout,
                   f"worker for pool {args.pool!r}", worker)

        print(ready_message(folder, base_url, api_url, args.pool), flush=True)

        while True:
            for process, name in ((server, "Prefect server"), (worker, "worker")):
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {process.returncode}"
                                       + (f"; see {server_log}" if process is server else ""))
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("\nposttrain server: stopping the worker and the server", flush=True)
        return 0
    except RuntimeError as e:
        print(f"posttrain server: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        stop(worker, "worker")
        stop(server, "Prefect server")


if __name__ == "__main__":
    sys.exit(main())
