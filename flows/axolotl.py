"""axolotl's config keys, moved into posttrain's sections before validation: flows/config.py's `before`
validators call `move_top_level_keys`, `move_training_keys`, `move_device_keys` and `reward_model_flags`
(docs/coming-from.md). A key of theirs that posttrain has under another name moves
there; one it does not honour is an error naming it; `posttrain validate` shows where each went.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from stages.rollout.rollout import RolloutConfig
from stages.training.grpo import GRPOConfig

AXOLOTL_KEYS = {"datasets": ("transform", "datasets"), "test_datasets": ("transform", "test_datasets"),
                "val_set_size": ("transform", "val_set_size"), "base_model": ("model", "path"),
                "revision_of_model": ("model", "revision"), "special_tokens": ("model", "special_tokens"),
                "chat_template": ("model", "chat_template"), "chat_template_jinja": ("model", "chat_template_jinja")}
"""axolotl's top-level keys and the section key each one is (moved there before validation)."""
PREFERENCE_RL = ("dpo", "ipo", "kto", "orpo", "simpo", "reward_model")
"""The methods that train on the preferences table; axolotl's `datasets`/`test_datasets` are its rows there."""
AXOLOTL_DEVICE_KEYS = {"bf16": "precision", "fp16": "precision", "tf32": None, "attn_implementation":
                       "attn_implementation", "gradient_checkpointing":
                       "gradient_checkpointing", "gradient_checkpointing_kwargs": "gradient_checkpointing_kwargs",
                       "torch_compile": "compile", "flash_attention": "attn_implementation",
                       "sdp_attention": "attn_implementation", "eager_attention": "attn_implementation"}
"""axolotl's top-level precision and kernel keys and the `train.*` key each one sets (`device_settings`)."""
AXOLOTL_TRL_KEYS = {"beta": ("grpo", "beta"), "epsilon": ("grpo", "epsilon"), "epsilon_high": ("grpo", "epsilon_high"),
                    "loss_type": ("grpo", "loss_type"), "num_iterations": ("grpo", "num_iterations"),
                    "mask_truncated_completions": ("grpo", "mask_truncated_completions"),
                    "importance_sampling_level": ("grpo", "importance_sampling_level"),
                    "num_generations": ("rollout", "num_generations"),
                    "max_completion_length": ("rollout", "max_completion_length"),
                    "max_prompt_length": ("rollout", "max_prompt_length"),
                    "temperature": ("rollout", "temperature"), "top_p": ("rollout", "top_p"),
                    "reward_funcs": ("score", "reward_funcs"), "reward_weights": ("score", "reward_weights"),
                    "scale_rewards": ("score", "scale_rewards"),
                    "multi_objective_aggregation": ("score", "multi_objective_aggregation"),
                    "vllm_gpu_memory_utilization": ("rollout", "vllm.gpu_memory_utilization"),
                    "vllm_tensor_parallel_size": ("rollout", "vllm.tensor_parallel_size"),
                    "vllm_enable_sleep_mode": ("rollout", "vllm.sleep_mode"),
                    "vllm_dtype": ("rollout", "vllm.dtype"), "vllm_max_model_len": ("rollout", "vllm.max_model_len"),
                    "async_prefetch": ("rollout", "async_prefetch"),
                    "vllm_importance_sampling_correction": ("grpo", "vllm_importance_sampling_correction"),
                    "vllm_importance_sampling_mode": ("grpo", "vllm_importance_sampling_mode"),
                    "vllm_importance_sampling_cap": ("grpo", "vllm_importance_sampling_cap"),
                    "off_policy_mask_threshold": ("grpo", "off_policy_mask_threshold"),
                    "use_bias_correction_kl": ("grpo", "use_bias_correction_kl"),
                    "replay_buffer_size": ("grpo", "replay_buffer_size"),
                    "replay_recompute_logps": ("grpo", "replay_recompute_logps"),
                    "reroll_start_fraction": ("grpo", "reroll_start_fraction"),
                    "reroll_max_groups": ("grpo", "reroll_max_groups"),
                    "skip_zero_advantage_batches": ("grpo", "skip_zero_advantage_batches"),
                    "reward_num_workers": ("score", "reward_num_workers"),
                    **{k: ("grpo", k) for k in ("scope_rl", "scope_target_entropy", "scope_alpha",
                                                "scope_temperature_min", "scope_temperature_max",
                                                "scope_positive_threshold")},
                    "rollout_func": ("rollout", "rollout_func")}
"""axolotl's `trl:` section (TRL's GRPOConfig names) -> the section key each one is. trl.rollout_func is the same
thing, a `module.fn` that samples the completions itself, called with posttrain's arguments (preflight checks them)."""
ASYNC_TRL_KEYS = ("prefetch_depth", "use_data_producer", "vllm_lora_sync", "streaming_partial_batch",
                  "streaming_min_groups")
"""axolotl's async-GRPO `trl:` keys that `_async_moves` reads with the rest of the config (the engine, the adapter,
async_prefetch); trl.vllm_sync_interval sizes the round (`move_training_length`)."""
VLLM_ENGINES = ("vllm", "ray_vllm", "vllm_server")
"""posttrain's rollout engines that are vLLM (where axolotl's vLLM weight-sync keys have a meaning)."""
AXOLOTL_TRL_NO_OPS = {("vllm_device", "auto"), ("vllm_enable_prefix_caching", True), ("log_completions", True)}
"""`trl:` settings that say what posttrain does anyway: vLLM on the run's device, its prefix cache on, sample
completions logged each round (tracking.completions_per_round)."""
AXOLOTL_VLLM_KEYS = {"tensor_parallel_size": "tensor_parallel_size", "gpu_memory_utilization": "gpu_memory_utilization",
                     "dtype": "dtype", "max_model_len": "max_model_len", "enforce_eager": "enforce_eager"}
"""axolotl's `vllm:` section keys that are `rollout.vllm` keys of the same name and meaning."""
AXOLOTL_VLLM_SERVER_KEYS = ("vllm.host", "vllm.port", "trl.vllm_server_host", "trl.vllm_server_port",
                            "trl.vllm_server_timeout")
"""Where `axolotl vllm-serve` listens and where `axolotl train` finds it (the two-terminal workflow): here
`posttrain vllm-serve` starts vLLM's OpenAI server there and the run generates on it (`_server_moves`:
rollout.engine vllm_server, rollout.vllm.server_urls, serve_host, server_wait_s)."""
TRL_SERVER_INTERNALS = {"serve_module": "the Python module axolotl runs as its server (TRL's weight-sync server, or "
                                        "axolotl's LoRA variant of it)",
                        "worker_extension_cls": "the vLLM worker class TRL's server loads to take weights over NCCL"}
"""axolotl's `vllm:` keys that choose TRL's weight-sync server's code: refused, as posttrain vllm-serve runs vLLM's
own OpenAI server and loads each round's LoRA adapter into it over HTTP (/v1/load_lora_adapter)."""
ALL_INTERFACES = ("0.0.0.0", "::", "[::]")
"""Listen addresses meaning every interface: the run on this machine connects to 127.0.0.1 instead."""
AXOLOTL_DPO_KEYS = ("rl_beta", "orpo_alpha", "simpo_gamma", "cpo_alpha", "kto_desirable_weight",
                    "kto_undesirable_weight")
"""axolotl's top-level DPO-family loss keys: `dpo` keys of the same names (an error under another rl)."""
AXOLOTL_TRAINING_KEYS = ("learning_rate", "micro_batch_size", "gradient_accumulation_steps", "weight_decay",
                         "max_grad_norm", "warmup_steps", "warmup_ratio", "lora_r", "lora_alpha", "lora_dropout",
                         "lora_target_modules", "adam_beta1", "adam_beta2", "adam_epsilon", "optimizer",
                         "lr_scheduler", "num_epochs", "max_steps", "adapter", "sequence_len", "eval_steps",
                         *AXOLOTL_DPO_KEYS)
"""axolotl's top-level training keys: the method's trainer section (grpo, dpo for the DPO family, reward_model)
gets them."""
LENGTH_KEYS = ("max_steps", "num_epochs", "sequence_len")
"""axolotl's training-length keys that, under a round method (grpo, gdpo, ebft), `move_training_length` turns
into grpo.rounds, rollout.prompts_per_round and rollout.max_prompt_length."""
LENGTH_TRL_KEYS = ("steps_per_generation", "generation_batch_size", "vllm_sync_interval")
"""The `trl:` keys that size TRL's generation batch (one posttrain round) and the weight pushes to vLLM between
which a round's batches are sampled (`move_training_length`)."""
AXOLOTL_FIXED_KEYS = {"tokenizer_type": ("AutoTokenizer", "the tokenizer is the model's own (AutoTokenizer)"),
                      "remove_unused_columns": (False, "each stage reads the columns it needs from the tables"),
                      "lora_target_linear": (True, "LoRA goes on every linear layer by default (lora_target_modules "
                                                   "names them); to pick fewer, set lora_target_modules"),
                      "skip_prepare_dataset": (True, "the transform stage writes the prompts table; no stage "
                                                     "pre-tokenizes it"),
                      "context_parallel_size": (1, "sequence parallelism, each sequence split across GPUs with ring "
                                                   "attention, is not built: it needs several GPUs, and posttrain's "
                                                   "optimize stage runs each sequence on one device")}
"""axolotl keys with only one value posttrain honours (dropped when they have it) and why the others are not."""
AXOLOTL_NOT_BUILT = {
    "fp8": "FP8 training (float8 matmuls on Hopper-class GPUs) is not built here; train.precision is fp32, bf16 or fp16",
    "plugins": "axolotl's plugins other than NeMo Gym's (axolotl.integrations.*: Liger, ...) are not loaded here; an "
               "environment's rollouts are rollout.rollout_func, a verifier over HTTP score.remote_verifiers",
}
"""axolotl keys (top level, or `trl.` ones) for what posttrain does not build, and why: an error naming the key."""
AXOLOTL_LOGGING_PREFIXES = ("wandb_", "mlflow_", "comet_", "use_wandb", "use_mlflow", "use_comet")
"""axolotl's experiment-tracker keys: dropped with a warning (posttrain tracks every run in MLflow)."""
AXOLOTL_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
                      "adamw_bnb_8bit": "adamw_8bit", "adamw_8bit": "adamw_8bit", "adafactor": "adafactor",
                      "sgd": "sgd"}


def move_top_level_keys(data):
    """axolotl writes `datasets`, `test_datasets`, `val_set_size`, `base_model`, `revision_of_model`,
    `special_tokens`, `chat_template` and `chat_template_jinja` at the top level: each moves to its section key
    (AXOLOTL_KEYS; under the DPO family's `rl`, datasets and test_datasets are preference rows: `preferences`);
    `posttrain validate` shows where."""
    if not isinstance(data, dict) or not data.keys() & AXOLOTL_KEYS.keys():
        return data
    data, keys = dict(data), dict(AXOLOTL_KEYS)
    if data.get("rl") in PREFERENCE_RL:  # axolotl's datasets are then the preference rows
        keys.update(datasets=("preferences", "datasets"), test_datasets=("preferences", "test_datasets"),
                    val_set_size=("preferences", "val_set_size"))
    for key, (section, field) in keys.items():
        if key not in data:
            continue
        target = section_dict(data, section)
        if target is None:
            continue  # the section's own error says what it should be
        if field in target:
            raise ValueError(f"{key} (axolotl's top-level key) and {section}.{field} are the same setting; "
                             "set one of them")
        data[section] = {**target, field: data.pop(key)}
    return data


