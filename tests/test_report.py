"""`posttrain report` and `posttrain diff --html` (flows/report.py): the page rendered in headless Chromium, and what
is on it after its JavaScript ran, checked against the run's MLflow metrics and artifacts. Two real tiny GRPO runs
(tests/conftest.py's tiny config) in one store made once for this module, both judged by a verifier of the
completion's text alone: `long`, two rounds at a learning rate high enough to change the policy's greedy
completions (so its base and final evals differ), and `short`, one round at the default learning rate (its
rollouts and scores of round 0 are `long`'s, read from the cache; its final eval differs from `long`'s).

Chromium: Debian's /usr/bin/chromium (.ci/run installs it), as tests/test_server_ui.py drives it; the Chromium
tests are skipped without it.
"""

from __future__ import annotations

import html
import json
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import warm_tiny_folder

from flows.cli import main
from tasks.store import MANIFEST

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,4000"]
needs_chromium = pytest.mark.skipif(not CHROMIUM.exists(),
                                    reason=f"needs Debian's chromium at {CHROMIUM} (apt-get install -y chromium)")

VERIFIER = '''"""A verifier of the completion's text alone: whether it has an even number of characters."""


def even_length(completions, **kwargs):
    return [float(len(c[-1]["content"]) % 2 == 0) for c in completions]
'''

# After the page's scripts ran: what plotly computed and drew for each chart (calcdata: the points it placed;
# path.point: the markers in the SVG), and the shapes (the healthy bands), written into the DOM for --dump-dom.
PROBE = """<script>
window.addEventListener("load", function () { setTimeout(function () {
  var out = {};
  document.querySelectorAll(".plotly-graph-div").forEach(function (gd) {
    var layers = gd.querySelectorAll(".scatterlayer .trace");
    out[gd.id] = {traces: (gd.calcdata || []).map(function (trace, i) {
      var full = gd._fullData[i];
      return {type: full.type, meta: full.meta, name: full.name,
              points: trace.map(function (pt) { return full.type === "bar" ? [pt.p, pt.s] : [pt.x, pt.y]; }),
              drawn: full.type === "scatter" && layers[i] ? layers[i].querySelectorAll("path.point").length : null};
    }), shapes: (gd._fullLayout.shapes || []).map(function (s) { return [s.y0, s.y1]; })};
  });
  var pre = document.createElement("pre"); pre.id = "probe"; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 0); });
</script>"""


class Tables(HTMLParser):
    """Every <table id=...> of a page: id -> rows of cell texts (the header row first)."""

    def __init__(self):
        super().__init__()
        self.tables, self.current, self.cell, self.fetched = {}, None, None, []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.fetched += [attrs[a] for a in ("src", "href") if attrs.get(a) and not attrs[a].startswith("#")]
        if tag == "table" and attrs.get("id"):
            self.current = self.tables.setdefault(attrs["id"], [])
        elif tag == "tr" and self.current is not None:
            self.current.append([])
        elif tag in ("td", "th") and self.current is not None:
            self.cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.current[-1].append("".join(self.cell))
            self.cell = None
        elif tag == "table":
            self.current = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def rendered(page: Path, tmp_path: Path) -> tuple[str, dict, dict]:
    """(DOM after the scripts ran, the probe's charts, the tables) of an HTML page opened in headless Chromium."""
    text = page.read_text()
    tags = Tables()
    tags.feed(text)
    assert tags.fetched == []  # self-contained: no script, style or image fetched (plotly.js is inline)
    probed = tmp_path / f"probed-{page.name}"
    probed.write_text(text.replace("</body>", PROBE + "</body>"))
    shown = subprocess.run([str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}",
                            "--virtual-time-budget=10000", "--dump-dom", probed.as_uri()],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-3000:]
    dom = shown.stdout
    start = dom.index('<pre id="probe">') + len('<pre id="probe">')
    charts = json.loads(html.unescape(dom[start:dom.index("</pre>", start)]))
    tables = Tables()
    tables.feed(dom)
    return dom, charts, tables.tables


