"""Scheduled and triggered retraining: a data registry, champion/challenger promotion, deployments.

  posttrain data add FILE [--config CONFIG] [--emit]      register a training data version, announce it
  posttrain data list [--config CONFIG]                   the registered versions, newest first
  posttrain data watch [--config CONFIG] [--once]         register files dropped into `data.inbox`
  posttrain deploy CONFIG [--name N] [--pool posttrain]   a deployment with the config's schedule and data trigger

(or `python -m flows.retrain data add ...`, `python -m flows.retrain deploy ...`).

**Data versions.** `data add` copies a file (jsonl, json, parquet, csv, in the config's transform format)
into <artifacts_dir>/data/<name>/<sha256[:12]>/ with a `_manifest.json` (version, sha256, rows, source,
time); the same content is the same version, added once. A new version is announced with the Prefect
event `posttrain.data.added` (resource `posttrain.data.<name>`, label `posttrain.data.version`). A run
with `data.version: <version>` (or `latest`) trains on those rows in place of the config's train split and
evaluates on the config's own eval split, so every version is measured on the same held-out prompts.

**Deployments.** `deploy` registers `flows.pipeline.posttrain_pipeline` (a module path) for the config on a process
work pool, run in the folder `deploy` was called from (like prefect.yaml), with the config's `schedule` as a cron
schedule and a DeploymentEventTrigger: each `posttrain.data.added` event for the config's name starts a
run with `overrides: {"data.version": <the event's version>}`.

**Champion/challenger.** After a run's final eval, its registered model version gets the MLflow alias
`champion` when its eval accuracy beats the constant baseline (what always giving the most common answer scores,
by the same verifier: a model at accuracy 0.0 never becomes champion) and either no version has the alias yet or
its `promotion.metric` is >= the champion's + `promotion.min_gain`, both measured on this run's held-out prompts
(the champion's eval is a cached stage when this pipeline produced it); otherwise the alias `challenger`. The
reason is the run's tag `promotion` (and `promotion.refused_by`: constant_baseline or champion, when it was not
promoted), the version's tag `promotion`, summary.json's `promotion`, and a printed line. With
`promotion.start_from_champion`, the rounds start from the champion's exported model instead of the
SFT output.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import shutil
import sys
import time
from pathlib import Path

POOL = "posttrain"
DATA_EVENT = "posttrain.data.added"
ENTRYPOINT = "flows.pipeline.posttrain_pipeline"  # a module path: the flow is found wherever posttrain is installed
VERSION_CHARS = 12  # sha256 prefix that names a data version


class RetrainError(ValueError):
    """A data file, data version or deployment request that cannot be honoured; the message is for people."""


def data_resource(name: str) -> str:
    """The Prefect resource id of a config's data: what `data add` emits and a deployment's trigger matches."""
    return f"posttrain.data.{name}"


# --------------------------------------------------------------------------------------------- data registry


def _data_store(cfg):
    from tasks.store import ArtifactStore

    return ArtifactStore(Path(cfg.artifacts_dir).resolve()), f"data/{cfg.name}"


def _record(artifact) -> dict:
    summary = artifact.manifest["summary"]
    return {**summary, "path": str(artifact.file(summary["file"])), "folder": str(artifact.path),
            "created_at": artifact.manifest["created_at"]}


def list_data(cfg) -> list[dict]:
    """The config name's registered data versions, newest first."""
    store, stage = _data_store(cfg)
    folder = store.root / stage
    found = [store.get(stage, p.name) for p in folder.iterdir()
             if p.is_dir() and not p.name.startswith(".")] if folder.is_dir() else []
    return sorted((_record(a) for a in found if a is not None), key=lambda r: r["added_at"], reverse=True)


