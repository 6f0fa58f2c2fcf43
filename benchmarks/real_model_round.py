"""Where a rollout round's time and memory go on a real model: one round's generation, engine by engine.

  PYTHONPATH=. .venv/bin/python benchmarks/real_model_round.py --run-dir ARTIFACTS [--variants ...] [--repeat 2]

ARTIFACTS is the artifacts folder of a finished run of configs/smollm2.yaml (any number of rounds >= 1): its
base_model folder, train prompts and last optimize adapter are the inputs. Each variant runs in its own
process (so its peak RSS is its own) and samples the round configs/smollm2.yaml samples: 16 prompts x 8
completions of <= 32 tokens at temperature 1.0, `--repeat` times after the engine is built (the first call
of a vLLM engine also loads the LoRA adapter; the printed `steady` is the median of the later calls).

Variants:
- `vllm-adapter`: the in-process vLLM engine (`rollout.engine: vllm`) with `rollout.vllm.lora_sync:
  adapter`: the adapter as a LoRARequest, applied by vLLM's LoRA kernels (every LoRA round before
  `lora_sync` existed).
- `vllm-merged`: the same engine with `lora_sync: merged` (auto's choice on CPU): the engine merges the
  adapter into a full-weight folder and loads it in place. Each call is a new adapter version (its file
  touched), so every call's time includes the merge, save and reload, as every round's does.
- `vllm-base`: the engine with no adapter (a lower bound for vLLM on this model).
- `transformers`: the transformers engine (`rollout.engine: transformers`), LoRA merged on load.
- add `@LEN` to a vLLM variant to set `rollout.vllm.max_model_len` (unset: the engine's default).
- `optimize`: the optimize stage (`stages.training.grpo.run`, the config's grpo section) on the run's first scored
  round, `--repeat` times each with `grpo.reuse_sampling_logps` on (a one-step round takes pi_old from its
  own forward) and off (a no-grad pi_old pass over the rows first, as every vLLM round did before).

Prints one line per variant: engine build seconds, first and steady call seconds, tokens/s, peak RSS.
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
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def newest(folder: Path, marker: str) -> Path:
    """The most recently written artifact under `folder` that holds `marker`."""
    found = sorted((p.parent for p in folder.glob(f"*/{marker}")), key=lambda p: p.stat().st_mtime)
    if not found:
        sys.exit(f"no {marker} under {folder}: run configs/smollm2.yaml with grpo.rounds >= 1 into that folder first")
    return found[-1]


def inputs(run_dir: Path) -> tuple[Path, Path, list]:
    """(base model folder, adapter folder, the round's 128 chat prompts)."""
    import pyarrow.parquet as pq

    from stages.rollout.rollout import select_prompts

    base = newest(run_dir / "base_model", "config.json")
    adapter = newest(run_dir / "optimize", "adapter_model.safetensors")
    rows = pq.read_table(newest(run_dir / "transform", "train.parquet") / "train.parquet").to_pylist()
    prompts = [row["prompt"] for row in select_prompts(rows, 0, 16, 0) for _ in range(8)]
    return base, adapter, prompts


def optimize_times(run_dir: Path, repeat: int) -> dict:
    """Seconds of stages.training.grpo.run on the run's round-0 scored rollouts,
    pi_old from the step vs its own pass."""
    import yaml

    from stages.training import grpo

    config = yaml.safe_load((ROOT / "configs" / "smollm2.yaml").read_text())
    base = newest(run_dir / "base_model", "config.json")
    import pyarrow.parquet as pq

    scored = next(p.parent for p in (run_dir / "score").glob("*/scored.parquet")
                  if pq.read_table(p, columns=["round_index"]).column(0)[0].as_py() == 0)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for reuse in (True, False):
            cfg = grpo.GRPOConfig(**{**config["grpo"], "rounds": 1, "reuse_sampling_logps": reuse})
            times = []
            for call in range(repeat):
                folder = Path(tmp) / f"{reuse}-{call}"
                folder.mkdir()
                started = time.perf_counter()
                metrics = grpo.run(cfg, base, None, scored / "scored.parquet", 0, 0.7, 32, folder)
                times.append(time.perf_counter() - started)
            out[f"reuse_{str(reuse).lower()}_s"] = round(statistics.median(times), 1)
            out[f"reuse_{str(reuse).lower()}_trained_rows"] = metrics["trained_rows"]
    return {"variant": "optimize", **out,
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def one_variant(variant: str, run_dir: Path, repeat: int) -> dict:
    from stages.rollout.engines import Policy, Sampling, get_engine

    if variant == "optimize":
        return optimize_times(run_dir, repeat)
    name, _, length = variant.partition("@")
    base, adapter, prompts = inputs(run_dir)
    kind = "transformers" if name == "transformers" else "vllm"
    options = {"batch_size": 256}
    if kind == "vllm":
        options = {"max_model_len": int(length) if length else None,
                   "lora_sync": {"vllm-adapter": "adapter", "vllm-merged": "merged"}.get(name, "auto")}
    started = time.perf_counter()
    engine = get_engine(kind, base, options)
    if kind == "vllm":
        engine.start()
    build_s = time.perf_counter() - started
    calls = []
    tokens = 0
    for call in range(repeat):
        # a new version each call, as each round brings one (vLLM loads or merges it afresh)
        policy = Policy(base) if name == "vllm-base" else Policy(base, adapter_dir=adapter, version=call + 1)
        started = time.perf_counter()
        out = engine.generate(policy, prompts, Sampling(max_new_tokens=32, temperature=1.0, seed=call))
        calls.append(time.perf_counter() - started)
        tokens = sum(len(o["completion_token_ids"]) for o in out)
    engine.close()
    return {"variant": variant, "build_s": round(build_s, 1), "first_s": round(calls[0], 1),
            "steady_s": round(statistics.median(calls[1:] or calls), 1), "tokens_last_call": tokens,
            "tokens_per_s": round(tokens / (statistics.median(calls[1:] or calls)), 1),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--variants", nargs="+", default=["vllm-adapter@8192", "vllm-adapter", "vllm-merged",
                                                          "vllm-base", "transformers"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant in this process
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_variant(args.one, args.run_dir.resolve(), args.repeat)), flush=True)
        return
    for variant in args.variants:
        proc = subprocess.run([sys.executable, __file__, "--run-dir", str(args.run_dir), "--repeat", str(args.repeat),
                               "--one", variant], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{variant}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}")
            continue
        print(json.dumps(json.loads(lines[-1][7:])), flush=True)


if __name__ == "__main__":
    main()
