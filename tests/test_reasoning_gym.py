"""reasoning-gym as a `datasets:` source and the `reasoning_gym` reward (stages/data/reasoning_gym_source.py,
stages/scoring/rewards/reasoning_gym_scorer.py): the transform key holds the task, size, seed, config and package
version; rows carry the entry the task's scorer needs; the reward equals the package's own scoring on hand-picked
completions; errors name the task, the extra, the seeds; a tiny run trains and evaluates with the task's scorer.
The real package throughout (the `reasoning-gym` extra, in `test`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import reasoning_gym
from reasoning_gym.utils import extract_answer

from flows.config import ConfigError, load_config
from stages.data import reasoning_gym_source as gym
from stages.data import sources, transform
from stages.data.sources import DatasetSource, SourceError
from stages.data.transform import TransformConfig
from stages.runtime.keys import key_fields
from stages.scoring.rewards import BUILTIN_REWARDS
from stages.scoring.rewards.common import SampleError
from stages.scoring.rewards.reasoning_gym_scorer import reasoning_gym_reward
from tasks import stage_tasks

LEGS = {"path": "reasoning_gym", "name": "leg_counting", "size": 6, "seed": 1,
        "config": {"min_animals": 1, "max_animals": 2}}
MIX = {"path": "reasoning_gym", "name": "composite", "size": 12, "seed": 3,
       "config": {"datasets": [{"name": "leg_counting", "weight": 1}, {"name": "basic_arithmetic", "weight": 2,
                                                                       "config": {"max_terms": 3}}]}}


def source(**changes) -> dict:
    return {**LEGS, **changes}


@pytest.fixture
def transform_key(key_of):
    """transform_key(datasets): the transform key the task would look up (no stage runs)."""
    return lambda datasets: key_of(stage_tasks.transform_task, {"transform": {"datasets": datasets},
                                                                "sft": {"enabled": False}}, None)


def test_a_source_is_keyed_by_its_task_size_seed_config_and_package_version(transform_key):
    first = transform_key([source()])
    assert transform_key([source()]) == first
    assert DatasetSource(**source()).revision == "0.1.25"  # the installed package's version, filled in
    changed = [source(config={"min_animals": 1, "max_animals": 3}), source(size=7), source(seed=2),
               source(name="basic_arithmetic", config={}), source(revision="0.1.24"),
               {**MIX, "config": {"datasets": [{"name": "leg_counting", "weight": 1}]}}, MIX]
    keys = {transform_key([s]) for s in changed}
    assert first not in keys and len(keys) == len(changed)
    # the task fields are keyed only where set: the key of every other source is what it was
    assert not {"size", "seed", "config"} & set(key_fields(DatasetSource(path="data.jsonl")))


def test_rows_round_trip_through_the_transform_with_the_entry_the_package_makes(tmp_path, out_dir):
    cfg = TransformConfig(datasets=[LEGS, MIX], test_datasets=[source(size=3, seed=100)])
    counts = transform.run(cfg, None, out_dir)
    assert counts["train"] == 18 and counts["eval"] == 3
    rows = pq.read_table(out_dir / "train.parquet").to_pylist()
    made = list(reasoning_gym.create_dataset("leg_counting", size=6, seed=1, min_animals=1, max_animals=2))
    assert [r["prompt"] for r in rows[:6]] == [[{"role": "user", "content": e["question"]}] for e in made]
    assert [r["answer"] for r in rows[:6]] == [e["answer"] for e in made]
    for row, entry in zip(rows, made):
        record = json.loads(row["reasoning_gym"])
        assert record["entry"] == json.loads(json.dumps(entry)) and record["version"] == "0.1.25"
        assert gym.entry_of(record)[1] == entry  # made again exactly, tuples and all
    mixed = {json.loads(r["reasoning_gym"])["entry"]["metadata"]["source_dataset"] for r in rows[6:]}
    assert mixed == {"leg_counting", "basic_arithmetic"}  # the composite's weighted mix
    right = reasoning_gym_reward(completions=[f"<answer>{r['answer']}</answer>" for r in rows],
                                 reasoning_gym=[r["reasoning_gym"] for r in rows])
    assert right == [1.0] * len(rows)


def test_a_row_is_scored_on_the_entry_as_the_package_makes_it():
    """arc_agi's scorer compares the answer's board with the entry's tuples: JSON's lists would score 0.05."""
    row = gym.rows("arc_agi", 1, 1, {})[0]
    stored = json.loads(row["reasoning_gym"])["entry"]
    dataset = reasoning_gym.create_dataset("arc_agi", size=1, seed=1)
    assert dataset.score_answer(row["answer"], stored) == 0.05
    assert reasoning_gym_reward(completions=[f"<answer>{row['answer']}</answer>"],
                                reasoning_gym=[row["reasoning_gym"]]) == [1.0]


# (task, config, completions built from the entry, the answer each states, what reasoning-gym's own scorer gives
# each): the last `<answer>` block (reasoning-gym's extract_answer), else a number stated as the answer
CASES = [
    ("leg_counting", {}, lambda e: [f"<answer>{e['answer']}</answer>", "<answer>291</answer>", e["answer"],
                                    f"Think: {e['answer']}?<answer>1</answer> no, <answer>{e['answer']}</answer>",
                                    f"So they have {e['answer']} legs", f"The total is {e['answer']}."],
     lambda e: [e["answer"], "291", e["answer"], e["answer"], None, e["answer"]], [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
    ("countdown", {}, lambda e: ["<answer>4*94 - 6 - 61</answer>", "<answer>1+1</answer>", "94*4 - 61 - 6",
                                 "<answer>94*4 - 61 - 6"],
     lambda e: ["4*94 - 6 - 61", "1+1", None, None], [1.0, 0.05, 0.01, 0.01]),
    ("propositional_logic", {}, lambda e: [f"<answer>{e['metadata']['example_answer']}</answer>", "<answer>P</answer>",
                                           "P", "<answer></answer>"],
     lambda e: [e["metadata"]["example_answer"], "P", None, ""], [1.0, 0.25, 0.0, 0.0]),
]


@pytest.mark.parametrize("task, config, completions_of, stated_of, expected", CASES, ids=[c[0] for c in CASES])
def test_the_reward_is_the_tasks_own_score_of_the_stated_answer(task, config, completions_of, stated_of, expected):
    row = gym.rows(task, 1, 1, config)[0]
    entry = json.loads(row["reasoning_gym"])["entry"]
    completions = completions_of(entry)
    dataset = reasoning_gym.create_dataset(task, size=1, seed=1, **config)
    tagged = [extract_answer(c) for c in completions]  # reasoning-gym's reading where a completion has tags
    assert [t for t in tagged if t is not None] == [a for a, t in zip(stated_of(entry), tagged) if t is not None]
    package = [dataset.score_answer(answer, dataset[0]) for answer in stated_of(entry)]
    chats = [[{"role": "assistant", "content": c}] for c in completions]  # TRL's chat completions
    assert BUILTIN_REWARDS["reasoning_gym"] is reasoning_gym_reward
    assert reasoning_gym_reward(prompts=[None] * len(chats), completions=chats,
                                reasoning_gym=[row["reasoning_gym"]] * len(chats)) == package == expected


def test_a_row_the_installed_package_makes_differently_is_a_sample_error():
    row = gym.rows("leg_counting", 2, 1, {})[0]
    record = json.loads(row["reasoning_gym"])
    record["entry"]["question"], record["version"] = "another question", "0.1.0"
    scores = reasoning_gym_reward(completions=["<answer>1</answer>"] * 2,
                                  reasoning_gym=[json.dumps(record), row["reasoning_gym"]])
    assert isinstance(scores[0], SampleError) and scores[1] == 0.0
    assert "differently from 0.1.0, which wrote this row; install reasoning-gym==0.1.0" in str(scores[0])


@pytest.mark.parametrize("entry, message", [
    (source(name="leg_countin"), r"reasoning-gym has no task 'leg_countin' \(did you mean leg_counting"),
    (source(config={"min_legs": 2}), r"task 'leg_counting' refuses config \{'min_legs': 2\}: TypeError: .*min_legs"),
    # a config the task takes, which its generator trips on only when it makes an item (operators without weights)
    (source(name="simple_equations", config={"operators": ["+"]}),
     r"task 'simple_equations' cannot make an item with config \{'operators': \['\+'\]\}: ValueError: The number "),
    (source(name="aiw", config={"task_types": ["siblings"], "task_type_weights": [1.0]}),  # it wants its enum
     r"task 'aiw' cannot make an item with config .*AttributeError: 'str' object has no attribute 'value'"),
    ({**MIX, "config": {"datasets": [{"name": "nope", "weight": 1}]}}, r"reasoning-gym has no task 'nope'"),
    (source(seed=None), r"set name \(the task\), size \(rows\) and seed; seed lacking"),
    ({"path": "data.jsonl", "seed": 1}, r"source 'data.jsonl': seed applies to path: reasoning_gym only"),
])
def test_a_bad_source_is_a_config_error_naming_it(tmp_path, entry, message):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"datasets": [entry], "val_set_size": 2}))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_held_out_source_drawing_the_train_seeds_is_refused():
    with pytest.raises(ValueError, match=r"test_datasets.0: leg_counting seeds 5..6 are also drawn by "
                                         r"transform.datasets.0 .* set its seed to 7 or more"):
        TransformConfig(datasets=[LEGS], test_datasets=[source(size=2, seed=5)])
    TransformConfig(datasets=[LEGS], test_datasets=[source(size=2, seed=7)])  # seeds 7, 8: none of 1..6
    TransformConfig(datasets=[LEGS], test_datasets=[source(size=2, seed=5, config={})])  # other problems


def test_without_the_package_one_line_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what `import reasoning_gym` meets where it is absent
    with pytest.raises(ValueError, match=r"needs the reasoning-gym package, which is not installed; install the "
                                         r"extra: pip install -e '\.\[reasoning-gym\]'"):
        DatasetSource(**LEGS)


def test_validate_exits_2_naming_an_unknown_task(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"datasets": [source(name="countdow")], "val_set_size": 2}))
    posttrain = Path(sys.executable).parent / "posttrain"
    done = subprocess.run([str(posttrain), "validate", str(path)], capture_output=True, text=True)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "reasoning-gym has no task 'countdow' (did you mean countdown" in done.stderr + done.stdout


def test_the_reward_on_rows_of_another_source_names_the_source_it_needs(tmp_path, capsys):
    from flows.cli import main

    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"question": f"{i} + 1?", "answer": str(i + 1)}) for i in range(8)))
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"datasets": [{"path": str(rows), "type": "question_answer"}],
                                "score": {"reward_funcs": ["reasoning_gym"]}}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "reasoning_gym needs column 'reasoning_gym' on every row" in err
    assert "read the rows from a reasoning-gym source (datasets: - path: reasoning_gym, name: TASK" in err


def test_a_revision_other_than_the_installed_package_stops_the_transform(out_dir):
    cfg = TransformConfig(datasets=[source(revision="0.1.24")], val_set_size=2)
    with pytest.raises(SourceError, match=r"reasoning_gym \(name=leg_counting, size=6, seed=1, revision=0.1.24, "
                                          r"split=train\): this source was made with reasoning-gym 0.1.24; 0.1.25"):
        sources.load(cfg.datasets[0])


@pytest.mark.first_run  # its stages share no key with the warm tiny stages: none to copy
def test_a_tiny_run_trains_and_evaluates_with_the_tasks_scorer(prefect_harness, tiny_config, tmp_path):
    """One GRPO round of the tiny model on leg_counting: rows from reasoning-gym, the round's rewards and the eval's
    verdicts and constant baseline from the task's own scorer (not math-verify `accuracy`)."""
    from flows.pipeline import posttrain_pipeline

    task = "{name: leg_counting, config: {min_animals: 1, max_animals: 2}, path: reasoning_gym"
    result = posttrain_pipeline(str(tiny_config), [
        "sft.enabled=false", "grpo.rounds=1", "score.reward_funcs=[reasoning_gym]",
        f"transform.datasets=[{task}, size: 16, seed: 1}}]",
        f"transform.test_datasets=[{task}, size: 8, seed: 5000}}]"], quiet=True)
    paths = {row["stage"]: row["path"] for row in result["stages"]}
    made = reasoning_gym.create_dataset("leg_counting", size=8, seed=5000, min_animals=1, max_animals=2)
    prompts = pq.read_table(f"{paths['transform']}/eval.parquet").to_pylist()
    assert [r["answer"] for r in prompts] == [e["answer"] for e in made]

    scored = pq.read_table(f"{paths['score r0']}/scored.parquet").to_pylist()
    train = reasoning_gym.create_dataset("leg_counting", size=16, seed=1, min_animals=1, max_animals=2)
    for row in scored:
        entry = train[json.loads(row["reasoning_gym"])["index"]]
        assert dict(row["rewards"]) == {"reasoning_gym": train.score_answer(extract_answer(row["completion"]), entry)}

    summary = json.loads((tmp_path / "artifacts" / "runs" / result["run_name"] / "summary.json").read_text())
    evaluated = pq.read_table(f"{paths['eval final']}/eval.parquet").to_pylist()
    assert [r["reward"] for r in evaluated] == [made.score_answer(extract_answer(r["completion"]), e)
                                                for r, e in zip(evaluated, made)]
    answers = [e["answer"] for e in made]
    top = max(set(answers), key=answers.count)
    # the constant baseline, judged by the task's scorer: "<answer>top</answer>" right on its prompts only
    assert summary["constant_baseline"] == answers.count(top) / 8 > 0
    manifest = json.loads((Path(paths["eval final"]) / "_manifest.json").read_text())
    assert manifest["summary"]["verifier"] == ["reasoning_gym"]
