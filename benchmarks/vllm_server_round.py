"""A rollout round through `posttrain vllm-serve` (rollout.engine vllm_server) against the in-process vLLM engine.

  .venv/bin/python benchmarks/vllm_server_round.py [--prompts 16] [--generations 8] [--max-new-tokens 32]
                                                   [--rounds 3] [--repeats 2] [--variants vllm,vllm_server]
                                                   [--json PATH]

Builds the ~27M-parameter Qwen2 and LoRA adapter of benchmarks/rollout_engines.py and one adapter per round (the
adapter's lora_B scaled per round), then samples the same rounds through each variant, one after the other:

- `vllm`: the in-process engine (`rollout.engine: vllm`) as a config gets it on CPU: `lora_sync` auto, i.e. each
  round's adapter merged into the weights and reloaded in place;
- `vllm-adapter`: the same engine with `lora_sync: adapter` (vLLM's LoRA kernels, as the server must use);
- `vllm_server`: the `vllm_server` engine as a config gets it on CPU (`lora_sync` auto: each round's adapter
  merged into the weights, loaded into the server through POST /collective_rpc) against one `vllm serve` started
  with the command line `posttrain vllm-serve` builds for it (serve_command, no LoRA);
- `vllm_server-adapter`: the same with `lora_sync: adapter` (axolotl's vllm_lora_sync: true): the server started
  with LoRA enabled, each round's adapter pushed with POST /v1/load_lora_adapter.

A round is `--prompts` prompts x `--generations` completions of <= `--max-new-tokens` tokens at temperature
1.0, its own seed; every round of every repeat is a new adapter version, so each round's time includes that
engine's adapter load (merge + reload, or the server's load). Engine start (and server start) and one warm-up
round are timed apart. Reports per variant the median round wall time, generated tokens/s, the time inside
rounds spent loading adapters, and the ratio of each variant to `vllm`; writes all of it as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_engines import build_model  # noqa: E402
from vllm_servers import start_servers, stop  # noqa: E402

ENGINE_OPTIONS = {"max_lora_rank": 16, "kv_cache_space_gib": 2.0, "max_model_len": 256}
"""rollout.vllm settings of both engines (the servers of benchmarks/vllm_servers.py are started with these)."""

LOAD_METHODS = {"vllm": ("_merged_weights", "_set_weights"), "vllm-adapter": ("_set_weights",),
                "vllm_server": ("_prepare", "_live_servers"), "vllm_server-adapter": ("_prepare", "_live_servers")}
"""The engine methods each round's adapter load (and, for the server, its per-call health check) runs in."""


def round_adapters(root: Path, rounds: int) -> list[Path]:
    """One adapter folder per round (plus a warm-up one, index 0): the built adapter with lora_B scaled by round."""
    from safetensors.torch import load_file, save_file

    weights = load_file(root / "adapter" / "adapter_model.safetensors")
    folders = []
    for index in range(rounds + 1):
        folder = root / f"adapter-round{index}"
        shutil.copytree(root / "adapter", folder)
        scale = 1.0 + 0.25 * index
        save_file({k: v * scale if "lora_B" in k else v for k, v in weights.items()},
                  str(folder / "adapter_model.safetensors"))
        folders.append(folder)
    return folders


def round_prompts(round_index: int, prompts: int, generations: int) -> list:
    """The round's chat prompts, each repeated `generations` times (a group each), as the rollout stage lays them out."""
    return [[{"role": "user", "content": f"Which is the largest of {(round_index + i) % 9 + 1}, {i % 7}, 7?"}]
            for i in range(prompts) for _ in range(generations)]


def timed(engine, names: tuple[str, ...]) -> dict:
    """Wrap the engine's methods `names` so that their seconds add up in the returned dict (reset it per round)."""
    spent = {"load_s": 0.0}

    def wrap(method):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent["load_s"] += time.perf_counter() - started
        return run

    for name in names:
        setattr(engine, name, wrap(getattr(engine, name)))
    return spent


def run_round(engine, spent: dict, policy, prompts: list, sampling) -> tuple[dict, list]:
    """One round's generate: its wall time, tokens, tokens/s and adapter-load seconds; and its completions' ids."""
    spent["load_s"] = 0.0
    started = time.perf_counter()
    rows = engine.generate(policy, prompts, sampling)
    wall = time.perf_counter() - started
    tokens = sum(len(r["completion_token_ids"]) for r in rows)
    return ({"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
             "load_s": round(spent["load_s"], 3)}, [r["completion_token_ids"] for r in rows])


