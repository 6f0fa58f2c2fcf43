"""Does one of the optimize stage's speed-ups move the accuracy? Each switched off in turn, over seeds.

  .venv/bin/python benchmarks/ablations.py --artifacts DIR [--config configs/quickstart.yaml] [--seeds 0 1 ...]
                                           [--variants NAME ...] [--baseline VS_TRL_JSON ...] [OVERRIDE ...]
  .venv/bin/python benchmarks/ablations.py --report DIR ... [--baseline VS_TRL_JSON ...]

For each seed S and variant, `posttrain run CONFIG --quiet artifacts_dir=DIR model.seed=S sft.seed=S
rollout.seed=S grpo.seed=S OVERRIDE... VARIANT...` in its own process (benchmarks/vs_trl.py's seeds, so the
"default" variant is vs_trl's posttrain side), all of a seed's variants in one artifacts folder, so they share
its data, SFT policy and base eval and differ only in their GRPO rounds (a patched variant, whose code
changes under the same cache keys, in DIR/patched-VARIANT, with the main folder's data and SFT linked in).
Variants:

  default              every speed-up on
  no_skip              grpo.skip_zero_advantage_batches=false: every row runs forward and backward and a step
                       whose rows all have advantage 0 still steps AdamW (on its momentum), as TRL
  trl_dapo_normalizer  dapo divides each step by the round's completion tokens over its steps (TRL's mean per
                       step), not by the step's own tokens (benchmarks/ablation_patches/)
  no_reuse_logps       grpo.reuse_sampling_logps=false: pi_old from a no-grad forward pass, not the sampling
                       log-probs (~1e-6 apart per token)
  no_shared_prompt     grpo.shared_prompt_pass=false: a plain forward per micro-batch, not one prompt pass per
                       group with its KV cache copied to the group's rows
  all_off              all of these and atomic_grad_order together
  atomic_grad_order    the KV-cache copy of the shared prompt pass by tensor indexing (before commit a762107),
                       whose backward adds the rows' gradients with atomic adds (benchmarks/ablation_patches/)

Writes DIR/ablations.json (one row per run, rewritten after each) and prints, per variant, the final held-out
accuracy of each seed and min / median / max, beside TRL's and posttrain's from vs_trl.json files (--baseline),
then the mean sampled accuracy of each run's last 5 rounds (finer where the greedy eval is at 1.0 on most seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quickstart import pinned_seeds, run_once  # noqa: E402  (same directory)

PATCHES = Path(__file__).resolve().parent / "ablation_patches"
VARIANTS: dict[str, tuple[list[str], list[str]]] = {  # name: (overrides, patches of ablation_patches/)
    "default": ([], []),
    "no_skip": (["grpo.skip_zero_advantage_batches=false"], []),
    "trl_dapo_normalizer": ([], ["trl_dapo_normalizer"]),
    "no_reuse_logps": (["grpo.reuse_sampling_logps=false"], []),
    "no_shared_prompt": (["grpo.shared_prompt_pass=false"], []),
    "all_off": (["grpo.reuse_sampling_logps=false", "grpo.shared_prompt_pass=false",
                 "grpo.skip_zero_advantage_batches=false"], ["atomic_grad_order", "trl_dapo_normalizer"]),
    "atomic_grad_order": ([], ["atomic_grad_order"]),
}
"""In the order a seed runs them (the ones that change more than float rounding first)."""


UPSTREAM = ("demo_data", "transform", "base_model", "sft")
"""Stages before GRPO, which no variant changes: a patched variant's folder links them from the main one."""


def share_upstream(main: Path, patched: Path) -> None:
    """Hard-link the finished UPSTREAM artifacts of `main` into `patched` (the store reuses them by key)."""
    for stage in UPSTREAM:
        for folder in (main / stage).glob("*/_manifest.json"):
            target = patched / stage / folder.parent.name
            if not target.exists():
                shutil.copytree(folder.parent, target, copy_function=os.link)


def run_variant(config: str, artifacts: Path, seed: int, variant: str, overrides: list[str]) -> dict:
    """One posttrain run of `variant` at `seed`; its row."""
    variant_overrides, patches = VARIANTS[variant]
    env = None
    if patches:  # code patched under the same cache keys: a folder of its own, or it would reuse another's rounds
        patched = artifacts / f"patched-{variant}"
        share_upstream(artifacts, patched)
        artifacts = patched
        env = {**os.environ, "ABLATION_PATCHES": ",".join(patches),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(PATCHES), os.environ.get("PYTHONPATH")]))}
    seconds, summary = run_once(artifacts, [*pinned_seeds(seed), *overrides, *variant_overrides], config, env)
    return {"variant": variant, "seed": seed, "wall_s": round(seconds, 1), "rounds_wall_s": summary["rounds_wall_s"],
            "base": summary["base_accuracy"], "final": summary["final_accuracy"],
            "constant_baseline": summary["constant_baseline"], "run": summary["run_name"],
            "health": summary["health"]}


