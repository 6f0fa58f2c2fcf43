"""How long the run report takes to write (issue 46: <= 5 s), on a real run of the store.

    .venv/bin/python benchmarks/report_speed.py [RUN] [--artifacts artifacts] [--repeat 3]

RUN: a run name or MLflow run id (default: the newest pipeline run in the store, e.g. the quickstart's after
`make run`). Three numbers:

- command: `posttrain report RUN -o <tmp>` in a new process, wall seconds, imports (MLflow's ~2-4 s) included:
  what a user waits for.
- in-process, first: flows/report.py `write_report` in a process that has MLflow loaded and a client open, the
  first page it writes (plotly's import included), plus a copy of the page (what logging it to the local MLflow
  artifact store does; not logged here, to leave the run as it is): what the end of `posttrain run` adds to a run
  (flows/pipeline.py calls `run_report`, which does the same reads and writes).
- in-process, again: the median of --repeat more pages in that process.
- with --hook: flows/report.py `run_report` itself, the end-of-run hook, on the run's own folder and MLflow run
  (it rewrites runs/<run>/report.html and logs it again as the run's artifact report.html, as the run did).

Prints the page's size and one line per number, wall and CPU seconds (CPU: less swayed by other processes on the
machine), and the load average; BENCHMARKS.md quotes them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", nargs="?", default=None, help="run name or MLflow run id (default: the newest)")
    parser.add_argument("--artifacts", default=str(ROOT / "artifacts"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hook", action="store_true", help="also time run_report, the end-of-run hook")
    args = parser.parse_args()

    from flows import report
    from flows.compare import open_client, search_parent_runs

    client = open_client(args.artifacts)
    parents = search_parent_runs(client)
    if not parents:
        sys.exit(f"no pipeline runs in {args.artifacts}: run `make run` (the quickstart) first")
    run = args.run or parents[0].info.run_name
    rounds = sum(1 for _ in client.get_metric_history(
        next(p.info.run_id for p in parents if run in (p.info.run_name, p.info.run_id)), "train/reward_mean"))

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.html"
        started, children = time.perf_counter(), os.times()
        done = subprocess.run([sys.executable, "-m", "flows.cli", "report", run, "-o", str(out), "--artifacts",
                               args.artifacts], cwd=ROOT, capture_output=True, text=True)
        command_s = time.perf_counter() - started
        command_cpu = sum(os.times()[2:4]) - sum(children[2:4])
        if done.returncode != 0:
            sys.exit(done.stderr)

        started, cpu = time.perf_counter(), time.process_time()
        path = report.write_report(run, args.artifacts, out)
        shutil.copyfile(path, Path(tmp) / "logged.html")  # what logging it to the local MLflow artifact store does
        first_s, first_cpu = time.perf_counter() - started, time.process_time() - cpu

        again, again_cpu = [], []
        for _ in range(args.repeat):
            started, cpu = time.perf_counter(), time.process_time()
            report.write_report(run, args.artifacts, out)
            again.append(time.perf_counter() - started)
            again_cpu.append(time.process_time() - cpu)
        size = out.stat().st_size

    print(f"run {run}: {rounds} rounds; page {size / 1e6:.1f} MB")
    print(f"command (new process, imports included): {command_s:.2f} s wall, {command_cpu:.2f} s CPU")
    print(f"in-process, first page + its copy (what a run adds at its end): {first_s:.2f} s wall, "
          f"{first_cpu:.2f} s CPU")
    print(f"in-process, again (median of {args.repeat}): {statistics.median(again):.2f} s wall, "
          f"{statistics.median(again_cpu):.2f} s CPU")
    if args.hook:
        print(f"end-of-run hook (run_report, MLflow artifact logged): {hook_seconds(run, args.artifacts)}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    return 0


def hook_seconds(run: str, artifacts: str) -> str:
    """run_report on the finished run, as `posttrain run` calls it at its end (a RunContext of the run's config)."""
    import json

    from flows.config import load_config
    from flows.report import run_report
    from tasks.lineage import Lineage
    from tasks.reporting import Reporter
    from tasks.stage_tasks import RunContext
    from tasks.store import ArtifactStore

    root = Path(artifacts).resolve()
    run_dir = root / "runs" / run
    if not (run_dir / "summary.json").exists():
        return f"- (no {run_dir / 'summary.json'}: pass the run's name)"
    summary = json.loads((run_dir / "summary.json").read_text())
    cfg = load_config(run_dir / "config.yaml", [])  # the run's resolved config, as `posttrain resume` loads it
    ctx = RunContext(cfg, ArtifactStore(root), Lineage(root, cfg.name), Reporter(root, quiet=True))
    ctx.lineage.client.get_run(summary["mlflow_run_id"])  # the store open, as it is at a run's end
    started, cpu = time.perf_counter(), time.process_time()
    if run_report(ctx, summary["mlflow_run_id"], run_dir, summary) is None:
        return f"failed: {ctx.reporter.warnings}"
    return f"{time.perf_counter() - started:.2f} s wall, {time.process_time() - cpu:.2f} s CPU"


if __name__ == "__main__":
    sys.exit(main())
