"""axolotl's multi-GPU keys (fsdp, fsdp_config, fsdp_version, deepspeed), the adapter an axolotl config without
`adapter:` trains (the whole model, as in axolotl), and a misspelt key's did-you-mean (issue 45; flows/axolotl.py
`move_sharding_keys`, `full_fine_tuning_default`, `top_level_keys`). Each key lands on posttrain's setting of the same
meaning with a note `posttrain validate` prints, or is one line naming it."""

from __future__ import annotations

import json

import pytest

from flows.cli import main
from flows.config import ConfigError, PipelineConfig, load_config

GRPO = "base_model: {model}\nrl: grpo\nadapter: lora\n"


def load(tmp_path, text: str, config_json: dict | None = None) -> PipelineConfig:
    """`text` (GRPO under it) loaded from tmp_path, whose model folder's config.json is `config_json`."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(config_json or {}))
    path = tmp_path / "axolotl.yaml"
    path.write_text((GRPO + text).format(model=tmp_path / "model"))
    cfg = load_config(path)
    assert PipelineConfig.model_validate(cfg.run_config()) == cfg  # the translation saved with the run loads back
    return cfg


def notes(cfg: PipelineConfig) -> str:
    return "\n".join(cfg.translation_notes)


@pytest.mark.parametrize("text", [
    "fsdp:\n  - full_shard\n  - auto_wrap\n",  # FSDP1's list (TrainingArguments.fsdp)
    "fsdp_version: 1\nfsdp_config:\n  fsdp_offload_params: false\n  fsdp_cpu_ram_efficient_loading: false\n"
    "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_state_dict_type: FULL_STATE_DICT\n"
    "  fsdp_sharding_strategy: FULL_SHARD\n",  # docs/multi-gpu.qmd's FSDP1 config, less its CPU-RAM loading
    "fsdp_version: 2\nfsdp_config:\n  offload_params: false\n  auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
    "  state_dict_type: FULL_STATE_DICT\n  reshard_after_forward: true\n",  # its FSDP2 migration, the same
    "fsdp_config:\n  version: 2\n  use_orig_params: true\n  sync_module_states: true\n",
], ids=["fsdp_list", "fsdp1_config", "fsdp2_config", "version_in_config"])
def test_fsdp_is_train_strategy_fsdp_with_the_process_count_from_train(tmp_path, text):
    cfg = load(tmp_path, text)
    assert (cfg.train.strategy, cfg.train.num_processes) == ("fsdp", 1)
    said = notes(cfg)
    assert "-> train.strategy: fsdp. axolotl takes the number of processes from its launcher" in said
    assert "here train.num_processes sets it, 1 in this config: one process shards nothing" in said
    cfg = load(tmp_path, text + "train:\n  num_processes: 2\n")
    assert (cfg.train.strategy, cfg.train.num_processes) == ("fsdp", 2)
    assert "train.num_processes sets it, 2 in this config" in notes(cfg)


def test_fsdp_sub_keys_of_the_same_meaning_land_on_train(tmp_path):
    cfg = load(tmp_path, "fsdp_config:\n  activation_checkpointing: true\n")
    assert (cfg.train.strategy, cfg.train.gradient_checkpointing) == ("fsdp", True)
    cfg = load(tmp_path, "fsdp:\n  - no_shard\n")  # FSDP without sharding: DDP
    assert cfg.train.strategy == "ddp"
    assert "fsdp_version: 1 (axolotl's FSDP1): posttrain shards with FSDP2" in notes(
        load(tmp_path, "fsdp_version: 1\nfsdp:\n  - full_shard\n"))


def test_the_layer_class_to_wrap_is_checked_against_the_models_blocks(tmp_path):
    """posttrain wraps each block the model's class lists in _no_split_modules: the class axolotl names is checked
    against them where the model's config.json tells its class, a note says so where it cannot."""
    qwen2 = {"model_type": "qwen2"}
    text = "fsdp_config:\n  transformer_layer_cls_to_wrap: {cls}\n"
    cfg = load(tmp_path, text.replace("{cls}", "Qwen2DecoderLayer"), qwen2)
    assert "Qwen2DecoderLayer: the model's transformer block, which posttrain's FSDP2 wraps" in notes(cfg)
    with pytest.raises(ConfigError, match=r"fsdp_config.transformer_layer_cls_to_wrap: LlamaDecoderLayer: posttrain "
                                          r"wraps each block the model lists in _no_split_modules, Qwen2DecoderLayer"):
        load(tmp_path, text.replace("{cls}", "LlamaDecoderLayer"), qwen2)
    assert "so that these are the same was not checked" in notes(load(tmp_path, text.replace("{cls}", "X")))