@pytest.fixture(scope="module")
def runs(prefect_harness, tiny_warm_store, empty_mlflow_store, tmp_path_factory):
    """(artifacts, {"long": results, "short": results}) of two finished tiny runs (see the module docstring)."""
    from flows.pipeline import posttrain_pipeline

    root = tmp_path_factory.mktemp("report")
    artifacts = warm_tiny_folder(root, tiny_warm_store, empty_mlflow_store)
    (root / "report_verdicts.py").write_text(VERIFIER)
    common = ["score.reward_funcs=[report_verdicts.even_length]", "grpo.learning_rate=0.05"]
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        results["long"] = posttrain_pipeline(str(root / "tiny.yaml"), common, quiet=True)
        results["short"] = posttrain_pipeline(str(root / "tiny.yaml"), [common[0], "grpo.rounds=1"], quiet=True)
    return artifacts, results


def stages_of(artifacts: Path, name: str) -> list[dict]:
    return json.loads((artifacts / "runs" / name / "summary.json").read_text())["stages"]


def stage_folder(artifacts: Path, name: str, label: str) -> Path:
    return Path(next(s["path"] for s in stages_of(artifacts, name) if s["stage"] == label))


def history(artifacts: Path, run_id: str, metric: str) -> list[list[float]]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{artifacts / 'mlflow.db'}")
    return [[m.step, m.value] for m in sorted(client.get_metric_history(run_id, metric), key=lambda m: m.step)]


def flat(points: list[list[float]]) -> list[float]:
    """[[step, value], ...] -> [step, value, ...] (pytest.approx compares flat lists)."""
    return [x for point in points for x in point]


def trace(charts: dict, chart: str, metric: str, run: str | None = None) -> dict:
    found = [t for t in charts[chart]["traces"] if t["meta"]["metric"] == metric and run in (None, t["meta"]["run"])]
    assert len(found) == 1, (chart, metric, [t["meta"] for t in charts[chart]["traces"]])
    return found[0]


def test_run_writes_its_report_and_logs_it_to_mlflow(runs):
    from mlflow import MlflowClient

    artifacts, results = runs
    result = results["long"]
    page = artifacts / "runs" / result["run_name"] / "report.html"
    assert result["report"] == str(page) and page.stat().st_size > 1_000_000  # plotly.js inline
    summary = json.loads((page.parent / "summary.json").read_text())
    assert summary["report"] == str(page)
    client = MlflowClient(f"sqlite:///{artifacts / 'mlflow.db'}")
    assert "report.html" in [f.path for f in client.list_artifacts(result["mlflow_run_id"])]
    logged = Path(client.download_artifacts(result["mlflow_run_id"], "report.html", str(page.parent.parent)))
    assert logged.read_bytes() == page.read_bytes()


def test_the_page_read_without_mlflow_is_the_page_read_through_it(runs):
    """`posttrain report` reads a sqlite store with tasks/lineage_reader.py (no MLflow import): the same page as
    through MlflowClient, but for the time it was written."""
    import re

    from flows import report
    from flows.compare import resolve_runs
    from tasks.lineage import retrying_client
    from tasks.lineage_reader import StoreReader

    artifacts, results = runs
    uri = f"sqlite:///{artifacts / 'mlflow.db'}"
    pages = []
    for client in (StoreReader(uri), retrying_client(uri)):
        run = resolve_runs(client, [results["long"]["run_name"]], artifacts)[0]
        page = report.run_page(report.load_view(client, run, artifacts))
        pages.append(re.sub(r"written by posttrain [0-9: -]+;", "", page))
    assert len(pages[0]) > 1_000_000 and pages[0] == pages[1]


