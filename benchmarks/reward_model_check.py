"""Does a demo reward model rank the right answer above every other answer a policy can give?

  .venv/bin/python benchmarks/reward_model_check.py REWARD_MODEL_DIR [REWARD_MODEL_DIR ...]
                                                    --prompts ARTIFACTS/transform/KEY/eval.parquet

Held-out pairwise accuracy only checks the wrong answers the preference pairs hold. GRPO tries every
answer, so this scores, for each held-out demo prompt, the completions `<answer>1</answer>` ..
`<answer>9</answer>` (one-digit demo) with the reward model and reports: how often the best-scored
answer is the right one ("argmax right"), and which wrong answers scored at least as high as the right
one, by kind (a number of the question, a number not in it below the largest, not in it above). A
reward model GRPO can trust has argmax right near 1.0; one at 0.2-0.6 is a reward GRPO will hack
(BENCHMARKS.md, issue 12: the policy drifts to the answers in the "beats gold" columns).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def check(reward_model_dir: Path, prompts_path: Path, limit: int, candidates: range) -> dict:
    import pyarrow.parquet as pq

    from stages.data.demo_data import format_answer
    from stages.scoring.rewards.reward_model import RewardModelScorer

    scorer = RewardModelScorer(reward_model_dir, batch_size=256)
    rows = pq.read_table(prompts_path).to_pylist()[:limit]
    prompts = [list(row["prompt"]) for row in rows for _ in candidates]
    scores = scorer(prompts, [format_answer(a) for _ in rows for a in candidates])
    right, beats, pairs = 0, collections.Counter(), collections.Counter()
    for i, row in enumerate(rows):
        by_answer = dict(zip(candidates, scores[i * len(candidates):(i + 1) * len(candidates)]))
        numbers = [int(x) for x in re.findall(r"\d+", row["prompt"][-1]["content"])]
        gold = max(numbers)
        right += max(by_answer, key=by_answer.get) == gold
        for answer, score in by_answer.items():
            if answer != gold and score >= by_answer[gold]:
                kind = "listed" if answer in numbers else ("unlisted below" if answer < gold else "unlisted above")
                beats[kind] += 1
                pairs[(gold, answer)] += 1
    return {"model": str(reward_model_dir), "prompts": len(rows), "argmax_right": right / len(rows),
            "beats_gold": dict(beats), "top_confusions": pairs.most_common(5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", type=Path, nargs="+", help="reward_model stage folders")
    parser.add_argument("--prompts", type=Path, required=True, help="a demo eval.parquet (transform stage)")
    parser.add_argument("--limit", type=int, default=256, help="prompts scored (default 256)")
    args = parser.parse_args()
    print("| reward model | prompts | argmax right | wrong answers scoring >= the right one | top (right, wrong) |")
    print("| --- | --- | --- | --- | --- |")
    for model in args.models:
        r = check(model, args.prompts, args.limit, range(1, 10))
        print(f"| {Path(r['model']).name} | {r['prompts']} | {r['argmax_right']:.3f} | {r['beats_gold'] or '-'} | "
              f"{r['top_confusions'] or '-'} |")


if __name__ == "__main__":
    main()
