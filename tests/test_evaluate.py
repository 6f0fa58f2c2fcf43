"""Honest eval metrics: what a constant answer scores on the same prompts, how spread the predicted
answers are, the run summary's warnings, and eval.every_rounds' intermediate evals in the flow."""

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from stages.evaluation.evaluate import answer_stats
from stages.scoring.rewards import accuracy_reward
from tasks.reporting import accuracy_notes
from tasks.store import MANIFEST


@pytest.fixture(autouse=True)
def close_pools():
    """The eval judges on reward workers (a pool kept per process): none outlives its test."""
    yield
    from stages.scoring import reward_pools

    reward_pools.close_pools()


def tagged(answers):
    return [f"<answer>{a}</answer>" for a in answers]


def test_a_constant_policy_has_one_answer_and_zero_entropy():
    stats = answer_stats(tagged(["9"] * 20), ["9"] * 12 + ["4"] * 5 + [3] * 3)
    assert stats["distinct_answers"] == 1 and stats["answer_entropy"] == 0.0
    assert stats["top_answer"] == "9" and stats["top_answer_frac"] == 1.0 and stats["constant_policy"] is True
    assert stats["constant_baseline"] == pytest.approx(12 / 20) and stats["baseline_answer"] == "9"


def test_two_answers_half_and_half_have_entropy_ln2():
    stats = answer_stats(tagged(["1", "2"] * 5), ["1"] * 10)
    assert stats["distinct_answers"] == 2 and stats["answer_entropy"] == pytest.approx(math.log(2))
    assert stats["top_answer_frac"] == 0.5 and stats["constant_policy"] is False
    assert stats["constant_baseline"] == 1.0


def test_free_text_answers_are_read_whether_or_not_a_period_ends_them():
    """A real model's greedy answers are sentences. Before: a sentence that did not end in a period was parsed as
    one LaTeX expression (a product of its letters) and scored 0 even when it stated the gold answer, which put a
    SmolLM2 run that had learned the task at 0.21 instead of 0.77. Reasoning cut off mid-way is read by its last
    number (the lenient metric); `stated_accuracy` refuses it."""
    from stages.scoring.rewards import stated_accuracy_reward

    completions = ["The largest of the three is 5", "The largest of the six numbers is 5.", "The answer is 5",
                   "To find the largest of 6, 1, 8, 5", "To find the largest of 6, 1, 5, 8"]
    gold = ["5"] * 5
    assert accuracy_reward(completions=completions, answer=gold) == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert stated_accuracy_reward(completions=completions, answer=gold) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_all_right_is_accuracy_one_and_the_baseline_comes_from_gold_frequencies():
    gold = [7, 7, 7, " 3", "3", 5, 8, 7]  # answers compared as str(answer).strip(): "3" twice
    completions = tagged([str(a).strip() for a in gold])
    assert accuracy_reward(completions=completions, answer=[str(a).strip() for a in gold]) == [1.0] * len(gold)
    stats = answer_stats(completions, gold)
    assert stats["constant_baseline"] == 4 / 8 and stats["baseline_answer"] == "7"
    assert stats["distinct_answers"] == 4 and stats["top_answer"] == "7" and stats["top_answer_frac"] == 0.5
    assert stats["answer_entropy"] == pytest.approx(-(0.5 * math.log(0.5) + 0.25 * math.log(0.25)
                                                      + 2 * 0.125 * math.log(0.125)))


def test_untagged_and_chat_completions_count_their_whole_stripped_text():
    stats = answer_stats([" 4 ", [{"role": "assistant", "content": "<answer>4</answer>"}], "five"], ["4", "4", "5"])
    assert stats["distinct_answers"] == 2 and stats["top_answer"] == "4"
    assert stats["top_answer_frac"] == pytest.approx(2 / 3) and stats["constant_baseline"] == pytest.approx(2 / 3)


def test_95_percent_one_answer_is_a_constant_policy():
    assert answer_stats(tagged(["9"] * 19 + ["1"]), ["1"] * 20)["constant_policy"] is True
    assert answer_stats(tagged(["9"] * 18 + ["1"] * 2), ["1"] * 20)["constant_policy"] is False
    assert answer_stats([], [])["distinct_answers"] == 0


def results(final, baseline, constant=False, top="9", frac=0.97):
    return {"final_accuracy": final, "constant_baseline": baseline, "baseline_answer": "9",
            "final_distinct_answers": 1 if constant else 5, "final_answer_entropy": 0.0 if constant else 1.2,
            "final_constant_policy": constant, "final_top_answer": top, "final_top_answer_frac": frac}


def test_summary_says_plainly_when_the_final_policy_is_a_constant_answer():
    lines = accuracy_notes(results(0.594, 0.594, constant=True))
    assert "constant baseline: 0.594" in lines[0] and "gain over it: +0.000" in lines[0]
    assert lines[1].startswith("WARNING: the final policy gives the answer '9' to 97% of held-out prompts")
    assert "not learning" in lines[1]