@needs_chromium
def test_report_page_shows_the_runs_curves_flips_costs_and_stages(runs, tmp_path, capsys):
    artifacts, results = runs
    result = results["long"]
    name, run_id = result["run_name"], result["mlflow_run_id"]
    out = tmp_path / "long.html"
    assert main(["report", name, "-o", str(out), "--artifacts", str(artifacts)]) == 0
    assert str(out) in capsys.readouterr().out
    dom, charts, tables = rendered(out, tmp_path)

    # curves: each round's values as MLflow has them, placed and drawn by plotly
    for chart, metric in (("curve-reward", "train/reward_mean"), ("curve-kl", "train/kl"),
                          ("curve-entropy", "train/entropy"), ("curve-length", "train/completion_length"),
                          ("curve-clip", "train/clip_ratio"),
                          ("curve-reward", "rewards/even_length/mean")):
        shown = trace(charts, chart, metric)
        assert flat(shown["points"]) == pytest.approx(flat(history(artifacts, run_id, metric))), metric
        assert [step for step, _ in shown["points"]] == [1, 2] and shown["drawn"] == 2, metric
    accuracy = trace(charts, "curve-accuracy", "eval/accuracy")
    assert flat(accuracy["points"]) == pytest.approx([0, result["base_accuracy"], 2, result["final_accuracy"]])
    assert flat(accuracy["points"]) == pytest.approx(flat(history(artifacts, run_id, "eval/accuracy")))
    # the healthy bands of the run's health.* settings (defaults: KL <= 2, clip ratio <= 0.3, entropy >= 0.01)
    assert [0, 2] in charts["curve-kl"]["shapes"] and [0, 0.3] in charts["curve-clip"]["shapes"]
    assert any(low == 0.01 for low, _ in charts["curve-entropy"]["shapes"])
    bars = next(t for t in charts["eval-bars"]["traces"] if t["type"] == "bar")
    assert [v for _, v in bars["points"]][:2] == pytest.approx([result["base_accuracy"], result["final_accuracy"]])
    assert bars["points"][2][1] == pytest.approx(result["constant_baseline"])

    # flips: the held-out prompts whose verdict differs between the base and the final eval, both completions
    base, final = ({r["prompt_id"]: r for r in pq.read_table(stage_folder(artifacts, name, label) / "eval.parquet")
                    .to_pylist()} for label in ("eval base", "eval final"))
    learned = [[p, str(base[p]["completion"]), str(final[p]["completion"])] for p in base
               if not base[p]["correct"] and final[p]["correct"]]
    unlearned = [[p, str(base[p]["completion"]), str(final[p]["completion"])] for p in base
                 if base[p]["correct"] and not final[p]["correct"]]
    assert learned or unlearned, "the fixture's runs should flip some verdicts"
    for table_id, expected in (("flips-wrong-to-right", learned), ("flips-right-to-wrong", unlearned)):
        rows = tables.get(table_id, [[]])[1:]
        assert [[r[0], r[2], r[4]] for r in rows] == expected, table_id
    assert f"wrong -> right {len(learned)}, right -> wrong {len(unlearned)}" in html.unescape(dom)

    # cost: a row per stage, in flow order, with what its manifest recorded
    stages = stages_of(artifacts, name)
    cost = tables["cost"]
    assert [r[0] for r in cost[1:]] == [s["stage"] for s in stages]
    for row, stage in zip(cost[1:], stages):
        manifest = json.loads((Path(stage["path"]) / MANIFEST).read_text())
        assert row[1] == ("cached (cost avoided)" if stage["status"] == "cached" else "computed")
        recorded = manifest.get("cost")
        if recorded:  # a manifest with the cost key: its wall and token counts
            assert row[2] == fmt_seconds(recorded["wall_s"]) and row[6] == fmt_count(recorded.get("tokens_generated"))
        else:
            assert row[2] == fmt_seconds(manifest["wall_time_s"]) and row[3:] == ["-"] * 6
    assert any(s["status"] == "cached" for s in stages) and any(s["status"] == "computed" for s in stages)
    run_cost = json.loads((artifacts / "runs" / name / "summary.json").read_text()).get("cost")
    if run_cost:  # the run's totals (tasks/costs.py), where its summary has them
        spent = tables["cost-totals"][1]
        assert spent[0] == "spent by this run" and spent[1] == fmt_seconds(run_cost["spent"]["wall_s"])
        assert spent[6] == fmt_count(run_cost["spent"]["tokens_trained"])

    # stages: flow order, cached/computed, content keys
    assert [[r[1], r[2], r[4]] for r in tables["stages"][1:]] == [
        [s["stage"], s["status"], Path(s["path"]).name] for s in stages]

    # sample completions of each round, as MLflow got them
    from tasks.publish import sample_completions

    for r in (0, 1):
        expected = sample_completions(stage_folder(artifacts, name, f"score r{r}") / "scored.parquet", 8)
        assert [[row[0], row[4]] for row in tables[f"samples-r{r}"][1:]] == [
            [s["prompt_id"], s["completion"]] for s in expected]


