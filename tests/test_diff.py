"""`posttrain diff`: two runs prompt by prompt. Real tiny runs (tests/conftest.py's tiny config) that differ in one
reward function, a DPO run and a run with a train split only, in one store made once for this module; and the flip
logic on hand-built eval tables."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import tiny_text, warm_tiny_folder

from flows.cli import main
from flows.compare import CompareError, RunData
from flows.diff import EvalTable, Side, answer_distribution, asked_digest, diff_data, diff_report, one_line

VERDICTS = '''"""Verifiers that judge a prompt `<split>-<n>` by n, whatever the completion."""


def even(completions, prompt_id, **kwargs):
    return [float(int(p.rsplit("-", 1)[1]) % 2 == 0) for p in prompt_id]


def low(completions, prompt_id, **kwargs):
    return [float(int(p.rsplit("-", 1)[1]) < 12) for p in prompt_id]
'''
EVEN_NOT_LOW = {f"eval-{n:06d}" for n in range(12, 24, 2)}  # right under `even`, wrong under `low`
LOW_NOT_EVEN = {f"eval-{n:06d}" for n in range(1, 12, 2)}


@pytest.fixture(scope="module")
def runs(prefect_harness, tiny_warm_store, empty_mlflow_store, tmp_path_factory):
    """One store with four finished runs of the tiny config: even and low (GRPO, score.reward_funcs
    [diff_verdicts.even] vs [diff_verdicts.low], so the eval's verifier is each run's function), dpo (rl: dpo)
    and train_only (transform.paths names a train split only: no eval). Returns (artifacts, {name: results})."""
    from flows.pipeline import posttrain_pipeline

    root = tmp_path_factory.mktemp("diff")
    artifacts = warm_tiny_folder(root, tiny_warm_store, empty_mlflow_store)
    (root / "diff_verdicts.py").write_text(VERDICTS)
    config = yaml.safe_load(tiny_text(artifacts))
    dpo = {k: v for k, v in config.items() if k not in ("rollout", "score", "grpo")}  # a DPO run reads none
    (root / "dpo.yaml").write_text(yaml.safe_dump({**dpo, "rl": "dpo"}))
    (root / "train_only.yaml").write_text(yaml.safe_dump({k: v for k, v in config.items() if k != "eval"}))
    (root / "rows.jsonl").write_text("\n".join(json.dumps({"question": f"say {i}", "answer": str(i)})
                                               for i in range(8)))
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        for name in ("even", "low"):
            results[name] = posttrain_pipeline(str(root / "tiny.yaml"), [f"score.reward_funcs=[diff_verdicts.{name}]"],
                                               quiet=True)
        results["dpo"] = posttrain_pipeline(str(root / "dpo.yaml"), [
            "demo_pairs.num_train=32", "demo_pairs.num_eval=16", "dpo.max_steps=2", "dpo.micro_batch_size=8"],
            quiet=True)
        results["train_only"] = posttrain_pipeline(str(root / "train_only.yaml"), [
            f"transform.paths={{train: {root / 'rows.jsonl'}}}", "grpo.rounds=1"], quiet=True)
    return artifacts, results


def diff_json(capsys, *argv) -> dict:
    assert main(["diff", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_flips_between_two_reward_functions(runs, capsys):
    artifacts, results = runs
    even, low = results["even"], results["low"]
    data = diff_json(capsys, even["run_name"], low["mlflow_run_id"], "--artifacts", str(artifacts))  # name, id
    assert [r["name"] for r in data["runs"]] == [even["run_name"], low["run_name"]]
    assert data["prompts"] == 24 and data["config_differs"] == {
        "score.reward_funcs": ['["diff_verdicts.even"]', '["diff_verdicts.low"]']}
    assert {f["prompt_id"] for f in data["right_to_wrong"]} == EVEN_NOT_LOW
    assert {f["prompt_id"] for f in data["wrong_to_right"]} == LOW_NOT_EVEN
    assert (data["both_right"], data["both_wrong"]) == (6, 6)
    assert [r["accuracy"] for r in data["runs"]] == [even["final_accuracy"], low["final_accuracy"]] == [0.5, 0.5]
    assert [r["reward_means"] for r in data["runs"]] == [{"diff_verdicts.even": 0.5}, {"diff_verdicts.low": 0.5}]
    finals = [{r["prompt_id"]: r for r in pq.read_table(f"{run['eval']}/eval.parquet").to_pylist()}
              for run in data["runs"]]
    for flip in data["right_to_wrong"] + data["wrong_to_right"]:  # the completions in full, each run's own
        assert flip["completions"] == [final[flip["prompt_id"]]["completion"] for final in finals]
        assert flip["base_correct"] == ([True, False] if flip["prompt_id"] in EVEN_NOT_LOW else [False, True])
    for run in data["runs"]:
        assert sum(n for _, n in run["answers"]["top"]) == 24
    summaries = {}
    for name in ("even", "low"):  # each round's statistics against the score stage's own summary
        for stage in results[name]["stages"]:
            if stage["kind"] == "score":
                summaries[name, int(stage["stage"].split(" r")[1])] = json.loads(
                    (Path(stage["path"]) / "_manifest.json").read_text())["summary"]
    assert [r["round"] for r in data["rounds"]] == [0, 1]
    for entry in data["rounds"]:
        for name, stats in zip(("even", "low"), entry["runs"]):
            summary = summaries[name, entry["round"]]
            assert stats["reward_mean"] == pytest.approx(summary["reward_mean"])
            assert stats["reward_std"] == pytest.approx(summary["reward_std_batch"])
            assert stats["rewards"] == {f"diff_verdicts.{name}": pytest.approx(summary[f"rewards/{name}/mean"])}
            assert stats["samples"] == 32 and 0 < stats["length_mean"] <= 8


def test_terminal_report_and_limit(runs, capsys):
    artifacts, results = runs
    assert main(["diff", results["low"]["run_name"], results["even"]["run_name"], "--artifacts", str(artifacts),
                 "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "config: 1 key differs" in out and "score.reward_funcs" in out
    assert "note: the runs' verifiers differ" in out
    assert "verdicts: both right 6, both wrong 6, right -> wrong 6, wrong -> right 6" in out
    right_to_wrong = out.split("right -> wrong: 6 prompts (A right, B wrong)")[1].split("wrong -> right:")[0]
    shown = [line.split()[0] for line in right_to_wrong.splitlines() if line.strip().startswith("eval-")]
    assert shown == sorted(LOW_NOT_EVEN)[:2] and "(4 more: --limit N" in right_to_wrong
    assert "right/wrong" in right_to_wrong  # the base evals judged them so too
    rounds = out.split("rounds (scored rollouts")[1]
    assert [line.split()[0] for line in rounds.splitlines()[3:5]] == ["0", "1"]
    assert "A diff_verdicts.low  B diff_verdicts.even" in rounds


def test_grpo_against_dpo_has_one_runs_rounds(runs, capsys):
    artifacts, results = runs
    grpo, dpo = results["even"]["run_name"], results["dpo"]["run_name"]
    data = diff_json(capsys, grpo, dpo, "--artifacts", str(artifacts))
    assert [r["method"] for r in data["runs"]] == ["grpo", "dpo"] and data["config_differs"]["rl"] == ["grpo", "dpo"]
    assert data["runs"][1]["verifier"] == ["accuracy"] and data["runs"][1]["accuracy"] == results["dpo"][
        "final_accuracy"]
    assert data["flips"]["right_to_wrong"] + data["both_right"] == 12  # even's right answers
    assert [r["runs"][1] for r in data["rounds"]] == [None, None] and all(r["runs"][0] for r in data["rounds"])
    assert main(["diff", grpo, dpo, "--artifacts", str(artifacts)]) == 0
    out = capsys.readouterr().out
    assert "(B: no rounds)" in out and "B reward" not in out and "A reward mean ± std" in out
    assert "config: 1 key differs;" in out and "set in B only (" in out and "dpo" in out


def test_bad_input_exits_2_naming_it(runs, capsys, tmp_path):
    artifacts, results = runs
    even, train_only = results["even"]["run_name"], results["train_only"]["run_name"]
    assert main(["diff", even, train_only, "--artifacts", str(artifacts)]) == 2
    err = capsys.readouterr().err
    assert f"run {train_only} has no final eval artifact" in err and "train split only" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["diff", even, "no-such-run", "--artifacts", str(artifacts)]) == 2
    assert "unknown run 'no-such-run'" in capsys.readouterr().err
    assert main(["diff", even, train_only, "--artifacts", str(tmp_path / "nothing")]) == 2
    assert "no MLflow store" in capsys.readouterr().err


# ---------------------------------------------------------------- the logic on hand-built eval tables

def side(name: str, correct: dict[int, bool], answers: dict[int, str] | None = None, base=None,
         gold: str = "7") -> Side:
    """A run whose final eval judged prompt eval-<n> correct[n]; its completion says answers[n] (default: n)."""
    answers = answers or {}
    rows = {f"eval-{n}": {"prompt_id": f"eval-{n}", "answer": gold, "completion": f"<answer>{answers.get(n, n)}"
                          "</answer>", "predicted_answer": answers.get(n, str(n)), "reward": float(ok),
                          "correct": float(ok)} for n, ok in correct.items()}
    table = EvalTable("eval final", rows, ["accuracy"], {p: asked_digest(None, gold) for p in rows}, f"/{name}")
    base_table = None
    if base is not None:
        base_table = EvalTable("eval base", {f"eval-{n}": {"correct": float(ok)} for n, ok in base.items()})
    return Side(RunData(f"id-{name}", name, "exp", "FINISHED", None, None), table, base_table)


def test_flips_both_ways_with_base_verdicts():
    a = side("a", {0: True, 1: True, 2: False, 3: False, 4: True}, base={0: False, 1: True, 2: False, 3: True, 4: True})
    b = side("b", {0: False, 1: True, 2: True, 3: False, 4: False}, answers={0: "x" * 100})
    data = diff_data(a, b)
    assert [f["prompt_id"] for f in data["right_to_wrong"]] == ["eval-0", "eval-4"]
    assert [f["prompt_id"] for f in data["wrong_to_right"]] == ["eval-2"]
    assert (data["both_right"], data["both_wrong"]) == (1, 1)
    flip = data["right_to_wrong"][0]
    assert flip["completions"] == ["<answer>0</answer>", f"<answer>{'x' * 100}</answer>"]  # whole in the data
    assert flip["answers"] == ["0", "x" * 100] and flip["base_correct"] == [False, None] and flip["gold"] == "7"
    assert [r["accuracy"] for r in data["runs"]] == [0.6, 0.4] and data["runs"][0]["base_accuracy"] == 0.6
    assert data["rounds"] == [] and data["flips"] == {"right_to_wrong": 2, "wrong_to_right": 1}
    assert len(diff_data(a, b, limit=1)["right_to_wrong"]) == 1
    text = diff_report(data)
    assert "eval-0  7     wrong/-" in text and "<answer>" + "x" * 31 + "…\n" in text  # 40 characters
    assert "rounds: neither run has rounds" in text and "verifiers differ" not in text
    assert diff_report(data, shown=1).count("\n  eval-") == 2  # one per direction


def test_different_eval_sets_are_an_error():
    a = side("a", {0: True, 1: False, 2: True})
    with pytest.raises(CompareError, match="a has 3, b has 2, 2 are the same in both"):
        diff_data(a, side("b", {0: True, 1: False}))
    with pytest.raises(CompareError, match="a has 3, b has 3, 0 are the same in both"):  # same ids, other answers
        diff_data(a, side("b", {0: True, 1: False, 2: True}, gold="8"))
    assert diff_data(a, side("b", {0: True, 1: False, 2: True}))["prompts"] == 3


def test_answer_distribution_counts_extracted_answers():
    rows = [{"predicted_answer": a} for a in ["7", "7", "3", "7", "3", "9"]]
    assert answer_distribution(rows) == {"distinct": 3, "top": [["7", 3], ["3", 2], ["9", 1]]}
    assert answer_distribution(rows, keep=1)["top"] == [["7", 3]]
    assert answer_distribution([{"completion": "I say <answer> 5 </answer>"}]) == {"distinct": 1, "top": [["5", 1]]}
    assert one_line("a\nb" * 30, 10) == "a\\nba\\nba…" and one_line(None) == "-"
