"""Every GRPO and EBFT YAML block of axolotl's GRPO guide (docs/grpo.qmd), vLLM serving guide (docs/vllm_serving.qmd)
and RLHF guide (docs/rlhf.qmd), with only the model, dataset paths and sizes changed, on a GRPO config of a new
user's: each validates into what it means here, each key asserted where it lands, or is one line naming the key
that posttrain does not build and why (issue 45 item 5). tests/test_configs.py has the rlhf guide's first GRPO
config and the reward-modelling and ebft guides' examples; tests/test_axolotl_async_keys.py the async keys one by
one; tests/test_axolotl_translation.py fsdp / deepspeed, the adapter default and misspelt keys."""

from __future__ import annotations

import re

import pytest

from flows.cli import main
from flows.config import ConfigError, load_config

BASE = """base_model: {model}
rl: grpo
datasets:
  - path: {rows}
    type: rewards.prompt_transform
    split: train
adapter: lora
micro_batch_size: 2
gradient_accumulation_steps: 4
max_steps: 20
gradient_checkpointing: true
"""
"""A new user's GRPO config (checkpointing on, as the guides' Quick Start); each block goes under it (its `trl:`
section where the block has none)."""

REWARDS = '''
def accuracy_reward(completions, answer, **kwargs):
    return [1.0 if str(a) in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


def format_reward(completions, **kwargs):
    return [1.0 if "<answer>" in c[0]["content"] else 0.0 for c in completions]


def length_penalty(completions, **kwargs):
    return [-0.5 if len(c[0]["content"]) < 50 else 0.0 for c in completions]


def prompt_transform(cfg, *args, **kwargs):
    def transform_fn(example, tokenizer=None):
        label = example["answer"].split("####")[-1].strip().replace(",", "")
        return {"prompt": [{"role": "user", "content": example["question"]}], "answer": label}
    return transform_fn, {"remove_columns": ["question"]}


oai_gsm8k_transform = prompt_transform


def rand_reward_func(completions, **kwargs):
    import random
    return [random.uniform(0, 1) for _ in completions]


def correctness_reward(completions, answer, **kwargs):
    return [2.0 if str(a) in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]
'''
"""docs/grpo.qmd's and docs/rlhf.qmd's reward module (their functions and transform, shortened)."""

MATH_ENV = '''
def math_solver_rollout(model, processing_class, prompts, generation_config=None):
    return ["FINAL ANSWER: 4" for _ in prompts]


def math_reward(prompts, completions, answers, **kwargs):
    return [1.0 for _ in completions]


def math_transform(cfg, *args, **kwargs):
    def transform_fn(example, processing_class=None):
        return {"prompt": [{"role": "user", "content": example["question"]}], "answer": str(example["answer"])}
    return transform_fn, {"remove_columns": ["question"]}
'''
"""docs/rlhf.qmd's OpenEnv module math_env.py (its functions' signatures, bodies shortened)."""

EBFT_OPENCODE = '''
def transform(cfg, **kwargs):
    def transform_fn(example, tokenizer=None):
        return {"prompt": [{"role": "user", "content": example["question"]}], "ground_truth": example["answer"]}
    return transform_fn, {"remove_columns": ["question"]}
'''
"""axolotl's ebft_opencode.transform (prompt + ground_truth) for gsm8k-style rows: a module of the user's here."""

QUICK_START = """base_model: {model}

rl: grpo
chat_template: tokenizer_default

vllm:
  host: 0.0.0.0
  port: 8000
  gpu_memory_utilization: 0.85
  dtype: auto
  max_model_len: 2048

adapter: lora
lora_r: 32
lora_alpha: 64
lora_target_linear: true

trl:
  use_vllm: true
  use_data_producer: true
  vllm_server_host: 0.0.0.0
  vllm_server_port: 8000
  vllm_server_timeout: 300
  vllm_lora_sync: true
  num_generations: 8
  max_completion_length: 512
  temperature: 0.7
  reward_funcs:
    - rewards.accuracy_reward
    - rewards.format_reward
  reward_weights:
    - 1.0
    - 0.5

datasets:
  - path: {rows}
    type: rewards.prompt_transform
    split: train

skip_prepare_dataset: true
val_set_size: 0.0
sequence_len: 512
micro_batch_size: 2
gradient_accumulation_steps: 4
max_steps: 200
learning_rate: 5.0e-6
optimizer: adamw_torch_fused
lr_scheduler: cosine
warmup_steps: 10

bf16: true
attn_implementation: {attention}
gradient_checkpointing: true

special_tokens:
  pad_token: "<|endoftext|>"

output_dir: ./grpo-output
logging_steps: 1
"""
"""docs/grpo.qmd's Quick Start config (model Qwen2.5-1.5B-Instruct and gsm8k replaced by local ones)."""

