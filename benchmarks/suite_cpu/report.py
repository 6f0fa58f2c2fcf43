"""The test suite's CPU by kind of process and by test (issue 43 item 1: the suite is CPU-bound on 2 cores).

    rm -rf /tmp/suite-cpu && mkdir -p /tmp/suite-cpu/procs
    PYTHONPATH=$PWD/benchmarks/suite_cpu PROC_LOG_DIR=/tmp/suite-cpu/procs TIMELINE_FILE=/tmp/suite-cpu/tests.tsv \\
        PYTEST_ADDOPTS="-p pytest_timeline" make test
    .venv/bin/python benchmarks/suite_cpu/report.py /tmp/suite-cpu/procs /tmp/suite-cpu/tests.tsv

A test's CPU = its pytest worker's own CPU during it (pytest_timeline.py) + every process started under it
(sitecustomize.py). A session fixture's processes (the Prefect harness server) count to the test whose setup started
them. Non-Python processes (Ray's raylet and GCS, Chromium, uv) are not seen."""

import argparse
import collections
import json
import os
from pathlib import Path


def kind(argv: list[str], test: str | None) -> str:
    line = " ".join(argv)
    for marker, name in (("default_worker.py", "Ray worker"), ("dashboard", "Ray dashboard agent"),
                         ("log_monitor", "Ray log monitor"), ("uvicorn", "Prefect server (uvicorn)"),
                         ("--app-dir", "Prefect server (uvicorn)"), ("posttrain-ranks-", "torchrun rank"),
                         ("--multiprocessing-fork", "forked child (vLLM engine core, ...)"),
                         ("compileall", "install: bytecode"), ("vllm", "vLLM server")):
        if marker in line:
            return name
    head = os.path.basename(argv[0]) if argv else "?"
    if head == "-c":
        return "pytest worker" if test is None else "python -c script"
    if head == "-m" and len(argv) > 1:
        return f"python -m {argv[1]}"
    return f"{head} {argv[1] if len(argv) > 1 else ''}".strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("procs", type=Path)
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()

    by_kind, count = collections.Counter(), collections.Counter()
    by_test = collections.Counter()
    for path in args.procs.glob("*.json"):
        proc = json.loads(path.read_text())
        test = (proc.get("test") or "").rsplit(" (", 1)[0] or None
        name = kind(proc.get("argv") or [], test)
        by_kind[name] += proc.get("cpu", 0.0)
        count[name] += 1
        if test and name != "pytest worker":
            by_test[test] += proc.get("cpu", 0.0)
    in_worker, wall = collections.Counter(), collections.Counter()
    for line in args.timeline.read_text().splitlines():
        _, start, end, cpu, nodeid = line.split("\t")
        in_worker[nodeid] += float(cpu)
        wall[nodeid] += float(end) - float(start)

    print(f"Python processes: {sum(count.values())}, {sum(by_kind.values()) / 60:.1f} CPU-minutes")
    for name, cpu in by_kind.most_common():
        print(f"  {cpu / 60:6.1f} min  {count[name]:4d} processes  {name}")
    total = {t: in_worker[t] + by_test[t] for t in set(in_worker) | set(by_test)}
    files = collections.Counter()
    for test, cpu in total.items():
        files[test.split("::")[0]] += cpu
    print(f"\nBy file (CPU s; tests' own {sum(in_worker.values()) / 60:.1f} min in the workers, "
          f"{sum(by_test.values()) / 60:.1f} min in their processes):")
    for name, cpu in files.most_common(args.top):
        print(f"  {cpu:6.0f}  {name}")
    print("\nBy test (CPU s = in the worker + in its processes; wall s):")
    for test, cpu in sorted(total.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {cpu:6.0f} = {in_worker[test]:5.0f} + {by_test[test]:5.0f}  wall {wall[test]:5.0f}  {test}")


if __name__ == "__main__":
    main()