@pytest.mark.parametrize("text, message", [
    ("fsdp:\n  - full_shard\n  - offload\n", r"fsdp: offload: CPU offload is not built here"),
    ("fsdp:\n  - shard_grad_op\n", r"fsdp: shard_grad_op: ZeRO-2"),
    ("fsdp:\n  - full_shard\n  - everything\n", r"fsdp: 'everything' is not one of full_shard"),
    ("fsdp_config:\n  offload_params: true\n", r"fsdp_config.offload_params: true: CPU offload is not built"),
    ("fsdp_config:\n  fsdp_offload_params: true\n", r"fsdp_config.offload_params: true: CPU offload"),  # FSDP1 name
    ("fsdp_config:\n  reshard_after_forward: false\n", r"fsdp_config.reshard_after_forward: false: it keeps each "
                                                        r"block's weights gathered"),
    ("fsdp_config:\n  cpu_ram_efficient_loading: true\n", r"fsdp_config.cpu_ram_efficient_loading: true: it loads "
                                                           r"the weights on rank 0 alone"),
    ("fsdp_config:\n  state_dict_type: SHARDED_STATE_DICT\n", r"fsdp_config.state_dict_type: SHARDED_STATE_DICT: "
                                                               r"posttrain gathers and writes whole"),
    ("fsdp_config:\n  auto_wrap_policy: SIZE_BASED_WRAP\n  min_num_params: 1000\n",
     r"fsdp_config.auto_wrap_policy: SIZE_BASED_WRAP"),
    ("fsdp_config:\n  mixed_precision_policy: bf16\n", r"fsdp_config.mixed_precision_policy: bf16: posttrain's FSDP2 "
                                                       r"casts nothing itself"),
    ("fsdp_config:\n  sharding_strategy: HYBRID_SHARD\n", r"fsdp_config.sharding_strategy: HYBRID_SHARD"),
    ("fsdp_config:\n  use_orig_params: false\n", r"fsdp_config.use_orig_params: false: FSDP1's flattened"),
    ("fsdp_config:\n  reshard_after_forwrd: true\n", r"fsdp_config.reshard_after_forwrd: not an FSDP setting axolotl "
                                                      r"has; did you mean 'reshard_after_forward'"),
    ("fsdp_version: 3\nfsdp:\n  - full_shard\n", r"fsdp_version: 3; axolotl's FSDP is version 1 or 2"),
    ("fsdp_version: 2\n", r"fsdp_version: axolotl turns FSDP on with fsdp_config \(or fsdp\)"),
    ("fsdp_config:\n  fsdp_backward_prefetch: BACKWARD_PRE\n", r"fsdp_config.backward_prefetch: BACKWARD_PRE: "
                                                               r"FSDP1's prefetch settings are gone in FSDP2"),
    ("fsdp:\n  - full_shard\ntrain:\n  strategy: ddp\n", r"fsdp \(axolotl's key\) and train.strategy are the same"),
    ("fsdp:\n  - full_shard\ndeepspeed: deepspeed_configs/zero3.json\n", r"fsdp, deepspeed: DeepSpeed and FSDP"),
    ("deepspeed: deepspeed_configs/zero2.json\n", r"deepspeed: deepspeed_configs/zero2.json \(axolotl's own file, as "
                                                  r"axolotl ships it\) is ZeRO stage 2, which shards the optimizer"),
    ("deepspeed: deepspeed_configs/zero1.json\n", r"is ZeRO stage 1, which shards the optimizer state but keeps"),
    ("deepspeed: deepspeed_configs/zero3_bf16_cpuoffload_params.json\n",
     r"zero_optimization.offload_param: CPU offload is not built here"),
    ("deepspeed: deepspeed_configs/zero3_bf16_cpuoffload_all.json\n", r"zero_optimization.offload_param: CPU offload"),
    ("deepspeed: my_zero.json\n", r"deepspeed: my_zero.json: no such file \(axolotl's own: deepspeed_configs/"),
    ("deepspeed: deepspeed_configs/zero3_bf16.json\nbf16: false\n",
     r"deepspeed's bf16.enabled: true \(axolotl's key\) and train.precision are the same setting"),
])
def test_what_posttrains_fsdp_does_not_honour_is_one_line_naming_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, text)


def test_sharding_is_refused_where_posttrain_trains_with_hf_trainer(tmp_path):
    (tmp_path / "model").mkdir()
    path = tmp_path / "dpo.yaml"
    path.write_text(f"base_model: {tmp_path / 'model'}\nrl: dpo\nfsdp:\n  - full_shard\n")
    with pytest.raises(ConfigError, match=r"fsdp: posttrain shards only the GRPO/EBFT optimize stage .* rl 'dpo'"):
        load_config(path)


