"""The base accuracy of a config's starting policy on reasoning-gym tasks, through posttrain's own eval stage.

For each task named on the command line: the config (default configs/smollm2.yaml: SmolLM2-135M-Instruct) with
that task as its train source (`{path: reasoning_gym, name: TASK, size: --train-size, seed: 1}`) and a held-out
eval source of N items from another seed (`--eval-seed`, past the train seeds), reasoning-gym's default system
prompt (it asks for the answer in <answer></answer>), `score.reward_funcs: [reasoning_gym]` (the task's own
scorer, which the eval then judges with), and greedy eval completions of `--max-tokens` tokens. One Prefect flow
per task prepares the policy as a run does (demo_data/transform -> base_model -> sft; flows/run.py
prepare_policy: the base_model stage is a cache hit after the first task in one artifacts folder) and runs the
eval stage on it as the pipeline's base eval does (tasks/stage_tasks.py eval_task -> stages/evaluation/evaluate.py).

Per task it prints and writes (--out, JSON): the base accuracy, the constant-answer baseline the eval reports
(by the same scorer), the share of completions with an <answer>...</answer> block, the eval stage's seconds, and
3 sample completions.

    taskset -c 1 nice -n 10 .venv/bin/python benchmarks/reasoning_gym_base.py leg_counting basic_arithmetic \\
        --artifacts /tmp/rg_base --n 32
    # a task's own config: TASK='{"min_animals": 1, "max_animals": 3}' (JSON after '=')
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_right(completion: str, answer) -> bool:
    """Diagnosis, not the score: the completion's last number is the gold answer (were it tagged)."""
    numbers = NUMBER.findall(completion or "")
    try:
        return bool(numbers) and answer is not None and float(numbers[-1]) == float(str(answer).strip())
    except ValueError:
        return False

KINDS = {  # what kind of task each candidate is (issue 47 item 3 asks for different kinds)
    "basic_arithmetic": "arithmetic", "chain_sum": "arithmetic", "products": "arithmetic",
    "simple_equations": "algebra", "gsm_symbolic": "word problem", "leg_counting": "word problem / counting",
    "count_primes": "counting", "letter_counting": "counting", "number_sorting": "sorting",
    "propositional_logic": "logic puzzle", "countdown": "puzzle",
}


def parse_task(spec: str) -> tuple[str, dict]:
    """'leg_counting' or 'leg_counting={"max_animals": 3}' -> (name, config)."""
    name, _, config = spec.partition("=")
    return name, (json.loads(config) if config else {})


def overrides_for(name: str, config: dict, args) -> dict:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    source = {"path": "reasoning_gym", "name": name, "config": config}
    tokens = args.max_tokens
    return {
        "name": f"rg-base-{name}",
        "artifacts_dir": str(Path(args.artifacts).resolve()),
        "model.path": str((ROOT / args.model).resolve()) if not Path(args.model).is_absolute() else args.model,
        "transform.datasets": [{**source, "size": args.train_size, "seed": 1}],
        "transform.test_datasets": [{**source, "size": args.n, "seed": args.eval_seed}],
        "transform.system_prompt": args.system_prompt or SYSTEM_PROMPTS["default"],
        "score.reward_funcs": ["reasoning_gym"],
        "score.reward_num_workers": 1,
        "rollout.max_completion_length": tokens,
        "eval.max_completion_length": tokens,
        "eval.batch_size": args.batch_size,
    }


def base_eval(config_path: str, overrides: dict) -> dict:
    """One Prefect flow: prepare the policy as a run does, then the eval stage on it (label base)."""
    name = overrides["name"]
    overrides = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]  # JSON is YAML: strings stay strings
    from prefect import flow

    from flows.run import open_run, prepare_policy
    from tasks.stage_tasks import eval_task

    @flow(name="posttrain-reasoning-gym-base", flow_run_name=f"base {name}")
    def run() -> dict:
        ctx, parent, _ = open_run(config_path, overrides, True, purpose="prepare")
        try:
            prompts, _, policy = prepare_policy(ctx, parent)
            started = time.perf_counter()
            evaluated = eval_task(ctx, policy, prompts, label="base")
            seconds = time.perf_counter() - started
        except BaseException:
            ctx.lineage.finish("FAILED")
            raise
        ctx.lineage.finish("FINISHED")
        return {"policy": str(policy.path), "prompts_dir": str(prompts.path), "eval_dir": str(evaluated.path), "summary": evaluated.manifest["summary"],
                "cost": evaluated.manifest.get("cost"), "seconds": seconds}

    return run()