def move_training_keys(data, posttrain_keys: frozenset[str]):
    """axolotl's `trl:` section (AXOLOTL_TRL_KEYS) and top-level training keys (AXOLOTL_TRAINING_KEYS: to
    `grpo` for grpo/gdpo/ebft, to `dpo` for the DPO family, to `reward_model`); `posttrain validate` shows
    where each went. A key of theirs with no counterpart here is an error naming it, as is a value of
    AXOLOTL_FIXED_KEYS other than the one posttrain honours. `posttrain_keys`: the top-level keys of posttrain's
    config (PipelineConfig's fields), which tell a config written in axolotl's terms (`is_axolotl_config`)."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    written_as_axolotl = is_axolotl_config(data, posttrain_keys)
    trl_keys = {f"trl.{k}" for k in data.get("trl") or {}} if isinstance(data.get("trl"), dict) else set()
    for key in [k for k in AXOLOTL_NOT_BUILT if k in data or k in trl_keys]:
        raise ValueError(f"{key}: {AXOLOTL_NOT_BUILT[key]}; remove it")
    if data.keys() & set(SHARDING_KEYS):
        data = move_sharding_keys(data)
    data = full_fine_tuning_default(data, written_as_axolotl)
    for key, (honoured, why) in AXOLOTL_FIXED_KEYS.items():
        if key in data and (value := data.pop(key)) != honoured:
            raise ValueError(f"{key}: {value!r} is not honoured here ({why}); remove it")
    if "logging_steps" in data:
        keep_notes([_logging_steps(data.pop("logging_steps"))])
    tracking = [k for k in data if k.startswith(AXOLOTL_LOGGING_PREFIXES)]
    if not (tracking or data.keys() & {"trl", "vllm", "output_dir", *AXOLOTL_TRAINING_KEYS}):
        return data
    data = {k: v for k, v in data.items() if k not in tracking}
    if tracking:
        logging.getLogger("posttrain.config").warning(
            "%s: axolotl's experiment-tracker keys, not used: posttrain logs every run to MLflow (tracking.*, "
            "MLFLOW_TRACKING_URI; `posttrain runs`, the MLflow UI)", ", ".join(tracking))
    if "output_dir" in data:  # where axolotl writes checkpoints and the model: here, every artifact
        output_dir = data.pop("output_dir")
        if data.get("artifacts_dir", output_dir) != output_dir:
            raise ValueError("output_dir (axolotl's key) and artifacts_dir are the same setting here (every stage "
                             "and the exported model go under it); set one of them")
        data["artifacts_dir"] = output_dir
    # (their key, section, field, value) for each key of theirs that is one of ours
    vllm = data.pop("vllm", None) or {}
    moves = _vllm_moves(vllm)
    server = _server_moves(vllm, data.get("trl") or {}, data) if isinstance(data.get("trl") or {}, dict) else []
    moves += server
    trl = data.pop("trl", None) or {}
    if isinstance(trl, dict) and trl.keys() & LENGTH_TRL_KEYS:  # TRL's generation batch: move_training_length's
        data["trl"] = {k: trl[k] for k in LENGTH_TRL_KEYS if k in trl}
        trl = {k: v for k, v in trl.items() if k not in LENGTH_TRL_KEYS}
    if isinstance(trl, dict) and trl.keys() & ASYNC_TRL_KEYS:
        moves += _async_moves({k: trl[k] for k in ASYNC_TRL_KEYS if trl.get(k) is not None}, trl, data,
                              bool(server), _adapter(data))  # null: unset, as in axolotl
        trl = {k: v for k, v in trl.items() if k not in ASYNC_TRL_KEYS}
    moves += _trl_moves(trl, bool(server))
    rl = data.get("rl")
    trainer = "reward_model" if rl == "reward_model" else "dpo" if rl in PREFERENCE_RL else "grpo"
    moves += _training_moves(data, trainer)
    for their_key, section, field, value in moves:
        target = section_dict(data, section)
        if target is not None:  # (else the section's own error says what it should be)
            data[section] = _with_value(target, field, value, their_key, section)
    return data


def move_device_keys(data):
    """axolotl's `bf16`, `fp16`, `gradient_checkpointing`, `flash_attention`, `sdp_attention` and
    `eager_attention` set train.precision, train.gradient_checkpointing and train.attn_implementation."""
    if not isinstance(data, dict) or not data.keys() & AXOLOTL_DEVICE_KEYS.keys():
        return data
    data = dict(data)
    train = section_dict(data, "train")
    if train is None:
        return data
    settings = device_settings({k: data.pop(k) for k in list(data) if k in AXOLOTL_DEVICE_KEYS})
    for field, (value, source) in settings.items():
        if field in train and train[field] != value:
            raise ValueError(f"{source} (axolotl's key) sets train.{field}: {value}, but train.{field} is "
                             f"{train[field]!r}; set one of them")
        train[field] = value
    data["train"] = train
    return data


def reward_model_flags(data):
    """axolotl's `reward_model: true` / `process_reward_model: true` (with `model_type`, `num_labels`) mean
    rl: reward_model (reward_model.kind orm / prm); the other moves read `rl`, so this one runs first."""
    if not isinstance(data, dict):
        return data
    flags = [k for k in ("reward_model", "process_reward_model") if isinstance(data.get(k), bool)]
    if not flags:
        if data.keys() & {"model_type", "num_labels"}:
            raise ValueError("model_type / num_labels: axolotl's reward-model keys; they go with reward_model: "
                             "true or process_reward_model: true (posttrain builds the head itself)")
        return data
    data = dict(data)
    on = [k for k in flags if data.pop(k)]
    if len(on) != 1:
        raise ValueError("reward_model / process_reward_model: set exactly one of them to true (posttrain's "
                         "reward_model section takes its options)")
    kind, model_type, labels = {"reward_model": ("orm", "AutoModelForSequenceClassification", 1),
                                "process_reward_model": ("prm", "AutoModelForTokenClassification", 2)}[on[0]]
    for key, wanted in (("model_type", model_type), ("num_labels", labels)):
        if key in data and data[key] != wanted:
            raise ValueError(f"{key}: {data[key]!r}; {on[0]}: true trains a {wanted} here ({key}: {wanted} "
                             "or leave it out)")
        data.pop(key, None)
    if data.get("rl", "reward_model") != "reward_model":
        raise ValueError(f"{on[0]}: true trains only a reward model (rl: reward_model), but rl is "
                         f"{data['rl']!r}; to use one in GRPO, name it in score.reward_funcs (reward_model, or "
                         "reward_model:<folder>)")
    data["rl"] = "reward_model"
    if kind == "prm":
        data["reward_model"] = {"kind": "prm"}
    return data


def device_settings(keys: dict) -> dict[str, tuple]:
    """{train field: (value, the axolotl key that set it)} for axolotl's precision and kernel keys.
    bf16: true | auto (auto: bf16 where the GPU has it -- posttrain's precision auto), fp16: true; both false:
    fp32. flash_attention / sdp_attention / eager_attention: true picks that kernel. tf32 (matmul mode on
    Ampere+) is accepted only as false or auto, which posttrain does (PyTorch's default). gradient_checkpointing
    and torch_compile: train.gradient_checkpointing and train.compile."""
    out: dict[str, tuple] = {}
    bf16, fp16 = keys.get("bf16"), keys.get("fp16")
    if bf16 not in (None, True, False, "auto") or fp16 not in (None, True, False):
        raise ValueError(f"bf16 is {bf16!r}, fp16 is {fp16!r}: axolotl's bf16 is true, false or auto, fp16 true "
                         "or false (posttrain: train.precision fp32 | bf16 | fp16 | auto)")
    if bf16 is True and fp16 is True:
        raise ValueError("bf16: true and fp16: true: choose one precision (train.precision)")
    if bf16 is True or bf16 == "auto":
        out["precision"] = ("bf16" if bf16 is True else "auto", "bf16")
    elif fp16 is True:
        out["precision"] = ("fp16", "fp16")
    elif bf16 is False or fp16 is False:
        out["precision"] = ("fp32", "bf16" if bf16 is False else "fp16")
    if keys.get("tf32") not in (None, False, "auto"):
        raise ValueError(f"tf32: {keys['tf32']!r} is not built: posttrain leaves PyTorch's matmul precision at its "
                         "default (full fp32 for fp32 matmuls); remove tf32 or set it to false")
    for key, field in (("gradient_checkpointing", "gradient_checkpointing"), ("torch_compile", "compile")):
        if key in keys:
            if not isinstance(keys[key], bool):
                raise ValueError(f"{key}: {keys[key]!r}; use true or false")
            out[field] = (keys[key], key)
    if "gradient_checkpointing_kwargs" in keys:  # train.gradient_checkpointing_kwargs checks what is in it
        out["gradient_checkpointing_kwargs"] = (keys["gradient_checkpointing_kwargs"], "gradient_checkpointing_kwargs")
    kernels = {"flash_attention": "flash_attention_2", "sdp_attention": "sdpa", "eager_attention": "eager"}
    chosen = [k for k in kernels if keys.get(k) is True]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} are all true: choose one attention kernel "
                         "(train.attn_implementation)")
    if chosen:
        out["attn_implementation"] = (kernels[chosen[0]], chosen[0])
    if "attn_implementation" in keys:  # axolotl's newer spelling: transformers' name of the kernel
        named = keys["attn_implementation"]
        if named == "flex_attention":
            raise ValueError("attn_implementation: flex_attention (PyTorch's compiled FlexAttention; axolotl's strided "
                             "EBFT path with it needs CUDA) is not built here: train.attn_implementation is sdpa, "
                             "eager or flash_attention_2, and rl: ebft's strided mode builds its block mask itself "
                             "(stages/training/ebft_strided.py); remove it or set sdpa")
        if named not in kernels.values():
            raise ValueError(f"attn_implementation: {named!r}; posttrain has {', '.join(kernels.values())}")
        if chosen and kernels[chosen[0]] != named:
            raise ValueError(f"attn_implementation: {named} and {chosen[0]}: true name two kernels; set one")
        out["attn_implementation"] = (named, "attn_implementation")
    return out


def _vllm_moves(vllm: dict) -> list[tuple[str, str, str, object]]:
    """axolotl's `vllm:` section as (their key, section, field, value) moves into rollout.vllm; the server's
    address (AXOLOTL_VLLM_SERVER_KEYS) is `_server_moves`'; TRL's server internals (TRL_SERVER_INTERNALS) and any
    other key are errors naming them."""
    if not isinstance(vllm, dict):
        raise ValueError(f"vllm: expected a mapping of vLLM settings, got {type(vllm).__name__}")
    for key, why in TRL_SERVER_INTERNALS.items():
        if vllm.get(key) is not None:
            raise ValueError(f"vllm.{key}: {vllm[key]!r} is {why}; posttrain vllm-serve runs vLLM's own OpenAI "
                             "server instead and loads each round's LoRA adapter into it over HTTP "
                             "(/v1/load_lora_adapter), so there is no such code to choose; remove it")
    moves = []
    for key, value in vllm.items():
        if f"vllm.{key}" in AXOLOTL_VLLM_SERVER_KEYS or key in TRL_SERVER_INTERNALS:
            continue  # _server_moves' / refused above
        if key in AXOLOTL_VLLM_KEYS:
            if value is not None:
                moves.append((f"vllm.{key}", "rollout", f"vllm.{AXOLOTL_VLLM_KEYS[key]}", value))
        elif key == "device" and value in ("auto", None):
            continue  # vLLM runs where the run does (a GPU when there is one)
        elif key == "enable_prefix_caching" and value in (True, None):
            continue  # vLLM's default, kept: the engine resets the cache when the weights change
        elif key == "data_parallel_size" and value in (1, None):
            continue
        else:
            hint = {"data_parallel_size": "several engines: rollout.engine: ray_vllm with "
                                          "rollout.ray_vllm.num_engines, or vllm_server with rollout.vllm.server_urls",
                    "device": "vLLM runs where the run does",
                    "enable_prefix_caching": "the engine keeps vLLM's prefix cache on"}.get(
                key, "not an option posttrain has")
            raise ValueError(f"vllm.{key}: {value!r} is not honoured here ({hint}); remove it")
    return moves


def _server_moves(vllm: dict, trl: dict, data: dict) -> list[tuple[str, str, str, object]]:
    """axolotl's two-terminal workflow (`axolotl vllm-serve config.yaml`, then `axolotl train config.yaml`):
    trl.vllm_mode: server, or where the server listens (AXOLOTL_VLLM_SERVER_KEYS), make the run generate on the
    vLLM server `posttrain vllm-serve` starts: rollout.engine vllm_server at rollout.vllm.server_urls
    [http://host:port] (trl.vllm_server_host/port, else vllm.host/port; 0.0.0.0 is this machine), vllm.host the
    address that server listens on (rollout.vllm.serve_host), trl.vllm_server_timeout how long the run waits for
    it (rollout.vllm.server_wait_s). [] when none is set. With trl.use_vllm false, trl.vllm_mode colocate or
    another rollout.engine, an error."""
    given = [k for k in AXOLOTL_VLLM_SERVER_KEYS
             if (vllm if k.startswith("vllm.") else trl).get(k.split(".", 1)[1]) is not None]
    mode = trl.get("vllm_mode")
    if not given and mode != "server":
        return []
    named = ", ".join(given) or "trl.vllm_mode: server"
    if mode not in (None, "server"):
        raise ValueError(f"{named}: where the run's vLLM server listens, but trl.vllm_mode is {mode!r} (vLLM in "
                         "the run's own process); set trl.vllm_mode: server to generate on `posttrain vllm-serve`'s "
                         "server, or remove them")
    rollout = section_dict(data, "rollout") or {}
    if trl.get("use_vllm") is False or ("use_vllm" not in trl and rollout.get("engine") != "vllm_server"):
        raise ValueError(f"{named}: the vLLM server a run generates on, but trl.use_vllm is "
                         f"{_yaml(trl.get('use_vllm'))} (the run would sample with transformers); set "
                         "trl.use_vllm: true, or remove them")
    if rollout.get("engine", "vllm_server") != "vllm_server":
        raise ValueError(f"{named}: generating on a vLLM server is rollout.engine vllm_server, but rollout.engine is "
                         f"{rollout['engine']!r}; set one of them")
    ports = {k: v for k, v in (("trl.vllm_server_port", trl.get("vllm_server_port")),
                               ("vllm.port", vllm.get("port"))) if v is not None}
    for key, port in ports.items():
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"{key}: {port!r}; use a TCP port number (e.g. 8000)")
    if len(set(ports.values())) > 1:
        raise ValueError("vllm.port (where posttrain vllm-serve listens) and trl.vllm_server_port (where the run "
                         f"connects) differ: {ports['vllm.port']} and {ports['trl.vllm_server_port']}; set one of "
                         "them")
    hosts = {k: v for k, v in (("trl.vllm_server_host", trl.get("vllm_server_host")),
                               ("vllm.host", vllm.get("host"))) if v is not None}
    for key, host in hosts.items():
        if not isinstance(host, str) or not host or "/" in host:
            raise ValueError(f"{key}: {host!r}; use a host name or address (e.g. 127.0.0.1, or 0.0.0.0 for every "
                             "interface)")
    host = next(iter(hosts.values()), "127.0.0.1")
    host = "127.0.0.1" if host in ALL_INTERFACES else f"[{host}]" if ":" in host and host[0] != "[" else host
    port = next(iter(ports.values()), 8000)
    source = next(iter(hosts), None) or next(iter(ports), None) or "trl.vllm_mode"
    moves = [(source, "rollout", "engine", "vllm_server"),
             (source, "rollout", "vllm.server_urls", [f"http://{host}:{port}"])]
    if "vllm.host" in hosts:
        moves.append(("vllm.host", "rollout", "vllm.serve_host", hosts["vllm.host"]))
    if "trl.vllm_server_timeout" in given:
        timeout = trl["vllm_server_timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"trl.vllm_server_timeout: {timeout!r}; use seconds to wait for the server (e.g. 300)")
        moves.append(("trl.vllm_server_timeout", "rollout", "vllm.server_wait_s", float(timeout)))
    return moves


def _trl_moves(trl: dict, server: bool = False) -> list[tuple[str, str, str, object]]:
    """axolotl's `trl:` section as (their key, section, field, value) moves (AXOLOTL_TRL_KEYS, use_vllm,
    log_completions); a vllm_mode other than colocate or server, or a key posttrain has no counterpart of, is an
    error naming it. The server keys (AXOLOTL_VLLM_SERVER_KEYS, vllm_mode: server) are `_server_moves`';
    `server`: they are set, and use_vllm means its rollout.engine vllm_server."""
    moves = []
    for key, value in trl.items():
        if f"trl.{key}" in AXOLOTL_VLLM_SERVER_KEYS:
            continue  # _server_moves'
        if key == "vllm_mode":
            if value not in ("colocate", "server"):
                raise ValueError(f"trl.vllm_mode: {value!r}: use colocate (vLLM in the run's own process, "
                                 "rollout.engine: vllm) or server (the server `posttrain vllm-serve` starts, "
                                 "rollout.engine: vllm_server)")
            continue
        if value is None:  # axolotl's schema default: unset (TRL's default there)
            if key in AXOLOTL_TRL_KEYS:
                section, field = AXOLOTL_TRL_KEYS[key]
                keep_notes([f"trl.{key}: null (axolotl's key): unset, so {section}.{field} keeps posttrain's "
                            f"default, {_yaml(_default_of(section, field))}"])
            continue
        if isinstance(value, (bool, str)) and (key, value) in AXOLOTL_TRL_NO_OPS:
            continue
        if key == "log_completions":  # sample completions are logged each round (tracking.completions_per_round)
            moves.append(("trl.log_completions", "tracking", "completions_per_round", 0))
            continue
        if key == "use_vllm":
            if not (server and value):  # (with the server keys: _server_moves sets rollout.engine vllm_server)
                moves.append(("trl.use_vllm", "rollout", "engine", "vllm" if value else "transformers"))
            if value and not server and "vllm_mode" not in trl:  # TRL's default mode is server
                keep_notes(["trl.use_vllm: true (axolotl's key) without trl.vllm_mode -> rollout.engine: vllm, vLLM in "
                            "the run's own process (TRL's colocate); TRL's default would be a server at "
                            "0.0.0.0:8000: for that, set trl.vllm_mode: server and start it with `posttrain "
                            "vllm-serve CONFIG`"])
        elif key in AXOLOTL_TRL_KEYS:
            moves.append((f"trl.{key}", *AXOLOTL_TRL_KEYS[key], value))
        else:
            import difflib

            accepted = [*AXOLOTL_TRL_KEYS, "use_vllm", "vllm_mode", "log_completions", *ASYNC_TRL_KEYS,
                        *LENGTH_TRL_KEYS, *(k.split(".", 1)[1] for k in AXOLOTL_VLLM_SERVER_KEYS if k[:4] == "trl.")]
            close = difflib.get_close_matches(str(key), accepted, n=1, cutoff=0.6)
            hint = f"did you mean trl.{close[0]}? " if close else ""
            raise ValueError(f"trl.{key}: not an option posttrain has under another name ({hint}trl: takes "
                             f"{', '.join(sorted(AXOLOTL_TRL_KEYS))}, use_vllm, vllm_mode, log_completions, "
                             f"{', '.join(ASYNC_TRL_KEYS + LENGTH_TRL_KEYS)}); set "
                             "the posttrain key instead or remove it")
    return moves


def _default_of(section: str, field: str):
    """The default of posttrain's `section`.`field` for the sections AXOLOTL_TRL_KEYS writes (grpo, rollout, score),
    read from their config models (dotted for a nested field: vllm.dtype)."""
    from stages.rollout.rollout import RolloutConfig
    from stages.scoring.score import ScoreConfig

    model = {"grpo": GRPOConfig, "rollout": RolloutConfig, "score": ScoreConfig}[section]
    for part in field.split("."):
        info = model.model_fields[part]
        value, model = info.get_default(call_default_factory=True), info.annotation
    return value


def _async_moves(keys: dict, trl: dict, data: dict, server: bool,
                 adapter: str) -> list[tuple[str, str, str, object]]:
    """axolotl's async-GRPO `trl:` keys (ASYNC_TRL_KEYS, in `keys`; `trl` is the whole section) as (their key,
    section, field, value) moves, read against the engine (trl.use_vllm or rollout.engine), the adapter (lora or
    none, `_adapter`) and async_prefetch (`server`: the server keys are set, the engine is vllm_server). A key that
    says what posttrain does anyway moves nothing and keeps a note saying why (`posttrain validate` prints it); one
    posttrain cannot honour is an error naming it."""
    rollout = section_dict(data, "rollout") or {}
    engine = "vllm_server" if server else ("vllm" if trl["use_vllm"] else "transformers") if "use_vllm" in trl \
        else rollout.get("engine", "transformers")
    prefetching = trl.get("async_prefetch", rollout.get("async_prefetch", False))
    moves, notes = [], []
    if "use_data_producer" in keys:
        # axolotl: GRPODataProducer, a producer object the trainer asks for each generation batch (with
        # async_prefetch, in a background thread); replay, re-roll and reward workers are built on it
        notes.append(f"trl.use_data_producer: {_yaml(keys['use_data_producer'])} (axolotl's key) is not needed "
                     "here: each round's rollout stage is posttrain's data producer (replay, re-roll and reward "
                     "workers work without it); generating ahead of training is trl.async_prefetch -> "
                     f"rollout.async_prefetch, {'on' if prefetching else 'off'} in this config")
    if "prefetch_depth" in keys:
        moves += _prefetch_depth(keys["prefetch_depth"], prefetching, rollout, notes)
    if "vllm_lora_sync" in keys:
        moves += _lora_sync(keys["vllm_lora_sync"], engine, adapter, notes)
    if keys.keys() & {"streaming_partial_batch", "streaming_min_groups"}:
        moves += _streaming(keys, prefetching, trl, data, notes)
    keep_notes(notes)
    return moves


def _streaming(keys: dict, prefetching: bool, trl: dict, data: dict, notes: list[str]) -> list[tuple]:
    """axolotl's trl.streaming_partial_batch / streaming_min_groups: grpo.streaming_partial_batch /
    streaming_min_groups (chunks of groups, micro-batches cut per chunk, advantages per group). axolotl streams only
    on its async path (trl.async_prefetch: AsyncGRPOTrainer's deferred scoring); elsewhere the keys do nothing there,
    and are an error here. false is a note: what posttrain does."""
    on = keys.get("streaming_partial_batch")
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"trl.streaming_partial_batch: {on!r}; use true or false")
    if "streaming_min_groups" in keys and not on:
        raise ValueError(f"trl.streaming_min_groups: {keys['streaming_min_groups']}: the chunk size of "
                         f"trl.streaming_partial_batch, which is {_yaml(on) if on is not None else 'unset'}; set "
                         "trl.streaming_partial_batch: true or remove it")
    if not on:
        notes.append(f"trl.streaming_partial_batch: {_yaml(on)} (axolotl's key): what posttrain does: a round's "
                     "micro-batches are drawn from all its completions, shuffled")
        return []
    if not prefetching:
        raise ValueError("trl.streaming_partial_batch: true: axolotl streams only on its async path "
                         "(trl.async_prefetch: true), so with async_prefetch off it scores the whole batch at once "
                         "there; set trl.async_prefetch: true, or remove it")
    moves = [("trl.streaming_partial_batch", "grpo", "streaming_partial_batch", True)]
    if "streaming_min_groups" in keys:
        groups = _whole("trl.streaming_min_groups", keys["streaming_min_groups"], "prompt groups per chunk")
        moves.append(("trl.streaming_min_groups", "grpo", "streaming_min_groups", groups))
    score = section_dict(data, "score") or {}
    scale = trl.get("scale_rewards", score.get("scale_rewards", "group"))
    gdpo = data.get("rl") == "gdpo" or trl.get("multi_objective_aggregation",
                                                score.get("multi_objective_aggregation")) == "normalize_then_sum"
    if gdpo or scale == "batch":
        what = "normalize_then_sum's last normalization is per group" if gdpo else "scale_rewards batch acts as group"
        notes.append(f"trl.streaming_partial_batch: true (axolotl's key): every advantage statistic is its group's, "
                     f"as axolotl's streaming scorer computes them ({what})")
    return moves


def _yaml(value) -> str:
    """`value` as YAML writes it (true, false, null), for the notes and errors."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _prefetch_depth(depth, prefetching: bool, rollout: dict, notes: list[str]) -> list[tuple]:
    """axolotl's trl.prefetch_depth: generation batches its background thread (async_prefetch) samples ahead of
    training, with no staleness cap: rollout.prefetch_depth, and rollout.max_staleness raised to it where
    unset (posttrain's lag is the smaller of the two)."""
    depth = _whole("trl.prefetch_depth", depth, "generation batches sampled ahead")
    if not prefetching:
        raise ValueError(f"trl.prefetch_depth: {depth}: how far trl.async_prefetch samples ahead, but async_prefetch "
                         "is off here, so nothing is; set trl.async_prefetch: true or remove it")
    staleness = rollout.get("max_staleness")
    if staleness is not None and staleness < depth:
        raise ValueError(f"trl.prefetch_depth {depth} and rollout.max_staleness {staleness}: posttrain samples at "
                         f"most max_staleness rounds ahead; raise max_staleness or lower prefetch_depth")
    moves = [("trl.prefetch_depth", "rollout", "prefetch_depth", depth)]
    if staleness is None and depth > 1:  # posttrain's default cap, 1, would lower the lag axolotl asks for
        moves.append(("trl.prefetch_depth", "rollout", "max_staleness", depth))
        notes.append(f"trl.prefetch_depth: {depth} (axolotl's key) -> rollout.prefetch_depth: {depth}, "
                     f"rollout.max_staleness: {depth} (axolotl caps the lag only by the depth): round r samples from "
                     f"the policy of round r - {depth}")
    return moves


def _lora_sync(value, engine: str, adapter: str, notes: list[str]) -> list[tuple]:
    """axolotl's trl.vllm_lora_sync: true sends vLLM the LoRA adapter (saved to files, loaded by vLLM's LoRA
    kernels), false the adapter merged into the weights: rollout.vllm.lora_sync adapter / merged on every vLLM
    engine (vllm_server: POST /v1/load_lora_adapter / the merged folder loaded through the server's
    /collective_rpc). Under full fine-tuning the weights go in whole (false is what posttrain does, true an
    error)."""
    if not isinstance(value, bool):
        raise ValueError(f"trl.vllm_lora_sync: {value!r}; use true or false")
    if engine not in VLLM_ENGINES:
        raise ValueError(f"trl.vllm_lora_sync: {_yaml(value)}: how a LoRA adapter reaches vLLM, but this run "
                         f"samples with rollout.engine {engine}; set trl.use_vllm: true (or rollout.engine vllm) or "
                         "remove it")
    if adapter != "lora":
        if value:
            raise ValueError("trl.vllm_lora_sync: true sends vLLM a LoRA adapter, but this run trains the full model "
                             "(adapter: none): its weights go into the engine whole each round; remove it")
        notes.append("trl.vllm_lora_sync: false (axolotl's key): what posttrain does under full fine-tuning: the "
                     "round's weights go into the engine whole")
        return []
    return [("trl.vllm_lora_sync", "rollout", "vllm.lora_sync", "adapter" if value else "merged")]


def is_axolotl_config(data: dict, posttrain_keys: frozenset[str]) -> bool:
    """Whether the raw config is written in axolotl's terms: a top-level key that is not one of posttrain's
    (`posttrain_keys`: base_model, datasets, trl, micro_batch_size, ...). `rl` alone is posttrain's own key too
    (configs/ebft.yaml)."""
    return any(key not in posttrain_keys for key in data)


def _adapter(data: dict) -> str:
    """What the GRPO policy trains, lora or none: axolotl's top-level `adapter` (null: none), else grpo.adapter (none
    where `full_fine_tuning_default` set it), else posttrain's default, lora."""
    if "adapter" in data:
        return data["adapter"] or "none"
    return (section_dict(data, "grpo") or {}).get("adapter", "lora")


def full_fine_tuning_default(data: dict, written_as_axolotl: bool) -> dict:
    """axolotl trains the whole model where its config has no `adapter:` key: under a round method grpo.adapter none,
    under the DPO family dpo.adapter none, each with a note (`posttrain validate` prints it), unless the section's
    adapter is set or the config is posttrain's own. (reward_model's default is already the whole model.)"""
    rl = data.get("rl", "grpo")
    section = "grpo" if rl in ROUND_RL else "dpo" if rl in PREFERENCE_RL and rl != "reward_model" else None
    target = section_dict(data, section) if section else None
    if not written_as_axolotl or "adapter" in data or target is None or "adapter" in target:
        return data
    sent = ", every weight trained and sent to the rollout engine each round" if section == "grpo" else \
        ", every weight trained (the reference is a frozen copy of the starting model)"
    keep_notes([f"adapter: not set: axolotl trains the whole model then (full fine-tuning) -> {section}.adapter: "
                f"none{sent}; for a LoRA adapter set adapter: lora"])
    return {**data, section: {**target, "adapter": "none"}}


def _training_moves(data: dict, trainer: str) -> list[tuple[str, str, str, object]]:
    """axolotl's top-level training keys (AXOLOTL_TRAINING_KEYS), popped from `data`, as (their key, section,
    field, value) moves into `trainer`'s section (grpo, dpo or reward_model); one that has no meaning for that
    trainer, or a value posttrain does not build, is an error naming it."""
    moves = []
    for key in [k for k in AXOLOTL_TRAINING_KEYS if k in data]:
        if trainer == "grpo" and key in LENGTH_KEYS:
            continue  # left for move_training_length, which reads the sections these moves fill
        value = data.pop(key)
        field = {"optimizer": "optim", "lr_scheduler": "lr_scheduler_type",
                 "num_epochs": "num_train_epochs"}.get(key, key)
        if key == "optimizer":
            if value not in AXOLOTL_OPTIMIZERS:
                raise ValueError(f"optimizer: {value!r} is not one posttrain has; use one of "
                                 f"{', '.join(AXOLOTL_OPTIMIZERS)}")
            value = AXOLOTL_OPTIMIZERS[value]
        if key == "adapter" and value not in ("lora", None):
            raise ValueError(f"adapter: {value!r} is not built here (lora, or none for full fine-tuning)")
        if key in AXOLOTL_DPO_KEYS and trainer != "dpo":
            raise ValueError(f"{key}: a DPO-family loss option (rl: dpo, ipo, kto, orpo, simpo); rl is "
                             f"{data.get('rl', 'grpo')!r}: remove it")
        if key == "sequence_len":
            field = "max_length"
        if key == "eval_steps" and trainer == "grpo":
            raise ValueError("eval_steps: a GRPO/EBFT run measures held-out accuracy between rounds: set "
                             "eval.every_rounds (every N rounds) instead")
        moves.append((key, trainer, field, "none" if key == "adapter" and value is None else value))
    return moves


def _with_value(target: dict, field: str, value, their_key: str, where: str) -> dict:
    """A section's raw dict with `field` (dotted for a nested section: vllm.dtype) set to `value` from axolotl's
    `their_key`; a different value already there is an error naming both keys."""
    head, _, rest = field.partition(".")
    if rest:
        inner = section_dict(target, head)
        return target if inner is None else {**target, head: _with_value(inner, rest, value, their_key,
                                                                         f"{where}.{head}")}
    if head in target and target[head] != value:
        raise ValueError(f"{their_key} (axolotl's key) and {where}.{head} are the same setting; set one of them")
    return {**target, head: value}


def section_dict(data: dict, section: str) -> dict | None:
    """The raw config's `section` as a dict (set fields only, if it is already a model) for a validator to add
    keys to; None when it is neither (its own validation then says what it should be)."""
    target = data.get(section) or {}
    if isinstance(target, BaseModel):
        target = target.model_dump(exclude_unset=True)
    return target if isinstance(target, dict) else None


# ---------------------------------------------------------------- sharding (axolotl's fsdp / deepspeed -> train)

SHARDING_KEYS = ("fsdp", "fsdp_config", "fsdp_version", "fsdp_final_state_dict_type", "deepspeed")
"""axolotl's top-level multi-GPU keys (docs/multi-gpu.qmd), read by `move_sharding_keys`."""
NO_OFFLOAD = ("CPU offload is not built here: the weights and optimizer state stay on the training device; "
              "shard over more processes (train.num_processes) to fit the model")
WHOLE_FILES = "posttrain gathers and writes whole checkpoints and models (FULL_STATE_DICT); sharded files are not built"
FSDP_LIST = {"full_shard": None, "auto_wrap": None, "no_shard": None,
             "shard_grad_op": "ZeRO-2 (weights kept gathered from forward to backward) is not built: posttrain's "
                              "FSDP2 reshards each block after its forward (full_shard)",
             "hybrid_shard": "sharding within a node and replicating across nodes is not built: posttrain shards "
                             "across every rank (full_shard)",
             "hybrid_shard_zero2": "hybrid sharding is not built: posttrain shards across every rank (full_shard)",
             "offload": NO_OFFLOAD}
"""axolotl's `fsdp:` list (TrainingArguments.fsdp): None for what posttrain does, else why it is not built."""
FSDP_CONFIG_HONOURED = {"reshard_after_forward": (True,), "offload_params": (False,),
                        "cpu_ram_efficient_loading": (False,), "sync_module_states": (True, False),
                        "use_orig_params": (True,), "state_dict_type": ("FULL_STATE_DICT",),
                        "final_state_dict_type": ("FULL_STATE_DICT",), "auto_wrap_policy": ("TRANSFORMER_BASED_WRAP",),
                        "activation_checkpointing": (True, False),
                        "sharding_strategy": ("FULL_SHARD", 1, "NO_SHARD", 3)}
"""axolotl's fsdp_config sub-keys (FSDP2 names; FSDP1's `fsdp_` prefix dropped, as axolotl does) and the values
posttrain's FSDP2 honours (transformer_layer_cls_to_wrap: `_wrapped_blocks`; fsdp_version: 1 or 2)."""
FSDP_CONFIG_WHY = {
    "reshard_after_forward": "it keeps each block's weights gathered from forward to backward (ZeRO-2), which is not "
                             "built: posttrain's FSDP2 reshards after forward (full_shard)",
    "sharding_strategy": "posttrain's FSDP2 is FULL_SHARD (NO_SHARD: train.strategy ddp); SHARD_GRAD_OP and the hybrid "
                         "strategies are not built",
    "offload_params": NO_OFFLOAD,
    "cpu_offload_pin_memory": "it pins host memory for offloaded weights, and posttrain offloads nothing "
                              "(offload_params)",
    "cpu_ram_efficient_loading": "it loads the weights on rank 0 alone and broadcasts them, which is not built: each "
                                 "of posttrain's ranks loads model.path itself",
    "use_orig_params": "FSDP1's flattened parameters are not built: posttrain's FSDP2 shards each parameter as it is "
                       "(true)",
    "state_dict_type": WHOLE_FILES, "final_state_dict_type": WHOLE_FILES,
    "auto_wrap_policy": "posttrain wraps each transformer block (TRANSFORMER_BASED_WRAP); SIZE_BASED_WRAP is not built",
    "min_num_params": "it sizes SIZE_BASED_WRAP, which is not built (posttrain wraps each transformer block)",
    "mixed_precision_policy": "posttrain's FSDP2 casts nothing itself: the model trains in train.precision "
                              "(axolotl's bf16 / fp16 keys)",
    "activation_checkpointing": "use true or false", "sync_module_states": "use true or false",
    **dict.fromkeys(("backward_prefetch", "backward_prefetch_policy", "forward_prefetch"),
                    "FSDP1's prefetch settings are gone in FSDP2 (axolotl's migration table), which prefetches the "
                    "next block's weights itself"),
}
"""Why a value of an fsdp_config sub-key is not honoured."""
DEEPSPEED_SHIPPED = {
    "zero1.json": {"zero_optimization": {"stage": 1}}, "zero1_torch_compile.json": {"zero_optimization": {"stage": 1}},
    "zero2.json": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "zero2_torch_compile.json": {"zero_optimization": {"stage": 2}},
    "zero3.json": {"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True}},
    "zero3_bf16.json": {"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": True},
                        "bf16": {"enabled": True}},
    "zero3_bf16_cpuoffload_params.json": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
                                          "bf16": {"enabled": True}},
    "zero3_bf16_cpuoffload_all.json": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                             "offload_optimizer": {"device": "cpu"}},
                                       "bf16": {"enabled": True}}}