LAST_ROUNDS = 5


def sampled_accuracy(folder: Path, row: dict) -> float | None:
    """Mean sampled accuracy reward of the run's last LAST_ROUNDS rounds (`rewards/accuracy/mean` of their score
    stages): how well the policy does while it trains, where the greedy eval is already at 1.0."""
    runs = [folder / "runs" / row["run"], folder / f"patched-{row['variant']}" / "runs" / row["run"]]
    summary = json.loads(next(p for p in runs if p.exists()).joinpath("summary.json").read_text())
    scores = [s for s in summary["stages"] if s["stage"].startswith("score r")]
    means = [json.loads((Path(s["path"]) / "_manifest.json").read_text())["summary"].get("rewards/accuracy/mean")
             for s in scores[-LAST_ROUNDS:]]
    return statistics.mean(means) if means and None not in means else None


def spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}" if values else "-"


def print_sampled(rows: list[dict]) -> None:
    """Per variant: sampled accuracy over the last rounds (row["sampled"]) per seed, min / median / max."""
    seeds = sorted({r["seed"] for r in rows})
    print(f"\n| sampled accuracy, last {LAST_ROUNDS} rounds | " + " | ".join(f"seed {s}" for s in seeds)
          + " | min / median / max |")
    print("|" + " --- |" * (len(seeds) + 2))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        by_seed = {r["seed"]: r["sampled"] for r in rows if r["variant"] == variant and r.get("sampled") is not None}
        cells = [f"{by_seed[s]:.3f}" if s in by_seed else "-" for s in seeds]
        print(f"| {variant} | " + " | ".join(cells) + f" | {spread(list(by_seed.values()))} |")


def print_table(rows: list[dict], baselines: list[dict]) -> None:
    """Per variant (and TRL, posttrain from vs_trl.json): final accuracy per seed, min / median / max."""
    seeds = sorted({r["seed"] for r in rows} | {b["seed"] for b in baselines})
    columns: dict[str, dict[int, float]] = {}
    for b in baselines:
        columns.setdefault("TRL (vs_trl)", {})[b["seed"]] = b["trl_accuracy"]
        columns.setdefault("posttrain (vs_trl)", {})[b["seed"]] = b["posttrain_accuracy"]
    for r in rows:
        columns.setdefault(r["variant"], {})[r["seed"]] = r["final"]
    print("| " + " | ".join(["final accuracy", *(f"seed {s}" for s in seeds), "min / median / max",
                             "seeds below TRL by > 0.05"]) + " |")
    print("|" + " --- |" * (len(seeds) + 3))
    trl = columns.get("TRL (vs_trl)", {})
    for name, by_seed in columns.items():
        cells = [f"{by_seed[s]:.3f}" if s in by_seed else "-" for s in seeds]
        below = [s for s, v in by_seed.items() if s in trl and trl[s] - v > 0.05]
        print(f"| {name} | " + " | ".join(cells) + f" | {spread(list(by_seed.values()))} | "
              f"{', '.join(map(str, below)) or 'none'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--artifacts", type=Path, default=None)
    parser.add_argument("--baseline", type=Path, nargs="*", default=[], metavar="VS_TRL_JSON")
    parser.add_argument("--report", type=Path, nargs="+", default=None, metavar="DIR",
                        help="run nothing: print the table of DIR/ablations.json of these folders")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    baselines = [row for path in args.baseline for row in json.loads(path.read_text())]
    if args.report:
        rows = [{**r, "sampled": sampled_accuracy(d, r)} for d in args.report
                for r in json.loads((d / "ablations.json").read_text())]
        print_table(rows, baselines)
        print_sampled(rows)
        return
    if args.artifacts is None:
        parser.error("--artifacts DIR is needed (the runs' folder, and where ablations.json goes)")
    args.artifacts.mkdir(parents=True, exist_ok=True)
    out = args.artifacts / "ablations.json"
    rows = json.loads(out.read_text()) if out.exists() else []
    done = {(r["variant"], r["seed"]) for r in rows}
    for seed in args.seeds:  # seed-major: the seed's SFT is trained once, shared by its variants
        for variant in args.variants:
            if (variant, seed) in done:
                continue
            rows.append(run_variant(args.config, args.artifacts.resolve(), seed, variant, args.overrides))
            out.write_text(json.dumps(rows, indent=2))
            r = rows[-1]
            print(f"seed {seed} {variant}: {r['wall_s']:.0f} s, base {r['base']:.3f} -> final {r['final']:.3f}",
                  flush=True)
    print_table(rows, baselines)
    print_sampled([{**r, "sampled": sampled_accuracy(args.artifacts, r)} for r in rows])


if __name__ == "__main__":
    main()