VALID_BLOCKS = {
    "multiple rewards": ("trl:\n  reward_funcs:\n    - rewards.accuracy_reward\n    - rewards.format_reward\n"
                         "    - rewards.length_penalty\n  reward_weights:\n    - 1.0    # accuracy is most important\n"
                         "    - 0.5    # format compliance\n    - 0.1    # mild length preference\n",
                         {"score.reward_funcs": ["rewards.accuracy_reward", "rewards.format_reward",
                                                 "rewards.length_penalty"], "score.reward_weights": [1.0, 0.5, 0.1]}),
    "gdpo": ("trl:\n  multi_objective_aggregation: normalize_then_sum\n",
             {"score.multi_objective_aggregation": "normalize_then_sum"}),
    "reward workers": ("trl:\n  reward_num_workers: 4\n", {"score.reward_num_workers": 4}),
    # a round is the 2 one-step generation batches between vllm_sync_interval 2's weight pushes: 10 of max_steps 20
    "async prefetch": ("trl:\n  use_vllm: true\n  use_data_producer: true\n  async_prefetch: true\n  prefetch_depth: 1\n"
                       "  vllm_sync_interval: 2\n",
                       {"rollout.engine": "vllm", "rollout.async_prefetch": True, "rollout.prefetch_depth": 1,
                        "rollout.prompts_per_round": 2, "grpo.rounds": 10}),
    "zero-advantage skipping": ("trl:\n  skip_zero_advantage_batches: true   # default\n",
                                {"grpo.skip_zero_advantage_batches": True}),
    "replay buffer": ("trl:\n  replay_buffer_size: 100\n  replay_recompute_logps: true\n",
                      {"grpo.replay_buffer_size": 100, "grpo.replay_recompute_logps": True}),
    "deferred re-rolling": ("trl:\n  reroll_start_fraction: 0.5   # Start re-rolling after 50% of training\n"
                            "  reroll_max_groups: 1          # Max groups to replace per batch\n",
                            {"grpo.reroll_start_fraction": 0.5, "grpo.reroll_max_groups": 1}),
    "importance sampling": ("trl:\n  use_vllm: true\n  vllm_importance_sampling_correction: true\n"
                            "  importance_sampling_level: token\n  off_policy_mask_threshold: 0.5\n",
                            {"rollout.engine": "vllm", "grpo.vllm_importance_sampling_correction": True,
                             "grpo.importance_sampling_level": "token", "grpo.off_policy_mask_threshold": 0.5}),
    # PyTorch FSDP2 on train.num_processes ranks, each transformer block wrapped (the model's config.json has no
    # model_type here: a note says the class was not compared); use_reentrant: false is what posttrain runs
    "fsdp": ("fsdp:\n  - full_shard\n  - auto_wrap\nfsdp_config:\n  fsdp_transformer_layer_cls_to_wrap: "
             "Qwen2DecoderLayer\ngradient_checkpointing_kwargs:\n  use_reentrant: false\n",
             {"train.strategy": "fsdp", "train.num_processes": 1}),
    # docs/vllm_serving.qmd (its importance-sampling block is grpo.qmd's, above)
    "vllm_serving lora sync": ("adapter: lora\nlora_r: 32\nlora_alpha: 64\nlora_target_linear: true\n\ntrl:\n"
                               "  use_vllm: true\n  vllm_lora_sync: true    # Enables LoRA sync mode\n"
                               "  vllm_sync_interval: 5   # Sync every 5 training steps\n",
                               {"grpo.adapter": "lora", "grpo.lora_r": 32, "grpo.lora_alpha": 64,
                                "rollout.vllm.lora_sync": "adapter", "rollout.prompts_per_round": 5,
                                "grpo.rounds": 4}),
    "vllm_serving sync interval": ("trl:\n  use_vllm: true\n  vllm_sync_interval: 5   # Sync every 5 optimizer "
                                   "steps\n", {"rollout.engine": "vllm", "rollout.prompts_per_round": 5,
                                               "grpo.rounds": 4}),
    # docs/rlhf.qmd (its async, importance-sampling, replay, re-rolling, zero-advantage and reward-worker blocks are
    # grpo.qmd's, above)
    "rlhf dr_grpo": ("trl:\n  loss_type: dr_grpo\n  # Normalizes loss based on max completion length (default: "
                     "256)\n  max_completion_length:\n",
                     {"grpo.loss_type": "dr_grpo", "rollout.max_completion_length": 16}),  # null: posttrain's default
    "rlhf lora sync": ("adapter: lora\nlora_r: 32\nlora_alpha: 64\nlora_target_linear: true\n\ntrl:\n"
                       "  use_vllm: true\n  vllm_lora_sync: true         # Enable native LoRA sync\n",
                       {"grpo.adapter": "lora", "grpo.lora_r": 32, "rollout.vllm.lora_sync": "adapter"}),
    # ZeRO-3 is FSDP2's full shard here (tests/test_axolotl_translation.py); use_reentrant: true is axolotl's
    # workaround for DeepSpeed's CheckpointError, honoured as torch's reentrant checkpointing
    "deepspeed": ("deepspeed: deepspeed_configs/zero3_bf16.json\ngradient_checkpointing_kwargs:\n"
                  "  use_reentrant: true   # Required -- non-reentrant causes CheckpointError with ZeRO-3\n",
                  {"train.strategy": "fsdp", "train.precision": "bf16", "train.gradient_checkpointing": True,
                   "train.gradient_checkpointing_kwargs": {"use_reentrant": True}}),
    "rlhf deepspeed": ("deepspeed: deepspeed_configs/zero3_bf16.json\ngradient_checkpointing_kwargs:\n"
                       "  use_reentrant: true   # Required for ZeRO-3\n",
                       {"train.strategy": "fsdp", "train.gradient_checkpointing_kwargs": {"use_reentrant": True}}),
    "rlhf aggregation": ("rl: grpo\ntrl:\n    multi_objective_aggregation: normalize_then_sum  # GDPO behavior\n"
                         "    # or: sum_then_normalize  # Default GRPO behavior\n",
                         {"rl": "grpo", "score.multi_objective_aggregation": "normalize_then_sum"}),
}
"""The guides' blocks that load, and where each of their keys lands (`use_vllm: true` added where a block needs vLLM
and the guide's config has it). BASE has no `use_vllm`: rollout.engine transformers unless a block says so."""

