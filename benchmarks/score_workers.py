"""Reward-worker throughput: a CPU-bound reward (math-verify) over many completions with 1, 2, ...
workers, worker start-up included; and the per-call overhead of going through a worker.

  .venv/bin/python benchmarks/score_workers.py [--completions 2048] [--workers 1,2] [--batch-size 64]
      [--backends local,ray]

Completions are LaTeX answers ("<answer>\\frac{3}{4}</answer>") against decimal gold answers
("0.75"), so every sample goes through math-verify's parse + verify (no string shortcut); a
quarter are wrong. Reported per worker count: wall time from creating the pool (spawning its
processes, importing the reward module) to the last score, and the same on the warm pool.
Overhead: the cheap built-in `format` reward over the same completions through one warm worker,
minus calling it in this process, divided by the number of calls.
Backends: `local` (spawned processes) and `ray` (Ray actors, stages/scoring/ray_rewards.py, on a local Ray
instance this process starts, or the cluster at RAY_ADDRESS); Ray's start-up is not in its cold time.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def make_jobs(name: str, count: int, batch_size: int) -> list:
    rng = random.Random(0)
    rows = []
    for i in range(count):
        num, den = rng.randint(1, 40), rng.choice([2, 4, 5, 8, 10, 16, 20, 25])
        gold = f"{num / den:g}"
        shown = f"\\frac{{{num + (1 if i % 4 == 0 else 0)}}}{{{den}}}"  # every 4th answer is wrong
        rows.append(({"role": "assistant", "content": f"<answer>${shown}$</answer>"}, gold, f"s{i}"))
    jobs = []
    for start in range(0, count, batch_size):
        chunk = rows[start:start + batch_size]
        jobs.append((name, {"prompts": [[{"role": "user", "content": "?"}]] * len(chunk),
                            "completions": [[c] for c, _, _ in chunk], "answer": [g for _, g, _ in chunk]},
                     [i for _, _, i in chunk]))
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--completions", type=int, default=2048)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--backends", default="local")
    args = parser.parse_args()
    report = {}
    for backend in args.backends.split(","):
        report[backend] = measure(args, backend)
    print(json.dumps(report, indent=2))


def measure(args, backend: str) -> dict:
    from stages.scoring.reward_workers import RewardWorkerPool, resolve_reward

    if backend == "ray":
        from stages.scoring.ray_rewards import RayRewardPool, connect

        started = time.perf_counter()
        connect(None)
        ray_start = time.perf_counter() - started

        def make_pool(names, workers, timeout_s):
            return RayRewardPool(names, workers, timeout_s)
    else:
        make_pool = RewardWorkerPool
    jobs = make_jobs("accuracy", args.completions, args.batch_size)
    report = {"completions": args.completions, "batch_size": args.batch_size, "calls": len(jobs)}
    if backend == "ray":
        report["ray_start_s"] = round(ray_start, 2)
    base = None
    for workers in [int(w) for w in args.workers.split(",")]:
        started = time.perf_counter()
        pool = make_pool(["accuracy"], workers, timeout_s=600)
        outputs = pool.score(jobs)
        cold = time.perf_counter() - started
        started = time.perf_counter()
        pool.score(jobs)
        warm = time.perf_counter() - started
        pool.close()
        errors = sum(len(failed) for _, failed in outputs)
        right = sum(v == 1.0 for values, _ in outputs for v in values)
        base = base or cold
        report[f"{workers}_workers"] = {"cold_s": round(cold, 2), "warm_s": round(warm, 2),
                                        "completions_per_s_cold": round(args.completions / cold),
                                        "speedup_cold_vs_1": round(base / cold, 2), "errors": errors,
                                        "scored_correct": right}

    fmt_jobs = make_jobs("format", args.completions, args.batch_size)
    fn = resolve_reward("format")
    started = time.perf_counter()
    for _, batch, _ in fmt_jobs:
        fn(**batch)
    in_process = time.perf_counter() - started
    pool = make_pool(["format"], 1, timeout_s=600)
    pool.score(fmt_jobs[:1])  # warm: process started, module imported
    started = time.perf_counter()
    pool.score(fmt_jobs)
    through_worker = time.perf_counter() - started
    pool.close()
    report["overhead_ms_per_call"] = round((through_worker - in_process) / len(fmt_jobs) * 1000, 3)
    report["overhead_ms_per_completion"] = round((through_worker - in_process) / args.completions * 1000, 4)
    return report


if __name__ == "__main__":  # the workers are spawned and re-import this module
    main()