def add_data(cfg, file: str | Path) -> tuple[dict, bool]:
    """Register a data file as a version of the config name's training data: (record, newly added).

    The rows are read and put through the config's transform first, so a file that could not train
    fails here, naming the row, not hours later in a scheduled run."""
    from stages.data import sources, transform
    from tasks.store import sha256_file

    file = Path(file)
    if not file.is_file():
        raise RetrainError(f"data add: {file} is not a file")
    if file.suffix.lower() not in sources.SUFFIXES:
        raise RetrainError(f"data add: {file} has suffix {file.suffix!r}; use one of {', '.join(sources.SUFFIXES)}")
    digest = sha256_file(file)
    version = digest[:VERSION_CHARS]
    store, stage = _data_store(cfg)
    found = store.get(stage, version)
    if found is not None:
        return _record(found), False
    try:
        rows = transform.read_rows(file)
        if not rows:
            raise RetrainError(f"data add: {file} has no rows")
        transform.transform_rows(cfg.transform, rows, "train", str(file))
    except (transform.BadRowError, ValueError, TypeError) as e:
        if isinstance(e, RetrainError):
            raise
        raise RetrainError(f"data add: {e} (transform.type {cfg.transform.type!r} of the config)") from None

    def produce(out: Path) -> dict:
        shutil.copy2(file, out / file.name)
        return {"version": version, "sha256": digest, "rows": len(rows), "file": file.name,
                "source": str(file.resolve()), "name": cfg.name, "added_at": time.time()}

    artifact = store.write(stage, version, produce, inputs={},
                           config={"name": cfg.name, "transform": cfg.transform.model_dump(mode="json")})
    return _record(artifact), True


def resolve_data_version(cfg) -> dict | None:
    """The record of `data.version` (a version, or `latest`); None when unset, or `latest` with none yet."""
    wanted = cfg.data.version
    if not wanted:
        return None
    versions = list_data(cfg)
    if wanted == "latest":
        return versions[0] if versions else None
    matches = [r for r in versions if r["version"].startswith(wanted)]
    if len(matches) != 1:
        store, stage = _data_store(cfg)
        known = ", ".join(r["version"] for r in versions[:5]) or "none"
        what = "matches several versions" if matches else "is not registered"
        raise RetrainError(f"data.version {wanted!r} {what} under {store.root / stage} (newest: {known}); "
                           f"register data with `posttrain data add FILE --config <this config>`")
    return matches[0]


def emit_data_added(cfg, record: dict) -> str | None:
    """Announce a data version with the Prefect event `posttrain.data.added`; the event id, or None when no
    Prefect server is configured (PREFECT_API_URL unset: nothing could be listening)."""
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        return None
    event = emit_event(
        DATA_EVENT,
        resource={"prefect.resource.id": data_resource(cfg.name), "prefect.resource.name": cfg.name,
                  "posttrain.data.version": record["version"]},
        payload={k: record[k] for k in ("version", "sha256", "rows", "path", "source")},
    )
    EventsWorker.instance().drain()  # sent before this process moves on (or exits)
    return str(event.id) if event is not None else None


def announce(cfg, record: dict, again: bool = False) -> str | None:
    """Announce a data version (emit_data_added) unless it was announced before (`again`: announce anyway).
    The event id is kept in <data store>/.announced/<version>, so a version registered by a `data add` that
    was killed before it could announce it is announced by the next add of the same file."""
    store, stage = _data_store(cfg)
    marker = store.root / stage / ".announced" / record["version"]
    if marker.exists() and not again:
        return None
    event = emit_data_added(cfg, record)
    if event:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(event)
    return event


