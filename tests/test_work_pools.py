"""Deployments where the compute is (prefect.yaml: quickstart-ray, quickstart-k8s, quickstart-docker).

Prefect 3.7.7's `prefect deploy` has no dry run, so the check here is its equivalent, stricter: prefect.yaml is
read by the function `prefect deploy` reads it with, each deployment's `job_variables` are validated against
its work pool's base job template the way the server validates them when a deployment is created, any key the
template does not declare is an error (Prefect drops those silently), and the job is rendered as a worker
renders it. The pools' templates are what `prefect work-pool create --type T` gives without a network:
Prefect's bundled copy of the collection registry (or the installed worker package, where there is one), and
deploy/kubernetes/base-job-template.json for the Kubernetes pool.

The slow test runs the quickstart-ray deployment for real: a two-node Ray cluster on loopback, `posttrain
server` (a Prefect server and a process worker) on its "head node", RAY_ADDRESS given to the flow run by the
deployment's job_variables, and the score stage's MLflow run records actors on both nodes.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import socket
import time
import uuid
from pathlib import Path
from unittest import mock

import cluster
import pytest
from test_deployments import TINY, Server, prefect, read_run

ROOT = Path(__file__).resolve().parents[1]
POOL_TYPES = {"posttrain": "process", "posttrain-k8s": "kubernetes", "posttrain-docker": "docker"}
K8S_TEMPLATE = ROOT / "deploy" / "kubernetes" / "base-job-template.json"
ARTIFACTS_IN_IMAGE = "/opt/posttrain/artifacts"


def deploy_configs(env: dict[str, str]) -> dict[str, dict]:
    """prefect.yaml's deployments by name as `prefect deploy` sees them: parsed and validated by its loader,
    merged with its defaults, `{{ $VAR }}` filled in from `env` (the deploying shell's environment)."""
    from prefect.cli.deploy._config import _load_deploy_configs_and_actions, _merge_with_default_deploy_config
    from prefect.utilities.templating import apply_values
    from rich.console import Console

    console = Console(record=True)
    configs, _ = _load_deploy_configs_and_actions(ROOT / "prefect.yaml", console=console)
    assert configs, console.export_text()  # the loader prints validation errors and returns nothing
    with mock.patch.dict(os.environ, env):  # `{{ $VAR }}` reads os.environ, as in `prefect deploy`
        return {c["name"]: apply_values(_merge_with_default_deploy_config(c), {}, remove_notset=False)
                for c in configs}


def bundled_template(pool_type: str) -> dict:
    """The base job template of a work pool type in Prefect's bundled copy of the collection registry (what
    the server falls back to offline)."""
    from prefect.server.api import collections

    view = Path(collections.__file__).parent / "collections_data" / "views" / "aggregate-worker-metadata.json"
    for workers in json.loads(view.read_text()).values():
        for metadata in workers.values():
            if metadata.get("type") == pool_type:
                return metadata["default_base_job_configuration"]
    raise LookupError(f"no base job template for work pool type {pool_type!r}")


def default_template(pool_type: str) -> dict:
    """`prefect work-pool get-default-base-job-template --type pool_type` without a server: the installed worker
    class's template, else the bundled one."""
    from prefect.workers.base import BaseWorker

    worker = BaseWorker.get_worker_class_from_type(pool_type)
    if worker is not None:
        return copy.deepcopy(worker.get_default_base_job_template())
    return bundled_template(pool_type)


def base_job_template(pool: str) -> dict:
    if pool == "posttrain-k8s":
        return json.loads(K8S_TEMPLATE.read_text())
    return default_template(POOL_TYPES[pool])


def render_job(job_variables: dict, template: dict) -> dict:
    """The job a worker would start for these job_variables, after the checks `prefect deploy` leaves to the
    server (prefect/server/api/validation.py: the template's JSON schema, required keys ignored) and one it
    does not make: every key must be a variable of the template. Raises ValueError naming the key."""
    from prefect.utilities.schema_tools import ValidationError, validate
    from prefect.utilities.templating import apply_values

    properties = template["variables"]["properties"]
    unknown = sorted(set(job_variables) - set(properties))
    if unknown:
        raise ValueError(f"job_variables {unknown} are not variables of the work pool's base job template "
                         f"(it has: {', '.join(sorted(properties))})")
    try:
        validate(job_variables, template["variables"], raise_on_error=True, preprocess=True, ignore_required=True,
                 allow_none_with_default=True)
    except ValidationError as e:
        raise ValueError(f"job_variables do not fit the work pool's base job template: {e}") from e
    defaults = {name: p["default"] for name, p in properties.items() if "default" in p}
    return apply_values(copy.deepcopy(template["job_configuration"]), {**defaults, **job_variables})


def test_every_deployment_fits_its_work_pool():
    configs = deploy_configs({"RAY_ADDRESS": "10.0.0.1:6379"})
    assert set(configs) >= {"quickstart", "dpo", "rm_grpo", "quickstart-ray", "quickstart-k8s", "quickstart-docker"}
    for name, cfg in configs.items():
        pool = cfg["work_pool"]["name"]
        assert pool in POOL_TYPES, (name, pool)
        render_job(cfg["work_pool"]["job_variables"], base_job_template(pool))

    ray = render_job(configs["quickstart-ray"]["work_pool"]["job_variables"], base_job_template("posttrain"))
    assert ray["env"] == {"RAY_ADDRESS": "10.0.0.1:6379"}  # from the deploying shell
    assert configs["quickstart-ray"]["parameters"]["overrides"]["score.backend"] == "ray"

    k8s = render_job(configs["quickstart-k8s"]["work_pool"]["job_variables"], base_job_template("posttrain-k8s"))
    pod = k8s["job_manifest"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"].endswith("posttrain:0.1.0")
    assert pod["volumes"] == [{"name": "artifacts", "persistentVolumeClaim": {"claimName": "posttrain-artifacts"}}]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "artifacts", "mountPath": ARTIFACTS_IN_IMAGE}]
    assert {"PREFECT_API_URL", "RAY_ADDRESS", "MLFLOW_TRACKING_URI"} <= set(k8s["env"])
    assert k8s["job_manifest"]["metadata"]["namespace"] == "posttrain"

    docker = render_job(configs["quickstart-docker"]["work_pool"]["job_variables"], base_job_template("posttrain-docker"))
    assert [v.split(":")[1] for v in docker["volumes"]] == [ARTIFACTS_IN_IMAGE]
    assert docker["image"] == "posttrain:0.1.0" and "MLFLOW_TRACKING_URI" in docker["env"]

    # containers start in the image's project folder, where the shared volume sits under artifacts/
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"WORKDIR {Path(ARTIFACTS_IN_IMAGE).parent}" in dockerfile
    for name in ("quickstart-k8s", "quickstart-docker"):
        assert configs[name]["pull"] == [{"prefect.deployments.steps.set_working_directory":
                                          {"directory": str(Path(ARTIFACTS_IN_IMAGE).parent)}}], name


