"""The composed pipeline config: one pydantic model per stage section, loaded from YAML
with dotted command-line overrides (`grpo.rounds=2 rollout.temperature=0.8`).

Errors name the file, the key's full path, and for an unknown key the closest valid name.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import typing
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stages.data.base_model import BaseModelConfig
from stages.data.demo_data import DemoDataConfig
from stages.data.preferences import DemoPairsConfig, PreferenceConfig
from stages.data.transform import TransformConfig
from stages.evaluation.evaluate import EvalConfig
from stages.evaluation.health import HealthConfig
from stages.rollout.rollout import RolloutConfig
from stages.runtime.distributed import TrainConfig
from stages.scoring.score import ScoreConfig
from stages.training.dpo import PreferenceOptimizationConfig
from stages.training.ebft import EBFTConfig
from stages.training.export import ExportConfig
from stages.training.grpo import GRPOConfig
from stages.training.reward_model import RewardModelConfig
from stages.training.sft import SFTConfig
from tasks.publish import TrackingConfig


ROUND_METHODS = ("grpo", "gdpo", "ebft")
DPO_FAMILY = ("dpo", "ipo", "kto", "orpo", "simpo")
REWARD_MODEL_RUN_UNREAD = ("sft", "rollout", "score", "grpo", "ebft", "dpo", "eval", "promotion")
"""The sections a `rl: reward_model` run reads nothing of."""
DPO_RUN_UNREAD = ("rollout", "score", "grpo", "ebft", "reward_model")
"""The sections a DPO-family run reads nothing of (it trains one preference stage, no rounds)."""
REWARD_MODEL_INPUTS = ("reward_model", "demo_pairs")
"""Sections a round-based run reads only to train its reward model (score.reward_funcs: [reward_model])."""
SEEDED_SECTIONS = ("model", "sft", "rollout", "grpo", "dpo", "reward_model")
"""Sections whose `seed` the top-level `seed` sets."""
AXOLOTL_KEYS = {"datasets": ("transform", "datasets"), "test_datasets": ("transform", "test_datasets"),
                "val_set_size": ("transform", "val_set_size"), "base_model": ("model", "path"),
                "revision_of_model": ("model", "revision"), "special_tokens": ("model", "special_tokens"),
                "chat_template": ("model", "chat_template"), "chat_template_jinja": ("model", "chat_template_jinja")}
"""axolotl's top-level keys and the section key each one is (moved there before validation)."""
PREFERENCE_RL = ("dpo", "ipo", "kto", "orpo", "simpo", "reward_model")
"""The methods that train on the preferences table; axolotl's `datasets`/`test_datasets` are its rows there."""
AXOLOTL_DEVICE_KEYS = {"bf16": "precision", "fp16": "precision", "tf32": None, "gradient_checkpointing":
                       "gradient_checkpointing", "torch_compile": "compile", "flash_attention": "attn_implementation",
                       "sdp_attention": "attn_implementation", "eager_attention": "attn_implementation"}
"""axolotl's top-level precision and kernel keys and the `train.*` key each one sets (`axolotl_devices`)."""
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
                    "async_prefetch": ("rollout", "async_prefetch")}
"""axolotl's `trl:` section (TRL's GRPOConfig names) -> the section key each one is."""
AXOLOTL_TRL_NO_OPS = {("vllm_device", "auto"), ("vllm_enable_prefix_caching", True), ("log_completions", True)}
"""`trl:` settings that say what posttrain does anyway: vLLM on the run's device, its prefix cache on, sample
completions logged each round (tracking.completions_per_round)."""
AXOLOTL_VLLM_KEYS = {"tensor_parallel_size": "tensor_parallel_size", "gpu_memory_utilization": "gpu_memory_utilization",
                     "dtype": "dtype", "max_model_len": "max_model_len", "enforce_eager": "enforce_eager"}
"""axolotl's `vllm:` section keys that are `rollout.vllm` keys of the same name and meaning."""
AXOLOTL_VLLM_SERVER_KEYS = ("vllm.host", "vllm.port", "vllm.serve_module", "vllm.worker_extension_cls",
                            "trl.vllm_server_host", "trl.vllm_server_port", "trl.vllm_server_timeout")
"""Where `axolotl vllm-serve` (TRL's weight-sync server) listens and what it runs: posttrain has no such server."""
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
AXOLOTL_FIXED_KEYS = {"tokenizer_type": ("AutoTokenizer", "the tokenizer is the model's own (AutoTokenizer)"),
                      "remove_unused_columns": (False, "each stage reads the columns it needs from the tables"),
                      "lora_target_linear": (True, "LoRA goes on every linear layer by default (lora_target_modules "
                                                   "names them); to pick fewer, set lora_target_modules"),
                      "gradient_checkpointing_kwargs": (None, "train.gradient_checkpointing uses transformers' "
                                                              "default (use_reentrant: false)")}
