"""axolotl's max_steps / num_epochs / sequence_len under GRPO (flows/axolotl.py `move_training_length`): posttrain takes
as many optimizer steps on as many prompts as TRL's GRPOTrainer given the same config, counted in a real GRPOTrainer
(tiny random model, constant reward) on one side and in the config posttrain makes, its prompt walk
(rollout.select_prompts) and its round plan (grpo.plan_round; for one setting a real round) on the other.
"""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import tiny_round, write_scored

from flows.config import ConfigError, PipelineConfig, load_config
from stages.rollout.rollout import select_prompts
from stages.runtime.devices import DeviceConfig
from stages.training import grpo

TRAIN_PROMPTS = 12


@pytest.fixture(scope="module")
def trl_model(tmp_path_factory):
    """(model folder, tokenizer) of a tiny random Qwen2, for TRL's GRPOTrainer."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from stages.data.base_model import train_tokenizer

    root = tmp_path_factory.mktemp("trl_length")
    tokenizer = train_tokenizer([f"what is {i} ?" for i in range(TRAIN_PROMPTS)] * 2, 64)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root, tokenizer


def trl_counts(trl_model, mbs, gas, generations, iterations=1, max_steps=-1, epochs=1.0, spg=None, gbs=None):
    """(optimizer steps, Counter of prompt -> times it was sampled) of TRL's GRPOTrainer.train() on TRAIN_PROMPTS
    prompts with these settings: the steps from the trainer's state, the prompts from what the reward sees."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    root, tokenizer = trl_model
    sampled = []

    def reward(prompts, completions, **kwargs):
        sampled.extend(prompts)  # one entry per completion
        return [0.0] * len(completions)

    args = GRPOConfig(output_dir=str(root / "out"), use_cpu=True, report_to=[], bf16=False,
                      gradient_checkpointing=False, per_device_train_batch_size=mbs, gradient_accumulation_steps=gas,
                      num_generations=generations, num_iterations=iterations, max_steps=max_steps,
                      num_train_epochs=epochs, steps_per_generation=spg, generation_batch_size=gbs,
                      max_completion_length=2, save_strategy="no", logging_steps=1000, seed=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32),
                          reward_funcs=reward, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_dict({"prompt": [f"what is {i} ?" for i in range(TRAIN_PROMPTS)]}))
    assert trainer.accelerator.num_processes == 1
    trainer.train()
    counts = Counter(sampled)
    assert all(n % generations == 0 for n in counts.values())  # whole groups
    return trainer.state.global_step, Counter({p: n // generations for p, n in counts.items()})


def axolotl_config(mbs, gas, generations, iterations=1, max_steps=None, epochs=None, spg=None, gbs=None):
    """The config posttrain makes of these axolotl keys (its train split: TRAIN_PROMPTS demo prompts)."""
    trl = {"num_generations": generations, "num_iterations": iterations,
           **({"steps_per_generation": spg} if spg else {}), **({"generation_batch_size": gbs} if gbs else {})}
    length = {**({"max_steps": max_steps} if max_steps else {}), **({"num_epochs": epochs} if epochs else {})}
    return PipelineConfig.model_validate({"rl": "grpo", "micro_batch_size": mbs, "gradient_accumulation_steps": gas,
                                          "trl": trl, **length, "demo_data": {"num_train": TRAIN_PROMPTS}})


def posttrain_counts(cfg: PipelineConfig) -> tuple[int, Counter]:
    """(optimizer steps, Counter of prompt -> times sampled) of the config's rounds: each round's steps as
    grpo.plan_round cuts its prompts_per_round x num_generations rows, its prompts as the rollout stage picks them."""
    per_round, generations = cfg.rollout.prompts_per_round, cfg.rollout.num_generations
    rows = [{"rollout_id": f"{p}-{g}", "prompt_id": str(p), "advantage": 1.0, "completion_token_ids": [1],
             "finish_reason": "stop"} for p in range(per_round) for g in range(generations)]
    steps = grpo.plan_round(cfg.grpo, rows, 0).steps_per_round
    prompts = [{"prompt_id": f"what is {i} ?"} for i in range(TRAIN_PROMPTS)]
    picked = Counter(row["prompt_id"] for r in range(cfg.grpo.rounds)
                     for row in select_prompts(prompts, r, per_round, cfg.rollout.seed))
    return cfg.grpo.rounds * steps, picked


SETTINGS = {  # micro_batch_size, gradient_accumulation_steps, num_generations, and the rest
    "max_steps": dict(mbs=2, gas=2, generations=2, max_steps=3),
    "num_iterations": dict(mbs=2, gas=2, generations=2, iterations=2, max_steps=4),
    "num_epochs": dict(mbs=4, gas=1, generations=2, epochs=2),
    "steps_per_generation": dict(mbs=2, gas=1, generations=2, max_steps=4, spg=2),
    "generation_batch_size": dict(mbs=2, gas=1, generations=4, max_steps=4, gbs=8),
    "epochs_spg_iterations": dict(mbs=2, gas=2, generations=4, iterations=2, epochs=1, spg=4),
    "spg_below_accumulation": dict(mbs=2, gas=2, generations=2, max_steps=2, spg=1),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_same_optimizer_steps_on_the_same_prompts_as_trl(trl_model, name):
    settings = SETTINGS[name]
    trl_steps, trl_prompts = trl_counts(trl_model, **{k: v for k, v in settings.items() if k != "max_steps"},
                                        max_steps=settings.get("max_steps", -1))
    steps, prompts = posttrain_counts(axolotl_config(**settings))
    assert steps == trl_steps
    assert sum(prompts.values()) == sum(trl_prompts.values())  # prompts sampled, and how often each
    assert sorted(prompts.values()) == sorted(trl_prompts.values())


def test_max_steps_inside_a_round_rounds_up_and_says_so(trl_model):
    """num_iterations 2: a round (one generation batch) is 2 steps. TRL's max_steps 5 samples 3 batches and stops
    after the first step of the third; posttrain trains 3 whole rounds: the same prompts, one step more."""
    trl_steps, trl_prompts = trl_counts(trl_model, 2, 2, 2, iterations=2, max_steps=5)
    cfg = axolotl_config(2, 2, 2, iterations=2, max_steps=5)
    steps, prompts = posttrain_counts(cfg)
    assert (trl_steps, steps, cfg.grpo.rounds) == (5, 6, 3)
    assert sorted(prompts.values()) == sorted(trl_prompts.values())
    assert any("5 steps are not a whole number of rounds: 3 rounds take 6 steps" in n for n in cfg.translation_notes)


def test_a_real_round_takes_the_steps_the_config_counts(tmp_path):
    """One round of the generation_batch_size setting above (2 prompts x 4 completions, micro_batch_size 2): the
    optimize stage takes the steps the config's rounds were counted with."""
    cfg = axolotl_config(**SETTINGS["generation_batch_size"])
    rows = tiny_round(tmp_path, num_prompts=4, prompts_per_round=cfg.rollout.prompts_per_round)
    assert len(rows) == cfg.rollout.prompts_per_round * cfg.rollout.num_generations
    write_scored(tmp_path / "scored.parquet", rows, [(1.0, -0.5, 0.8, -1.3)[r["group_index"]] for r in rows])
    (tmp_path / "out").mkdir()
    metrics = grpo.run(cfg.grpo, tmp_path / "model", None, tmp_path / "scored.parquet", 0, 1.0, 6, tmp_path / "out",
                       devices=DeviceConfig(device="cpu"))
    steps, _ = posttrain_counts(cfg)
    assert metrics["optimizer_steps"] + metrics["skipped_steps"] == steps // cfg.grpo.rounds == 4


def test_validate_shows_the_rounds_it_chose_and_why(tmp_path):
    path = tmp_path / "axolotl.yaml"
    path.write_text("rl: grpo\ntrl:\n  num_generations: 8\n  max_completion_length: 256\nsequence_len: 512\n"
                    "micro_batch_size: 2\ngradient_accumulation_steps: 4\nmax_steps: 200\nnum_epochs: 1\n")
    cfg = load_config(path)
    assert (cfg.grpo.rounds, cfg.rollout.prompts_per_round, cfg.rollout.max_prompt_length) == (200, 1, 256)
    from flows import preflight

    notes = preflight.inspect_config(cfg, path).notes
    assert any(n.startswith("max_steps: 200 (axolotl's key; num_epochs is not used: max_steps overrides it, as in "
                            "TRL) -> grpo.rounds: 200, rollout.prompts_per_round: 1") for n in notes), notes
    assert any(n.startswith("sequence_len: 512 (axolotl's key) -> rollout.max_prompt_length: 256") for n in notes)
    assert PipelineConfig.model_validate(cfg.run_config()) == cfg  # the saved config loads as it is


@pytest.mark.parametrize("text, message", [
    ("max_steps: 10\ngrpo:\n  rounds: 3\n", r"max_steps \(axolotl's key\) and grpo.rounds are the same setting"),
    ("num_epochs: 1\ngrpo:\n  rounds: 3\n", r"num_epochs \(axolotl's key\) and grpo.rounds are the same setting"),
    ("max_steps: 10\ntrl:\n  steps_per_generation: 4\nrollout:\n  prompts_per_round: 8\n",
     r"trl.steps_per_generation and rollout.prompts_per_round both size a round"),
    ("max_steps: 2.5\n", r"max_steps: 2.5; expected a whole number >= 1"),
    ("num_epochs: -1\n", r"num_epochs: -1; expected a number > 0"),
    ("max_steps: 10\nmicro_batch_size: 2\ngradient_accumulation_steps: 2\ntrl:\n  steps_per_generation: 3\n",
     r"trl.steps_per_generation: a generation batch of 3 micro-batches with gradient_accumulation_steps 2 ends "
     r"inside an optimizer step"),
    ("max_steps: 10\nmicro_batch_size: 2\ntrl:\n  generation_batch_size: 7\n",
     r"trl.generation_batch_size 7 is not a multiple of micro_batch_size 2"),
    ("max_steps: 10\nmicro_batch_size: 1\ngradient_accumulation_steps: 2\ntrl:\n  num_generations: 4\n",
     r"TRL's generation batch of micro_batch_size 1 x 2 micro-batches = 2 completions is not a whole number of "
     r"groups of num_generations 4"),
    ("max_steps: 10\ntrain:\n  num_processes: 2\n", r"max_steps: with train.num_processes 2 TRL's batches are per"),
    ("num_epochs: 1\ntransform:\n  datasets:\n    - path: org/some-hub-dataset\n  val_set_size: 0.1\n",
     r"num_epochs: transform.datasets org/some-hub-dataset is a hub dataset"),
    ("sequence_len: 64\nrollout:\n  max_prompt_length: 60\n",
     r"sequence_len 64 and rollout.max_prompt_length 60: with max_completion_length 16 that is 76 tokens"),
    ("rl: dpo\ntrl:\n  steps_per_generation: 2\n", r"trl.steps_per_generation: TRL's GRPO generation batch; rl is"),
], ids=["max_steps_and_rounds", "num_epochs_and_rounds", "spg_and_prompts_per_round", "max_steps_not_whole",
        "num_epochs_negative", "spg_inside_a_step", "gbs_not_a_multiple", "gbs_not_whole_groups", "processes",
        "num_epochs_hub", "sequence_len_and_max_prompt_length", "spg_under_dpo"])
def test_lengths_posttrain_cannot_honour_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "axolotl.yaml"
    path.write_text(("" if text.startswith("rl:") else "rl: grpo\n") + text)
    with pytest.raises(ConfigError, match=message) as error:
        load_config(path)
    assert len(str(error.value).splitlines()) == 1


def test_gradient_checkpointing_reaches_every_trained_policy(tmp_path):
    """train.gradient_checkpointing (axolotl's gradient_checkpointing) turns it on in the optimize stage's model,
    LoRA (on the frozen base under the adapter) and full fine-tuning alike: every GRPO/EBFT round trains there."""
    tiny_round(tmp_path, num_prompts=4, prompts_per_round=2)
    cfg = load_config_text(tmp_path, "rl: grpo\ngradient_checkpointing: true\n")
    assert cfg.train.gradient_checkpointing
    for adapter in ("lora", "none"):
        trainer = grpo.RoundTrainer(grpo.GRPOConfig(adapter=adapter), tmp_path / "model", None, 0, 1.0,
                                    DeviceConfig(device="cpu", gradient_checkpointing=cfg.train.gradient_checkpointing))
        assert trainer.model.is_gradient_checkpointing and trainer.plain_forward, adapter


def load_config_text(tmp_path, text: str) -> PipelineConfig:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return load_config(path)


def test_sequence_len_equal_to_the_completion_length_cuts_nothing_as_in_axolotl(tmp_path):
    """axolotl's own GRPO example sets sequence_len = max_completion_length: no room to bound a prompt by, and
    axolotl passes no length to TRL's GRPO, so it loads, cuts no prompt, and the note says so."""
    cfg = load_config_text(tmp_path, "rl: grpo\nsequence_len: 16\ntrl:\n  max_completion_length: 16\n")
    assert cfg.rollout.max_prompt_length is None
    assert any("sequence_len: 16 (axolotl's key) is not above max_completion_length 16" in n and "cuts nothing" in n
               for n in cfg.translation_notes)


def test_under_strided_ebft_a_round_is_one_of_axolotls_steps_and_takes_one(tmp_path):
    """ebft.mode strided (axolotl's strided trainer: micro_batch_size documents per micro-batch, each sampled at
    every anchor): max_steps is rounds of micro_batch_size x gradient_accumulation_steps documents, and a real round
    of them (prompt + completion rows, documents cut at sequence_len) takes one optimizer step; num_epochs passes over
    the documents; without sequence_len, or with TRL's generation batch keys, a one-line error."""
    import json
    import random

    from conftest import tiny_model

    from stages.data import transform
    from stages.rollout.engines import Policy
    from stages.training import ebft, ebft_strided

    rng = random.Random(0)
    tiny_model(tmp_path, [" ".join(str(rng.randrange(10)) for _ in range(24)) for _ in range(100)])
    rows = [{"input": "1 2 3", "output": " ".join(str(rng.randrange(10)) for _ in range(8 + 3 * i))} for i in range(5)]
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    strided = ("rl: ebft\nebft:\n  mode: strided\n  stride: 4\n  context_length: 4\n  generate_max_len: 4\n"
               f"  n_samples_per_prompt: 2\ndatasets:\n  - path: {tmp_path / 'docs.jsonl'}\n"
               "    type: ebft_strided_structured.transform\n"
               "micro_batch_size: 1\ngradient_accumulation_steps: 2\n")
    cfg = load_config_text(tmp_path, strided + "sequence_len: 24\nmax_steps: 3\n")
    assert (cfg.grpo.rounds, cfg.rollout.prompts_per_round, cfg.ebft.max_document_tokens) == (3, 2, 24)
    assert (cfg.grpo.micro_batch_size, cfg.grpo.gradient_accumulation_steps) == (2, 2 * 5)  # 5 anchors at most
    assert load_config_text(tmp_path, strided + "sequence_len: 24\nnum_epochs: 2\n").grpo.rounds == 6  # 5 docs / 2
    for text, message in ((strided + "max_steps: 3\n", r"max_steps: under ebft.mode strided .* set sequence_len"),
                          (strided + "sequence_len: 24\nmax_steps: 3\ntrl:\n  steps_per_generation: 2\n",
                           r"trl.steps_per_generation: TRL's generation batch; ebft.mode strided has none")):
        with pytest.raises(ConfigError, match=message):
            load_config_text(tmp_path, text)

    (tmp_path / "prompts").mkdir()
    transform.run(cfg.transform, None, tmp_path / "prompts")
    picked = ebft_strided.rollout(cfg.ebft, cfg.rollout.model_copy(update={"seed": 1}), Policy(tmp_path / "model"),
                                  tmp_path / "prompts" / "train.parquet", 0, tmp_path)
    assert picked["documents"] == 2 and picked["rows"] > cfg.grpo.micro_batch_size * 2
    ebft.run(cfg.ebft, tmp_path / "rollouts.parquet", tmp_path / "model", cfg.rollout.num_generations, "group",
             tmp_path)
    (tmp_path / "out").mkdir()
    metrics = grpo.run(cfg.grpo, tmp_path / "model", None, tmp_path / "scored.parquet", 0, 1.0, 4, tmp_path / "out",
                       devices=DeviceConfig(device="cpu"))
    assert metrics["optimizer_steps"] + metrics["skipped_steps"] == 1