REFUSED_BLOCKS = {
    "fp8": ("fp8: true\ntorch_compile: true\n", "fp8: FP8 training"),
    "rlhf sequence parallelism": ("rl: gdpo\ncontext_parallel_size: 2\n",
                                  "context_parallel_size: 2 is not honoured here (sequence parallelism"),
}
"""The guides' blocks posttrain does not build, and the start of the one line that says so. grpo.qmd's "reward model
from the hub" block is tests/test_reward_model_hub.py's (it needs the model in a hub cache), its "streaming partial
batch" block tests/test_axolotl_streaming.py's (under the async section's async_prefetch), its SCOPE-RL block
tests/test_scope_rl.py's."""


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A new user's folder: the reward module, 40 gsm8k-style rows and a local model folder."""
    import json

    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "math_env.py").write_text(MATH_ENV)
    (tmp_path / "ebft_opencode.py").write_text(EBFT_OPENCODE)
    rows = [{"question": f"What is {a}+{b}?", "answer": f"{a}+{b} = {a + b}\n#### {a + b}"}
            for a in range(8) for b in range(5)]
    (tmp_path / "gsm8k.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))

    def config(text: str):
        path = tmp_path / "config.yaml"
        path.write_text(text.format(model=tmp_path / "model", rows=tmp_path / "gsm8k.jsonl", attention="sdpa"))
        return path

    return config


def with_block(block: str) -> str:
    """BASE with `block` under it, less BASE's lines of the top-level keys the block sets: a block's `trl:` keys join
    the config's accuracy reward."""
    if "trl:" in block and "reward_funcs" not in block:
        indent = re.search(r"^trl:\n( +)", block, re.M).group(1)
        block += f"{indent}reward_funcs: [rewards.accuracy_reward]\n"
    own = {line.split(":")[0] for line in block.splitlines() if line[:1].isalpha()}
    return "".join(line for line in BASE.splitlines(keepends=True) if line.split(":")[0] not in own) + block


def at(cfg, dotted: str):
    """The value of `dotted` (grpo.lora_r) in the loaded config."""
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("name", list(VALID_BLOCKS))
def test_a_guide_block_loads_each_key_where_it_means_the_same(user, name):
    block, lands = VALID_BLOCKS[name]
    cfg = load_config(user(with_block(block)))
    assert cfg.rl == "grpo" and not cfg.sft.enabled and not cfg.runs_eval
    assert {key: at(cfg, key) for key in lands} == lands
    if "adapter:" not in block:  # BASE's LoRA, as every GRPO config in the guides but their vLLM-server ones
        assert cfg.grpo.adapter == "lora"


@pytest.mark.parametrize("name", list(REFUSED_BLOCKS))
def test_a_guide_block_not_built_here_is_one_line_naming_its_key(user, name, capsys):
    """`posttrain validate` (what `posttrain run` checks first): exit 2 and the line naming the key."""
    block, message = REFUSED_BLOCKS[name]
    assert main(["validate", str(user(with_block(block)))]) == 2
    shown = [line for line in capsys.readouterr().err.splitlines() if message in line]
    assert len(shown) == 1, message


def test_the_quick_start_config_loads_with_what_each_key_means(user):
    """The guide's Quick Start as written (two terminals: `vllm-serve` and `train`), but for flash-attn, which
    needs a CUDA machine: every key lands where it means the same here."""
    cfg = load_config(user(QUICK_START))
    assert (cfg.rollout.num_generations, cfg.rollout.max_completion_length, cfg.rollout.temperature) == (8, 512, 0.7)
    assert cfg.score.reward_funcs == ["rewards.accuracy_reward", "rewards.format_reward"]
    assert cfg.score.reward_weights == [1.0, 0.5]
    # max_steps 200 in TRL's terms: micro_batch_size 2 x gradient_accumulation_steps 4 = 8 completions a step,
    # 1 prompt x 8 generations: a round is one step; the cosine schedule runs over all of them, as TRL's does
    assert (cfg.grpo.rounds, cfg.rollout.prompts_per_round) == (200, 1)
    assert (cfg.grpo.lr_scheduler_type, cfg.grpo.lr_schedule_rounds, cfg.grpo.warmup_steps) == ("cosine", 200, 10)
    assert (cfg.grpo.optim, cfg.grpo.learning_rate, cfg.grpo.adapter) == ("adamw", 5.0e-6, "lora")
    assert (cfg.train.precision, cfg.train.attn_implementation, cfg.train.gradient_checkpointing) == (
        "bf16", "sdpa", True)
    assert cfg.rollout.max_prompt_length is None  # sequence_len 512 = max_completion_length: cuts nothing
    assert not cfg.runs_eval and not cfg.sft.enabled  # val_set_size 0.0: no eval split; your rows: no SFT
    # the two terminals: `posttrain vllm-serve` serves on the vllm: section's host and port, the run waits for it
    assert (cfg.rollout.engine, cfg.rollout.vllm.server_urls, cfg.rollout.vllm.server_wait_s) == (
        "vllm_server", ["http://127.0.0.1:8000"], 300)
    notes = " ".join(cfg.translation_notes)
    assert "logging_steps: 1 (axolotl's key)" in notes and "grpo.lr_schedule_rounds: 200" in notes


def test_flash_attention_2_is_refused_naming_the_key_on_a_machine_without_it(user):
    """attn_implementation: flash_attention_2 needs the flash-attn package (CUDA): here, one line naming it."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    path = user(QUICK_START)
    path.write_text(path.read_text().replace("attn_implementation: sdpa", "attn_implementation: flash_attention_2"))
    with pytest.raises(ConfigError, match=r"train.attn_implementation: flash_attention_2 needs the flash-attn package"):
        load_config(path)


def test_use_vllm_without_a_mode_runs_vllm_in_process_and_says_how_to_use_a_server(user):
    """TRL's vllm_mode defaults to server; posttrain's use_vllm alone is vLLM in the run's process, and the
    note says so and how to get the server instead."""
    cfg = load_config(user(with_block(VALID_BLOCKS["importance sampling"][0])))
    assert cfg.rollout.engine == "vllm"
    assert any("trl.use_vllm: true (axolotl's key) without trl.vllm_mode -> rollout.engine: vllm" in note
               and "trl.vllm_mode: server" in note for note in cfg.translation_notes)
    served = load_config(user(with_block(VALID_BLOCKS["importance sampling"][0].replace(
        "use_vllm: true\n", "use_vllm: true\n  vllm_mode: server\n"))))
    assert served.rollout.engine == "vllm_server"
    assert not any("without trl.vllm_mode" in note for note in served.translation_notes)


# ---------------------------------------------------------------- docs/vllm_serving.qmd and docs/rlhf.qmd's configs

SERVER = """base_model: {model}

vllm:
  host: 0.0.0.0
  port: 8000
  gpu_memory_utilization: 0.85
  dtype: auto
  max_model_len: 4096

rl: grpo
trl:
  use_vllm: true
  vllm_server_host: 0.0.0.0
  vllm_server_port: 8000
  vllm_server_timeout: 300
"""
"""docs/vllm_serving.qmd's Minimal Server Config, as written (but for the model)."""

GDPO = """base_model: {model}

vllm:
    host: 0.0.0.0
    port: 8000
    tensor_parallel_size: 2
    gpu_memory_utilization: 0.85

rl: gdpo

trl:
    beta: 0.001
    max_completion_length: 256
    use_vllm: true
    num_generations: 4
    reward_funcs:
        - rewards.format_reward
        - rewards.correctness_reward
    reward_weights: [1.0, 2.0]

datasets:
    - path: {rows}
      type: rewards.oai_gsm8k_transform
"""
"""docs/rlhf.qmd's GDPO config (openai/gsm8k, name: main -> the local rows, which have no dataset config)."""

EBFT_STRUCTURED = """base_model: {model}

rl: ebft

ebft:
  feature_layers: [0.25, 0.5, 0.75]    # Extract features at 25%, 50%, 75% depth
  embed_method: last_token
  use_whitening: false
  alignment_coef: 1.0                    # Cosine similarity reward weight
  diversity_coef: 1.0                    # Pairwise dot product penalty
  ce_coef: 0.0                          # Cross-entropy on GT tokens (0 = off)

trl:
  num_generations: 4
  max_completion_length: 256
  temperature: 0.7
  use_vllm: true
  vllm_server_host: 0.0.0.0
  vllm_server_port: 8000
  vllm_lora_sync: true                   # LoRA adapter sync (recommended)
  vllm_sync_interval: 3
  use_data_producer: true
  async_prefetch: true                   # Set false for sync mode
  scale_rewards: true
  loss_type: grpo
  epsilon: 0.2

vllm:
  gpu_memory_utilization: 0.5
  max_model_len: 2048

datasets:
  - path: {rows}
    type: ebft_opencode.transform
    split: train[:500]

adapter: lora
lora_r: 16
lora_alpha: 32
lora_target_linear: true
"""
"""docs/rlhf.qmd's EBFT structured-mode config (Qwen3-4B and nvidia/OpenCodeInstruct -> local ones; its transform,
axolotl's ebft_opencode, a module beside the config here)."""

EBFT_STRIDED = """base_model: {model}

rl: ebft

ebft:
  mode: strided
  stride: 8
  context_length: 8
  generate_max_len: 8
  n_samples_per_prompt: 4
  temperature: 0.6
  feature_layers: [0.25, 0.5, 0.75]
  embed_method: last_token
  use_whitening: true
  alignment_coef: 1.0
  diversity_coef: 1.0
  rl_coef: 1.0
  ce_coef: 0.03
  advantage_estimator: rloo

datasets:
  - path: {rows}
    type: ebft_strided_structured.transform
    split: train[:1%]

attn_implementation: flex_attention   # Strided mode uses flex_attention
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: true    # Required for flex_attention
"""
"""docs/rlhf.qmd's EBFT strided-mode config, its dataset type (axolotl's ebft_strided_structured.transform: prompt and
completion as one document, blocks in the completion) as written."""

EBFT_STRIDED_STRUCTURED = """base_model: {model}
rl: ebft

ebft:
  mode: strided
  stride: 8                    # Tokens between anchor points
  context_length: 8            # Context window per block
  generate_max_len: 8          # Tokens to generate per block
  n_samples_per_prompt: 4      # Independent rollouts per document
  temperature: 0.6
  feature_layers: [0.25, 0.5, 0.75]
  embed_method: last_token
  use_whitening: true
  alignment_coef: 1.0
  diversity_coef: 1.0
  rl_coef: 1.0                # RL policy gradient loss weight
  ce_coef: 0.03               # Cross-entropy loss on GT tokens
  advantage_estimator: rloo    # rloo, group_norm, or reinforce
  min_completion_prefix: 8     # Skip anchors in prompt region

datasets:
  - path: {rows}
    type: ebft_strided_structured.transform
    split: train[:50%]

sequence_len: 2048
micro_batch_size: 1
gradient_accumulation_steps: 2

adapter: lora
lora_r: 16
lora_alpha: 32
lora_target_linear: true

bf16: auto
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: true          # Required with flex_attention
"""
"""docs/ebft.qmd's Strided Mode Configuration (its attn_implementation: flex_attention left out: CUDA's; the line that
names it is test_the_ebft_strided_config_needs_flex_attention_on_cuda's)."""

NEMO_GYM = {
    "single-turn": "base_model: {model}\n\nrl: grpo\nchat_template: tokenizer_default\n\ntrl:\n  use_vllm: false\n"
                   "  num_generations: 4\n  max_completion_length: 128\n  temperature: 0.9\n  reward_funcs:\n"
                   "    - axolotl.integrations.nemo_gym.rewards.reward_nemo_gym_verify\n\nplugins:\n"
                   "  - axolotl.integrations.nemo_gym.NemoGymPlugin\n\nnemo_gym_enabled: true\nnemo_gym_dir: ~/Gym\n"
                   "nemo_gym_auto_start: false\nnemo_gym_head_port: 11000\nnemo_gym_datasets:\n"
                   "  - path: resources_servers/reasoning_gym/data/train_basic_arithmetic.jsonl\n"
                   "    server_name: reasoning_gym\n\ndatasets:\n  - path: {rows}\n    type: chat_template\n"
                   "    field_messages: responses_create_params.input\n    message_field_content: content\n"
                   "    message_field_role: role\n",
    "multi-turn": "base_model: {model}\n\nrl: grpo\nchat_template: tokenizer_default\n\nadapter: lora\nlora_r: 16\n"
                  "lora_alpha: 32\nlora_target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                  "down_proj]\n\ntrl:\n  use_vllm: true\n  vllm_mode: server\n  vllm_server_host: localhost\n"
                  "  vllm_server_port: 8000\n  vllm_lora_sync: true\n  vllm_sync_interval: 5\n"
                  "  use_data_producer: true\n  async_prefetch: true\n  num_generations: 4\n"
                  "  max_completion_length: 512\n  temperature: 0.8\n  reward_funcs:\n"
                  "    - axolotl.integrations.nemo_gym.rewards.reward_env\n\nplugins:\n"
                  "  - axolotl.integrations.nemo_gym.NemoGymPlugin\n\nnemo_gym_enabled: true\n"
                  "nemo_gym_auto_start: false\nnemo_gym_head_port: 11000\nnemo_gym_multi_turn: true\n"
                  "nemo_gym_verify_timeout: 120\nnemo_gym_datasets:\n"
                  "  - path: resources_servers/example_single_tool_call/data/weather_tool_calling.jsonl\n"
                  "    server_name: example_single_tool_call\n\ndatasets:\n  - path: {rows}\n"
                  "    type: chat_template\n    field_messages: responses_create_params.input\n"
                  "    message_field_content: content\n    message_field_role: role\n\nvllm:\n"
                  "  gpu_memory_utilization: 0.85\n  max_model_len: 2048\n",
}
"""docs/rlhf.qmd's NeMo Gym configs: the single-turn one loads (flows/nemo_gym.py; tests/test_nemo_gym.py runs it
beside NeMo Gym's own servers), the multi-turn one drives NeMo Gym's agent servers, which posttrain does not."""


