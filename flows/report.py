"""One run, or two, as one self-contained HTML page (`posttrain report`, `posttrain diff --html`).

A run's page: the per-round curves (reward and each reward function's mean, held-out accuracy with the constant
baseline, KL, entropy, completion length, clip ratio) from the parent run's MLflow metrics (x: the MLflow step, the
round's number counted from 1; eval 0 is the base eval), each with the healthy band of the run's own `health.*`
settings (stages/evaluation/health.py, the checks every round is held to) shaded and the rounds the checks flagged
marked; the eval before/after with the constant-answer baseline; the held-out prompts whose verdict flipped between
the base and the final eval, with both completions; sample completions per round (the ones MLflow and Prefect
get, tasks/publish.py `sample_completions`); what each stage cost (its manifest's `cost`, else its `wall_time_s`);
the stages in flow order with cached/computed, content key and inputs. `posttrain diff A B --html PATH` draws two
runs on the same curves with diff's flips, both completions side by side (flows/diff.py `diff_data`).

It reads what `posttrain compare`, `diff` and `trace` read (runs: flows/compare.py `resolve_runs`; evals and rounds:
flows/diff.py `load_eval`, `stage_folder`) and recomputes nothing. `posttrain run` writes the page at the end of a
run that trained a policy (flows/pipeline.py), as runs/<run>/report.html, logs it as the parent run's MLflow
artifact `report.html` and links it from the Prefect summary; a failure there is a warning, never a failed run.

Why plotly: plotly.py is well kept (MIT, released monthly, plotly.js underneath), its charts are interactive where a
report is read (each round's value on hover, zoom into rounds, a reward function toggled off in the legend), and
`plotly.io.to_html` writes each figure as a div plus its JSON, with plotly.js (4.8 MB) inlined once in the page's
head, so the file opens offline, from an MLflow artifact or an e-mail, with no CDN. Its import is cheap (`plotly.io`
~0.1 s); the figures are plotly figure dicts handed over unvalidated, since building the six charts through
`plotly.graph_objects` took 0.52 s against 0.15 s as dicts (measured) for the same JSON, and every run writes a page.
matplotlib (`posttrain compare --plot`) draws static images, no values on hover; Altair and Bokeh load their JS from
a CDN unless told otherwise.

  posttrain report RUN [-o PATH] [--artifacts DIR]
  posttrain diff RUN_A RUN_B --html PATH
"""

from __future__ import annotations

import html
import json
import logging
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flows.compare import (MISSING, CompareError, RunData, experiment_names, fmt_duration, fmt_number, fmt_time,
                           open_client, resolve_runs, to_run_data)
from flows.diff import BASE, FINAL, ROUND_STAGE, EvalTable, Side, load_eval, shared_prompts, stage_folder, verdicts
from tasks.store import MANIFEST, ArtifactStore

log = logging.getLogger("posttrain")

REPORT = "report.html"
"""The page's name in the run folder (runs/<run>/) and as the parent run's MLflow artifact."""
FLIPS_SHOWN = 200  # per direction; the rest are counted (`posttrain diff --json` lists all)
COST_KEYS = ("wall_s", "cpu_s", "gpu_s", "gpu_peak_bytes", "tokens_generated", "tokens_trained", "tokens_scored")
REWARD_FN = re.compile(r"rewards/(.+)/mean")
RUN_COLORS = ("#1f77b4", "#d62728")  # run A, run B on a two-run page


@dataclass(frozen=True)
class Curve:
    """One chart of the curves section: its metrics (REWARD_FN names match `rewards/*/mean`) and where the health
    checks draw its healthy band (`band`: a method of Bands)."""

    id: str
    title: str
    metrics: tuple[str, ...]
    band: str


CURVES = (
    Curve("reward", "reward (train/reward_mean; each reward function's mean)", ("train/reward_mean", "rewards/*/mean"),
          "reward"),
    Curve("accuracy", "held-out accuracy (eval/accuracy; step 0: base eval)", ("eval/accuracy",), "accuracy"),
    Curve("kl", "KL to the reference policy (train/kl)", ("train/kl",), "kl"),
    Curve("entropy", "policy entropy, nats per token (train/entropy)", ("train/entropy",), "entropy"),
    Curve("length", "completion length, tokens (train/completion_length)", ("train/completion_length",), "length"),
    Curve("clip", "clip ratio (train/clip_ratio)", ("train/clip_ratio",), "clip"),
)
FINDING_CHART = {"train/reward_mean": "reward", "train/kl": "kl", "train/entropy": "entropy",
                 "train/completion_length": "length", "train/clip_ratio": "clip"}  # + rewards/*/mean -> reward


