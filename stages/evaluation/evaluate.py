"""eval: greedy accuracy of a policy on the held-out prompts, and what a constant answer scores.

With `num_samples` k > 1, k sampled completions per prompt instead: accuracy is their share of correct ones (pass@1),
beside pass@k by the HumanEval paper's unbiased estimator (`pass_at_k`).

A completion is correct when the task's verifier gives it at least `correct_threshold`: the reward functions of
`reward_funcs` (by default the run's own verifiers, `verifier_funcs`; the built-in math-verify `accuracy` for
the built-in task), run on the same worker pool as the score stage (stages/scoring/score.py `call_rewards`:
timeouts, crashes, score.max_error_rate), as TRL evaluates GRPO with its training reward functions. Accuracy
alone can flatter a policy that always gives the same answer: on a task whose most common answer is
"9" for 59% of prompts, always saying "9" scores 0.59. So the summary also has the constant
baseline (the best constant answer's accuracy on the same prompts, by the same verifier) and the spread of the
predicted answers (`answer_stats`). Writes every prompt's completion, predicted answer, reward and
verdict to out_dir/eval.parquet for inspection.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from pathlib import Path
from typing import Callable, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.runtime.keys import key_when_set, not_in_key

log = logging.getLogger(__name__)

CONSTANT_POLICY_FRAC = 0.95
"""A policy that gives one answer to at least this share of the prompts is a constant answer."""


class EvalConfig(BaseModel):
    """Held-out evaluation."""

    model_config = ConfigDict(extra="forbid")

    split: str = "eval"
    """Prompts split to evaluate on."""
    max_prompts: int | None = Field(None, ge=1)
    """Evaluate on the first N prompts only; unset: all."""
    max_completion_length: int = Field(16, ge=1)
    """Most tokens of each greedy eval completion (set it as rollout.max_completion_length: a shorter budget
    cuts answers the policy was trained to give)."""
    batch_size: int = Field(256, ge=1)
    """Eval prompts per generate call. Higher: faster, more memory."""
    too_long_prompts: Literal["fail", "drop"] = "fail"
    """An eval prompt that leaves less room than max_completion_length in the model's context (its
    max_position_embeddings), which it would run past. fail: the eval stops before the model loads, naming its row
    in the prompts file and its length. drop: it is left out (of the first max_prompts rows), with a warning naming
    the count and the first row, and the count as the summary's `prompts_too_long`. A run's config sets it from
    transform.on_bad_rows (the transform runs before the model exists) unless it is set here."""
    reward_funcs: list[str] | None = Field(None, min_length=1)
    """The task's verifier: reward functions (names as in score.reward_funcs) whose reward decides whether a
    completion is correct. Unset: the run's verifiers, which are the entries of score.reward_funcs that are not
    built-in (your `module.fn` and `remote:<name>`: the task's own scorer) and the built-ins `reasoning_gym` and
    `human_eval` (the task's own scorer too), or `accuracy` (math-verify) when score.reward_funcs names no verifier (accuracy,
    stated_accuracy, format, code_execution, reward models), so the built-in task is judged as before
    (`verifier_funcs`). Set it when a function of yours is a shaping term (a length or format bonus), not a verdict.
    With several, a completion's reward is their mean (None, "does not apply", left out)."""
    correct_threshold: float = Field(1.0, allow_inf_nan=False)
    """A completion is correct when its verifier reward is at least this. 1.0: a 0/1 verifier's right answers
    (partial credit, e.g. 0.5 for a right number in a wrong format, is not correct); lower it for a graded one."""
    num_samples: int | None = key_when_set(None, ge=1)
    """Completions per eval prompt. Unset (or 1): one greedy completion, whose verdict is the prompt's. k > 1: k
    completions sampled at eval.temperature, and the summary's pass@k for k in 1, 10, 100 and num_samples (those up
    to num_samples; `pass_at_1`, ...) by the unbiased estimator of the HumanEval paper (Chen et al. 2021, eq. 1:
    1 - C(n - c, k) / C(n, k) per prompt, averaged); `accuracy` is then pass@1, the share of correct samples.
    Higher: a finer pass@1 and a pass@k, num_samples times the generation and verifier time."""
    temperature: float | None = key_when_set(None, gt=0)
    """Sampling temperature of eval.num_samples > 1 (one completion is greedy). Unset: 0.8, the temperature the
    HumanEval paper found best for pass@10 and pass@100 (0.2 for pass@1)."""
    every_rounds: int | None = not_in_key(None, ge=1)
    """GRPO: also evaluate the policy after every N optimize rounds (as TRL's `eval_steps`, in rounds),
    logged as eval/* at step = rounds done; unset: only the base (step 0) and the final model. Lower:
    a finer eval/accuracy curve, one more greedy pass over the eval prompts each time. When to
    evaluate, not what: not part of an eval's cache key."""

    @model_validator(mode="after")
    def _sampled_only(self):
        if self.temperature is not None and (self.num_samples or 1) == 1:
            raise ValueError("eval.temperature applies to eval.num_samples > 1 (one completion per prompt is greedy); "
                             "set num_samples, or remove temperature")
        return self

    @property
    def samples(self) -> int:
        """Completions per prompt (eval.num_samples, unset: 1)."""
        return self.num_samples or 1

    @field_validator("reward_funcs")
    @classmethod
    def _no_run_reward_model(cls, value):
        if value and "reward_model" in value:
            raise ValueError("`reward_model` (this run's reward model) does not reach the eval; name its folder "
                             "(reward_model:/path/to/model), or a verifier")
        from stages.scoring.reward_workers import is_model_name

        if models := [name for name in value or [] if is_model_name(name)]:
            raise ValueError(f"{models[0]!r}: a reward model named by hub id or path is scored in the rounds "
                             "(score.reward_funcs), not judged in the eval; name a verifier here, or the model's "
                             "folder as reward_model:/path/to/model")
        return value


VERIFIER_DEFAULT = ["accuracy"]
"""The eval's verifier when the run's reward functions are all built-in: math-verify on the gold answer."""


def verifier_funcs(cfg: EvalConfig, score_funcs: list[str]) -> list[str]:
    """The reward functions the eval judges with: eval.reward_funcs when set; else the entries of the run's
    score.reward_funcs that are a task's own verifier (`module.fn`, `remote:<name>`, and the built-ins of
    TASK_VERIFIERS: `reasoning_gym`, `human_eval`), or `accuracy` when it names none (format is a shaping term; a reward model
    scores preferences, not correctness).

    >>> verifier_funcs(EvalConfig(), ["accuracy", "format"]), verifier_funcs(EvalConfig(), ["mytask.check", "format"])
    (['accuracy'], ['mytask.check'])
    >>> verifier_funcs(EvalConfig(), ["reasoning_gym", "format"])
    ['reasoning_gym']
    >>> verifier_funcs(EvalConfig(reward_funcs=["stated_accuracy"]), ["mytask.check"])
    ['stated_accuracy']
    """
    from stages.scoring.reward_workers import REWARD_MODEL_PREFIX, is_model_name
    from stages.scoring.rewards import BUILTIN_REWARDS, TASK_VERIFIERS

    if cfg.reward_funcs:
        return list(cfg.reward_funcs)
    own = [name for name in score_funcs if (name not in BUILTIN_REWARDS or name in TASK_VERIFIERS)
           and name != "reward_model" and not name.startswith(REWARD_MODEL_PREFIX) and not is_model_name(name)]
    return own or list(VERIFIER_DEFAULT)


def answer_stats(completions: list, gold_answers: list) -> dict:
    """What a constant answer would score on these prompts, and how spread the predicted answers are.

    A completion's answer is `extract_answer` of its text; gold answers are compared as
    str(answer).strip(). `constant_baseline`: share of prompts whose gold answer is the most
    common one (`baseline_answer`), the best accuracy any constant answer gets. `answer_entropy`:
    Shannon entropy in nats of the predicted answers (0: one answer for all; ln k: k answers, equally
    often). `constant_policy`: the top predicted answer covers >= 95% of the prompts. `top_completion`: the most
    common completion text. The eval (`run`) measures its constant baseline again with the task's verifier.

    >>> s = answer_stats(["<answer>9</answer>", "<answer>9</answer>", "<answer>4</answer>"], [9, 9, 3])
    >>> s["constant_baseline"], s["baseline_answer"], s["distinct_answers"], s["top_answer"], s["constant_policy"]
    (0.6666666666666666, '9', 2, '9', False)
    """
    from stages.scoring.rewards import completion_text
    from stages.scoring.rewards.math import extract_answer

    n = len(completions)
    texts = [completion_text(c) for c in completions]
    predicted = Counter(extract_answer(t) for t in texts)
    gold = Counter(str(a).strip() for a in gold_answers)
    if n == 0:
        return {"constant_baseline": 0.0, "baseline_answer": None, "distinct_answers": 0, "answer_entropy": 0.0,
                "top_answer": None, "top_answer_frac": 0.0, "constant_policy": False, "top_completion": None}
    baseline_answer, baseline_count = gold.most_common(1)[0]
    top_answer, top_count = predicted.most_common(1)[0]
    entropy = -sum(c / n * math.log(c / n) for c in predicted.values())
    return {
        "constant_baseline": baseline_count / len(gold_answers),
        "baseline_answer": baseline_answer,
        "distinct_answers": len(predicted),
        "answer_entropy": max(entropy, 0.0),  # -0.0 for a single answer
        "top_answer": top_answer,
        "top_answer_frac": top_count / n,
        "constant_policy": top_count / n >= CONSTANT_POLICY_FRAC,
        "top_completion": Counter(texts).most_common(1)[0][0],
    }


PASS_AT = (1, 10, 100)
"""The k of pass@k the eval reports (those up to eval.num_samples, and num_samples itself), as the HumanEval paper."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code", eq. 1 and its numerically stable product form): 1 - C(n - c, k) / C(n, k),
    the chance that k samples drawn without replacement from the n hold at least one correct one.

    >>> pass_at_k(10, 0, 1), round(pass_at_k(10, 3, 1), 4), pass_at_k(10, 9, 2), round(pass_at_k(10, 3, 5), 4)
    (0.0, 0.3, 1.0, 0.9167)
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_at(correct: list[list[bool]], n: int) -> dict[str, float]:
    """{pass_at_k: the mean over prompts of pass_at_k(n, c, k)} for the k of PASS_AT up to n and n itself, from each
    prompt's n verdicts."""
    ks = sorted({k for k in PASS_AT if k <= n} | {n})
    return {f"pass_at_{k}": sum(pass_at_k(n, sum(map(bool, c)), k) for c in correct) / len(correct) for k in ks}


SCORING_FIELDS = ("remote_verifiers", "reward_on_error", "max_error_rate")
"""The fields of the run's ScoreConfig (`run`'s `scoring`) that change the eval's verdicts, for its key: the remote
verifiers it may call, the value a failed call counts as, the failure share that stops it. The rest say where and
how fast the verifier runs (workers, timeout); the functions' code is keyed by digest with `reward_funcs`."""


def run(cfg: EvalConfig, model_dir: Path, adapter_dir: Path | None, prompts_path: Path, out_dir: Path,
        on_progress: Callable[[int, int], None] | None = None, devices=None, scoring=None,
        log_dir: Path | None = None) -> dict:
    """Greedy-decode every eval prompt (cfg.num_samples > 1: sample that many completions of each) and judge it
    with the verifier (cfg.reward_funcs; unset: `accuracy`); return {"accuracy", "num_prompts", "num_samples",
    "format_rate", "verifier", "verifier_errors"}, pass_at_k (num_samples > 1) and `answer_stats`, its constant
    baseline measured by the verifier. Samples from its own generator seeded 0: it neither seeds nor draws from
    torch's global RNG, which a rollout or optimize round in another thread of the process may be using. `devices`:
    where and in which dtype the policy runs (stages/runtime/devices.py). `scoring`: the run's ScoreConfig
    (stages/scoring/score.py): how the verifier runs (workers, timeout, remote verifiers, max_error_rate,
    reward_on_error); None: its defaults. `log_dir`: where reward_errors.log goes when the verifier fails on too
    many completions (the eval stops); None: out_dir."""
    from stages.rollout.engines import Sampling
    from stages.rollout.engines.hf import generate
    from stages.runtime.policy import load_policy

    names = list(cfg.reward_funcs or VERIFIER_DEFAULT)
    scoring = verifier_scoring(names, scoring)
    rows = pq.read_table(prompts_path).to_pylist()[: cfg.max_prompts]
    check_gold(names, rows, prompts_path)  # before the model loads
    too_long = prompts_too_long(cfg, rows, prompts_path, model_dir)
    if too_long:  # too_long_prompts: drop
        i, pid, n = too_long[0]
        log.warning("eval: left out %d prompt(s) of %s longer than the model's context leaves beside "
                    "eval.max_completion_length %d (eval.too_long_prompts: drop), e.g. row %d (prompt_id %s, "
                    "%d tokens)", len(too_long), prompts_path, cfg.max_completion_length, i, pid, n)
        dropped = {i for i, _, _ in too_long}
        rows = [row for i, row in enumerate(rows) if i not in dropped]
    model, tokenizer = load_policy(model_dir, adapter_dir, devices=devices)
    done = 0

    def progress(n):
        nonlocal done
        done += n
        if on_progress:
            on_progress(done, len(rows) * cfg.samples)

    n = cfg.samples  # each prompt's samples side by side: rows[i // n]
    sampling = (Sampling(max_new_tokens=cfg.max_completion_length, do_sample=False) if n == 1 else
                Sampling(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature or 0.8, seed=0))
    prompts = [r for r in rows for _ in range(n)]
    outputs = generate(model, tokenizer, [r["prompt"] for r in prompts], sampling, cfg.batch_size, progress)
    judged = [{**r, "completion": o["completion"], "completion_token_ids": o["completion_token_ids"]}
              for r, o in zip(prompts, outputs)]
    summary = verdicts(cfg, scoring, judged, n, out_dir, log_dir, devices)
    return {**summary, "num_prompts": len(rows), "prompts_too_long": len(too_long)}


def verifier_scoring(names: list[str], scoring=None):
    """How the verifier `names` runs: the run's ScoreConfig `scoring` (None: its defaults) with those functions,
    unweighted, on local worker processes even under score.backend: ray (the pool is kept for the run, and Ray
    actors kept idle would hold the CPUs the rounds' score actors wait for: a scaled-out run hung so)."""
    from stages.scoring.rewards.remote import check_remote_names
    from stages.scoring.score import ScoreConfig

    scoring = (scoring or ScoreConfig()).model_copy(update={"reward_funcs": names, "reward_weights": None,
                                                            "backend": "local"})
    check_remote_names(names, scoring.remote_verifiers)  # eval.reward_funcs: remote:<name> of score.remote_verifiers
    return scoring


def check_gold(names: list[str], rows: list[dict], prompts_path: Path) -> None:
    """accuracy and stated_accuracy need every prompt's gold answer: ValueError naming the prompts without one."""
    unanswered = [r["prompt_id"] for r in rows if r.get("answer") is None]
    if unanswered and {"accuracy", "stated_accuracy"} & set(names):
        raise ValueError(f"eval: {len(unanswered)} of the {len(rows)} prompts of {prompts_path} have no answer "
                         f"(e.g. {unanswered[:3]}; the transform returned none): the eval stage scores accuracy "
                         "against gold answers; give the eval split answers (transform.answer_field, or `answer` "
                         "from your transform_fn)")


def verdicts(cfg: EvalConfig, scoring, judged: list[dict], n: int, out_dir: Path, log_dir: Path | None,
             devices=None) -> dict:
    """Judge `judged` (prompt rows with their `completion`, each prompt's n samples side by side) with the verifier
    (scoring.reward_funcs), write out_dir/eval.parquet, and return the summary: accuracy (pass@1), pass@k (n > 1),
    format rate, `answer_stats`, the constant baseline by the same verifier, the verifier and its failures."""
    from stages.scoring.rewards import format_reward
    from stages.scoring.rewards.math import extract_answer

    completions = [r["completion"] for r in judged]
    answers = [r.get("answer") for r in judged]
    stats = answer_stats(completions, answers)
    gold_top = stats["baseline_answer"] if any(a is not None for a in answers) else None
    rewards, errors, notes, baseline, baseline_answer = judge(scoring, judged, gold_top, stats["top_completion"],
                                                             cfg.correct_threshold, out_dir, log_dir, devices)
    correct = [1.0 if r is not None and r >= cfg.correct_threshold else 0.0 for r in rewards]
    formatted = format_reward(completions=completions)
    pq.write_table(
        pa.table({"prompt_id": [r["prompt_id"] for r in judged], "sample": [i % n for i in range(len(judged))],
                  "answer": answers, "completion": completions,
                  "predicted_answer": [extract_answer(c) for c in completions],
                  "reward": pa.array(rewards, type=pa.float64()), "correct": correct,
                  "errors": pa.array([e + w for e, w in zip(errors, notes)], type=pa.list_(pa.string()))}),
        out_dir / "eval.parquet",
    )
    sampled = pass_at([correct[i : i + n] for i in range(0, len(correct), n)], n) if n > 1 else {}
    return {"accuracy": sum(correct) / len(correct), **sampled, "num_samples": n,
            "format_rate": sum(formatted) / len(correct), **stats, "constant_baseline": baseline,
            "baseline_answer": baseline_answer, "verifier": list(scoring.reward_funcs),
            "verifier_errors": sum(map(len, errors))}


def rejudge(cfg: EvalConfig, eval_path: Path, prompts_path: Path, out_dir: Path, scoring=None,
            log_dir: Path | None = None, devices=None) -> dict:
    """A finished eval's completions (`eval_path`: its eval.parquet; nothing generated) judged again by the verifier
    cfg.reward_funcs, each joined by prompt_id to its row of `prompts_path` (the columns the verifier reads): the
    eval.parquet and summary `run` writes for them (`posttrain rescore`, flows/rescore.py). eval.parquet keeps no
    token ids, so a reward function that reads `completion_ids` fails here, naming itself."""
    names = list(cfg.reward_funcs or VERIFIER_DEFAULT)
    scoring = verifier_scoring(names, scoring)
    done = pq.read_table(eval_path, columns=["prompt_id", "sample", "completion"]).to_pylist()
    by_id = {r["prompt_id"]: r for r in pq.read_table(prompts_path).to_pylist()}
    if missing := [r["prompt_id"] for r in done if r["prompt_id"] not in by_id]:
        raise ValueError(f"eval: {eval_path} has {len(missing)} prompt(s) not in {prompts_path} (e.g. {missing[:3]})")
    n = max((r["sample"] for r in done), default=0) + 1
    judged = [{**by_id[r["prompt_id"]], "completion": r["completion"]} for r in done]
    check_gold(names, judged, prompts_path)
    return {**verdicts(cfg, scoring, judged, n, out_dir, log_dir, devices), "num_prompts": len(done) // n,
            "rejudged": str(eval_path)}


def judge(scoring, rows: list[dict], gold_top, top_completion: str | None, threshold: float, out_dir: Path,
          log_dir: Path | None, devices=None) -> tuple[list, list[list[str]], list[list[str]], float, str | None]:
    """The verifier (scoring.reward_funcs) on each row's completion and on constant answers over the same rows:
    (each row's reward, each row's failures, each row's Verdict reasons, the constant baseline, its answer).

    A row's reward is the mean of its functions' values, None ("does not apply") left out, a failed call counted as
    scoring.reward_on_error; None where no function applies (not correct). The constant answers tried: the most
    common gold answer, bare and in <answer> tags, and the policy's own most common completion; the baseline is
    the best one's accuracy."""
    from stages.scoring.rewards.common import Verdict
    from stages.scoring.score import call_rewards, worker_sources

    names = scoring.reward_funcs
    columns = [c for c in rows[0] if c not in ("prompt", "completion", "completion_token_ids")] if rows else []
    candidates = list(dict.fromkeys(c for c in ([str(gold_top), f"<answer>{gold_top}</answer>"]
                                                if gold_top is not None else []) + [top_completion] if c is not None))
    constant = [{**r, "completion": c, "completion_token_ids": []} for c in candidates for r in rows]
    ids = [str(r["prompt_id"]) for r in rows] + [f"constant {i}: {r['prompt_id']}" for i in range(len(candidates))
                                                 for r in rows]
    values, failed = call_rewards(scoring, names, rows + constant, ids, columns,
                                  worker_sources(scoring, None, devices), out_dir, log_dir)

    def reward(i: int):
        got = [scoring.reward_on_error if i in failed[name] else values[name][i] for name in names]
        got = [float(v) for v in got if v is not None]
        return sum(got) / len(got) if got else None

    n = len(rows)
    rewards = [reward(i) for i in range(n)]
    errors = [[failed[name][i] for name in names if i in failed[name]] for i in range(n)]
    notes = [[f"{name}: {values[name][i].why}" for name in names if isinstance(values[name][i], Verdict)]
             for i in range(n)]  # a Verdict's reason (a failing test): noted beside the failures, not one
    baseline, baseline_answer = 0.0, None
    for k, candidate in enumerate(candidates):
        hits = [reward(n * (k + 1) + i) for i in range(n)]
        score = sum(r is not None and r >= threshold for r in hits) / n if n else 0.0
        if baseline_answer is None or score > baseline:
            baseline, baseline_answer = score, candidate
    from stages.scoring.rewards.math import extract_answer

    return rewards, errors, notes, baseline, extract_answer(baseline_answer) if baseline_answer is not None else None


def prompts_too_long(cfg: EvalConfig, rows: list[dict], prompts_path: Path, model_dir: Path) -> list[tuple]:
    """(row index, prompt_id, prompt tokens) of the rows whose chat-templated prompt leaves less room than
    eval.max_completion_length in the model's context (stages/rollout/rollout.py too_long_rows); under
    too_long_prompts: fail, PromptTooLongError naming them instead."""
    from stages.rollout.rollout import model_context, prompts_that_do_not_fit

    context = model_context(None, model_dir)  # eval generates with transformers
    if context is None:
        return []
    return prompts_that_do_not_fit("eval", cfg.too_long_prompts, rows, prompts_path, model_dir, context,
                                   cfg.max_completion_length)
