"""Scheduled and triggered retraining (flows/retrain.py) on a real MLflow sqlite store and the session's
Prefect test harness: champion/challenger aliases after each run's final eval, retraining from the
champion on a registered data version, `data add` (content-addressed, idempotent, a Prefect event), and
`deploy` (cron schedule + a data trigger that really starts a run of the deployment)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from tasks.store import MANIFEST


def rows_file(path: Path, n: int, seed: int) -> Path:
    """Fresh question/answer rows of the demo task (the config's question_answer transform reads them)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        numbers = [rng.randint(0, 9) for _ in range(5)]
        lines.append(json.dumps({"question": f"Which is the largest of {', '.join(map(str, numbers))}?",
                                 "answer": str(max(numbers))}))
    path.write_text("\n".join(lines) + "\n")
    return path


def read_events(resource_id: str, timeout_s: float = 30.0, at_least: int = 1) -> list:
    """posttrain.data.added events of a resource, as the Prefect server stored them (it persists in batches):
    once there are `at_least`, or what there is after timeout_s."""
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    wanted = EventFilter(event=EventNameFilter(name=["posttrain.data.added"]),
                         resource=EventResourceFilter(id=[resource_id]))
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            events = client.read_events(filter=wanted, limit=50).events  # the API's own maximum page size
        if len(events) >= at_least or time.monotonic() > deadline:
            return events
        time.sleep(1.0)


@pytest.mark.slow
def test_champion_challenger_then_retrain_from_champion_on_new_data(prefect_harness, tiny_config, tmp_path, capsys,
                                                                    monkeypatch):
    from flows import retrain
    from flows.config import load_config
    from flows.pipeline import posttrain_pipeline

    root = tmp_path / "artifacts"
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    champion = lambda: str(client.get_model_version_by_alias("test-tiny", "champion").version)  # noqa: E731

    # issue 44: the tiny model does not learn the task (eval accuracy 0.0): registered, never champion, even as
    # the first version, and the run says why (a line, the `promotion` and `promotion.refused_by` tags)
    zero = posttrain_pipeline(str(tiny_config), ["grpo.rounds=1"])
    assert zero["final_accuracy"] <= zero["constant_baseline"]
    refused = zero["promotion"]
    assert refused["alias"] == "challenger" and refused["refused_by"] == "constant_baseline"
    assert (f"test-tiny v1 is not promoted: eval/accuracy {zero['final_accuracy']:.4f} does not beat the constant "
            f"baseline {zero['constant_baseline']:.4f}") in refused["reason"]
    assert f"promotion: {refused['reason']}" in capsys.readouterr().out
    tags = client.get_run(zero["mlflow_run_id"]).data.tags
    assert tags["promotion"] == refused["reason"] and tags["promotion.refused_by"] == "constant_baseline"
    with pytest.raises(Exception, match="champion"):
        champion()

    # the champion/challenger rules below, on this model that does not learn: its baseline check passed by hand
    monkeypatch.setattr(retrain, "below_baseline", lambda summary: None)

    # the first ranked version becomes champion
    first = posttrain_pipeline(str(tiny_config), ["grpo.rounds=1"])
    assert first["promotion"]["alias"] == "champion" and "first" in first["promotion"]["reason"]
    assert champion() == str(first["registered_model_version"]) == first["promotion"]["version"] == "2"
    assert f"promotion: {first['promotion']['reason']}" in capsys.readouterr().out
    run = client.get_run(first["mlflow_run_id"])
    assert run.data.tags["promotion"] == first["promotion"]["reason"]
    summary = json.loads((root / "runs" / first["run_name"] / "summary.json").read_text())
    assert summary["promotion"]["alias"] == "champion"

    # not better by min_gain: challenger, and the run says why; the champion stays
    second = posttrain_pipeline(str(tiny_config), ["grpo.rounds=1", "promotion.min_gain=0.5"], quiet=True)
    assert [r["status"] for r in second["stages"]] == ["cached"] * len(second["stages"])
    promotion = second["promotion"]
    assert promotion["alias"] == "challenger" and promotion["champion_version"] == "2"
    assert promotion["champion_value"] == first["final_accuracy"] == promotion["value"]
    assert "stays challenger" in promotion["reason"] and "< champion v2's" in promotion["reason"]
    assert promotion["refused_by"] == "champion"
    assert client.get_run(second["mlflow_run_id"]).data.tags["promotion"] == promotion["reason"]
    assert str(client.get_model_version_by_alias("test-tiny", "challenger").version) == promotion["version"] == "3"
    assert champion() == "2"

    # min_gain -1: better by the rule, so champion (the old one is kept as previous_champion)
    third = posttrain_pipeline(str(tiny_config), ["grpo.rounds=1", "promotion.min_gain=-1.0"], quiet=True)
    assert third["promotion"]["alias"] == "champion" and "becomes champion" in third["promotion"]["reason"]
    assert champion() == third["promotion"]["version"] == "4"
    assert str(client.get_model_version_by_alias("test-tiny", "previous_champion").version) == "2"
    assert client.get_model_version("test-tiny", "4").tags["promotion"] == third["promotion"]["reason"]

    # new data: registered once, however often it is added
    cfg = load_config(tiny_config)
    data = rows_file(tmp_path / "new.jsonl", 32, seed=7)
    record, new = retrain.add_data(cfg, data)
    again, new_again = retrain.add_data(cfg, data)
    assert new and not new_again and again["version"] == record["version"] and record["rows"] == 32

    # retraining: starts from the champion's exported model, trains on the new version, same held-out set
    overrides = ["grpo.rounds=1", "promotion.start_from_champion=true", f"data.version={record['version']}"]
    fourth = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    stages = {row["stage"]: row for row in fourth["stages"]}
    assert "sft" not in stages  # the champion replaces the SFT policy
    rollout = json.loads((Path(stages["rollout r0"]["path"]) / MANIFEST).read_text())
    assert rollout["inputs"]["policy"] == f"export/{Path(third['exported_model']).name}"
    prompts_key = rollout["inputs"]["prompts"]
    transformed = pq.read_table(root / prompts_key / "train.parquet").to_pylist()
    assert len(transformed) == 32 and transformed[0]["answer"] == json.loads(data.read_text().splitlines()[0])["answer"]
    heldout = root / prompts_key / "eval.parquet"
    first_heldout = next(p for p in (root / "transform").iterdir() if p.name != Path(prompts_key).name) / "eval.parquet"
    assert pq.read_table(heldout).equals(pq.read_table(first_heldout))  # the same held-out prompts
    tags = client.get_run(fourth["mlflow_run_id"]).data.tags
    assert tags["data_version"] == record["version"] and tags["start_policy"] == "champion test-tiny/4"
    # the champion was measured on this run's held-out prompts: its eval is this run's base eval (cached)
    assert fourth["promotion"]["champion_version"] == "4"
    assert fourth["promotion"]["champion_value"] == fourth["base_accuracy"]
    assert stages["eval champion"]["status"] == "cached"
    assert fourth["promotion"]["alias"] in ("champion", "challenger")
    expected = "champion" if fourth["final_accuracy"] >= fourth["base_accuracy"] else "challenger"
    assert fourth["promotion"]["alias"] == expected

    # a champion whose export folder is not in this artifacts folder comes from the registry, downloaded once
    from types import SimpleNamespace

    from tasks.lineage import Lineage
    from tasks.store import ArtifactStore

    elsewhere = SimpleNamespace(store=ArtifactStore(tmp_path / "elsewhere"), lineage=Lineage(root, "test-tiny"))
    version = elsewhere.lineage.version_by_alias("test-tiny", "champion")
    downloaded = retrain.champion_artifact(elsewhere, version)
    assert downloaded.stage == "registry" and downloaded.path.parent == tmp_path / "elsewhere" / "registry"
    exported = Path(client.get_run(version.run_id).data.tags["exported_model"])
    assert (downloaded.file("model.safetensors").read_bytes() == (exported / "model.safetensors").read_bytes())
    assert retrain.champion_artifact(elsewhere, version).path == downloaded.path  # found, not fetched again


def test_configs_without_a_model_name_register_models_of_their_own(prefect_harness, tiny_config, tmp_path,
                                                                  monkeypatch):
    """export.model_name defaults to the config's name: two configs in one artifacts folder register two
    models, and the second config's first version is its own champion, never a challenger of the other's."""
    from flows import retrain
    from flows.pipeline import posttrain_pipeline

    monkeypatch.setattr(retrain, "below_baseline", lambda summary: None)  # the tiny model does not beat it

    text = tiny_config.read_text()
    assert "export: {model_name: test-tiny}\n" in text
    text = text.replace("export: {model_name: test-tiny}\n", "")
    alpha, beta = tmp_path / "alpha.yaml", tmp_path / "beta.yaml"
    alpha.write_text(text.replace("name: test-tiny", "name: alpha-tiny"))
    beta.write_text(text.replace("name: test-tiny", "name: beta-tiny"))
    first = posttrain_pipeline(str(alpha), ["grpo.rounds=1"], quiet=True)
    second = posttrain_pipeline(str(beta), ["grpo.rounds=1", "promotion.min_gain=0.5"], quiet=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'artifacts' / 'mlflow.db'}")
    assert {m.name for m in client.search_registered_models()} == {"alpha-tiny", "beta-tiny"}
    assert first["promotion"]["model"] == "alpha-tiny" and second["promotion"]["model"] == "beta-tiny"
    assert first["promotion"]["alias"] == second["promotion"]["alias"] == "champion", second["promotion"]


def test_data_add_is_content_addressed_idempotent_and_announced(prefect_harness, tiny_config, tmp_path, capsys):
    from flows import retrain

    data = rows_file(tmp_path / "batch.jsonl", 12, seed=1)
    args = ["data", "add", str(data), "--config", str(tiny_config)]
    assert retrain.main(args) == 0
    first = capsys.readouterr().out
    assert retrain.main(args) == 0
    second = capsys.readouterr().out
    version = __import__("hashlib").sha256(data.read_bytes()).hexdigest()[:12]
    folder = tmp_path / "artifacts" / "data" / "test-tiny" / version
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, "batch.jsonl"]
    summary = json.loads((folder / MANIFEST).read_text())["summary"]
    assert summary["version"] == version and summary["rows"] == 12 and summary["source"] == str(data)
    assert "registered at" in first and "announced as event posttrain.data.added" in first
    assert "already registered" in second and "no event sent" in second
    assert [p.name for p in folder.parent.iterdir() if not p.name.startswith(".")] == [version]

    (event,) = read_events("posttrain.data.test-tiny")  # announced once: the second add was a no-op
    assert event.resource["posttrain.data.version"] == version
    assert event.payload["rows"] == 12 and event.payload["path"] == str(folder / "batch.jsonl")

    # a `data add` killed after registering a version, before announcing it: the next add of the file announces it
    from flows.config import load_config

    late = rows_file(tmp_path / "late.jsonl", 7, seed=3)
    retrain.add_data(load_config(tiny_config), late)  # registered, not announced: where such a kill stops
    assert retrain.main(["data", "add", str(late), "--config", str(tiny_config)]) == 0
    out = capsys.readouterr().out
    assert "already registered" in out and "announced as event posttrain.data.added" in out
    assert sorted(e.payload["rows"] for e in read_events("posttrain.data.test-tiny", at_least=2)) == [7, 12]

    # a file the transform cannot read fails at the door, naming the row
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "Which is the largest of 1, 2?"}) + "\n")
    assert retrain.main(["data", "add", str(bad), "--config", str(tiny_config)]) == 2
    assert "row 0: missing or empty field answer" in capsys.readouterr().err

    # the inbox: a dropped file is registered, announced and moved aside
    config = tmp_path / "inbox.yaml"
    config.write_text(tiny_config.read_text().replace("name: test-tiny", "name: inbox-tiny")
                      + f"data: {{inbox: {tmp_path / 'inbox'}}}\n")
    (tmp_path / "inbox").mkdir()
    dropped = rows_file(tmp_path / "inbox" / "drop.jsonl", 5, seed=2)
    assert retrain.main(["data", "watch", "--config", str(config), "--once", "--settle", "0"]) == 0
    assert (tmp_path / "inbox" / "registered" / "drop.jsonl").exists() and not dropped.exists()
    (event,) = read_events("posttrain.data.inbox-tiny")
    assert event.payload["rows"] == 5
    assert retrain.main(["data", "list", "--config", str(config)]) == 0
    assert " 5 rows" in capsys.readouterr().out