@dataclass
class RunView:
    """What a run's page shows, read from MLflow and the run's artifacts."""

    run: RunData
    tags: dict[str, str]
    summary: dict  # runs/<run>/summary.json (the run's results), {} if it has none
    histories: dict[str, dict[int, float]]  # metric -> {MLflow step: value}
    health: object  # stages.evaluation.health.HealthConfig of the run's config
    health_note: str
    max_completion_length: int | None
    base: EvalTable | None
    final: EvalTable | None
    eval_summaries: dict[str, dict]  # "base" / "final" -> the eval manifest's summary
    samples: list[tuple[int, list[dict]]]  # (round, sample completions)
    stages: list[dict] = field(default_factory=list)  # run.stages rows + "manifest"


# ---------------------------------------------------------------- loading (MLflow + artifact folders)

def run_folder(run: RunData, tags: dict, artifacts_dir: Path) -> Path:
    """runs/<run name>/ under the run's artifact root (tag artifact_root, as `posttrain compare` finds it)."""
    return Path(tags.get("artifact_root") or Path(artifacts_dir).resolve()) / "runs" / run.name


def curve_metrics(run: RunData) -> list[str]:
    """The metrics of CURVES (and eval/constant_baseline) the run logged."""
    names = {m for c in CURVES for m in c.metrics} | {"eval/constant_baseline"}
    return sorted(m for m in run.metrics if m in names or REWARD_FN.fullmatch(m))


def health_settings(config: dict[str, str]) -> tuple[object, str]:
    """(HealthConfig, note) from the run's flattened config's health.* keys; the defaults, said so, where they do
    not validate (a config from another posttrain version)."""
    from pydantic import ValidationError

    from stages.evaluation.health import HealthConfig

    fields = {k.split(".", 1)[1]: v for k, v in config.items() if k.startswith("health.")}
    fields = {k: v for k, v in fields.items() if k in HealthConfig.model_fields}
    try:
        return HealthConfig(**fields), "the run's health.* settings"
    except ValidationError:
        return HealthConfig(), "health.* defaults (the run's settings did not validate)"


def sample_rows(run: RunData, artifacts_dir: Path, count: int) -> list[tuple[int, list[dict]]]:
    """(round, `count` sample completions of its scored rollouts) per `score rN` stage, as MLflow got them."""
    from tasks.publish import sample_completions

    out = []
    for stage in run.stages:
        match = ROUND_STAGE.fullmatch(stage["stage"])
        folder = stage_folder(run, stage["stage"], artifacts_dir) if match else None
        if folder is not None and (folder / "scored.parquet").exists():
            out.append((int(match[1]), sample_completions(folder / "scored.parquet", count)))
    return out


def load_view(client, run: RunData, artifacts_dir: Path, tags: dict | None = None,
              summary: dict | None = None) -> RunView:
    """A RunView of `run` (from resolve_runs / to_run_data). `summary`: the run's results when they are not on disk
    yet (the end-of-run hook), else runs/<run>/summary.json."""
    artifacts_dir = Path(artifacts_dir)
    tags = tags if tags is not None else dict(client.get_run(run.run_id).data.tags)
    if summary is None:
        path = run_folder(run, tags, artifacts_dir) / "summary.json"
        try:
            summary = json.loads(path.read_text()) if path.exists() else {}
        except json.JSONDecodeError:
            summary = {}
    histories = {}
    for metric in curve_metrics(run):
        points = sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run.run_id, metric))
        histories[metric] = {step: value for step, _, value in points}  # the last value logged per step
    health, note = health_settings(run.config)
    length = run.config.get("rollout.max_completion_length")
    evals, summaries = {}, {}
    for which, label in (("base", BASE), ("final", FINAL)):
        try:
            evals[which] = load_eval(run, label, artifacts_dir)
        except CompareError:  # an eval without a verdict per prompt (ebft strided): no flips
            evals[which] = None
        folder = stage_folder(run, label, artifacts_dir)
        if folder is not None:
            summaries[which] = json.loads((folder / MANIFEST).read_text()).get("summary") or {}
    count = int(run.config.get("tracking.completions_per_round") or 8)
    stages, store = [], ArtifactStore(artifacts_dir)
    for stage in run.stages:  # summary.json's rows name their folder; MLflow stage runs' rows, their key
        folder = Path(stage["path"]) if stage.get("path") else None
        if folder is None and stage.get("key") not in (None, MISSING):
            folder = store.path(stage["stage"].split()[0], stage["key"])
        manifest = {}
        if folder is not None and (folder / MANIFEST).exists():
            manifest = json.loads((folder / MANIFEST).read_text())
        stages.append({**stage, "manifest": manifest})
    return RunView(run, tags, summary, histories, health, note,
                   int(length) if length and str(length).isdigit() else None, evals["base"], evals["final"],
                   summaries, sample_rows(run, artifacts_dir, count), stages)


def summary_stages(rows: list[dict]) -> list[dict]:
    """A run's stage rows (tasks/reporting.py Reporter.rows, summary.json's `stages`) as RunData.stages."""
    return [{"stage": r["stage"], "status": r.get("status", MISSING), "seconds": r.get("seconds"),
             "key": Path(r["path"]).name if r.get("path") else MISSING, "path": r.get("path")} for r in rows]


