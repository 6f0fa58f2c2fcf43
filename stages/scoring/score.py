"""score: reward functions over a round's rollouts, weighted total, group-relative advantages.

Rewards run in `reward_num_workers` spawned subprocesses (stages/scoring/reward_workers.py). A reward
function that raises, hangs past `reward_timeout_s` or kills its worker on a sample does not stop
the stage: that sample gets `reward_on_error` for that function, the row's `errors` column says
what happened ("accuracy: TimeoutError after 60 s"), `score/errors` counts them, and each one's traceback goes
to `reward_errors.log` in the output folder (not the console). Unless the function failed on more than
`max_error_rate` of the round's samples: then it is broken, not flaky, and the stage stops with one
`RewardFunctionError` naming it, its first error and the count, with the tracebacks in `log_dir`'s
reward_errors.log; nothing is written, so nothing is cached. A function that returns the wrong number of values
or a non-number stops it too (a bug, not a flaky sample). The eval stage scores its completions with the same
machinery (`call_rewards`).

Advantages follow TRL's GRPOTrainer (`multi_objective_aggregation`):
- `sum_then_normalize` (GRPO): A = r - mean_group(r), divided by (std + 1e-4) where std is the
  group's (`scale_rewards: group`), the batch's (`batch`), or not at all (`none`, Dr. GRPO), with
  r the weighted sum of the reward functions.
- `normalize_then_sum` (GDPO, arXiv 2601.05242): each function is normalized within the group
  first, then weighted-summed and normalized over the batch (`gdpo_advantages`, stages/scoring/advantages.py).
A reward function may return None for a sample it does not apply to; that sample counts as 0 in
the weighted sum, as TRL's nansum does, and is left out of GDPO's per-function group statistics
and of the `rewards/<name>/mean|std` metrics. Where TRL only warns and trains on 0, two things stop
the stage with `RewardFunctionError` naming the function and the sample, before anything is written:
a value that is not finite (NaN, inf: a grader's 0/0 or log(0), which would reach the advantages), and
a sample no function returns a value for (every one said None: it has no reward at all). With
`reward_on_invalid` set, such a sample gets that value instead (for that function; for the row's total
where no function applied), with a warning and a note in its `errors` column. A function may also return a
`Verdict` (a float with its reason, e.g. the test a program failed): the value is scored, the reason noted in the
`errors` column, and it is no failure.

The summary also holds the round's collapse metrics (`rollout/top_answer_frac`, distinct answers,
identical groups; stages/scoring/collapse.py), which the health checks read. The advantages themselves are
computed in stages/scoring/advantages.py.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.data.schemas import ROLLOUTS, SCORED, write_table
from stages.runtime.imports import LazyModule
from stages.runtime.keys import key_when_set, not_in_key
from stages.scoring.advantages import (_nanstd, gdpo_advantages, group_advantages, reward_spread,
                                       streaming_advantages)
from stages.scoring.collapse import collapse_metrics
from stages.scoring.reward_pools import shared_pool
from stages.scoring.reward_workers import (REWARD_MODEL_PREFIX, RewardFunctionError, is_model_name, resolve_model_name,
                                           reward_model_source)
from stages.scoring.rewards.common import Verdict
from stages.scoring.rewards.remote import REMOTE_PREFIX, RemoteVerifierConfig, check_remote_names, remote_source
from stages.training.scope_rl import AUX_COLUMN

torch = LazyModule("torch")  # imported on first use: loading a config does not import torch
log = logging.getLogger(__name__)

__all__ = ["ScoreConfig", "group_advantages", "gdpo_advantages", "run", "RewardFunctionError"]


class RayScoringConfig(BaseModel):
    """Where `backend: ray` scores (stages/scoring/ray_rewards.py)."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = None
    """Ray cluster to join (`host:6379`, `ray://host:10001`); unset: RAY_ADDRESS, else a local Ray instance."""
    num_cpus_per_actor: float = Field(1.0, gt=0)
    """CPUs Ray reserves for each reward actor (`reward_num_workers` actors)."""