"""axolotl keys with only one value posttrain honours (dropped when they have it) and why the others are not."""
AXOLOTL_LOGGING_PREFIXES = ("wandb_", "mlflow_", "comet_", "use_wandb", "use_mlflow", "use_comet")
"""axolotl's experiment-tracker keys: dropped with a warning (posttrain tracks every run in MLflow)."""
AXOLOTL_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
                      "adamw_bnb_8bit": "adamw_8bit", "adamw_8bit": "adamw_8bit", "adafactor": "adafactor",
                      "sgd": "sgd"}
SCORE_WHERE_KEYS = ("reward_num_workers", "backend", "ray", "reward_timeout_s", "reward_batch_size")
"""score keys that say where and how reward functions run, not what they score."""
PROMPT_SPLITS_OF_DATASETS = ("train", "eval")
"""The prompts splits transform.datasets makes."""


class ScheduleConfig(BaseModel):
    """When `posttrain deploy` schedules the config's deployment (Prefect cron schedule)."""

    model_config = ConfigDict(extra="forbid")

    cron: str = "0 3 * * *"
    """Five-field cron expression (minute hour day month weekday); default 03:00 every day."""
    timezone: str = "UTC"
    """IANA time zone the cron is read in (e.g. Europe/Berlin); daylight-saving shifts follow it."""

    @model_validator(mode="after")
    def _valid_cron_and_zone(self):
        from datetime import datetime
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        from cronsim import CronSim, CronSimError  # what Prefect's cron schedules use

        try:
            CronSim(self.cron, datetime.now())
        except CronSimError as e:
            raise ValueError(f"schedule.cron {self.cron!r} is not a cron expression ({e}); "
                             "e.g. '0 3 * * *' is 03:00 daily") from None
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"schedule.timezone {self.timezone!r} is not an IANA time zone "
                             "(e.g. UTC, Europe/Berlin, America/New_York)") from None
        return self


class PromotionConfig(BaseModel):
    """Champion/challenger: which registered model version carries the `champion` alias."""

    model_config = ConfigDict(extra="forbid")

    metric: Literal["eval/accuracy", "eval/format_rate"] = "eval/accuracy"
    """Held-out metric (higher is better) the new model and the champion are compared on, both measured
    on this run's eval prompts."""
    min_gain: float = 0.0
    """The new model becomes champion when metric >= champion's metric + min_gain (otherwise challenger).
    0: ties promote the newer model; higher: keep the champion unless clearly beaten; negative: always promote."""
    start_from_champion: bool = False
    """Start the GRPO/DPO rounds from the champion's exported model instead of the SFT output (retraining
    continues from the best model so far). False keeps reruns of one config cached end to end."""


class DataConfig(BaseModel):
    """Registered training data versions (`posttrain data add`), under <artifacts_dir>/data/<name>/."""

    model_config = ConfigDict(extra="forbid")

    version: str | None = None
    """A registered data version (sha256 prefix) or `latest`: its rows replace the training prompts
    (transform.type applies); the eval split stays the config's, so metrics stay comparable. Unset: the
    config's own data. A deployment's data trigger sets it per run."""
    inbox: str | None = None
    """A folder `posttrain data watch` polls: each data file dropped there is registered as a version
    (and announced with a `posttrain.data.added` event), then moved into <inbox>/registered/."""


