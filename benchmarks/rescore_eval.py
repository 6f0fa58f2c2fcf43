"""Score saved eval tables again with today's verifiers: greedy completions do not change, the scoring may.

  PYTHONPATH=. .venv/bin/python benchmarks/rescore_eval.py EVAL_PARQUET [EVAL_PARQUET ...]

Each EVAL_PARQUET is an eval stage's `eval.parquet` (artifacts/eval/<key>/, or vs_trl.py's
`vs_trl/seed<S>/eval/`). Prints, per file: the accuracy stored when it was written, the `accuracy` reward's
now (math-verify, lenient: the last number of free text counts), `stated_accuracy` (only an answer the
completion states), the number of distinct completions, the most common one and its share, and the best
constant answer's accuracy on those prompts. Used when issue 25 found the `accuracy` verifier scoring
sentences without a final period as 0 (BENCHMARKS.md, "A real model that learns").
"""

from __future__ import annotations

import sys

import pyarrow.parquet as pq

from stages.evaluation.evaluate import answer_stats
from stages.scoring.rewards import accuracy_reward, stated_accuracy_reward


def rescore(path: str) -> dict:
    rows = pq.read_table(path).to_pylist()
    completions, gold = [r["completion"] for r in rows], [r["answer"] for r in rows]
    stats = answer_stats(completions, gold)
    return {
        "file": path,
        "stored": sum(r["correct"] for r in rows) / len(rows),
        "accuracy": sum(accuracy_reward(completions=completions, answer=gold)) / len(rows),
        "stated_accuracy": sum(stated_accuracy_reward(completions=completions, answer=gold)) / len(rows),
        "distinct": stats["distinct_answers"],
        "top": stats["top_answer"],
        "top_frac": stats["top_answer_frac"],
        "constant": stats["constant_baseline"],
    }


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        r = rescore(path)
        print(f"{r['file']}: stored {r['stored']:.3f}  accuracy {r['accuracy']:.3f}  stated {r['stated_accuracy']:.3f}"
              f"  distinct {r['distinct']}  top {r['top'][:40]!r} ({r['top_frac']:.2f})  constant {r['constant']:.3f}")


if __name__ == "__main__":
    main()
