"""`posttrain rescore` (flows/rescore.py) on tiny runs: a reward edit re-scored equals what a training run with the
edited reward scores in its round 0 (same rollouts, same key, same rewards computed apart) and judges in its base
eval (same completions, same verdicts), a second rescore computes nothing, and bad input is one line naming it,
exit 2, with nothing cached."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import copy_warm_stages, tiny_text

REWARDS = '''
def digits(prompts, completions, **kwargs):
    """Share of digit characters in each completion: a signal even a tiny untrained policy gets."""
    texts = [c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]


def length(prompts, completions, **kwargs):
    """Longer is better, up to 32 characters: a value for any completion, the greedy eval's included."""
    return [min(1.0, len(c[0]["content"]) / 32) for c in completions]


def broken(prompts, completions, **kwargs):
    raise ValueError("this grader is broken")


def per_token(prompts, completions, completion_ids, **kwargs):
    """Reads the completions' token ids: rollouts have them, an eval.parquet does not."""
    return [min(1.0, len(ids) / 4) for ids in completion_ids]
'''


@pytest.fixture(scope="module")
def folder(prefect_harness, tmp_path_factory, empty_mlflow_store, tiny_warm_store):
    """A folder with a reward module, a module that fails to import, and two tiny configs (tiny_a.yaml, tiny_b.yaml)
    on stores of their own holding the warm stages."""
    root = tmp_path_factory.mktemp("rescore")
    (root / "rescore_rewards.py").write_text(REWARDS)
    (root / "rescore_broken.py").write_text("raise RuntimeError('cannot load the grader')\n")
    for name in ("a", "b"):
        artifacts = root / f"artifacts_{name}"
        artifacts.mkdir()
        shutil.copyfile(empty_mlflow_store, artifacts / "mlflow.db")
        copy_warm_stages(tiny_warm_store, artifacts)
        (root / f"tiny_{name}.yaml").write_text(tiny_text(artifacts))
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield root


@pytest.fixture(scope="module")
def run_a(folder):
    """A 2-round tiny GRPO run with the default rewards (accuracy, format)."""
    from flows.pipeline import posttrain_pipeline

    return posttrain_pipeline(str(folder / "tiny_a.yaml"), quiet=True)


def table(folder: str | Path, name: str) -> list[dict]:
    return pq.read_table(Path(folder) / name).to_pylist()


def score_folders(artifacts: Path) -> set[str]:
    return {p.name for p in (artifacts / "score").iterdir()}


def test_rescore_equals_round_0_of_a_run_with_the_edited_reward(folder, run_a):
    from flows.pipeline import posttrain_pipeline
    from flows.rescore import rescore

    edited = ["rescore_rewards.digits", "rescore_rewards.length"]
    report = rescore(run_a["run_name"], edited, artifacts_dir=folder / "artifacts_a")
    assert [(r["round"], r["status"]) for r in report["rounds"]] == [(0, "computed"), (1, "computed")]
    assert report["reward_funcs"] == {"old": ["accuracy", "format"], "new": edited}
    rescored = report["rounds"][0]
    assert rescored["reward_mean"]["new"] != rescored["reward_mean"]["old"]
    assert rescored["groups"]["with_signal"]["new"] - rescored["groups"]["with_signal"]["old"] == (
        rescored["groups"]["gained"] - rescored["groups"]["lost"])

    # the same config trained with the edited reward, in another store: it samples and scores round 0 itself
    trained = posttrain_pipeline(str(folder / "tiny_b.yaml"), [f"score.reward_funcs=[{','.join(edited)}]",
                                                               "grpo.rounds=1"], quiet=True)
    stages = {row["stage"]: row for row in trained["stages"]}
    assert stages["rollout r0"]["status"] == stages["score r0"]["status"] == "computed"
    assert Path(stages["rollout r0"]["path"]).name == Path(rescored["rollouts"]).name  # round 0: same rollouts
    assert table(stages["rollout r0"]["path"], "rollouts.parquet") == table(rescored["rollouts"], "rollouts.parquet")
    assert Path(stages["score r0"]["path"]).name == Path(rescored["new_score"]).name  # the key a run would use
    columns = ("rollout_id", "rewards", "reward", "advantage", "errors")
    ours = [{c: row[c] for c in columns} for row in table(rescored["new_score"], "scored.parquet")]
    assert ours == [{c: row[c] for c in columns} for row in table(stages["score r0"]["path"], "scored.parquet")]
    assert ours != [{c: row[c] for c in columns} for row in table(rescored["old_score"], "scored.parquet")]

    # the held-out evals judged again, nothing generated: the base eval's verdicts are the trained run's own base
    # eval (same policy, same greedy completions, judged by the edited reward as that run's verifier)
    assert [(e["eval"], e["rescored"], e["status"]) for e in report["evals"]] == [
        ("eval base", True, "computed"), ("eval final", True, "computed")]
    base = report["evals"][0]
    assert base["verifier"] == {"old": ["accuracy"], "new": edited}
    columns = ("prompt_id", "completion", "reward", "correct", "errors")
    assert [{c: row[c] for c in columns} for row in table(base["new_eval"], "eval.parquet")] == [
        {c: row[c] for c in columns} for row in table(stages["eval base"]["path"], "eval.parquet")]
    assert table(base["old_eval"], "eval.parquet") != table(base["new_eval"], "eval.parquet")
    for e in report["evals"]:  # the flips are the difference in accuracy (one completion a prompt)
        assert e["accuracy"]["new"] - e["accuracy"]["old"] == pytest.approx((e["gained"] - e["lost"]) / e["prompts"])
        assert e["reward_mean"]["new"] != e["reward_mean"]["old"]


def test_a_second_rescore_computes_nothing(folder, run_a, capsys):
    from flows.cli import main

    artifacts = folder / "artifacts_a"
    args = ["rescore", run_a["run_name"], "--reward-funcs", "rescore_rewards.digits", "format",
            "--reward-weights", "1", "0.5", "--artifacts", str(artifacts)]
    assert main([*args, "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    folders = score_folders(artifacts)
    assert main([*args, "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in second["rounds"]] == ["cached", "cached"]
    assert [(e["eval"], e["status"]) for e in second["evals"]] == [("eval base", "cached"), ("eval final", "cached")]
    assert [e["new_eval"] for e in second["evals"]] == [e["new_eval"] for e in first["evals"]]
    assert second["mlflow_run_id"] is None  # nothing computed: no MLflow run either
    assert score_folders(artifacts) == folders
    same = ("round", "new_score", "reward_mean", "groups", "moved")
    assert [{k: r[k] for k in same} for r in second["rounds"]] == [{k: r[k] for k in same} for r in first["rounds"]]

    assert main(args) == 0  # the text a person reads
    out = capsys.readouterr().out
    assert "groups with signal old -> new" in out and "samples whose reward moved most" in out
    assert "held-out evals judged again" in out and "accuracy -> rescore_rewards.digits" in out
    assert "0 score and eval artifacts computed, 4 cached" in out


def test_an_eval_the_new_reward_cannot_judge_says_why(folder, run_a):
    """A reward that reads completion_ids scores the rounds (rollouts keep token ids) and cannot judge the evals
    (eval.parquet keeps none): the rounds are re-scored, each eval says why it is not, naming the function."""
    from flows.rescore import rescore

    report = rescore(run_a["run_name"], ["rescore_rewards.per_token"], artifacts_dir=folder / "artifacts_a")
    assert [r["status"] for r in report["rounds"]] == ["computed", "computed"]
    assert [e["rescored"] for e in report["evals"]] == [False, False]
    assert all("rescore_rewards.per_token" in e["why"] for e in report["evals"]), report["evals"]


@pytest.fixture(scope="module")
def dpo_run(folder, run_a):
    """A DPO run in run_a's store (no rollouts)."""
    from flows.pipeline import posttrain_pipeline

    config = yaml.safe_load((folder / "tiny_a.yaml").read_text())
    for section in ("rollout", "score", "grpo"):  # a DPO-family run reads none of them
        config.pop(section)
    (folder / "tiny_dpo.yaml").write_text(yaml.safe_dump(config))
    return posttrain_pipeline(str(folder / "tiny_dpo.yaml"), ["rl=dpo", "demo_pairs.num_train=16",
                                                             "demo_pairs.num_eval=8", "dpo.max_steps=1"], quiet=True)


@pytest.mark.parametrize("case, funcs, named", [
    ("unknown run", ["accuracy"], "unknown run 'no-such-run'"),
    ("no rollouts", ["accuracy"], "has no rollouts to re-score"),
    ("no such module", ["rescore_nowhere.fn"], "cannot import module 'rescore_nowhere'"),
    ("module fails to import", ["rescore_broken.fn"], "importing 'rescore_broken' failed: RuntimeError: cannot load"),
    ("no such function", ["rescore_rewards.digit"], "did you mean rescore_rewards.digits"),
    ("function raises", ["rescore_rewards.broken"], "reward function 'rescore_rewards.broken' failed on 32 of 32"),
    ("weights", ["accuracy", "--reward-weights", "1", "2"], "--reward-weights: 2 weights for 1 reward functions"),
])
def test_bad_input_is_one_line_naming_it_exit_2_nothing_cached(folder, run_a, dpo_run, capsys, case, funcs, named):
    from flows.cli import main

    artifacts = folder / "artifacts_a"
    run = {"unknown run": "no-such-run", "no rollouts": dpo_run["run_name"]}.get(case, run_a["run_name"])
    folders = score_folders(artifacts)
    assert main(["rescore", run, "--reward-funcs", *funcs, "--artifacts", str(artifacts)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and named in captured.err, captured.err
    assert score_folders(artifacts) == folders  # nothing half-written left, nothing cached
    assert all((p / "_manifest.json").exists() for p in (artifacts / "score").iterdir())


def test_group_signal():
    from flows.rescore import group_signal

    rows = [{"advantage": a} for a in (0.0, 0.0, 0.0, 0.0, 0.5, -0.5, 0.0, 0.0)]
    assert group_signal(rows, 4) == [False, True]
    assert group_signal(rows, 2) == [False, False, True, False]