# ---------------------------------------------------------------- charts (plotly)

class Bands:
    """The healthy band of each chart, from a run's HealthConfig: (low, high, text) or None; None bounds are open."""

    def __init__(self, view: RunView):
        self.view, self.cfg = view, view.health

    def reward(self):
        cfg = self.cfg
        if not cfg.min_reward_rise:
            return None
        return (cfg.min_reward_rise, None, f"a verifier's mean should pass {cfg.min_reward_rise:g} within "
                                           f"{cfg.reward_rise_steps} optimizer steps (health.min_reward_rise)")

    def accuracy(self):
        from tasks.reporting import BASELINE_MARGIN

        baseline = self.view.histories.get("eval/constant_baseline") or {}
        if not baseline:
            return None
        value = list(baseline.values())[-1]
        return (value + BASELINE_MARGIN, None, f"above the constant baseline {value:.3f} + {BASELINE_MARGIN} "
                                               "(below: no evidence of learning)")

    def kl(self):
        return 0.0, self.cfg.max_kl, f"<= {self.cfg.max_kl:g} (health.max_kl)"

    def entropy(self):
        cfg, first = self.cfg, self.view.histories.get("train/entropy") or {}
        first = first[min(first)] if first else None
        high = max(cfg.max_entropy, cfg.max_entropy_growth * first if first else 0.0)
        why = "health.max_entropy" if high == cfg.max_entropy else \
            f"health.max_entropy_growth x round 1's {first:.3g}"
        return cfg.min_entropy, high, f"[{cfg.min_entropy:g}, {high:.3g}] (health.min_entropy, {why})"

    def length(self):
        cap = self.view.max_completion_length
        text = f">= {self.cfg.min_completion_length:g} (health.min_completion_length)" + (
            f", < {cap} (rollout.max_completion_length)" if cap else "")
        return self.cfg.min_completion_length, cap, text

    def clip(self):
        return 0.0, self.cfg.max_clip_ratio, f"<= {self.cfg.max_clip_ratio:g} (health.max_clip_ratio)"


def chart_range(values: list[float], band: tuple | None, fixed: tuple | None = None) -> list[float]:
    """The y range: the data with a margin, stretched to a band's bound that lies near it (within twice the data's
    spread), so a curve close to its limit shows the limit and a far-off one does not squash the curve.

    >>> chart_range([0.01, 0.03], (0.0, 2.0, ""))  # KL far below its bound 2: the data fills the chart
    [0.0, 0.032]
    >>> chart_range([0.5, 1.5], (0.0, 2.0, ""))
    [0.0, 2.05]
    """
    if fixed:
        return list(fixed)
    low, high = min(values), max(values)
    spread = max(high - low, abs(high) * 0.1) or 1.0  # a flat curve at 0 (KL with grpo.beta 0): a unit scale
    view_low, view_high = low - 0.1 * spread, high + 0.1 * spread
    for bound in (band or (None, None))[:2]:
        if bound is not None and low - 2 * spread <= bound <= high + 2 * spread:
            view_low, view_high = min(view_low, bound - 0.05 * spread), max(view_high, bound + 0.05 * spread)
    if low >= 0 > view_low:
        view_low = 0.0
    return [round(view_low, 6), round(view_high, 6)]


def curve_traces(curve: Curve, view: RunView) -> list[tuple[str, str, dict[int, float]]]:
    """(metric, legend name, {step: value}) of each metric the chart draws that the run logged."""
    out = []
    for pattern in curve.metrics:
        names = sorted(m for m in view.histories if REWARD_FN.fullmatch(m)) if pattern == "rewards/*/mean" \
            else [pattern]
        for metric in names:
            if view.histories.get(metric):
                match = REWARD_FN.fullmatch(metric)
                out.append((metric, match[1] if match else metric.split("/")[-1], view.histories[metric]))
    return out


def findings_of(view: RunView, chart: str) -> list[dict]:
    """The health findings (summary.json `health`) of the chart's metrics: {round, metric, value, range, message}."""
    out = []
    for f in view.summary.get("health") or []:
        target = "reward" if REWARD_FN.fullmatch(str(f.get("metric"))) else FINDING_CHART.get(f.get("metric"))
        if target == chart and isinstance(f.get("value"), (int, float)):
            out.append(f)
    return out


def layout(title: str, height: int, **more) -> dict:
    """A chart's plotly layout: white, light grid, legend below."""
    axis = {"gridcolor": "#e5e5e5", "zerolinecolor": "#cccccc", "automargin": True}
    return {"title": {"text": title, "font": {"size": 14}}, "height": height, "hovermode": "closest",
            "margin": {"l": 50, "r": 20, "t": 60, "b": 40}, "paper_bgcolor": "white", "plot_bgcolor": "white",
            "legend": {"orientation": "h", "x": 1, "xanchor": "right", "y": 0, "yanchor": "bottom",
                       "bgcolor": "rgba(255,255,255,0.8)", "font": {"size": 10}},
            "font": {"family": "system-ui, Helvetica, Arial, sans-serif", "size": 11},
            **more, "xaxis": {**axis, **more.get("xaxis", {})}, "yaxis": {**axis, **more.get("yaxis", {})}}


