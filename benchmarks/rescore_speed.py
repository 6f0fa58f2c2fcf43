"""`posttrain rescore` of a finished run against the run's own rollout + score stages (issue 46: <= 0.2x).

  .venv/bin/python benchmarks/rescore_speed.py --artifacts DIR [--config configs/quickstart.yaml | --tiny]
      [--run NAME] [--reward-funcs accuracy] [KEY=VALUE ...]

1. `posttrain run CONFIG --quiet artifacts_dir=DIR KEY=VALUE...` (`--tiny`: tests/conftest.py's tiny config,
   written into DIR), unless --run names a finished run in DIR.
2. The run's rollout and score seconds: its summary.json's `rollout rN` and `score rN` rows (each must have been
   computed by that run, not reused).
3. `posttrain rescore RUN --reward-funcs ... --json` twice, each a new process, timed end to end: the first
   computes every round's score artifact, the second finds them cached.

Prints one JSON line: the run's rollout + score seconds, each rescore's wall seconds and the seconds its score
tasks took (the report's `seconds`: the process's imports and MLflow/config loading left out), and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.2


def posttrain(*args: str, cwd: Path) -> tuple[float, str]:
    """`python -m flows.cli ARGS` in a new process from `cwd`: (wall seconds, stdout); exits on failure."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"posttrain {' '.join(args)} failed:\n{out.stderr[-4000:]}")
    return time.perf_counter() - started, out.stdout


def train(config: Path, artifacts: Path, overrides: list[str]) -> str:
    """Run the config into `artifacts`; the new run's name."""
    before = set((artifacts / "runs").glob("*/summary.json"))
    posttrain("run", str(config), "--quiet", f"artifacts_dir={artifacts}", *overrides, cwd=config.parent)
    (summary,) = set((artifacts / "runs").glob("*/summary.json")) - before
    return summary.parent.name


def stage_seconds(artifacts: Path, run: str) -> dict:
    """Rounds, and rollout and score seconds summed over the run's rounds (summary.json)."""
    rows = json.loads((artifacts / "runs" / run / "summary.json").read_text())["stages"]
    rounds = [r for r in rows if re.fullmatch(r"(rollout|score) r\d+", r["stage"])]
    reused = [r["stage"] for r in rounds if r["status"] != "computed"]
    if reused:
        sys.exit(f"{run} reused {', '.join(reused)}: its own rollout + score time is not known; use a fresh DIR")
    return {"rounds": sum(r["stage"].startswith("score") for r in rounds),
            **{f"{kind}_s": sum(r["seconds"] for r in rounds if r["stage"].startswith(kind))
               for kind in ("rollout", "score")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    parser.add_argument("--tiny", action="store_true", help="tests/conftest.py's tiny config instead of --config")
    parser.add_argument("--run", default=None, help="a finished run in --artifacts (default: run the config now)")
    parser.add_argument("--reward-funcs", nargs="+", default=["accuracy"])
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE for the run, e.g. grpo.rounds=20")
    args = parser.parse_args()
    artifacts = args.artifacts.resolve()
    artifacts.mkdir(parents=True, exist_ok=True)
    config = args.config.resolve()
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import tiny_text

        config = artifacts / "tiny.yaml"
        config.write_text(tiny_text(artifacts))
    run = args.run or train(config, artifacts, args.overrides)
    own = stage_seconds(artifacts, run)
    own["rollout_score_s"] = own["rollout_s"] + own["score_s"]
    command = ["rescore", run, "--reward-funcs", *args.reward_funcs, "--artifacts", str(artifacts), "--json"]
    result = {"run": run, "reward_funcs": args.reward_funcs, **own}
    for which in ("first", "cached"):
        wall, out = posttrain(*command, cwd=ROOT)
        report = json.loads(out)
        result[f"rescore_{which}_wall_s"] = wall
        result[f"rescore_{which}_score_tasks_s"] = report["seconds"]
        result[f"rescore_{which}_computed"] = sum(r["status"] == "computed" for r in report["rounds"])
    result["ratio_wall"] = result["rescore_first_wall_s"] / own["rollout_score_s"]
    result["ratio_score_tasks"] = result["rescore_first_score_tasks_s"] / own["rollout_score_s"]
    result["target"] = TARGET
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
