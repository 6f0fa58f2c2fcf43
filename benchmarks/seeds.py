"""Does the quickstart learn on every seed, beyond the best constant answer?

  .venv/bin/python benchmarks/seeds.py [--configs configs/quickstart.yaml configs/dpo.yaml configs/rm_grpo.yaml]
                                       [--seeds 0 1 2 3 4] [--artifacts DIR] [OVERRIDE ...]

Runs `posttrain run CONFIG --quiet seed=S` for every config and seed (each its own process, as a
user runs it), all in one artifacts folder, so configs that share a seed share their SFT warm start
(same key) instead of training it again. The top-level `seed` sets the model initialization, the SFT,
rollout and optimizer seeds; the demo data keep their seed, so every run is evaluated on the same
held-out prompts. Prints one row per run (base accuracy, final accuracy, the best constant answer's
accuracy on those prompts, distinct final answers, the most common final answer) and, per config,
min / median / max with the issue-12 goals checked on every seed:

    final >= constant baseline + 0.30   and   final >= base + 0.30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quickstart import run_once  # noqa: E402  (same directory)

GOAL = 0.30


def round0_sampled_accuracy(summary: dict) -> float | None:
    """How often the starting policy's sampled completions were right in round 0 (GRPO configs)."""
    for stage in summary["stages"]:
        if stage["stage"] == "score r0":
            manifest = json.loads((Path(stage["path"]) / "_manifest.json").read_text())
            return manifest["summary"].get("rewards/accuracy/mean")
    return None


def row(config: str, seed: int, seconds: float | None, summary: dict) -> dict:
    base, final = summary["base_accuracy"], summary["final_accuracy"]
    baseline = summary.get("constant_baseline")
    return {"config": Path(config).stem, "seed": seed, "wall_s": seconds, "base": base,
            "base_sampled": round0_sampled_accuracy(summary), "final": final,
            "baseline": baseline, "gain": final - base,
            "over_baseline": final - baseline if baseline is not None else float("nan"),
            "distinct": summary.get("final_distinct_answers"), "top_answer": summary.get("final_top_answer"),
            "top_frac": summary.get("final_top_answer_frac")}


def print_table(rows: list[dict]) -> None:
    print("| config | seed | wall s | base (greedy) | base, sampled in round 0 | final | constant baseline "
          "| final - base | final - baseline | distinct final answers | top final answer (share) |")
    print("|" + " --- |" * 11)
    for r in rows:
        top = f"{r['top_answer']} ({r['top_frac']:.2f})" if r["top_frac"] is not None else "-"
        wall = f"{r['wall_s']:.0f}" if r["wall_s"] is not None else "-"
        sampled = f"{r['base_sampled']:.3f}" if r.get("base_sampled") is not None else "-"
        print(f"| {r['config']} | {r['seed']} | {wall} | {r['base']:.3f} | {sampled} | {r['final']:.3f} | "
              f"{r['baseline']:.3f} | {r['gain']:+.3f} | {r['over_baseline']:+.3f} | {r['distinct']} | {top} |")
    print()
    print("| config | seeds | final min / median / max | final - base min / median / max "
          "| final - baseline min / median / max | goals met on every seed |")
    print("|" + " --- |" * 6)
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]

        def spread(key):
            values = [r[key] for r in mine]
            return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"

        met = all(r["gain"] >= GOAL and r["over_baseline"] >= GOAL for r in mine)
        print(f"| {config} | {len(mine)} | {spread('final')} | {spread('gain')} | {spread('over_baseline')} | "
              f"{'yes' if met else 'NO'} |")


def report(folders: list[Path]) -> list[dict]:
    """A row per (config, seed): the newest finished run of it in these artifacts folders
    (runs/<name>-<date>-<time>/summary.json + config.yaml), so a rerun after a fix replaces the old row."""
    import yaml

    newest = {}
    paths = [path for folder in folders for path in folder.glob("runs/*/summary.json")]
    for summary_path in sorted(paths, key=lambda p: p.parent.name[-15:]):  # <date>-<time>: oldest first
        config = yaml.safe_load((summary_path.parent / "config.yaml").read_text())
        if config.get("seed") is not None:  # runs made with `seed=S` (not per-section seeds, e.g. vs_trl's)
            newest[(config["name"], config["seed"])] = json.loads(summary_path.read_text())
    rows = [row(name, seed, None, summary) for (name, seed), summary in newest.items()]
    return sorted(rows, key=lambda r: (r["config"], r["seed"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+",
                        default=["configs/quickstart.yaml", "configs/dpo.yaml", "configs/rm_grpo.yaml"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--artifacts", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--report", type=Path, nargs="+", default=None, metavar="ARTIFACTS",
                        help="run nothing: print the table of the runs already in these artifacts folders")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.report:
        print_table(report(args.report))
        return
    artifacts = args.artifacts or Path(tempfile.mkdtemp(prefix="posttrain-seeds-"))
    print(f"artifacts: {artifacts}", flush=True)
    rows = []
    started = time.time()
    for seed in args.seeds:  # seed-major: one SFT per seed, shared by the configs
        for config in args.configs:
            seconds, summary = run_once(artifacts, [f"seed={seed}", *args.overrides], config)
            rows.append(row(config, seed, seconds, summary))
            r = rows[-1]
            print(f"{r['config']} seed {seed}: {seconds:.0f} s, base {r['base']:.3f} -> final {r['final']:.3f} "
                  f"(constant baseline {r['baseline']:.3f}, {r['distinct']} distinct answers)", flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=2))
    print(f"\ntotal {time.time() - started:.0f} s\n")
    order = [Path(c).stem for c in args.configs]
    rows.sort(key=lambda r: (order.index(r["config"]), r["seed"]))
    print_table(rows)


if __name__ == "__main__":
    main()