def curve_figure(curve: Curve, views: list[RunView], labels: list[str]) -> dict | None:
    """The chart of one Curve for one run or two (A solid, B dotted), as a plotly figure dict; None if no run
    logged its metrics."""
    traces, values, steps_max = [], [], 0
    for i, (view, label) in enumerate(zip(views, labels)):
        for j, (metric, name, points) in enumerate(curve_traces(curve, view)):
            steps = sorted(points)
            values += [points[s] for s in steps]
            steps_max = max(steps_max, steps[-1])
            traces.append({
                "type": "scatter", "mode": "lines+markers", "x": steps, "y": [points[s] for s in steps],
                "name": f"{label}{name}", "meta": {"metric": metric, "run": view.run.name},
                "line": {"dash": ("solid", "dot")[i], **({"color": RUN_COLORS[i]} if len(views) > 1 and j == 0
                                                         else {})},
                "hovertemplate": f"{label}{metric}<br>step %{{x}}: %{{y:.4g}}<extra></extra>"})
        found = findings_of(view, curve.id)
        if found:
            traces.append({
                "type": "scatter", "mode": "markers", "x": [f["round"] + 1 for f in found],
                "y": [f["value"] for f in found], "name": f"{label}health finding",
                "meta": {"metric": "health", "run": view.run.name},
                "marker": {"symbol": "x", "size": 12, "color": "#d62728"},
                "text": [f"{f['metric']} = {f['value']:.4g} (healthy: {f['range']}): {f['message']}" for f in found],
                "hovertemplate": "round %{x}: %{text}<extra></extra>"})
    if not values:
        return None
    band = getattr(Bands(views[0]), curve.band)()
    span = chart_range(values, band, (0, 1.02) if curve.id == "accuracy" else None)
    shapes, notes = [], []
    if band:
        low, high, _ = band
        shapes.append({"type": "rect", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "line": {"width": 0},
                       "y0": span[0] if low is None else low, "y1": span[1] if high is None else high,
                       "fillcolor": "#2ca02c", "opacity": 0.09, "layer": "below"})
    if curve.id == "accuracy":
        for value in list((views[0].histories.get("eval/constant_baseline") or {}).values())[-1:]:
            shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": value, "y1": value,
                           "line": {"dash": "dash", "color": "#7f7f7f", "width": 1}})
            notes.append({"xref": "paper", "x": 1, "y": value, "yanchor": "top", "xanchor": "right",
                          "showarrow": False, "text": f"constant baseline {value:.3f}", "font": {"color": "#555555"}})
    subtitle = f"healthy: {band[2]}" if band else "no health check on this metric"
    return {"data": traces, "layout": layout(
        f"{curve.title}<br><sup>{html.escape(subtitle)}</sup>", 320, shapes=shapes, annotations=notes,
        xaxis={"title": {"text": "round (MLflow step)"}, **({"dtick": 1} if steps_max <= 20 else {})},
        yaxis={"range": span})}


def eval_figure(view: RunView) -> dict | None:
    """Base vs final held-out accuracy beside the constant-answer baseline; None without both evals."""
    base, final = view.eval_summaries.get("base"), view.eval_summaries.get("final")
    if not (base and final and "accuracy" in final):
        return None
    names, values = ["base", "final"], [base.get("accuracy"), final["accuracy"]]
    if final.get("constant_baseline") is not None:
        names.append(f"constant '{final.get('baseline_answer')}'")
        values.append(final["constant_baseline"])
    bar = {"type": "bar", "x": names, "y": values, "text": [f"{v:.3f}" for v in values], "textposition": "outside",
           "marker": {"color": ["#7f7f7f", "#1f77b4", "#c7c7c7"][: len(values)]},
           "meta": {"metric": "eval/accuracy", "run": view.run.name}}
    return {"data": [bar], "layout": layout("held-out accuracy: base, final, always the most common answer", 300,
                                            margin={"l": 50, "r": 20, "t": 50, "b": 40}, yaxis={"range": [0, 1.12]})}


def figure_html(fig: dict, div_id: str) -> str:
    """A figure as a div and its script (plotly.js is in the page's head once). The figure is a plotly figure dict
    written unvalidated (plotly.graph_objects would validate it, at ~0.4 s a page: see the module docstring)."""
    import plotly.io as pio

    return pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=div_id, validate=False,
                       config={"displaylogo": False, "displayModeBar": False, "responsive": True})