def test_summary_warns_below_baseline_plus_margin_and_not_above_it():
    assert accuracy_notes(results(0.62, 0.594))[1].startswith("WARNING: final accuracy 0.620 is below")
    assert len(accuracy_notes(results(0.70, 0.594))) == 1
    assert accuracy_notes({"final_accuracy": 0.5}) == []  # a summary from before the baseline existed


@pytest.mark.slow
def test_every_rounds_logs_intermediate_evals_and_a_rerun_computes_nothing(prefect_harness, tiny_config, tmp_path):
    from mlflow import MlflowClient

    from flows.pipeline import posttrain_pipeline

    overrides = ["grpo.rounds=2", "eval.every_rounds=1"]
    first = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    stages = [row["stage"] for row in first["stages"]]
    assert stages.index("optimize r0") < stages.index("eval r0") < stages.index("optimize r1")
    assert "eval r1" not in stages  # the last round is the final eval's
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'artifacts' / 'mlflow.db'}")
    for name in ("eval/accuracy", "eval/constant_baseline", "eval/distinct_answers", "eval/answer_entropy",
                 "eval/format_rate"):
        assert sorted(m.step for m in client.get_metric_history(first["mlflow_run_id"], name)) == [0, 1, 2], name
    summary = json.loads((tmp_path / "artifacts" / "runs" / first["run_name"] / "summary.json").read_text())
    assert summary["gain_over_baseline"] == pytest.approx(summary["final_accuracy"] - summary["constant_baseline"])
    assert 0 < summary["constant_baseline"] <= 1 and summary["final_distinct_answers"] >= 1
    metrics = client.get_run(first["mlflow_run_id"]).data.metrics
    assert metrics["eval/gain_over_baseline"] == pytest.approx(summary["gain_over_baseline"])
    round_eval = Path(first["stages"][stages.index("eval r0")]["path"])
    table = pq.read_table(round_eval / "eval.parquet")
    assert {"answer", "predicted_answer", "completion", "correct"} <= set(table.column_names)
    assert json.loads((round_eval / MANIFEST).read_text())["inputs"]["adapter"].startswith("optimize/")

    second = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    assert [row["stage"] for row in second["stages"] if row["status"] == "computed"] == []
    # when to evaluate is not part of an eval's key: without every_rounds, base and final evals are cached
    third = posttrain_pipeline(str(tiny_config), ["grpo.rounds=2"], quiet=True)
    assert [row["stage"] for row in third["stages"] if row["status"] == "computed"] == []


def _split_with_a_long_prompt(root: Path) -> Path:
    """tiny_model (context 256) under root/model and a prompts split of 3 short rows and, row 3, one of a few
    hundred tokens; returns the split's path."""
    from conftest import tiny_model

    from stages.data import transform

    tiny_model(root, ["<|im_start|>user\nsay 1<|im_end|>\n<|im_start|>assistant\n7<|im_end|>"] * 20)
    raw = [{"question": f"say {i}", "answer": str(i)} for i in range(3)] + [
        {"question": "say " + "1 2 3 " * 200, "answer": "0"}]
    (root / "raw.jsonl").write_text("\n".join(json.dumps(r) for r in raw))
    transform.run(transform.TransformConfig(), {"eval": root / "raw.jsonl"}, root)
    return root / "eval.parquet"


def test_an_eval_prompt_longer_than_the_models_context_stops_the_eval_naming_its_row(tmp_path):
    """An eval prompt that leaves less room than eval.max_completion_length in the model's context stops the eval
    before the model loads, naming the prompts file's row and its length."""
    from stages.data.sources import BadRowError
    from stages.evaluation import evaluate

    prompts = _split_with_a_long_prompt(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BadRowError, match=rf"eval: {prompts}: row 3 \(prompt_id eval-000003\) has \d{{3,}} prompt "
                                          r"tokens.*context of 256 tokens.*eval.max_completion_length 4.*"
                                          r"on_bad_rows: drop"):
        evaluate.run(evaluate.EvalConfig(max_completion_length=4), tmp_path / "model", None, prompts, out)
    assert not list(out.iterdir())