def report(name: str, config: dict, args, result: dict) -> dict:
    import pyarrow.parquet as pq

    rows = pq.read_table(Path(result["eval_dir"]) / "eval.parquet").to_pylist()
    questions = {r["prompt_id"]: r["prompt"][-1]["content"]  # the user message: the task's question
                 for r in pq.read_table(Path(result["prompts_dir"]) / "eval.parquet").to_pylist()}
    summary = result["summary"]
    tagged = [bool(ANSWER.search(r["completion"])) for r in rows]
    cost = result.get("cost") or {}
    wall = cost.get("wall_s") if isinstance(cost, dict) else None
    return {
        "task": name, "kind": KINDS.get(name, "?"), "config": config, "n": len(rows),
        "base_accuracy": summary.get("accuracy"), "constant_baseline": summary.get("constant_baseline"),
        "answer_block_share": sum(tagged) / len(rows) if rows else None,
        "mean_reward": sum(r["reward"] or 0.0 for r in rows) / len(rows) if rows else None,
        # diagnosis, not a score: the gold answer's text appears in the completion (tagged or not)
        "gold_in_completion_share": (sum(bool(r.get("answer")) and str(r["answer"]).strip() in r["completion"]
                                         for r in rows) / len(rows)) if rows else None,
        "last_number_right_share": sum(last_number_right(r["completion"], r.get("answer")) for r in rows) / len(rows)
        if rows else None,
        "format_rate": summary.get("format_rate"), "verifier": summary.get("verifier"),
        "seconds": round(wall if wall is not None else result["seconds"], 1),
        "max_tokens": args.max_tokens, "system_prompt": args.system_prompt or "reasoning-gym default",
        "eval_dir": result["eval_dir"],
        "samples": [{"question": questions[r["prompt_id"]], "answer": r.get("answer"),
                     "completion": r["completion"], "reward": r["reward"]} for r in rows[:3]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tasks", nargs="+", help="reasoning-gym task names (TASK or TASK='{json config}')")
    parser.add_argument("--config", default="configs/smollm2.yaml")
    parser.add_argument("--model", default="artifacts/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--artifacts", default="/tmp/rg_base")
    parser.add_argument("--n", type=int, default=32, help="held-out items evaluated per task")
    parser.add_argument("--max-tokens", type=int, default=256, help="greedy completion length")
    parser.add_argument("--batch-size", type=int, default=32, help="eval prompts per generate call")
    parser.add_argument("--train-size", type=int, default=500, help="train source rows (not evaluated)")
    parser.add_argument("--eval-seed", type=int, default=10000)
    parser.add_argument("--system-prompt", default=None,
                        help="the system message (default: reasoning-gym's SYSTEM_PROMPTS['default'])")
    parser.add_argument("--out", default=None, help="JSON file of the results (default: ARTIFACTS/results.json)")
    args = parser.parse_args()

    import torch

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(threads)  # taskset -c 1: one thread, not one per core of the machine
    from stages.data.reasoning_gym_source import create

    specs = [parse_task(s) for s in args.tasks]
    for name, config in specs:  # an unknown task or config key stops here, before any model loads
        create(name, 1, 0, config)
    out = Path(args.out or Path(args.artifacts) / "results.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.exists() else {}
    config_path = str((ROOT / args.config).resolve())
    for name, config in specs:
        print(f"== {name} {config or ''}: {args.n} held-out items, {args.max_tokens} tokens greedy", flush=True)
        try:
            result = report(name, config, args, base_eval(config_path, overrides_for(name, config, args)))
        except Exception as e:  # the next task still runs; the failure is recorded
            result = {"task": name, "config": config, "error": f"{type(e).__name__}: {e}"}
            print(f"   FAILED: {result['error']}", flush=True)
        key = name + (json.dumps(config, sort_keys=True) if config else "") + (f" sp:{hashlib.sha1(args.system_prompt.encode()).hexdigest()[:8]}" if args.system_prompt else "")
        results[f"{key} n{args.n} t{args.max_tokens}"] = result
        out.write_text(json.dumps(results, indent=2))
        if "error" not in result:
            print(f"   accuracy {result['base_accuracy']:.3f}  constant {result['constant_baseline']}  "
                  f"<answer> {result['answer_block_share']:.2f}  {result['seconds']} s", flush=True)
            for s in result["samples"]:
                print(f"   gold {s['answer']!r} reward {s['reward']}: {s['completion'][:300]!r}", flush=True)
    print(f"results: {out}")
    print(f"{'task':22} {'kind':24} {'N':>3} {'acc':>6} {'const':>6} {'<ans>':>6} {'s':>7}")
    for r in results.values():
        if "error" in r:
            print(f"{r['task']:22} FAILED {r['error'][:80]}")
            continue
        const = r["constant_baseline"]
        print(f"{r['task']:22} {r['kind']:24} {r['n']:>3} {r['base_accuracy']:>6.3f} "
              f"{const if const is None else format(const, '.3f'):>6} {r['answer_block_share']:>6.2f} "
              f"{r['seconds']:>7}")


if __name__ == "__main__":
    main()
