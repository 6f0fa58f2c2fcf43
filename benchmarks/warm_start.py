"""What the SFT warm start learns, seed by seed: is it the same policy every time?

  .venv/bin/python benchmarks/warm_start.py [--config configs/quickstart.yaml] [--seeds 0 1 2] [OVERRIDE ...]

For each seed (model init, SFT data order; `model.seed` and `sft.seed`), builds demo data, the
base model and the SFT policy with the stage functions (no Prefect, no MLflow), then samples
`--samples` completions per held-out prompt at temperature 1 and greedy-decodes once. Prints, per
seed: greedy accuracy, greedy "first number" rate, sampled rates of the largest number, the first
number, the second largest, any number of the question, and the best constant answer's accuracy.
A warm start GRPO can build on samples the largest number often, greedily says something else
(room to gain), and behaves alike on every seed.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def behaviour(questions: list[str], answers: list[str], completions: list[str]) -> dict:
    """Rates of what the completions name: the largest, the first, the second largest, any listed number."""
    from stages.scoring.rewards.math import extract_answer

    counts = {"largest": 0, "first": 0, "second": 0, "listed": 0}
    for question, answer, completion in zip(questions, answers, completions):
        numbers = re.findall(r"\d+", question)
        said = extract_answer(completion)
        counts["largest"] += said == answer
        counts["first"] += said == numbers[0]
        counts["second"] += said == sorted(numbers, key=int)[-2]
        counts["listed"] += said in numbers
    return {k: v / len(completions) for k, v in counts.items()}


def warm_start(config: str, seed: int, overrides: list[str], samples: int, work: Path) -> dict:
    import pyarrow.parquet as pq
    import torch

    from flows.config import load_config
    from stages.data import base_model, demo_data, transform
    from stages.rollout.engines import Sampling
    from stages.rollout.engines.hf import generate
    from stages.runtime.policy import load_policy
    from stages.training import sft

    cfg = load_config(config, [*overrides, f"model.seed={seed}", f"sft.seed={seed}"])
    for name in ("raw", "prompts", "base", "sft"):
        (work / name).mkdir(parents=True, exist_ok=True)
    demo_data.run(cfg.demo_data, work / "raw")
    transform.run(cfg.transform, {s: work / "raw" / f"{s}.parquet" for s in demo_data.SPLITS}, work / "prompts")
    sft_rows = pq.read_table(work / "prompts" / "sft.parquet").to_pylist()
    texts = ["".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in row["prompt"])
             + f"<|im_start|>assistant\n{row[cfg.sft.completion_field]}<|im_end|>\n" for row in sft_rows]
    base_model.run(cfg.model, texts, work / "base")
    started = time.perf_counter()
    trained = sft.run(cfg.sft, work / "base", work / "prompts" / "sft.parquet", work / "sft")
    sft_s = time.perf_counter() - started

    rows = pq.read_table(work / "prompts" / "eval.parquet").to_pylist()
    questions = [r["prompt"][-1]["content"] for r in rows]
    answers = [r["answer"] for r in rows]
    model, tokenizer = load_policy(work / "sft")
    torch.manual_seed(seed)
    greedy = generate(model, tokenizer, [r["prompt"] for r in rows], Sampling(max_new_tokens=16, do_sample=False), 256)
    sampled = generate(model, tokenizer, [r["prompt"] for r in rows for _ in range(samples)],
                       Sampling(max_new_tokens=16, temperature=1.0, seed=seed), 256)
    greedy_rates = behaviour(questions, answers, [o["completion"] for o in greedy])
    sampled_rates = behaviour([q for q in questions for _ in range(samples)],
                              [a for a in answers for _ in range(samples)],
                              [o["completion"] for o in sampled])
    constant = max(answers.count(a) for a in set(answers)) / len(answers)
    return {"seed": seed, "sft_s": sft_s, "sft_loss": trained["train_loss"], "greedy_acc": greedy_rates["largest"],
            "greedy_first": greedy_rates["first"], **{f"sampled_{k}": v for k, v in sampled_rates.items()},
            "constant": constant}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--samples", type=int, default=8, help="sampled completions per eval prompt")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as work:
            result = warm_start(args.config, seed, args.overrides, args.samples, Path(work))
        results.append(result)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), flush=True)
    keys = [k for k in results[0] if k != "seed"]
    print("| " + " | ".join(["seed", *keys]) + " |")
    print("|" + " --- |" * (len(keys) + 1))
    for r in results:
        print("| " + " | ".join([str(r["seed"]), *(f"{r[k]:.3f}" for k in keys)]) + " |")
    print("| median | " + " | ".join(f"{statistics.median(r[k] for r in results):.3f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