"""What posttrain reads of axolotl's own deepspeed_configs/*.json (`axolotl fetch deepspeed_configs`) where a config
names one that is not on this machine: the stage, offload and bf16 of each."""
DEEPSPEED_TUNING = ("overlap_comm", "contiguous_gradients", "sub_group_size", "reduce_bucket_size",
                    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "max_live_parameters",
                    "max_reuse_distance", "allgather_bucket_size", "allgather_partitions", "reduce_scatter",
                    "round_robin_gradients", "stage3_max_live_parameters", "stage3_max_reuse_distance")
"""ZeRO's communication and bucket tuning: no counterpart under FSDP2, which schedules its own all-gathers."""
DEEPSPEED_AUTO = {"train_micro_batch_size_per_gpu": "micro_batch_size", "train_batch_size": "micro_batch_size",
                  "gradient_accumulation_steps": "gradient_accumulation_steps", "gradient_clipping": "max_grad_norm"}
"""DeepSpeed JSON keys that axolotl fills from its own keys ("auto"), and the key to set instead."""
DEEPSPEED_QUIET = ("wall_clock_breakdown", "steps_per_print", "zero_allow_untested_optimizer",
                   "zero_force_ds_cpu_optimizer")
"""DeepSpeed JSON keys about its own logging and optimizer checks: nothing to do under FSDP2."""


