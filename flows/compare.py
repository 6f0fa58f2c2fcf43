"""List pipeline runs and compare them side by side (`posttrain runs`, `posttrain compare`).

A pipeline run is an MLflow parent run (one without `mlflow.parentRunId`) in the store
that `tasks/lineage.py` writes; experiments are named after the config. For each run
this reads its MLflow status, times, params and metric histories, and its run folder
`<artifacts>/runs/<run name>/` (the resolved `config.yaml`, and the `stages` list of
`summary.json`: stage, status, seconds, artifact path ending in the content key).
A run that failed before writing summary.json still has one nested MLflow run per
stage it computed or read from the cache (tags `posttrain.artifact_key`, `posttrain.cached`); those stand in for
the stage list. `runs` shows each run's cost totals (parent-run `cost/*` metrics, tasks/costs.py).

Loading (`load_*`, `resolve_runs`) talks to MLflow; everything that builds rows
(`*_rows`, `format_table`) is a pure function of `RunData`, testable without a store.

  posttrain runs [--artifacts DIR] [--experiment NAME]
  posttrain compare RUN RUN... [--artifacts DIR] [--plot PATH]
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tasks.lineage import CODE_ARTIFACTS, CODE_TAG_PREFIX, flatten, process_alive, tracking_uri
from tasks.lineage_reader import PARENT_FILTER, stage_runs_filter

MISSING = "-"
CURVES = {"train/reward_mean": "reward (train/reward_mean)", "eval/accuracy": "accuracy (eval/accuracy)"}
ROUND_TIMES = ("time/generate_s", "time/score_s", "time/optimize_s", "time/waiting_s")  # logged once per round
HISTORIES = (*CURVES, *ROUND_TIMES)


class CompareError(Exception):
    """A problem the user can fix: unknown run name, no store at that path, ..."""


@dataclass
class RunData:
    """What `runs` and `compare` need of one pipeline run."""

    run_id: str
    name: str
    experiment: str
    status: str  # MLflow: RUNNING / FINISHED / FAILED / KILLED / SCHEDULED
    start_ms: int | None
    end_ms: int | None
    metrics: dict[str, float] = field(default_factory=dict)  # latest value (highest step) per metric
    histories: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> [(step, value)]
    config: dict[str, str] = field(default_factory=dict)  # flattened resolved config
    stages: list[dict] = field(default_factory=list)  # {stage, status, seconds, key, path}
    stages_source: str = ""  # "summary.json", "stages.json", "mlflow stage runs" or ""
    code: dict[str, str] = field(default_factory=dict)  # user module -> source digest (tags code.<module>)

    def wall_s(self, now_ms: int | None = None) -> float | None:
        """End minus start; a run still RUNNING counts up to now."""
        if self.start_ms is None:
            return None
        end = self.end_ms or (now_ms if self.status == "RUNNING" and now_ms else None)
        return None if end is None else max(0.0, (end - self.start_ms) / 1000)


# ---------------------------------------------------------------- formatting (pure)

def fmt_number(value: float | None) -> str:
    if value is None:
        return MISSING
    return f"{value:.0f}" if float(value).is_integer() and abs(value) >= 1000 else f"{value:.4g}"


def fmt_duration(seconds: float | None) -> str:
    """12.3s, 3m 07s, 2h 05m."""
    if seconds is None:
        return MISSING
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def fmt_time(ms: int | None) -> str:
    return MISSING if ms is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))


def format_table(header: list[str], rows: list[list[str]], indent: str = "") -> str:
    """Left-aligned plain-text columns, two spaces apart."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [indent + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------- rows (pure)

def accuracy_base_final(run: RunData) -> tuple[float | None, float | None]:
    """eval/accuracy before and after training: the summary metrics, else the step-0 / last-step values."""
    base, final = run.metrics.get("eval/accuracy_base"), run.metrics.get("eval/accuracy_final")
    history = sorted(run.histories.get("eval/accuracy", []))
    if base is None and history and history[0][0] == 0:
        base = history[0][1]
    if final is None and history and history[-1][0] > 0:
        final = history[-1][1]
    return base, final


