"""How busy the machine's cores are while the suite runs, and which tests ran while they were not.

report.py counts the CPU of Python processes only; this reads the whole machine (/proc/stat: every process,
Ray's C++ raylet and GCS, Chromium and the kernel included), so it answers whether the suite waits (idle cores:
more workers or less waiting would help) or computes (busy cores: only less work helps).

    .venv/bin/python benchmarks/suite_cpu/busy.py record /tmp/suite-cpu/busy.tsv &      # every 2 s until killed
    PYTHONPATH=$PWD/benchmarks/suite_cpu TIMELINE_FILE=/tmp/suite-cpu/tests.tsv PYTEST_ADDOPTS="-p pytest_timeline" \\
        make test
    kill %1
    .venv/bin/python benchmarks/suite_cpu/busy.py report /tmp/suite-cpu/busy.tsv /tmp/suite-cpu/tests.tsv [--below 1.5]

`report` prints the cores busy on average between the first test's start and the last one's end, the idle
core-minutes there, and each 10-second window whose mean is below --below cores with the tests running in it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

WINDOW_S = 10


def busy_cores(previous: list[int], current: list[int]) -> float:
    """Cores busy between two readings of /proc/stat's `cpu` line (idle and iowait count as not busy)."""
    delta = [c - p for c, p in zip(current, previous)]
    total = sum(delta) or 1
    return (os.cpu_count() or 1) * (total - delta[3] - delta[4]) / total


def cpu_times() -> list[int]:
    with open("/proc/stat") as stat:
        return [int(field) for field in stat.readline().split()[1:]]


def record(out: Path, every_s: float = 2.0) -> None:
    """Append `time<TAB>busy cores` to `out` every `every_s` seconds, until killed."""
    previous = cpu_times()
    with open(out, "a") as f:
        while True:
            time.sleep(every_s)
            current = cpu_times()
            f.write(f"{time.time():.1f}\t{busy_cores(previous, current):.2f}\n")
            f.flush()
            previous = current


def report(samples: Path, timeline: Path, below: float) -> None:
    tests = []
    for line in timeline.read_text().splitlines():
        worker, start, end, _cpu, nodeid = line.split("\t")
        if worker != "main":
            tests.append((worker, float(start), float(end), nodeid.split("@")[0]))
    first, last = min(t[1] for t in tests), max(t[2] for t in tests)
    readings = [(float(t), float(b)) for t, b in (line.split("\t")[:2] for line in samples.read_text().splitlines())]
    readings = [(t, b) for t, b in readings if first <= t <= last]
    if not readings:
        raise SystemExit(f"{samples} has no reading between the first test's start and the last one's end")
    cores = os.cpu_count() or 1
    mean = sum(b for _, b in readings) / len(readings)
    print(f"tests ran {(last - first) / 60:.1f} min; {mean:.2f} of {cores} cores busy on average; "
          f"idle {(cores - mean) * (last - first) / 60:.1f} core-minutes")
    windows: dict[int, list[float]] = {}
    for t, b in readings:
        windows.setdefault(int((t - first) // WINDOW_S), []).append(b)
    for index, values in sorted(windows.items()):
        busy = sum(values) / len(values)
        if busy < below:
            middle = first + (index + 0.5) * WINDOW_S
            running = [f"{w}: {n.removeprefix('tests/')}" for w, s, e, n in tests if s <= middle < e]
            print(f"{index * WINDOW_S:6d} s  {busy:4.2f}  " + " | ".join(running))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rep = sub.add_parser("report")
    rep.add_argument("samples", type=Path)
    rep.add_argument("timeline", type=Path)
    rep.add_argument("--below", type=float, default=1.5, help="list windows with fewer cores busy than this")
    args = parser.parse_args()
    if args.command == "record":
        record(args.out)
    else:
        report(args.samples, args.timeline, args.below)


if __name__ == "__main__":
    main()