class ScoreConfig(BaseModel):
    """Rewards and advantages (names as in TRL's GRPOConfig)."""

    model_config = ConfigDict(extra="forbid")

    reward_funcs: list[str] = Field(default_factory=lambda: ["accuracy", "format"], min_length=1)
    """Built-in names (accuracy, format), `module.fn` with TRL's signature, `reward_model` (this run's),
    `reward_model:<folder>`, a reward model as TRL names one (a hub id `org/name`, resolved through the hub cache
    to the commit its main branch is at, which the score stage's key holds; or a folder path), or `remote:<name>`:
    the HTTP verifier `<name>` of `remote_verifiers`."""
    remote_verifiers: dict[str, RemoteVerifierConfig] = Field(default_factory=dict)
    """HTTP verification services by name (NeMo Gym resources-server `/verify`, or `posttrain
    serve-rewards`), each scoring the completions of `remote:<name>` (stages/scoring/rewards/remote.py). They run
    inside the reward workers, so reward_timeout_s, reward_on_error and the errors column hold for them."""
    reward_weights: list[float] | None = None
    """One weight per reward function; unset: all 1.0."""
    reward_num_workers: int = Field(2, ge=1)
    """Workers scoring in parallel: subprocesses, or Ray actors with `backend: ray`."""
    backend: Literal["local", "ray"] = not_in_key("local")
    """local: worker subprocesses of this run. ray: actors on a Ray cluster (`ray`), same contract
    (timeouts, dead workers replaced, reward_on_error); not part of the stage key (same scores)."""
    ray: RayScoringConfig = not_in_key(default_factory=RayScoringConfig)
    reward_timeout_s: float = Field(60.0, gt=0)
    """Seconds one call may take; past it the worker is killed and replaced, the batch re-scored one
    sample at a time, and each sample that times out on its own gets `reward_on_error`. Higher: fewer
    false timeouts on slow graders; a hanging function costs up to (1 + batch size / workers) times this."""
    reward_memory_mb: float | None = key_when_set(None, gt=0)
    """Memory (MiB) each reward worker may allocate, enforced by the OS (Linux RLIMIT_DATA: heap and private
    writable memory, not reserved address space); an allocation past it fails the call, and each sample that
    breaches it on its own gets `reward_on_error`, as a timeout does. None: no cap. No default fits every machine:
    importing torch alone takes ~1.6 GB of it on 16 cores (more with more cores; 2048 stopped that import), CUDA and
    a small reward model ~3 GB; a plain grader ~100 MB. Local workers only (not `backend: ray`). In the
    stage's key when set (a breach changes the rewards)."""
    reward_on_error: float = Field(0.0, allow_inf_nan=False)
    """Value a reward function contributes for a sample it raised, hung or crashed on (counted in
    `score/errors`, explained in the row's `errors` column). 0.0: an unscorable completion earns nothing."""
    max_error_rate: float = Field(0.1, ge=0, le=1)
    """Share of a round's samples a reward function may fail on (raise, time out, crash, SampleError) before the
    run stops, naming the function, its first error and the count (RewardFunctionError; the tracebacks in a log
    file). 0.1: a grader that fails on more than one sample in ten is broken, not flaky, and training on its
    `reward_on_error` values teaches the policy the grader's failures (at 10%, a group of 8 holds a failed sample
    58% of the time). Higher: tolerate a flaky remote verifier; 1.0: never stop; 0: stop on the first failure.
    In the key: whether a round is accepted depends on it (a round cached under 0.5 is not served under 0.1)."""
    reward_on_invalid: float | None = key_when_set(None, allow_inf_nan=False)
    """Value recorded where a reward function returned NaN or inf for a sample, and the total of a sample that
    every function returned None for (no reward at all); each is a warning, a note in the row's `errors`
    column and one of `score/errors`. Unset: such a sample stops the stage naming the function and the sample
    (usually a bug in the grader, better fixed than trained on); nothing is written, so nothing is cached."""
    reward_batch_size: int = Field(64, ge=1)
    """Completions per call of a reward function."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's std (GRPO), the batch's std, or nothing (Dr. GRPO).
    Only for `sum_then_normalize`; `normalize_then_sum` always ends with a batch normalization, as TRL.
    TRL's booleans are accepted: true is group, false is none."""

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _trl_booleans(cls, value):
        """TRL's `scale_rewards: true | false` (its older values) as the names it now uses."""
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """TRL's option of the same name. sum_then_normalize (GRPO, TRL's default): weighted sum of the reward
    functions, then group advantages. normalize_then_sum (GDPO): normalize each function within the group,
    then weighted sum, then normalize over the batch; keeps e.g. (format 1, correct 0) and (format 0,
    correct 1) apart where their sums collide. Same result with a single reward function up to the batch
    normalization."""

    @model_validator(mode="after")
    def _remote_names_defined(self):
        check_remote_names(self.reward_funcs, self.remote_verifiers)
        for name, verifier in self.remote_verifiers.items():
            worst = verifier.worst_case_s()
            if worst > self.reward_timeout_s:
                raise ValueError(
                    f"remote_verifiers.{name}: timeout_s x (retries + 1) + backoff = {worst:g} s is more than "
                    f"reward_timeout_s = {self.reward_timeout_s:g} s, so a hanging service would be cut off by the "
                    "worker pool's timeout instead of its own; lower timeout_s or retries, or raise reward_timeout_s")
        return self

    @model_validator(mode="after")
    def _memory_cap_where_enforced(self):
        if self.reward_memory_mb is not None and self.backend == "ray":
            raise ValueError("reward_memory_mb caps local reward workers only; Ray actors are not capped (unset it, "
                             "or use backend: local)")
        return self

    @model_validator(mode="after")
    def _weights_match(self):
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(self.reward_weights)} values for {len(self.reward_funcs)} reward_funcs"
            )
        return self


