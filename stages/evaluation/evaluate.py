"""eval: greedy accuracy of a policy on the held-out prompts, and what a constant answer scores.

A completion is correct when the `accuracy` reward (math-verify) gives it 1.0. Accuracy alone
can flatter a policy that always gives the same answer: on a task whose most common answer is
"9" for 59% of prompts, always saying "9" scores 0.59. So the summary also has the constant
baseline (the best constant answer's accuracy on the same prompts) and the spread of the
predicted answers (`answer_stats`). Writes every prompt's completion, predicted answer and
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
from pydantic import BaseModel, ConfigDict, Field

from stages.runtime.keys import not_in_key

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
    every_rounds: int | None = not_in_key(None, ge=1)
    """GRPO: also evaluate the policy after every N optimize rounds (as TRL's `eval_steps`, in rounds),
    logged as eval/* at step = rounds done; unset: only the base (step 0) and the final model. Lower:
    a finer eval/accuracy curve, one more greedy pass over the eval prompts each time. When to
    evaluate, not what: not part of an eval's cache key."""


def answer_stats(completions: list, gold_answers: list) -> dict:
    """What a constant answer would score on these prompts, and how spread the predicted answers are.

    A completion's answer is `extract_answer` of its text; gold answers are compared as
    str(answer).strip(). `constant_baseline`: share of prompts whose gold answer is the most
    common one (`baseline_answer`), the best accuracy any constant answer gets. `answer_entropy`:
    Shannon entropy in nats of the predicted answers (0: one answer for all; ln k: k answers, equally
    often). `constant_policy`: the top predicted answer covers >= 95% of the prompts.

    >>> s = answer_stats(["<answer>9</answer>", "<answer>9</answer>", "<answer>4</answer>"], [9, 9, 3])
    >>> s["constant_baseline"], s["baseline_answer"], s["distinct_answers"], s["top_answer"], s["constant_policy"]
    (0.6666666666666666, '9', 2, '9', False)
    """
    from stages.scoring.rewards import completion_text
    from stages.scoring.rewards.math import extract_answer

    n = len(completions)
    predicted = Counter(extract_answer(completion_text(c)) for c in completions)
    gold = Counter(str(a).strip() for a in gold_answers)
    if n == 0:
        return {"constant_baseline": 0.0, "baseline_answer": None, "distinct_answers": 0, "answer_entropy": 0.0,
                "top_answer": None, "top_answer_frac": 0.0, "constant_policy": False}
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
    }


def run(cfg: EvalConfig, model_dir: Path, adapter_dir: Path | None, prompts_path: Path, out_dir: Path,
        on_progress: Callable[[int, int], None] | None = None, devices=None) -> dict:
    """Greedy-decode every eval prompt; return {"accuracy", "num_prompts", "format_rate"} and `answer_stats`.
    Uses no randomness: it neither seeds nor draws from torch's global RNG, which a rollout or optimize
    round in another thread of the process may be using. `devices`: where and in which dtype the policy runs
    (stages/runtime/devices.py)."""
    from stages.rollout.engines import Sampling
    from stages.rollout.engines.hf import generate
    from stages.runtime.policy import load_policy
    from stages.scoring.rewards import accuracy_reward, format_reward
    from stages.scoring.rewards.math import extract_answer

    rows = pq.read_table(prompts_path).to_pylist()[: cfg.max_prompts]
    unanswered = [r["prompt_id"] for r in rows if r.get("answer") is None]
    if unanswered:  # before the model loads: accuracy needs a gold answer per prompt
        raise ValueError(f"eval: {len(unanswered)} of the {len(rows)} prompts of {prompts_path} have no answer "
                         f"(e.g. {unanswered[:3]}; the transform returned none): the eval stage scores accuracy "
                         "against gold answers; give the eval split answers (transform.answer_field, or `answer` "
                         "from your transform_fn)")
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
            on_progress(done, len(rows))

    outputs = generate(model, tokenizer, [r["prompt"] for r in rows],
                       Sampling(max_new_tokens=cfg.max_completion_length, do_sample=False), cfg.batch_size, progress)
    completions = [o["completion"] for o in outputs]
    answers = [r["answer"] for r in rows]
    correct = accuracy_reward(completions=completions, answer=answers)
    formatted = format_reward(completions=completions)
    pq.write_table(
        pa.table({"prompt_id": [r["prompt_id"] for r in rows], "answer": answers, "completion": completions,
                  "predicted_answer": [extract_answer(c) for c in completions], "correct": correct}),
        out_dir / "eval.parquet",
    )
    return {"accuracy": sum(correct) / len(rows), "format_rate": sum(formatted) / len(rows), "num_prompts": len(rows),
            "prompts_too_long": len(too_long), **answer_stats(completions, answers)}


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
