"""Time the quickstart as a new user runs it, and check its learning target.

  .venv/bin/python benchmarks/quickstart.py [--config configs/quickstart.yaml] [--artifacts DIR] [OVERRIDE ...]

Runs `posttrain run configs/quickstart.yaml --quiet` twice in a fresh artifacts folder (each a
separate process, as `make run` does) and prints: wall time of the first run, of the
cached second run, stages computed by the second run, base and final eval accuracy.
Targets (issue 2): first run <= 600 s, second run <= 60 s with nothing computed,
final accuracy >= base + 0.15 on >= 200 held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pinned_seeds(seed: int) -> list[str]:
    """Overrides that seed a run's model, SFT, sampling and optimizer with `seed` (vs_trl.py's and
    ablations.py's runs; the top-level `seed=S` would also set the DPO and reward-model seeds)."""
    return [f"{section}.seed={seed}" for section in ("model", "sft", "rollout", "grpo")]


def run_once(artifacts: Path, overrides: list[str], config: str = "configs/quickstart.yaml",
             env: dict[str, str] | None = None) -> tuple[float, dict]:
    """`posttrain run CONFIG` in its own process (environment `env`, default this one's); its wall time and
    summary.json."""
    command = [str(Path(sys.executable).parent / "posttrain"), "run", config, "--quiet",
               f"artifacts_dir={artifacts}", *overrides]
    start = time.time()
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    seconds = time.time() - start
    if out.returncode != 0:
        sys.exit(f"run failed:\n{out.stderr[-4000:]}")
    import yaml

    name = yaml.safe_load((ROOT / config).read_text())["name"]
    # finished by this command: a new run folder, or that of an interrupted run it resumed
    new = [d for d in (artifacts / "runs").glob("*") if (d / "summary.json").exists()
           and (d / "summary.json").stat().st_mtime >= start and _is_this_run(d, [f"name={name}", *overrides])]
    if len(new) != 1:  # other runs (other configs or seeds) may finish in the same folder meanwhile
        sys.exit(f"cannot tell which of {sorted(d.name for d in new)} is this run ({overrides})")
    return seconds, json.loads((new[0] / "summary.json").read_text())


def stage_path(summary: dict, stage: str) -> Path:
    """The output folder of the run's stage named `stage` (its row in summary["stages"], e.g. "eval final")."""
    return Path(next(s["path"] for s in summary["stages"] if s["stage"] == stage))


def print_medians(rows: list[dict], columns: list[tuple]) -> None:
    """Median [min, max] over the seeds' rows of each (name, getter) column."""
    import statistics

    print(f"\n{len(rows)} seeds, median [min, max]:")
    for name, get in columns:
        values = [get(r) for r in rows]
        print(f"  {name}: {statistics.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]")


def _is_this_run(run_dir: Path, overrides: list[str]) -> bool:
    """A finished run whose resolved config has every `key=value` override."""
    import yaml

    if not (run_dir / "summary.json").exists():
        return False
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    for override in overrides:
        key, _, value = override.partition("=")
        node = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node != yaml.safe_load(value):
            return False
    return True


def seconds_by_kind(stages: list[dict]) -> dict:
    """Wall time per stage kind, the rounds' rollout/score/optimize summed."""
    totals: dict[str, float] = {}
    for row in stages:
        totals[row["kind"]] = totals.get(row["kind"], 0.0) + row["seconds"]
    return {kind: round(seconds, 1) for kind, seconds in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--artifacts", type=Path, default=None)
    parser.add_argument("--config", default="configs/quickstart.yaml", help="e.g. configs/dpo.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    artifacts = args.artifacts or Path(tempfile.mkdtemp(prefix="posttrain-bench-"))
    first_s, first = run_once(artifacts, args.overrides, args.config)
    second_s, second = run_once(artifacts, args.overrides, args.config)
    report = {
        "first_run_s": round(first_s, 1),
        "second_run_s": round(second_s, 1),
        "second_run_stages_computed": [r["stage"] for r in second["stages"] if r["status"] == "computed"],
        "stage_seconds": seconds_by_kind(first["stages"]),
        "eval_prompts": first["eval_prompts"],
        "base_accuracy": first["base_accuracy"],
        "final_accuracy": first["final_accuracy"],
        "gain": round(first["final_accuracy"] - first["base_accuracy"], 4),
        **{k: first[k] for k in ("preference_accuracy_base", "preference_accuracy_final") if k in first},
    }
    print(json.dumps(report, indent=2))
    if args.artifacts is None:
        shutil.rmtree(artifacts, ignore_errors=True)


if __name__ == "__main__":
    main()
