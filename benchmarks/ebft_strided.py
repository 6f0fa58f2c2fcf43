"""Does strided EBFT (configs/ebft_strided.yaml) improve the held-out documents' continuations?

  .venv/bin/python benchmarks/ebft_strided.py [--config configs/ebft_strided.yaml] [--seeds 0 1 2]
                                              [--artifacts DIR] [OVERRIDE ...]

For every seed: `posttrain run CONFIG --quiet seed=S` in its own process (benchmarks/quickstart.py
`run_once`). Its eval stage (stages/training/ebft_strided.py `evaluate`) writes greedy blocks at every anchor of the
held-out documents, before (the SFT policy, also the frozen feature model) and after the rounds. From those:
token accuracy against the documents' own text (and the best constant token's), the feature-matching
distance, and -- the demo documents' lines end "... is <answer>." -- answer accuracy: every held-out line
read up to its "is ", and whether the policy's greedy next token is the true largest number, next to the
best constant digit's share. Prints one row per seed, the median and range over seeds, and a few final blocks.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from quickstart import print_medians, run_once, stage_path  # noqa: E402  (same directory)


def answer_positions(tokenizer, text: str) -> set[int]:
    """Token indices of a demo document that state a line's answer (the digit after "is ")."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return {i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith(" is ")
            and tokenizer.decode(ids[i : i + 1]).isdigit()}


def answers(model_dir: Path, documents: list[str]) -> dict:
    """Answer accuracy of a policy on the held-out documents: for every line, the document up to its
    "is " read greedily; right when the next token is the line's true answer (the largest number). Also
    the best constant digit's share (the demo's answers are balanced: about 1/5)."""
    import torch

    from stages.runtime.policy import load_policy

    model, tokenizer = load_policy(model_dir)
    right, gold, shown = 0, Counter(), []
    with torch.no_grad():
        for text in documents:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            for p in sorted(answer_positions(tokenizer, text)):
                said = int(model(torch.tensor([ids[:p]])).logits[0, -1].argmax())
                right += said == ids[p]
                gold[ids[p]] += 1
                if len(shown) < 4:
                    shown.append((tokenizer.decode(ids[max(0, p - 14) : p + 1]), tokenizer.decode([said])))
    total = sum(gold.values())
    return {"answer_accuracy": right / total, "answer_constant": gold.most_common(1)[0][1] / total,
            "answers": total, "shown": shown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/ebft_strided.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--artifacts", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import pyarrow.parquet as pq

    artifacts = (args.artifacts or Path(tempfile.mkdtemp(prefix="ebft-strided-"))).resolve()
    rows = []
    for seed in args.seeds:
        seconds, summary = run_once(artifacts, [f"seed={seed}", *args.overrides], args.config)
        documents = [r["text"] for r in pq.read_table(stage_path(summary, "transform") / "eval.parquet").to_pylist()]
        evals = {}
        for which, model in (("base", stage_path(summary, "sft")), ("final", Path(summary["exported_model"]))):
            manifest = json.loads((stage_path(summary, f"eval {which}") / "_manifest.json").read_text())["summary"]
            evals[which] = {**manifest, **answers(model, documents)}
        before, after = evals["base"], evals["final"]
        rows.append({"seed": seed, "wall_s": seconds, "rounds_wall_s": summary["rounds_wall_s"],
                     "before": before, "after": after})
        print(f"seed {seed}: wall {seconds:.0f} s (rounds {summary['rounds_wall_s']:.0f} s); token accuracy "
              f"{before['accuracy']:.3f} -> {after['accuracy']:.3f} (constant {after['constant_baseline']:.3f}); "
              f"answer accuracy {before['answer_accuracy']:.3f} -> {after['answer_accuracy']:.3f} (constant "
              f"{after['answer_constant']:.3f}, {after['answers']} answers); feature distance "
              f"{before['feature_distance']:.4g} -> {after['feature_distance']:.4g}", flush=True)
        for context, said in after["shown"]:
            print(f"    ...{context!r}: the final policy says {said!r}")

    print_medians(rows, [("wall s", lambda r: r["wall_s"]), ("rounds s", lambda r: r["rounds_wall_s"]),
                         ("token accuracy before", lambda r: r["before"]["accuracy"]),
                         ("token accuracy after", lambda r: r["after"]["accuracy"]),
                         ("constant token", lambda r: r["after"]["constant_baseline"]),
                         ("answer accuracy before", lambda r: r["before"]["answer_accuracy"]),
                         ("answer accuracy after", lambda r: r["after"]["answer_accuracy"]),
                         ("constant answer", lambda r: r["after"]["answer_constant"]),
                         ("feature distance before", lambda r: r["before"]["feature_distance"]),
                         ("feature distance after", lambda r: r["after"]["feature_distance"])])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
