"""`posttrain validate` checks what a run would trip on, `posttrain run` checks the same before its first stage,
user modules beside the config are found, and your own data runs without SFT unless the config asks for it
(flows/preflight.py, issue 44 items 1-3)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.cli import main
from flows.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]

REWARDS = '''
def correct(prompts, completions, answer, **kwargs):
    """1.0 where the completion contains the row's answer."""
    return [1.0 if gold in (c[-1]["content"] if isinstance(c, list) else c) else 0.0
            for c, gold in zip(completions, answer)]


def by_solution(prompts, completions, solution, **kwargs):
    return [0.0 for _ in completions]
'''

@pytest.fixture
def new_user(tmp_path, monkeypatch):
    """What a new user writes: 60 question/answer rows, a reward module beside the config (in task/, not the
    working folder, which is tmp_path), a tiny model folder, and a config naming only transform.paths,
    score.reward_funcs and the model (plus the tiny sizes a test can afford)."""
    from conftest import tiny_model

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folders a config adds are this test's only
    monkeypatch.delitem(sys.modules, "own_rewards", raising=False)
    task = tmp_path / "task"
    task.mkdir()
    rows = [{"question": f"What is {i} + {i % 7}?", "answer": str(i + i % 7)} for i in range(60)]
    (task / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (task / "own_rewards.py").write_text(REWARDS)
    tiny_model(task, [f"<|im_start|>user\n{r['question']}<|im_end|>\n<|im_start|>assistant\n{r['answer']}<|im_end|>"
                      for r in rows])
    config = task / "my.yaml"
    config.write_text(f"""name: own-data
artifacts_dir: {tmp_path / 'artifacts'}
model: {{path: task/model}}
transform:
  paths: {{train: task/data.jsonl, eval: task/data.jsonl}}
score:
  reward_funcs: [own_rewards.correct]
  reward_num_workers: 1   # below: the sizes a test can afford
rollout: {{num_generations: 4, prompts_per_round: 8, max_completion_length: 8}}
grpo: {{rounds: 2, micro_batch_size: 16, gradient_accumulation_steps: 1, skip_zero_advantage_batches: false}}
eval: {{max_completion_length: 8, max_prompts: 16}}
""")
    return config


@pytest.mark.parametrize("override, key, says", [
    ("transform.paths.train=task/dta.jsonl", "transform.paths.train", "did you mean task/data.jsonl"),
    ("score.reward_funcs=[own_reward.correct]", "score.reward_funcs.0", "cannot import module 'own_reward'"),
    ("score.reward_funcs=[own_rewards.corect]", "score.reward_funcs.0", "did you mean own_rewards.correct"),
    ("score.reward_funcs=[own_rewards.by_solution]", "score.reward_funcs.0", "'solution' that the rows lack"),
    ("model.path=task/modle", "model.path", "did you mean task/model"),
    ("transform.answer_field=solution", "transform.paths.train", "missing or empty field solution"),
    ("sft.enabled=true", "sft.split", "no split 'sft'"),
    ("eval.reward_funcs=[own_rewards.corect]", "eval.reward_funcs.0", "did you mean own_rewards.correct"),
])
def test_validate_names_each_planted_mistake(new_user, override, key, says, capsys):
    started = time.perf_counter()
    assert main(["validate", str(new_user), override]) == 2
    assert time.perf_counter() - started < 10
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors and errors[0].startswith(f"error: {key}: ") and says in errors[0], errors


def test_new_user_config_validates_fails_fast_when_broken_and_runs(new_user, prefect_harness, capsys):
    """The scripted new user: validate passes (SFT off, said so), `posttrain run` with a bad reward module stops in
    seconds with exit 2 before any stage, and the fixed config runs to the end with its reward module found beside
    the config (in the flow process and in the spawned reward workers), no PYTHONPATH."""
    from flows.pipeline import posttrain_pipeline
    from tasks.lineage import Lineage

    assert main(["validate", str(new_user)]) == 0
    err = capsys.readouterr().err
    assert "note: sft: off" in err and "error:" not in err
    assert str(new_user.parent) in sys.path  # appended: an installed package of the same name would still win

    started = time.perf_counter()
    assert main(["run", str(new_user), "--quiet", "score.reward_funcs=[own_rewardz.correct]"]) == 2
    assert time.perf_counter() - started < 10
    assert "score.reward_funcs.0: cannot import module 'own_rewardz'" in capsys.readouterr().err
    assert not (new_user.parent.parent / "artifacts" / "transform").exists()  # no stage ran

    capsys.readouterr()
    results = posttrain_pipeline(str(new_user))
    assert results["final_accuracy"] is not None
    out = capsys.readouterr().out  # a run you can watch (issue 44 item 5): its name and MLflow run first, a line a round
    assert f"run {results['run_name']}: MLflow run {results['mlflow_run_id']}" in out.splitlines()[0]
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in rounds] == ["round 1/2", "round 2/2"]
    assert "reward " in rounds[0] and "kl " in rounds[0] and "length " in rounds[0] and "ETA " in rounds[0]
    assert "ETA" not in rounds[1]
    stages = {row["stage"] for row in results["stages"]}
    assert "sft" not in stages and {"score r0", "score r1"} <= stages
    run = Lineage(new_user.parent.parent / "artifacts", "own-data").client.get_run(results["mlflow_run_id"])
    assert str(new_user.parent) in json.loads(run.data.tags["posttrain.code_dirs"])

    # a resume reads the run's saved config (artifacts/runs/<run>/), not the user's: the module's folder comes
    # from the run's tag (here every stage is cached, and the checks import the module again)
    sys.path.remove(str(new_user.parent))
    del sys.modules["own_rewards"]
    saved = new_user.parent.parent / "artifacts" / "runs" / results["run_name"] / "config.yaml"
    again = posttrain_pipeline(str(saved), quiet=True, resume=results["mlflow_run_id"])
    assert str(new_user.parent) in sys.path and sys.modules["own_rewards"].__file__ == str(new_user.parent /
                                                                                            "own_rewards.py")
    assert again["final_accuracy"] == results["final_accuracy"]

    # the command a user types: Prefect's per-task state lines and its ephemeral server's link only with --verbose
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)  # its own ephemeral server, as a user's first run
    shown = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(new_user)], cwd=new_user.parent.parent,
                           capture_output=True, text=True, env=env, timeout=300)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "round 2/2:" in shown.stdout and "cached" in shown.stdout
    assert "Task run '" not in shown.stdout + shown.stderr and "View at http" not in shown.stdout + shown.stderr

    # the reward edited: the next run rescores, and compare names the module and shows the diff (issue 44 item 6)
    rewards = new_user.parent / "own_rewards.py"
    rewards.write_text(rewards.read_text().replace("1.0 if gold in", "1.0 if gold.strip() in"))
    edited = posttrain_pipeline(str(new_user), quiet=True)
    assert main(["compare", results["run_name"], edited["run_name"], "--artifacts",
                 str(new_user.parent.parent / "artifacts")]) == 0
    out = capsys.readouterr().out
    assert "user code differs: own_rewards" in out
    assert "-    return [1.0 if gold in" in out and "+    return [1.0 if gold.strip() in" in out

    # a reward that raises stops the run at its first score stage, one message naming it
    from stages.scoring.reward_workers import RewardFunctionError

    rewards.write_text(rewards.read_text().replace('"""1.0 where', 'raise KeyError("answer")\n    """1.0 where'))
    with pytest.raises(RewardFunctionError, match=r"own_rewards.correct.*score.max_error_rate") as failed:
        posttrain_pipeline(str(new_user), quiet=True)
    assert "KeyError" in str(failed.value) and len(str(failed.value).splitlines()) == 1


def test_sft_runs_only_where_the_config_asks(tmp_path):
    def sft(text: str):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        return load_config(path).sft.enabled

    assert sft("name: demo\n") is True  # the demo task's sft split: the quickstart's warm start
    assert sft("transform: {paths: {train: a.jsonl, eval: b.jsonl}}\n") is False  # your own data: straight to GRPO
    assert sft("transform: {paths: {sft: s.jsonl, train: a.jsonl, eval: b.jsonl}}\n") is True  # your rows have one
    assert sft("datasets: [{path: a.jsonl}]\nval_set_size: 2\n") is False
    assert sft("transform: {paths: {train: a.jsonl, eval: b.jsonl}}\nsft: {enabled: true, split: train}\n") is True
    with pytest.raises(ConfigError, match="sft.split is 'sft'"):  # asked for explicitly: still refused by name
        sft("datasets: [{path: a.jsonl}]\nval_set_size: 2\nsft: {enabled: true}\n")


def test_init_writes_a_task_that_validates_and_runs(tmp_path, monkeypatch, prefect_harness, capsys):
    """`posttrain init my-task`: a config, five rows and a reward module that run as they are."""
    from flows.pipeline import posttrain_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "rewards", raising=False)
    assert main(["init", "my-task"]) == 0
    assert len((tmp_path / "my-task" / "data.jsonl").read_text().splitlines()) == 5
    assert main(["init", "my-task"]) == 2  # never overwrites
    capsys.readouterr()
    assert main(["validate", "my-task/config.yaml"]) == 0
    assert "error:" not in capsys.readouterr().err
    results = posttrain_pipeline("my-task/config.yaml", quiet=True)
    assert {"score r0", "score r1", "eval final"} <= {row["stage"] for row in results["stages"]}


def test_validate_reads_the_first_preference_rows_as_the_run_does(tmp_path, capsys):
    """A DPO-family config whose rows lack the field its type reads: `posttrain validate` names the source, the
    row and the field (the preferences stage would stop on it), once although val_set_size puts the source in
    both splits; rows that fit pass."""
    import json

    rows = [{"instruction": f"{i}+1?", "completion": str(i + 1), "label": i % 2 == 0} for i in range(12)]
    (tmp_path / "kto.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    from conftest import tiny_model

    tiny_model(tmp_path, [f"{r['instruction']} {r['completion']}" for r in rows])
    config = tmp_path / "kto.yaml"
    config.write_text(f"rl: kto\nbase_model: {tmp_path / 'model'}\nval_set_size: 0.25\n"
                      f"datasets:\n  - path: {tmp_path / 'kto.jsonl'}\n    type: chatml.argilla\n")
    assert main(["validate", str(config)]) == 0
    (tmp_path / "kto.jsonl").write_text("\n".join(json.dumps({"prompt" if k == "instruction" else k: v
                                                              for k, v in r.items()}) for r in rows))
    assert main(["validate", str(config)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(r"kto.jsonl \(split=train\) row \d+, field 'instruction': missing",
                                          errors[0]), errors


def test_validate_leaves_out_what_the_run_uses_nothing_of_unless_full(tmp_path, capsys):
    """A GRPO config on its own rows and model, SFT off, the in-process vLLM engine: `posttrain validate` prints
    no demo_data, no built model's sizes, no other engine's or source's settings, and one comment saying what it
    left out and why; `--full` prints every setting, the same as the run saves."""
    import yaml

    from flows.cli import shown_config

    (tmp_path / "rows.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    config = tmp_path / "grpo.yaml"
    config.write_text(f"rl: grpo\nbase_model: {tmp_path / 'model'}\nadapter: lora\n"
                      f"datasets:\n  - path: {tmp_path / 'rows.jsonl'}\n    type: question_answer\n"
                      "trl:\n  use_vllm: true\n  vllm_mode: colocate\n")
    main(["validate", str(config)])
    out = capsys.readouterr().out
    shown = yaml.safe_load(out)
    assert "demo_data" not in shown and "hidden_size" not in shown["model"] and shown["sft"] == {"enabled": False}
    assert "atropos" not in shown["rollout"] and "ray_vllm" not in shown["rollout"]
    assert "server_url" not in shown["rollout"]["vllm"] and shown["rollout"]["vllm"]["lora_sync"] == "auto"
    comment = out.strip().splitlines()[-1]
    assert comment.startswith("# not shown, not used by this run: demo_data (the run reads your rows); model.vocab_size")
    assert comment.endswith("(posttrain validate --full prints them)")
    main(["validate", str(config), "--full"])
    cfg = load_config(str(config))
    assert yaml.safe_load(capsys.readouterr().out) == cfg.run_config() == shown_config(cfg, full=True)[0]