def test_the_minimal_server_config_generates_on_the_server_it_names(user):
    """docs/vllm_serving.qmd's Minimal Server Config: `posttrain vllm-serve` listens on vllm.host:port with the vllm:
    section's settings, the run connects to trl.vllm_server_host:port and waits vllm_server_timeout for it; no
    `adapter:` key is axolotl's full fine-tuning (the server takes the round's weights in place)."""
    cfg = load_config(user(SERVER))
    assert (cfg.rollout.engine, cfg.rollout.vllm.server_urls, cfg.rollout.vllm.serve_host,
            cfg.rollout.vllm.server_wait_s) == ("vllm_server", ["http://127.0.0.1:8000"], "0.0.0.0", 300)
    assert (cfg.rollout.vllm.gpu_memory_utilization, cfg.rollout.vllm.dtype, cfg.rollout.vllm.max_model_len) == (
        0.85, "auto", 4096)
    assert cfg.grpo.adapter == "none" and any(n.startswith("adapter: not set") for n in cfg.translation_notes)
    # its Multi-GPU vLLM block: the same server with tensor parallelism
    multi = load_config(user(SERVER.replace("  gpu_memory_utilization: 0.85\n  dtype: auto\n  max_model_len: 4096\n",
                                            "  tensor_parallel_size: 2\n  gpu_memory_utilization: 0.85\n")))
    assert (multi.rollout.engine, multi.rollout.vllm.tensor_parallel_size) == ("vllm_server", 2)