def top_level_keys() -> list[str]:
    """Every top-level key of axolotl's that posttrain reads (moved into its sections or checked), for the did-you-mean
    of an unknown key (flows/config.py `_describe`)."""
    from flows.nemo_gym import KNOWN

    return sorted({*KNOWN, *AXOLOTL_KEYS, *AXOLOTL_DEVICE_KEYS, *AXOLOTL_TRAINING_KEYS, *AXOLOTL_FIXED_KEYS, *SHARDING_KEYS,
                   *(k for k in AXOLOTL_NOT_BUILT if "." not in k), "trl", "vllm", "output_dir", "logging_steps",
                   "process_reward_model", "model_type", "num_labels"})


def move_sharding_keys(data: dict) -> dict:
    """axolotl's fsdp / fsdp_config / fsdp_version and deepspeed, popped from `data`, as train.strategy (fsdp, or ddp
    for no_shard / ZeRO-0) and what else they mean (fsdp_config.activation_checkpointing: train.gradient_checkpointing,
    a ZeRO-3 JSON's bf16: train.precision), with a note saying what was chosen and that train.num_processes is the
    process count (axolotl's launcher's). A setting posttrain's FSDP2 does not honour is an error naming it."""
    given = {k: data.pop(k) for k in SHARDING_KEYS if k in data}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return data
    named = ", ".join(given)
    if data.get("rl", "grpo") not in ROUND_RL:
        raise ValueError(f"{named}: posttrain shards only the GRPO/EBFT optimize stage (train.strategy: fsdp); rl "
                         f"{data['rl']!r} trains with HF Trainer's DDP on train.num_processes ranks; remove it")
    if "deepspeed" in given and len(given) > 1:
        raise ValueError(f"{named}: DeepSpeed and FSDP are two ways to shard (axolotl refuses both too); keep one")
    if "deepspeed" not in given and not given.keys() & {"fsdp", "fsdp_config"}:
        raise ValueError(f"{named}: axolotl turns FSDP on with fsdp_config (or fsdp), which this config does not set; "
                         "add it (train.strategy: fsdp here) or remove it")
    model = data.get("base_model") or (section_dict(data, "model") or {}).get("path")
    settings, notes = (_deepspeed_settings(given["deepspeed"]) if "deepspeed" in given else
                       _fsdp_settings(given, model))
    train = section_dict(data, "train")
    if train is None:
        return data  # train's own error says what it should be
    for field, (value, source) in settings.items():
        train = _with_value(train, field, value, source, "train")
    data["train"] = train
    processes = train.get("num_processes", 1)
    keep_notes([*notes, f"{named} (axolotl's) -> train.strategy: {settings['strategy'][0]}. axolotl takes the number "
                        "of processes from its launcher (accelerate launch / torchrun, `axolotl train "
                        f"--num-processes`); here train.num_processes sets it, {processes} in this config"
                        + (": one process shards nothing, set it to the GPU count" if processes == 1 else "")
                        + ". axolotl's micro_batch_size is per process; posttrain's is the whole step's, split across "
                          "the processes"])
    return data


