"""Wall time and eval accuracy of configs/atropos.yaml, started as docs/methods/atropos.md says:
`posttrain run` (which starts run-api and the policy server), then the example environment.

    /tmp/atropos-venv/bin/python benchmarks/atropos.py --artifacts /tmp/atropos-bench [overrides...]

Prints one JSON line: wall seconds of the whole run and of the GRPO rounds, base/final accuracy, the
rounds' staleness (how many optimize rounds the sampling policy lagged). Stops the environment and the
run-api it started at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--artifacts", required=True)
    parser.add_argument("--config", default=str(REPO / "configs" / "atropos.yaml"))
    parser.add_argument("--api-port", type=int, default=18000)
    parser.add_argument("--policy-port", type=int, default=19100)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    artifacts = Path(args.artifacts).resolve()
    api, policy = f"http://127.0.0.1:{args.api_port}", f"http://127.0.0.1:{args.policy_port}"
    sys.path.insert(0, str(REPO))
    from flows.config import load_config

    overrides = [f"artifacts_dir={artifacts}", f"rollout.atropos.api_url={api}",
                 f"rollout.atropos.policy_url={policy}", *args.overrides]
    cfg = load_config(args.config, overrides)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
    artifacts.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    run = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", args.config, *overrides, "--quiet"], cwd=REPO,
                           env=env, stdout=open(artifacts / "posttrain.log", "w"), stderr=subprocess.STDOUT)
    pid_file = artifacts / "atropos" / "run-api.pid"
    environment = None
    try:
        while not pid_file.exists() and run.poll() is None:
            time.sleep(0.5)
        environment = subprocess.Popen(
            [sys.executable, str(REPO / "configs" / "examples" / "atropos_env.py"), "serve", "--env.rollout_server_url", api,
             "--openai.base_url", f"{policy}/v1", "--env.group_size", str(cfg.rollout.num_generations),
             "--env.max_completion_tokens", str(cfg.rollout.max_completion_length),
             "--env.temperature", str(cfg.rollout.temperature), "--env.num_items", str(cfg.demo_data.num_train)],
            cwd=artifacts, env=env, stdout=open(artifacts / "env.log", "w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        code = run.wait()
    finally:
        if environment is not None:
            os.killpg(environment.pid, signal.SIGTERM)
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
    wall = time.perf_counter() - started
    if code != 0:
        print((artifacts / "posttrain.log").read_text()[-3000:])
        return code
    summary = json.loads(max((artifacts / "runs").glob("*/summary.json"), key=os.path.getmtime).read_text())
    staleness = [json.loads(p.read_text())["summary"]["staleness"] for p in (artifacts / "rollout").glob("*/_manifest.json")]
    print(json.dumps({"config": args.config, "wall_s": round(wall, 1), "rounds_wall_s": round(summary["rounds_wall_s"], 1),
                      "base_accuracy": summary["base_accuracy"], "final_accuracy": summary["final_accuracy"],
                      "constant_baseline": summary["constant_baseline"], "staleness_mean":
                      sum(staleness) / len(staleness), "staleness_max": max(staleness)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