def test_kubernetes_template_is_prefects_plus_the_artifacts_volume():
    """deploy/kubernetes/base-job-template.json is Prefect 3.7.7's bundled Kubernetes template plus the volume
    (prefect-kubernetes releases add variables; the test below checks its worker still renders this one)."""
    ours = json.loads(K8S_TEMPLATE.read_text())
    assert ours["variables"]["properties"].pop("artifacts_claim")["default"] == "posttrain-artifacts"
    pod = ours["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    del pod["volumes"], pod["containers"][0]["volumeMounts"]
    assert ours == bundled_template("kubernetes")


@pytest.mark.parametrize("pool, job_variables, error", [
    ("posttrain-k8s", {"imagee": "posttrain:0.1.0"}, r"\['imagee'\] are not variables"),
    ("posttrain-k8s", {"env": ["RAY_ADDRESS=x"]}, "do not fit"),
    ("posttrain-k8s", {"volumes": ["/mnt:/opt/posttrain/artifacts"]}, r"\['volumes'\] are not variables"),
    ("posttrain-docker", {"volumes": "/mnt:/opt/posttrain/artifacts"}, "do not fit"),
    ("posttrain", {"env": {"RAY_ADDRESS": "x"}, "working_dir": 3}, "do not fit"),
])
def test_a_wrong_job_variable_fails_the_check(pool, job_variables, error):
    configs = deploy_configs({"RAY_ADDRESS": "10.0.0.1:6379"})
    name = {"posttrain": "quickstart-ray", "posttrain-k8s": "quickstart-k8s",
            "posttrain-docker": "quickstart-docker"}
    broken = {**configs[name[pool]]["work_pool"]["job_variables"], **job_variables}
    with pytest.raises(ValueError, match=error):
        render_job(broken, base_job_template(pool))


def test_kubernetes_worker_renders_the_job(request):
    """Where prefect-kubernetes is installed: the worker's own job configuration renders the Job
    (it resolves block and variable references through a Prefect API: the test harness here)."""
    kubernetes = pytest.importorskip("prefect_kubernetes.worker")
    from prefect.client.schemas.objects import FlowRun

    request.getfixturevalue("prefect_harness")  # only where the package is: the harness takes ~10-60 s

    cfg = deploy_configs({})["quickstart-k8s"]
    job = asyncio.run(kubernetes.KubernetesWorkerJobConfiguration.from_template_and_values(
        json.loads(K8S_TEMPLATE.read_text()), cfg["work_pool"]["job_variables"]))
    job.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="a-run"))
    container = job.job_manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == cfg["work_pool"]["job_variables"]["image"]
    assert container["volumeMounts"][0]["mountPath"] == ARTIFACTS_IN_IMAGE
    assert {"name": "RAY_ADDRESS", "value": "ray://raycluster-head-svc.posttrain.svc:10001"} in container["env"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xdist_group(name="ray")  # its own Ray cluster: never beside another (tests/conftest.py)
def test_deploy_and_run_quickstart_ray_on_the_ray_head_nodes_process_pool(tmp_path):
    """`posttrain server` (a Prefect server and a process worker) on the head node of a two-node Ray cluster;
    `prefect deploy --name ...` registers the shipped deployments of its pool; `prefect deployment run
    posttrain/quickstart-ray --watch` runs a tiny pipeline through the worker to COMPLETED, every stage a task run of
    that flow run, its artifacts where the overrides say, RAY_ADDRESS given to the flow run by the deployment's
    job_variables, the score stage's actors on both nodes, SFT and the round on 2 torchrun processes. Then SIGTERM
    stops the server and the worker, and nothing is left running. (One run for what were two tests, each starting a
    server and computing a tiny run: the plain `quickstart` deployment differs from quickstart-ray only in its
    scoring and training overrides and job_variables, all checked against the pool by
    test_every_deployment_fits_its_work_pool.)"""
    pytest.importorskip("ray")
    from mlflow import MlflowClient

    started = time.monotonic()
    home = tmp_path / "home"  # the Ray cluster's, the worker's and so the flow run's (Ray's token is in ~/.ray)
    home.mkdir()
    run_artifacts = tmp_path / "run-artifacts"
    with cluster.ray_cluster(home, nodes=2) as address:
        server = Server(tmp_path, HOME=str(home))  # the worker's environment has no RAY_ADDRESS
        try:
            server.wait_ready()
            assert (server.artifacts / "prefect-server" / "prefect.db").exists()  # the server's SQLite, --artifacts
            # by name: `--all` stops at the first deployment whose pool this server lacks (posttrain-k8s, ...)
            names = ("quickstart", "dpo", "rm_grpo", "quickstart-ray")
            deployed = prefect(["deploy", *(arg for name in names for arg in ("--name", name))], server, tmp_path,
                               timeout_s=180, RAY_ADDRESS=address)
            for name in names:
                assert f"Deployment 'posttrain/{name}' successfully created" in deployed.stdout, deployed.stdout
            assert deployed.stdout.count("successfully created") == len(names), deployed.stdout

            # scaled out as tests/test_demo_learns.py's second run was: rewards on the cluster's actors, SFT and the
            # round on 2 torchrun processes (the learning itself: one process there; 2 equal 1: test_distributed)
            overrides = {**TINY, "artifacts_dir": str(run_artifacts), "score.backend": "ray",
                         "score.reward_num_workers": 2, "train.num_processes": 2}
            ran = prefect(["deployment", "run", "posttrain/quickstart-ray", "--param",
                           f"overrides={json.dumps(overrides)}", "--param", "quiet=true", "--watch",
                           "--watch-timeout", "420"], server, tmp_path, timeout_s=450)
            assert "Flow run finished successfully in 'Completed'" in ran.stdout, ran.stdout

            dep, runs, tasks = asyncio.run(read_run(server.api_url, "posttrain/quickstart-ray"))
            assert dep.work_pool_name == "posttrain" and dep.job_variables == {"env": {"RAY_ADDRESS": address}}
            assert dep.entrypoint == "flows.pipeline.posttrain_pipeline"
            assert dep.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
            assert len(runs) == 1 and runs[0].state.is_completed(), runs
            assert runs[0].parameters["config_path"] == "configs/quickstart.yaml"
            assert runs[0].parameters["overrides"]["grpo.rounds"] == 1

            # every stage is a task run of that flow run; untemplated task names get Prefect's random suffix
            names = {t.name for t in tasks}
            assert all(t.state.is_completed() for t in tasks), [(t.name, t.state.name) for t in tasks]
            assert {"eval-base", "rollout-r0", "score-r0", "optimize-r0", "eval-final"} <= names, names
            for stage in ("demo_data", "transform", "base_model", "sft", "export"):
                assert any(n == stage or n.startswith(f"{stage}-") for n in names), (stage, names)
            assert len(tasks) == 10, names

            # the run wrote where the overrides said (the worker's folder is the project, per the pull step)
            summary = json.loads(next((run_artifacts / "runs").glob("deploy-tiny-*/summary.json")).read_text())
            assert Path(summary["exported_model"]).is_relative_to(run_artifacts)
            assert not list((ROOT / "artifacts" / "runs").glob("deploy-tiny-*"))

            assert server.stop() == 0, server.output()[-5000:]
            assert "stopping the worker and the server" in server.output()
            with socket.socket() as probe:
                assert probe.connect_ex(("127.0.0.1", server.port)) != 0, "the Prefect server still answers"
        finally:
            server.stop()

    # the score stage ran on the cluster: two actors, one on each node
    client = MlflowClient(tracking_uri=f"sqlite:///{run_artifacts / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("deploy-tiny")
    (score_run,) = client.search_runs([experiment.experiment_id], "tags.`posttrain.stage` = 'score r0'")
    assert score_run.data.metrics["workers/ray_nodes"] == 2, score_run.data.metrics
    assert score_run.data.metrics["workers/count"] == 2
    for stage in ("sft", "optimize r0"):  # and the training stages on two processes
        (trained,) = client.search_runs([experiment.experiment_id], f"tags.`posttrain.stage` = '{stage}'")
        assert trained.data.metrics["num_processes"] == 2, (stage, trained.data.metrics)

    assert not cluster.processes_in_home(home), "Ray, Prefect or flow-run processes are still running"
    assert not cluster.processes_with_env(f"PREFECT_API_URL={server.api_url}")
    print(f"work pools test: {time.monotonic() - started:.0f} s")