RUNS_HEADER = ["run", "experiment", "status", "started", "wall time", "eval/accuracy base->final",
               "train/reward_mean (last)", "spent wall/CPU/GPU s", "tokens gen/trained/scored",
               "avoided wall/CPU/GPU s"]


def cost_cells(run: RunData) -> list[str]:
    """The run's cost totals (parent-run cost/* metrics, tasks/costs.py `totals_metrics`): seconds its stages
    spent, tokens they generated, trained on and scored, seconds the cache saved; '-' where not recorded."""
    def joined(prefix: str, names: tuple[str, ...]) -> str:
        values = [run.metrics.get(f"{prefix}{name}") for name in names]
        return MISSING if all(v is None for v in values) else "/".join(fmt_number(v) for v in values)

    seconds = ("wall_s", "cpu_s", "gpu_s")
    return [joined("cost/", seconds), joined("cost/", ("tokens_generated", "tokens_trained", "tokens_scored")),
            joined("cost/avoided_", seconds)]


def runs_rows(runs: list[RunData], now_ms: int | None = None) -> list[list[str]]:
    """One row per run, newest first."""
    rows = []
    for run in sorted(runs, key=lambda r: r.start_ms or 0, reverse=True):
        base, final = accuracy_base_final(run)
        accuracy = MISSING if base is None and final is None else f"{fmt_number(base)} -> {fmt_number(final)}"
        rows.append([run.name, run.experiment, run.status, fmt_time(run.start_ms), fmt_duration(run.wall_s(now_ms)),
                     accuracy, fmt_number(run.metrics.get("train/reward_mean")), *cost_cells(run)])
    return rows


def overview_rows(runs: list[RunData], now_ms: int | None = None) -> list[list[str]]:
    return [
        ["run id", *[r.run_id for r in runs]],
        ["experiment", *[r.experiment for r in runs]],
        ["status", *[r.status for r in runs]],
        ["started", *[fmt_time(r.start_ms) for r in runs]],
        ["wall time", *[fmt_duration(r.wall_s(now_ms)) for r in runs]],
    ]


def config_diff_rows(runs: list[RunData]) -> list[list[str]]:
    """Only the flattened config keys whose values are not the same in every run ('-': key absent)."""
    keys = sorted(set().union(*(r.config for r in runs)))
    rows = []
    for key in keys:
        values = [r.config.get(key, MISSING) for r in runs]
        if len(set(values)) > 1:
            rows.append([key, *values])
    return rows


def metric_rows(runs: list[RunData]) -> list[list[str]]:
    """Final (latest-step) value of every metric any run logged, timings aside; eval/ first."""
    names = set().union(*(r.metrics for r in runs))
    names = sorted((n for n in names if not n.startswith("time/")), key=lambda n: (not n.startswith("eval/"), n))
    return [[name, *[fmt_number(r.metrics.get(name)) for r in runs]] for name in names]


def _union_in_order(lists: list[list[str]]) -> list[str]:
    seen: dict[str, None] = {}
    for items in lists:
        for item in items:
            seen.setdefault(item)
    return list(seen)


def stage_time_rows(runs: list[RunData], now_ms: int | None = None) -> list[list[str]]:
    """Seconds per stage ('cached' when reused), the per-round timings summed, the rounds and total wall."""
    by_run = [{s["stage"]: s for s in r.stages} for r in runs]
    rows = []
    for stage in _union_in_order([[s["stage"] for s in r.stages] for r in runs]):
        cells = []
        for stages in by_run:
            s = stages.get(stage)
            if s is None:
                cells.append(MISSING)
            elif s["status"] == "cached":
                cells.append("cached")
            else:
                note = "" if s["status"] == "computed" else f" ({s['status']})"
                cells.append(fmt_duration(s["seconds"]) + note)
        rows.append([stage, *cells])
    for name in ROUND_TIMES:
        if any(name in r.histories for r in runs):
            rows.append([f"{name} (sum over rounds)",
                         *[fmt_duration(sum(v for _, v in r.histories[name])) if name in r.histories else MISSING
                           for r in runs]])
    if any("time/rounds_wall_s" in r.metrics for r in runs):
        rows.append(["time/rounds_wall_s", *[fmt_duration(r.metrics.get("time/rounds_wall_s")) for r in runs]])
    rows.append(["run wall time", *[fmt_duration(r.wall_s(now_ms)) for r in runs]])
    return rows