def metric_name(name: str) -> str:
    """`rewards/<this>/mean`: the function's own name (`pkg.mod.fn` -> fn; a reward model -> reward_model)."""
    if name == "reward_model" or name.startswith(REWARD_MODEL_PREFIX) or is_model_name(name):
        return "reward_model"
    return name.rsplit(".", 1)[-1]


ERROR_LOG = "reward_errors.log"
"""Per-sample failures of reward functions, with tracebacks: in a stage's output folder, or in its `log_dir` when
too many failures stopped it."""


def run(cfg: ScoreConfig, rollouts_path: Path, num_generations: int, out_dir: Path,
        reward_model_dir: Path | None = None, devices=None, log_dir: Path | None = None,
        reward_models: dict | None = None, streaming: bool = False,
        scope_positive_threshold: float | None = None) -> dict:
    """Score rollouts into out_dir/scored.parquet; return reward metrics. `reward_model_dir`: the
    folder the reward function named `reward_model` scores with (this run's reward_model stage).
    `reward_models`: {reward_funcs entry: its ModelSource} for the reward models named TRL's way (a hub id or a
    folder), as the caller resolved them (the task keys their commits); None: resolved here.
    `devices` (stages/runtime/devices.py): where the workers run reward models (None: the folder alone, auto).
    `log_dir`: where reward_errors.log goes when a function fails too often (the stage then stops and its
    output folder is discarded); None: out_dir. `streaming` (grpo.streaming_partial_batch): every advantage statistic
    is its group's, as axolotl's streaming scorer computes them (advantages.py `streaming_advantages`).
    `scope_positive_threshold` (grpo.scope_rl): SCOPE-RL's auxiliary rows get advantage 1 where their total reward
    reaches it, else 0 (`_scope_rl`); the round's reward statistics are its main rows'."""
    sources = worker_sources(cfg, reward_model_dir, devices, reward_models)
    table = pq.read_table(rollouts_path)
    rows = table.to_pylist()
    n = len(rows)
    if n % num_generations:
        raise ValueError(f"{rollouts_path}: {n} rows is not a multiple of num_generations={num_generations}")
    columns = [c for c in table.column_names if (c not in ROLLOUTS.names or c in ("prompt_id",)) and c != AUX_COLUMN]
    weights = cfg.reward_weights or [1.0] * len(cfg.reward_funcs)

    worker_stats: list = []
    started = time.perf_counter()
    raw, failed = call_rewards(cfg, cfg.reward_funcs, rows, [r["rollout_id"] for r in rows], columns, sources,
                               out_dir, log_dir, worker_stats)
    scoring_s = time.perf_counter() - started

    per_function: dict[str, list] = {name: [] for name in cfg.reward_funcs}
    errors: list[list[str]] = [[] for _ in range(n)]
    invalid: list[str] = []  # "reward function 'f' returned nan for sample s", per (function, sample)
    notes = 0  # Verdicts' reasons in the errors column (a value, not a failure: not in score/errors)
    for name in cfg.reward_funcs:
        for row, v in enumerate(raw[name]):
            if isinstance(v, Verdict):
                errors[row].append(f"{name}: {v.why}")
                notes += 1
            if row in failed[name]:
                v = cfg.reward_on_error
                errors[row].append(failed[name][row])
            elif v is not None and not math.isfinite(v := _as_float(v)):
                invalid.append(f"reward function {name!r} returned {v} for sample {rows[row]['rollout_id']}")
                errors[row].append(f"{name}: returned {v}")
                v = cfg.reward_on_invalid
            per_function[name].append(float("nan") if v is None else float(v))
    _refuse_or_record(cfg, invalid, "a reward must be a finite number (or None where the function does not apply)")

    matrix = torch.tensor([per_function[name] for name in cfg.reward_funcs], dtype=torch.float64).T  # (n, F)
    no_reward = torch.isnan(matrix).all(dim=1).tolist()  # every function returned None: TRL warns, trains on 0
    _refuse_or_record(cfg, [f"sample {rows[i]['rollout_id']} has no reward: every reward function "
                            f"({', '.join(cfg.reward_funcs)}) returned None for it" for i in range(n) if no_reward[i]],
                      "make one of them return a number there")
    weights_t = torch.tensor(weights, dtype=torch.float64)
    ray = cfg.backend == "ray"
    totals = torch.nansum(matrix * weights_t, dim=1)
    for i in (i for i in range(n) if no_reward[i]):  # only with reward_on_invalid set (else refused above)
        totals[i] = cfg.reward_on_invalid
        errors[i].append("no reward function returned a value (every one returned None)")
    if streaming:
        advantages = streaming_advantages(totals, matrix, weights_t, num_generations, cfg.multi_objective_aggregation,
                                          cfg.scale_rewards)
    elif cfg.multi_objective_aggregation == "normalize_then_sum":
        advantages = gdpo_advantages(matrix, weights_t, num_generations)  # a row with no reward: advantage 0
    else:
        advantages = group_advantages(totals, num_generations, cfg.scale_rewards)
    _all_finite(totals, advantages, [r["rollout_id"] for r in rows])
    main, scope_metrics = _scope_rl(table, totals, advantages, scope_positive_threshold)

    rewards_column = [
        [(name, None if math.isnan(matrix[i, f]) else float(matrix[i, f])) for f, name in enumerate(cfg.reward_funcs)]
        for i in range(n)
    ]
    scored = (
        table.append_column("rewards", pa.array(rewards_column, type=SCORED.field("rewards").type))
        .append_column("reward", pa.array(totals.tolist(), type=pa.float64()))
        .append_column("advantage", pa.array(advantages.tolist(), type=pa.float64()))
        .append_column("errors", pa.array(errors, type=SCORED.field("errors").type))
    )
    write_table(scored, out_dir / "scored.parquet", SCORED, extra_ok=True)
    metrics = {
        **reward_spread(totals[:main], num_generations),
        **scope_metrics,
        "score/samples": n,
        "score/errors": sum(len(e) for e in errors) - notes,  # (function, sample) pairs that got reward_on_error
        # per function: samples it failed on (their tracebacks in reward_errors.log)
        **{f"score/errors/{metric_name(name)}": len(failed[name]) for name in cfg.reward_funcs if failed[name]},
        **_function_metrics(cfg, matrix[:main]),
        **_worker_metrics(worker_stats, scoring_s, reward_pool(cfg, cfg.reward_funcs, sources) if ray else None),
    }
    # policy collapse (rollout/top_answer_frac, ...; the most common answer as `top_answer`), for
    # stages/evaluation/health.py
    metrics.update(collapse_metrics([r["prompt_id"] for r in rows[:main]], [r["completion"] for r in rows[:main]],
                                    [r["answer"] for r in rows[:main]] if "answer" in table.column_names else None))
    return metrics