def test_deploy_has_the_cron_schedule_and_a_data_trigger_that_starts_runs(prefect_harness, tiny_config, tmp_path,
                                                                          capsys, monkeypatch):
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    from flows import retrain
    from flows.config import load_config

    config = tmp_path / "scheduled.yaml"
    config.write_text(tiny_config.read_text().replace("name: test-tiny", "name: sched-tiny")
                      + "schedule: {cron: '30 2 * * 1-5', timezone: Europe/Berlin}\n")
    monkeypatch.chdir(tmp_path)  # your own folder: the deployment runs there, the config named relative to it
    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name="posttrain-test", type="process"))
        except Exception:  # another test made it
            pass
    assert retrain.main(["deploy", str(config), "--pool", "no-such-pool"]) == 2
    assert "Could not find work pool 'no-such-pool'" in capsys.readouterr().err
    assert retrain.main(["deploy", str(config), "--pool", "posttrain-test"]) == 0
    assert "schedule: cron '30 2 * * 1-5' (Europe/Berlin)" in capsys.readouterr().out

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("posttrain/sched-tiny-retrain")
        (schedule,) = deployment.schedules
        (automation,) = client.read_resource_related_automations(f"prefect.deployment.{deployment.id}")
    assert (schedule.schedule.cron, schedule.schedule.timezone, schedule.active) == ("30 2 * * 1-5", "Europe/Berlin",
                                                                                     True)
    assert deployment.work_pool_name == "posttrain-test" and deployment.entrypoint == retrain.ENTRYPOINT
    assert deployment.parameters == {"config_path": "scheduled.yaml", "overrides": {}}
    assert deployment.pull_steps == [{"prefect.deployments.steps.set_working_directory":
                                      {"directory": str(tmp_path)}}]
    trigger = automation.trigger
    assert trigger.expect == {"posttrain.data.added"} and trigger.posture == "Reactive"
    assert trigger.match.root == {"prefect.resource.id": "posttrain.data.sched-tiny"}
    (action,) = automation.actions
    assert action.deployment_id == deployment.id
    assert action.parameters["overrides"] == {"data.version": "{{ event.resource['posttrain.data.version'] }}"}

    # redeploying updates the same deployment and automation, nothing twice
    assert retrain.main(["deploy", str(config), "--pool", "posttrain-test"]) == 0
    with get_client(sync_client=True) as client:
        assert client.read_deployment_by_name("posttrain/sched-tiny-retrain").id == deployment.id
        assert len(client.read_resource_related_automations(f"prefect.deployment.{deployment.id}")) == 1

    # the trigger is live: new data for this config starts a run of the deployment with its version
    record, _ = retrain.add_data(load_config(config), rows_file(tmp_path / "fresh.jsonl", 8, seed=3))
    assert retrain.emit_data_added(load_config(config), record)
    deadline = time.monotonic() + 60
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))
        triggered = [r for r in runs if r.parameters.get("overrides")]
        if triggered or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert [r.parameters for r in triggered] == [{"config_path": "scheduled.yaml",
                                                  "overrides": {"data.version": record["version"]}}]


def test_schedule_and_promotion_config_errors_name_the_key(tmp_path):
    from flows.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    for text, expected in (("schedule: {cron: '0 3 * *'}", "schedule.cron '0 3 * *' is not a cron expression"),
                           ("schedule: {timezone: Mars/Olympus}", "'Mars/Olympus' is not an IANA time zone"),
                           ("promotion: {metric: eval/loss}", "promotion.metric"),
                           ("promotion: {min_gian: 0.1}", "did you mean 'promotion.min_gain'"),
                           ("data: {versoin: abc}", "did you mean 'data.version'")):
        path.write_text(text + "\n")
        with pytest.raises(ConfigError, match=None) as caught:
            load_config(path)
        assert expected in str(caught.value), (text, str(caught.value))
    path.write_text("schedule: {cron: '0 3 * * *'}\n")
    cfg = load_config(path)
    assert (cfg.schedule.cron, cfg.schedule.timezone, cfg.promotion.min_gain, cfg.data.version) == (
        "0 3 * * *", "UTC", 0.0, None)