def _fsdp_settings(given: dict, model) -> tuple[dict, list[str]]:
    """({train field: (value, axolotl key)}, notes) for axolotl's fsdp list, fsdp_config (FSDP1 or FSDP2 names) and
    fsdp_version; a value posttrain's FSDP2 does not honour is an error naming the key."""
    listed = given.get("fsdp") or []
    listed = listed.split() if isinstance(listed, str) else listed
    if not isinstance(listed, list):
        raise ValueError(f"fsdp: {listed!r}; axolotl's fsdp is a list (e.g. [full_shard, auto_wrap])")
    for option in listed:
        if option not in FSDP_LIST:
            raise ValueError(f"fsdp: {option!r} is not one of {', '.join(FSDP_LIST)}")
        if FSDP_LIST[option]:
            raise ValueError(f"fsdp: {option}: {FSDP_LIST[option]}; remove it")
    config = given.get("fsdp_config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"fsdp_config: expected a mapping of FSDP settings, got {type(config).__name__}")
    config = {(k if k == "fsdp_version" else k.removeprefix("fsdp_")): v for k, v in config.items()}
    version = config.pop("version", None) or config.pop("fsdp_version", None) or given.get("fsdp_version")
    if version is not None and str(version) not in ("1", "2"):
        raise ValueError(f"fsdp_version: {version!r}; axolotl's FSDP is version 1 or 2")
    config.setdefault("final_state_dict_type", given.get("fsdp_final_state_dict_type"))
    notes = [note for key, value in config.items() if (note := _fsdp_config_value(key, value, model))]
    strategy = "ddp" if "no_shard" in listed or config.get("sharding_strategy") in ("NO_SHARD", 3) else "fsdp"
    settings = {"strategy": (strategy, "fsdp" if "fsdp" in given else "fsdp_config")}
    if config.get("activation_checkpointing"):
        settings["gradient_checkpointing"] = (True, "fsdp_config.activation_checkpointing")
        notes.append("fsdp_config.activation_checkpointing: true -> train.gradient_checkpointing: true (each "
                     "transformer block's activations recomputed in the backward pass)")
    if str(version) == "1":
        notes.append("fsdp_version: 1 (axolotl's FSDP1): posttrain shards with FSDP2 (fully_shard), which shards the "
                     "same weights, gradients and optimizer state")
    return settings, notes


def _fsdp_config_value(key: str, value, model) -> str | None:
    """One fsdp_config sub-key checked against what posttrain's FSDP2 does: an error naming it, or a note, or None."""
    if value is None:  # axolotl's schema default: unset
        return None
    if key == "transformer_layer_cls_to_wrap":
        return _wrapped_blocks(value, model)
    if key not in FSDP_CONFIG_WHY:
        import difflib

        close = difflib.get_close_matches(key, [*FSDP_CONFIG_WHY, "transformer_layer_cls_to_wrap"], n=1)
        raise ValueError(f"fsdp_config.{key}: not an FSDP setting axolotl has"
                         + (f"; did you mean {close[0]!r}?" if close else "; remove it"))
    if not any(value == ok and type(value) is type(ok) for ok in FSDP_CONFIG_HONOURED.get(key, ())):
        raise ValueError(f"fsdp_config.{key}: {_yaml(value)}: {FSDP_CONFIG_WHY[key]}; remove it")
    if key == "sync_module_states":
        return (f"fsdp_config.sync_module_states: {_yaml(value)}: each rank loads the same weights from model.path, "
                "so the ranks start in sync either way")
    return None


def _wrapped_blocks(name, model) -> str:
    """fsdp_config.transformer_layer_cls_to_wrap against what posttrain wraps, each block the model's class lists in
    `_no_split_modules` (stages/runtime/distributed.py `shard_model`): an error naming the key where they differ, a
    note where they agree or the model's config.json is not on this machine to compare."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"fsdp_config.transformer_layer_cls_to_wrap: {name!r}; name the model's decoder layer class")
    wanted, blocks = {n.strip() for n in name.split(",")}, _model_blocks(model)
    key = f"fsdp_config.transformer_layer_cls_to_wrap: {name}"
    if blocks is None:
        return (f"{key}: posttrain wraps each block the model lists in _no_split_modules; the model's class is not "
                "known here yet (its config.json is not on this machine, or has no model_type transformers knows), "
                "so that these are the same was not checked")
    if wanted != blocks:
        raise ValueError(f"{key}: posttrain wraps each block the model lists in _no_split_modules, "
                         f"{', '.join(sorted(blocks))} for this model; set that or remove it")
    return f"{key}: the model's transformer block, which posttrain's FSDP2 wraps (its _no_split_modules)"


def _model_blocks(model) -> set[str] | None:
    """The classes the model's transformers class lists in `_no_split_modules`, from its config.json in a local
    folder or the hub cache; None where neither has it, or its model_type is no causal LM transformers knows."""
    import json

    if not isinstance(model, str) or not model:
        return None
    folder, path = Path(model).expanduser(), None
    if folder.is_dir():
        path = folder / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(model, "config.json")
        except ValueError:  # not a hub id (huggingface_hub's HFValidationError)
            cached = None
        path = Path(cached) if isinstance(cached, str) else None
    try:
        model_type = json.loads(path.read_text()).get("model_type") if path else None
    except (OSError, ValueError):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if class_name is None:
        return None
    import transformers

    return set(getattr(getattr(transformers, class_name), "_no_split_modules", None) or ())


def _deepspeed_settings(value) -> tuple[dict, list[str]]:
    """({train field: (value, "deepspeed")}, notes) for axolotl's deepspeed JSON: ZeRO-3 without offload is what FSDP's
    full shard does (weights, gradients and optimizer state sharded) -> train.strategy fsdp, stage 0 ddp; ZeRO-1/2,
    CPU offload and a setting axolotl does not fill itself are errors naming them."""
    spec, where = _deepspeed_json(value)
    if not isinstance(spec, dict):
        raise ValueError(f"deepspeed: {where}: expected a JSON object")
    zero = spec.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage in (1, 2):
        raise ValueError(f"deepspeed: {where} is ZeRO stage {stage}, which shards the optimizer state"
                         f"{' and gradients' if stage == 2 else ''} but keeps the whole weights on every rank: not "
                         "built here. posttrain has train.strategy ddp (nothing sharded) or fsdp (as ZeRO-3: the "
                         "weights too); use deepspeed_configs/zero3.json, or set train.strategy")
    if stage not in (0, 3):
        raise ValueError(f"deepspeed: {where}: zero_optimization.stage {stage!r}; ZeRO stages are 0 to 3")
    for part in ("offload_param", "offload_optimizer"):
        if (zero.get(part) or {}).get("device", "none") not in ("none", None):
            raise ValueError(f"deepspeed: {where} zero_optimization.{part}: {NO_OFFLOAD}")
    if zero.get("gather_16bit_weights_on_model_save", zero.get("stage3_gather_16bit_weights_on_model_save")) is False:
        raise ValueError(f"deepspeed: {where} zero_optimization.gather_16bit_weights_on_model_save: false: "
                         f"{WHOLE_FILES}")
    known = {"stage", "offload_param", "offload_optimizer", "gather_16bit_weights_on_model_save",
             "stage3_gather_16bit_weights_on_model_save", *DEEPSPEED_TUNING}
    top = {"zero_optimization", "bf16", "fp16", *DEEPSPEED_AUTO, *DEEPSPEED_QUIET}
    for key in [*(f"zero_optimization.{k}" for k in zero if k not in known), *(k for k in spec if k not in top)]:
        raise ValueError(f"deepspeed: {where} {key}: not a setting posttrain has a counterpart of; remove it")
    for key, theirs in DEEPSPEED_AUTO.items():
        if spec.get(key, "auto") != "auto":
            raise ValueError(f"deepspeed: {where} {key}: {spec[key]!r}: axolotl fills it from {theirs} (\"auto\"); "
                             f"set {theirs} instead")
    settings = {"strategy": ("fsdp" if stage == 3 else "ddp", "deepspeed")}
    settings.update(_deepspeed_precision(spec, where))
    tuning = sorted(zero.keys() & set(DEEPSPEED_TUNING))
    return settings, [f"deepspeed: {where}: ZeRO stage {stage} -> train.strategy: {settings['strategy'][0]}"
                      + (": PyTorch FSDP2 (fully_shard) shards the weights, gradients and optimizer state as ZeRO-3 "
                         "does, and writes whole files" if stage == 3 else ": nothing sharded")
                      + (f"; its communication tuning ({', '.join(tuning)}) has no counterpart under FSDP2, which "
                         "schedules its own all-gathers" if tuning else "")]


def _deepspeed_json(value) -> tuple[object, str]:
    """(the DeepSpeed config, how to name it): axolotl's deepspeed is a JSON file's path (or the JSON inline); one of
    axolotl's own files that is not on this machine is read as axolotl ships it (DEEPSPEED_SHIPPED)."""
    import json

    if isinstance(value, dict):
        return value, "(inline)"
    if not isinstance(value, str):
        raise ValueError(f"deepspeed: {value!r}; axolotl's deepspeed is a JSON file's path "
                         "(e.g. deepspeed_configs/zero3_bf16.json)")
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return json.loads(path.read_text()), value
        except (OSError, ValueError) as e:
            raise ValueError(f"deepspeed: {value}: not a readable JSON file ({e})") from None
    if path.name in DEEPSPEED_SHIPPED:
        return DEEPSPEED_SHIPPED[path.name], f"{value} (axolotl's own file, as axolotl ships it)"
    raise ValueError(f"deepspeed: {value}: no such file (axolotl's own: deepspeed_configs/"
                     f"{{{', '.join(DEEPSPEED_SHIPPED)}}}, `axolotl fetch deepspeed_configs`)")


def _deepspeed_precision(spec: dict, where: str) -> dict:
    """{"precision": (bf16 | fp16, "deepspeed")} where the JSON turns one on (true), {} where it follows axolotl's
    bf16 / fp16 keys ("auto") or is off; DeepSpeed's own fp16 loss scaler is an error."""
    on = [kind for kind in ("bf16", "fp16") if (spec.get(kind) or {}).get("enabled") is True]
    if "fp16" in on:
        raise ValueError(f"deepspeed: {where} fp16.enabled: true is DeepSpeed's fp16 with its own loss scaler, not "
                         "built here; set fp16: true (train.precision) and fp16.enabled: auto")
    return {"precision": ("bf16", "deepspeed's bf16.enabled: true")} if on else {}


# ---------------------------------------------------------------- training length (TRL's terms -> rounds)

ROUND_RL = ("grpo", "gdpo", "ebft")
"""The methods that run rounds (flows/config.py ROUND_METHODS), where TRL's lengths become rounds."""


_NOTES: ContextVar[list[str] | None] = ContextVar("axolotl_translation_notes", default=None)
"""The notes of the config being validated (`collecting_notes`)."""


@contextmanager
def collecting_notes():
    """A list that `keep_notes` adds to while the config validates (PipelineConfig's `translation_notes`)."""
    notes: list[str] = []
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)