def _scope_rl(table: pa.Table, totals, advantages, threshold: float | None) -> tuple[int, dict]:
    """SCOPE-RL's auxiliary rows (grpo.scope_rl: the round's last groups, marked scope_aux by the rollout stage):
    advantage 1 where the total reward reaches `threshold`, else 0 (Eq. 11's positive samples; in place). Returns
    (the main rows' count, {scope/positive_frac}); a table without them: (all its rows, {})."""
    if AUX_COLUMN not in table.column_names:
        return len(totals), {}
    if threshold is None:
        raise ValueError("rollouts with SCOPE-RL's auxiliary rows (scope_aux) need grpo.scope_positive_threshold; "
                         "score them with grpo.scope_rl on")
    aux = torch.tensor(table.column(AUX_COLUMN).to_pylist(), dtype=torch.bool)
    main = int((~aux).sum())
    if not aux[main:].all():
        raise ValueError("SCOPE-RL's auxiliary rows (scope_aux) must follow the round's main rows")
    positive = (totals[aux] >= threshold).to(advantages.dtype)
    advantages[aux] = positive
    return main, {"scope/positive_frac": float(positive.mean())}


def reward_pool(cfg: ScoreConfig, names: list[str], sources: dict):
    """The shared worker pool (stages/scoring/reward_pools.py) that runs `names` with cfg's workers, timeout,
    memory cap and backend."""
    ray = ({"address": cfg.ray.address, "num_cpus": cfg.ray.num_cpus_per_actor} if cfg.backend == "ray" else None)
    return shared_pool(names, cfg.reward_num_workers, cfg.reward_timeout_s, sources, ray, memory_mb=cfg.reward_memory_mb)


