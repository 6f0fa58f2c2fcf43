"""Replay buffer and re-roll on the quickstart: what they replace, what it costs, what it changes.

  .venv/bin/python benchmarks/replay.py [--artifacts DIR] [--config configs/quickstart.yaml]

Runs `posttrain run CONFIG --quiet` (each its own process) in one artifacts folder, four times:
plain, with grpo.replay_buffer_size=64, with re-roll (reroll_start_fraction 0.25, 4 groups per
round), with both. The first run computes the shared SFT policy; later runs reuse every artifact
their choices leave unchanged. Prints per variant: wall time, rounds wall time, stages computed,
replaced groups and re-rolled prompts per round (from MLflow), final eval accuracy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from quickstart import run_once

VARIANTS = {
    "plain": [],
    "replay": ["grpo.replay_buffer_size=64"],
    "reroll": ["grpo.reroll_start_fraction=0.25", "grpo.reroll_max_groups=4"],
    "both": ["grpo.replay_buffer_size=64", "grpo.reroll_start_fraction=0.25", "grpo.reroll_max_groups=4"],
}


def per_round(client, run_id: str, name: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--artifacts", type=Path, default=None)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    args = parser.parse_args()
    artifacts = args.artifacts or Path(tempfile.mkdtemp(prefix="posttrain-replay-"))
    from mlflow import MlflowClient

    report = {}
    for name, overrides in VARIANTS.items():
        seconds, summary = run_once(artifacts, overrides, args.config)
        client = MlflowClient(tracking_uri=f"sqlite:///{artifacts / 'mlflow.db'}")
        run_id = summary["mlflow_run_id"]
        report[name] = {
            "wall_s": round(seconds, 1),
            "rounds_wall_s": round(summary["rounds_wall_s"], 1),
            "stages_computed": sum(r["status"] == "computed" for r in summary["stages"]),
            "replaced_groups": per_round(client, run_id, "replay/replaced_groups"),
            "replayed_rows": per_round(client, run_id, "train/replayed_rows"),
            "rerolled_prompts": per_round(client, run_id, "reroll/rerolled_prompts"),
            "frac_reward_zero_std": [round(v, 3) for v in per_round(client, run_id, "train/frac_reward_zero_std")],
            "final_accuracy": summary["final_accuracy"],
        }
        print(name, json.dumps(report[name]), flush=True)
    print(json.dumps(report, indent=2))
    if args.artifacts is None:
        shutil.rmtree(artifacts, ignore_errors=True)


if __name__ == "__main__":
    main()