def _logging_steps(value) -> str:
    """axolotl's logging_steps (TRL's: log every N optimizer steps): posttrain logs once a round, which a note says."""
    _whole("logging_steps", value, "optimizer steps between logged metrics")
    return (f"logging_steps: {value} (axolotl's key): posttrain logs each round's metrics to MLflow and the console, "
            "one point per round (the mean over its optimizer steps); each optimize stage's nested MLflow run has "
            "every step's")


def keep_notes(notes: list[str]) -> None:
    """Add `notes` to the validating config's (nothing when no config is collecting them)."""
    collected = _NOTES.get()
    if collected is not None:
        collected.extend(notes)


@dataclass
class RoundSettings:
    """What sizes a round, as the config resolves it (`_round_settings`)."""

    grpo: GRPOConfig
    rollout: RolloutConfig
    num_generations: int  # rollout.num_generations, or ebft.n_samples_per_prompt under rl: ebft
    max_completion_length: int
    strided: bool  # rl: ebft with ebft.mode strided
    set_in_rollout: set[str]  # rollout keys the config sets
    rounds_set: bool  # grpo.rounds is set


def move_training_length(data) -> tuple[object, list[str]]:
    """Under a round method (grpo, gdpo, ebft): axolotl's `max_steps` / `num_epochs` (TRL's optimizer steps /
    passes over the prompts), `trl.steps_per_generation` / `trl.generation_batch_size` (TRL's generation batch) and
    `sequence_len` (prompt + completion), popped from `data` and set as grpo.rounds, rollout.prompts_per_round and
    rollout.max_prompt_length (rollout.atropos.max_token_len under Atropos). Returns (data, one note per choice,
    saying what and why: `posttrain validate` prints them). Runs after the other moves: the batch settings are in
    their sections then. A value it cannot honour is an error naming the key."""
    if not isinstance(data, dict) or not data.keys() & {*LENGTH_KEYS, "trl"}:
        return data, []
    data = dict(data)
    given = {k: data.pop(k) for k in LENGTH_KEYS if k in data}
    trl = data.pop("trl", None) or {}
    given.update({f"trl.{k}": v for k, v in trl.items() if k in LENGTH_TRL_KEYS})
    given = {k: v for k, v in given.items() if v is not None}  # `max_steps: null`: unset, as in axolotl
    if data.get("rl", "grpo") not in ROUND_RL:
        if given:
            what = "generation batch" + (" and its weight pushes to vLLM" if "trl.vllm_sync_interval" in given else "")
            raise ValueError(f"{', '.join(given)}: TRL's GRPO {what}; rl is {data.get('rl')!r}, which "
                             "has none: remove it")
        return data, []
    settings = _round_settings(data)
    if settings is None or not given:
        return data, []  # a section's own error says what is wrong with it
    notes = []
    if "sequence_len" in given:
        data, note = _sequence_len(data, given.pop("sequence_len"), settings)
        notes.append(note)
    if given:
        data, note = (_strided_rounds if settings.strided else _rounds_from_length)(data, given, settings)
        notes.append(note)
        data, note = _schedule_horizon(data)
        notes += [note] if note else []
    return data, notes


