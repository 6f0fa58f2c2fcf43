"""Concurrent runs in one artifacts folder: N `posttrain run` processes started at once share the MLflow
store (<artifacts>/mlflow.db) and Prefect's database (<artifacts>/prefect/prefect.db, opened by every run's
temporary Prefect server); none may die on a lock (issue 25, item 5).

  nice -n 10 .venv/bin/python benchmarks/concurrent_runs.py [--runs 4] [--config configs/quickstart.yaml]
      [--full] [--set KEY=VALUE ...] [--stagger S] [--work DIR] [--out PATH] [--json]

Run i gets `seed=i` and `name=<config name>-c<i>` (distinct run names, experiments and cache keys: each run
computes its own base model, SFT and rounds; demo_data and transform do not depend on the seed, so the runs
share them, computed once under the store's lock). Unless --full, each run is shortened by SHORT (the tiny
model and data of tests/conftest.py, 2 GRPO rounds); --set adds or overrides. Every run registers the same
export.model_name, so the model registry is written by all of them, as are the champion/challenger aliases.
--stagger S starts run i S x i seconds after the first (runs that start while others train and finish).

Reported per run: exit code, wall time, the MLflow parent run's status (FINISHED wanted) and its Prefect flow
run's state (COMPLETED wanted), the number of "database is locked" lines in its output (tracebacks MLflow or
Prefect logged on a lock, retried or not; "Failed to send telemetry" lines are counted in the JSON), and its
last error line when it failed. Exit code 1 when any run
failed. Logs: <work>/logs/run-<i>.log; the artifacts folder: <work>/artifacts.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent

SHORT = ["demo_data.num_sft=300", "demo_data.num_train=64", "demo_data.num_eval=24", "model.hidden_size=64",
         "model.num_attention_heads=1", "model.num_key_value_heads=1", "model.intermediate_size=128",
         "model.num_hidden_layers=2", "model.vocab_size=300", "sft.num_train_epochs=1", "sft.save_steps=500",
         "rollout.num_generations=4", "rollout.prompts_per_round=8", "rollout.max_completion_length=8",
         "score.reward_num_workers=1", "grpo.rounds=2", "grpo.micro_batch_size=16",
         "grpo.gradient_accumulation_steps=1", "grpo.skip_zero_advantage_batches=false",
         "eval.max_completion_length=8"]
"""Overrides that make a quickstart run ~1 minute alone on 2 cores (tests/conftest.py `tiny_config_text`)."""


def env_for(artifacts: Path) -> dict:
    """The ephemeral Prefect and sqlite MLflow store of this artifacts folder, whatever the shell has set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_HOME", "MLFLOW_TRACKING"))}
    return {**env, "PREFECT_HOME": str(artifacts / "prefect")}


def query(db: Path, sql: str, params: tuple = ()) -> list[tuple]:
    """Read-only query on a sqlite file (waits up to 60 s for a writer); [] when it cannot be read."""
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=60)) as con:
            return con.execute(sql, params).fetchall()
    except sqlite3.Error:
        return []


