"""What the sha256 check on reuse costs a fully cached rerun (issue 42, item 3: within 10 % of before).

  .venv/bin/python benchmarks/cached_rerun.py --artifacts DIR [--config configs/quickstart.yaml]
      [--baseline CHECKOUT] [--repeats 3]

1. `posttrain run CONFIG --quiet artifacts_dir=DIR` once in this checkout, unless DIR already holds its
   artifacts (the first run computes everything: minutes).
2. `--repeats` times, alternating: the same cached command in the --baseline checkout (a clone at the commit
   before the check, same stages: same keys), in this one with the `.verified` stamps the writes and earlier
   reruns left ("warm": every rerun but the first pays this), and in this one with `.verified` deleted
   ("cold": every file the run reuses is hashed, as on the first rerun after the upgrade or after copying the
   artifacts folder). Each must compute nothing.
3. The check alone, in this process: `ArtifactStore.lookup` of every folder the run reused, cold and warm,
   the bytes it hashes cold, and the check before it (`check_folder`, sizes only) on the same folders.

Prints one JSON line: wall times (each run and the medians) per case, and the check's own seconds and bytes.
Each command runs as a separate process from its checkout (`python -m flows.cli`, PYTHONPATH=checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(checkout: Path, config: str, artifacts: Path) -> tuple[float, dict]:
    """The cached command from `checkout`: its wall time and the summary.json of the run it made."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "HF_HUB_OFFLINE": "1"}
    started = time.time()
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", config, "--quiet", f"artifacts_dir={artifacts}"],
                         cwd=checkout, env=env, capture_output=True, text=True)
    seconds = time.time() - started
    if out.returncode != 0:
        sys.exit(f"{checkout}: run failed:\n{out.stderr[-4000:]}")
    summaries = [p for p in (artifacts / "runs").glob("*/summary.json") if p.stat().st_mtime >= started]
    if len(summaries) != 1:
        sys.exit(f"cannot tell which run of {sorted(str(p) for p in summaries)} this was")
    return seconds, json.loads(summaries[0].read_text())


def computed(summary: dict) -> list[str]:
    return [row["stage"] for row in summary["stages"] if row["status"] == "computed"]


def check_alone(artifacts: Path, summary: dict) -> dict:
    """`lookup` of every folder the run reused: cold (no .verified) and warm, in seconds, and what cold hashes;
    the sizes-only check of before on the same folders."""
    from tasks.store import MANIFEST, VERIFIED, ArtifactStore, check_folder

    store = ArtifactStore(artifacts)
    folders = sorted({Path(row["path"]) for row in summary["stages"]})
    sizes = [meta["size"] for folder in folders
             for meta in json.loads((folder / MANIFEST).read_text())["files"].values()]
    started = time.perf_counter()
    for folder in folders:  # the check before: sizes only
        assert not check_folder(folder)[1], folder
    timings = {"sizes_only": round(time.perf_counter() - started, 3)}
    shutil.rmtree(artifacts / VERIFIED, ignore_errors=True)
    for case in ("cold", "warm"):
        started = time.perf_counter()
        for folder in folders:
            assert store.get(folder.parent.name, folder.name) is not None, folder
        timings[case] = round(time.perf_counter() - started, 3)
    return {"folders": len(folders), "files": len(sizes), "mb_hashed_cold": round(sum(sizes) / 2**20, 1),
            "sizes_only_s": timings["sizes_only"], "cold_s": timings["cold"], "warm_s": timings["warm"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--baseline", type=Path, default=None, help="a checkout without the check")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    artifacts = args.artifacts.resolve()
    from tasks.store import VERIFIED

    first_s, summary = run(ROOT, args.config, artifacts)
    first = {"first_run_s": round(first_s, 1), "computed": len(computed(summary))}
    cases = {"warm": ROOT, "cold": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    walls: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case, checkout in cases.items():
            if case == "cold":
                shutil.rmtree(artifacts / VERIFIED, ignore_errors=True)
            seconds, summary = run(checkout, args.config, artifacts)
            if computed(summary):
                sys.exit(f"{case}: the cached rerun computed {computed(summary)}")
            walls[case].append(round(seconds, 1))
    result = {"config": args.config, **first, "runs_s": walls,
              "median_s": {case: statistics.median(w) for case, w in walls.items()},
              "check_alone": check_alone(artifacts, summary)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