def watch_inbox(cfg, interval_s: float = 10.0, settle_s: float = 2.0, once: bool = False, emit: bool = True,
                log=print) -> list[dict]:
    """Poll `data.inbox`: register each data file that has not changed for settle_s seconds, announce new
    versions, move the file into <inbox>/registered/ (or <inbox>/rejected/ with a .error.txt beside it)."""
    from stages.data.sources import SUFFIXES

    if not cfg.data.inbox:
        raise RetrainError("data watch: the config has no data.inbox folder; set `data: {inbox: path/to/folder}`")
    inbox = Path(cfg.data.inbox)
    inbox.mkdir(parents=True, exist_ok=True)
    done, rejected = inbox / "registered", inbox / "rejected"
    added: list[dict] = []
    log(f"posttrain data watch: polling {inbox.resolve()} every {interval_s:g} s for {', '.join(SUFFIXES)} files")
    while True:
        for file in sorted(p for p in inbox.iterdir() if p.is_file() and not p.name.startswith(".")):
            if file.suffix.lower() not in SUFFIXES or time.time() - file.stat().st_mtime < settle_s:
                continue
            try:
                record, new = add_data(cfg, file)
            except RetrainError as e:
                rejected.mkdir(exist_ok=True)
                shutil.move(str(file), rejected / file.name)
                (rejected / f"{file.name}.error.txt").write_text(f"{e}\n")
                log(f"rejected {file.name}: {e}")
                continue
            done.mkdir(exist_ok=True)
            target = done / file.name
            shutil.move(str(file), target if not target.exists() else done / f"{record['version']}-{file.name}")
            event = announce(cfg, record) if emit else None
            log(_added_line(record, new, event))
            added.append(record)
        if once:
            return added
        time.sleep(interval_s)


def _added_line(record: dict, new: bool, event: str | None) -> str:
    head = (f"data version {record['version']} ({record['rows']} rows) "
            + ("registered at " if new else "already registered at ") + record["folder"])
    if event:
        return f"{head}; announced as event {DATA_EVENT} (id {event})"
    if new:
        return f"{head}; no event sent: no Prefect server configured (set PREFECT_API_URL)"
    return f"{head}; no event sent (pass --emit to announce it again)"


# ----------------------------------------------------------------------------------- inside a pipeline run


def data_version_prompts(ctx, parent: str, raw, prompts):
    """With `data.version`: the prompts artifact whose train split is that version's rows and whose eval
    split is the config's own (the fixed held-out set); else `prompts` unchanged. Tags the parent run."""
    from stages.data.demo_data import SPLITS
    from stages.data.sources import DatasetSource
    from tasks.stage_tasks import transform_task

    cfg = ctx.config
    record = resolve_data_version(cfg)
    if record is None:
        if cfg.data.version:
            ctx.lineage.set_tags(parent, {"data_version": "none registered yet: the config's own data"})
        return prompts
    split = cfg.eval.split
    if cfg.transform.datasets:  # the version's rows replace the train sources; test_datasets stay the eval split
        if not cfg.transform.test_datasets or split != "eval":
            raise RetrainError("data.version with transform.datasets needs the held-out rows as "
                               "transform.test_datasets and eval.split: eval (transform.val_set_size draws them "
                               "from the train sources, which the version's rows replace)")
        source = DatasetSource(path=record["path"])  # its rows go through transform.type, as with paths
        update = {"datasets": [source]}
    else:
        sources = (dict(cfg.transform.paths) if cfg.transform.paths
                   else {s: str(raw.file(f"{s}.parquet")) for s in SPLITS})
        if split == "train" or split not in sources:
            raise RetrainError(f"data.version: the held-out split eval.split={split!r} must be a split of the "
                               f"config's own data other than train (has: {', '.join(sources)})")
        update = {"paths": {"train": record["path"], **{s: sources[s] for s in (split, "eval") if s in sources}}}
    local = copy.copy(ctx)  # the same run, with the version's rows as the train split
    local.config = cfg.model_copy(update={"transform": cfg.transform.model_copy(update=update)})
    ctx.lineage.set_tags(parent, {"data_version": record["version"], "data_path": record["path"]})
    return transform_task(local, None)