class PipelineConfig(BaseModel):
    """A whole pipeline run: GRPO rounds, or (rl: dpo | ipo | kto | orpo | simpo) preference optimization."""

    model_config = ConfigDict(extra="forbid")

    name: str = "posttrain"
    """Run group: the MLflow experiment and the Prefect flow-run name prefix."""
    artifacts_dir: str = "artifacts"
    """Root of every stage folder, the MLflow sqlite store and Prefect's home."""
    seed: int | None = None
    """One seed for every random choice of training (TRL `seed`): sets model.seed (initialization),
    sft.seed, rollout.seed, grpo.seed, dpo.seed and reward_model.seed. The demo data keep their own
    demo_data.seed, so runs with different seeds evaluate on the same held-out prompts. Unset: each
    section's own seed (all 0 by default)."""
    rl: Literal["grpo", "gdpo", "ebft", "dpo", "ipo", "kto", "orpo", "simpo", "reward_model"] = "grpo"
    """Post-training method (axolotl's `rl`). grpo: rollout/score/optimize rounds (sections rollout,
    score, grpo); gdpo: the same rounds with score.multi_objective_aggregation normalize_then_sum; ebft:
    the same rounds scored by feature matching against a reference completion (section ebft). dpo, ipo,
    kto, orpo, simpo: one preference-optimization stage on the `preferences` table (section dpo).
    reward_model (axolotl's `reward_model: true` / `process_reward_model: true`): only a reward model
    (section reward_model) trained from model.path on the preferences, evaluated on their eval split and
    registered; a GRPO run scores with it as `score.reward_funcs: [reward_model:<its folder>]`."""
    demo_data: DemoDataConfig = Field(default_factory=DemoDataConfig)
    transform: TransformConfig = Field(default_factory=TransformConfig)
    model: BaseModelConfig = Field(default_factory=BaseModelConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    score: ScoreConfig = Field(default_factory=ScoreConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    ebft: EBFTConfig = Field(default_factory=EBFTConfig)
    """rl: ebft: feature-matching rewards from a frozen copy of the starting policy (stages/training/ebft.py)."""
    preferences: PreferenceConfig | None = None
    """Your preference data (axolotl's RLHF formats); unset: demo pairs for the built-in task."""
    demo_pairs: DemoPairsConfig = Field(default_factory=DemoPairsConfig)
    dpo: PreferenceOptimizationConfig = Field(default_factory=PreferenceOptimizationConfig)
    """Preference optimization options (rl_beta, orpo_alpha, simpo_gamma, ...); `dpo.rl` follows `rl`."""
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    """The reward model trained on the preferences when score.reward_funcs names `reward_model`."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """What each run publishes besides metrics (sample completions per round)."""
    schedule: ScheduleConfig | None = None
    """`posttrain deploy`: the deployment's cron schedule ({cron, timezone}); unset: no schedule (data
    trigger and manual runs only)."""
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    """Champion/challenger aliases on the registered model after each run's final eval."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Registered training data versions: which one this run trains on, and the inbox folder to watch."""
    health: HealthConfig = Field(default_factory=HealthConfig)
    """Healthy ranges of the per-round GRPO metrics (axolotl's training-stability red flags by default);
    out of range: warn (tag + summary) or, with on_unhealthy: stop, end the run. NaN/Inf always ends it."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Where training runs: `num_processes` data-parallel ranks (torchrun) for the optimize and SFT stages;
    not part of any stage's key (same weights up to float rounding)."""

    @model_validator(mode="before")
    @classmethod
    def _preference_types_follow_rl(cls, data):
        """preferences.namespace follows `rl` (kto: unpaired rows; every other method: pairs), so a `type`
        means what it means in axolotl under that method (chatml.argilla is a pair format for dpo, an
        unpaired one for kto). Defined first, so it runs after the validators below move axolotl's keys (pydantic
        runs `before` validators last-defined first)."""
        if not isinstance(data, dict):
            return data
        prefs = _section_dict(data, "preferences")
        if not prefs:
            return data
        wanted, given = ("kto" if data.get("rl") == "kto" else "pairs"), prefs.get("namespace")
        if given is not None and given != wanted:
            raise ValueError(f"preferences.namespace: {prefs.get('namespace')!r} does not fit rl: "
                             f"{data.get('rl', 'grpo')} (it reads {wanted} rows); leave it out, it follows rl")
        return {**data, "preferences": {**prefs, "namespace": "kto"}} if wanted == "kto" else data

    @model_validator(mode="before")
    @classmethod
    def _axolotl_top_level_keys(cls, data):
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
            target = _section_dict(data, section)
            if target is None:
                continue  # the section's own error says what it should be
            if field in target:
                raise ValueError(f"{key} (axolotl's top-level key) and {section}.{field} are the same setting; "
                                 "set one of them")
            data[section] = {**target, field: data.pop(key)}
        return data

    @model_validator(mode="before")
    @classmethod
    def _axolotl_training_keys(cls, data):
        """axolotl's `trl:` section (AXOLOTL_TRL_KEYS) and top-level training keys (AXOLOTL_TRAINING_KEYS: to
        `grpo` for grpo/gdpo/ebft, to `dpo` for the DPO family, to `reward_model`); `posttrain validate` shows
        where each went. A key of theirs with no counterpart here is an error naming it, as is a value of
        AXOLOTL_FIXED_KEYS other than the one posttrain honours."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key, (honoured, why) in AXOLOTL_FIXED_KEYS.items():
            if key in data and (value := data.pop(key)) != honoured:
                raise ValueError(f"{key}: {value!r} is not honoured here ({why}); remove it")
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
        moves = _axolotl_vllm_moves(data.pop("vllm", None) or {}, data.get("trl") or {})
        moves += _axolotl_trl_moves(data.pop("trl", None) or {})
        rl = data.get("rl")
        trainer = "reward_model" if rl == "reward_model" else "dpo" if rl in PREFERENCE_RL else "grpo"
        moves += _axolotl_training_moves(data, trainer)
        for their_key, section, field, value in moves:
            target = _section_dict(data, section)
            if target is not None:  # (else the section's own error says what it should be)
                data[section] = _with_value(target, field, value, their_key, section)
        return data

    @model_validator(mode="before")
    @classmethod
    def _axolotl_device_keys(cls, data):
        """axolotl's `bf16`, `fp16`, `gradient_checkpointing`, `flash_attention`, `sdp_attention` and
        `eager_attention` set train.precision, train.gradient_checkpointing and train.attn_implementation."""
        if not isinstance(data, dict) or not data.keys() & AXOLOTL_DEVICE_KEYS.keys():
            return data
        data = dict(data)
        train = _section_dict(data, "train")
        if train is None:
            return data
        settings = axolotl_devices({k: data.pop(k) for k in list(data) if k in AXOLOTL_DEVICE_KEYS})
        for field, (value, source) in settings.items():
            if field in train and train[field] != value:
                raise ValueError(f"{source} (axolotl's key) sets train.{field}: {value}, but train.{field} is "
                                 f"{train[field]!r}; set one of them")
            train[field] = value
        data["train"] = train
        return data

    @model_validator(mode="before")
    @classmethod
    def _axolotl_reward_model_flags(cls, data):
        """axolotl's `reward_model: true` / `process_reward_model: true` (with `model_type`, `num_labels`) mean
        rl: reward_model (reward_model.kind orm / prm). Defined after the other axolotl validators, so it runs
        before them (they read `rl`)."""
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

    @model_validator(mode="after")
    def _no_option_ignored(self):
        """Options the chosen method never reads are errors, never dropped in silence (issue 28): under
        rollout.source atropos the environments sample and score (only score.scale_rewards is read: it makes
        the advantages); rl: ebft scores by feature matching (score.scale_rewards likewise). score's `where`
        keys (SCORE_WHERE_KEYS: how many workers, where, timeouts) change no score and are let through. An
        option counts when its value is not its default (a run's saved config.yaml lists every field)."""
        atropos, ebft = self.rollout.source == "atropos", self.rl == "ebft"
        if atropos and self.rl in ("ebft", "gdpo"):
            what = ("feature-matching rewards (the ebft section)" if ebft
                    else "normalize_then_sum over several reward functions")
            raise ValueError(f"rl: {self.rl} with rollout.source: atropos: the environments' scores are the rewards, "
                             f"so {what} would be ignored; use rl: grpo with Atropos, or rollout.source: prompts")
        ignored = []
        if atropos or ebft:
            ignored += [f"score.{k}" for k in not_default(self.score, type(self.score).model_fields)
                        if k != "scale_rewards" and k not in SCORE_WHERE_KEYS]
        if atropos:
            ignored += [f"grpo.{k}" for k in not_default(self.grpo, ("replay_buffer_size", "reroll_start_fraction",
                                                                      "reroll_max_groups"))]
            ignored += [f"rollout.{k}" for k in not_default(self.rollout, ("top_p",))]
        if ignored:
            source = "rollout.source: atropos (the environments sample and score)" if atropos else \
                "rl: ebft (rewards from feature matching, stages/training/ebft.py)"
            raise ValueError(f"{', '.join(ignored)}: not read under {source}; remove "
                             f"{'them' if len(ignored) > 1 else 'it'}")
        self._reward_model_run_reads_its_sections()
        self._method_reads_its_sections()
        rollout = self.rollout
        if not_default(rollout, ("prefetch_depth",)) and (
                not rollout.async_prefetch or rollout.prefetch_depth > rollout.max_staleness):
            why = ("needs rollout.async_prefetch: true" if not rollout.async_prefetch else
                   f"is {rollout.prefetch_depth}, but rollout.max_staleness {rollout.max_staleness} caps the lag "
                   f"at {rollout.max_staleness}; raise max_staleness or lower prefetch_depth")
            raise ValueError(f"rollout.prefetch_depth {why}")
        return self

    def _method_reads_its_sections(self) -> None:
        """A value set in a section the chosen method reads nothing of is an error naming it (a DPO-family run
        reads no rollout/score/grpo/ebft/reward_model; a round-based run no dpo, ebft only under rl: ebft, and
        the reward model's sections only with score.reward_funcs: [reward_model]). `seed` is left out: the
        top-level seed sets every section's."""
        if self.rl == "reward_model":
            return  # _reward_model_run_reads_its_sections
        trains_reward_model = self.rl not in DPO_FAMILY and "reward_model" in self.score.reward_funcs
        if self.rl in DPO_FAMILY:
            unread = {name: f"rl: {self.rl} (one preference-optimization stage, no rounds)" for name in DPO_RUN_UNREAD}
        else:
            unread = {"dpo": f"rl: {self.rl} (the DPO family's section)",
                      **({} if self.rl == "ebft" else {"ebft": f"rl: {self.rl} (rl: ebft's section)"}),
                      **({} if trains_reward_model else {name: f"rl: {self.rl} without reward_model in "
                                                         "score.reward_funcs (nothing trains a reward model)"
                                                         for name in REWARD_MODEL_INPUTS})}
        for name, why in unread.items():
            section = getattr(self, name)
            ignored = [f"{name}.{k}" for k in not_default(section, type(section).model_fields) if k != "seed"]
            if ignored:
                raise ValueError(f"{', '.join(ignored)}: not read under {why}; remove "
                                 f"{'them' if len(ignored) > 1 else 'it'}")
        if self.preferences is not None and self.rl not in DPO_FAMILY and not trains_reward_model:
            raise ValueError(f"preferences: not read under rl: {self.rl} without reward_model in score.reward_funcs "
                             "(nothing trains a reward model); remove it")

    def _reward_model_run_reads_its_sections(self) -> None:
        """rl: reward_model trains from model.path on the preferences: SFT is skipped (sft.enabled follows) and
        the policy sections (REWARD_MODEL_RUN_UNREAD) are read by nothing, so a value set there is an error."""
        if self.rl != "reward_model":
            return
        if self.sft.enabled and "enabled" in self.sft.model_fields_set:
            raise ValueError("sft.enabled: rl: reward_model trains the reward model from model.path, with no SFT "
                             "stage; remove it (to start from an SFT model, give its folder as model.path)")
        self.sft = self.sft.model_copy(update={"enabled": False})
        ignored = [f"{name}.{k}" for name in REWARD_MODEL_RUN_UNREAD
                   for k in not_default(getattr(self, name), type(getattr(self, name)).model_fields)
                   if k != "seed" and not (name == "sft" and k == "enabled")]
        if ignored:
            raise ValueError(f"{', '.join(ignored)}: not read under rl: reward_model (it trains, evaluates and "
                             f"registers a reward model only); remove {'them' if len(ignored) > 1 else 'it'}")

    @model_validator(mode="after")
    def _machine_has_what_train_asks(self):
        """train.device / precision / attn_implementation, and grpo.optim adamw_8bit, that this machine cannot
        run fail here, naming the key, not in the middle of a run (stages/runtime/devices.py check_machine)."""
        from stages.runtime import devices

        devices.check_machine(self.train)
        if self.uses_rounds and self.grpo.optim == "adamw_8bit":
            if devices.device(self.train).type != "cuda":
                raise ValueError("grpo.optim: adamw_8bit is bitsandbytes' 8-bit AdamW, which needs a CUDA GPU; "
                                 "this run trains on the CPU (train.device). Use grpo.optim: adamw, or adafactor "
                                 "for less optimizer memory")
            import importlib.util

            if importlib.util.find_spec("bitsandbytes") is None:
                raise ValueError("grpo.optim: adamw_8bit needs the bitsandbytes package, not installed here "
                                 "(pip install bitsandbytes); or use grpo.optim: adamw")
        if (self.rollout.engine == "vllm" and self.rollout.vllm.sleep_mode
                and devices.device(self.train).type != "cuda"):
            raise ValueError("rollout.vllm.sleep_mode frees a GPU's memory between rounds (vLLM's sleep mode, "
                             "CUDA only); this run has no GPU (train.device): set it false")
        if (self.train.precision == "fp16" and self.train.num_processes > 1 and self.train.strategy == "fsdp"
                and self.uses_rounds):
            raise ValueError("train.precision: fp16 with train.strategy: fsdp is not built for the optimize stage "
                             "(its gradient scaler would check each rank's shard alone); use bf16, or strategy ddp")
        return self

    @property
    def uses_rounds(self) -> bool:
        """True for the rollout/score/optimize methods (grpo, gdpo, ebft); False for the DPO family."""
        return self.rl in ROUND_METHODS

    @model_validator(mode="after")
    def _seed_reaches_every_section(self):
        if self.seed is not None:
            for section in SEEDED_SECTIONS:
                setattr(self, section, getattr(self, section).model_copy(update={"seed": self.seed}))
        return self

    @model_validator(mode="after")
    def _batches_split_across_processes(self):
        """Each of train.num_processes ranks takes micro_batch_size / num_processes rows
        (stages/runtime/distributed.py)."""
        from stages.runtime.distributed import per_device

        n = self.train.num_processes
        if n > 1 and self.sft.enabled:
            per_device(self.sft.micro_batch_size, n, "sft.micro_batch_size")
        if n > 1 and not self.uses_rounds:
            per_device(self.dpo.micro_batch_size, n, "dpo.micro_batch_size")
        if n > 1 and "reward_model" in self.score.reward_funcs:
            per_device(self.reward_model.micro_batch_size, n, "reward_model.micro_batch_size")
        if n > 1 and self.train.strategy == "fsdp" and self.rl == "ebft" and self.ebft.ce_coef:
            raise ValueError("ebft.ce_coef with train.strategy: fsdp is not built (its reference forward runs on "
                             "some ranks' micro-batches only, and a sharded model needs the same passes on every "
                             "rank); use train.strategy: ddp, or ebft.ce_coef: 0")
        if n > 1 and self.train.strategy == "fsdp" and self.grpo.optim in ("adafactor", "adamw_8bit"):
            raise ValueError(f"train.strategy: fsdp shards the optimizer state, which grpo.optim {self.grpo.optim} "
                             "keeps in shapes of its own (factored or 8-bit); use grpo.optim adamw or sgd with fsdp, "
                             "or train.strategy: ddp")
        return self

    @model_validator(mode="after")
    def _splits_of_datasets(self):
        """transform.datasets makes the prompts splits train and eval only: SFT and eval read one of them."""
        if not self.transform.datasets:
            return self
        splits = ", ".join(PROMPT_SPLITS_OF_DATASETS)
        if self.sft.enabled and self.sft.split not in PROMPT_SPLITS_OF_DATASETS:
            raise ValueError(f"sft.split is {self.sft.split!r}, but transform.datasets makes the prompts splits "
                             f"{splits}. "
                             "Set sft.enabled: false (the policy starts from the model as it is, as axolotl's RL "
                             "runs do), or sft.split: train to warm-start on the datasets' rows (with "
                             "sft.completion_field naming the target column, e.g. answer)")
        if self.eval.split not in PROMPT_SPLITS_OF_DATASETS:
            raise ValueError(f"eval.split is {self.eval.split!r}, but transform.datasets makes the prompts splits "
                             f"{splits} (eval: test_datasets or val_set_size); set eval.split: eval")
        return self

    @model_validator(mode="after")
    def _model_name_per_config(self):
        """export.model_name unset: the config's name, so two configs never share a registered model."""
        if self.export.model_name is None:
            self.export = self.export.model_copy(update={"model_name": self.name})
        return self

    @model_validator(mode="after")
    def _method_options_follow_rl(self):
        if self.rl in DPO_FAMILY and self.dpo.rl != self.rl:
            self.dpo = self.dpo.model_copy(update={"rl": self.rl})
        if self.rl == "gdpo":  # as axolotl: gdpo means normalize_then_sum, and says so if told otherwise
            if ("multi_objective_aggregation" in self.score.model_fields_set
                    and self.score.multi_objective_aggregation != "normalize_then_sum"):
                raise ValueError("rl: gdpo uses score.multi_objective_aggregation: normalize_then_sum; "
                                 f"got {self.score.multi_objective_aggregation!r} (use rl: grpo for that)")
            self.score = self.score.model_copy(update={"multi_objective_aggregation": "normalize_then_sum"})
        if self.grpo.reroll_max_groups > self.rollout.prompts_per_round:
            raise ValueError(f"grpo.reroll_max_groups is {self.grpo.reroll_max_groups} but a round samples "
                             f"rollout.prompts_per_round = {self.rollout.prompts_per_round} prompts; re-rolled "
                             "prompts take the place of the round's own, so set it at most that")
        if self.preferences is None and self.uses_rounds and "reward_model" in self.score.reward_funcs:
            # demo rows of the kind the reward model trains on
            wanted = "stepwise" if self.reward_model.kind == "prm" else "pair"
            if "kind" in self.demo_pairs.model_fields_set and self.demo_pairs.kind != wanted:
                raise ValueError(f"reward_model.kind: {self.reward_model.kind} trains on {wanted} rows; "
                                 f"demo_pairs.kind is {self.demo_pairs.kind!r} (set it to {wanted!r} or leave it out)")
            if self.demo_pairs.kind != wanted:
                self.demo_pairs = self.demo_pairs.model_copy(update={"kind": wanted})
        return self

    @model_validator(mode="after")
    def _ebft_sets_rollout(self):
        """ebft.n_samples_per_prompt / generate_max_len / temperature / top_p set rollout.num_generations /
        max_completion_length / temperature / top_p."""
        if self.rl != "ebft":
            return self
        if self.ebft.rl_coef == 0 and self.ebft.ce_coef == 0:
            raise ValueError("ebft.rl_coef and ebft.ce_coef are both 0: the optimize loss would be 0 and nothing "
                             "would train; give one of them a weight")
        for mine, theirs in (("n_samples_per_prompt", "num_generations"),
                             ("generate_max_len", "max_completion_length"), ("temperature", "temperature"),
                             ("top_p", "top_p")):
            value = getattr(self.ebft, mine)
            if value is None:
                continue
            if theirs in self.rollout.model_fields_set and getattr(self.rollout, theirs) != value:
                raise ValueError(f"ebft.{mine} is {value} but rollout.{theirs} is {getattr(self.rollout, theirs)}; "
                                 f"they are the same setting under rl: ebft: set one of them")
            self.rollout = self.rollout.model_copy(update={theirs: value})
        if self.ebft.mode == "strided":
            self._strided_fits()
        return self

    def _strided_fits(self) -> None:
        """ebft.mode: strided samples blocks with its own block-parallel generator (stages/training/ebft_strided.py)."""
        rollout = self.rollout
        if self.ebft.generate_max_len is None:  # axolotl's default 8, unless rollout says otherwise
            length = rollout.max_completion_length if "max_completion_length" in rollout.model_fields_set else 8
            self.ebft = self.ebft.model_copy(update={"generate_max_len": length})
            self.rollout = rollout.model_copy(update={"max_completion_length": length})
        sampler = "samples its blocks in this process with a strided attention mask (stages/training/ebft_strided.py)"
        problems = {"rollout.engine": (rollout.engine != "transformers", "transformers", sampler),
                    "rollout.source": (rollout.source != "prompts", "prompts", sampler),
                    "rollout.rollout_func": (rollout.rollout_func is not None, "null", sampler),
                    "rollout.max_prompt_length": (rollout.max_prompt_length is not None, "null", sampler),
                    "rollout.worker_process": (rollout.worker_process, "false", sampler),
                    "grpo.reroll_start_fraction": (self.grpo.reroll_start_fraction < 1.0, "1.0 (off)",
                                                   "does not re-roll blocks (a block's prompt is a document prefix)")}
        for key, (bad, wanted, why) in problems.items():
            if bad:
                raise ValueError(f"ebft.mode: strided {why}; {key} must be {wanted}")

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]


def not_default(section: BaseModel, names) -> list[str]:
    """Those of `names` whose value in `section` differs from the field's default (sorted)."""
    fields = type(section).model_fields
    return sorted(name for name in names
                  if getattr(section, name) != fields[name].get_default(call_default_factory=True))


def axolotl_devices(keys: dict) -> dict[str, tuple]:
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
    kernels = {"flash_attention": "flash_attention_2", "sdp_attention": "sdpa", "eager_attention": "eager"}
    chosen = [k for k in kernels if keys.get(k) is True]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} are all true: choose one attention kernel "
                         "(train.attn_implementation)")
    if chosen:
        out["attn_implementation"] = (kernels[chosen[0]], chosen[0])
    return out