def _schedule_horizon(data: dict) -> tuple[dict, str | None]:
    """TRL's learning-rate schedule runs over max_steps: a schedule that needs a horizon (not constant, or a
    warmup_ratio) with grpo.lr_schedule_rounds unset gets the rounds that max_steps / num_epochs became."""
    grpo = section_dict(data, "grpo") or {}
    kind = grpo.get("lr_scheduler_type", "constant")
    if (kind == "constant" and not grpo.get("warmup_ratio")) or "lr_schedule_rounds" in grpo or "rounds" not in grpo:
        return data, None
    data["grpo"] = {**grpo, "lr_schedule_rounds": grpo["rounds"]}
    return data, (f"grpo.lr_schedule_rounds: {grpo['rounds']} (the {kind} schedule's horizon: every round max_steps "
                  "became, as TRL's schedule runs over max_steps)")


def _round_settings(data: dict) -> RoundSettings | None:
    """The grpo, rollout and ebft sections of `data` validated (grpo.rounds left out), with what sizes a round;
    None when one does not validate (the whole config's validation then names what is wrong)."""
    from pydantic import ValidationError

    from stages.training.ebft import EBFTConfig

    grpo, rollout, ebft = (section_dict(data, name) for name in ("grpo", "rollout", "ebft"))
    if grpo is None or rollout is None or ebft is None:
        return None
    try:
        grpo_cfg = GRPOConfig.model_validate({"lr_schedule_rounds": 1, **grpo, "rounds": 1})  # rounds (and the
        # schedule's horizon, `_schedule_horizon`): this function's to choose
        rollout_cfg, ebft_cfg = RolloutConfig.model_validate(rollout), EBFTConfig.model_validate(ebft)
    except ValidationError:
        return None
    is_ebft = data.get("rl") == "ebft"
    strided = is_ebft and ebft_cfg.mode == "strided"
    generations = (ebft_cfg.n_samples_per_prompt if is_ebft and ebft_cfg.n_samples_per_prompt
                   else rollout_cfg.num_generations)
    length = ebft_cfg.generate_max_len if is_ebft and ebft_cfg.generate_max_len else (
        8 if strided and "max_completion_length" not in rollout else rollout_cfg.max_completion_length)
    return RoundSettings(grpo_cfg, rollout_cfg, generations, length, strided, set(rollout), "rounds" in grpo)


