"""Resume cost: wall time of `posttrain resume` after a SIGKILL in the last round, against the
uninterrupted run's wall time (issue 5 target: < 25%).

  .venv/bin/python benchmarks/resume.py [--config configs/quickstart.yaml] [--artifacts DIR]

1. `posttrain run CONFIG` from scratch in a fresh artifacts folder: the uninterrupted wall time.
2. The same config with other rollout/grpo seeds (its rounds are new work; data, base model and
   SFT are cached, as they would be in a run killed late), SIGKILLed (whole process group) while
   the last round's rollout is being written.
3. `posttrain resume <that run>`: its wall time, and that it ends FINISHED with every round once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
POSTTRAIN = str(Path(sys.executable).parent / "posttrain")


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{out.stderr[-4000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--artifacts", type=Path, default=None)
    args = parser.parse_args()
    artifacts = (args.artifacts or Path(tempfile.mkdtemp(prefix="posttrain-resume-"))).resolve()
    rounds = yaml.safe_load((ROOT / args.config).read_text())["grpo"]["rounds"]
    common = [args.config, "--quiet", f"artifacts_dir={artifacts}"]

    uninterrupted = timed([POSTTRAIN, "run", *common])

    before = set((artifacts / "runs").iterdir())
    optimize_done = len(list((artifacts / "optimize").glob("*/_manifest.json")))
    process = subprocess.Popen([POSTTRAIN, "run", *common, "rollout.seed=7", "grpo.seed=7"], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    while (len(list((artifacts / "optimize").glob("*/_manifest.json"))) < optimize_done + rounds - 1
           or not list((artifacts / "rollout").glob(".tmp-*"))):
        if process.poll() is not None:
            sys.exit("the run finished before the kill")
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    (run_dir,) = set((artifacts / "runs").iterdir()) - before

    resumed = timed([POSTTRAIN, "resume", run_dir.name, "--artifacts", str(artifacts), "--quiet"])
    summary = json.loads((run_dir / "summary.json").read_text())
    computed = [s["stage"] for s in summary["stages"] if s["status"] == "computed"]
    print(json.dumps({"config": args.config, "rounds": rounds, "uninterrupted_s": round(uninterrupted, 1),
                      "resume_after_kill_in_last_round_s": round(resumed, 1),
                      "resume_over_uninterrupted": round(resumed / uninterrupted, 3),
                      "computed_by_resume": computed, "final_accuracy": summary["final_accuracy"]}, indent=2))


if __name__ == "__main__":
    main()
