"""Process reward models (stages/training/reward_model.py, kind: prm): labels sit on the last token of each step,
a tiny PRM trained on the demo stepwise rows beats the majority class on held-out steps, the saved folder
scores as a TRL reward function (a right solution above one with a wrong step; min vs last aggregation),
and LoRA is merged into the saved folder."""

import json

import pytest

from stages.data import base_model
from stages.data.demo_data import DemoDataConfig
from stages.data.demo_pairs import DemoPairsConfig, demo_pair_rows, demo_steps, write_demo_pairs
from stages.data.preferences import write_split
from stages.scoring.rewards import reward_model as rm_scoring
from stages.training import reward_model as rm
from stages.training.dpo import read_rows

# 3 numbers per question: a random-init 2-layer model learns the comparisons in ~80 steps (5 need hundreds)
DEMO = DemoDataConfig(numbers_per_question=3, num_sft=10, num_train=10, num_eval=10, balanced_answers=False)
FAST = dict(kind="prm", micro_batch_size=16, logging_steps=10, learning_rate=3e-3, lora_r=8, lora_alpha=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2 causal LM (ChatML, tokenizer trained on step-by-step solutions) and demo stepwise rows
    (train 400, eval 64)."""
    root = tmp_path_factory.mktemp("prm")
    texts = []
    for i in range(200):
        numbers = (i % 9 + 1, i * 3 % 9 + 1, i * 7 % 9 + 1)
        steps, _ = demo_steps(numbers)
        texts.append(f"<|im_start|>user\nWhich is the largest of {', '.join(map(str, numbers))}?<|im_end|>\n"
                     f"<|im_start|>assistant\n" + "\n".join(steps) + "<|im_end|>")
    cfg = base_model.BaseModelConfig(vocab_size=300, hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
                                     intermediate_size=128, num_hidden_layers=2)
    base_model.run(cfg, texts, root / "model")
    (root / "prefs").mkdir()
    write_demo_pairs(DemoPairsConfig(kind="stepwise", num_train=400, num_eval=64), root / "prefs", DEMO)
    return root


@pytest.fixture(scope="module")
def prm(tiny):
    """A full fine-tuned PRM trained for 80 steps, held-out step accuracy every 40; (out_dir, summary, metrics)."""
    seen: list[tuple[dict, int]] = []
    out = tiny / "prm"
    summary = rm.run(rm.RewardModelConfig(max_steps=80, eval_steps=40, **FAST), tiny / "model", tiny / "prefs", out,
                     on_metrics=lambda m, s: seen.append((m, s)))
    return out, summary, seen


def test_labels_only_at_step_ends():
    prompt, steps, separator = [101, 102, 103], [[7, 8, 9], [4], [5, 6]], [0]
    ids, ends = rm_scoring.join_steps(prompt, steps, separator)
    assert ids == [101, 102, 103, 7, 8, 9, 0, 4, 0, 5, 6]
    assert ends == [5, 7, 10] and [ids[e] for e in ends] == [9, 4, 6]  # each step's own last token
    labels = rm.step_labels(len(ids), ends, [True, False, False])
    assert labels == [-100, -100, -100, -100, -100, 1, -100, 0, -100, -100, 0]
    with pytest.raises(ValueError, match="2 labels for 3 steps"):
        rm.step_labels(len(ids), ends, [True, False])
    # truncation keeps the last tokens and the step ends among them
    assert rm.keep_last(ids, ends, 4) == ([0, 4, 0, 5, 6][-4:], [0, 3])
    batch = rm.collate_steps([{"input_ids": ids, "labels": labels}, {"input_ids": [1, 2], "labels": [-100, 1]}], 99)
    assert batch["input_ids"][1].tolist() == [1, 2] + [99] * 9
    assert batch["attention_mask"][1].tolist() == [1, 1] + [0] * 9
    assert batch["labels"][1].tolist() == [-100, 1] + [-100] * 9


def test_labels_on_real_tokens(tiny):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    steps, labels = demo_steps((3, 8, 1), mistake_at=1)
    assert steps == ["Compare 3 and 8: keep 8", "Compare 8 and 1: keep 1", "<answer>1</answer>"]
    assert labels == [True, False, False]
    row = {"prompt": [{"role": "user", "content": "Which is the largest of 3, 8, 1?"}], "completions": steps,
           "labels": labels}
    feature = rm.prm_features(tokenizer, [row], "\n")[0]
    text = tokenizer.decode(feature["input_ids"])
    assert text.endswith("<|im_start|>assistant\n" + "\n".join(steps))  # the completion as the policy writes it
    marked = [(tokenizer.decode(feature["input_ids"][: i + 1]), label)
              for i, label in enumerate(feature["labels"]) if label != -100]
    assert [(t.split("assistant\n")[-1], label) for t, label in marked] == [
        ("Compare 3 and 8: keep 8", 1), ("Compare 3 and 8: keep 8\nCompare 8 and 1: keep 1", 0),
        ("\n".join(steps), 0)]


def test_demo_stepwise_rows():
    rows = demo_pair_rows(DemoPairsConfig(kind="stepwise", num_train=200, num_eval=50), DEMO)
    train, held_out = rows["train"], rows["eval"]
    questions = [r["prompt"][-1]["content"] for r in train + held_out]
    held_out_questions = {r["prompt"][-1]["content"] for r in held_out}
    assert len(held_out_questions) == 50  # distinct held-out rows
    assert not held_out_questions & {r["prompt"][-1]["content"] for r in train}  # disjoint splits
    from stages.data.demo_pairs import demo_eval_questions

    assert not set(questions) & demo_eval_questions(DEMO)  # and disjoint from the demo task's eval split
    assert {r["kind"] for r in train} == {"stepwise"}
    for r in train:
        labels = r["labels"]
        assert len(labels) == len(r["completions"]) and r["completions"][-1].startswith("<answer>")
        assert labels == sorted(labels, reverse=True)  # bad from the first mistake on
    lengths = {len(r["completions"]) for r in train}
    assert lengths == {1, 3}  # answer-only and full solutions
    good = sum(all(r["labels"]) for r in train) / len(train)
    assert 0.3 < good < 0.7  # mistake_rate 0.5
    assert demo_pair_rows(DemoPairsConfig(num_train=3, num_eval=2), DEMO)["train"][0]["kind"] == "pair"


def test_prm_learns_held_out_steps(tiny, prm):
    out, summary, seen = prm
    assert summary["kind"] == "prm" and summary["steps"] == 80 and summary["train_rows"] == 400
    chance = max(summary["eval_good_step_fraction"], 1 - summary["eval_good_step_fraction"])
    assert summary["eval_step_accuracy"] > chance + 0.05, summary
    assert summary["eval_step_accuracy"] > summary["eval_step_accuracy_before"], summary
    assert summary["eval_pairwise_accuracy"] is None
    for key in ("loss", "step_accuracy", "grad_norm"):
        assert key in summary["final_metrics"]
    assert [s for m, s in seen if "reward_model/loss" in m] == list(range(10, 81, 10))
    held_out = [(m["reward_model/eval_step_accuracy"], s) for m, s in seen if "reward_model/eval_step_accuracy" in m]
    middle = summary["eval_history"][0][1]  # eval_steps 40: once between the before and after evals
    assert summary["eval_history"] == [[40, middle]]
    assert held_out == [(summary["eval_step_accuracy_before"], 0), (middle, 40), (summary["eval_step_accuracy"], 80)]

    from transformers import AutoModelForTokenClassification, AutoTokenizer

    assert not (out / "_trainer").exists() and not (out / "adapter_config.json").exists()
    assert json.loads((out / "reward_model.json").read_text()) == {
        "kind": "prm", "max_length": 1024, "step_separator": "\n", "step_aggregation": "min"}
    model = AutoModelForTokenClassification.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.num_labels == 2 and model.config.id2label == {0: "bad", 1: "good"}
    assert tokenizer.chat_template and model.config.pad_token_id == tokenizer.pad_token_id
    rows = rm.to_prm_rows(read_rows(tiny / "prefs" / "eval.parquet"), "eval", "\n")
    assert rm.step_accuracy(model, tokenizer, rows, "\n") == pytest.approx(summary["eval_step_accuracy"])


def test_scorer_ranks_a_right_solution_over_one_with_a_wrong_step(tiny, prm):
    out, summary, _ = prm
    fn = rm_scoring.reward_model_function(out)
    assert fn.__name__ == "reward_model" and fn.scorer.kind == "prm" and fn.scorer.step_aggregation == "min"
    questions = [r["prompt"][-1]["content"] for r in read_rows(tiny / "prefs" / "eval.parquet")][:32]
    right, wrong = [], []
    for i, q in enumerate(questions):
        numbers = tuple(int(n) for n in q.removeprefix("Which is the largest of ").rstrip("?").split(", "))
        right.append("\n".join(demo_steps(numbers)[0]))
        wrong.append("\n".join(demo_steps(numbers, mistake_at=i % 3, wrong_answer=min(numbers))[0]))
    prompts = [[{"role": "user", "content": q}] for q in questions] * 2
    completions = [[{"role": "assistant", "content": c}] for c in right + wrong]  # as TRL passes them
    scores = fn(prompts=prompts, completions=completions, completion_ids=None, answer=["x"] * 64)
    assert len(scores) == 64 and all(isinstance(s, float) and 0 <= s <= 1 for s in scores)
    ranked = sum(r > w for r, w in zip(scores[:32], scores[32:]))
    assert ranked >= 0.75 * 32, (ranked, summary)

    # strings score the same, one at a time (padding changes nothing) or in a batch
    one_by_one = rm_scoring.RewardModelScorer(out, batch_size=1)
    assert one_by_one(questions * 2, right + wrong) == pytest.approx(scores, abs=1e-5)


def test_step_aggregation_min_and_last(prm):
    assert rm_scoring.aggregate_steps([0.9, 0.2, 0.8], "min") == 0.2
    assert rm_scoring.aggregate_steps([0.9, 0.2, 0.8], "last") == 0.8
    assert rm_scoring.aggregate_steps([0.4], "min") == rm_scoring.aggregate_steps([0.4], "last") == 0.4
    with pytest.raises(ValueError):
        rm_scoring.aggregate_steps([], "min")
    with pytest.raises(ValueError, match="step_aggregation"):
        rm_scoring.RewardModelScorer(prm[0], step_aggregation="mean")

    out = prm[0]
    by_min, by_last = rm_scoring.RewardModelScorer(out), rm_scoring.RewardModelScorer(out, step_aggregation="last")
    prompts = ["Which is the largest of 3, 8, 1?"] * 3
    completions = ["Compare 3 and 8: keep 8\nCompare 8 and 1: keep 8\n<answer>8</answer>",
                   "Compare 3 and 8: keep 3\nCompare 3 and 1: keep 3\n<answer>3</answer>",
                   "<answer>8</answer>\n"]  # a trailing separator adds no step
    steps = by_min.score_steps(prompts, completions)
    assert [len(s) for s in steps] == [3, 3, 1]
    assert by_min(prompts, completions) == pytest.approx([min(s) for s in steps])
    assert by_last(prompts, completions) == pytest.approx([s[-1] for s in steps])
    # the same step scores whether the completion is split on the separator here or given whole
    assert by_min.score_steps(prompts[:1], [completions[0].split("\n")[0]])[0] == pytest.approx(steps[0][:1])


def test_prm_lora_is_merged_and_rows_are_checked(tiny, tmp_path):
    summary = rm.run(rm.RewardModelConfig(adapter="lora", max_steps=3, lora_dropout=0.1, step_aggregation="last",
                                          **FAST), tiny / "model", tiny / "prefs", tmp_path / "lora")
    assert summary["steps"] == 3
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "lora" / "model.safetensors"))
    assert not any("lora" in k or "modules_to_save" in k for k in weights) and "score.weight" in weights
    scorer = rm_scoring.RewardModelScorer(tmp_path / "lora")
    assert scorer.kind == "prm" and scorer.step_aggregation == "last"  # from the folder's reward_model.json

    prefs = tmp_path / "prefs"
    prefs.mkdir()
    pair = {"pair_id": "train-000003", "kind": "pair", "prompt": [{"role": "user", "content": "q"}],
            "chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}
    write_split([pair], prefs / "train.parquet")
    with pytest.raises(ValueError, match=r"needs kind stepwise.*train-000003 \(pair\)"):
        rm.run(rm.RewardModelConfig(kind="prm"), tiny / "model", prefs, tmp_path / "out")
    two_lines = {"pair_id": "train-000004", "kind": "stepwise", "prompt": [{"role": "user", "content": "q"}],
                 "completions": ["a\nb", "c"], "labels": [True, False]}
    write_split([two_lines], prefs / "train.parquet")
    with pytest.raises(ValueError, match=r"step_separator.*train-000004"):
        rm.run(rm.RewardModelConfig(kind="prm"), tiny / "model", prefs, tmp_path / "out")


def prm_on_ranks(root: str, out: str, on_metrics=None, group=None) -> dict:
    """A 20-step PRM run (stages.runtime.distributed.launch calls it on each rank)."""
    from pathlib import Path

    return rm.run(rm.RewardModelConfig(max_steps=20, **FAST), Path(root) / "model", Path(root) / "prefs", Path(out),
                  on_metrics=on_metrics, group=group)


@pytest.mark.slow
def test_prm_on_two_processes_equals_one(tiny, tmp_path):
    """train.num_processes 2: the same weights, and step_accuracy counted over both ranks' rows (a rank's
    own share would differ from the one-process value)."""
    from stages.runtime import distributed
    from test_checkpoints import weights

    seen_one, seen_two = [], []
    KEY = "reward_model/step_accuracy"
    prm_on_ranks(str(tiny), str(tmp_path / "one"), on_metrics=lambda m, s: seen_one.append((m, s)))
    distributed.launch("test_prm:prm_on_ranks", {"root": str(tiny), "out": str(tmp_path / "two")},
                       distributed.TrainConfig(num_processes=2), "reward_model",
                       on_metrics=lambda m, s: seen_two.append((m, s)))
    accuracy_one, accuracy_two = ([(s, m[KEY]) for m, s in seen if KEY in m]
                                  for seen in (seen_one, seen_two))
    assert len(accuracy_one) == 2 and [s for s, _ in accuracy_one] == [s for s, _ in accuracy_two]
    # step 10 counts the same tokens under equal weights; by step 20 the weights differ by float rounding,
    # which can flip the argmax of a near-tie token (one in ~200 here)
    assert accuracy_two[0][1] == pytest.approx(accuracy_one[0][1], abs=1e-9)
    assert accuracy_two[1][1] == pytest.approx(accuracy_one[1][1], abs=0.011)
    w1, w2 = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5
