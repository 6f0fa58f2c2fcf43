"""A config that names its own model and rows trains what it says (issue 45 item 0): no demo data, no SFT warm
start unless asked, no eval split required. axolotl's documented examples are run to the policy they start from;
a GRPO run on a train split alone goes to the end, says it has no held-out eval and reports its training reward."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from mlflow import MlflowClient

from conftest import computed
from test_configs import AXOLOTL_DOC_EXAMPLES, _without

pytestmark = pytest.mark.usefixtures("prefect_harness")

QUESTIONS = [{"question": f"{a}+{b}?", "answer": str(a + b), "text": f"{a}+{b}={a + b}"} for a in range(6)
             for b in range(4)]
"""Rows for every example: question_answer reads question and answer, type text (EBFT strided) reads text."""


@pytest.fixture(scope="module")
def own_model(tiny_warm_store):
    """A real model folder of the user's: the tiny run's base model (model.path reads it as it is)."""
    return next(p for p in (tiny_warm_store / "base_model").iterdir() if (p / "config.json").is_file())


def write_rows(folder) -> tuple:
    prompts, prefs = folder / "prompts.jsonl", folder / "prefs.jsonl"
    prompts.write_text("\n".join(json.dumps(row) for row in QUESTIONS))
    prefs.write_text(json.dumps({"question": "2+2?", "chosen": "4", "rejected": "5"}))
    return prompts, prefs


RUN_TO_THE_POLICY = [name for name in AXOLOTL_DOC_EXAMPLES if not name.startswith("reward_modelling")]
"""The doc examples that train a policy (a reward model run starts from model.path, with no prompts or SFT)."""


@pytest.mark.parametrize("name", RUN_TO_THE_POLICY)
def test_axolotl_doc_examples_start_from_their_own_model_and_rows(name, own_model, tmp_path, monkeypatch,
                                                                  empty_mlflow_store):
    """Each example as written (its keys posttrain refuses left out; base_model and datasets added where the
    excerpt has none, as every real config has them): the stages before the first round compute no demo_data and no sft, and a
    DPO-family run on its preferences builds no prompts at all."""
    from flows.config import load_config
    from flows.pipeline import prepare_policy_flow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    text, refused = AXOLOTL_DOC_EXAMPLES[name]
    prompts, prefs = write_rows(tmp_path)
    text = text.format(prefs=prefs, prompts=prompts, model=own_model)
    if refused:
        text = _without(text.splitlines(keepends=True), refused[1])
    if "base_model:" not in text:
        text = f"base_model: {own_model}\n{text}"
    if "datasets:" not in text:  # an excerpt about other keys (vLLM's): the rows a real config names
        text = f"datasets:\n  - path: {prompts}\n    type: question_answer\n{text}"
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    shutil.copyfile(empty_mlflow_store, artifacts / "mlflow.db")
    path = tmp_path / "axolotl.yaml"
    if "output_dir:" in text:  # axolotl's name for where everything goes
        text = re.sub(r"(?m)^output_dir: .*$", f"output_dir: {artifacts}", text)
    else:
        text += f"\nartifacts_dir: {artifacts}\n"
    path.write_text(text)
    cfg = load_config(path)

    policy = prepare_policy_flow(str(path), quiet=True)
    made = sorted(p.name for p in artifacts.iterdir() if p.is_dir() and any(p.iterdir()))
    assert "demo_data" not in made and "sft" not in made, made
    assert ("transform" in made) == (cfg.rl not in ("dpo", "ipo", "kto", "orpo", "simpo")), made
    assert policy.startswith(str(artifacts / "base_model"))  # the user's model, as it is


def test_grpo_on_a_train_split_alone_runs_to_the_end_without_an_eval(own_model, tmp_path, monkeypatch,
                                                                     empty_mlflow_store, capsys):
    """transform.datasets with no test_datasets or val_set_size (as axolotl's GRPO examples): the run computes
    no eval stage, registers the model without ranking it, and its summary reports the first and last rounds'
    training reward instead of a held-out accuracy."""
    from flows.pipeline import posttrain_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    prompts, _ = write_rows(tmp_path)
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    shutil.copyfile(empty_mlflow_store, artifacts / "mlflow.db")
    path = tmp_path / "own.yaml"
    path.write_text(f"""
name: own-rows
artifacts_dir: {artifacts}
base_model: {own_model}
rl: grpo
datasets: [{{path: {prompts}, type: question_answer}}]
rollout: {{num_generations: 4, prompts_per_round: 8, max_completion_length: 8}}
score: {{reward_num_workers: 1}}
grpo: {{rounds: 2, micro_batch_size: 16, gradient_accumulation_steps: 1, skip_zero_advantage_batches: false}}
""")
    results = posttrain_pipeline(str(path), quiet=False)
    stages = [row["stage"] for row in results["stages"]]
    assert stages == ["transform", "base_model", "rollout r0", "score r0", "optimize r0", "rollout r1", "score r1",
                      "optimize r1", "export"]
    assert computed(results) == stages
    assert json.loads(next((artifacts / "transform").glob("*/_manifest.json")).read_text())["summary"]["train"] == 24
    assert results["held_out_eval"] is False and results["final_accuracy"] is None
    assert results["train_rounds"] == 2 and 0 <= results["train_reward_first"] <= 1
    assert results["promotion"]["alias"] is None and "registered but not ranked" in results["promotion"]["reason"]
    assert "train split only" in results["promotion"]["reason"]
    shown = capsys.readouterr().out
    assert "eval: none, your rows are a train split only" in shown  # at the start, and in the summary:
    assert "eval: no held-out prompts (your rows are a train split only" in shown
    assert "train/reward_mean  first round:" in shown and "eval/accuracy  base:" not in shown
    assert f"open the MLflow UI: {results['mlflow_ui']}" in shown.splitlines()  # one line to copy, not wrapped

    client = MlflowClient(f"sqlite:///{artifacts / 'mlflow.db'}")
    parent = client.get_run(results["mlflow_run_id"])
    assert parent.data.tags["promotion.alias"] == "none"
    assert [m.step for m in client.get_metric_history(parent.info.run_id, "train/reward_mean")] == [1, 2]
    assert client.get_metric_history(parent.info.run_id, "eval/accuracy") == []
    version = client.get_model_version("own-rows", results["registered_model_version"])
    assert not version.aliases  # registered, neither champion nor challenger


def test_a_dpo_run_on_its_preferences_says_what_it_measured(own_model, tmp_path):
    """A DPO-family run without prompts: its summary says why there is no prompt eval and shows the held-out
    preference accuracy it measured, never "a train split only"."""
    from flows.config import PipelineConfig
    from flows.pipeline import training_results
    from flows.rounds import Trained
    from tasks.reporting import headline

    _, prefs = write_rows(tmp_path)
    cfg = PipelineConfig.model_validate({"rl": "dpo", "base_model": str(own_model), "val_set_size": 0.25,
                                         "datasets": [{"path": str(prefs), "type": "chatml.intel"}]})
    assert not cfg.reads_prompts and not cfg.runs_eval
    trained = Trained(None, {}, 1.0, results={"preference_accuracy_base": 0.5, "preference_accuracy_final": 0.75})
    lines = headline({**training_results(cfg, trained), **trained.results})
    assert lines[0].startswith("eval: no held-out prompts (rl: dpo on your preferences alone")
    assert "train split only" not in " ".join(lines)
    assert lines[-1].startswith("eval/preference_accuracy  base: 0.500   final: 0.750")


def test_a_kto_run_shows_its_heldout_rewards_in_the_summary(own_model, tmp_path):
    """axolotl's KTO with val_set_size: the summary shows the held-out rewards TRL's KTOTrainer logs on eval."""
    from flows.config import PipelineConfig
    from flows.pipeline import training_results
    from flows.rounds import Trained
    from tasks.reporting import headline

    _, prefs = write_rows(tmp_path)
    cfg = PipelineConfig.model_validate({"rl": "kto", "base_model": str(own_model), "val_set_size": 0.25,
                                         "datasets": [{"path": str(prefs), "type": "chatml.intel"}]})
    kto = {"rows": 8, "desirable": 4, "undesirable": 4, "rewards_chosen": 0.02, "rewards_rejected": -0.05,
           "rewards_margins": 0.07, "label_accuracy": 0.625}
    trained = Trained(None, {}, 1.0, results={"preference_accuracy_base": None, "preference_accuracy_final": None,
                                              "kto_heldout": kto})
    lines = headline({**training_results(cfg, trained), **trained.results})
    assert lines[-1].startswith("eval/kto  reward margin: +0.070   label accuracy: 0.625   (8 held-out rows, "
                                "4 desirable"), lines
