"""Async prefetch vs synchronous rounds: wall time of the same N GRPO rounds.

  .venv/bin/python benchmarks/prefetch.py [--rounds 8] [--repeats 3] [OVERRIDE ...]

Each repetition runs `posttrain run configs/quickstart.yaml grpo.rounds=N` twice -- once with
rollout.async_prefetch=false, once with true (prefetch_depth 1, max_staleness 1) -- alternating
which goes first, in one artifacts folder whose SFT policy is built once and then cached. Every
run uses its own rollout/grpo seeds, so no round is ever a cache hit. Reported: the
median over repetitions of the rounds' wall time (summary.json's rounds_wall_s: from the first
rollout submitted to the last optimize finished) and the async / sync ratio (goal <= 0.8).
Extra arguments are passed on as overrides to both modes (e.g. rollout.engine=vllm);
`--async-only OVERRIDE` (repeatable) applies to the async runs only, e.g. to compare the best
synchronous setup with the best asynchronous one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(artifacts: Path, overrides: list[str]) -> dict:
    before = set((artifacts / "runs").glob("*")) if (artifacts / "runs").exists() else set()
    command = [str(Path(sys.executable).parent / "posttrain"), "run", "configs/quickstart.yaml", "--quiet",
               f"artifacts_dir={artifacts}", *overrides]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"run failed:\n{out.stderr[-4000:]}")
    (run_dir,) = set((artifacts / "runs").glob("*")) - before
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--artifacts", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=None,
                        help="first rollout/grpo seed (default: from the clock, so no earlier run is a cache hit)")
    parser.add_argument("--async-only", action="append", default=[], metavar="OVERRIDE",
                        help="an override for the async runs only (repeatable)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    artifacts = args.artifacts or Path(tempfile.mkdtemp(prefix="posttrain-prefetch-"))
    times: dict[str, list[float]] = {"sync": [], "async": []}
    accuracy: dict[str, list[float]] = {"sync": [], "async": []}
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    for rep in range(args.repeats):
        order = ["sync", "async"] if rep % 2 == 0 else ["async", "sync"]
        for mode in order:
            run_seed = seed + 2 * rep + (mode == "async")  # no run shares a cached round with another
            result = run(artifacts, [f"grpo.rounds={args.rounds}", f"rollout.seed={run_seed}",
                                     f"grpo.seed={run_seed}", f"rollout.async_prefetch={mode == 'async'}",
                                     *args.overrides, *(args.async_only if mode == "async" else [])])
            times[mode].append(result["rounds_wall_s"])
            accuracy[mode].append(result["final_accuracy"])
    sync, asynchronous = statistics.median(times["sync"]), statistics.median(times["async"])
    print(json.dumps({"rounds": args.rounds, "overrides": args.overrides, "async_only": args.async_only,
                      "first_seed": seed,
                      "rounds_wall_s": {k: [round(v, 1) for v in vs] for k, vs in times.items()},
                      "median_sync_s": round(sync, 1), "median_async_s": round(asynchronous, 1),
                      "async_over_sync": round(asynchronous / sync, 3), "final_accuracy": accuracy}, indent=2))


if __name__ == "__main__":
    main()
