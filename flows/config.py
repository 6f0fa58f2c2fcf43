"""The composed pipeline config: one pydantic model per stage section, loaded from YAML
with dotted command-line overrides (`grpo.rounds=2 rollout.temperature=0.8`).

Errors name the file, the key's full path, and for an unknown key the closest valid name.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import typing
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from stages.data.base_model import BaseModelConfig
from stages.data.demo_data import SPLITS as DEMO_SPLITS, DemoDataConfig
from stages.data.demo_pairs import DemoPairsConfig
from stages.data.preferences import PreferenceConfig
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
from flows import axolotl, nemo_gym
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
SCORE_WHERE_KEYS = ("reward_num_workers", "backend", "ray", "reward_timeout_s", "reward_batch_size")
"""score keys that say where and how reward functions run, not what they score."""
PROMPT_SPLITS_OF_DATASETS = ("train", "eval")
"""The prompts splits transform.datasets makes."""
NO_EVAL = ("a run whose rows are a train split only (no eval split: set transform.test_datasets or "
           "val_set_size, or transform.paths.eval, to evaluate)")
"""Why the eval section is unread where `runs_eval` is False with prompts."""
NO_PROMPTS = ("rl: {rl} on your preferences and model.path with no prompt rows (it trains on the preferences and "
              "measures held-out preference accuracy on their eval split)")
"""Why the eval and transform sections are unread where `reads_prompts` is False."""


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
    """The new model becomes champion when metric >= champion's metric + min_gain (otherwise challenger), and
    only if its eval accuracy beats the constant baseline, whatever min_gain says (flows/retrain.py `promote`).
    0: ties promote the newer model; higher: keep the champion unless clearly beaten; negative: promote a model
    up to |min_gain| worse than the champion."""
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

    _translation_notes: list[str] = PrivateAttr(default_factory=list)

    @property
    def translation_notes(self) -> list[str]:
        """What axolotl's length keys became and why (`_axolotl_training_length`); `posttrain validate` prints them."""
        return list(self._translation_notes)

    def __eq__(self, other) -> bool:
        """Equal when every field is: the notes on how a config was written (`translation_notes`) do not count, so a
        translated config equals its saved, re-loaded run config."""
        return isinstance(other, PipelineConfig) and self.model_dump() == other.model_dump()

    __hash__ = None  # as BaseModel's: mutable, not hashable

    @model_validator(mode="after")
    def _numbers_are_finite(self):
        """Every number in the config is finite: a field's own bounds may let inf through (`learning_rate > 0`),
        and no option means anything at inf or NaN. Checked on the whole config, so no field can forget it."""
        for key, value in _numbers(self.model_dump()):
            if not math.isfinite(value):
                raise PydanticCustomError("not_finite", "{key}: got {value}; expected a finite number",
                                          {"key": key, "value": str(value)})
        return self

    @model_validator(mode="after")
    def _sft_runs_where_asked(self):
        """sft.enabled unset: true where the prompts will have the split sft.split to warm-start on (the demo task
        makes one; so may a transform.paths entry of that name), false otherwise: your own data goes straight to the
        method (DESIGN.md, "a config trains what it names"), and a run without prompts (`reads_prompts`) has
        nothing to warm-start on. rl: reward_model trains no policy (its own check)."""
        if self.sft.enabled and not self.reads_prompts:
            raise ValueError(f"sft.enabled: the SFT warm start trains on the prompts' rows, and this rl: {self.rl} run "
                             "on your preferences and model.path names none; remove it, or give the rows as "
                             "transform.paths (with sft.split and sft.completion_field)")
        if self.sft.enabled is None and self.rl != "reward_model":
            if self.transform.datasets or not self.reads_prompts:
                asked = False
            elif self.transform.paths:
                asked = self.sft.split in self.transform.paths
            else:
                asked = self.sft.split in DEMO_SPLITS
            self.sft = self.sft.model_copy(update={"enabled": asked})
        return self

    @model_validator(mode="before")
    @classmethod
    def _preference_types_follow_rl(cls, data):
        """preferences.namespace follows `rl` (kto: unpaired rows; every other method: pairs), so a `type`
        means what it means in axolotl under that method (chatml.argilla is a pair format for dpo, an
        unpaired one for kto). Defined first, so it runs after the validators below move axolotl's keys (pydantic
        runs `before` validators last-defined first)."""
        if not isinstance(data, dict):
            return data
        prefs = axolotl.section_dict(data, "preferences")
        if not prefs:
            return data
        wanted, given = ("kto" if data.get("rl") == "kto" else "pairs"), prefs.get("namespace")
        if given is not None and given != wanted:
            raise ValueError(f"preferences.namespace: {prefs.get('namespace')!r} does not fit rl: "
                             f"{data.get('rl', 'grpo')} (it reads {wanted} rows); leave it out, it follows rl")
        return {**data, "preferences": {**prefs, "namespace": "kto"}} if wanted == "kto" else data

    @model_validator(mode="before")
    @classmethod
    def _axolotl_training_length(cls, data):
        """axolotl's max_steps / num_epochs / sequence_len and trl.steps_per_generation / generation_batch_size under
        a round method into grpo.rounds, rollout.prompts_per_round and rollout.max_prompt_length, the notes on what
        was chosen and why kept for `translation_notes` (flows/axolotl.py `move_training_length`). Defined before
        the validators that move axolotl's other keys, so it runs after them (it reads the sections they fill)."""
        data, notes = axolotl.move_training_length(data)
        axolotl.keep_notes(notes)
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _translation_notes_kept(cls, data, handler):
        """The config with the notes the axolotl validators kept while it validated (`translation_notes`). A wrap
        validator runs outside every `before` one."""
        with axolotl.collecting_notes() as notes:
            cfg = handler(data)
        cfg._translation_notes = notes
        return cfg

    @model_validator(mode="before")
    @classmethod
    def _axolotl_top_level_keys(cls, data):
        """axolotl's top-level `datasets`, `base_model`, ... into their sections (flows/axolotl.py)."""
        return axolotl.move_top_level_keys(data)

    @model_validator(mode="before")
    @classmethod
    def _axolotl_training_keys(cls, data):
        """axolotl's `trl:`, `vllm:` and top-level training keys into their sections (flows/axolotl.py)."""
        return axolotl.move_training_keys(data, frozenset(cls.model_fields))

    @model_validator(mode="before")
    @classmethod
    def _axolotl_device_keys(cls, data):
        """axolotl's `bf16`, `fp16`, `gradient_checkpointing`, attention keys into train (flows/axolotl.py)."""
        return axolotl.move_device_keys(data)

    @model_validator(mode="before")
    @classmethod
    def _axolotl_nemo_gym_plugin(cls, data):
        """axolotl's NeMo Gym plugin and its `nemo_gym_*` keys into datasets, trl.reward_funcs and score
        (flows/nemo_gym.py). Defined here, so it runs before the validators above read `datasets` and `trl`, and after
        the one below sets `rl`."""
        data, notes = nemo_gym.move_nemo_gym_keys(data)
        axolotl.keep_notes(notes)
        return data

    @model_validator(mode="before")
    @classmethod
    def _axolotl_reward_model_flags(cls, data):
        """axolotl's `reward_model: true` / `process_reward_model: true` into rl: reward_model (flows/axolotl.py).
        Defined after the other axolotl validators, so it runs before them (they read `rl`)."""
        return axolotl.reward_model_flags(data)

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

    def unread_sections(self) -> dict[str, str]:
        """{section: why} of the sections the chosen method reads nothing of: a DPO-family run reads no
        rollout/score/grpo/ebft/reward_model; a round-based run no dpo, ebft only under rl: ebft, and the reward
        model's sections only with score.reward_funcs: [reward_model]; rl: reward_model none of the policy's
        (REWARD_MODEL_RUN_UNREAD). A value set there is an error; a run's saved config.yaml leaves them out."""
        if self.rl == "reward_model":
            return {name: "rl: reward_model (it trains, evaluates and registers a reward model only)"
                    for name in REWARD_MODEL_RUN_UNREAD}
        no_eval = {} if self.runs_eval else {"eval": NO_EVAL if self.reads_prompts else NO_PROMPTS.format(rl=self.rl)}
        if self.rl in DPO_FAMILY:
            no_prompts = {} if self.reads_prompts else {"transform": NO_PROMPTS.format(rl=self.rl)}
            return {**{name: f"rl: {self.rl} (one preference-optimization stage, no rounds)" for name in DPO_RUN_UNREAD},
                    **no_eval, **no_prompts}
        trains_reward_model = "reward_model" in self.score.reward_funcs
        return {**no_eval, "dpo": f"rl: {self.rl} (the DPO family's section)",
                **({} if self.rl == "ebft" else {"ebft": f"rl: {self.rl} (rl: ebft's section)"}),
                **({} if trains_reward_model else {name: f"rl: {self.rl} without reward_model in "
                                                   "score.reward_funcs (nothing trains a reward model)"
                                                   for name in REWARD_MODEL_INPUTS})}

    def run_config(self) -> dict:
        """The config as a run saves and logs it (runs/<run>/config.yaml, MLflow params): every field of the
        sections the method reads, without the unread ones (set there, a value would be an error on resume)."""
        dumped = self.model_dump(mode="json")
        for name in self.unread_sections():
            dumped.pop(name, None)
        return dumped

    def _method_reads_its_sections(self) -> None:
        """A field set in a section the method reads nothing of (`unread_sections`) is an error naming it, whether
        or not its value is the default. `seed` is left out: the top-level seed sets every section's."""
        if self.rl == "reward_model":
            return  # _reward_model_run_reads_its_sections
        for name, why in self.unread_sections().items():
            ignored = [f"{name}.{k}" for k in set_fields(getattr(self, name)) if k != "seed"]
            if ignored:
                raise ValueError(f"{', '.join(ignored)}: not read under {why}; remove "
                                 f"{'them' if len(ignored) > 1 else 'it'}")
        trains_reward_model = self.rl not in DPO_FAMILY and "reward_model" in self.score.reward_funcs
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
        ignored = [f"{name}.{k}" for name in REWARD_MODEL_RUN_UNREAD for k in set_fields(getattr(self, name))
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

    @property
    def reads_prompts(self) -> bool:
        """Whether the run builds the prompts table (demo_data or your rows -> transform). False for a DPO-family
        run on your own preferences and model (model.path) that names no prompt rows (transform.paths/datasets):
        it trains on the preferences alone, with no demo data, SFT or prompt eval (axolotl's DPO runs)."""
        return not (self.rl in DPO_FAMILY and self.preferences is not None and self.model.path
                    and not (self.transform.paths or self.transform.datasets))

    @property
    def runs_eval(self) -> bool:
        """Whether the run evaluates its policy on the eval split (base, eval.every_rounds, final, the champion):
        the demo task's, a transform.paths split other than train, transform.datasets' test_datasets or
        val_set_size, or any split eval.split names. False where your rows are a train split only (axolotl's and
        TRL's GRPO examples: the run says so and reports its training metrics) and without prompts."""
        if self.rl == "reward_model" or not self.reads_prompts:
            return False
        if "split" in self.eval.model_fields_set:
            return True
        if self.transform.datasets:
            return bool(self.transform.test_datasets or self.transform.val_set_size)
        if self.transform.paths:
            return set(self.transform.paths) != {"train"}
        return True

    @model_validator(mode="after")
    def _seed_reaches_every_section(self):
        if self.seed is not None:
            for section in SEEDED_SECTIONS:
                setattr(self, section, getattr(self, section).model_copy(update={"seed": self.seed}))
        return self

    @model_validator(mode="after")
    def _too_long_prompts_follow_on_bad_rows(self):
        """transform.on_bad_rows sets rollout.too_long_prompts and eval.too_long_prompts where they are not set: a
        prompt longer than the model's context is a bad row the transform cannot see (it runs before the model
        exists: the quickstart trains its tokenizer on the transform's output), so the stages that meet the
        tokenizer stop on it or leave it out, and their keys hold the choice. Only in sections the method reads
        (_method_reads_its_sections), so a saved config.yaml loads again."""
        reads = (["rollout"] if self.uses_rounds else []) + (["eval"] if self.runs_eval else [])
        for name in reads:
            section = getattr(self, name)
            if "too_long_prompts" not in section.model_fields_set:
                setattr(self, name, section.model_copy(update={"too_long_prompts": self.transform.on_bad_rows}))
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
        if n > 1 and self.train.strategy == "fsdp" and self.grpo.logps_chunk_tokens:
            raise ValueError("grpo.logps_chunk_tokens with train.strategy: fsdp is not built (FSDP2 shards the "
                             "lm_head with the root module, whose forward gathers it; the chunks call the head "
                             "alone); use train.strategy: ddp, or grpo.logps_chunk_tokens: 0")
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
        if self.runs_eval and self.eval.split not in PROMPT_SPLITS_OF_DATASETS:
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
        if self.grpo.scope_rl and (self.rl == "ebft" or self.rollout.source == "atropos"):
            raise ValueError(f"grpo.scope_rl under {'rl: ebft' if self.rl == 'ebft' else 'rollout.source: atropos'}: "
                             "SCOPE-RL resamples groups of the round's own prompts and keeps those that reach "
                             "score.reward_funcs' scope_positive_threshold, which this method does not score with "
                             "(axolotl: rl grpo only); remove it")
        if self.grpo.streaming_partial_batch and self.score.scale_rewards == "batch" and (
                self.rl == "ebft" or self.rollout.source == "atropos"):
            raise ValueError("grpo.streaming_partial_batch with score.scale_rewards batch: streaming divides each "
                             "advantage by its group's std (axolotl's streaming scorer), which the scoring of "
                             f"{'rl: ebft' if self.rl == 'ebft' else 'rollout.source: atropos'} does not do here; set "
                             "scale_rewards: group")
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
                                                   "does not re-roll blocks (a block's prompt is a document prefix)"),
                    "eval.num_samples": (self.eval.samples > 1, "unset",
                                         "evaluates one continuation per block (no pass@k)")}
        for key, (bad, wanted, why) in problems.items():
            if bad:
                raise ValueError(f"ebft.mode: strided {why}; {key} must be {wanted}")
        entries = (self.transform.datasets or []) + (self.transform.test_datasets or [])
        types = {s.type or self.transform.type for s in entries} if entries else {self.transform.type}
        if self.ebft.min_completion_prefix and types <= RAW_DOCUMENT_TYPES:
            raise ValueError(f"ebft.min_completion_prefix: {self.ebft.min_completion_prefix} places blocks after a "
                             f"prompt, and transform.type {' and '.join(sorted(types))} makes raw documents, which have "
                             "none; remove it, or use type ebft_strided_structured.transform (prompt + completion rows)")

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]


