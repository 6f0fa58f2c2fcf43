"""Data-parallel generation over vLLM servers: one server on all cores vs one server per core.

  .venv/bin/python benchmarks/vllm_servers.py [--sequences 256] [--max-new-tokens 64] [--repeats 3] [--cores 0,1]
                                              [--ray]

Builds the ~30M-parameter Qwen2 and LoRA adapter of benchmarks/rollout_engines.py, then times the
`vllm_server` engine with the adapter (how the pipeline samples a LoRA policy) on

- `1 server`: one `vllm serve` whose CPU threads use all `--cores` (VLLM_CPU_OMP_THREADS_BIND), and
- `N servers`: one `vllm serve` per core, the engine's `server_urls` listing them all,

so both setups have the same cores (with `--ray`, also the `ray_vllm` engine: 1 engine of all cores and one
engine of 1 CPU per core, on a local Ray instance; vLLM's own thread binding there). Reports each setup's server
start time, first call, median
steady-state tokens per second over `--repeats` calls, and whether the completions equal the
single server's token for token (they must: every prompt has its own seed). On CPU the
servers share memory bandwidth; the point here is correctness and overhead, not speed-up.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_engines import build_model, time_engine  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(model_dir: Path, core_sets: list[str], log_dir: Path,
                  lora: bool = True) -> tuple[list[str], list, float]:
    """Start one server per core set, all at once (`lora`: with runtime LoRA loading); return (urls, processes,
    seconds until all are healthy)."""
    from stages.rollout.engines.vllm_server import serve_command, wait_until_healthy

    started = time.perf_counter()
    urls, procs = [], []
    for index, cores in enumerate(core_sets):
        port = free_port()
        argv, env = serve_command(model_dir, port, 16, {"dtype": "float32", "gpu_memory_utilization": 0.05,
                                                        "kv_cache_space_gib": 2.0, "max_model_len": 256},
                                   lora=lora)
        log = open(log_dir / f"server-{index}.log", "wb")
        procs.append(subprocess.Popen(argv, env={**os.environ, **env, "VLLM_CPU_OMP_THREADS_BIND": cores},
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    for index, (url, proc) in enumerate(zip(urls, procs)):
        wait_until_healthy(url, proc, 900, log_dir / f"server-{index}.log")
    return urls, procs, time.perf_counter() - started


def stop(procs) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the server and its engine-core / worker processes
        except ProcessLookupError:
            pass
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cores", default="0,1", help="the cores both setups share, comma-separated")
    parser.add_argument("--ray", action="store_true",
                        help="also time rollout.engine ray_vllm with 1 engine and with one engine per core")
    args = parser.parse_args()

    from stages.rollout.engines import Policy, Sampling
    from stages.rollout.engines.vllm_server import VLLMServerEngine

    root = build_model(Path(tempfile.mkdtemp(prefix="posttrain-servers-")))
    policy = Policy(root / "model", adapter_dir=root / "adapter", version=1)
    prompts = [[{"role": "user", "content": f"Which is the largest of {i % 9 + 1}, 3, 7?"}]
               for i in range(args.sequences)]
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1)
    cores = args.cores.split(",")
    report = {"sequences": args.sequences, "max_new_tokens": args.max_new_tokens, "cores": args.cores}
    tokens = {}
    for label, core_sets in [("1 server", [",".join(cores)]), (f"{len(cores)} servers", cores)]:
        urls, procs, start_s = start_servers(root / "model", core_sets, root)
        try:
            engine = VLLMServerEngine(root / "model", server_urls=urls, max_lora_rank=16)
            report[label] = {"servers_start_s": round(start_s, 1),
                             **time_engine(engine, policy, prompts, sampling, args.repeats)}
            tokens[label] = [r["completion_token_ids"] for r in engine.generate(policy, prompts, sampling)]
            report[label]["completions_per_server"] = [s["completions"] for s in engine.last_call.values()]
            engine.close()
            print(json.dumps({label: report[label]}), file=sys.stderr, flush=True)
        finally:
            stop(procs)
    if args.ray:
        from stages.rollout.engines.ray_vllm import RayVLLMEngine
        from stages.runtime.ray_cluster import connect

        started = time.perf_counter()
        connect(None)  # a local Ray instance, all cores
        report["ray_start_s"] = round(time.perf_counter() - started, 1)
        for engines in (1, len(cores)):
            label = f"ray_vllm {engines} engine(s)"
            engine = RayVLLMEngine(root / "model", num_engines=engines, num_cpus_per_engine=len(cores) / engines,
                                   max_lora_rank=16, kv_cache_space_gib=2.0, max_model_len=256, dtype="float32")
            started = time.perf_counter()
            engine._start()
            report[label] = {"engines_start_s": round(time.perf_counter() - started, 1),
                             **time_engine(engine, policy, prompts, sampling, args.repeats)}
            tokens[label] = [r["completion_token_ids"] for r in engine.generate(policy, prompts, sampling)]
            engine.close()
            print(json.dumps({label: report[label]}), file=sys.stderr, flush=True)
    reference = tokens["1 server"]
    report["same_completions_as_1_server"] = {label: toks == reference for label, toks in tokens.items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