class ConfigError(ValueError):
    """A config file or override that does not validate; the message is for people."""


def apply_override(data: dict, override: str) -> None:
    """Set `a.b.c=value` in nested dicts; the value is parsed as YAML (2 -> int, [a, b] -> list)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected KEY.PATH=VALUE, e.g. grpo.rounds=2")
    path, raw = override.split("=", 1)
    keys = path.strip().split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else None


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Valid key names of the section at `loc` (for suggestions); a dict or list of sections
    (`score.remote_verifiers.<name>`) is walked through its key or index."""
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        field = model.model_fields.get(part) if isinstance(part, str) else None
        annotation = getattr(field, "annotation", None)
        if typing.get_origin(annotation) in (dict, list) and parts:
            annotation = typing.get_args(annotation)[-1]
            parts.pop(0)  # the entry's key or index
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _describe(error: dict, source: str) -> str:
    loc = tuple(error["loc"])
    path = ".".join(str(p) for p in loc)
    if error["type"] == "extra_forbidden":
        valid = _fields_at(PipelineConfig, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?" if close else ""
        return f"{source}: unknown key {path!r}{hint} (valid here: {', '.join(valid)})"
    if error["type"] == "value_error":
        return f"{source}: {path or '<top level>'}: {error['msg'].removeprefix('Value error, ')}"
    value = error.get("input")
    shown = f"{value!r} ({type(value).__name__})" if not isinstance(value, dict) else "a mapping"
    return f"{source}: {path or '<top level>'}: got {shown}; expected {error['msg'].lower()}"


def config_differences(before: dict, after: dict) -> list[str]:
    """Dotted keys whose values differ between two resolved configs, as `key (old -> new)`."""
    from tasks.lineage import flatten

    old, new = flatten(before), flatten(after)
    return [f"{k} ({old.get(k, '-')} -> {new.get(k, '-')})" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]


def _axolotl_vllm_moves(vllm: dict, trl: dict) -> list[tuple[str, str, str, object]]:
    """axolotl's `vllm:` section as (their key, section, field, value) moves into rollout.vllm; the keys of
    `axolotl vllm-serve`'s server (AXOLOTL_VLLM_SERVER_KEYS), and any other, are errors naming them."""
    if not isinstance(vllm, dict):
        raise ValueError(f"vllm: expected a mapping of vLLM settings, got {type(vllm).__name__}")
    server = [k for k in AXOLOTL_VLLM_SERVER_KEYS
              if (vllm if k.startswith("vllm.") else trl).get(k.split(".", 1)[1]) is not None]
    if server:
        raise ValueError(f"{', '.join(server)}: where `axolotl vllm-serve` (TRL's weight-sync server) listens; "
                         "posttrain has no such server: rollout.engine vllm (what trl.use_vllm sets) runs vLLM in the "
                         "run's own process and loads each round's weights itself; vllm_server talks to `vllm serve` "
                         "OpenAI servers at rollout.vllm.server_url. Remove them")
    moves = []
    for key, value in vllm.items():
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


def _axolotl_trl_moves(trl: dict) -> list[tuple[str, str, str, object]]:
    """axolotl's `trl:` section as (their key, section, field, value) moves (AXOLOTL_TRL_KEYS, use_vllm,
    vllm_lora_sync, log_completions); a vllm_mode other than colocate, or a key posttrain has no counterpart
    of, is an error naming it. The server keys (AXOLOTL_VLLM_SERVER_KEYS) are left to `_axolotl_vllm_moves`."""
    moves = []
    for key, value in trl.items():
        if f"trl.{key}" in AXOLOTL_VLLM_SERVER_KEYS:
            continue  # refused by _axolotl_vllm_moves
        if key == "vllm_mode":
            if value != "colocate":
                raise ValueError(f"trl.vllm_mode: {value!r}: posttrain has no TRL vLLM server to connect to; "
                                 "colocate (vLLM in the run's own process, rollout.engine: vllm) is what it runs")
            continue
        if isinstance(value, (bool, str)) and (key, value) in AXOLOTL_TRL_NO_OPS:
            continue
        if key == "log_completions":  # sample completions are logged each round (tracking.completions_per_round)
            moves.append(("trl.log_completions", "tracking", "completions_per_round", 0))
            continue
        if key == "vllm_lora_sync":  # axolotl: adapters to vLLM through files (true) or merged weights (false)
            moves.append(("trl.vllm_lora_sync", "rollout", "vllm.lora_sync", "adapter" if value else "merged"))
            continue
        if key == "use_vllm":
            moves.append(("trl.use_vllm", "rollout", "engine", "vllm" if value else "transformers"))
        elif key in AXOLOTL_TRL_KEYS:
            moves.append((f"trl.{key}", *AXOLOTL_TRL_KEYS[key], value))
        else:
            raise ValueError(f"trl.{key}: not an option posttrain has under another name (trl: takes "
                             f"{', '.join(sorted(AXOLOTL_TRL_KEYS))}, use_vllm, vllm_mode, vllm_lora_sync, "
                             "log_completions); set "
                             "the posttrain key instead or remove it")
    return moves


def _axolotl_training_moves(data: dict, trainer: str) -> list[tuple[str, str, str, object]]:
    """axolotl's top-level training keys (AXOLOTL_TRAINING_KEYS), popped from `data`, as (their key, section,
    field, value) moves into `trainer`'s section (grpo, dpo or reward_model); one that has no meaning for that
    trainer, or a value posttrain does not build, is an error naming it."""
    moves = []
    for key in [k for k in AXOLOTL_TRAINING_KEYS if k in data]:
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
            if trainer == "grpo":
                raise ValueError("sequence_len: a GRPO run's lengths are rollout.max_completion_length (and the "
                                 "vLLM engine's rollout.vllm.max_model_len); set those")
            field = "max_length"
        if key == "eval_steps" and trainer == "grpo":
            raise ValueError("eval_steps: a GRPO/EBFT run measures held-out accuracy between rounds: set "
                             "eval.every_rounds (every N rounds) instead")
        if key in ("num_epochs", "max_steps") and trainer == "grpo":
            raise ValueError(f"{key}: GRPO here runs grpo.rounds rounds of rollout -> score -> optimize "
                             "(each grpo.gradient_accumulation_steps micro-batches per optimizer step); set "
                             "grpo.rounds")
        moves.append((key, trainer, field, "none" if key == "adapter" and value is None else value))
    return moves


def _with_value(target: dict, field: str, value, their_key: str, where: str) -> dict:
    """A section's raw dict with `field` (dotted for a nested section: vllm.dtype) set to `value` from axolotl's
    `their_key`; a different value already there is an error naming both keys."""
    head, _, rest = field.partition(".")
    if rest:
        inner = _section_dict(target, head)
        return target if inner is None else {**target, head: _with_value(inner, rest, value, their_key,
                                                                         f"{where}.{head}")}
    if head in target and target[head] != value:
        raise ValueError(f"{their_key} (axolotl's key) and {where}.{head} are the same setting; set one of them")
    return {**target, head: value}


def _section_dict(data: dict, section: str) -> dict | None:
    """The raw config's `section` as a dict (set fields only, if it is already a model) for a validator to add
    keys to; None when it is neither (its own validation then says what it should be)."""
    target = data.get(section) or {}
    if isinstance(target, BaseModel):
        target = target.model_dump(exclude_unset=True)
    return target if isinstance(target, dict) else None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last one silently, so
    the first value would be accepted and ignored)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is set twice in one section (line {seen[key] + 1} and line "
                                f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read YAML, apply overrides, validate. Raises ConfigError naming file and key path."""
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for override in overrides or []:
        apply_override(data, override)
    source = str(path) + (" (with overrides)" if overrides else "")
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError("\n".join(_describe(err, source) for err in e.errors())) from None