def champion_artifact(ctx, version):
    """The champion's exported model as an artifact: its export folder in this store when this pipeline
    produced it here (tag `exported_model` of its run), else the registered files downloaded once into
    <artifacts>/registry/<key>/."""
    from tasks.store import ArtifactStore

    store: ArtifactStore = ctx.store
    exported = ctx.lineage.client.get_run(version.run_id).data.tags.get("exported_model") if version.run_id else None
    if exported and Path(exported).parent == store.root / "export":
        found = store.get("export", Path(exported).name)
        if found is not None:
            return found
    key = hashlib.sha256(f"{version.name}:{version.version}:{version.source}".encode()).hexdigest()[:20]
    found = store.get("registry", key)
    if found is not None:
        return found

    def produce(out: Path) -> dict:
        from mlflow.artifacts import download_artifacts

        got = Path(download_artifacts(artifact_uri=version.source, dst_path=str(out), tracking_uri=ctx.lineage.uri))
        if got.resolve() != out.resolve():
            for item in got.iterdir():
                shutil.move(str(item), out / item.name)
            got.rmdir()
        return {"model": version.name, "version": version.version, "run_id": version.run_id}

    return store.write("registry", key, produce, inputs={},
                       config={"model": version.name, "version": version.version, "source": version.source})


def starting_policy(ctx, parent: str):
    """With `promotion.start_from_champion` and a champion: its exported model (an artifact), else None."""
    cfg = ctx.config
    if not cfg.promotion.start_from_champion:
        return None
    name = cfg.export.model_name
    champion = ctx.lineage.version_by_alias(name, "champion")
    if champion is None:
        ctx.lineage.set_tags(parent, {"start_policy": f"sft output (no champion of {name} yet)"})
        return None
    artifact = champion_artifact(ctx, champion)
    ctx.lineage.set_tags(parent, {"start_policy": f"champion {name}/{champion.version}",
                                  "start_model": str(artifact.path)})
    return artifact


def promote(ctx, parent: str, version: str, exported, final_eval, prompts, evaluate=None) -> dict:
    """Give the run's registered version the alias `champion` or `challenger`; return what and why.
    `evaluate`: the eval task the final eval was (flows/recipes `evaluator`; None: eval_task), so the champion
    is measured the same way."""
    from tasks.stage_tasks import eval_task

    evaluate = evaluate or eval_task

    cfg, name = ctx.config.promotion, ctx.config.export.model_name
    key = cfg.metric.removeprefix("eval/")
    summary = final_eval.manifest["summary"]
    value = float(summary[key])
    n = summary.get("num_prompts")
    result = {"model": name, "version": str(version), "metric": cfg.metric, "value": value, "min_gain": cfg.min_gain,
              "champion_version": None, "champion_value": None, "constant_baseline": summary.get("constant_baseline")}
    below = below_baseline(summary)
    champion = None if below else ctx.lineage.version_by_alias(name, "champion")
    if below:  # never champion, whatever the champion scores
        alias = "challenger"
        reason = f"{name} v{version} is not promoted: {below}, on this run's {n} held-out prompts"
    elif champion is None:
        alias = "champion"
        reason = f"{name} v{version} becomes champion: the first version to be ranked ({cfg.metric} {value:.4f})"
    else:
        source = champion_artifact(ctx, champion)
        if (source.stage, source.key) == (exported.stage, exported.key):  # the very same model: same numbers
            champion_value = value
        else:
            champion_value = float(evaluate(ctx, source, prompts, label="champion").manifest["summary"][key])
        better = value >= champion_value + cfg.min_gain
        alias = "champion" if better else "challenger"
        reason = (f"{name} v{version} {'becomes champion' if better else 'stays challenger'}: {cfg.metric} "
                  f"{value:.4f} {'>=' if better else '<'} champion v{champion.version}'s {champion_value:.4f} "
                  f"+ min_gain {cfg.min_gain:g}, both on this run's {n} held-out prompts")
        result.update(champion_version=str(champion.version), champion_value=champion_value)
        ctx.lineage.log_metrics(parent, {"promotion/champion_value": champion_value,
                                         "promotion/gain": value - champion_value})
        if better:
            ctx.lineage.set_alias(name, "previous_champion", champion.version)
    refused_by = "constant_baseline" if below else None if alias == "champion" else "champion"
    tags = {"promotion": reason, "promotion.alias": alias, **({"promotion.refused_by": refused_by} if refused_by else {})}
    ctx.lineage.set_alias(name, alias, version, tags=tags)
    ctx.lineage.set_tags(parent, tags)
    return {**result, "alias": alias, "reason": reason, "refused_by": refused_by}