def artifact_rows(runs: list[RunData]) -> tuple[list[list[str]], list[str], list[str]]:
    """Per stage, each run's artifact content key and 'shared' / 'different':
    (rows, stages whose artifact is the same folder in every run, stages whose artifacts differ).
    Folders are compared by path; where a run knows only the key (MLflow stage runs), by key.
    A stage one run never reached is neither; its cell is '-'."""
    by_run = [{s["stage"]: s for s in r.stages} for r in runs]
    rows, shared, different = [], [], []
    for stage in _union_in_order([[s["stage"] for s in r.stages] for r in runs]):
        found = [stages.get(stage) for stages in by_run]
        keys = [s["key"] if s else MISSING for s in found]
        if any(s is None for s in found):
            verdict = "not in every run"
        elif len({s["path"] if all(f["path"] for f in found) else s["key"] for s in found}) == 1:
            verdict = "shared"
            shared.append(stage)
        else:
            verdict = "different"
            different.append(stage)
        rows.append([stage, *keys, verdict])
    return rows, shared, different


def summarize_stages(labels: list[str]) -> str:
    """Round stages folded into ranges: ["sft", "rollout r0", "rollout r1", "rollout r3"] -> "sft, rollout r0-r1, r3".

    >>> summarize_stages(["sft", "rollout r0", "score r0", "rollout r1", "rollout r3"])
    'sft, rollout r0-r1, r3, score r0'
    """
    groups: dict[str, list] = {}
    for label in labels:
        m = re.fullmatch(r"(.+) r(\d+)", label)
        if m:
            groups.setdefault(m[1], []).append(int(m[2]))
        else:
            groups.setdefault(label, None)
    parts = []
    for name, rounds in groups.items():
        if rounds is None:
            parts.append(name)
            continue
        spans, rounds = [], sorted(rounds)
        start = prev = rounds[0]
        for r in [*rounds[1:], None]:
            if r is not None and r == prev + 1:
                prev = r
                continue
            spans.append(f"r{start}" if start == prev else f"r{start}-r{prev}")
            if r is not None:
                start = prev = r
        parts.append(f"{name} {', '.join(spans)}")
    return ", ".join(parts) or "none"


def default_plot_path(artifacts_dir: Path, runs: list[RunData]) -> Path:
    name = "-vs-".join(re.sub(r"[^\w.-]+", "_", r.name) for r in runs)
    if len(name) > 150:
        name = name[:130] + "-" + hashlib.sha256(name.encode()).hexdigest()[:12]
    return Path(artifacts_dir) / f"compare-{name}.png"