def _whole(key: str, value, what: str) -> int:
    """`value` as a positive whole number, else an error naming `key`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}: {value!r}; expected a whole number >= 1 ({what})")
    return value


def _sequence_len(data: dict, value, s: RoundSettings) -> tuple[dict, str]:
    """axolotl's sequence_len under GRPO: the longest prompt + completion in tokens. Prompts are cut on the left to
    sequence_len - max_completion_length tokens (rollout.max_prompt_length, TRL's former left truncation), so that
    every engine stays within it; under Atropos it is atropos.max_token_len (the same bound, registered)."""
    length = _whole("sequence_len", value, "tokens of prompt + completion")
    if s.rollout.source == "atropos":
        data["rollout"] = _with_value(section_dict(data, "rollout"), "atropos.max_token_len", length,
                                      "sequence_len", "rollout")
        return data, (f"sequence_len: {length} (axolotl's key) -> rollout.atropos.max_token_len: {length} (the "
                      "environments drop longer prompt + completion sequences)")
    if s.strided:  # axolotl's strided transforms cut each document to sequence_len tokens
        data["ebft"] = _with_value(section_dict(data, "ebft"), "max_document_tokens", length, "sequence_len", "ebft")
        return data, (f"sequence_len: {length} (axolotl's key) -> ebft.max_document_tokens: {length} (strided mode "
                      "cuts each document to it, a prompt + completion row's completion first, as axolotl's "
                      "strided transforms do)")
    if s.rollout.rollout_func:
        raise ValueError("sequence_len: rollout.rollout_func samples the prompts itself, so posttrain cannot bound "
                         "prompt + completion there; remove it")
    room = length - s.max_completion_length
    if room < 1:  # axolotl's own GRPO example (sequence_len = max_completion_length): what axolotl does there
        return data, (f"sequence_len: {length} (axolotl's key) is not above max_completion_length "
                      f"{s.max_completion_length}, so it leaves no room to bound the prompts by: as in axolotl, whose "
                      "GRPO passes no length to TRL, it cuts nothing (completions stop at max_completion_length); "
                      "set it above max_completion_length to cut prompts to the rest")
    given = s.rollout.max_prompt_length
    if given is not None:
        if given > room:
            raise ValueError(f"sequence_len {length} and rollout.max_prompt_length {given}: with "
                             f"max_completion_length {s.max_completion_length} that is {given + s.max_completion_length}"
                             " tokens; set one of them (or max_prompt_length at most "
                             f"{room})")
        return data, (f"sequence_len: {length} (axolotl's key): rollout.max_prompt_length {given} + "
                      f"max_completion_length {s.max_completion_length} already fit in it")
    data["rollout"] = {**section_dict(data, "rollout"), "max_prompt_length": room}
    return data, (f"sequence_len: {length} (axolotl's key) -> rollout.max_prompt_length: {room} (prompt + completion "
                  f"<= {length} tokens: each prompt keeps its last {room} tokens beside max_completion_length "
                  f"{s.max_completion_length}; the round's prompts_truncated_frac counts those cut)")


def _round_size(given: dict, s: RoundSettings) -> tuple[int, int, str]:
    """(prompts per round, TRL's generation batch in prompts, why): one round is one TRL generation batch of
    micro_batch_size x steps_per_generation completions (steps_per_generation: TRL's default
    gradient_accumulation_steps, or generation_batch_size / micro_batch_size); where steps_per_generation is a
    divisor of gradient_accumulation_steps (and num_iterations is 1), the generation batches of one optimizer step,
    all sampled from the same policy. Your rollout.prompts_per_round, where set, is the round."""
    mbs, gas, mu, groups = (s.grpo.micro_batch_size, s.grpo.gradient_accumulation_steps, s.grpo.num_iterations,
                            s.num_generations)
    spg, gbs = given.get("trl.steps_per_generation"), given.get("trl.generation_batch_size")
    if spg is not None and gbs is not None:
        raise ValueError("trl.steps_per_generation and trl.generation_batch_size are the same setting (as in TRL); "
                         "set one of them")
    if gbs is not None:
        if _whole("trl.generation_batch_size", gbs, "completions") % mbs:
            raise ValueError(f"trl.generation_batch_size {gbs} is not a multiple of micro_batch_size {mbs} (TRL "
                             "refuses it too); set a multiple")
        spg = gbs // mbs
    key = "trl.generation_batch_size" if gbs is not None else "trl.steps_per_generation"
    spg = gas if spg is None else _whole("trl.steps_per_generation", spg, "micro-batches per generation")
    if spg % gas and (gas % spg or mu > 1):
        raise ValueError(f"{key}: a generation batch of {spg} micro-batches with gradient_accumulation_steps {gas}"
                         f"{f' and num_iterations {mu}' if mu > 1 else ''} ends inside an optimizer step; posttrain "
                         "trains whole rounds of whole steps: use a multiple of gradient_accumulation_steps")
    if mbs * spg % groups:
        raise ValueError(f"{key}: TRL's generation batch of micro_batch_size {mbs} x {spg} micro-batches = "
                         f"{mbs * spg} completions is not a whole number of groups of num_generations {groups} "
                         "(TRL refuses it too); change one of them")
    batch = mbs * spg // groups
    if "prompts_per_round" in s.set_in_rollout:
        if given.keys() & {"trl.steps_per_generation", "trl.generation_batch_size"}:
            raise ValueError(f"{key} and rollout.prompts_per_round both size a round; set one of them")
        prompts = s.rollout.prompts_per_round
        return prompts, batch, f"rollout.prompts_per_round {prompts} (yours)"
    per_round = max(spg, gas) // spg  # generation batches per round: 1, or those of one optimizer step
    why = (f"TRL's generation batch: micro_batch_size {mbs} x steps_per_generation {spg} = {mbs * spg} "
           f"completions, {batch} prompt(s) x num_generations {groups}"
           + (f"; {per_round} of them make one optimizer step" if per_round > 1 else ""))
    return batch * per_round, batch, why


def _rounds_from_length(data: dict, given: dict, s: RoundSettings) -> tuple[dict, str]:
    """grpo.rounds (from max_steps or num_epochs) and rollout.prompts_per_round (`_round_size`) into `data`; the note
    says how they were counted. max_steps that is not a whole number of rounds rounds up: TRL samples that last
    generation batch too and stops part way through it; posttrain trains whole rounds."""
    from stages.training.grpo import round_steps

    length_keys = [k for k in ("max_steps", "num_epochs") if k in given]
    if length_keys and s.rounds_set:
        raise ValueError(f"{length_keys[0]} (axolotl's key) and grpo.rounds are the same setting (how long GRPO "
                         "trains); set one of them")
    processes = (section_dict(data, "train") or {}).get("num_processes", 1)
    if processes != 1:
        raise ValueError(f"{', '.join(given)}: with train.num_processes {processes} TRL's batches are per process, "
                         "posttrain's grpo.micro_batch_size x gradient_accumulation_steps the whole step's: set "
                         "grpo.rounds and rollout.prompts_per_round instead")
    prompts, batch, why = _round_size(given, s)
    prompts, pushes, why = _synced_round(given, prompts, why, s)
    steps = round_steps(s.grpo, prompts * s.num_generations, s.num_generations)
    if "prompts_per_round" not in s.set_in_rollout:
        data["rollout"] = {**section_dict(data, "rollout"), "prompts_per_round": prompts}
    per_round = (f"a round is {prompts} prompt(s) x {s.num_generations} completions = {steps} optimizer step(s) "
                 f"(micro_batch_size {s.grpo.micro_batch_size} x gradient_accumulation_steps "
                 f"{s.grpo.gradient_accumulation_steps} completions per step, x num_iterations {s.grpo.num_iterations})")
    if not length_keys:
        return data, f"{', '.join(given)} (axolotl's) -> rollout.prompts_per_round: {prompts} ({why}); {per_round}"
    if "max_steps" in given:
        max_steps = _whole("max_steps", given["max_steps"], "TRL's optimizer steps")
        source = f"max_steps: {max_steps} (axolotl's key" + ("; num_epochs is not used: max_steps overrides it, "
                                                             "as in TRL)" if "num_epochs" in given else ")")
    else:
        max_steps, source = _steps_of_epochs(data, given["num_epochs"], batch, s)
    rounds = -(-max_steps // steps)
    data["grpo"] = {**section_dict(data, "grpo"), "rounds": rounds}
    last = max_steps - (rounds - 1) * steps
    exact = "" if rounds * steps == max_steps else (
        f"; {max_steps} steps are not a whole number of rounds: {rounds} rounds take {rounds * steps} steps (TRL "
        + (f"samples the last generation batch too and stops after {last} of its {steps} steps" if pushes == 1 else
           f"stops {last} steps after its last weight push") + "; posttrain trains whole rounds)")
    what = "one generation batch" if pushes == 1 else f"the {pushes} generation batches between two weight pushes"
    return data, (f"{source} -> grpo.rounds: {rounds}, rollout.prompts_per_round: {prompts}: one round is {what} "
                  f"({why}); {per_round}{exact}")


def _strided_rounds(data: dict, given: dict, s: RoundSettings) -> tuple[dict, str]:
    """max_steps / num_epochs under ebft.mode strided. axolotl's strided trainer is a plain Trainer over documents:
    a micro-batch is micro_batch_size documents, each with its n samples at every anchor, and an optimizer step
    gradient_accumulation_steps micro-batches. Here a round is one such step: rollout.prompts_per_round
    micro_batch_size x gradient_accumulation_steps documents, trained in one optimizer step (a micro-batch per anchor,
    its n samples; as many accumulated as the round's documents have anchors at most, under sequence_len);
    grpo.rounds is max_steps, or num_epochs passes over the documents."""
    other = [k for k in given if k.startswith("trl.")]
    if other:
        raise ValueError(f"{other[0]}: TRL's generation batch; ebft.mode strided has none (axolotl's strided trainer "
                         "samples each micro-batch's documents itself): remove it")
    length_keys = [k for k in ("max_steps", "num_epochs") if k in given]
    if s.rounds_set:
        raise ValueError(f"{length_keys[0]} (axolotl's key) and grpo.rounds are the same setting (how long EBFT "
                         "trains); set one of them")
    ebft = section_dict(data, "ebft") or {}
    cap = ebft.get("max_document_tokens")
    if cap is None:
        raise ValueError(f"{length_keys[0]}: under ebft.mode strided a step's size depends on the documents' length: "
                         "set sequence_len (axolotl's strided transforms cut documents to it; axolotl's default is 512)")
    mbs, gas = s.grpo.micro_batch_size, s.grpo.gradient_accumulation_steps
    stride, context = ebft.get("stride") or 8, ebft.get("context_length") or 8
    blocks = max((cap - s.max_completion_length - context) // stride + 1, 1)
    documents = mbs * gas
    if "prompts_per_round" in s.set_in_rollout and s.rollout.prompts_per_round != documents:
        raise ValueError(f"rollout.prompts_per_round {s.rollout.prompts_per_round} and {length_keys[0]}: under "
                         f"ebft.mode strided a step is micro_batch_size {mbs} x gradient_accumulation_steps {gas} = "
                         f"{documents} documents; set one of them")
    if "max_steps" in given:
        rounds = _whole("max_steps", given["max_steps"], "optimizer steps")
        source = f"max_steps: {rounds} (axolotl's key)"
    else:
        epochs = given["num_epochs"]
        if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not 0 < epochs < float("inf"):
            raise ValueError(f"num_epochs: {epochs!r}; expected a number > 0 (passes over the documents)")
        count, where = _train_prompts(data)
        rounds = max(math.ceil(epochs * -(-count // documents)), 1)
        source = f"num_epochs: {epochs:g} (axolotl's key: passes over the {count} documents of {where})"
    groups = documents * blocks  # a micro-batch per anchor: its n samples
    data["rollout"] = {**section_dict(data, "rollout"), "prompts_per_round": documents}
    data["grpo"] = {**section_dict(data, "grpo"), "rounds": rounds, "micro_batch_size": s.num_generations,
                    "gradient_accumulation_steps": groups}
    return data, (f"{source} -> grpo.rounds: {rounds}, rollout.prompts_per_round: {documents}: under ebft.mode "
                  f"strided a round is one of axolotl's optimizer steps, micro_batch_size {mbs} x "
                  f"gradient_accumulation_steps {gas} documents, each with num_generations {s.num_generations} "
                  f"samples at up to {blocks} anchors (sequence_len {cap}), trained in one optimizer step: "
                  f"grpo.micro_batch_size: {s.num_generations} (an anchor's samples), "
                  f"grpo.gradient_accumulation_steps: {groups} (every anchor of the round)")


def _synced_round(given: dict, prompts: int, why: str, s: RoundSettings) -> tuple[int, int, str]:
    """(prompts per round, generation batches per round, why) under axolotl's trl.vllm_sync_interval N: it pushes
    the trainer's weights to vLLM every N optimizer steps, checked when it samples a generation batch, and the
    batches sampled in between come from the weights last pushed. posttrain loads the policy into the engine once
    per round, so a round is the generation batches between two pushes: lcm(N, a batch's optimizer steps) steps.
    Your rollout.prompts_per_round, where set, must be N steps. An engine that is not vLLM is an error naming it."""
    from stages.training.grpo import round_steps

    if "trl.vllm_sync_interval" not in given or given["trl.vllm_sync_interval"] is None:
        return prompts, 1, why
    n = _whole("trl.vllm_sync_interval", given["trl.vllm_sync_interval"], "optimizer steps between weight pushes")
    if s.rollout.engine not in VLLM_ENGINES:
        raise ValueError(f"trl.vllm_sync_interval: {n}: how often axolotl pushes the trainer's weights to vLLM, but "
                         f"this run samples with rollout.engine {s.rollout.engine}, which gets each round's policy; "
                         "set trl.use_vllm: true (or rollout.engine vllm) or remove it")
    steps = round_steps(s.grpo, prompts * s.num_generations, s.num_generations)
    if "prompts_per_round" in s.set_in_rollout:
        if steps != n:
            raise ValueError(f"trl.vllm_sync_interval {n} and rollout.prompts_per_round {prompts}: posttrain loads the "
                             f"policy into the engine once per round, and a round of {prompts} prompt(s) is {steps} "
                             "optimizer step(s); set one of them")
        return prompts, 1, f"{why}; trl.vllm_sync_interval {n}: the engine gets the policy once per round"
    pushes = math.lcm(n, steps) // steps
    if pushes > 1 and s.grpo.num_iterations > 1:
        raise ValueError(f"trl.vllm_sync_interval {n} with num_iterations {s.grpo.num_iterations}: the {pushes} "
                         "generation batches between two weight pushes would be one round here, which posttrain "
                         f"passes over {s.grpo.num_iterations} times as a whole, where TRL repeats each batch before "
                         f"sampling the next; set vllm_sync_interval to {steps} (a batch's optimizer steps) or "
                         "num_iterations to 1")
    at = (f"axolotl pushes the weights to vLLM every {n} optimizer step(s), when it samples a generation batch (every "
          f"{steps} step(s) here)")
    if pushes == 1:
        return prompts, 1, f"{why}; trl.vllm_sync_interval {n}: the engine gets the policy once per round, as {at}"
    lag = s.rollout.lag()
    ahead = (f"; with rollout.async_prefetch a round samples from the policy {lag} round(s), {lag * pushes * steps} "
             "steps, back, where axolotl's background thread runs trl.prefetch_depth generation batches ahead"
             if lag else "")
    return prompts * pushes, pushes, (f"{why}; trl.vllm_sync_interval {n}: {at}, so {pushes} batches sample from "
                                      f"the same weights: a round is those {pushes} batches, {prompts * pushes} "
                                      f"prompt(s), and the engine gets the policy once per round{ahead}")


def _steps_of_epochs(data: dict, epochs, batch: int, s: RoundSettings) -> tuple[int, str]:
    """(TRL's optimizer steps for `epochs` passes over the train split, how they were counted): each pass is
    train prompts // batch generation batches (TRL drops the last partial one), each used for steps_per_generation
    x num_iterations micro-batches, gradient_accumulation_steps of them per optimizer step (the last step of a pass
    may have fewer), times epochs rounded up."""
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not 0 < epochs < float("inf"):
        raise ValueError(f"num_epochs: {epochs!r}; expected a number > 0 (passes over the train prompts)")
    count, where = _train_prompts(data)
    batches = count // batch
    if batches == 0:
        raise ValueError(f"num_epochs: the train split's {count} prompts ({where}) are fewer than one generation "
                         f"batch of {batch}; lower the batch or set max_steps")
    spg = batch * s.num_generations // s.grpo.micro_batch_size
    micro_steps = batches * spg * s.grpo.num_iterations
    per_epoch = -(-micro_steps // s.grpo.gradient_accumulation_steps)
    steps = math.ceil(epochs * per_epoch)
    return steps, (f"num_epochs: {epochs:g} (axolotl's key: passes over the {count} train prompts of {where}, "
                   f"{batches} generation batches of {batch} each, TRL's {per_epoch} optimizer steps per pass; "
                   f"{steps} steps)")


def _train_prompts(data: dict) -> tuple[int, str]:
    """(rows of the train split the rounds draw from, where they were counted), for num_epochs: the demo task's
    demo_data.num_train, or the rows of your local train files (less val_set_size's hold-out; rows the transform
    or too_long_prompts leaves out are not subtracted). A hub dataset, a data version or Atropos: an error naming
    num_epochs (its size is known only when the run reads it)."""
    from stages.data import sources
    from stages.data.demo_data import DemoDataConfig
    from stages.data.transform import TransformConfig

    later = "its size is known only once the run reads it; set max_steps instead"
    if (section_dict(data, "rollout") or {}).get("source") == "atropos":
        raise ValueError("num_epochs: rollout.source atropos has no prompt set to pass over; set max_steps instead")
    if (section_dict(data, "data") or {}).get("version"):
        raise ValueError(f"num_epochs: data.version trains on a registered data version: {later}")
    transform = TransformConfig.model_validate(section_dict(data, "transform") or {})
    if transform.paths:
        if "train" not in transform.paths:
            raise ValueError("num_epochs: transform.paths has no train split to pass over; add one or set max_steps")
        path = Path(transform.paths["train"]).expanduser()
        return sum(isinstance(r, dict) for r in sources.read_rows(path)), str(path)
    if transform.datasets:
        total = 0
        for source in transform.datasets:
            if sources.kind(source) == "hub":
                raise ValueError(f"num_epochs: transform.datasets {source.path} is a hub dataset: {later}")
            total += len(sources.load(source))
        size = transform.val_set_size if not transform.test_datasets else None
        held = (math.ceil(size * total) if size < 1 else int(size)) if size else 0
        return total - held, "transform.datasets" + (f", less val_set_size's {held}" if held else "")
    demo = DemoDataConfig.model_validate(section_dict(data, "demo_data") or {})
    return demo.num_train * (demo.records_per_document or 1), "demo_data.num_train"