def not_ranked(ctx, parent: str, version: str, why: str) -> dict:
    """A run without a prompt eval: its registered version gets no alias (promotion.metric, measured on the eval
    split's prompts, is not measured); the promotion entry and the parent's tags say why (`why`)."""
    name = ctx.config.export.model_name
    reason = (f"{name} v{version} is registered but not ranked: {ctx.config.promotion.metric} on held-out prompts "
              f"ranks versions, and this run measures none ({why})")
    ctx.lineage.set_tags(parent, {"promotion": reason, "promotion.alias": "none"})
    return {"model": name, "version": str(version), "metric": ctx.config.promotion.metric, "value": None,
            "min_gain": ctx.config.promotion.min_gain, "champion_version": None, "champion_value": None,
            "constant_baseline": None, "alias": None, "reason": reason, "refused_by": "no_eval_split"}


def below_baseline(summary: dict) -> str | None:
    """Why an eval's model may not become champion, or None when it may: its accuracy must beat the constant
    baseline (the best a constant answer scores on the same prompts by the same verifier), and so be above 0.
    Whatever promotion.metric is: a model no better than a constant answer has not learned the task."""
    accuracy, baseline = float(summary["accuracy"]), summary.get("constant_baseline")
    if baseline is None:  # an eval without one (written before it existed): at least not 0
        return None if accuracy > 0 else f"eval/accuracy {accuracy:.4f} is 0"
    if accuracy > baseline:
        return None
    answer = summary.get("baseline_answer")
    return (f"eval/accuracy {accuracy:.4f} does not beat the constant baseline {float(baseline):.4f}"
            + (f" (always answering {answer!r})" if answer is not None else "")
            + "; a model no better than a constant answer never becomes champion")


# ---------------------------------------------------------------------------------------------- deployment


def deploy(config_path: str | Path, name: str | None = None, pool: str = POOL) -> dict:
    """Register (create or update) the config's deployment against the configured Prefect server, with
    its cron schedule and its data trigger; return what was registered."""
    cfg = _config(str(config_path))
    from prefect import flow
    from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger
    from prefect.schedules import Cron
    from prefect.settings import get_current_settings

    api = get_current_settings().api.url
    if not api:
        raise RetrainError("deploy: no Prefect server configured; start one (`posttrain server`) and set "
                           "PREFECT_API_URL, e.g. http://127.0.0.1:4200/api")
    folder = Path.cwd()  # the flow runs here (the deployment's pull step), as `posttrain run` would
    path = Path(config_path).resolve()
    config_param = str(path.relative_to(folder)) if path.is_relative_to(folder) else str(path)
    deployment = name or f"{cfg.name}-retrain"
    schedules = [Cron(cfg.schedule.cron, timezone=cfg.schedule.timezone)] if cfg.schedule else []
    trigger = DeploymentEventTrigger(
        name=f"{deployment}: new {cfg.name} data",
        description=f"`posttrain data add ... --config {config_param}` registered a data version: train on it",
        expect={DATA_EVENT},
        match={"prefect.resource.id": data_resource(cfg.name)},
        parameters={"config_path": config_param,
                    "overrides": {"data.version": "{{ event.resource['posttrain.data.version'] }}"}},
    )
    when = f"cron {cfg.schedule.cron!r} ({cfg.schedule.timezone}) and " if cfg.schedule else ""
    try:
        deployment_id = flow.from_source(str(folder), ENTRYPOINT).deploy(
            name=deployment, work_pool_name=pool, schedules=schedules, triggers=[trigger],
            parameters={"config_path": config_param, "overrides": {}},
            description=f"Retraining for {config_param}: {when}on every {DATA_EVENT} event for "
                        f"{data_resource(cfg.name)}.",
            tags=["posttrain", "retrain", cfg.rl], print_next_steps=False, ignore_warnings=True,
        )
    except ValueError as e:  # e.g. no such work pool
        raise RetrainError(f"deploy: {e} (`posttrain server --pool {pool}` starts a server with that process "
                           "pool and a worker)") from None
    return {"deployment": f"posttrain/{deployment}", "id": str(deployment_id), "pool": pool, "api": api,
            "config_path": config_param, "schedule": cfg.schedule.model_dump() if cfg.schedule else None,
            "trigger": {"event": DATA_EVENT, "resource": data_resource(cfg.name)}}


