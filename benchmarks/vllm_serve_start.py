"""What starting a `vllm serve` costs on this machine: wall seconds to a healthy server that has answered one
completion, and the CPU seconds of all its processes by then (the API server and, on the CPU, the engine-core and
worker processes vLLM spawns), with posttrain's command line (serve_command: `python -m
stages.rollout.engines.vllm_api_server`) and with vLLM's own module in its place.

    .venv/bin/python benchmarks/vllm_serve_start.py [--repeats 2]

A tiny random model (stages/data/base_model.py) in a temporary folder; the server options are the test suite's
(tests/test_vllm.py `serving`); health is polled as the engine polls it (vllm_server.wait_until_healthy, once a
second). The two entries alternate `--repeats` times. Prints one line per start (which
processes loaded scikit-learn, read from /proc/PID/maps) and one JSON line with the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ENTRIES = {"posttrain": "stages.rollout.engines.vllm_api_server", "vllm": "vllm.entrypoints.openai.api_server"}


def tiny_model(folder: Path) -> Path:
    from stages.data.base_model import BaseModelConfig, run

    texts = [f"<|im_start|>user\nlargest of {i % 10}<|im_end|>\n<|im_start|>assistant\n{i % 10}<|im_end|>"
             for i in range(200)]
    run(BaseModelConfig(vocab_size=300, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=256, num_hidden_layers=2, max_position_embeddings=128), texts, folder)
    return folder


def group_pids(leader: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == leader:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process (its own, not its children's)."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loads_sklearn(pid: int) -> bool:
    try:
        return "/sklearn/" in (Path("/proc") / str(pid) / "maps").read_text()
    except OSError:
        return False


def start_once(model: Path, entry: str) -> dict:
    from stages.rollout.engines.vllm_server import serve_command, wait_until_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv, env = serve_command(model, port, 8, {"dtype": "float32", "gpu_memory_utilization": 0.05,
                                              "kv_cache_space_gib": 0.25, "max_model_len": 128,
                                              "enforce_eager": True})
    argv[2] = ENTRIES[entry]
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, cwd=tempfile.gettempdir())
    try:
        wait_until_healthy(url, proc, 600)
        request = urllib.request.Request(f"{url}/v1/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": model.name, "prompt": "hi",
                                                          "max_tokens": 4}).encode())
        json.load(urllib.request.urlopen(request, timeout=120))
        wall = time.monotonic() - started
        pids = group_pids(proc.pid)
        return {"entry": entry, "wall_s": round(wall, 1), "cpu_s": round(sum(map(cpu_seconds, pids)), 1),
                "processes": len(pids), "with_sklearn": sum(map(loads_sklearn, pids))}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results = {entry: [] for entry in ENTRIES}
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "base")
        for _ in range(args.repeats):
            for entry in ("vllm", "posttrain"):
                one = start_once(model, entry)
                print(one, flush=True)
                results[entry].append(one)
    print(json.dumps({entry: {"wall_s": statistics.median(r["wall_s"] for r in runs),
                              "cpu_s": statistics.median(r["cpu_s"] for r in runs)}
                      for entry, runs in results.items()}))


if __name__ == "__main__":
    main()
