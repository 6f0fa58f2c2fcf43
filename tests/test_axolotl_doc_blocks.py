"""Every YAML block of axolotl's GRPO guide (docs/grpo.qmd), with only the model, dataset paths and sizes changed,
on a GRPO config of a new user's: each validates into what it means here, or is one line naming the key that
posttrain does not build and why (issue 45 item 5). tests/test_configs.py has the rlhf, reward-modelling and ebft
guides' examples; tests/test_axolotl_async_keys.py the async ones key by key."""

from __future__ import annotations

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
"""
"""A new user's GRPO config; each block goes under it (its `trl:` section where the block has none)."""

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
'''
"""docs/grpo.qmd's reward module (its functions and transform, shortened)."""

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
    "multiple rewards": "trl:\n  reward_funcs:\n    - rewards.accuracy_reward\n    - rewards.format_reward\n"
                        "    - rewards.length_penalty\n  reward_weights:\n    - 1.0    # accuracy is most important\n"
                        "    - 0.5    # format compliance\n    - 0.1    # mild length preference\n",
    "gdpo": "trl:\n  multi_objective_aggregation: normalize_then_sum\n",
    "reward workers": "trl:\n  reward_num_workers: 4\n",
    "async prefetch": "trl:\n  use_vllm: true\n  use_data_producer: true\n  async_prefetch: true\n  prefetch_depth: 1\n"
                      "  vllm_sync_interval: 2\n",
    "zero-advantage skipping": "trl:\n  skip_zero_advantage_batches: true   # default\n",
    "replay buffer": "trl:\n  replay_buffer_size: 100\n  replay_recompute_logps: true\n",
    "deferred re-rolling": "trl:\n  reroll_start_fraction: 0.5   # Start re-rolling after 50% of training\n"
                           "  reroll_max_groups: 1          # Max groups to replace per batch\n",
    "importance sampling": "trl:\n  use_vllm: true\n  vllm_importance_sampling_correction: true\n"
                           "  importance_sampling_level: token\n  off_policy_mask_threshold: 0.5\n",
}
"""docs/grpo.qmd's blocks that load (`use_vllm: true` added where a block needs vLLM and the guide's config has it)."""

REFUSED_BLOCKS = {
    "scope-rl": ("trl:\n  use_data_producer: true\n  scope_rl: true\n  scope_target_entropy: 0.5\n"
                 "  scope_alpha: 0.015625\n  scope_positive_threshold: 1.0\n", "trl.scope_rl: SCOPE-RL"),
    "fp8": ("fp8: true\ntorch_compile: true\n", "fp8: FP8 training"),
    "fsdp": ("fsdp:\n  - full_shard\n  - auto_wrap\nfsdp_config:\n  fsdp_transformer_layer_cls_to_wrap: "
             "Qwen2DecoderLayer\ngradient_checkpointing_kwargs:\n  use_reentrant: false\n",
             "fsdp: axolotl's FSDP list is not read here: set train.strategy: fsdp"),
    "deepspeed": ("deepspeed: deepspeed_configs/zero3_bf16.json\ngradient_checkpointing_kwargs:\n"
                  "  use_reentrant: true   # Required -- non-reentrant causes CheckpointError with ZeRO-3\n",
                  "deepspeed: DeepSpeed is not built here"),
}
"""docs/grpo.qmd's blocks posttrain does not build, and the start of the one line that says so. Its "reward model
from the hub" block is tests/test_reward_model_hub.py's (it needs the model in a hub cache), its "streaming partial
batch" block tests/test_axolotl_streaming.py's (under the async section's async_prefetch)."""


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A new user's folder: the reward module, 40 gsm8k-style rows and a local model folder."""
    import json

    (tmp_path / "rewards.py").write_text(REWARDS)
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
    """BASE with `block` under it: a block's `trl:` keys join the config's accuracy reward."""
    if block.startswith("trl:") and "reward_funcs" not in block:
        block += "  reward_funcs: [rewards.accuracy_reward]\n"
    return BASE + block


@pytest.mark.parametrize("name", list(VALID_BLOCKS))
def test_a_grpo_guide_block_loads(user, name):
    cfg = load_config(user(with_block(VALID_BLOCKS[name])))
    assert cfg.rl == "grpo" and cfg.grpo.rounds >= 1 and not cfg.sft.enabled and not cfg.runs_eval


@pytest.mark.parametrize("name", list(REFUSED_BLOCKS))
def test_a_grpo_guide_block_not_built_here_is_one_line_naming_its_key(user, name, capsys):
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
    cfg = load_config(user(with_block(VALID_BLOCKS["importance sampling"])))
    assert cfg.rollout.engine == "vllm"
    assert any("trl.use_vllm: true (axolotl's key) without trl.vllm_mode -> rollout.engine: vllm" in note
               and "trl.vllm_mode: server" in note for note in cfg.translation_notes)
    served = load_config(user(with_block(VALID_BLOCKS["importance sampling"].replace(
        "use_vllm: true\n", "use_vllm: true\n  vllm_mode: server\n"))))
    assert served.rollout.engine == "vllm_server"
    assert not any("without trl.vllm_mode" in note for note in served.translation_notes)