def plot_curves(runs: list[RunData], path: Path) -> Path:
    """Reward per round and eval accuracy per step, one line per run, side by side; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(6 * len(CURVES), 4))
    for ax, (metric, title) in zip(axes, CURVES.items()):
        plotted = False
        for run in runs:
            points = sorted(run.histories.get(metric, []))
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], marker="o", label=run.name)
                plotted = True
        ax.set_title(title)
        ax.set_xlabel("round (step)")
        ax.grid(alpha=0.3)
        if plotted:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def compare_report(runs: list[RunData], now_ms: int | None = None) -> str:
    """The whole side-by-side text of `posttrain compare`, plot line aside."""
    names = [r.name for r in runs]
    out = ["runs", format_table(["", *names], overview_rows(runs, now_ms), indent="  "), ""]

    diff = config_diff_rows(runs)
    total = len(set().union(*(r.config for r in runs)))
    out.append(f"config: {len(diff)} of {total} keys differ")
    if diff:
        out.append(format_table(["key", *names], diff, indent="  "))
    if any(not r.config for r in runs):
        out.append("  (no config found for: " + ", ".join(r.name for r in runs if not r.config) + ")")
    out.append("")

    metrics = metric_rows(runs)
    out.append("final metrics (latest step)")
    out.append(format_table(["metric", *names], metrics, indent="  ") if metrics else "  none logged")
    out.append("")

    out.append("wall time per stage")
    out.append(format_table(["stage", *names], stage_time_rows(runs, now_ms), indent="  "))
    notes = [f"{r.name}: from MLflow stage runs (no summary.json)"
             for r in runs if r.stages_source == "mlflow stage runs"]
    notes += [f"{r.name}: no stage record" for r in runs if not r.stages]
    out += [f"  ({n})" for n in notes]
    out.append("")

    out += code_rows(runs) + [""]

    rows, shared, different = artifact_rows(runs)
    out.append("artifacts (content key per stage)")
    if rows:
        out.append(format_table(["stage", *names, "same folder?"], rows, indent="  "))
    out.append(f"  shared (reused, same folder in every run): {summarize_stages(shared)}")
    out.append(f"  different: {summarize_stages(different)}")
    return "\n".join(out)


def differing_code(runs: list[RunData]) -> list[str]:
    """User modules whose source differs between the runs (or that only some runs called)."""
    modules = sorted(set().union(*(r.code for r in runs)))
    return [m for m in modules if len({r.code.get(m) for r in runs}) > 1]


def code_rows(runs: list[RunData]) -> list[str]:
    """The user-code lines of the report: which modules' source differs (the diff follows the report)."""
    modules = sorted(set().union(*(r.code for r in runs)))
    if not modules:
        return ["user code: none logged (built-in rewards only, or runs from before it was logged)"]
    differing = differing_code(runs)
    if not differing:
        return [f"user code: the same in every run ({', '.join(modules)})"]
    return [f"user code differs: {', '.join(differing)} (unified diff below)"]


def code_diff(client, runs: list[RunData], modules: list[str]) -> str:
    """A unified diff of each differing module's source files between the first run and each other run, read from
    the runs' `code/` artifacts (tasks/lineage.py `log_code`)."""
    import difflib
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        files: list[dict[str, list[str]]] = []
        for i, run in enumerate(runs):
            sources: dict[str, list[str]] = {}
            try:
                root = Path(client.download_artifacts(run.run_id, CODE_ARTIFACTS, str(Path(tmp) / str(i))))
            except Exception:  # noqa: BLE001 - no code artifacts: an older run, or built-ins only
                root = None
            for path in sorted(root.rglob("*.py")) if root else ():
                sources[str(path.relative_to(root))] = path.read_text(errors="replace").splitlines(keepends=True)
            files.append(sources)
    wanted = [m.replace(".", "/") for m in modules]
    out = []
    for run, sources in zip(runs[1:], files[1:]):
        for name in sorted(set(files[0]) | set(sources)):
            if not any(name.startswith(w + "/") or name.removesuffix(".py") == w for w in wanted):
                continue
            out += difflib.unified_diff(files[0].get(name, []), sources.get(name, []),
                                        f"{runs[0].name}/{name}", f"{run.name}/{name}")
    return "".join(out)


# ---------------------------------------------------------------- loading (MLflow + run folders)

def open_client(artifacts_dir: str | Path):
    """A client of the store `posttrain run` writes for this artifacts folder: a sqlite one is read without
    importing MLflow (tasks/lineage_reader.py), another through MlflowClient; while runs write it, its reads wait
    for the lock and retry (tasks/lineage.py `retry_busy`)."""
    from tasks.lineage_reader import reader_or_client

    root = Path(artifacts_dir).resolve()
    uri = tracking_uri(root)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        raise CompareError(f"no MLflow store at {uri.removeprefix('sqlite:///')}: run `posttrain run CONFIG` "
                           f"first, pass --artifacts DIR (the config's artifacts_dir), or set MLFLOW_TRACKING_URI")
    return reader_or_client(uri)