def test_colocate_with_sleep_mode_needs_a_gpu(user):
    """docs/vllm_serving.qmd's Colocate Mode block: vLLM in the run's process; its sleep mode frees GPU memory between
    rounds (CUDA only): on a machine without a GPU, the one line naming where the key landed."""
    import torch

    path = user(with_block("trl:\n  use_vllm: true\n  vllm_mode: colocate\n  vllm_enable_sleep_mode: true\n"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"rollout.vllm.sleep_mode frees a GPU's memory between rounds"):
            load_config(path)
        return
    cfg = load_config(path)
    assert (cfg.rollout.engine, cfg.rollout.vllm.sleep_mode) == ("vllm", True)


def test_the_rlhf_grpo_reward_config_loads_as_written(user):
    """docs/rlhf.qmd's GRPO reward-function config (openai/gsm8k, name: main -> the local rows)."""
    cfg = load_config(user(
        "base_model: {model}\nrl: grpo\n\ntrl:\n    beta: 0.001\n    max_completion_length: 256\n    use_vllm: True\n"
        "    num_generations: 4\n    reward_funcs: [\"rewards.rand_reward_func\"]    # format: '{{file_name}}."
        "{{fn_name}}'\n    reward_weights: [1.0]\ndatasets:\n  - path: {rows}\n"
        "    type: rewards.oai_gsm8k_transform  # format: '{{file_name}}.{{fn_name}}'\n"))
    assert (cfg.grpo.beta, cfg.rollout.max_completion_length, cfg.rollout.engine, cfg.rollout.num_generations) == (
        0.001, 256, "vllm", 4)
    assert (cfg.score.reward_funcs, cfg.score.reward_weights) == (["rewards.rand_reward_func"], [1.0])
    assert cfg.transform.datasets[0].type == "rewards.oai_gsm8k_transform" and cfg.grpo.adapter == "none"


OPENENV = ("base_model: {model}\nrl: grpo\n\ntrl:\n  beta: 0.001\n  max_completion_length: 512\n  num_generations: 4\n"
           "  rollout_func: \"math_env.math_solver_rollout\"  # Custom rollout function\n"
           "  reward_funcs: [\"math_env.math_reward\"]\n  reward_weights: [1.0]\n\ndatasets:\n  - path: {rows}\n"
           "    type: math_env.math_transform\n")
"""docs/rlhf.qmd's OpenEnv block (openai/gsm8k -> the local rows)."""


def test_the_openenv_rollout_func_loads_with_axolotls_signature(user):
    """docs/rlhf.qmd's OpenEnv block: trl.rollout_func is rollout.rollout_func, and its function's signature (model,
    processing_class, prompts, generation_config) is axolotl's guide's, which posttrain calls as the guide says."""
    from flows import preflight

    path = user(OPENENV)
    cfg = load_config(path)
    assert (cfg.rollout.rollout_func, cfg.score.reward_funcs, cfg.rollout.num_generations) == (
        "math_env.math_solver_rollout", ["math_env.math_reward"], 4)
    report = preflight.inspect_config(cfg, path)  # the model folder here is a stand-in
    # the guide's math_reward(prompts, completions, answers, **kwargs) needs an `answers` column its own transform
    # does not write (it writes `answer`; TRL would fail on it too): named, with the fix
    assert [p.split(":")[0] for p in report.problems] == ["model.path", "score.reward_funcs.0"], report.problems
    assert "answers" in report.problems[1]
    assert any(n.startswith("rollout.rollout_func: math_env.math_solver_rollout takes axolotl's guide's")
               for n in report.notes)


def test_an_axolotl_rollout_func_gets_the_policy_and_its_strings_become_the_rollouts(tmp_path, monkeypatch):
    """A round through a rollout_func written to axolotl's guide (it generates with the model and generation config
    it is given and returns strings): the rows are its strings, tokenized after the chat-templated prompt, with the
    policy's own log-probs of them, cut at max_completion_length; one that returns a wrong count is an error naming
    it."""
    import pyarrow.parquet as pq
    from conftest import tiny_say_policy

    from stages.rollout import rollout
    from stages.rollout.engines import Policy

    tiny_say_policy(tmp_path, num_prompts=4)
    (tmp_path / "openenv.py").write_text('''
def solve(model, processing_class, prompts, generation_config=None):
    texts = [processing_class.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    batch = processing_class(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**batch, generation_config=generation_config)
    return processing_class.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def short(model, processing_class, prompts):
    return ["1"]
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = rollout.RolloutConfig(num_generations=2, prompts_per_round=2, max_completion_length=6,
                                rollout_func="openenv.solve")
    summary = rollout.run(cfg, Policy(tmp_path / "model"), tmp_path / "prompts" / "train.parquet", 0, tmp_path)
    rows = pq.read_table(tmp_path / "rollouts.parquet").to_pylist()
    assert summary["rows"] == len(rows) == 4 and {r["engine"] for r in rows} == {"transformers+openenv.solve"}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    for r in rows:
        assert tokenizer.decode(r["completion_token_ids"]) == r["completion"]
        assert len(r["sampling_logprobs"]) == len(r["completion_token_ids"]) <= 6
        assert all(lp <= 0 for lp in r["sampling_logprobs"])
    with pytest.raises(ValueError, match=r"rollout.rollout_func openenv.short: returned 1 items for 4 prompts "
                                         r"\(axolotl's rollout_func returns one completion string per prompt\)"):
        rollout.run(cfg.model_copy(update={"rollout_func": "openenv.short"}), Policy(tmp_path / "model"),
                    tmp_path / "prompts" / "train.parquet", 0, tmp_path / "short")


def test_the_gdpo_config_loads_as_written(user):
    cfg = load_config(user(GDPO))
    assert (cfg.rl, cfg.score.multi_objective_aggregation, cfg.grpo.beta, cfg.rollout.max_completion_length) == (
        "gdpo", "normalize_then_sum", 0.001, 256)
    assert (cfg.score.reward_funcs, cfg.score.reward_weights) == (
        ["rewards.format_reward", "rewards.correctness_reward"], [1.0, 2.0])
    assert (cfg.rollout.engine, cfg.rollout.vllm.server_urls, cfg.rollout.vllm.tensor_parallel_size,
            cfg.rollout.vllm.gpu_memory_utilization, cfg.grpo.adapter) == (
        "vllm_server", ["http://127.0.0.1:8000"], 2, 0.85, "none")


def test_the_ebft_structured_config_loads_as_written(user):
    cfg = load_config(user(EBFT_STRUCTURED))
    assert (cfg.rl, cfg.ebft.feature_layers, cfg.ebft.embed_method, cfg.ebft.use_whitening, cfg.ebft.ce_coef) == (
        "ebft", [0.25, 0.5, 0.75], "last_token", False, 0.0)
    assert (cfg.rollout.num_generations, cfg.rollout.max_completion_length, cfg.rollout.temperature) == (4, 256, 0.7)
    assert (cfg.rollout.engine, cfg.rollout.vllm.server_urls, cfg.rollout.vllm.lora_sync) == (
        "vllm_server", ["http://127.0.0.1:8000"], "adapter")
    assert (cfg.rollout.async_prefetch, cfg.score.scale_rewards, cfg.grpo.loss_type, cfg.grpo.epsilon) == (
        True, "group", "grpo", 0.2)
    assert (cfg.rollout.vllm.gpu_memory_utilization, cfg.rollout.vllm.max_model_len) == (0.5, 2048)
    assert (cfg.grpo.adapter, cfg.grpo.lora_r, cfg.grpo.lora_alpha) == ("lora", 16, 32)


def test_the_ebft_strided_config_needs_flex_attention_on_cuda(user):
    """docs/rlhf.qmd's EBFT strided config: attn_implementation flex_attention (CUDA; posttrain's strided mode builds
    its block mask itself) is one line naming the key; without it the rest loads, its use_reentrant: true too."""
    with pytest.raises(ConfigError, match=r"attn_implementation: flex_attention \(PyTorch's compiled FlexAttention"):
        load_config(user(EBFT_STRIDED))
    without_flex = EBFT_STRIDED.replace("attn_implementation: flex_attention   # Strided mode uses flex_attention\n", "")
    cfg = load_config(user(without_flex))
    assert cfg.train.gradient_checkpointing_kwargs == {"use_reentrant": True}
    assert (cfg.ebft.mode, cfg.ebft.stride, cfg.ebft.context_length, cfg.rollout.max_completion_length,
            cfg.rollout.num_generations, cfg.rollout.temperature) == ("strided", 8, 8, 8, 4, 0.6)
    assert (cfg.ebft.use_whitening, cfg.ebft.rl_coef, cfg.ebft.ce_coef, cfg.ebft.advantage_estimator) == (
        True, 1.0, 0.03, "rloo")
    assert cfg.train.gradient_checkpointing and cfg.grpo.adapter == "none"
    assert cfg.transform.datasets[0].type == "ebft_strided_structured.transform"


def test_the_ebft_strided_structured_config_loads_as_written(user):
    """docs/ebft.qmd's strided block on prompt + completion rows: its transform is the built-in of that name (a file
    of that name beside the config is not imported: the note says so), min_completion_prefix lands in ebft, and
    sequence_len is the document cap axolotl's transform cuts at."""
    from pathlib import Path

    Path("ebft_strided_structured.py").write_text("def transform(cfg, *args, **kwargs):\n    raise RuntimeError\n")
    path = user(EBFT_STRIDED_STRUCTURED)
    cfg = load_config(path)
    assert (cfg.ebft.mode, cfg.ebft.min_completion_prefix, cfg.ebft.max_document_tokens) == ("strided", 8, 2048)
    assert (cfg.grpo.adapter, cfg.grpo.lora_r, cfg.train.gradient_checkpointing_kwargs) == (
        "lora", 16, {"use_reentrant": True})
    from flows import preflight

    report = preflight.inspect_config(cfg, path)  # the rows transformed; the model folder here is a stand-in
    assert [p.split(":")[0] for p in report.problems] == ["model.path"], report.problems
    assert any("sequence_len: 2048 (axolotl's key) -> ebft.max_document_tokens: 2048" in n for n in report.notes)
    assert any("./ebft_strided_structured.py is not imported" in n for n in report.notes), report.notes


def test_the_nemo_gym_single_turn_config_loads_with_its_rows_and_verifier(user, tmp_path):
    rows = tmp_path / "Gym" / "resources_servers" / "reasoning_gym" / "data" / "train_basic_arithmetic.jsonl"
    rows.parent.mkdir(parents=True)
    rows.write_text('{"responses_create_params": {"input": [{"role": "user", "content": "2+3?"}]}, "answer": "5"}\n')
    cfg = load_config(user(NEMO_GYM["single-turn"].replace("nemo_gym_dir: ~/Gym", f"nemo_gym_dir: {tmp_path / 'Gym'}")))
    assert [(s.path, s.type, s.server_name) for s in cfg.transform.datasets] == [(str(rows), "nemo_gym", "reasoning_gym")]
    assert cfg.score.reward_funcs == ["remote:nemo_gym"]
    assert cfg.score.remote_verifiers["nemo_gym"].head_url == "http://127.0.0.1:11000"


def test_the_nemo_gym_multi_turn_config_is_one_line_naming_its_key(user, capsys):
    assert main(["validate", str(user(NEMO_GYM["multi-turn"]))]) == 2
    assert [line for line in capsys.readouterr().err.splitlines()
            if "nemo_gym_multi_turn: true: multi-turn rollouts through NeMo Gym's agent servers" in line]