# --------------------------------------------------------------------------------------------- command line


def add_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`posttrain data add|list|watch` (shared by flows/cli.py and `python -m flows.retrain`)."""
    actions = parser.add_subparsers(dest="data_action", required=True)
    for action, help_text in (("add", "register a data file as a training data version and announce it"),
                              ("list", "the registered data versions, newest first"),
                              ("watch", "poll data.inbox and register every data file dropped there")):
        p = actions.add_parser(action, help=help_text)
        if action == "add":
            p.add_argument("file", help="jsonl, json, parquet or csv rows in the config's transform format")
            p.add_argument("--emit", action="store_true",
                           help="announce the version even when it was registered before")
        p.add_argument("--config", default="configs/quickstart.yaml",
                       help="the config the data is for: its name, artifacts_dir and transform "
                            "(default: configs/quickstart.yaml)")
        if action == "watch":
            p.add_argument("--interval", type=float, default=10.0, help="seconds between polls (default 10)")
            p.add_argument("--settle", type=float, default=2.0,
                           help="a file is taken once unmodified for this many seconds (default 2)")
            p.add_argument("--once", action="store_true", help="one poll, then exit")
    return parser


def add_deploy_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("config", help="YAML config, e.g. configs/quickstart.yaml (its schedule, name, data)")
    parser.add_argument("--name", default=None, help="deployment name (default: <config name>-retrain)")
    parser.add_argument("--pool", default=POOL, help=f"process work pool (default {POOL}; `posttrain server` makes it)")
    return parser


def _config(path: str):
    from flows.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        raise RetrainError(f"config error:\n{e}") from None


def data_command(args: argparse.Namespace) -> int:
    try:
        cfg = _config(args.config)
        if args.data_action == "list":
            versions = list_data(cfg)
            for r in versions:
                print(f"{r['version']}  {r['rows']:>7} rows  {r['created_at']}  {r['path']}  (from {r['source']})")
            if not versions:
                print(f"no data registered for {cfg.name!r}; "
                      f"add some with `posttrain data add FILE --config {args.config}`")
        elif args.data_action == "add":
            record, new = add_data(cfg, args.file)
            event = announce(cfg, record, again=args.emit)
            print(_added_line(record, new, event))
        else:
            try:
                watch_inbox(cfg, args.interval, args.settle, once=args.once)
            except KeyboardInterrupt:
                pass
    except RetrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def deploy_command(args: argparse.Namespace) -> int:
    try:
        done = deploy(args.config, args.name, args.pool)
    except RetrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    schedule = done["schedule"]
    when = f"cron {schedule['cron']!r} ({schedule['timezone']})" if schedule else "none (no `schedule:` in the config)"
    print(f"deployment {done['deployment']} (id {done['id']}) on pool {done['pool']!r} at {done['api']}\n"
          f"  runs: {done['config_path']}\n"
          f"  schedule: {when}\n"
          f"  trigger: each {DATA_EVENT} event for {done['trigger']['resource']} runs it with "
          "overrides {\"data.version\": <the event's version>}\n"
          f"  needs a worker on the pool: `posttrain server` (or `prefect worker start --pool {done['pool']}`)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.retrain data ...` / `python -m flows.retrain deploy ...`."""
    parser = argparse.ArgumentParser(prog="posttrain", description="Data versions and retraining deployments.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_data_arguments(sub.add_parser("data", help="registered training data versions"))
    add_deploy_arguments(sub.add_parser("deploy", help="deploy a config with its schedule and data trigger"))
    args = parser.parse_args(argv)
    return data_command(args) if args.command == "data" else deploy_command(args)


if __name__ == "__main__":
    sys.exit(main())