def experiment_names(client) -> dict[str, str]:
    """experiment id -> name, active experiments."""
    return {e.experiment_id: e.name for e in client.search_experiments()}


def search_parent_runs(client, experiment: str | None = None) -> list:
    """MLflow parent runs (pipeline runs), newest first; optionally of one experiment (config name)."""
    experiments = experiment_names(client)
    ids = list(experiments)
    if experiment is not None:
        ids = [i for i, n in experiments.items() if n == experiment]
        if not ids:
            raise CompareError(f"no experiment named {experiment!r}; experiments: "
                               f"{', '.join(sorted(experiments.values())) or 'none'}")
    found, token = [], None
    while ids:
        page = client.search_runs(ids, filter_string=PARENT_FILTER, max_results=1000,
                                  order_by=["attributes.start_time DESC"], page_token=token)
        found += list(page)
        token = page.token
        if not token:
            break
    return found


def shown_status(run) -> str:
    """MLflow's status, except KILLED for a run still RUNNING whose process (tags posttrain.pid and posttrain.host,
    this host) is gone: a SIGKILL or a lost machine leaves no chance to end the run in MLflow."""
    tags = run.data.tags
    if (run.info.status == "RUNNING" and tags.get("posttrain.host") == socket.gethostname()
            and not process_alive(tags.get("posttrain.pid", ""))):
        return "KILLED"
    return run.info.status


def to_run_data(client, run, experiments: dict[str, str], artifacts_dir: Path, full: bool) -> RunData:
    """RunData from an MLflow run. `full`: also config, all histories and stages (for compare);
    otherwise only what the `runs` listing shows."""
    info, data = run.info, run.data
    out = RunData(run_id=info.run_id, name=info.run_name or info.run_id,
                  experiment=experiments.get(info.experiment_id, info.experiment_id), status=shown_status(run),
                  start_ms=info.start_time, end_ms=info.end_time, metrics=dict(data.metrics),
                  code={k.removeprefix(CODE_TAG_PREFIX): v for k, v in data.tags.items()
                        if k.startswith(CODE_TAG_PREFIX)})
    wanted = HISTORIES if full else (("eval/accuracy",) if "eval/accuracy_base" not in data.metrics else ())
    for key in wanted:
        if key in data.metrics:
            out.histories[key] = [(m.step, m.value) for m in client.get_metric_history(info.run_id, key)]
    if not full:
        return out
    run_dir = Path(data.tags.get("artifact_root") or Path(artifacts_dir).resolve()) / "runs" / out.name
    out.config = load_config(run_dir, data.params)
    out.stages, out.stages_source = load_stages(client, run, run_dir)
    return out


def load_config(run_dir: Path, params: dict[str, str]) -> dict[str, str]:
    """The flattened resolved config: runs/<name>/config.yaml, else the parent run's params."""
    path = run_dir / "config.yaml"
    if path.exists():
        loaded = yaml.safe_load(path.read_text())
        if isinstance(loaded, dict):
            return flatten(loaded)
    return dict(params)