def call_rewards(cfg: ScoreConfig, names: list[str], rows: list[dict], ids: list[str], columns: list[str],
                 sources: dict, out_dir: Path, log_dir: Path | None = None,
                 worker_stats: list | None = None) -> tuple[dict[str, list], dict[str, dict[int, str]]]:
    """Every function of `names` on every row (`prompt`, `completion`, `completion_token_ids` if present, and
    `columns` as keyword columns), in cfg.reward_batch_size batches on the shared worker pool:
    ({name: one value per row, None where it does not apply or failed}, {name: {row: what went wrong}}).

    Each failed sample's traceback goes to out_dir/reward_errors.log. A function that failed on more than
    cfg.max_error_rate of the rows stops the caller: RewardFunctionError (one line) naming it, its first error and
    the count, with the log written to `log_dir` (the caller's output folder is discarded) or out_dir."""
    jobs = []
    for name in names:
        for start in range(0, len(rows), cfg.reward_batch_size):
            chunk = rows[start : start + cfg.reward_batch_size]
            batch = {
                "prompts": [r["prompt"] for r in chunk],
                "completions": [[{"role": "assistant", "content": r["completion"]}] for r in chunk],
                **({"completion_ids": [r["completion_token_ids"] for r in chunk]}
                   if chunk and "completion_token_ids" in chunk[0] else {}),
                **{c: [r[c] for r in chunk] for c in columns},
            }
            jobs.append((name, batch, ids[start : start + cfg.reward_batch_size]))
    failures: list[tuple[str, str, str, str]] = []  # (function, sample id, error, traceback)
    outputs = reward_pool(cfg, names, sources).score(jobs, worker_stats, failures)

    # Values come back job by job: function by function, then row batch by row batch.
    values: dict[str, list] = {name: [] for name in names}
    failed: dict[str, dict[int, str]] = {name: {} for name in names}
    for (name, _, _), (got, errors) in zip(jobs, outputs):
        failed[name].update({len(values[name]) + i: e for i, e in errors.items()})
        values[name].extend(got)
    if failures:
        _write_error_log(out_dir / ERROR_LOG, failures)
    _refuse_broken(cfg, names, len(rows), failed, failures, out_dir, log_dir)
    return values, failed


