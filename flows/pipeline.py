"""The GRPO pipeline flow: which tasks run, in which order, per round.

demo_data -> transform -> base_model -> sft -> eval(base)
  -> [rollout(r) -> score(r) -> optimize(r) (-> eval(r) every eval.every_rounds)] x grpo.rounds
  -> export -> eval(final)

Every stage is a cached artifact (tasks/store.py): running the same config again
computes nothing. MLflow gets one parent run per pipeline run, a nested run per
computed stage, per-round metrics, the eval accuracies and the registered model.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import yaml
from prefect import flow
from prefect.runtime import flow_run

from flows.config import ConfigError, PipelineConfig, config_differences, load_config
from stages.engines import close_engines
from stages.health import TrainingUnhealthy, check_round, quarantine
from stages.replay import RoundSignals
from stages.score import metric_name
from stages.rollout_worker import close_workers
from tasks.lineage import Lineage, git_commit, process_alive, ui_command
from tasks.publish import publish_rounds, publish_summary, sample_completions
from tasks.reporting import Reporter
from tasks.stage_tasks import (
    RunContext,
    placement,
    preference_optimization_task,
    preferences_task,
    reward_model_task,
    base_model_task,
    demo_data_task,
    eval_task,
    export_task,
    optimize_task,
    atropos_batch_size,
    atropos_batch_task,
    atropos_score_task,
    ebft_score_task,
    policy_for,
    replay_task,
    rollout_task,
    score_task,
    sft_task,
    transform_task,
)
from tasks.store import ArtifactStore

log = logging.getLogger("posttrain.health")


def normalize_overrides(overrides: list[str] | dict | None) -> list[str]:
    """Accept ["grpo.rounds=2"] (CLI) or {"grpo.rounds": 2} (Prefect parameters)."""
    if not overrides:
        return []
    if isinstance(overrides, dict):
        return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()]
    return list(overrides)


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
    "train/replayed_rows": ("optimize", "replayed_rows"),
    # policy collapse, from the round's completions (stages/health.py collapse_metrics)
    "rollout/distinct_completions_per_group": ("score", "rollout/distinct_completions_per_group"),
    "rollout/frac_identical_groups": ("score", "rollout/frac_identical_groups"),
    "rollout/distinct_answers": ("score", "rollout/distinct_answers"),
    "rollout/top_answer_frac": ("score", "rollout/top_answer_frac"),
    "rollout/gold_top_answer_frac": ("score", "rollout/gold_top_answer_frac"),
}


EVAL_METRICS = ("accuracy", "constant_baseline", "distinct_answers", "answer_entropy", "format_rate",
                "feature_distance", "exact_blocks")
"""eval summary keys (stages/evaluate.py; ebft strided: stages/ebft_strided.py) logged to the parent run as
eval/<key> at each evaluated step."""


def eval_metrics(summary: dict) -> dict:
    """The parent-run eval/* metrics of one eval artifact's summary."""
    return {f"eval/{k}": summary[k] for k in EVAL_METRICS if k in summary}


def run_rounds(ctx: RunContext, policy, prompts, log_round, scoring: tuple, features=None) -> tuple:
    """rollout -> score -> optimize, grpo.rounds times; returns (last adapter, lineage keys, last metrics).
    `scoring`: (the score task, its keyword arguments besides ctx, rollouts, round); `features`: rl: ebft's
    feature model, for strided evals.

    Synchronous (lag 0): round r samples from the policy after r optimize rounds. With
    rollout.async_prefetch, lag L = min(prefetch_depth, max_staleness): round r samples
    from the policy after max(0, r - L) rounds, and its rollout + score run as concurrent
    Prefect tasks submitted as soon as that policy exists -- while rounds r-L..r-1
    optimize. The schedule is deterministic, so reruns hit the same cached artifacts.
    """
    cfg = ctx.config.rollout
    if cfg.source == "atropos":
        return _atropos_rounds(ctx, policy, prompts, log_round)
    threads = len(cfg.trainer_cpus) if cfg.trainer_cpus else None
    if cfg.lag() and cfg.prefetch_torch_threads:
        threads = cfg.prefetch_torch_threads
    if threads is None:  # nothing to pin: a fully cached run never imports torch
        return _rounds(ctx, policy, prompts, log_round, cfg.lag(), scoring, features)
    import torch

    threads_before, cpus_before = torch.get_num_threads(), os.sched_getaffinity(0)
    if cfg.trainer_cpus:
        os.sched_setaffinity(0, cfg.trainer_cpus)
    torch.set_num_threads(threads)
    try:
        return _rounds(ctx, policy, prompts, log_round, cfg.lag(), scoring, features)
    finally:
        torch.set_num_threads(threads_before)
        os.sched_setaffinity(0, cpus_before)


def eval_round(ctx: RunContext, policy, prompts, adapter, r: int, features=None) -> None:
    """eval.every_rounds: evaluate the policy after r + 1 rounds (base, step 0, and final are evaluated by
    the flow)."""
    cfg = ctx.config
    if cfg.eval.every_rounds and (r + 1) % cfg.eval.every_rounds == 0 and r + 1 < cfg.grpo.rounds:
        evaluated = eval_task(ctx, policy, prompts, label=f"r{r}", adapter=adapter, version=r + 1,
                              feature_model=features)
        ctx.lineage.log_metrics(ctx.lineage.parent_id, eval_metrics(evaluated.manifest["summary"]), step=r + 1)


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


def _atropos_rounds(ctx: RunContext, policy, prompts, log_round) -> tuple:
    """rollout.source: atropos (stages/atropos.py): each round pulls one scored batch from the Atropos API,
    stores it (rollouts, then scored), and optimizes on it; the policy server samples the newest policy."""
    from stages import atropos
    from stages.engines import get_engine
    from stages.rollout import engine_options

    cfg = ctx.config
    session = atropos.AtroposSession(
        cfg.rollout.atropos, lambda: get_engine(cfg.rollout.engine, policy.path,
                                                engine_options(cfg.rollout, cfg.grpo.lora_r, placement(ctx))),
        atropos_batch_size(ctx), cfg.grpo.rounds, ctx.store.root)
    adapter, lineage_keys, metrics = None, {}, {}
    try:
        for r in range(cfg.grpo.rounds):
            session.serve(policy_for(ctx, policy, adapter, r))
            started = time.perf_counter()
            rollouts = atropos_batch_task(ctx, session, policy, adapter, r)
            scored = atropos_score_task(ctx, rollouts, r)
            waited = time.perf_counter() - started
            started = time.perf_counter()
            adapter = optimize_task(ctx, policy, adapter, scored, r)
            optimize_s = time.perf_counter() - started
            eval_round(ctx, policy, prompts, adapter, r)
            metrics = finish_round(r, rollouts, scored, adapter, {"optimize_s": optimize_s, "waiting_s": waited},
                                   log_round, lineage_keys)
    finally:
        session.close()
    return adapter, lineage_keys, metrics


def _rounds(ctx: RunContext, policy, prompts, log_round, lag: int, scoring: tuple, features) -> tuple:
    cfg = ctx.config
    score, score_kwargs = scoring
    in_flight: dict[int, tuple] = {}
    # replay buffer + re-roll queue: rebuilt from the (cached) scored rounds on every run, in round order
    signals = RoundSignals.from_config(cfg.grpo, cfg.grpo.rounds)

    def submit(r: int, adapter, version: int) -> None:
        """Prefetch: round r's rollout and score start on Prefect's thread pool, beside the optimizer."""
        reroll = signals.prompts_to_reroll(r) if signals else []
        rollouts = rollout_task.submit(ctx, policy, adapter, prompts, r, version, reroll)
        in_flight[r] = (rollouts, score.submit(ctx, rollouts, r, **score_kwargs))

    def sampled_and_scored(r: int, adapter) -> tuple:
        """Round r's rollout and score: prefetched, or (no prefetch) run here, on the flow's thread. Every
        torch call of a synchronous run stays on one thread: a second thread gets its own OpenMP team, and two
        teams on 2 cores made the quickstart's optimize stage ~1.7x slower (benchmarks/omp_wait.py)."""
        if r in in_flight:
            rollouts_future, scored_future = in_flight.pop(r)
            return rollouts_future.result(), scored_future.result()
        rollouts = rollout_task(ctx, policy, adapter, prompts, r, r, signals.prompts_to_reroll(r) if signals else [])
        return rollouts, score(ctx, rollouts, r, **score_kwargs)

    for r in range(min(lag + 1, cfg.grpo.rounds) if lag else 0):
        submit(r, None, 0)
    adapter, lineage_keys, metrics = None, {}, {}
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
        adapter = optimize_task(ctx, policy, adapter, train_on, r)
        optimize_s = time.perf_counter() - started
        if lag and r + lag + 1 < cfg.grpo.rounds:
            submit(r + lag + 1, adapter, r + 1)
        eval_round(ctx, policy, prompts, adapter, r, features)
        extra = signals.metrics(len(replaced), rollouts.manifest["summary"].get("rerolled_prompts", 0)) if signals else {}
        metrics = finish_round(r, rollouts, scored, adapter, {"optimize_s": optimize_s, "waiting_s": waited},
                               log_round, lineage_keys, extra, {"replay": train_on.key} if replaced else {})
    return adapter, lineage_keys, metrics


def crash_flow_run(previous_id: str, current_id: str) -> None:
    """Mark the Prefect flow run of an attempt whose process was killed CRASHED: nothing else would, and
    the Prefect UI would show it running forever. Best effort: a failure here only logs a warning."""
    if not previous_id or previous_id == current_id:
        return
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    try:
        with get_client(sync_client=True) as client:
            if client.read_flow_run(previous_id).state.is_running():
                client.set_flow_run_state(previous_id, Crashed(message=f"its process died; flow run {current_id} "
                                                                       "continues its pipeline run"), force=True)
    except Exception as e:  # an old server without that run, a network error: the run itself is not affected
        logging.getLogger(__name__).warning("could not mark flow run %s crashed: %s", previous_id, e)


def open_run(config_path: str, overrides: list[str] | dict | None, quiet: bool, purpose: str = "train",
             resume: str | None = None, allow_config_change: bool = False):
    """Load the config, open (or continue) the MLflow parent run, save the resolved config:
    (ctx, parent run id, run dir).

    A training run continues an unfinished one instead of opening a new run when `resume` names it
    (`posttrain resume`), when this Prefect flow run opened it before (`prefect flow-run retry`), or
    when the newest run of the same config failed or its process died (the same command again).
    Finished stages and rounds are then cache hits; the parent run goes on where it stopped.
    """
    override_list = normalize_overrides(overrides)
    cfg: PipelineConfig = load_config(config_path, override_list)
    root = Path(cfg.artifacts_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    lineage = Lineage(root, cfg.name)
    flow_run_id = str(flow_run.get_id() or "")
    if purpose == "train" and resume is None:
        resume = lineage.unfinished_run(cfg.hash(), flow_run_id)
    if resume:
        previous = lineage.client.get_run(resume)
        run_name = previous.info.run_name
        run_dir = root / "runs" / run_name
        changed = config_differences(yaml.safe_load((run_dir / "config.yaml").read_text()),
                                     cfg.model_dump(mode="json"))
        if changed and not allow_config_change:
            raise ConfigError(f"resume {run_name}: the config differs from the run's in {', '.join(changed)}; "
                              "resume with the run's own config, or pass --allow-config-change")
        lineage.resume(resume, cfg.model_dump(mode="json"), run_dir / "config.yaml")
        if not process_alive(previous.data.tags.get("posttrain.pid", "")):
            crash_flow_run(previous.data.tags.get("prefect.flow_run_id", ""), flow_run_id)
        lineage.set_tags(resume, {"prefect.flow_run_id": flow_run_id, "git_commit": git_commit(),
                                  **({"posttrain.config_changed": ", ".join(changed)} if changed else {})})
        if changed:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        return RunContext(cfg, ArtifactStore(root), lineage, Reporter(root, quiet=quiet)), resume, run_dir
    run_name = f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}" + ("" if purpose == "train" else f"-{purpose}")
    base, n = run_name, 1
    while True:  # another run of this config started in the same second: <name>-2, -3, ...
        run_dir = root / "runs" / run_name
        try:
            run_dir.mkdir(parents=True)
            break
        except FileExistsError:
            n += 1
            run_name = f"{base}-{n}"
    resolved = run_dir / "config.yaml"
    resolved.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    tags = {
        "prefect.flow_run_id": flow_run_id,
        "git_commit": git_commit(),
        "config_hash": cfg.hash(),
        "config_path": str(config_path),
        "overrides": " ".join(override_list),
        "artifact_root": str(root),
        "posttrain.purpose": purpose,
        "posttrain.pid": str(os.getpid()),
    }
    parent = lineage.start(run_name, tags, cfg.model_dump(mode="json"), resolved)
    return RunContext(cfg, ArtifactStore(root), lineage, Reporter(root, quiet=quiet)), parent, run_dir


def announce(ctx: RunContext, message: str, level: int) -> None:
    """Log `message` and show it on the console (a warning in yellow) unless the run is quiet."""
    log.log(level, message)
    if not ctx.reporter.quiet:
        ctx.reporter.console.print(message, soft_wrap=True, markup=False,
                                   style="yellow" if level >= logging.WARNING else None)


def prepare_policy(ctx: RunContext, parent: str) -> tuple:
    """demo_data -> transform -> base_model -> sft: (prompts, base model, starting policy) artifacts."""
    from flows import retrain

    cfg = ctx.config
    raw = None if cfg.transform.paths or cfg.transform.datasets else demo_data_task(ctx)
    prompts = transform_task(ctx, raw)
    for source in prompts.manifest["summary"].get("sources", []):  # transform.datasets: rows per source
        splits = ", ".join(f"{split} {rows}" for split, rows in source["splits"].items())
        message = (f"transform: {source['key']} {source['source']}: {source['rows']} rows ({splits})"
                   + (f", {source['dropped']} dropped" if source["dropped"] else ""))
        announce(ctx, message, logging.INFO)
        ctx.lineage.set_tags(parent, {f"transform.source_rows.{source['key']}": source["rows"],
                                      f"transform.source.{source['key']}": source["source"]})
    for split, dropped in prompts.manifest["summary"].get("dropped", {}).items():  # transform.on_bad_rows: drop
        message = (f"transform: dropped {dropped['rows']} bad row(s) of split {split!r} (transform.on_bad_rows: "
                   f"drop), rows {dropped['indices'][:10]}: {dropped['reasons'][0]}")
        announce(ctx, message, logging.WARNING)
        ctx.lineage.set_tags(parent, {f"transform.dropped_rows.{split}": dropped["rows"]})
    base = base_model_task(ctx, prompts)
    champion = retrain.starting_policy(ctx, parent)  # promotion.start_from_champion: the champion's model
    policy = champion or (sft_task(ctx, base, prompts) if cfg.sft.enabled else base)
    prompts = retrain.data_version_prompts(ctx, parent, raw, prompts)  # data.version: its rows are the train split
    for split in ("train", "eval"):
        meta = prompts.manifest["files"][f"{split}.parquet"]
        ctx.lineage.log_dataset(parent, f"prompts-{split}", prompts.file(f"{split}.parquet"), meta["sha256"],
                                context="training" if split == "train" else "evaluation", rows=meta["rows"])
    return prompts, base, policy


def grpo_rounds(ctx: RunContext, parent: str, policy, prompts, lineage_keys: dict, features=None) -> tuple:
    """The GRPO rounds, logged to the parent run: (last adapter, last round's metrics, wall seconds, each
    round's metrics, health findings). With `reward_model` among score.reward_funcs, a reward model is trained
    first on the preferences; rl: ebft scores with the `features` model (the starting policy) instead of
    score.reward_funcs."""
    started = time.perf_counter()
    if ctx.config.rl == "ebft":  # the frozen feature network (stages/ebft.py)
        scoring = (ebft_score_task, {"feature_model": features})
    elif "reward_model" in ctx.config.score.reward_funcs:
        prefs = log_preferences(ctx, parent, preferences_task(ctx))
        reward_model = reward_model_task(ctx, policy, prefs)
        summary = reward_model.manifest["summary"]
        for key in ("eval_pairwise_accuracy", "eval_step_accuracy"):  # ORM / PRM
            if summary.get(key) is not None:
                ctx.lineage.log_metrics(parent, {f"reward_model/{key}": summary[key]})
        lineage_keys.update(preferences=prefs.key, reward_model=reward_model.key)
        scoring = (score_task, {"reward_model": reward_model})
    else:
        scoring = (score_task, {})
    history: list[dict] = []  # each round's metrics, for the run's summary table
    verifiers = [] if ctx.config.rl == "ebft" or ctx.config.rollout.source == "atropos" else [
        metric_name(n) for n in ctx.config.score.reward_funcs if metric_name(n) != "reward_model"]
    findings_so_far: list[dict] = []  # out-of-range round metrics (stages/health.py)
    unpublished: list[tuple[dict, int, list]] = []  # cached rounds: (metrics, round, completions), logged together

    def log_round(metrics: dict, r: int, scored, adapter) -> None:
        history.append({"round": r, **{k: v for k, v in metrics.items() if not k.startswith("time/")}})
        samples = []
        if not ctx.lineage.already_logged("train/reward_mean", r + 1):  # a resumed run published it already
            samples = sample_completions(scored.file("scored.parquet"), ctx.config.tracking.completions_per_round)
        unpublished.append((metrics, r, samples))
        if not (scored.reused and adapter.reused):  # computed now: show it now (with the cached ones before it)
            publish_unpublished()
        check_health(metrics, r, scored, adapter)

    def publish_unpublished() -> None:
        """Metrics and sample completions of the rounds not logged yet, in one request each."""
        ctx.lineage.log_metric_steps(parent, [(metrics, r + 1) for metrics, r, _ in unpublished])
        publish_rounds(ctx.lineage, parent, ctx.config.name, [(r, samples) for _, r, samples in unpublished])
        unpublished.clear()

    def check_health(metrics: dict, r: int, scored, adapter) -> None:
        """Warn about (tag, list, log) out-of-range metrics; stop on NaN/Inf or with on_unhealthy: stop."""
        cfg = ctx.config.health
        rollouts = ctx.store.get(*scored.manifest["inputs"]["rollouts"].split("/", 1))
        truncated = rollouts.manifest["summary"].get("truncated_frac") if rollouts else None
        top_answer = scored.manifest["summary"].get("top_answer")  # text, for the collapse finding's message
        findings = check_round({**metrics, **({"rollout/truncated_frac": truncated} if truncated is not None else {}),
                                **({"rollout/top_answer": top_answer} if top_answer is not None else {})},
                               cfg, ctx.config.rollout.max_completion_length,
                               first_entropy=history[0].get("train/entropy") if history else None,
                               history=history[:-1], verifiers=verifiers)
        if not findings:
            return
        for f in findings:
            log.warning("round %d: %s = %.6g (healthy: %s): %s", r, f.metric, f.value, f.range, f.message)
            if not ctx.reporter.quiet:
                ctx.reporter.console.print(f"health: round {r}: {f.metric} = {f.value:.4g} (healthy: {f.range}): "
                                           f"{f.message}", soft_wrap=True, markup=False, style="yellow")
        findings_so_far.extend({"round": r, **f.as_dict()} for f in findings)
        stop = [f for f in findings if f.fatal or cfg.on_unhealthy == "stop"]
        ctx.lineage.set_tags(parent, {"health": "stopped" if stop else "warnings",
                                      **{f"health.warning.{f.metric}": f"round {r}: {f.message}" for f in findings}})
        if stop:
            quarantined = quarantine(adapter.path) if any(f.fatal for f in stop) else None
            raise TrainingUnhealthy(r, stop, quarantined)

    try:
        adapter, round_keys, round_metrics = run_rounds(ctx, policy, prompts, log_round, scoring, features)
    finally:
        close_engines()
        close_workers()
        publish_unpublished()
    wall_s = time.perf_counter() - started
    ctx.lineage.log_metrics(parent, {"time/rounds_wall_s": wall_s})
    lineage_keys.update(round_keys)
    return adapter, round_metrics, wall_s, history, findings_so_far


def log_preferences(ctx: RunContext, parent: str, prefs):
    """Record the preference tables as the parent run's dataset inputs; return the artifact."""
    for name, meta in prefs.manifest["files"].items():
        if name.endswith(".parquet"):
            ctx.lineage.log_dataset(parent, f"preferences-{name.removesuffix('.parquet')}", prefs.file(name),
                                    meta["sha256"], context="training", rows=meta.get("rows", 0))
    return prefs


def optimize_preferences(ctx: RunContext, parent: str, policy, lineage_keys: dict) -> tuple:
    """preferences -> dpo/ipo/kto/orpo/simpo, logged to the parent run: (trained artifact, metrics, wall s)."""
    started = time.perf_counter()
    prefs = log_preferences(ctx, parent, preferences_task(ctx))
    trained = preference_optimization_task(ctx, policy, prefs, label=ctx.config.rl)
    summary = trained.manifest["summary"]
    metrics = {f"train/{k}": v for k, v in (summary.get("final_metrics") or {}).items() if isinstance(v, (int, float))}
    ctx.lineage.log_metrics(parent, metrics, step=1)
    if summary.get("eval_accuracy_before") is not None:  # held-out pairs with chosen log-prob margin > 0
        ctx.lineage.log_metrics(parent, {"eval/preference_accuracy": summary["eval_accuracy_before"]}, step=0)
        ctx.lineage.log_metrics(parent, {"eval/preference_accuracy": summary["eval_accuracy_after"]}, step=1)
        metrics["eval/preference_accuracy"] = summary["eval_accuracy_after"]
    lineage_keys.update(preferences=prefs.key, **{ctx.config.rl: trained.key})
    return trained, metrics, time.perf_counter() - started


def reward_model_run(ctx: RunContext, parent: str, run_dir: Path) -> dict:
    """rl: reward_model: base model -> preferences -> reward model, registered in MLflow; return the results
    (pairwise or step accuracy on the preferences' eval split before and after training, the model's folder)."""
    cfg, lineage = ctx.config, ctx.lineage
    try:
        _, base, _ = prepare_policy(ctx, parent)  # sft is off: the reward model starts from model.path
        prefs = log_preferences(ctx, parent, preferences_task(ctx))
        trained = reward_model_task(ctx, base, prefs)
        summary = trained.manifest["summary"]
        accuracy = "eval_step_accuracy" if cfg.reward_model.kind == "prm" else "eval_pairwise_accuracy"
        for step, key in ((0, f"{accuracy}_before"), (1, accuracy)):
            if summary.get(key) is not None:
                lineage.log_metrics(parent, {f"reward_model/{accuracy}": summary[key]}, step=step)
        version = lineage.register_model(parent, trained.path, cfg.export.model_name)
        lineage.set_tags(parent, {"registered_model": f"{cfg.export.model_name}/{version}",
                                  "reward_model": str(trained.path)})
        results = {
            "run_name": run_dir.name, "mlflow_run_id": parent, "experiment": cfg.name, "rl": "reward_model",
            "reward_model_kind": cfg.reward_model.kind, "reward_model": str(trained.path),
            "registered_model_version": version,
            "accuracy_metric": accuracy, "accuracy_before": summary.get(f"{accuracy}_before"),
            "accuracy_after": summary.get(accuracy),
            "eval_rows": summary.get("eval_rows" if cfg.reward_model.kind == "prm" else "eval_pairs"),
            "score_with": f"score.reward_funcs: [reward_model:{trained.path}]",
            "stages": ctx.reporter.rows, "warnings": ctx.reporter.warnings,
            "mlflow_ui": ui_command(Path(cfg.artifacts_dir).resolve()),
        }
        (run_dir / "summary.json").write_text(json.dumps(results, indent=2))
        publish_summary(cfg.name, results, [])
        lineage.client.log_artifact(parent, str(run_dir / "summary.json"))
    except BaseException:
        lineage.finish("FAILED")
        raise
    lineage.finish("FINISHED")
    if not ctx.reporter.quiet:
        ctx.reporter.summary(results)
    return results


@flow(name="posttrain-prepare-policy", flow_run_name="prepare {config_path}")
def prepare_policy_flow(config_path: str, overrides: list[str] | dict | None = None, quiet: bool = False) -> str:
    """Materialize (or find cached) the policy a run starts from; return its folder (what serve-vllm serves)."""
    ctx, parent, _ = open_run(config_path, overrides, quiet, purpose="prepare")
    try:
        _, _, policy = prepare_policy(ctx, parent)
    except BaseException:
        ctx.lineage.finish("FAILED")
        raise
    ctx.lineage.finish("FINISHED")
    return str(policy.path)


@flow(name="posttrain", flow_run_name="{config_path}")
def posttrain_pipeline(config_path: str, overrides: list[str] | dict | None = None, quiet: bool = False,
                       resume: str | None = None, allow_config_change: bool = False) -> dict:
    """Run the pipeline for a YAML config (plus dotted overrides); return the results. `resume`: the
    MLflow run id of an unfinished run to continue (see `open_run` for when that happens by itself)."""
    ctx, parent, run_dir = open_run(config_path, overrides, quiet, resume=resume,
                                    allow_config_change=allow_config_change)
    if ctx.config.rl == "reward_model":
        return reward_model_run(ctx, parent, run_dir)
    cfg, lineage, reporter = ctx.config, ctx.lineage, ctx.reporter
    root = Path(cfg.artifacts_dir).resolve()
    run_name = run_dir.name
    try:
        prompts, base, policy = prepare_policy(ctx, parent)
        base_eval = eval_task(ctx, policy, prompts, label="base")
        lineage.log_metrics(parent, eval_metrics(base_eval.manifest["summary"]), step=0)

        lineage_keys = {"prompts": prompts.key, "base_model": base.key, "policy": f"{policy.stage}/{policy.key}"}
        features = policy if cfg.rl == "ebft" else None  # EBFT's frozen feature model: the starting policy
        history, findings = [], []
        if not cfg.uses_rounds:
            adapter, round_metrics, rounds_wall_s = optimize_preferences(ctx, parent, policy, lineage_keys)
        else:
            adapter, round_metrics, rounds_wall_s, history, findings = grpo_rounds(ctx, parent, policy, prompts,
                                                                                  lineage_keys, features)

        exported = export_task(ctx, policy, adapter, lineage_keys, round_metrics)
        final_eval = eval_task(ctx, exported, prompts, label="final", feature_model=features)
        base_summary, final_summary = base_eval.manifest["summary"], final_eval.manifest["summary"]
        base_acc, final_acc = base_summary["accuracy"], final_summary["accuracy"]
        constant_baseline = final_summary.get("constant_baseline")  # same prompts as base: same baseline
        lineage.log_metrics(parent, eval_metrics(final_summary), step=cfg.grpo.rounds if cfg.uses_rounds else 1)
        lineage.log_metrics(parent, {"eval/accuracy_base": base_acc, "eval/accuracy_final": final_acc,
                                     "eval/accuracy_gain": final_acc - base_acc,
                                     **({"eval/gain_over_baseline": final_acc - constant_baseline}
                                        if constant_baseline is not None else {})})
        version = lineage.register_model(parent, exported.path, cfg.export.model_name)
        lineage.set_tags(parent, {"registered_model": f"{cfg.export.model_name}/{version}",
                                  "exported_model": str(exported.path)})
        from flows import retrain

        promotion = retrain.promote(ctx, parent, version, exported, final_eval, prompts,  # champion or challenger
                                    feature_model=features)
        if not quiet:
            reporter.console.print(f"promotion: {promotion['reason']}", soft_wrap=True, markup=False)
        results = {
            "run_name": run_name,
            "mlflow_run_id": parent,
            "experiment": cfg.name,
            "base_accuracy": base_acc,
            "final_accuracy": final_acc,
            "eval_prompts": final_summary["num_prompts"],
            # a constant answer's accuracy on the same prompts, and how spread the predicted answers are
            "constant_baseline": constant_baseline,
            "baseline_answer": final_summary.get("baseline_answer"),
            "gain_over_baseline": final_acc - constant_baseline if constant_baseline is not None else None,
            **{f"{which}_{k}": summary.get(k) for which, summary in (("base", base_summary), ("final", final_summary))
               for k in ("format_rate", "distinct_answers", "answer_entropy", "top_answer", "top_answer_frac",
                         "constant_policy")},
            "exported_model": str(exported.path),
            "registered_model_version": version,
            "promotion": promotion,
            "rounds_wall_s": rounds_wall_s,
            "health": findings,  # grpo_rounds' out-of-range metrics (stages/health.py)
            "dropped_rows": prompts.manifest["summary"].get("dropped", {}),  # transform.on_bad_rows: drop: per split
            "source_rows": prompts.manifest["summary"].get("sources", []),  # transform.datasets: rows per source
            **({"preference_accuracy_base": adapter.manifest["summary"].get("eval_accuracy_before"),
                "preference_accuracy_final": adapter.manifest["summary"].get("eval_accuracy_after")}
               if not cfg.uses_rounds else {}),
            "stages": reporter.rows,
            "warnings": reporter.warnings,  # e.g. damaged artifact folders that were recomputed
            "mlflow_ui": ui_command(root),
        }
        (run_dir / "summary.json").write_text(json.dumps(results, indent=2))
        publish_summary(cfg.name, results, history)
        lineage.client.log_artifact(parent, str(run_dir / "summary.json"))
    except BaseException:
        lineage.finish("FAILED")
        raise
    lineage.finish("FINISHED")
    if not quiet:
        reporter.summary(results)
    return results
