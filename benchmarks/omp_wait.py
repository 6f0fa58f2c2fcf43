"""How OpenMP's wait policy changes the optimize stage's time, alone and with a second busy process.

    .venv/bin/python benchmarks/omp_wait.py ARTIFACTS RUN_NAME [--rounds 3 4 5 6 7 8]
        [--settings OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000 GOMP_SPINCOUNT=10000 default]

Reruns `stages.training.grpo.run` on the given rounds of a finished run (their manifests: config and inputs) in a child
process per setting, with 2 torch threads: once alone, then as two identical processes at once (what a second run,
a rollout worker process or CI does to the cores), then alone again with each round's rollout (transformers
engine) run first on another Python thread, as Prefect's thread pool ran it before flows/pipeline.py kept
synchronous rounds on the flow's thread. Prints the seconds each process spent in `grpo.run` on the rounds.
libgomp (torch's OpenMP on Linux) spins GOMP_SPINCOUNT iterations between parallel regions before it sleeps
(300,000 by default, far less when it counts more of its threads than CPUs; OMP_WAIT_POLICY=PASSIVE: 0), so the
setting decides both how fast small ops run alone and how badly spinning threads of one process hold the cores
another process needs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rounds_seconds(artifacts: Path, run: str, rounds: list[int], rollout_thread: bool = False) -> list[float]:
    """Seconds of `stages.training.grpo.run` for each given round of `run` (after one warm-up call), 2 threads; with
    `rollout_thread`, each round's rollout is generated first on a second Python thread."""
    sys.path.insert(0, str(ROOT))
    import torch

    from recompute_optimize import rerun  # same directory

    torch.set_num_threads(2)
    summary = json.loads((artifacts / "runs" / run / "summary.json").read_text())
    folders = [Path(s["path"]) for s in summary["stages"] if s["kind"] == "optimize"]
    rollout_folders = [Path(s["path"]) for s in summary["stages"] if s["kind"] == "rollout"]

    def once(folder: Path) -> float:
        with tempfile.TemporaryDirectory() as out:
            started = time.perf_counter()
            rerun(artifacts, folder, Path(out))
            return time.perf_counter() - started

    def generate(folder: Path) -> None:
        from stages.rollout import rollout
        from stages.rollout.engines import Policy

        manifest = json.loads((folder / "_manifest.json").read_text())
        config, inputs = manifest["config"], manifest["inputs"]
        cfg = rollout.RolloutConfig(**{k: v for k, v in config.items() if k in rollout.RolloutConfig.model_fields})
        policy = Policy(artifacts / inputs["policy"], version=config["round"],
                        adapter_dir=artifacts / inputs["adapter"] if inputs.get("adapter") else None)
        with tempfile.TemporaryDirectory() as out:
            rollout.run(cfg, policy, artifacts / inputs["prompts"] / "train.parquet", config["round"], Path(out))

    once(folders[rounds[0]])
    if not rollout_thread:
        return [once(folders[r]) for r in rounds]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as other_thread:
        seconds = []
        for r in rounds:
            other_thread.submit(generate, rollout_folders[r]).result()
            seconds.append(once(folders[r]))
        return seconds


def child(setting: str, args, rollout_thread: bool = False) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if setting != "default":
        name, value = setting.split("=")
        env[name] = value
    command = [sys.executable, __file__, str(args.artifacts), args.run, "--rounds", *map(str, args.rounds), "--child"]
    command += ["--rollout-thread"] if rollout_thread else []
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", type=Path)
    parser.add_argument("run", help="a finished GRPO run's name (artifacts/runs/<name>)")
    parser.add_argument("--rounds", type=int, nargs="+", default=[3, 4, 5, 6, 7, 8])
    parser.add_argument("--settings", nargs="+",
                        default=["OMP_WAIT_POLICY=PASSIVE", "GOMP_SPINCOUNT=1000", "GOMP_SPINCOUNT=10000", "default"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rollout-thread", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(rounds_seconds(args.artifacts, args.run, args.rounds, args.rollout_thread)))
        return
    print(f"| setting | alone: s for rounds {args.rounds} | two processes at once: s each "
          "| alone, rollouts on a second thread |")
    print("| --- | --- | --- | --- |")
    for setting in args.settings:
        alone = sum(json.loads(child(setting, args).communicate()[0]))
        pair = [child(setting, args) for _ in range(2)]
        both = [sum(json.loads(p.communicate()[0])) for p in pair]
        threaded = sum(json.loads(child(setting, args, rollout_thread=True).communicate()[0]))
        print(f"| {setting} | {alone:.2f} | {both[0]:.2f} / {both[1]:.2f} | {threaded:.2f} |", flush=True)


if __name__ == "__main__":
    main()