def outcome(artifacts: Path, pid: int) -> dict:
    """The MLflow parent run the process `pid` opened (tag posttrain.pid) and its Prefect flow run's state."""
    found = query(artifacts / "mlflow.db",
                  "SELECT r.name, r.status, (SELECT value FROM tags f WHERE f.run_uuid = r.run_uuid AND "
                  "f.key = 'prefect.flow_run_id') FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                  "WHERE t.key = 'posttrain.pid' AND t.value = ? AND NOT EXISTS (SELECT 1 FROM tags p WHERE "
                  "p.run_uuid = r.run_uuid AND p.key = 'mlflow.parentRunId')", (str(pid),))
    if not found:
        return {"run_name": None, "mlflow": "no parent run", "prefect": None}
    name, status, flow_run_id = found[-1]
    state = query(artifacts / "prefect" / "prefect.db", "SELECT state_type FROM flow_run WHERE id = ?",
                  (flow_run_id.replace("-", ""),)) or query(
        artifacts / "prefect" / "prefect.db", "SELECT state_type FROM flow_run WHERE id = ?", (flow_run_id,))
    return {"run_name": name, "mlflow": status, "prefect": state[0][0] if state else f"no flow run {flow_run_id}"}


def last_error(log: Path) -> str:
    """The last line of the log that names an error (else its last line)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line or "Exception" in line]
    return (errors or lines or [""])[-1].strip()[:300]


def table(summary: dict) -> str:
    """One line per run, then the totals."""
    header = ["run", "exit", "wall s", "MLflow", "Prefect", "'locked' lines", "run name / error"]
    rows = [[str(r["run"]), str(r["exit_code"]), f"{r['wall_s']:.1f}", str(r["mlflow"]), str(r["prefect"]),
             str(r["locked_lines"]), r["run_name"] if r["ok"] else f"{r['run_name']}: {r['error']}"]
            for r in summary["results"]]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    load = ", ".join(f"{x:.1f}" for x in summary["load_average"])
    at_once = f"{summary['stagger_s']:g} s apart" if summary["stagger_s"] else "at once"
    return "\n".join([*lines, f"{summary['runs']} runs started {at_once}, {summary['failed']} failed; all done after "
                             f"{summary['wall_s']:.0f} s; load average at the end {load}; work {summary['work']}"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=4, help="runs started at once (default 4)")
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--full", action="store_true", help="the config as it is, not shortened by SHORT")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override passed to every run, e.g. --set grpo.rounds=3 (repeatable)")
    parser.add_argument("--stagger", type=float, default=0.0, help="seconds between starts (default 0: all at once)")
    parser.add_argument("--seed0", type=int, default=0, help="run i gets seed seed0 + i (default 0)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the artifacts folder and logs (kept)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON summary here")
    parser.add_argument("--json", action="store_true", help="print the JSON summary instead of the table")
    args = parser.parse_args()
    work = (args.work or Path(tempfile.mkdtemp(prefix="posttrain-concurrent-"))).resolve()
    artifacts, logs = work / "artifacts", work / "logs"
    if artifacts.exists():
        sys.exit(f"{artifacts} exists; the runs need a fresh artifacts folder (another --work)")
    logs.mkdir(parents=True, exist_ok=True)
    name = yaml.safe_load((ROOT / args.config).read_text())["name"]
    posttrain = [sys.executable, "-m", "flows.cli"]  # `posttrain` of this checkout (cwd ROOT)

    started, processes = time.perf_counter(), []
    for i in range(args.runs):
        seed = args.seed0 + i
        if i and args.stagger:
            time.sleep(args.stagger)
        command = [*posttrain, "run", args.config, "--quiet", f"artifacts_dir={artifacts}", f"seed={seed}",
                   f"name={name}-c{seed}", *([] if args.full else SHORT), *args.set]
        with open(logs / f"run-{i}.log", "w") as out:
            processes.append((command, time.perf_counter(),
                              subprocess.Popen(command, cwd=ROOT, env=env_for(artifacts), stdout=out,
                                               stderr=subprocess.STDOUT)))
    ended: dict[int, float] = {}
    while len(ended) < len(processes):  # poll, so each run's wall time ends when it does
        for i, (_, _, process) in enumerate(processes):
            if i not in ended and process.poll() is not None:
                ended[i] = time.perf_counter()
        time.sleep(0.5)
    results = [{"run": i, "pid": process.pid, "exit_code": process.returncode, "wall_s": round(ended[i] - began, 1)}
               for i, (_, began, process) in enumerate(processes)]
    for i, row in enumerate(results):
        log = logs / f"run-{i}.log"
        text = log.read_text(errors="replace")
        row.update(outcome(artifacts, row["pid"]))
        row["locked_lines"] = text.count("database is locked")
        row["telemetry_errors"] = text.count("Failed to send telemetry")
        row["ok"] = row["exit_code"] == 0 and row["mlflow"] == "FINISHED" and row["prefect"] == "COMPLETED"
        if not row["ok"]:
            row["error"] = last_error(log)
            row["log"] = str(log)
    summary = {"runs": args.runs, "stagger_s": args.stagger, "config": args.config,
               "overrides": ([] if args.full else SHORT) + args.set,
               "wall_s": round(time.perf_counter() - started, 1), "failed": sum(not r["ok"] for r in results),
               "load_average": os.getloadavg(), "work": str(work), "results": results}
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2) if args.json else table(summary))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
