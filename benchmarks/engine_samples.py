"""Do the transformers and vLLM engines sample the same completions? Many samples of the same prompts, compared.

  PYTHONPATH=. .venv/bin/python benchmarks/engine_samples.py --model DIR --prompts FILE.parquet
                                 [--num-prompts 16] [--samples 64] [--max-new-tokens 32] [--temperature 0.7]
                                 [--reward stated_accuracy] [--seed 0] [--out FILE.json]

`--model`: a model folder (e.g. a run's base_model artifact), `--prompts`: a prompts table with `prompt` and
`answer` columns (a run's transform/train.parquet). Each engine samples `--samples` completions of each of the
first `--num-prompts` prompts, policy = the model itself, at the given temperature. The importance ratio of
the optimize stage checks that the engines report the same log-probs for the tokens they sampled; this checks
what they sample. Reported per engine: the mean reward (the config's verifier), the share of completions that
stop before the length limit, the mean length, and how the first sampled token is distributed; then the
difference of mean rewards with its standard error (prompt-level, samples are independent within an engine),
the per-prompt reward differences, and the total-variation distance between the first-token distributions
(with the same statistic between two halves of one engine's samples as the noise floor).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter
from pathlib import Path


def sample(kind: str, model: Path, prompts: list[list[dict]], samples: int, max_new_tokens: int,
           temperature: float, seed: int) -> list[dict]:
    """`samples` completions of every prompt from engine `kind` (prompts repeated, one request each)."""
    from stages.rollout.engines import Policy, Sampling, get_engine

    engine = get_engine(kind, model)
    repeated = [p for p in prompts for _ in range(samples)]
    out = engine.generate(Policy(base_dir=model), repeated,
                          Sampling(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed))
    engine.close()
    return out


def summarize(results: list[dict], answers: list[str], samples: int, reward) -> dict:
    """Mean reward per prompt, stop share, mean length, first-token counts."""
    texts = [r["completion"] for r in results]
    gold = [a for a in answers for _ in range(samples)]
    rewards = reward(completions=texts, answer=gold)
    per_prompt = [statistics.fmean(rewards[i * samples:(i + 1) * samples]) for i in range(len(answers))]
    return {
        "reward": statistics.fmean(rewards),
        "reward_per_prompt": per_prompt,
        "stopped": statistics.fmean(r["finish_reason"] == "stop" for r in results),
        "mean_length": statistics.fmean(len(r["completion_token_ids"]) for r in results),
        "first_tokens": Counter(r["completion_token_ids"][0] for r in results if r["completion_token_ids"]),
        "first_tokens_halves": (Counter(r["completion_token_ids"][0] for r in results[0::2]
                                        if r["completion_token_ids"]),
                                Counter(r["completion_token_ids"][0] for r in results[1::2]
                                        if r["completion_token_ids"])),
    }


def total_variation(a: Counter, b: Counter) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[k] / na - b[k] / nb) for k in set(a) | set(b))


def main() -> None:
    import pyarrow.parquet as pq

    from stages.scoring.rewards import BUILTIN_REWARDS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--reward", default="stated_accuracy", choices=sorted(BUILTIN_REWARDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", default="transformers,vllm")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    rows = pq.read_table(args.prompts).slice(0, args.num_prompts).to_pylist()
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    reward = BUILTIN_REWARDS[args.reward]
    summaries = {}
    for kind in args.engines.split(","):
        results = sample(kind, args.model, prompts, args.samples, args.max_new_tokens, args.temperature, args.seed)
        summaries[kind] = summarize(results, answers, args.samples, reward)
        s = summaries[kind]
        print(f"{kind:13s} reward {s['reward']:.4f}  stopped {s['stopped']:.3f}  mean length {s['mean_length']:.2f}  "
              f"first tokens: {s['first_tokens'].most_common(4)}", flush=True)
    report = {"args": {k: str(v) for k, v in vars(args).items()},
              **{kind: {k: v for k, v in s.items() if k not in ("first_tokens", "first_tokens_halves")}
                 for kind, s in summaries.items()}}
    if len(summaries) == 2:
        a, b = summaries.values()
        diffs = [y - x for x, y in zip(a["reward_per_prompt"], b["reward_per_prompt"])]
        # Each engine's prompt mean has binomial variance p(1-p)/samples; the two engines are independent.
        var = sum(p * (1 - p) / args.samples for s in (a, b) for p in s["reward_per_prompt"]) / len(diffs) ** 2
        report["reward_difference"] = statistics.fmean(diffs)
        report["reward_difference_se"] = math.sqrt(var)
        report["per_prompt_differences"] = diffs
        report["first_token_tv"] = total_variation(a["first_tokens"], b["first_tokens"])
        report["first_token_tv_within"] = [total_variation(*s["first_tokens_halves"]) for s in (a, b)]
        names = list(summaries)
        print(f"reward {names[1]} - {names[0]}: {report['reward_difference']:+.4f} "
              f"+- {report['reward_difference_se']:.4f} "
              f"(1 s.e.); first-token TV {report['first_token_tv']:.4f} (between halves of one engine: "
              f"{report['first_token_tv_within'][0]:.4f}, {report['first_token_tv_within'][1]:.4f})")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