def test_under_drop_an_eval_prompt_longer_than_the_models_context_is_left_out_and_counted(tmp_path):
    """eval.too_long_prompts: drop (which transform.on_bad_rows: drop sets) evaluates the other prompts and
    counts the one left out in the summary."""
    from stages.evaluation import evaluate

    prompts = _split_with_a_long_prompt(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    cfg = evaluate.EvalConfig(max_completion_length=4, too_long_prompts="drop")
    summary = evaluate.run(cfg, tmp_path / "model", None, prompts, out)
    assert summary["num_prompts"] == 3 and summary["prompts_too_long"] == 1
    assert summary["verifier"] == ["accuracy"]  # eval.reward_funcs unset (the stage called alone): math-verify
    assert pq.read_table(out / "eval.parquet").column("prompt_id").to_pylist() == [
        "eval-000000", "eval-000001", "eval-000002"]


def test_accuracy_does_not_credit_a_restated_question():
    """Issue 44: math-verify read the restated `43 + 14` of "... is 43 + 14 = 18." as the answer (57, right). The
    stated answer (18) is checked now, and an expression that only restates the prompt's is no answer; the
    quickstart's <answer>N</answer> and free-text answers read as before."""
    from stages.scoring.rewards import stated_accuracy_reward

    question = [{"role": "user", "content": "What is 43 + 14?"}]
    completions = ["The final answer to the given arithmetic problem is 43 + 14 = 18.", "The answer is 43 + 14.",
                   "<answer>57</answer>", "43 + 14 = 57", "The sum is 57."]
    assert accuracy_reward(prompts=[question] * 5, completions=completions, answer=["57"] * 5) == [0, 0, 1, 1, 1]
    assert accuracy_reward(completions=completions[:1], answer=["57"]) == [0.0]  # without the prompt too
    assert stated_accuracy_reward(prompts=[question] * 5, completions=completions, answer=["57"] * 5) == [0, 0, 1, 1, 1]
    assert accuracy_reward(prompts=["Which is the largest of -5, -3, -7?", "Which is larger, 3/4 or 1/2?"],
                           completions=["<answer>-3</answer>", "It is 3/4"], answer=["-3", "3/4"]) == [1.0, 1.0]


def test_the_eval_verifier_defaults_to_the_runs_own_reward_functions():
    from stages.evaluation.evaluate import EvalConfig, verifier_funcs

    assert verifier_funcs(EvalConfig(), ["accuracy", "format"]) == ["accuracy"]  # the built-in task: as before
    assert verifier_funcs(EvalConfig(), ["stated_accuracy"]) == ["accuracy"]
    assert verifier_funcs(EvalConfig(), ["mytask.check", "format", "remote:gym"]) == ["mytask.check", "remote:gym"]
    assert verifier_funcs(EvalConfig(), ["reward_model", "format"]) == ["accuracy"]
    assert verifier_funcs(EvalConfig(reward_funcs=["mytask.strict"]), ["mytask.check"]) == ["mytask.strict"]
    with pytest.raises(ValueError, match="reward_model:/path/to/model"):
        EvalConfig(reward_funcs=["reward_model"])


VERIFIERS = '''
def says_seven_times(prompts, completions, answer, **kwargs):
    """The task's own scorer for "say i": right when the completion is the number 7 * i."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 if t.strip() == str(7 * int(a)) else 0.0 for t, a in zip(texts, answer)]


def everything(completions, **kwargs):
    return [1.0] * len(completions)


def half(completions, **kwargs):
    return [0.5] * len(completions)


def boom(completions, **kwargs):
    raise ValueError("boom")
'''


@pytest.fixture
def verifiers(tmp_path, monkeypatch):
    """A module of verifiers, importable here and in the spawned reward workers."""
    import os

    folder = tmp_path / "verifiers"
    folder.mkdir()
    (folder / "eval_verifiers.py").write_text(VERIFIERS)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", str(folder) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return "eval_verifiers"


def test_the_eval_judges_with_the_tasks_verifier_and_so_does_its_constant_baseline(tmp_path, verifiers):
    """Issue 44: the eval always scored with math-verify `accuracy`, whatever the task's verifier said. Now
    eval.reward_funcs judge each completion (correct at reward >= eval.correct_threshold), on the reward workers,
    and the constant baseline is what a constant answer scores by the same verifier."""
    from conftest import tiny_say_policy

    from stages.evaluation import evaluate
    from stages.evaluation.evaluate import EvalConfig
    from stages.scoring.reward_workers import RewardFunctionError
    from stages.scoring.score import ScoreConfig

    root = tiny_say_policy(tmp_path / "tiny", 6)
    prompts, scoring = root / "prompts" / "train.parquet", ScoreConfig(reward_num_workers=1)

    def run(*names: str, **options) -> dict:
        out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
        out.mkdir()
        cfg = EvalConfig(max_completion_length=4, reward_funcs=[f"{verifiers}.{n}" for n in names], **options)
        summary = evaluate.run(cfg, root / "model", None, prompts, out, scoring=scoring, log_dir=tmp_path / "work")
        summary["table"] = pq.read_table(out / "eval.parquet").to_pylist()
        return summary

    own = run("says_seven_times")  # the task's own scorer
    assert own["verifier"] == [f"{verifiers}.says_seven_times"]
    assert own["accuracy"] == sum(r["reward"] for r in own["table"]) / 6
    assert own["constant_baseline"] <= 1 / 6  # the gold answers differ: a constant is right once at most
    both = run("everything", "half", correct_threshold=0.75)  # a completion's reward: the functions' mean
    assert [r["reward"] for r in both["table"]] == [0.75] * 6 and both["accuracy"] == 1.0
    assert both["constant_baseline"] == 1.0  # the same verifier credits a constant answer as much
    with pytest.raises(RewardFunctionError, match=rf"'{verifiers}.boom' failed on (\d+) of \1 samples \(100%"):
        run("boom")  # its 6 completions and a few constant answers per prompt
    assert "ValueError: boom" in (tmp_path / "work" / "reward_errors.log").read_text()