def test_a_zero3_json_of_the_users_is_read(tmp_path):
    """A DeepSpeed file on this machine is read: ZeRO-3 with its bucket tuning (noted as having no counterpart);
    stage 0 is DDP; a batch size it fixes instead of axolotl's "auto" names the key to set; an unknown key is named."""
    zero3 = {"zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
                                   "stage3_gather_16bit_weights_on_model_save": True},
             "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
    (tmp_path / "ds.json").write_text(json.dumps(zero3))
    cfg = load(tmp_path, f"deepspeed: {tmp_path / 'ds.json'}\n")
    assert (cfg.train.strategy, cfg.train.precision) == ("fsdp", "auto")
    assert "its communication tuning (overlap_comm, reduce_bucket_size) has no counterpart under FSDP2" in notes(cfg)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    assert load(tmp_path, f"deepspeed: {tmp_path / 'ds.json'}\n").train.strategy == "ddp"
    for extra, message in (({"gradient_accumulation_steps": 8}, r"gradient_accumulation_steps: 8: axolotl fills it "
                                                                  r"from gradient_accumulation_steps"),
                           ({"optimizer": {"type": "AdamW"}}, r"optimizer: not a setting posttrain has a "
                                                               r"counterpart of")):
        (tmp_path / "ds.json").write_text(json.dumps({**zero3, **extra}))
        with pytest.raises(ConfigError, match=message):
            load(tmp_path, f"deepspeed: {tmp_path / 'ds.json'}\n")


# ---------------------------------------------------------------- no `adapter:`: the whole model, as in axolotl

@pytest.mark.parametrize("text, section, adapter", [
    ("base_model: {model}\nrl: grpo\n", "grpo", "none"),  # axolotl trains the whole model without `adapter:`
    ("base_model: {model}\nrl: ebft\n", "grpo", "none"),
    ("rl: grpo\nmicro_batch_size: 2\n", "grpo", "none"),  # axolotl's keys, no base_model
    ("base_model: {model}\nadapter: lora\n", "grpo", "lora"),
    ("base_model: {model}\nadapter:\n", "grpo", "none"),  # axolotl's null: full fine-tuning
    ("base_model: {model}\ngrpo:\n  adapter: lora\n", "grpo", "lora"),  # posttrain's own key wins
    ("rl: grpo\ngrpo:\n  rounds: 2\n", "grpo", "lora"),  # a posttrain config (rl is posttrain's key too): its default
    ("base_model: {model}\nrl: dpo\n", "dpo", "none"),  # the DPO family too
    ("base_model: {model}\nrl: kto\nmicro_batch_size: 2\n", "dpo", "none"),
    ("base_model: {model}\nrl: orpo\nadapter: lora\n", "dpo", "lora"),
    ("rl: dpo\ndpo:\n  rl_beta: 0.2\n", "dpo", "lora"),
])
def test_an_axolotl_config_without_adapter_trains_the_whole_model(tmp_path, capsys, text, section, adapter):
    (tmp_path / "model").mkdir()
    path = tmp_path / "config.yaml"
    path.write_text(text.format(model=tmp_path / "model"))
    cfg = load_config(path)
    assert getattr(cfg, section).adapter == adapter
    said = [n for n in cfg.translation_notes if n.startswith("adapter: not set: axolotl trains the whole model")]
    assert bool(said) == (adapter == "none" and "adapter" not in text)  # the note says what the default chose
    assert all(f"-> {section}.adapter: none" in n for n in said)
    assert PipelineConfig.model_validate(cfg.run_config()) == cfg


def test_qlora_is_still_refused_naming_the_key(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("rl: grpo\nadapter: qlora\n")
    with pytest.raises(ConfigError, match=r"adapter: 'qlora' is not built here"):
        load_config(path)


# ---------------------------------------------------------------- misspelt keys

@pytest.mark.parametrize("text, suggestion", [
    ("base_model: m\nmicro_batch_sise: 2\n", "did you mean 'micro_batch_size'?"),
    ("rl: grpo\ngradient_acumulation_steps: 4\n", "did you mean 'gradient_accumulation_steps'?"),
    ("base_model: m\nflash_atention: true\n", "did you mean 'flash_attention'?"),
    ("rl: grpo\nfsdp_confg:\n  offload_params: false\n", "did you mean 'fsdp_config'?"),
    ("rl: grpo\ngrpoo:\n  rounds: 2\n", "did you mean 'grpo'?"),  # posttrain's own sections as before
    ("rl: grpo\ntrl:\n  num_generation: 4\n", "did you mean trl.num_generations?"),
])
def test_a_misspelt_key_gets_the_closest_accepted_one_in_its_line(tmp_path, capsys, text, suggestion):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if suggestion in line]
    assert len(lines) == 1, suggestion


def test_a_null_trl_key_is_unset_as_in_axolotl(tmp_path):
    cfg = load(tmp_path, "trl:\n  loss_type: dr_grpo\n  max_completion_length:\n")
    assert (cfg.grpo.loss_type, cfg.rollout.max_completion_length) == ("dr_grpo", 16)
    assert "trl.max_completion_length: null (axolotl's key): unset, so rollout.max_completion_length keeps " \
           "posttrain's default, 16" in notes(cfg)
