"""Per-completion overhead of scoring through a remote verifier (`posttrain serve-rewards`) instead of
in-process reward workers.

  .venv/bin/python benchmarks/remote_scoring.py [--completions 1024] [--workers 2] [--batch-size 64]
      [--reward format] [--concurrency 8,32] [--repeats 3]

Starts `posttrain serve-rewards` (uvicorn, loopback, `--workers` reward workers) on a config with the
reward, then scores the same completions (benchmarks/score_workers.py's LaTeX answers) through a warm
local pool of `--workers` workers: in-process (`<reward>`), remote one request per completion
(`remote:<reward>`, each --concurrency), and remote with `batch: true` (one request per call of
--batch-size). Reports the median of --repeats warm runs and the overhead per completion against
in-process. With the cheap `format` reward almost all of the remote time is overhead (HTTP, JSON, the
server's queue and its own worker pool); client and server share this machine's cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from score_workers import make_jobs  # noqa: E402  (same directory)


def start_server(reward: str, workers: int, port: int) -> subprocess.Popen:
    import httpx

    from stages.runtime.http import client

    config = Path(tempfile.mkdtemp()) / "rewards.yaml"
    config.write_text(f"score:\n  reward_funcs: [{reward}]\n  reward_num_workers: {workers}\n")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve-rewards", str(config), "--port", str(port)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"})
    for _ in range(600):
        try:
            client().get(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    sys.exit("serve-rewards did not start")


def timed(pool, jobs, repeats: int) -> tuple[float, int]:
    """Median seconds of `repeats` warm runs, and the failed samples of the last."""
    pool.score(jobs)  # warm: workers spawned, connections open
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        out = pool.score(jobs)
        times.append(time.perf_counter() - started)
    return statistics.median(times), sum(len(errors) for _, errors in out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--completions", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--reward", default="format")
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import socket

    from stages.scoring.reward_workers import RewardWorkerPool
    from stages.scoring.rewards.remote import RemoteVerifierConfig, remote_source

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(args.reward, args.workers, port)
    n = args.completions
    rows = []
    try:
        def measure(label: str, name: str, source: str | None = None) -> None:
            pool = RewardWorkerPool([name], args.workers, 120.0, {name: source} if source else None)
            try:
                seconds, errors = timed(pool, make_jobs(name, n, args.batch_size), args.repeats)
            finally:
                pool.close()
            rows.append((label, seconds, errors))
            print(f"{label}: {seconds:.3f} s, {errors} errors", flush=True)

        measure("in-process", args.reward)
        url = f"http://127.0.0.1:{port}/{args.reward}"
        for c in [int(c) for c in args.concurrency.split(",")]:
            cfg = RemoteVerifierConfig(url=url, max_concurrency=c)
            measure(f"remote, per completion, max_concurrency {c}", f"remote:{args.reward}", remote_source(cfg))
        cfg = RemoteVerifierConfig(url=url, batch=True)
        measure(f"remote, batch ({args.batch_size} per request)", f"remote:{args.reward}", remote_source(cfg))
    finally:
        server.terminate()
        server.wait(timeout=30)
    base = rows[0][1]
    print(f"\n{n} completions, reward {args.reward}, {args.workers} client workers, {args.workers} server "
          f"workers, batches of {args.batch_size}, median of {args.repeats} warm runs")
    print("| scoring | wall | completions/s | overhead per completion vs in-process | errors |")
    print("| --- | --- | --- | --- | --- |")
    for label, seconds, errors in rows:
        overhead = "-" if seconds is base else f"{(seconds - base) / n * 1000:.3f} ms"
        print(f"| {label} | {seconds:.3f} s | {n / seconds:.0f} | {overhead} | {errors} |")


if __name__ == "__main__":
    main()