def curves_html(views: list[RunView], labels: list[str]) -> str:
    charts = []
    for curve in CURVES:
        fig = curve_figure(curve, views, labels)
        if fig is not None:
            charts.append(f'<div class="chart">{figure_html(fig, f"curve-{curve.id}")}</div>')
    if not charts:
        return p("No per-round metrics: the run has no rounds (a DPO-family or reward-model run trains in one "
                 "stage), or it stopped before its first round.")
    bands = views[0].health_note + (" of run A" if len(views) > 1 else "")  # a two-run page: A's bands
    return (p(f"Shaded green: the healthy range the health checks hold each round to ({bands}; "
              "stages/evaluation/health.py); ✕: a round the checks flagged. x: the MLflow step, round r's metrics "
              "are logged at step r + 1.") + f'<div class="grid">{"".join(charts)}</div>')


# ---------------------------------------------------------------- HTML pieces

def esc(value) -> str:
    if value is None:
        return MISSING
    if isinstance(value, float):
        return fmt_number(value)
    return html.escape(str(value))


def p(text: str) -> str:
    return f"<p>{html.escape(text)}</p>"


def table(header: list[str], rows: list[list], table_id: str = "", pre: tuple[int, ...] = ()) -> str:
    """An HTML table; cells escaped (columns in `pre` as preformatted text: completions)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header) if any(header) else ""
    body = "".join("<tr>" + "".join(f'<td class="pre">{esc(c)}</td>' if i in pre else f"<td>{esc(c)}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    ident = f' id="{table_id}"' if table_id else ""
    return f'<table{ident}>' + (f"<thead><tr>{head}</tr></thead>" if head else "") + f"<tbody>{body}</tbody></table>"


def right_wrong(correct) -> str:
    return MISSING if correct is None else "right" if correct else "wrong"


def page(title: str, sections: list[tuple[str, str, str]]) -> str:
    """The whole document: plotly.js inline in the head, then each (id, heading, body html) section."""
    from plotly.offline import get_plotlyjs

    nav = " · ".join(f'<a href="#{sid}">{html.escape(h)}</a>' for sid, h, _ in sections if h)
    body = "".join(f'<section id="{sid}">' + (f"<h2>{html.escape(h)}</h2>" if h else "") + f"{content}</section>"
                   for sid, h, content in sections)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style><script>{get_plotlyjs()}</script></head><body><h1>{html.escape(title)}</h1>"
            f'<nav>{nav}</nav>{body}<footer>written by posttrain {time.strftime("%Y-%m-%d %H:%M:%S")}; '
            "every number here is read from the run's MLflow metrics and artifact manifests</footer></body></html>")


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:16px 24px;color:#222;
font-size:14px;max-width:1400px}
h1{font-size:20px;margin:4px 0}h2{font-size:16px;margin:24px 0 8px;border-bottom:1px solid #ddd}
nav{margin:4px 0 8px;font-size:13px}nav a{color:#1f77b4}
table{border-collapse:collapse;margin:6px 0;font-size:12px}
th,td{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}th{background:#f4f4f4}
td.pre{white-space:pre-wrap;font-family:ui-monospace,Menlo,Consolas,monospace;max-width:420px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:8px}
.chart{border:1px solid #eee}.kv td:first-child{color:#555}.warn{color:#b35900}
details{margin:4px 0}summary{cursor:pointer}footer{margin-top:24px;color:#888;font-size:11px}
"""


# ---------------------------------------------------------------- one run's page

def header_html(view: RunView) -> str:
    from tasks.reporting import headline

    run, tags, results = view.run, view.tags, view.summary
    rows = [["run", f"{run.name} (MLflow run {run.run_id})"], ["experiment", run.experiment],
            ["method", run.config.get("rl", MISSING)], ["status", run.status], ["started", fmt_time(run.start_ms)],
            ["wall time", fmt_duration(run.wall_s(int(time.time() * 1000)))],
            ["config", f"{tags.get('config_path', MISSING)} {tags.get('overrides', '')}".strip()],
            ["git commit", tags.get("git_commit", MISSING)]]
    lines = []
    try:
        lines = headline(results) if results.get("run_name") else []
    except (KeyError, TypeError, ValueError):  # a summary of another posttrain version
        lines = []
    notes = "".join(f'<p class="{"warn" if line.startswith("WARNING") else ""}">{html.escape(line)}</p>'
                    for line in lines)
    return table(["", ""], rows, "run") + notes


def eval_html(view: RunView) -> str:
    base, final = view.eval_summaries.get("base"), view.eval_summaries.get("final")
    if not (final or base):
        return p("No held-out eval: the run has no eval split (or stopped before its base eval).")
    keys = ("accuracy", "constant_baseline", "baseline_answer", "num_prompts", "format_rate", "distinct_answers",
            "answer_entropy", "top_answer", "top_answer_frac")
    final = final or {}  # a run that stopped before its final eval: the base eval alone
    rows = [[k, (base or {}).get(k), final.get(k)] for k in keys if k in final or k in (base or {})]
    fig = eval_figure(view)
    return (table(["", "base eval", "final eval"], rows, "eval") +
            (f'<div class="chart" style="max-width:560px">{figure_html(fig, "eval-bars")}</div>' if fig else ""))