RAW_DOCUMENT_TYPES = frozenset({"text", "ebft_pretrain.transform"})
"""transform.type built-ins whose rows are raw documents (no prompt before the text) in ebft.mode: strided."""


def _numbers(value, key: str = ""):
    """(dotted key, number) of every float in a dumped config, lists and dicts walked (`score.reward_weights.1`)."""
    if isinstance(value, float):
        yield key, value
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _numbers(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{key}.{index}")


def set_fields(section: BaseModel) -> list[str]:
    """The fields of `section` a config set (even to the default value) or that differ from their default."""
    return sorted(set(section.model_fields_set) | set(not_default(section, type(section).model_fields)))


def not_default(section: BaseModel, names) -> list[str]:
    """Those of `names` whose value in `section` differs from the field's default (sorted)."""
    fields = type(section).model_fields
    return sorted(name for name in names
                  if getattr(section, name) != fields[name].get_default(call_default_factory=True))


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
        theirs = axolotl.top_level_keys() if len(loc) == 1 else []  # an axolotl config's keys are accepted too
        close = difflib.get_close_matches(str(loc[-1]), [*valid, *theirs], n=1, cutoff=0.5)
        hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?" if close else ""
        also = ", and axolotl's keys: docs/coming-from.md" if theirs else ""
        return f"{source}: unknown key {path!r}{hint} (valid here: {', '.join(valid)}{also})"
    if error["type"] == "not_finite":  # PipelineConfig._numbers_are_finite: the key is in the message
        return f"{source}: {error['msg']}"
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


def code_dirs(config_path: str | Path) -> list[str]:
    """Where `module.fn` user code of a config is found besides sys.path: the config's own folder and the
    working folder (axolotl's `file.fn`), absolute. A resumed run records the first run's (flows/run.py)."""
    return [str(Path(config_path).resolve().parent), str(Path.cwd())]


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read YAML, apply overrides, validate. Raises ConfigError naming file and key path. The config's folder
    and the working folder become importable (`code_dirs`): a reward module beside the config is found."""
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not data:  # an empty file (or only comments, or {}): never a run with every default
        raise ConfigError(f"{path}: empty config (no sections); copy configs/quickstart.yaml and edit it, "
                          "or write the sections you want to change")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for override in overrides or []:
        apply_override(data, override)
    source = str(path) + (" (with overrides)" if overrides else "")
    from stages.runtime.imports import add_code_dirs

    add_code_dirs(code_dirs(path))
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError("\n".join(_describe(err, source) for err in e.errors())) from None
