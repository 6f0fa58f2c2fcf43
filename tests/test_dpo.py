"""Preference optimization (stages/training/dpo.py): options reach TRL, DPO/IPO losses match their formulas,
a tiny model learns the demo preferences, KTO trains on unpaired rows, and the LoRA reference is the
adapter-disabled base unless a separate copy is asked for."""

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel

from stages.data.preferences import write_split
from stages.runtime.devices import DeviceConfig
from stages.training import dpo
from conftest import tiny_preference_model

FAST = dict(micro_batch_size=8, logging_steps=1, lora_r=8, lora_alpha=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2 with the ChatML template and demo preference pairs (train 64, eval 64)."""
    return tiny_preference_model(tmp_path_factory.mktemp("dpo"), num_train=64, num_eval=64)


# ---------------------------------------------------------------- config -> TRL


@pytest.mark.parametrize("rl, trainer_name, expected", [
    ("dpo", "DPOTrainer", {"beta": 0.3, "loss_type": ["sigmoid"]}),
    ("ipo", "DPOTrainer", {"beta": 0.3, "loss_type": ["ipo"]}),
    ("kto", "KTOTrainer", {"beta": 0.3, "desirable_weight": 1.5, "undesirable_weight": 0.7}),
    ("orpo", "ORPOTrainer", {"beta": 0.25}),
    ("simpo", "CPOTrainer", {"beta": 0.3, "loss_type": "simpo", "simpo_gamma": 0.8, "cpo_alpha": 0.0}),
])
def test_trl_config_carries_options(tmp_path, rl, trainer_name, expected):
    cfg = dpo.PreferenceOptimizationConfig(
        rl=rl, rl_beta=0.3, orpo_alpha=0.25, simpo_gamma=0.8, cpo_alpha=0.0, kto_desirable_weight=1.5,
        kto_undesirable_weight=0.7, learning_rate=2e-4, max_steps=7, micro_batch_size=3,
        gradient_accumulation_steps=2, max_length=99, seed=5)
    trainer_class, config_class = dpo.trl_classes(rl)
    args = dpo.build_trl_config(cfg, tmp_path, devices=DeviceConfig(device="cpu"))
    assert trainer_class.__name__ == trainer_name and type(args) is config_class
    for key, value in expected.items():
        assert getattr(args, key) == value, key
    assert (args.learning_rate, args.max_steps, args.per_device_train_batch_size, args.gradient_accumulation_steps,
            args.max_length, args.seed) == (2e-4, 7, 3, 2, 99, 5)
    assert not args.bf16 and not args.fp16 and not args.gradient_checkpointing and args.use_cpu  # fp32 on CPU


def test_config_rejects_unknown_names():
    with pytest.raises(ValueError):
        dpo.PreferenceOptimizationConfig(rl="ppo")
    with pytest.raises(ValueError):
        dpo.PreferenceOptimizationConfig(beta=0.1)  # axolotl spells it rl_beta
    with pytest.raises(ValueError, match="rl: unknown 'ppo'.*dpo, ipo, kto, orpo, simpo"):
        dpo.trl_classes("ppo")


def test_rows_a_loss_cannot_use_are_named():
    prompt = [{"role": "user", "content": "q"}]
    unpaired = {"pair_id": "train-000003", "kind": "unpaired", "prompt": prompt,
                "completion": [{"role": "assistant", "content": "a"}], "label": True}
    with pytest.raises(ValueError, match="train-000003 \\(unpaired\\)"):
        dpo.to_trl_rows([unpaired], "dpo")
    pair = {"pair_id": "train-000000", "kind": "pair", "prompt": prompt,
            "chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}
    kto_rows = dpo.to_trl_rows([pair, unpaired], "kto")
    assert [(r["completion"][0]["content"], r["label"]) for r in kto_rows] == [("a", True), ("b", False), ("a", True)]


# ---------------------------------------------------------------- parity with the formulas


@pytest.mark.parametrize("rl", ["dpo", "ipo"])
def test_loss_matches_formula(tiny, tmp_path, rl):
    """TRL's loss on one batch equals the formula computed from our own policy/reference log-probs
    (policy perturbed away from the reference so the log-ratios are not zero)."""
    beta = 0.5
    cfg = dpo.PreferenceOptimizationConfig(rl=rl, rl_beta=beta, adapter="none", **FAST)
    model, ref_model = dpo.load_models(cfg, tiny / "model")
    assert ref_model is not None
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    rows = dpo.to_trl_rows(dpo.read_rows(tiny / "prefs" / "train.parquet")[:6], rl)
    trainer = dpo.build_trainer(cfg, model, ref_model, tokenizer, rows, tmp_path)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    with torch.no_grad():
        loss = float(trainer.compute_loss(trainer.model, batch))

    def seq_logps(m):  # plain forward, no TRL code: sum of completion-token log-probs per row
        logits = m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        return (lp * batch["completion_mask"][:, 1:]).sum(-1)

    with torch.no_grad():
        policy_c, policy_r = seq_logps(model).chunk(2)
        ref_c, ref_r = seq_logps(ref_model).chunk(2)
    # our preference_accuracy helper tokenizes exactly as TRL does
    ours = dpo.completion_logps(model, tokenizer, [(r["prompt"], r["chosen"]) for r in rows])
    assert torch.allclose(torch.tensor(ours), policy_c, atol=1e-4)
    delta_c, delta_r = policy_c - ref_c, policy_r - ref_r
    assert (delta_c - delta_r).abs().max() > 0.05  # a non-trivial check
    if rl == "dpo":
        expected = -F.logsigmoid(beta * (delta_c - delta_r)).mean()
    else:  # TRL's IPO divides each log-ratio by its completion length (as the IPO authors do)
        len_c, len_r = batch["completion_mask"].sum(-1).chunk(2)
        expected = ((delta_c / len_c - delta_r / len_r - 1 / (2 * beta)) ** 2).mean()
    assert loss == pytest.approx(float(expected), rel=1e-4, abs=1e-5)


# ---------------------------------------------------------------- learning


def test_dpo_raises_held_out_preference_accuracy(tiny, tmp_path):
    cfg = dpo.PreferenceOptimizationConfig(rl="dpo", learning_rate=5e-3, max_steps=8, **FAST)
    seen: list[tuple[dict, int]] = []
    summary = dpo.run(cfg, tiny / "model", tiny / "prefs", tmp_path, on_metrics=lambda m, s: seen.append((m, s)))
    assert summary["steps"] == 8 and summary["rows"] == 64 and summary["eval_pairs"] == 64
    assert summary["reference"] == "adapter_disabled"
    assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"] + 0.2, summary
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert key in summary["final_metrics"]
        assert all(f"preference/{key}" in m for m, s in seen if "preference/loss" in m)
    assert [s for m, s in seen if "preference/loss" in m] == list(range(1, 9))
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "adapter_model.safetensors"))
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    assert lora_b and all(torch.count_nonzero(w) > 0 for w in lora_b)  # LoRA B starts at zero
    assert (tmp_path / "adapter_config.json").exists() and not (tmp_path / "_trainer").exists()
    from transformers import AutoTokenizer

    from stages.runtime.policy import load_policy

    merged, _ = load_policy(tiny / "model", tmp_path, merge=True)  # as the export stage loads it
    eval_rows = dpo.read_rows(tiny / "prefs" / "eval.parquet")
    merged_accuracy = dpo.preference_accuracy(merged, AutoTokenizer.from_pretrained(tiny / "model"), eval_rows)
    assert merged_accuracy == pytest.approx(summary["eval_accuracy_after"], abs=2 / 64)


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])  # bf16: emulated on CPU
def test_eval_steps_measures_held_out_accuracy_between_and_trains_the_same(tiny, tmp_path, precision):
    """axolotl's eval_steps: preference accuracy every 3 steps (not at the last), logged at its step; the adapter
    is the same as without it, in bf16 too (the eval runs between steps, outside the trainer's autocast).
    With no held-out pairs it is an error naming it."""
    from safetensors.torch import load_file

    seen: list[tuple[dict, int]] = []
    devices = DeviceConfig(device="cpu", precision=precision)
    cfg = dict(rl="dpo", learning_rate=5e-3, max_steps=6, **FAST)
    every = dpo.run(dpo.PreferenceOptimizationConfig(eval_steps=3, **cfg), tiny / "model", tiny / "prefs",
                    tmp_path / "every", on_metrics=lambda m, s: seen.append((m, s)), devices=devices)
    plain = dpo.run(dpo.PreferenceOptimizationConfig(**cfg), tiny / "model", tiny / "prefs", tmp_path / "plain",
                    devices=devices)
    assert every["precision"] == precision
    assert [step for step, _ in every["eval_history"]] == [3] and "eval_history" not in plain
    assert [(s, m["preference/eval_accuracy"]) for m, s in seen if "preference/eval_accuracy" in m] == \
        [tuple(h) for h in every["eval_history"]]
    trained, again = (load_file(str(tmp_path / name / "adapter_model.safetensors")) for name in ("every", "plain"))
    assert all(torch.equal(trained[name], again[name]) for name in trained)
    assert every["eval_accuracy_after"] == plain["eval_accuracy_after"]
    with pytest.raises(ValueError, match=r"dpo.eval_steps: there are no held-out pairs to evaluate"):
        dpo.run(dpo.PreferenceOptimizationConfig(eval_steps=1, eval_split=None, **cfg), tiny / "model",
                tiny / "prefs", tmp_path / "none")


def unpaired_rows(pairs: list[dict]) -> list[dict]:
    """KTO rows from pairs: odd rows keep the chosen turn (desirable), even rows the rejected one."""
    return [{"pair_id": f"train-{i:06d}", "kind": "unpaired", "prompt": p["prompt"],
             "completion": p["chosen"] if i % 2 else p["rejected"], "label": bool(i % 2)}
            for i, p in enumerate(pairs)]


def test_kto_trains_on_unpaired_rows(tiny, tmp_path):
    unpaired = unpaired_rows(dpo.read_rows(tiny / "prefs" / "train.parquet")[:16])
    prefs = tmp_path / "prefs"
    prefs.mkdir()
    write_split(unpaired, prefs / "train.parquet")
    cfg = dpo.PreferenceOptimizationConfig(rl="kto", learning_rate=5e-3, max_steps=2, **FAST)
    summary = dpo.run(cfg, tiny / "model", prefs, tmp_path / "out")
    assert summary["steps"] == 2 and summary["train_rows"] == 16 and summary["eval_accuracy_before"] is None
    assert summary["final_metrics"]["loss"] > 0
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_kto_heldout_metrics_are_trls_implicit_rewards():
    rows = [{"label": True}, {"label": True}, {"label": False}, {"label": False}]
    got = dpo.kto_heldout(rows, [-5.0, -4.0, -3.0, -2.0], [-4.0, -4.5, -3.5, -1.0], beta=0.5)
    assert got["rewards_chosen"] == pytest.approx((0.5 - 0.25) / 2)
    assert got["rewards_rejected"] == pytest.approx((-0.25 + 0.5) / 2)
    assert got["rewards_margins"] == pytest.approx(0.125 - 0.125)
    assert got["label_accuracy"] == 0.5  # rows 0 (+, desirable) and 2 (-, undesirable) have the label's sign
    assert dpo.kto_heldout(rows[:2], [0.0, 0.0], [1.0, 1.0], 0.1)["rewards_margins"] is None  # one label only


def test_kto_reports_its_heldout_rewards(tiny, tmp_path):
    """A KTO run with an eval split of unpaired rows reports what TRL's KTOTrainer logs on eval (implicit rewards
    of desirable and undesirable rows, their margin) and the share of rows whose reward has the label's sign;
    the numbers are the trained adapter's log-prob changes from the starting policy, recomputed here."""
    from stages.runtime.policy import load_policy

    unpaired = unpaired_rows(dpo.read_rows(tiny / "prefs" / "train.parquet")[:32])
    prefs = tmp_path / "prefs"
    prefs.mkdir()
    write_split(unpaired[:24], prefs / "train.parquet")
    write_split(unpaired[24:], prefs / "eval.parquet")
    cfg = dpo.PreferenceOptimizationConfig(rl="kto", learning_rate=5e-3, max_steps=6, **FAST)
    kto = dpo.run(cfg, tiny / "model", prefs, tmp_path / "out")["eval_kto"]
    assert (kto["rows"], kto["desirable"], kto["undesirable"]) == (8, 4, 4)
    held_out = dpo.to_trl_rows(unpaired[24:], "kto")
    start, _ = load_policy(tiny / "model")
    end, tokenizer = load_policy(tiny / "model", tmp_path / "out")
    rewards = [cfg.rl_beta * (b - a) for a, b in zip(dpo.kto_rows_logps(start, tokenizer, held_out),
                                                      dpo.kto_rows_logps(end, tokenizer, held_out))]
    assert kto["rewards_chosen"] == pytest.approx(sum(rewards[1::2]) / 4, abs=1e-4)
    assert kto["rewards_rejected"] == pytest.approx(sum(rewards[0::2]) / 4, abs=1e-4)
    signs = [(r > 0) if row["label"] else (r < 0) for r, row in zip(rewards, held_out)]
    assert kto["label_accuracy"] == sum(signs) / 8
    assert kto["rewards_margins"] > 0, kto  # it learnt which turns are wanted (0.087 here, 5 of 8 rows signed right)


@pytest.mark.parametrize("rl", ["orpo", "simpo"])
def test_reference_free_losses_train(tiny, tmp_path, rl):
    """The experimental TRL trainers run on the same conversational rows and save an adapter."""
    cfg = dpo.PreferenceOptimizationConfig(rl=rl, learning_rate=5e-3, max_steps=2, eval_split=None, **FAST)
    summary = dpo.run(cfg, tiny / "model", tiny / "prefs", tmp_path)
    assert summary["steps"] == 2 and summary["reference"] == "none"
    assert "rewards/margins" in summary["final_metrics"]
    assert (tmp_path / "adapter_model.safetensors").exists()


def test_full_fine_tuning_saves_a_model_folder(tiny, tmp_path):
    cfg = dpo.PreferenceOptimizationConfig(rl="ipo", adapter="none", learning_rate=1e-3, max_steps=2,
                                           eval_split=None, **FAST)
    summary = dpo.run(cfg, tiny / "model", tiny / "prefs", tmp_path)
    assert summary["reference"] == "separate_copy" and summary["steps"] == 2
    from stages.runtime.policy import load_policy

    model, tokenizer = load_policy(tmp_path)
    assert tokenizer.chat_template and not (tmp_path / "adapter_config.json").exists()
    base, _ = load_policy(tiny / "model")
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), base.parameters()))


# ---------------------------------------------------------------- LoRA reference


@pytest.mark.parametrize("separate", [False, True])
def test_lora_reference_model(tiny, tmp_path, separate):
    cfg = dpo.PreferenceOptimizationConfig(rl="dpo", rl_adapter_ref_model=separate, lora_dropout=0.1, **FAST)
    model, ref_model = dpo.load_models(cfg, tiny / "model")
    assert (ref_model is not None) == separate
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    rows = dpo.to_trl_rows(dpo.read_rows(tiny / "prefs" / "train.parquet")[:4], "dpo")
    trainer = dpo.build_trainer(cfg, model, ref_model, tokenizer, rows, tmp_path)
    assert isinstance(trainer.model, PeftModel)
    lora_dropouts = [m.p for n, m in trainer.model.named_modules()
                     if ".lora_dropout." in f"{n}." and isinstance(m, torch.nn.Dropout)]
    assert lora_dropouts and set(lora_dropouts) == {0.1}  # restored after TRL's disable_dropout
    if separate:
        assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
        assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    else:
        assert trainer.ref_model is None  # TRL computes the reference with the adapter disabled
    assert dpo.reference_kind(cfg) == ("separate_copy" if separate else "adapter_disabled")