def flips_html(view: RunView) -> str:
    """The held-out prompts whose verdict differs between the base and the final eval, both completions shown."""
    if view.base is None or view.final is None:
        return p("No flips to show: the run needs a base and a final eval with a verdict per prompt.")
    try:
        ids = shared_prompts(Side(view.run, view.base), Side(view.run, view.final))
    except CompareError as e:
        return p(str(e))
    flips = verdicts(Side(view.run, view.base), Side(view.run, view.final), ids)
    out = [p(f"{len(ids)} held-out prompts: right in both {flips['both_right']}, wrong in both {flips['both_wrong']}, "
             f"wrong -> right {len(flips['wrong_to_right'])}, right -> wrong {len(flips['right_to_wrong'])} "
             f"(base eval -> final eval). `posttrain trace {view.run.name} PROMPT_ID` traces one.")]
    for direction, heading in (("wrong_to_right", "wrong -> right (learned)"),
                               ("right_to_wrong", "right -> wrong (unlearned)")):
        rows = [[f["prompt_id"], f["gold"], f["completions"][0], f["answers"][0], f["completions"][1],
                 f["answers"][1]] for f in flips[direction][:FLIPS_SHOWN]]
        more = len(flips[direction]) - len(rows)
        out.append(f"<h3>{html.escape(heading)}: {len(flips[direction])}</h3>")
        if rows:
            out.append(table(["prompt", "gold", "base said", "base answer", "final said", "final answer"], rows,
                             f"flips-{direction.replace('_', '-')}", pre=(2, 4)))
        if more > 0:
            out.append(p(f"{more} more (posttrain diff --json lists every flip of two runs)."))
    return "".join(out)


def samples_html(view: RunView) -> str:
    if not view.samples:
        return p("No rounds of scored rollouts.")
    out = [p("Per round, the sample completions MLflow (completions/round_<r>.json) and Prefect got: evenly spaced "
             "over the round's scored rollouts (tracking.completions_per_round).")]
    for i, (r, rows) in enumerate(view.samples):
        rewards = list(dict.fromkeys(k for row in rows for k in row if k.startswith("reward/")))
        table_rows = [[row["prompt_id"], row["sample"], row["policy_version"], row["prompt"], row["completion"],
                       *[row.get(k) for k in rewards], row["reward"], row["advantage"], row["errors"] or ""]
                      for row in rows]
        mean = view.histories.get("train/reward_mean", {}).get(r + 1)
        opened = " open" if i in (0, len(view.samples) - 1) else ""
        out.append(f"<details{opened}><summary>round {r} (step {r + 1}): {len(rows)} samples"
                   f"{f', round reward mean {mean:.3f}' if mean is not None else ''}</summary>"
                   + table(["prompt", "sample", "policy", "prompt text", "completion", *rewards, "reward", "advantage",
                            "errors"], table_rows, f"samples-r{r}", pre=(3, 4)) + "</details>")
    return "".join(out)


def fmt_bytes(value) -> str:
    if value is None:
        return MISSING
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return MISSING


def cost_cells(cost: dict, wall=None, rate: bool = False) -> list[str]:
    """A cost record's cells in COST_KEYS order (`wall`: the wall seconds where the record has none; `rate`:
    seconds per unit, to 3 digits)."""
    cells = []
    for key in COST_KEYS:
        value = cost.get(key, wall if key == "wall_s" else None)
        cells.append(MISSING if not isinstance(value, (int, float)) else fmt_bytes(value) if key.endswith("_bytes")
                     else f"{value:.3g}s" if rate else fmt_duration(value) if key.endswith("_s")
                     else fmt_number(value))
    return cells


COST_HEADER = ["wall", "CPU", "GPU", "GPU peak", "tokens generated", "tokens trained", "tokens scored"]


def cost_html(view: RunView) -> str:
    """Per stage what it cost (the manifest's `cost`; else its `wall_time_s`, the rest not recorded) and whether
    this run paid it (computed) or read the artifact (cached: the cost shown was avoided); the run's totals where
    its results have them (summary.json `cost`, tasks/costs.py)."""
    rows, recorded, totals = [], False, {"computed": 0.0, "cached": 0.0}
    for stage in view.stages:
        manifest = stage["manifest"]
        cost = manifest.get("cost") if isinstance(manifest.get("cost"), dict) else None
        recorded = recorded or cost is not None
        wall = (cost or {}).get("wall_s", manifest.get("wall_time_s"))
        if isinstance(wall, (int, float)):
            totals["cached" if stage["status"] == "cached" else "computed"] += wall
        status = "cached (cost avoided)" if stage["status"] == "cached" else stage["status"]
        rows.append([stage["stage"], status, *cost_cells(cost or {}, wall)])
    if not rows:
        return p("No stage record (no summary.json and no MLflow stage runs).")
    note = ("From each stage's manifest `cost` (-: not measured there: no GPU used, or no tokens of that kind)."
            if recorded else
            "Only wall time was recorded (the manifests' wall_time_s): this run's manifests have no `cost` "
            "(CPU and GPU seconds, GPU peak memory, tokens); runs of a newer posttrain record them.")
    out = [p(f"{note} Computed in this run: {fmt_duration(totals['computed'])} of stage wall time; read from the "
             f"cache instead of computed: {fmt_duration(totals['cached'])} (what those stages cost when computed).")]
    run = view.summary.get("cost")
    if isinstance(run, dict) and isinstance(run.get("spent"), dict):
        lines = [["spent by this run", *cost_cells(run["spent"])],
                 ["avoided (read from the cache)", *cost_cells(run.get("avoided") or {})]]
        for key, label in (("per_1k_tokens_trained", "per 1k tokens trained"),
                           ("per_accepted_sample", f"per accepted sample ({run.get('accepted_samples', '?')})")):
            if isinstance(run.get(key), dict):
                lines.append([label, *cost_cells(run[key], rate=True)[:3], *[""] * 4])
        out.append(table(["run total", *COST_HEADER], lines, "cost-totals"))
    return "".join(out) + table(["stage", "this run", *COST_HEADER], rows, "cost")


