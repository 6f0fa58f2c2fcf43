"""What every kind of GRPO round shares (flows/recipes/grpo.py, ebft.py, atropos.py): the round loop over our own
rollouts (`sampled_rounds`: sync or prefetched, replay and re-rolls), each finished round's bookkeeping
(`finish_round`: metrics, times, lineage), its logging and health checks (`RoundLog`), the periodic evals, and
the run-wide wrapper that pins the trainer's CPUs and closes engines and workers (`logged_rounds`)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from stages.evaluation.health import TrainingUnhealthy, check_round, quarantine
from stages.rollout.engines import close_engines
from stages.rollout.rollout_worker import close_workers
from stages.scoring.replay import RoundSignals
from flows.run import eval_metrics
from tasks.publish import publish_rounds, sample_completions
from tasks.stage_tasks import RunContext, eval_task, optimize_task, replay_task, rollout_task

log = logging.getLogger("posttrain.health")


ROUND_METRICS = {  # parent-run metric name -> (stage, summary key)
    "train/reward_mean": ("score", "reward_mean"),
    "train/reward_std": ("score", "reward_std"),
    "train/frac_reward_zero_std": ("score", "frac_reward_zero_std"),
    "train/reward_errors": ("score", "score/errors"),
    "train/kl": ("optimize", "kl"),
    "train/loss": ("optimize", "loss"),
    "train/ce_loss": ("optimize", "ce_loss"),  # rl: ebft with ebft.ce_coef
    "train/clip_ratio": ("optimize", "clip_ratio"),
    "train/mean_ratio": ("optimize", "mean_ratio"),
    "train/completion_length": ("optimize", "completion_length"),
    "train/grad_norm": ("optimize", "grad_norm"),
    "train/entropy": ("optimize", "entropy"),
    "train/is_ratio_mean": ("optimize", "is_ratio_mean"),
    "train/is_ratio_max": ("optimize", "is_ratio_max"),
    "train/off_policy_masked_frac": ("optimize", "off_policy_masked_frac"),
    "train/learning_rate": ("optimize", "learning_rate"),
    "train/skipped_batches": ("optimize", "skipped_batches"),
    "train/skipped_steps": ("optimize", "skipped_steps"),
    "train/optimizer_steps": ("optimize", "optimizer_steps"),
    "train/truncated_masked": ("optimize", "truncated_masked"),
    "rollout/staleness": ("rollout", "staleness"),
    "rollout/tokens_per_s": ("rollout", "tokens_per_s"),
    "rollout/tokens": ("rollout", "tokens"),
    "rollout/prompts_truncated_frac": ("rollout", "prompts_truncated_frac"),
    "rollout/prompts_too_long": ("rollout", "prompts_too_long"),  # left out under transform.on_bad_rows: drop
    "train/replayed_rows": ("optimize", "replayed_rows"),
    # grpo.scope_rl (axolotl's names): the auxiliary groups' temperature, and the share of them kept as positives
    "scope/temperature": ("rollout", "scope/temperature"),
    "scope/positive_frac": ("score", "scope/positive_frac"),
    # policy collapse, from the round's completions (stages/evaluation/health.py collapse_metrics)
    "rollout/distinct_completions_per_group": ("score", "rollout/distinct_completions_per_group"),
    "rollout/frac_identical_groups": ("score", "rollout/frac_identical_groups"),
    "rollout/distinct_answers": ("score", "rollout/distinct_answers"),
    "rollout/top_answer_frac": ("score", "rollout/top_answer_frac"),
    "rollout/gold_top_answer_frac": ("score", "rollout/gold_top_answer_frac"),
}


def eval_round(ctx: RunContext, policy, prompts, adapter, r: int, evaluate=eval_task) -> None:
    """eval.every_rounds: evaluate the policy after r + 1 rounds with the method's eval task `evaluate` (base,
    step 0, and final are evaluated by the flow)."""
    cfg = ctx.config
    if cfg.eval.every_rounds and (r + 1) % cfg.eval.every_rounds == 0 and r + 1 < cfg.grpo.rounds:
        evaluated = evaluate(ctx, policy, prompts, label=f"r{r}", adapter=adapter, version=r + 1)
        metrics = eval_metrics(evaluated.manifest["summary"])
        ctx.lineage.log_metrics(ctx.lineage.parent_id, metrics, step=r + 1)
        if "eval/accuracy" in metrics:
            ctx.reporter.line(f"eval after round {r + 1}: accuracy {metrics['eval/accuracy']:.3f}")


def settle(in_flight: dict[int, tuple]) -> None:
    """Wait until every prefetched round's rollout and score has finished or failed (their errors are the
    failed rounds', not raised here). Called when the loop ends early: an engine closed under a rollout still
    generating in Prefect's thread pool failed that rollout with an unrelated error, and one not started yet
    would open a new engine after the flow had closed them all."""
    for futures in in_flight.values():
        for future in futures:
            future.wait()


def round_metrics(rollouts, scored, adapter) -> tuple[dict, dict]:
    """A round's parent-run metrics (ROUND_METRICS, per reward function), and its stages' summaries."""
    summaries = {"rollout": rollouts.manifest["summary"], "score": scored.manifest["summary"],
                 "optimize": adapter.manifest["summary"]}
    metrics = {name: summaries[stage][key] for name, (stage, key) in ROUND_METRICS.items()
               if key in summaries[stage]}
    # per reward function, and rl: ebft's feature-matching statistics
    metrics.update({k: v for k, v in summaries["score"].items() if k.startswith(("rewards/", "ebft/"))})
    return metrics, summaries


def finish_round(r: int, rollouts, scored, adapter, times: dict, log_round, lineage_keys: dict,
                 extra_metrics: dict | None = None, extra_lineage: dict | None = None) -> dict:
    """A finished round's bookkeeping, the same for every kind of round: its metrics (round_metrics, the
    stages' times, `extra_metrics`) logged through `log_round`, and its artifacts' keys added to
    `lineage_keys` as round_<r>. Returns the metrics."""
    metrics, summaries = round_metrics(rollouts, scored, adapter)
    metrics.update(extra_metrics or {})
    metrics.update({"time/generate_s": summaries["rollout"].get("generate_s", 0.0),
                    "time/score_s": scored.manifest["wall_time_s"],
                    **{f"time/{name}": seconds for name, seconds in times.items()}})
    log_round(metrics, r, scored, adapter)
    lineage_keys[f"round_{r}"] = {"rollout": rollouts.key, "score": scored.key, "optimize": adapter.key,
                                  "policy_version": summaries["rollout"].get("policy_version", r),
                                  **(extra_lineage or {})}
    return metrics


def sampled_rounds(ctx: RunContext, policy, prompts, log_round, scoring: tuple, evaluate=eval_task,
                   sample=rollout_task, ce_coef: float = 0.0, rl_coef: float = 1.0) -> tuple:
    """rollout -> score -> optimize, grpo.rounds times, with the replay buffer and re-rolls; returns (last
    adapter, lineage keys, last round's metrics). `scoring`: (the score task, its keyword arguments besides ctx,
    rollouts, round); `evaluate`: the eval task of eval.every_rounds; `sample`: the rollout task
    (rl: ebft's strided mode samples blocks of documents); `ce_coef`, `rl_coef`: the optimize stage's loss weights.

    Synchronous (lag 0): round r samples from the policy after r optimize rounds. With
    rollout.async_prefetch, lag L = min(prefetch_depth, max_staleness): round r samples
    from the policy after max(0, r - L) rounds, and its rollout + score run as concurrent
    Prefect tasks submitted as soon as that policy exists -- while rounds r-L..r-1
    optimize. The schedule is deterministic, so reruns hit the same cached artifacts.
    """
    cfg = ctx.config
    lag = cfg.rollout.lag()
    score, score_kwargs = scoring
    in_flight: dict[int, tuple] = {}
    # replay buffer + re-roll queue: rebuilt from the (cached) scored rounds on every run, in round order
    signals = RoundSignals.from_config(cfg.grpo, cfg.grpo.rounds)

    def submit(r: int, adapter, version: int) -> None:
        """Prefetch: round r's rollout and score start on Prefect's thread pool, beside the optimizer."""
        reroll = signals.prompts_to_reroll(r) if signals else []
        rollouts = sample.submit(ctx, policy, adapter, prompts, r, version, reroll)
        in_flight[r] = (rollouts, score.submit(ctx, rollouts, r, **score_kwargs))

    def sampled_and_scored(r: int, adapter) -> tuple:
        """Round r's rollout and score: prefetched, or (no prefetch) run here, on the flow's thread. Every
        torch call of a synchronous run stays on one thread: a second thread gets its own OpenMP team, and two
        teams on 2 cores made the quickstart's optimize stage ~1.7x slower (benchmarks/omp_wait.py)."""
        if r in in_flight:
            rollouts_future, scored_future = in_flight.pop(r)
            return rollouts_future.result(), scored_future.result()
        rollouts = sample(ctx, policy, adapter, prompts, r, r, signals.prompts_to_reroll(r) if signals else [])
        return rollouts, score(ctx, rollouts, r, **score_kwargs)

    for r in range(min(lag + 1, cfg.grpo.rounds) if lag else 0):
        submit(r, None, 0)
    adapter, lineage_keys, metrics = None, {}, {}
    try:
        for r in range(cfg.grpo.rounds):
            waited = time.perf_counter()
            rollouts, scored = sampled_and_scored(r, adapter)
            waited = time.perf_counter() - waited
            started = time.perf_counter()
            train_on, replaced = scored, []
            if signals:
                replaced = signals.after_scoring(r, scored.file("scored.parquet"), f"{scored.stage}/{scored.key}")
                if replaced:
                    train_on = replay_task(ctx, scored, replaced, r)
            adapter = optimize_task(ctx, policy, adapter, train_on, r, ce_coef, rl_coef)
            optimize_s = time.perf_counter() - started
            if lag and r + lag + 1 < cfg.grpo.rounds:
                submit(r + lag + 1, adapter, r + 1)
            eval_round(ctx, policy, prompts, adapter, r, evaluate)
            extra = signals.metrics(len(replaced),
                                    rollouts.manifest["summary"].get("rerolled_prompts", 0)) if signals else {}
            metrics = finish_round(r, rollouts, scored, adapter, {"optimize_s": optimize_s, "waiting_s": waited},
                                   log_round, lineage_keys, extra, {"replay": train_on.key} if replaced else {})
    except Exception:  # the prefetched rounds still running must not outlive the loop (close_engines follows)
        settle(in_flight)
        raise
    return adapter, lineage_keys, metrics


@dataclass
class Trained:
    """What a method's training gives the flow: the trained artifact (the last round's adapter, or the preference
    stage's output), the last round's metrics, the training's wall seconds, each round's metrics and the
    health findings (rounds only), the lineage keys of the artifacts it made, the step the final eval is
    logged at (the rounds done, or 1) and the recipe's own entries of the run's results."""

    adapter: object
    metrics: dict
    wall_s: float
    history: list[dict] = field(default_factory=list)
    findings: list[dict] = field(default_factory=list)
    lineage: dict = field(default_factory=dict)
    steps: int = 1
    results: dict = field(default_factory=dict)


class RoundLog:
    """Each finished round's metrics and sample completions, logged to the parent run (a cached round's waiting
    to go with the next computed one, in one request), and its health checked (stages/evaluation/health.py): warnings
    tag, list and log; NaN/Inf or health.on_unhealthy: stop end the run. `verifiers`: the reward functions
    whose means should rise (health.min_reward_rise)."""

    def __init__(self, ctx: RunContext, parent: str, verifiers: list[str]):
        self.ctx, self.parent, self.verifiers = ctx, parent, verifiers
        self.history: list[dict] = []  # each round's metrics, for the run's summary table
        self.last_finished = time.perf_counter()
        self.computed_s: list[float] = []  # wall seconds of each round computed now (the ETA's rate)
        self.findings: list[dict] = []  # out-of-range round metrics
        self.unpublished: list[tuple[dict, int, list]] = []  # cached rounds: (metrics, round, completions)

    def __call__(self, metrics: dict, r: int, scored, adapter) -> None:
        self.history.append({"round": r, **{k: v for k, v in metrics.items() if not k.startswith("time/")}})
        samples = []
        if not self.ctx.lineage.already_logged("train/reward_mean", r + 1):  # a resumed run published it already
            samples = sample_completions(scored.file("scored.parquet"), self.ctx.config.tracking.completions_per_round)
        self.unpublished.append((metrics, r, samples))
        if not (scored.reused and adapter.reused):  # computed now: show it now (with the cached ones before it)
            self.publish()
        self.show_round(metrics, r, cached=scored.reused and adapter.reused)
        self.warn_reward_errors(r, scored)
        self.check_health(metrics, r, scored, adapter)

    def show_round(self, metrics: dict, r: int, cached: bool) -> None:
        """One console line per round: reward, KL, entropy, completion length, seconds, and the run's ETA (the
        mean of the rounds computed so far, times the rounds left)."""
        now = time.perf_counter()
        seconds, self.last_finished = now - self.last_finished, now
        if not cached:
            self.computed_s.append(seconds)
        total = self.ctx.config.grpo.rounds
        parts = [f"round {r + 1}/{total}:"]
        for name, key, fmt in (("reward", "train/reward_mean", ".3f"), ("kl", "train/kl", ".4f"),
                               ("entropy", "train/entropy", ".3f"), ("length", "train/completion_length", ".1f")):
            if metrics.get(key) is not None:
                parts.append(f"{name} {metrics[key]:{fmt}}")
        parts.append("cached" if cached else f"{seconds:.1f}s")
        left = total - (r + 1)
        if left > 0 and self.computed_s:
            parts.append(f"ETA {format_eta(sum(self.computed_s) / len(self.computed_s) * left)}")
        self.ctx.reporter.line("  ".join(parts))

    def warn_reward_errors(self, r: int, scored) -> None:
        """One warning (console and summary.json's `warnings`) for a round whose reward functions failed on some
        samples (fewer than score.max_error_rate: more stop the run), naming the log with their tracebacks."""
        from stages.scoring.score import ERROR_LOG

        summary = scored.manifest["summary"]
        counts = {k.removeprefix("score/errors/"): v for k, v in summary.items()
                  if k.startswith("score/errors/") and v}
        if counts:
            failed = ", ".join(f"{name} failed on {count}" for name, count in counts.items())
            self.ctx.reporter.warn(f"score r{r}: {failed} of {summary.get('score/samples', '?')} samples, which got "
                                   f"score.reward_on_error; tracebacks: {scored.path / ERROR_LOG}")

    def publish(self) -> None:
        """Metrics and sample completions of the rounds not logged yet, in one request each."""
        ctx = self.ctx
        ctx.lineage.log_metric_steps(self.parent, [(metrics, r + 1) for metrics, r, _ in self.unpublished])
        publish_rounds(ctx.lineage, self.parent, ctx.config.name, [(r, samples) for _, r, samples in self.unpublished])
        self.unpublished.clear()

    def check_health(self, metrics: dict, r: int, scored, adapter) -> None:
        """Warn about (tag, list, log) out-of-range metrics; stop on NaN/Inf or with on_unhealthy: stop."""
        ctx, cfg = self.ctx, self.ctx.config.health
        rollouts = ctx.store.get(*scored.manifest["inputs"]["rollouts"].split("/", 1))
        truncated = rollouts.manifest["summary"].get("truncated_frac") if rollouts else None
        top_answer = scored.manifest["summary"].get("top_answer")  # text, for the collapse finding's message
        findings = check_round({**metrics, **({"rollout/truncated_frac": truncated} if truncated is not None else {}),
                                **({"rollout/top_answer": top_answer} if top_answer is not None else {})},
                               cfg, ctx.config.rollout.max_completion_length,
                               first_entropy=self.history[0].get("train/entropy") if self.history else None,
                               history=self.history[:-1], verifiers=self.verifiers)
        if not findings:
            return
        for f in findings:
            log.warning("round %d: %s = %.6g (healthy: %s): %s", r, f.metric, f.value, f.range, f.message)
            if not ctx.reporter.quiet:
                ctx.reporter.console.print(f"health: round {r}: {f.metric} = {f.value:.4g} (healthy: {f.range}): "
                                           f"{f.message}", soft_wrap=True, markup=False, style="yellow")
        self.findings.extend({"round": r, **f.as_dict()} for f in findings)
        stop = [f for f in findings if f.fatal or cfg.on_unhealthy == "stop"]
        ctx.lineage.set_tags(self.parent, {"health": "stopped" if stop else "warnings",
                                           **{f"health.warning.{f.metric}": f"round {r}: {f.message}"
                                              for f in findings}})
        if stop:
            quarantined = quarantine(adapter.path) if any(f.fatal for f in stop) else None
            raise TrainingUnhealthy(r, stop, quarantined)


def format_eta(seconds: float) -> str:
    """12s, 3m05s, 1h02m."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def logged_rounds(ctx: RunContext, parent: str, verifiers: list[str], rounds) -> Trained:
    """Run `rounds(log_round)` (a recipe's loop: returns (last adapter, lineage keys, last metrics)) with a
    RoundLog, on the trainer's CPUs (rollout.trainer_cpus, prefetch_torch_threads), then close the engines and
    worker processes and publish what is left, however the loop ended."""
    started = time.perf_counter()
    round_log = RoundLog(ctx, parent, verifiers)
    try:
        with trainer_threads(ctx.config.rollout):
            adapter, keys, metrics = rounds(round_log)
    finally:
        close_engines()
        close_workers()
        round_log.publish()
    wall_s = time.perf_counter() - started
    ctx.lineage.log_metrics(parent, {"time/rounds_wall_s": wall_s})
    return Trained(adapter, metrics, wall_s, round_log.history, round_log.findings, keys, ctx.config.grpo.rounds)


class trainer_threads:
    """The flow thread's torch threads and CPUs while the rounds run: rollout.trainer_cpus pins them (and sets
    as many threads), rollout.prefetch_torch_threads sets the threads under async prefetch; restored after.
    Nothing to pin: torch is not imported (a fully cached run never imports it)."""

    def __init__(self, cfg):
        threads = len(cfg.trainer_cpus) if cfg.trainer_cpus else None
        if cfg.lag() and cfg.prefetch_torch_threads:
            threads = cfg.prefetch_torch_threads
        self.threads, self.cpus, self.saved = threads, cfg.trainer_cpus, None

    def __enter__(self):
        if self.threads is None:
            return self
        import torch

        self.saved = (torch.get_num_threads(), os.sched_getaffinity(0))
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        torch.set_num_threads(self.threads)
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            import torch

            torch.set_num_threads(self.saved[0])
            os.sched_setaffinity(0, self.saved[1])
        return False