def load_stages(client, run, run_dir: Path) -> tuple[list[dict], str]:
    """(stage rows, where from): summary.json's `stages`, else a stages.json list, else nested MLflow runs."""
    for name in ("summary.json", "stages.json"):
        path = run_dir / name
        if not path.exists():
            continue
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        rows = loaded.get("stages") if isinstance(loaded, dict) else loaded
        if isinstance(rows, list) and rows:
            return [{"stage": r["stage"], "status": r.get("status", MISSING), "seconds": r.get("seconds"),
                     "key": Path(r["path"]).name if r.get("path") else MISSING, "path": r.get("path")}
                    for r in rows], name
    nested = client.search_runs([run.info.experiment_id],
                                filter_string=stage_runs_filter(run.info.run_id),
                                max_results=1000, order_by=["attributes.start_time ASC"])
    rows = []
    for child in nested:
        info = child.info
        seconds = child.data.metrics.get("wall_time_s")
        if seconds is None and info.end_time and info.start_time:
            seconds = (info.end_time - info.start_time) / 1000
        status = "computed" if info.status == "FINISHED" else info.status.lower()
        if child.data.tags.get("posttrain.cached") == "true":  # read from the cache (tasks/stage_tasks.py)
            status, seconds = "cached", 0.0
        rows.append({"stage": info.run_name, "status": status,
                     "seconds": seconds, "key": child.data.tags.get("posttrain.artifact_key", MISSING), "path": None})
    return rows, ("mlflow stage runs" if rows else "")


def resolve_runs(client, refs: list[str], artifacts_dir: Path) -> list[RunData]:
    """Each RUN (parent run name, or MLflow run id) -> RunData; unknown or ambiguous names raise CompareError."""
    experiments = experiment_names(client)
    parents = search_parent_runs(client)
    by_id = {r.info.run_id: r for r in parents}
    resolved = []
    for ref in refs:
        matches = [r for r in parents if r.info.run_name == ref]
        if not matches and ref in by_id:
            matches = [by_id[ref]]
        if not matches and re.fullmatch(r"[0-9a-f]{32}", ref):
            matches = [run for run in [_get_parent(client, ref)] if run is not None]
        if not matches:
            known = ", ".join(r.info.run_name for r in parents[:5]) or "none (no pipeline runs in this store)"
            raise CompareError(f"unknown run {ref!r}: not a pipeline run name or MLflow run id in "
                               f"{client.tracking_uri}. Newest runs: {known}. `posttrain runs` lists them all.")
        if len(matches) > 1:
            ids = ", ".join(f"{r.info.run_id} ({experiments.get(r.info.experiment_id)})" for r in matches)
            raise CompareError(f"run name {ref!r} is ambiguous; pass one of the run ids: {ids}")
        resolved.append(to_run_data(client, matches[0], experiments, artifacts_dir, full=True))
    return resolved


def _get_parent(client, run_id: str):
    """The run with this id, or its parent when it is a nested stage run; None if there is none."""
    from tasks.lineage_reader import RunNotFound, StoreReader

    if isinstance(client, StoreReader):
        not_found = RunNotFound
    else:
        from mlflow.exceptions import MlflowException as not_found
    try:
        run = client.get_run(run_id)
        parent = run.data.tags.get("mlflow.parentRunId")
        return client.get_run(parent) if parent else run
    except not_found:
        return None


# ---------------------------------------------------------------- commands

def runs_command(artifacts_dir: str, experiment: str | None = None) -> str:
    """The text of `posttrain runs`."""
    client = open_client(artifacts_dir)
    experiments = experiment_names(client)
    runs = [to_run_data(client, r, experiments, Path(artifacts_dir), full=False)
            for r in search_parent_runs(client, experiment)]
    if not runs:
        return f"no pipeline runs in {client.tracking_uri}" + (f" (experiment {experiment!r})" if experiment else "")
    return format_table(RUNS_HEADER, runs_rows(runs, int(time.time() * 1000)))


def compare_command(refs: list[str], artifacts_dir: str, plot: str | None = None) -> str:
    """The text of `posttrain compare`; writes the curves PNG."""
    client = open_client(artifacts_dir)
    runs = resolve_runs(client, refs, Path(artifacts_dir))
    report = compare_report(runs, int(time.time() * 1000))
    differing = differing_code(runs)
    if differing:
        report += "\n\n" + (code_diff(client, runs, differing) or "(no source logged to diff)").rstrip("\n")
    path = plot_curves(runs, Path(plot) if plot else default_plot_path(Path(artifacts_dir), runs))
    return f"{report}\n\nplot: {path}"
