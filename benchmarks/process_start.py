"""What starting a posttrain process costs in CPU: loading TRL's trainers, and a small whole `posttrain run`
(its temporary Prefect server, MLflow store, reward worker and stages), here and in a --baseline checkout.

  .venv/bin/python benchmarks/process_start.py [--baseline CHECKOUT] [--repeats 3] [--rounds 2]

Cases, alternating between the checkouts `--repeats` times (each a new process, PYTHONPATH=checkout):
- import: `import stages` and then TRL's SFTTrainer and DPOTrainer (what the SFT and DPO stages load);
- run: `python -m flows.cli run` of the test suite's tiny config (tests/conftest.py, `--rounds` GRPO rounds)
  into a new artifacts folder with a new Prefect home: every stage computed, a temporary Prefect server started.
Prints one JSON line: per case and checkout, each repeat's wall seconds and CPU seconds (user + system of the
process and everything it started) and their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = """name: bench-tiny
demo_data: {num_sft: 300, num_train: 64, num_eval: 24}
model: {hidden_size: 64, num_attention_heads: 1, num_key_value_heads: 1, intermediate_size: 128,
        num_hidden_layers: 2, vocab_size: 300}
sft: {num_train_epochs: 1, micro_batch_size: 32}
rollout: {num_generations: 4, prompts_per_round: 8, max_completion_length: 8}
score: {reward_num_workers: 1}
grpo: {micro_batch_size: 16, gradient_accumulation_steps: 1, skip_zero_advantage_batches: false}
eval: {max_completion_length: 8}
export: {model_name: bench-tiny}
"""


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured(command: list[str], checkout: Path, env: dict) -> tuple[float, float]:
    """(wall s, CPU s of the command and its descendants that it waited for)."""
    env = {k: v for k, v in {**os.environ, **env}.items() if not k.startswith(("PREFECT_API", "MLFLOW_TRACKING"))}
    env["PYTHONPATH"] = str(checkout)
    cpu, started = children_cpu(), time.time()
    out = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(command)} in {checkout} failed:\n{out.stderr[-3000:]}")
    return time.time() - started, children_cpu() - cpu


def import_case(checkout: Path, scratch: Path) -> tuple[float, float]:
    return measured([sys.executable, "-c", "import stages; from trl import SFTTrainer, DPOTrainer"], checkout, {})


def run_case(checkout: Path, scratch: Path, rounds: int) -> tuple[float, float]:
    folder = Path(tempfile.mkdtemp(dir=scratch))
    config = folder / "tiny.yaml"
    config.write_text(TINY)
    return measured([sys.executable, "-m", "flows.cli", "run", str(config), "--quiet",
                     f"artifacts_dir={folder / 'artifacts'}", f"grpo.rounds={rounds}"], checkout,
                    {"PREFECT_HOME": str(folder / "prefect"), "HF_HUB_OFFLINE": "1"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout (e.g. a git worktree at an older commit)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    checkouts = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    cases = {"import": import_case, "run": lambda c, s: run_case(c, s, args.rounds)}
    results: dict = {case: {name: [] for name in checkouts} for case in cases}
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.repeats):
            for case, fn in cases.items():
                for name, checkout in checkouts.items():
                    wall, cpu = fn(checkout, Path(scratch))
                    results[case][name].append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
    for case in results.values():
        for name, runs in list(case.items()):
            case[name] = {"runs": runs, "median_wall_s": statistics.median(r["wall_s"] for r in runs),
                          "median_cpu_s": statistics.median(r["cpu_s"] for r in runs)}
    print(json.dumps({"python": sys.version.split()[0], "checkouts": {k: str(v) for k, v in checkouts.items()},
                      "rounds": args.rounds, **results}))


if __name__ == "__main__":
    main()