def fmt_seconds(value) -> str:
    from flows.compare import fmt_duration

    return fmt_duration(value)


def fmt_count(value) -> str:
    from flows.compare import fmt_number

    return "-" if value is None else fmt_number(value)


@needs_chromium
def test_diff_html_shows_both_runs_flips_and_curves(runs, tmp_path, capsys):
    artifacts, results = runs
    a, b = results["long"], results["short"]
    out = tmp_path / "diff.html"
    assert main(["diff", a["run_name"], b["run_name"], "--artifacts", str(artifacts), "--json", "--html",
                 str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    dom, charts, tables = rendered(out, tmp_path)
    flipped = 0
    for direction in ("right_to_wrong", "wrong_to_right"):
        rows = tables.get(f"flips-{direction.replace('_', '-')}", [[]])[1:]
        assert [[r[0], r[3], r[5]] for r in rows] == [
            [f["prompt_id"], str(f["completions"][0]), str(f["completions"][1])] for f in data[direction]]
        flipped += len(rows)
    assert flipped, "the fixture's runs should flip some verdicts"
    for result, steps in ((a, [1, 2]), (b, [1])):
        shown = trace(charts, "curve-reward", "train/reward_mean", result["run_name"])
        assert flat(shown["points"]) == pytest.approx(flat(history(artifacts, result["mlflow_run_id"],
                                                                    "train/reward_mean")))
        assert [s for s, _ in shown["points"]] == steps
    assert shown["points"][0] == trace(charts, "curve-reward", "train/reward_mean", a["run_name"])["points"][0]


def test_a_report_that_cannot_be_written_is_a_warning_not_a_failed_run(runs, tmp_path, monkeypatch):
    """The end-of-run hook on a finished run whose run folder is not a folder: None and a warning, no exception."""
    from flows.config import load_config
    from flows.report import run_report
    from tasks.lineage import Lineage
    from tasks.reporting import Reporter
    from tasks.stage_tasks import RunContext
    from tasks.store import ArtifactStore

    artifacts, results = runs
    result = results["long"]
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    summary = json.loads((artifacts / "runs" / result["run_name"] / "summary.json").read_text())
    ctx = RunContext(load_config(str(artifacts.parent / "tiny.yaml")), ArtifactStore(artifacts),
                     Lineage(artifacts, "test-tiny"), Reporter(artifacts, quiet=True))
    not_a_folder = tmp_path / result["run_name"]
    not_a_folder.write_text("a file where the run folder should be")
    assert run_report(ctx, result["mlflow_run_id"], not_a_folder, summary) is None
    assert len(ctx.reporter.warnings) == 1 and "the run report was not written" in ctx.reporter.warnings[0]
    assert f"posttrain report {result['run_name']}" in ctx.reporter.warnings[0]


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path, capsys):
    artifacts, _ = runs
    assert main(["report", "no-such-run", "--artifacts", str(artifacts)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown run 'no-such-run'") and err.count("\n") == 1
    assert main(["report", "any", "--artifacts", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no MLflow store at") and str(tmp_path / "nothing") in err


def test_cli_start_imports_neither_mlflow_nor_plotly():
    check = ("import sys, flows.cli; bad = [m for m in ('mlflow', 'plotly') if m in sys.modules]; "
             "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", check], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