def stages_html(view: RunView) -> str:
    """The stages in flow order: cached or computed, content key, and which stages' artifacts it read."""
    by_ref = {}
    for stage in view.stages:
        if stage.get("path"):
            by_ref[f"{Path(stage['path']).parent.name}/{Path(stage['path']).name}"] = stage["stage"]
    rows = []
    for i, stage in enumerate(view.stages):
        inputs = stage["manifest"].get("inputs") or {}
        read = ", ".join(f"{name}: {by_ref.get(ref, ref)}" for name, ref in inputs.items() if isinstance(ref, str)
                         and ref)
        rows.append([i + 1, stage["stage"], stage["status"],
                     fmt_duration(stage["seconds"]) if isinstance(stage.get("seconds"), (int, float)) else MISSING,
                     stage["key"], read or MISSING, stage.get("path") or MISSING])
    if not rows:
        return p("No stage record.")
    return (p(f"{view.run.stages_source or 'stage record'}: each stage's folder is artifacts/<stage>/<key>; its "
              "inputs are the artifacts its key digests (manifest `inputs`, by the stage of this run that made them).")
            + table(["#", "stage", "status", "seconds", "key", "inputs", "artifact"], rows, "stages"))


def health_html(view: RunView) -> str:
    found = view.summary.get("health") or []
    if not found:
        return ""
    rows = [[f.get("round"), f.get("metric"), f.get("value"), f.get("range"), f.get("message")] for f in found]
    return f"<h3>health findings: {len(rows)}</h3>" + table(["round", "metric", "value", "healthy", "what it means"],
                                                             rows, "health")


def run_page(view: RunView) -> str:
    """One run's page."""
    return page(f"posttrain report: {view.run.name}", [
        ("summary", "", header_html(view)),
        ("curves", "Curves per round", curves_html([view], [""]) + health_html(view)),
        ("eval", "Eval before and after", eval_html(view)),
        ("flips", "Flips: base eval vs final eval", flips_html(view)),
        ("samples", "Sample completions per round", samples_html(view)),
        ("cost", "Cost", cost_html(view)),
        ("stages", "Stages", stages_html(view)),
    ])


# ---------------------------------------------------------------- two runs' page (posttrain diff --html)