def time_rounds(engine, spent: dict, model_dir: Path, adapters: list[Path], args) -> tuple[dict, list]:
    """A warm-up round, then `--repeats` x `--rounds` rounds, each a new adapter version; their numbers and the
    last repeat's completions (round by round)."""
    from stages.rollout.engines import Policy, Sampling

    def sample(index: int, version: int) -> tuple[dict, list]:
        policy = Policy(model_dir, adapter_dir=adapters[index], version=version)
        sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=index)
        return run_round(engine, spent, policy, round_prompts(index, args.prompts, args.generations), sampling)

    warm, _ = sample(0, 0)
    rounds, tokens = [], []
    for repeat in range(args.repeats):
        tokens = []
        for index in range(1, args.rounds + 1):
            numbers, ids = sample(index, repeat * args.rounds + index)
            rounds.append({"repeat": repeat, "round": index, **numbers})
            tokens.append(ids)
    walls = [r["wall_s"] for r in rounds]
    return {"warmup_round_s": warm["wall_s"], "median_round_s": round(statistics.median(walls), 3),
            "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rounds), 1),
            "median_load_s": round(statistics.median(r["load_s"] for r in rounds), 3), "rounds": rounds}, tokens


def measure(variant: str, root: Path, adapters: list[Path], args) -> tuple[dict, list]:
    """Start the variant's engine (and server), time its rounds, shut it down; (numbers, completions)."""
    from stages.rollout.engines import get_engine

    procs = []
    started = time.perf_counter()
    try:
        if variant.startswith("vllm_server"):
            sync = "adapter" if variant.endswith("-adapter") else "auto"
            urls, procs, _ = start_servers(root / "model", [args.cores], root, lora=sync == "adapter")
            engine = get_engine("vllm_server", root / "model", {"server_urls": urls, "max_lora_rank": 16,
                                                                "lora_sync": sync})
        else:
            sync = "adapter" if variant == "vllm-adapter" else "auto"
            engine = get_engine("vllm", root / "model", {**ENGINE_OPTIONS, "lora_sync": sync})
            engine.start()
        startup = time.perf_counter() - started
        numbers, tokens = time_rounds(engine, timed(engine, LOAD_METHODS[variant]), root / "model", adapters, args)
        engine.close()
    finally:
        stop(procs)
    return {"startup_s": round(startup, 1), **numbers}, tokens


def same_share(a: list, b: list) -> float:
    """The share of completions (over all rounds) whose token ids are equal in `a` and `b`."""
    pairs = [(x, y) for round_a, round_b in zip(a, b) for x, y in zip(round_a, round_b)]
    return round(sum(x == y for x, y in pairs) / len(pairs), 3)


def table(report: dict, variants: list[str]) -> str:
    """The results as a Markdown table, one row per variant."""
    lines = ["| variant | startup s | warm-up round s | median round s | tokens/s | adapter load s | x vllm |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    base = report["vllm"]["median_round_s"] if "vllm" in report else None
    for v in variants:
        r = report[v]
        ratio = f"{r['median_round_s'] / base:.2f}" if base else "-"
        lines.append(f"| {v} | {r['startup_s']} | {r['warmup_round_s']} | {r['median_round_s']} | "
                     f"{r['median_tokens_per_s']} | {r['median_load_s']} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--prompts", type=int, default=16, help="prompts (groups) per round")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="times the same rounds are sampled (new versions)")
    parser.add_argument("--variants", default="vllm,vllm_server",
                        help="comma-separated, run in this order: vllm, vllm-adapter, vllm_server")
    parser.add_argument("--cores", default="0,1", help="the server's CPU threads (VLLM_CPU_OMP_THREADS_BIND)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here (default: stdout only)")
    args = parser.parse_args()

    root = build_model(Path(tempfile.mkdtemp(prefix="posttrain-server-round-")))
    adapters = round_adapters(root, args.rounds)
    variants = args.variants.split(",")
    report = {"prompts": args.prompts, "generations": args.generations, "max_new_tokens": args.max_new_tokens,
              "rounds": args.rounds, "repeats": args.repeats}
    tokens = {}
    for variant in variants:
        report[variant], tokens[variant] = measure(variant, root, adapters, args)
        print(json.dumps({variant: {k: v for k, v in report[variant].items() if k != "rounds"}}),
              file=sys.stderr, flush=True)
    if "vllm" in report:
        report["ratio_to_vllm"] = {v: round(report[v]["median_round_s"] / report["vllm"]["median_round_s"], 3)
                                   for v in variants}
    report["same_tokens"] = {f"{a}/{b}": same_share(tokens[a], tokens[b])
                             for i, a in enumerate(variants) for b in variants[i + 1:]}
    print(table(report, variants))
    print(json.dumps({k: report[k] for k in ("ratio_to_vllm", "same_tokens") if k in report}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main()