def _write_error_log(path: Path, failures: list[tuple[str, str, str, str]]) -> None:
    """One entry per failed (function, sample): the error, then its traceback."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for name, sample, error, details in failures:
            f.write(f"reward function {name!r} failed on sample {sample}: {error}\n{details.rstrip()}\n\n")


def _refuse_broken(cfg: ScoreConfig, names: list[str], n: int, failed: dict[str, dict[int, str]],
                   failures: list, out_dir: Path, log_dir: Path | None) -> None:
    """RewardFunctionError for the first function that failed on more than cfg.max_error_rate of the n rows."""
    broken = [name for name in names if n and len(failed[name]) / n > cfg.max_error_rate]
    if not broken:
        return
    log_path = out_dir / ERROR_LOG
    if log_dir is not None:  # out_dir is discarded once this error leaves the stage
        log_path = Path(log_dir) / ERROR_LOG
        _write_error_log(log_path, failures)
    name = broken[0]
    _, sample, error, _ = next(f for f in failures if f[0] == name)
    others = f" (also over it: {', '.join(repr(b) for b in broken[1:])})" if broken[1:] else ""
    first = " ".join(error.split())[:300]  # one line
    raise RewardFunctionError(
        f"reward function {name!r} failed on {len(failed[name])} of {n} samples ({len(failed[name]) / n:.0%}, more "
        f"than score.max_error_rate {cfg.max_error_rate:g}){others}; first error (sample {sample}): {first}; every "
        f"failed sample's traceback is in {log_path}; fix the function, or raise score.max_error_rate to train on "
        f"score.reward_on_error ({cfg.reward_on_error:g}) for the samples it fails on")


def _as_float(value) -> float:
    """A reward as a float; an int too large for one is inf (refused as such, not an OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _refuse_or_record(cfg: ScoreConfig, problems: list[str], rule: str) -> None:
    """Samples without a usable reward: with `reward_on_invalid` unset, one RewardFunctionError naming the first
    (the CLI prints it as one line; no scored table is written); set, a warning for each (their value is
    recorded by the caller)."""
    if not problems:
        return
    if cfg.reward_on_invalid is None:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RewardFunctionError(f"{problems[0]}{more}; {rule}: fix the reward function, or set "
                                  "score.reward_on_invalid to record a value for such samples")
    for problem in problems:
        log.warning("%s; recorded as score.reward_on_invalid (%g)", problem, cfg.reward_on_invalid)


def _all_finite(totals, advantages, ids: list[str]) -> None:
    """Last check before the table is written: finite rewards can still overflow float64 in the weighted sum or
    the advantages (1e308 x 2); such a round is refused, never cached."""
    bad = ~(torch.isfinite(totals) & torch.isfinite(advantages))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise RewardFunctionError(f"sample {ids[i]}: reward {float(totals[i])}, advantage {float(advantages[i])}: "
                                  "the rewards overflow float64 once weighted and normalized; scale them (or "
                                  "score.reward_weights) down")


def worker_sources(cfg: ScoreConfig, reward_model_dir: Path | None, devices,
                   reward_models: dict | None = None) -> dict:
    """What the reward workers build besides functions they import: reward models (this run's, named by folder,
    or named TRL's way: their folder from `reward_models`, resolved here where absent) placed per `devices`, and
    each remote verifier's client."""
    sources = {}
    if "reward_model" in cfg.reward_funcs:
        if reward_model_dir is None:
            raise ValueError("score.reward_funcs: 'reward_model' needs a reward model; this run trains none "
                             "(or name a folder: reward_model:/path/to/model)")
        sources["reward_model"] = reward_model_source(Path(reward_model_dir).resolve(), devices)
    for name in cfg.reward_funcs:  # a reward model named by its folder: placed the same way
        if name.startswith(REWARD_MODEL_PREFIX) and devices is not None:
            sources[name] = reward_model_source(name[len(REWARD_MODEL_PREFIX):], devices)
    for name in filter(is_model_name, cfg.reward_funcs):  # a hub id or folder: the resolved files, placed alike
        source = (reward_models or {}).get(name) or resolve_model_name(name)
        sources[name] = reward_model_source(source.path, devices)
    for name in cfg.reward_funcs:  # each worker builds the verifier's client from its config
        if name.startswith(REMOTE_PREFIX):
            sources[name] = remote_source(cfg.remote_verifiers[name[len(REMOTE_PREFIX):]])
    return sources


def _function_metrics(cfg: ScoreConfig, matrix) -> dict:
    """rewards/<name>/mean|std per function, None (NaN) left out, as TRL's."""
    metrics = {}
    for f, name in enumerate(cfg.reward_funcs):
        metrics[f"rewards/{metric_name(name)}/mean"] = float(torch.nanmean(matrix[:, f]))
        metrics[f"rewards/{metric_name(name)}/std"] = float(_nanstd(matrix[:, f], dim=0))
    return metrics


def _worker_metrics(worker_stats: list, scoring_s: float, ray_pool=None) -> dict:
    """Where the scoring ran and how fast (the nested score run in MLflow; not compared between runs)."""
    answered = sum(done for done, _ in worker_stats)
    metrics = {"workers/count": len(worker_stats), "workers/samples_per_s": answered / scoring_s if scoring_s else 0.0}
    for slot, (done, busy) in enumerate(worker_stats):
        metrics[f"workers/{slot}/samples_per_s"] = done / busy if busy else 0.0
    if ray_pool is not None:
        metrics["workers/ray_nodes"] = len({node for node, _ in ray_pool.placement()})
    return metrics