def diff_page(data: dict, views: list[RunView]) -> str:
    """`posttrain diff --html`: diff_data (all flips) of two runs, and both runs' curves on the same charts."""
    a, b = data["runs"]
    runs = table(["", "A", "B"], [
        ["run", f"{a['name']} ({a['run_id']})", f"{b['name']} ({b['run_id']})"],
        ["experiment", a["experiment"], b["experiment"]], ["method", a["method"], b["method"]],
        ["accuracy (final eval)", a["accuracy"], b["accuracy"]],
        ["accuracy (base eval)", a["base_accuracy"], b["base_accuracy"]],
        ["verifier", ", ".join(a["verifier"]), ", ".join(b["verifier"])],
        *[[f"mean reward {fn}", a["reward_means"].get(fn), b["reward_means"].get(fn)]
          for fn in dict.fromkeys([*a["reward_means"], *b["reward_means"]])],
        ["distinct answers", a["answers"]["distinct"], b["answers"]["distinct"]]], "runs")
    config = data["config_differs"]
    config_html = table(["key", "A", "B"], [[k, *v] for k, v in config.items()], "config") if config else p(
        "The runs' configs are the same.")
    flips = [p(f"{data['prompts']} held-out prompts, the same in both: right in both {data['both_right']}, wrong in "
               f"both {data['both_wrong']}, A right B wrong {data['flips']['right_to_wrong']}, A wrong B right "
               f"{data['flips']['wrong_to_right']}.")]
    for direction, heading in (("right_to_wrong", "A right, B wrong"), ("wrong_to_right", "A wrong, B right")):
        rows = [[f["prompt_id"], f["gold"], "/".join(map(right_wrong, f["base_correct"])), f["completions"][0],
                 f["answers"][0], f["completions"][1], f["answers"][1]] for f in data[direction][:FLIPS_SHOWN]]
        flips.append(f"<h3>{html.escape(heading)}: {data['flips'][direction]}</h3>")
        if rows:
            flips.append(table(["prompt", "gold", "base A/B", "A said", "A answer", "B said", "B answer"], rows,
                               f"flips-{direction.replace('_', '-')}", pre=(3, 5)))
        if data["flips"][direction] > len(rows):
            flips.append(p(f"{data['flips'][direction] - len(rows)} more (posttrain diff --json lists them all)."))
    tops = [r["answers"]["top"] for r in (a, b)]
    answers = table(["A answer", "A count", "B answer", "B count"], [
        [*(tops[0][i] if i < len(tops[0]) else ["", ""]), *(tops[1][i] if i < len(tops[1]) else ["", ""])]
        for i in range(max(map(len, tops)))], "answers")
    rounds = table(["round", "A reward mean", "A reward std", "A length", "B reward mean", "B reward std", "B length"],
                   [[e["round"], *[c for s in e["runs"] for c in ((s["reward_mean"], s["reward_std"], s["length_mean"])
                                                               if s else (None, None, None))]]
                    for e in data["rounds"]], "rounds") if data["rounds"] else p("Neither run has rounds.")
    return page(f"posttrain diff: {a['name']} vs {b['name']}", [
        ("runs", "", runs),
        ("curves", "Curves per round (A solid, B dotted)", curves_html(views, ["A ", "B "])),
        ("flips", "Flips: final eval, A vs B", "".join(flips)),
        ("config", "Config differences", config_html),
        ("answers", "Most common answers (final eval)", answers),
        ("rounds", "Rounds: scored rollouts", rounds),
    ])


# ---------------------------------------------------------------- writing

def write_page(path: str | Path, text: str) -> Path:
    """Write the page through a temporary file beside it (a reader never sees half a page)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def write_report(ref: str, artifacts_dir: str | Path, output: str | Path | None = None) -> Path:
    """`posttrain report`: the page of run `ref` (run name or MLflow run id) at `output` (default:
    runs/<run>/report.html, the file the run wrote at its end). CompareError on an unknown run or no store."""
    artifacts_dir = Path(artifacts_dir)
    client = open_client(artifacts_dir)
    run = resolve_runs(client, [ref], artifacts_dir)[0]
    view = load_view(client, run, artifacts_dir)
    return write_page(output or run_folder(run, view.tags, artifacts_dir) / REPORT, run_page(view))


def write_diff_page(client, a: Side, b: Side, artifacts_dir: Path, output: str | Path) -> Path:
    """`posttrain diff --html`: the two runs' page at `output`."""
    from flows.diff import diff_data

    data = diff_data(a, b)
    views = [load_view(client, side.run, artifacts_dir) for side in (a, b)]
    return write_page(output, diff_page(data, views))


def run_report(ctx, parent: str, run_dir: Path, results: dict) -> str | None:
    """The end of `posttrain run` (flows/pipeline.py): write runs/<run>/report.html from the finished run's
    results and MLflow metrics, and log it as the parent run's artifact `report.html`. Returns its path, or None
    when it could not be written: a warning then (`posttrain report RUN` writes it later), never a failed run."""
    started = time.perf_counter()
    try:
        client, root = ctx.lineage.client, Path(ctx.config.artifacts_dir).resolve()
        mlflow_run = client.get_run(parent)
        run = to_run_data(client, mlflow_run, experiment_names(client), root, full=True)
        run.status, run.end_ms = "FINISHED", int(time.time() * 1000)  # it finishes as this returns
        run.stages, run.stages_source = summary_stages(results["stages"]), "summary.json"
        view = load_view(client, run, root, tags=dict(mlflow_run.data.tags), summary=results)
        path = write_page(Path(run_dir) / REPORT, run_page(view))
        client.log_artifact(parent, str(path))
    except Exception as e:  # noqa: BLE001 - the run has finished; its report is not worth failing it for
        log.warning("run report not written: %s: %s", type(e).__name__, e)
        ctx.reporter.warn(f"the run report was not written ({type(e).__name__}: {e}); "
                          f"`posttrain report {run_dir.name}` writes it from the finished run")
        return None
    log.info("run report %s written in %.2f s", path, time.perf_counter() - started)
    return str(path)


def report_command(args) -> int:
    """`posttrain report`: write the page, print its path; exit 2 naming the problem on bad input."""
    from tasks.lineage import StoreBusyError

    started = time.perf_counter()
    try:
        path = write_report(args.run, args.artifacts, args.output)
    except (CompareError, StoreBusyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"report: {path} ({path.stat().st_size / 1e6:.1f} MB, written in {time.perf_counter() - started:.1f} s; "
          "opens offline in a browser)")
    return 0
