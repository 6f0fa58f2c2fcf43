"""Does EBFT (configs/ebft.yaml) improve held-out accuracy and the feature-matching distance?

  .venv/bin/python benchmarks/ebft.py [--config configs/ebft.yaml] [--seeds 0 1 2] [--artifacts DIR]
                                      [--samples 16] [OVERRIDE ...]

For every seed: `posttrain run CONFIG --quiet seed=S` in its own process (benchmarks/quickstart.py
`run_once`), then, on the held-out eval prompts, `--samples` sampled completions (temperature 1, the
rollout stage, same seed for both) of the starting policy (the SFT output, also the frozen feature model)
and of the exported final model, scored by stages/training/ebft.py against the reference completions
(config's ebft.ground_truth): the feature-matching distance ||mean_j phi(y_j) - phi(y)||^2 averaged over
prompts (paper eq. 2), the mean alignment and diversity terms, and the sampled accuracy. Prints one row per
seed, the median and range over seeds, and a few final completions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from quickstart import print_medians, run_once, stage_path  # noqa: E402  (same directory)


def held_out(cfg, feature_model: Path, policy: Path, eval_prompts: Path, samples: int, seed: int, out: Path) -> dict:
    """Sampled completions of `policy` on every eval prompt, scored against the references."""
    import pyarrow.parquet as pq

    from stages.rollout import rollout
    from stages.rollout.engines import Policy
    from stages.scoring.rewards.math import extract_answer
    from stages.training import ebft

    prompts = pq.read_table(eval_prompts).num_rows
    sampling = rollout.RolloutConfig(num_generations=samples, prompts_per_round=prompts, temperature=1.0,
                                     max_completion_length=cfg.rollout.max_completion_length, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    rollout.run(sampling, Policy(policy), eval_prompts, 0, out)
    rows = pq.read_table(out / "rollouts.parquet").to_pylist()
    scores, _ = ebft.score_rows(cfg.ebft, ebft.FeatureNetwork(feature_model, cfg.ebft.feature_layers), rows,
                                samples, str(out))
    return {"distance": float(scores["feature_distance"]), "alignment": float(scores["alignment"].mean()),
            "diversity": float(scores["diversity"].mean()),
            "sampled_accuracy": sum(extract_answer(r["completion"]) == r["answer"] for r in rows) / len(rows),
            "completions": [(r["prompt"][-1]["content"], r["completion"], r["answer"]) for r in rows[::samples][:6]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/ebft.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--artifacts", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--samples", type=int, default=16, help="sampled completions per held-out prompt")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    import torch

    from flows.config import load_config

    torch.set_num_threads(2)
    artifacts = (args.artifacts or Path(tempfile.mkdtemp(prefix="ebft-"))).resolve()
    cfg = load_config(args.config, args.overrides)
    rows = []
    for seed in args.seeds:
        seconds, summary = run_once(artifacts, [f"seed={seed}", *args.overrides], args.config)
        sft, final = stage_path(summary, "sft"), Path(summary["exported_model"])
        eval_prompts = stage_path(summary, "transform") / "eval.parquet"
        work = artifacts / "bench" / summary["run_name"]
        before = held_out(cfg, sft, sft, eval_prompts, args.samples, seed, work / "base")
        after = held_out(cfg, sft, final, eval_prompts, args.samples, seed, work / "final")
        rows.append({"seed": seed, "wall_s": seconds, "rounds_wall_s": summary["rounds_wall_s"],
                     "base": summary["base_accuracy"], "final": summary["final_accuracy"],
                     "baseline": summary["constant_baseline"], "baseline_answer": summary["baseline_answer"],
                     "distinct": summary["final_distinct_answers"], "top": summary["final_top_answer"],
                     "top_frac": summary["final_top_answer_frac"], "before": before, "after": after})
        r = rows[-1]
        print(f"seed {seed}: wall {seconds:.0f} s (rounds {r['rounds_wall_s']:.0f} s); greedy accuracy "
              f"{r['base']:.3f} -> {r['final']:.3f} (constant {r['baseline']:.3f}, '{r['baseline_answer']}'); "
              f"sampled {before['sampled_accuracy']:.3f} -> {after['sampled_accuracy']:.3f}; feature distance "
              f"{before['distance']:.3g} -> {after['distance']:.3g}; alignment {before['alignment']:.4f} -> "
              f"{after['alignment']:.4f}; diversity {before['diversity']:.4f} -> {after['diversity']:.4f}; "
              f"final answers {r['distinct']} distinct, top '{r['top']}' ({r['top_frac']:.2f})", flush=True)
        for question, completion, answer in after["completions"]:
            print(f"    {question!r} -> {completion!r} (gold {answer})")

    print_medians(rows, [("wall s", lambda r: r["wall_s"]), ("greedy accuracy before", lambda r: r["base"]),
                         ("greedy accuracy after", lambda r: r["final"]),
                         ("constant baseline", lambda r: r["baseline"]),
                         ("sampled accuracy before", lambda r: r["before"]["sampled_accuracy"]),
                         ("sampled accuracy after", lambda r: r["after"]["sampled_accuracy"]),
                         ("feature distance before", lambda r: r["before"]["distance"]),
                         ("feature distance after", lambda r: r["after"]["distance"])])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
