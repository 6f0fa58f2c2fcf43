"""Chaos: SIGKILL the whole `posttrain` process group at random moments until the run finishes, then check
that nothing is corrupted and the result equals an uninterrupted run's (issue 13, item 2).

  nice -n 10 .venv/bin/python benchmarks/chaos.py [--config configs/quickstart.yaml] [--seed 0] [--delays 3 30]
      [--min-kills 30] [--max-kills 60] [--set KEY=VALUE ...] [--work DIR] [--out PATH]
  nice -n 10 .venv/bin/python benchmarks/chaos.py --config configs/dpo.yaml
  nice -n 10 .venv/bin/python benchmarks/chaos.py --sweep [--sweep-after 0 2]
  nice -n 10 .venv/bin/python benchmarks/chaos.py --data-add [--data-kills 10] [--data-rows 50000]
  nice -n 10 .venv/bin/python benchmarks/chaos.py --faults [--probe NAME ...] [--list-probes]

Pipeline mode, in artifacts folders under --work:
1. reference/: `posttrain run CONFIG` to completion (uninterrupted wall), then again (cached rerun wall);
   reused by later calls with the same config and overrides (walls.json).
2. chaos-seed<N>/ (fresh): start, SIGKILL the process group after a delay drawn uniformly from --delays, start
   again -- `posttrain resume <parent run id>` once the MLflow parent run exists, `posttrain run` before --
   until a start finishes; after --max-kills kills it is left to finish. A kill landed in the stages whose temp
   folders (`.tmp-<key>-<pid>-*`) the killed process had open, else in `startup` (before it opened or resumed
   the parent run: imports, Prefect server, MLflow store) or `between` (MLflow/Prefect writes, torch imports).
3. checks: manifests (files, sizes, sha256, inputs), temp folders, sqlite integrity, MLflow parent runs, metric
   steps logged twice, processes that outlived a kill, and the parent's metric histories (timings left out),
   params, artifacts and the artifacts' files against the uninterrupted run's.
Work lost per kill = (kill-loop wall - uninterrupted wall - kills x cached rerun wall) / kills (goal <= 10 s),
the kill-loop wall being the time posttrain processes ran.

--sweep (chaos-sweep-seed<N>/): instead of random moments, each start is killed once the run opens a temp folder
in a stage it has not been killed in yet (first seen in demo_data, transform, sft, rollout, score, optimize, eval,
export, ...), after a delay drawn uniformly from --sweep-after (default 0-2 s; a short stage may have finished by
then: the kill lands between stages, in MLflow/Prefect writes). Random kills at 3-30 s mostly land in startup and
the first long stage; this puts a kill into every stage the config has, with the same checks after it.

Data mode: `posttrain data add` of a new file, killed --data-kills times at moments drawn uniformly within one
add's duration and once as soon as its temp folder appears; then every registered version's files and sha256
are valid, each file can be added again and `data list` shows its version exactly once.

Faults mode (benchmarks/chaos_faults.py): issue 42's probes as a new user or a faulty machine would run them
(bad rewards, damaged cache files, bad data rows, a disk that fills, overlong prompts, the reward server's
limits, SIGINT/SIGTERM, a library on PYTHONPATH, a reward's memory, bad configs), each on the tiny test config:
exit code, a one-line message naming what is wrong, no traceback, and a rerun that nothing cached trips.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import closing
from pathlib import Path

import yaml

from chaos_common import MANIFEST, ROOT, env_for, reap_survivors, verify_manifests  # noqa: E402
from tasks.store import sha256_file  # noqa: E402

TOLERANCE = 1e-6



def start(args: list[str], artifacts: Path, log: Path) -> subprocess.Popen:
    """`posttrain ARGS` from this checkout, in its own process group, output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env_for(artifacts),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def run_to_end(args: list[str], artifacts: Path, log: Path) -> float:
    """`posttrain ARGS` to completion; its wall seconds (exits naming the log on failure)."""
    started = time.perf_counter()
    if start(args, artifacts, log).wait() != 0:
        sys.exit(f"posttrain {' '.join(args)} failed; see {log}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - started


def query(artifacts: Path, sql: str, params: tuple = (), db: str = "mlflow.db") -> list[tuple]:
    """Read-only query on a sqlite file under `artifacts`, [] while it or its tables do not exist (never creates
    or migrates it)."""
    db = artifacts / db
    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as con:
            return con.execute(sql, params).fetchall()
    except sqlite3.Error:
        return []


def parent_runs(artifacts: Path, experiment: str) -> list[tuple[str, str, str]]:
    """(run id, name, status) of the experiment's pipeline parent runs, oldest first."""
    return query(artifacts, "SELECT r.run_uuid, r.name, r.status FROM runs r JOIN experiments e "
                 "ON r.experiment_id = e.experiment_id WHERE e.name = ? AND NOT EXISTS (SELECT 1 FROM tags t "
                 "WHERE t.run_uuid = r.run_uuid AND t.key = 'mlflow.parentRunId') ORDER BY r.start_time", (experiment,))


def landed(artifacts: Path, pid: int, log: Path) -> dict:
    """Where the kill of process `pid` landed (see the module docstring), and the nested runs left RUNNING."""
    stages = sorted({str(t.parent.relative_to(artifacts)) for t in artifacts.glob("**/.tmp-*")
                     if f"-{pid}-" in t.name and t.is_dir()})
    opened = query(artifacts, "SELECT 1 FROM tags WHERE key = 'posttrain.pid' AND value = ?", (str(pid),))
    running = query(artifacts, "SELECT r.name FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                    "WHERE t.key = 'mlflow.parentRunId' AND r.status = 'RUNNING'")
    creating_store = "database tables" in (log.read_text().strip().splitlines() or [""])[-1]  # MLflow's last line
    where = "+".join(stages) or ("between" if opened else "startup: MLflow store" if creating_store else "startup")
    return {"stage": where, "mlflow_running": sorted(name for (name,) in running)}



def reference(config: str, overrides: list[str], artifacts: Path) -> dict:
    """Walls of an uninterrupted run and a fully cached rerun in a fresh folder (saved; reused when they match)."""
    saved, command = artifacts.parent / "walls.json", [config, *overrides]
    if saved.exists() and json.loads(saved.read_text())["command"] == command:
        return json.loads(saved.read_text())["walls"]
    if artifacts.exists():
        sys.exit(f"{artifacts} holds another reference than {command}; pick another --work")
    run = ["run", config, "--quiet", f"artifacts_dir={artifacts}", *overrides]
    walls = {"uninterrupted_s": round(run_to_end(run, artifacts, artifacts.parent / "logs" / "reference.log"), 1),
             "cached_rerun_s": round(run_to_end(run, artifacts, artifacts.parent / "logs" / "cached.log"), 1)}
    saved.write_text(json.dumps({"command": command, "walls": walls}))
    return walls


def opened_stage(process: subprocess.Popen, artifacts: Path, skip: set[str]) -> str | None:
    """Poll until `process` opens a temp folder in a stage folder not in `skip`; that stage, or None once the
    process has ended."""
    while process.poll() is None:
        for temp in artifacts.glob(f"*/.tmp-*-{process.pid}-*"):
            if temp.parent.name not in skip:
                return temp.parent.name
        time.sleep(0.05)
    return None


def kill_loop(config: str, overrides: list[str], artifacts: Path, experiment: str, rng: random.Random,
              delays: tuple[float, float], max_kills: int, sweep_after: tuple[float, float] | None = None) -> dict:
    """Start, kill after a random delay, start again (resume once the parent run exists) until a start ends.
    With `sweep_after`, a start is killed that many seconds after it opens a stage not yet targeted instead."""
    kills, survivors, failure, wall = [], [], None, 0.0  # wall: seconds posttrain processes ran (checks left out)
    targeted: set[str] = set()
    while True:
        parents = parent_runs(artifacts, experiment)
        command = (["resume", parents[-1][0], "--artifacts", str(artifacts), "--quiet"] if parents
                   else ["run", config, "--quiet", f"artifacts_dir={artifacts}", *overrides])
        log, delay = artifacts.parent / "logs" / f"start-{len(kills):03d}.log", rng.uniform(*delays)
        began = time.perf_counter()
        process = start(command, artifacts, log)
        target = None
        if sweep_after and len(kills) < max_kills:
            target = opened_stage(process, artifacts, targeted)
            targeted.add(target or "")
            delay = rng.uniform(*sweep_after)
        try:
            code = process.wait(timeout=delay if len(kills) < max_kills and (target or not sweep_after) else None)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            wall += time.perf_counter() - began
            kills.append({"start": command[0], "delay_s": round(delay, 2), **({"target": target} if target else {}),
                          **landed(artifacts, process.pid, log)})
            time.sleep(0.2)  # let the kernel finish off the group before looking for survivors
            survivors += [{"kill": len(kills), "cmdline": c} for c in reap_survivors(artifacts)]
            continue
        wall += time.perf_counter() - began
        if code != 0:  # not killed, failed: the run cannot go on (the checks still run)
            failure = {"start": command[0], "exit_code": code, "log": str(log),
                       "error": (log.read_text().strip().splitlines() or [""])[-1][:300]}
        return {"wall_s": round(wall, 1), "kills": kills, "survivors": survivors, "failure": failure}



def verify_databases(artifacts: Path) -> dict:
    """sqlite integrity of the MLflow and Prefect stores, and Prefect's flow runs by state."""
    checks = {name: ", ".join(row[0] for row in query(artifacts, "PRAGMA quick_check", db=db)) or "unreadable"
              for name, db in (("mlflow", "mlflow.db"), ("prefect", "prefect/prefect.db"))}
    states = query(artifacts, "SELECT state_type, COUNT(*) FROM flow_run GROUP BY state_type", db="prefect/prefect.db")
    return {"quick_check": checks, "prefect_flow_runs": dict(states)}


def differing_artifacts(artifacts: Path, reference_root: Path) -> list[str]:
    """Artifacts (same stage/key in both folders) whose files differ from the uninterrupted run's, oldest first;
    PEFT's README.md and adapter_config.json left out (they name the artifacts folder)."""
    out = []
    by_time = lambda m: json.loads(m.read_text())["created_at"]  # noqa: E731
    for manifest in sorted(reference_root.glob(f"*/*/{MANIFEST}"), key=by_time):
        mine = artifacts / manifest.relative_to(reference_root)
        if mine.is_file():
            want, got = (json.loads(m.read_text())["files"] for m in (manifest, mine))
            names = [n for n in want if Path(n).name not in ("README.md", "adapter_config.json")
                     and want[n]["sha256"] != got.get(n, {}).get("sha256")]
            out += [f"{manifest.parent.relative_to(reference_root)} ({', '.join(names)})"] if names else []
    return out


def experiment_runs(artifacts: Path, experiment: str):
    """(client, every run of the experiment) of an artifacts folder's MLflow store."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{artifacts / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    return client, client.search_runs([found.experiment_id], max_results=10000) if found else []


def duplicate_steps(client, runs) -> list[dict]:
    """(run name, metric, steps logged more than once) in any of the runs."""
    found = []
    for run in runs:
        for key in run.data.metrics:
            steps = Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
            if max(steps.values()) > 1:
                found.append({"run": run.info.run_name, "metric": key,
                              "steps": {s: n for s, n in steps.items() if n > 1}})
    return found


def histories(client, run) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of a run, timings (time/*, *_s) left out."""
    return {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in run.data.metrics
            if not (k.startswith("time/") or k.endswith("_s"))}


def verify_mlflow(artifacts: Path, experiment: str, reference_root: Path) -> dict:
    """Parent runs, duplicate metric steps (and which the uninterrupted run has too), run statuses, and the
    parent's metric histories, params and artifacts against the uninterrupted run's."""
    client, runs = experiment_runs(artifacts, experiment)
    ref_client, ref_runs = experiment_runs(reference_root, experiment)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    duplicates = duplicate_steps(client, runs)
    uninterrupted = {(d["run"], d["metric"]) for d in duplicate_steps(ref_client, ref_runs)}
    out = {"parent_runs": [f"{r.info.run_name} ({r.info.status})" for r in parents],
           "run_statuses": dict(Counter(r.info.status for r in runs)), "duplicate_metric_steps": duplicates,
           "duplicates_not_in_uninterrupted": [d for d in duplicates if (d["run"], d["metric"]) not in uninterrupted]}
    if len(parents) != 1:
        return out
    ref = min((r for r in ref_runs if "mlflow.parentRunId" not in r.data.tags),
              key=lambda r: r.info.start_time)  # the uninterrupted run, not the cached rerun
    got, want = histories(client, parents[0]), histories(ref_client, ref)
    diffs = [{"metric": k, "step": s, "reference": want.get(k, {}).get(s), "kill_loop": got.get(k, {}).get(s)}
             for k in sorted(set(got) | set(want)) for s in sorted(set(got.get(k, {})) | set(want.get(k, {})))
             if s not in got.get(k, {}) or s not in want.get(k, {}) or abs(got[k][s] - want[k][s]) > TOLERANCE]
    return {**out, "metrics_equal": not diffs, "metric_diffs": diffs,
            "final_metrics": {k: v[max(v)] for k, v in got.items()},
            "missing_params": sorted(set(ref.data.params) - set(parents[0].data.params)),
            "missing_artifacts": sorted({a.path for a in ref_client.list_artifacts(ref.info.run_id)}
                                        - {a.path for a in client.list_artifacts(parents[0].info.run_id)})}


def guarded(check, *args) -> dict:
    """check(*args), or {"error": ...} when it raises (e.g. on an MLflow store the kills left unreadable)."""
    try:
        return check(*args)
    except Exception as e:  # reported, not raised: the other checks still count
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def pipeline_mode(args, work: Path) -> dict:
    experiment = yaml.safe_load((ROOT / args.config).read_text())["name"]
    ref_root = work / "reference" / "artifacts"
    loop_root = work / f"chaos-{'sweep-' if args.sweep else ''}seed{args.seed}" / "artifacts"
    if loop_root.exists():
        sys.exit(f"{loop_root} exists; the kill loop needs a fresh folder (another --seed or --work)")
    ref = reference(args.config, args.set, ref_root)
    loop = kill_loop(args.config, args.set, loop_root, experiment, random.Random(args.seed), tuple(args.delays),
                     args.max_kills, tuple(args.sweep_after) if args.sweep else None)
    kills = len(loop["kills"])
    lost = (loop["wall_s"] - ref["uninterrupted_s"] - kills * ref["cached_rerun_s"]) / kills if kills else None
    return {"mode": "pipeline", "config": args.config, "overrides": args.set, "seed": args.seed,
            "sweep_after_s": args.sweep_after if args.sweep else None,
            "targeted_stages": [k["target"] for k in loop["kills"] if "target" in k],
            "delays_s": args.delays, "min_kills": args.min_kills, "max_kills": args.max_kills, **ref,
            "kill_loop_wall_s": loop["wall_s"], "kills_survived": kills, "min_kills_met": kills >= args.min_kills,
            "kill_cap_reached": kills >= args.max_kills,
            "work_lost_per_kill_s": round(lost, 1) if lost is not None else None,
            "kills_per_stage": dict(Counter(k["stage"] for k in loop["kills"]).most_common()),
            "run_folders": sorted(p.name for p in (loop_root / "runs").glob("*")),
            "failure": loop["failure"], "survivors": loop["survivors"], "artifacts": verify_manifests(loop_root),
            "databases": verify_databases(loop_root), "differing_artifacts": differing_artifacts(loop_root, ref_root),
            "mlflow": guarded(verify_mlflow, loop_root, experiment, ref_root), "kills": loop["kills"],
            "work": str(work)}


def rows_file(path: Path, rows: int, seed: int) -> Path:
    """Question/answer rows of the demo task (the quickstart's question_answer transform reads them)."""
    rng = random.Random(seed)
    numbers = [[rng.randint(0, 9) for _ in range(5)] for _ in range(rows)]
    path.write_text("".join(json.dumps({"question": f"Which is the largest of {', '.join(map(str, n))}?",
                                        "answer": str(max(n))}) + "\n" for n in numbers))
    return path


def kill_data_add(command: list[str], artifacts: Path, registry: Path, version: str, delay: float | None,
                  log: Path) -> dict:
    """One `data add`, killed after `delay` s (None: as soon as its temp folder appears); where it landed."""
    began = time.perf_counter()
    process = start(command, artifacts, log)
    writing = lambda: any(f"-{process.pid}-" in t.name for t in registry.glob(".tmp-*"))  # noqa: E731
    while delay is None and process.poll() is None and not writing():
        time.sleep(0.001)
    try:
        process.wait(timeout=delay or 0)
        return {"delay_s": round(time.perf_counter() - began, 2), "stage": "finished before the kill"}
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    where = "write (temp folder)" if writing() else "registered" if (registry / version).exists() else "before write"
    return {"delay_s": round(time.perf_counter() - began, 2), "stage": where, "targeted": delay is None}


def data_mode(args, work: Path) -> dict:
    """Kill `data add` of new files; then the registry is intact and each file adds and lists once."""
    artifacts, config = work / "artifacts", work / "config.yaml"
    cfg = yaml.safe_load((ROOT / args.config).read_text())
    config.write_text(yaml.safe_dump({**cfg, "artifacts_dir": str(artifacts)}, sort_keys=False))
    registry, logs = artifacts / "data" / cfg["name"], work / "logs"
    add = lambda f: ["data", "add", str(f), "--config", str(config)]  # noqa: E731
    one_add_s = run_to_end(add(rows_file(work / "probe.jsonl", args.data_rows, 0)), artifacts, logs / "probe.log")
    rng, kills, files = random.Random(args.seed), [], []
    for i in range(args.data_kills + 1):  # the last one: killed as soon as its temp folder appears
        files.append(rows_file(work / f"rows-{i}.jsonl", args.data_rows, i + 1))
        delay = rng.uniform(0.0, one_add_s) if i < args.data_kills else None
        kills.append(kill_data_add(add(files[-1]), artifacts, registry, sha256_file(files[-1])[:12], delay,
                                   logs / f"add-{i}.log"))
    checks = verify_manifests(artifacts)
    readds = [start(add(f), artifacts, logs / f"readd-{i}.log").wait() for i, f in enumerate(files)]
    listed = subprocess.run([sys.executable, "-m", "flows.cli", "data", "list", "--config", str(config)], cwd=ROOT,
                            env=env_for(artifacts), capture_output=True, text=True).stdout
    shown = Counter(line.split()[0] for line in listed.splitlines() if line.strip())
    return {"mode": "data-add", "seed": args.seed, "rows_per_file": args.data_rows, "one_add_s": round(one_add_s, 2),
            "kills_survived": sum(k["stage"] != "finished before the kill" for k in kills),
            "kills_per_stage": dict(Counter(k["stage"] for k in kills)), "artifacts": checks,
            "readds_failed": sum(code != 0 for code in readds),
            "listed_not_once": {v: shown[v] for v in (sha256_file(f)[:12] for f in files) if shown[v] != 1},
            "after_readds": verify_manifests(artifacts), "kills": kills, "work": str(work)}


def print_table(s: dict) -> None:
    art, ml, failure = s["artifacts"], s.get("mlflow", {}), s.get("failure")
    kills = s["kills_survived"]
    if s["mode"] == "pipeline":
        kills = (f"{kills} (min {s['min_kills']} {'met' if s['min_kills_met'] else 'NOT met'}; cap {s['max_kills']} "
                 f"{'REACHED: it finished once kills stopped' if s['kill_cap_reached'] else 'not reached'})")
    rows = [("kills survived", kills), *((f"  in {stage}", n) for stage, n in s["kills_per_stage"].items()),
            *([("stages targeted (sweep)", ", ".join(s["targeted_stages"]))] if s.get("sweep_after_s") else []),
            ("manifests checked", art["manifests_checked"]), ("corrupted artifacts", len(art["corrupted"])),
            ("dangling manifest inputs", len(art["dangling_inputs"])),
            ("stale temp folders (never read)", art["stale_temp_folders"]),
            ("key folders without manifest", len(art["key_folders_without_manifest"]))]
    if s["mode"] == "data-add":
        rows += [("one data add (s)", s["one_add_s"]), ("re-adds failed", s["readds_failed"]),
                 ("versions not listed exactly once", len(s["listed_not_once"]))]
    elif "error" in ml:
        rows += [("MLflow checks", f"failed: {ml['error']}")]
    else:
        rows += [("parent runs", len(ml["parent_runs"])), ("run folders", len(s["run_folders"])),
                 ("duplicate metric steps (not in uninterrupted run)",
                  f"{len(ml['duplicate_metric_steps'])} ({len(ml['duplicates_not_in_uninterrupted'])})"),
                 ("final metrics equal", "not compared (needs one parent run)" if "metrics_equal" not in ml
                  else "yes" if ml["metrics_equal"] else f"no ({len(ml['metric_diffs'])} diffs)"),
                 ("parent params / artifacts missing",
                  f"{len(ml.get('missing_params', []))} / {len(ml.get('missing_artifacts', []))}")]
    if s["mode"] == "pipeline":
        db = s["databases"]
        rows += [("sqlite quick_check (MLflow / Prefect)", " / ".join(db["quick_check"].values())),
                 ("Prefect flow runs by state", db["prefect_flow_runs"]),
                 ("artifacts differing from the uninterrupted run's", f"{len(s['differing_artifacts'])}"
                  + (f", first {s['differing_artifacts'][0]}" if s["differing_artifacts"] else "")),
                 ("processes that outlived a kill", len(s["survivors"])),
                 ("start failed", f"yes: {failure['error']} ({failure['log']})" if failure else "no"),
                 ("uninterrupted wall (s)", s["uninterrupted_s"]), ("cached rerun wall (s)", s["cached_rerun_s"]),
                 ("kill-loop wall (s)", s["kill_loop_wall_s"]),
                 ("work lost per kill (s, goal <= 10)", s["work_lost_per_kill_s"])]
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override passed to posttrain, e.g. --set grpo.rounds=2 (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--delays", type=float, nargs=2, default=[3.0, 30.0], metavar=("MIN", "MAX"),
                        help="seconds after each start at which it is killed, drawn uniformly (default 3 30)")
    parser.add_argument("--min-kills", type=int, default=30, help="kills the measurement needs (reported: met or not)")
    parser.add_argument("--max-kills", type=int, default=60,
                        help="after this many kills the run is left to finish (reported: cap reached)")
    parser.add_argument("--sweep", action="store_true",
                        help="kill once in each stage the run reaches, --sweep-after s after it opens it")
    parser.add_argument("--sweep-after", type=float, nargs=2, default=[0.0, 2.0], metavar=("MIN", "MAX"))
    parser.add_argument("--data-add", action="store_true", help="kill `posttrain data add` instead of a run")
    parser.add_argument("--data-kills", type=int, default=10)
    parser.add_argument("--data-rows", type=int, default=50000, help="rows per data file (50000: ~3.5 MB)")
    parser.add_argument("--faults", action="store_true", help="issue 42's fault probes (benchmarks/chaos_faults.py)")
    parser.add_argument("--probe", action="append", default=[], metavar="NAME",
                        help="--faults: only this probe (repeatable; --list-probes names them)")
    parser.add_argument("--list-probes", action="store_true", help="name the --faults probes and exit")
    parser.add_argument("--work", type=Path, default=None, help="folder for the artifacts folders and logs (kept)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON summary here")
    args = parser.parse_args()
    if args.faults or args.list_probes:
        import chaos_faults

        if args.list_probes:
            return chaos_faults.list_probes()
    work = (args.work or Path(tempfile.mkdtemp(prefix="posttrain-chaos-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.faults:
        summary = chaos_faults.faults_mode(args, work)
    else:
        summary = data_mode(args, work) if args.data_add else pipeline_mode(args, work)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2, default=str))
    (chaos_faults.print_faults_table if args.faults else print_table)(summary)
    print(f"details: {args.out or work}")


if __name__ == "__main__":
    main()
