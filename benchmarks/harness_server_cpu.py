"""The Prefect test harness's server CPU per tiny pipeline run (issue 43: the suite's CPU).

    .venv/bin/python benchmarks/harness_server_cpu.py --runs 3                 # Prefect's default recorder batch (1)
    .venv/bin/python benchmarks/harness_server_cpu.py --runs 3 --recorder-batch 100   # as tests/conftest.py sets it

Starts `prefect_test_harness` (its server a subprocess, as in the suite), computes the tiny config's stages up to SFT
once, then runs the tiny pipeline `--runs` times from copies of them, and prints for each run the server's CPU
seconds (psutil, measured 6 s after the run so its 5 s flushes are in) and this process's."""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--recorder-batch", type=int, default=None,
                        help="PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE for the server")
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    if args.recorder_batch:
        os.environ["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"] = str(args.recorder_batch)

    import psutil
    from prefect.testing.utilities import prefect_test_harness

    from conftest import WARM_STAGES, tiny_text
    from flows.pipeline import posttrain_pipeline, prepare_policy_flow

    root = Path(tempfile.mkdtemp(prefix="harness-cpu-"))
    with prefect_test_harness(server_startup_timeout=180):
        me = psutil.Process()

        def server_cpu() -> float:
            return sum(sum(c.cpu_times()[:2]) for c in me.children(recursive=True)
                       if "uvicorn" in " ".join(c.cmdline()))

        warm = root / "warm"
        (warm / "artifacts").mkdir(parents=True)
        (warm / "tiny.yaml").write_text(tiny_text(warm / "artifacts"))
        prepare_policy_flow(str(warm / "tiny.yaml"), quiet=True)
        time.sleep(6)
        for i in range(args.runs):
            run = root / f"run{i}"
            (run / "artifacts").mkdir(parents=True)
            for stage in WARM_STAGES:
                shutil.copytree(warm / "artifacts" / stage, run / "artifacts" / stage)
            (run / "tiny.yaml").write_text(tiny_text(run / "artifacts"))
            server0, own0 = server_cpu(), time.process_time()
            posttrain_pipeline(str(run / "tiny.yaml"), quiet=True)
            own = time.process_time() - own0
            time.sleep(6)  # the server's 5 s flushes
            print(f"run {i}: server CPU {server_cpu() - server0:.2f} s, this process {own:.2f} s", flush=True)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
