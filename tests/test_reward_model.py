"""Reward models (stages/training/reward_model.py): a tiny ORM learns the demo preferences with TRL's RewardTrainer,
the saved folder loads as a sequence classifier, the scorer ranks held-out answers as a TRL reward
function, LoRA is merged into the saved folder, and each kind names the rows it cannot train on.
Process reward models (kind: prm): tests/test_prm.py."""

import json
from pathlib import Path

import pytest
import torch

from stages.data.preferences import write_split
from stages.runtime.devices import DeviceConfig
from stages.scoring.rewards import reward_model as rm_scoring
from stages.training import reward_model as rm
from stages.training.dpo import read_rows
from conftest import tiny_preference_model

FAST = dict(micro_batch_size=8, logging_steps=1, learning_rate=1e-3, lora_r=8, lora_alpha=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2 causal LM with the ChatML template and demo preference pairs (train 128, eval 64)."""
    return tiny_preference_model(tmp_path_factory.mktemp("reward_model"), num_train=128, num_eval=64)


@pytest.fixture(scope="module")
def orm(tiny):
    """A full fine-tuned ORM trained for 30 steps; (out_dir, summary, metrics seen)."""
    seen: list[tuple[dict, int]] = []
    cfg = rm.RewardModelConfig(max_steps=30, adapter="none", **FAST)
    out = tiny / "orm"
    summary = rm.run(cfg, tiny / "model", tiny / "prefs", out, on_metrics=lambda m, s: seen.append((m, s)))
    return out, summary, seen


def test_config_and_trl_options(tmp_path):
    with pytest.raises(ValueError):
        rm.RewardModelConfig(kind="ppo")
    with pytest.raises(ValueError):
        rm.RewardModelConfig(beta=0.1)  # extra="forbid"
    cfg = rm.RewardModelConfig(learning_rate=2e-4, max_steps=7, micro_batch_size=3, gradient_accumulation_steps=2,
                               max_length=99, seed=5)
    args = rm.build_trl_config(cfg, tmp_path, devices=DeviceConfig(device="cpu"))
    assert (args.learning_rate, args.max_steps, args.per_device_train_batch_size, args.gradient_accumulation_steps,
            args.max_length, args.seed) == (2e-4, 7, 3, 2, 99, 5)
    assert not args.bf16 and not args.fp16 and not args.gradient_checkpointing and args.use_cpu  # fp32 on CPU
    assert rm.lora_config(cfg) is None
    lora = rm.lora_config(rm.RewardModelConfig(adapter="lora"))
    assert "score" in lora.modules_to_save and lora.task_type == "SEQ_CLS"


def test_orm_learns_held_out_preferences(tiny, orm):
    out, summary, seen = orm
    assert summary["steps"] == 30 and summary["rows"] == 128 and summary["eval_pairs"] == 64
    assert summary["eval_pairwise_accuracy"] > 0.6, summary
    assert summary["eval_pairwise_accuracy"] > summary["eval_pairwise_accuracy_before"], summary
    for key in ("loss", "accuracy", "margin", "mean_reward"):
        assert key in summary["final_metrics"]
    assert [s for m, s in seen if "reward_model/loss" in m] == list(range(1, 31))

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    assert not (out / "_trainer").exists() and not (out / "adapter_config.json").exists()
    model = AutoModelForSequenceClassification.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.chat_template
    assert json.loads((out / "reward_model.json").read_text()) == {"kind": "orm", "max_length": 1024}
    eval_rows = read_rows(tiny / "prefs" / "eval.parquet")
    assert rm.pairwise_accuracy(model, tokenizer, eval_rows) == pytest.approx(summary["eval_pairwise_accuracy"])


def test_scorer_ranks_held_out_answers(tiny, orm):
    out, summary, _ = orm
    fn = rm_scoring.reward_model_function(out)
    assert fn.__name__ == "reward_model" and fn.scorer.kind == "orm"
    rows = read_rows(tiny / "prefs" / "eval.parquet")[:32]
    prompts = [r["prompt"] for r in rows] * 2
    completions = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]  # as TRL passes conversational data
    scores = fn(prompts=prompts, completions=completions, completion_ids=None, answer=["x"] * 64)
    assert len(scores) == 64 and all(isinstance(s, float) for s in scores)
    right = sum(c > w for c, w in zip(scores[:32], scores[32:]))
    assert right >= 0.75 * 32, (right, summary)

    # plain strings: the prompt is a user message, the completion an assistant message -- same scores
    text_prompts = [p[-1]["content"] for p in prompts]
    text_completions = [c[0]["content"] for c in completions]
    assert all(len(p) == 1 and p[0]["role"] == "user" for p in prompts)
    one_by_one = rm_scoring.RewardModelScorer(out, batch_size=1)  # padding does not change a score
    assert one_by_one(text_prompts, text_completions) == pytest.approx(scores, abs=1e-5)


def test_lora_is_merged_into_the_saved_folder(tiny, tmp_path):
    cfg = rm.RewardModelConfig(adapter="lora", max_steps=3, lora_dropout=0.1, **FAST)
    summary = rm.run(cfg, tiny / "model", tiny / "prefs", tmp_path)
    assert summary["steps"] == 3
    assert not (tmp_path / "adapter_config.json").exists()
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    assert not any("lora" in k or "modules_to_save" in k for k in weights) and "score.weight" in weights
    scorer = rm_scoring.RewardModelScorer(tmp_path)
    rows = read_rows(tiny / "prefs" / "eval.parquet")
    assert rm.pairwise_accuracy(scorer.model, scorer.tokenizer, rows) == pytest.approx(
        summary["eval_pairwise_accuracy"])
    base = rm.load_reward_model(tiny / "model", scorer.tokenizer)
    body = dict(base.named_parameters())
    assert any(not torch.equal(p, body[n]) for n, p in scorer.model.named_parameters() if n != "score.weight")


def test_eval_steps_measures_held_out_accuracy_between_and_trains_the_same(tiny, tmp_path):
    """axolotl's eval_steps: pairwise accuracy every 2 steps (not at the last: the after eval is that one), logged
    at its step; the saved model is the same as without it. With no held-out pairs it is an error naming it."""
    from safetensors.torch import load_file

    seen: list[tuple[dict, int]] = []
    every = rm.run(rm.RewardModelConfig(max_steps=5, adapter="none", eval_steps=2, **FAST), tiny / "model",
                   tiny / "prefs", tmp_path / "every", on_metrics=lambda m, s: seen.append((m, s)))
    plain = rm.run(rm.RewardModelConfig(max_steps=5, adapter="none", **FAST), tiny / "model", tiny / "prefs",
                   tmp_path / "plain")
    assert [step for step, _ in every["eval_history"]] == [2, 4] and "eval_history" not in plain
    assert [(s, m["reward_model/eval_pairwise_accuracy"]) for m, s in seen
            if "reward_model/eval_pairwise_accuracy" in m] == [tuple(h) for h in every["eval_history"]]
    assert all(0 <= accuracy <= 1 for _, accuracy in every["eval_history"])
    trained, again = load_file(str(tmp_path / "every" / "model.safetensors")), \
        load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert all(torch.equal(trained[name], again[name]) for name in trained)
    assert every["eval_pairwise_accuracy"] == plain["eval_pairwise_accuracy"]
    with pytest.raises(ValueError, match=r"reward_model.eval_steps: there are no held-out pairs to evaluate"):
        rm.run(rm.RewardModelConfig(max_steps=1, eval_steps=1, eval_split=None, **FAST), tiny / "model",
               tiny / "prefs", tmp_path / "none")


def test_each_kind_names_the_rows_it_cannot_train_on(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"needs kind stepwise.*train-000000 \(pair\)"):
        rm.run(rm.RewardModelConfig(kind="prm"), tiny / "model", tiny / "prefs", tmp_path)
    stepwise = {"pair_id": "train-000007", "kind": "stepwise", "prompt": [{"role": "user", "content": "q"}],
                "completions": ["a", "b"], "labels": [True, False]}
    prefs = tmp_path / "prefs"
    prefs.mkdir()
    write_split([stepwise], prefs / "train.parquet")
    with pytest.raises(ValueError, match=r"train-000007 \(stepwise\)"):
        rm.run(rm.RewardModelConfig(), tiny / "model", prefs, tmp_path / "out")


@pytest.mark.slow
def test_a_reward_model_run_trains_evaluates_and_registers_one(prefect_harness, tmp_path, monkeypatch):
    """rl: reward_model written as axolotl writes it (`reward_model: true`, model_type, num_labels, top-level
    training keys): the run trains an ORM from the base model on the preferences (here the demo pairs),
    measures pairwise accuracy on their eval split before and after, registers the folder in MLflow and
    says how a GRPO run scores with it; nothing of the policy sections runs."""
    from flows.config import load_config
    from flows.pipeline import posttrain_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = tmp_path / "rm.yaml"
    config.write_text(f"""
name: test-rm
output_dir: {tmp_path / 'artifacts'}
reward_model: true
model_type: AutoModelForSequenceClassification
num_labels: 1
micro_batch_size: 8
learning_rate: 1.0e-3
max_steps: 30
demo_data: {{num_sft: 300, num_train: 64, num_eval: 24}}
demo_pairs: {{num_train: 128, num_eval: 64}}
model: {{hidden_size: 64, num_attention_heads: 1, num_key_value_heads: 1, intermediate_size: 128,
        num_hidden_layers: 2, vocab_size: 300}}
""")
    results = posttrain_pipeline(str(config), quiet=True)

    assert [row["stage"] for row in results["stages"]] == ["demo_data", "transform", "base_model", "preferences",
                                                           "reward_model"]
    assert results["accuracy_metric"] == "eval_pairwise_accuracy" and results["eval_rows"] == 64
    assert results["accuracy_after"] > max(results["accuracy_before"], 0.6)
    folder = results["reward_model"]
    assert json.loads((Path(folder) / "config.json").read_text())["architectures"] == ["Qwen2ForSequenceClassification"]
    assert results["score_with"] == f"score.reward_funcs: [reward_model:{folder}]"
    assert str(results["registered_model_version"]) == "1"
    grpo = tmp_path / "grpo.yaml"  # the way the summary says to use it validates
    grpo.write_text(f"score:\n  reward_funcs: ['reward_model:{folder}']\n")
    assert load_config(grpo).score.reward_funcs == [f"reward_model:{folder}"]


def test_reward_model_run_config_errors_name_the_key(tmp_path):
    from flows.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    for text, message in (
            ("reward_model: true\nrl: dpo\n", "reward_model: true trains only a reward model .* rl is 'dpo'"),
            ("process_reward_model: true\nnum_labels: 1\n", "num_labels: 1; process_reward_model: true trains a 2"),
            ("model_type: AutoModelForSequenceClassification\n", "model_type / num_labels: axolotl's reward-model"),
            ("rl: reward_model\ngrpo:\n  rounds: 3\n", r"grpo.rounds: not read under rl: reward_model"),
            ("rl: reward_model\nsft:\n  enabled: true\n", "sft.enabled: rl: reward_model trains the reward model "
                                                         "from model.path")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_config(path)
    path.write_text("process_reward_model: true\nnum_labels: 2\n")
    cfg = load_config(path)
    assert (cfg.rl, cfg.reward_model.kind, cfg.sft.enabled) == ("reward_model", "prm", False)
