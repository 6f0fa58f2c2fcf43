"""`posttrain server` (flows/server.py) as a process the tests start and stop, and the `prefect` CLI against it:
the helpers of the end-to-end deployment test (tests/test_work_pools.py: `prefect deploy --name ...` of the shipped
deployments, `prefect deployment run 'posttrain/quickstart-ray' --watch` through the server's process worker to
COMPLETED, then SIGTERM stops the server and the worker and nothing is left running) and of tests/test_server_ui.py.

The server is its own process: PREFECT_API_URL is set only in the environments of the subprocesses (and the client
is pointed at the server explicitly).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster import free_port, processes_with_env

ROOT = Path(__file__).resolve().parents[1]
PREFECT = [sys.executable, "-m", "prefect", "--no-prompt"]

# tests/conftest.py's tiny_config_text as dotted overrides of configs/quickstart.yaml, one round.
TINY = {
    "name": "deploy-tiny", "export.model_name": "deploy-tiny", "grpo.rounds": 1,
    "demo_data.num_sft": 300, "demo_data.num_train": 64, "demo_data.num_eval": 24,
    "model.hidden_size": 64, "model.num_attention_heads": 1, "model.num_key_value_heads": 1,
    "model.intermediate_size": 128, "model.num_hidden_layers": 2, "model.vocab_size": 300,
    "sft.num_train_epochs": 1, "sft.micro_batch_size": 32,
    "rollout.num_generations": 4, "rollout.prompts_per_round": 8, "rollout.max_completion_length": 8,
    "score.reward_num_workers": 1,
    "grpo.micro_batch_size": 16, "grpo.gradient_accumulation_steps": 1,
    "eval.max_completion_length": 8,
}


def clean_env(**extra: str) -> dict:
    """This process's environment without any Prefect server, MLflow store or Ray cluster it may point at."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_HOME", "MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    return {**env, **extra}


class Server:
    """`python -m flows.server` in its own session, `env` added to its environment; stop() sends SIGTERM like a
    service manager would."""

    def __init__(self, tmp_path: Path, **env: str):
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.artifacts = tmp_path / "server-artifacts"
        self.log = tmp_path / "server.out"
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "flows.server", "--port", str(self.port), "--artifacts", str(self.artifacts)],
                cwd=ROOT, env=clean_env(PREFECT_WORKER_QUERY_SECONDS="2", **env), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 200.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "posttrain server: ready." not in self.output():
            assert self.process.poll() is None, f"posttrain server exited early:\n{self.output()[-5000:]}"
            assert time.monotonic() < deadline, f"posttrain server not ready after {timeout_s} s:\n{self.output()}"
            time.sleep(1.0)

    def stop(self) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        for pid in processes_with_env(f"PREFECT_API_URL={self.api_url}"):  # never leave a worker behind
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return self.process.returncode


@pytest.fixture
def server(tmp_path):
    handle = Server(tmp_path)
    try:
        yield handle
    finally:
        handle.stop()


def prefect(args: list[str], server: Server, tmp_path: Path, timeout_s: float, **env: str) -> subprocess.CompletedProcess:
    env = clean_env(PREFECT_API_URL=server.api_url, PREFECT_HOME=str(tmp_path / "cli-home"), **env)
    result = subprocess.run(PREFECT + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, (f"prefect {' '.join(args)} exited {result.returncode}:\n{result.stdout[-5000:]}\n"
                                    f"{result.stderr[-5000:]}\n--- posttrain server ---\n{server.output()[-5000:]}")
    return result


async def read_run(api_url: str, deployment: str):
    """(the deployment, its flow runs, the task runs of its single flow run) from the server's API."""
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterId

    async with PrefectClient(api=api_url) as client:
        dep = await client.read_deployment_by_name(deployment)
        runs = await client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id])))
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[runs[0].id])))
        return dep, runs, tasks


def test_the_server_tells_how_to_deploy_from_the_folder_it_serves(tmp_path):
    """`posttrain server` serves the folder it is started in (issue 44 item 8): with a prefect.yaml there (this
    project, or a copy beside your configs) it says `prefect deploy`, else `posttrain deploy CONFIG`."""
    from flows.server import ready_message

    own = ready_message(tmp_path, "http://127.0.0.1:4200", "http://127.0.0.1:4200/api", "posttrain")
    assert f"runs flows in {tmp_path}" in own and "posttrain deploy CONFIG.yaml --pool posttrain" in own
    shipped = ready_message(ROOT, "http://127.0.0.1:4200", "http://127.0.0.1:4200/api", "posttrain")
    assert f"Deploy with {ROOT / 'prefect.yaml'}" in shipped and "deploy --name quickstart" in shipped
