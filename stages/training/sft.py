"""Supervised warm start with TRL's SFTTrainer on prompt/completion chat rows.

Loss on completion tokens only (TRL's default for prompt-completion data). Rows without a prompt (raw
documents, transform.type: text) train as language modelling on the whole text (TRL's "text" rows). Full
fine-tuning of the small base model; the result is the policy GRPO starts from. Device and precision:
`devices` (stages/runtime/devices.py): fp32 weights and optimizer state, forward under the Trainer's bf16/fp16
autocast where the precision asks for it; the saved model is fp32.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from stages.runtime import checkpoints
from stages.runtime import devices as devices_module
from stages.runtime.devices import DeviceConfig
from stages.runtime.distributed import per_device
from stages.runtime.keys import not_in_key
from stages.training.trainer_setup import common_arguments


class SFTConfig(BaseModel):
    """Warm-start settings (names as in TRL's SFTConfig)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool | None = None
    """true: warm-start the policy on the demonstrations of `split`; false: the base model is the policy as it
    is. Unset: a config trains what it names (flows/config.py `_sft_runs_where_asked`): true where the prompts
    have the split `split` (the built-in demo task's, or a transform.paths entry of that name), false for your own
    data without one (transform.datasets, or paths without it), which goes straight to the method as in axolotl's
    RL runs and TRL's GRPOTrainer. The run says which at its start; the saved config holds the value."""
    split: str = "sft"
    """Which prompts split holds the demonstrations."""
    completion_field: str = "teacher_completion"
    """Column of the prompts table with the assistant's target text."""
    num_train_epochs: float = Field(3.0, gt=0)
    """Passes over the demonstrations (fractions allowed, as in TRL's SFTConfig)."""
    learning_rate: float = Field(3e-3, gt=0)
    """Peak learning rate of the cosine schedule (AdamW). The default suits the small built model; a
    pretrained one wants ~1e-5 to 1e-4."""
    micro_batch_size: int = Field(32, ge=1)
    """Demonstrations per forward/backward pass (TRL's per_device_train_batch_size). Higher: faster, more memory."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step: the effective batch is micro_batch_size times this (times processes)."""
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    """Share of the optimizer steps the learning rate warms up over, linearly from 0."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    seed: int = 0
    """Seed of the data order (and of dropout, where the model has any)."""
    save_steps: int | None = not_in_key(100, ge=1)
    """Optimizer steps between checkpoints a rerun resumes from (TRL/HF `save_steps`; stages/runtime/checkpoints.py);
    null: none. Not part of the stage's key: it changes when the weights are saved, not what they are."""


def _read_rows(cfg: SFTConfig, prompts_path: Path) -> list[dict]:
    """The split's {prompt, <completion_field>} rows; a ValueError naming sft.completion_field without that column."""
    import pyarrow.parquet as pq

    table = pq.read_table(prompts_path)
    if cfg.completion_field not in table.column_names:
        raise ValueError(
            f"sft.completion_field: column {cfg.completion_field!r} is not in {prompts_path} "
            f"(columns: {table.column_names})"
        )
    return table.select(["prompt", cfg.completion_field]).to_pylist()


def _to_dataset(rows: list[dict], completion_field: str):
    """TRL's conversational prompt/completion rows, or its "text" rows when no row has a prompt (raw documents,
    transform.type: text: language modelling on them)."""
    import datasets

    if all(not r["prompt"] for r in rows):
        return datasets.Dataset.from_list([{"text": r[completion_field]} for r in rows])
    return datasets.Dataset.from_list(
        [{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": r[completion_field]}]}
         for r in rows])


def _report_metrics(on_metrics: Callable[[dict, int], None] | None):
    """A TrainerCallback passing each log's numeric entries, keys prefixed "sft/", and the step to on_metrics."""
    from transformers import TrainerCallback

    class ReportMetrics(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if on_metrics and logs:
                on_metrics({f"sft/{k}": v for k, v in logs.items() if isinstance(v, (int, float))}, state.global_step)

    return ReportMetrics()


def _trl_config(cfg: SFTConfig, output_dir: Path, per_device_batch_size: int, num_rows: int, devices: DeviceConfig,
                prepared: bool):
    """TRL SFTConfig for `cfg` on num_rows rows: cosine schedule with warmup_ratio of the steps, logs every 10 steps,
    checkpoints and device/precision from common_arguments; `prepared`: the dataset is already tokenized."""
    from trl import SFTConfig as TRLSFTConfig

    return TRLSFTConfig(
        output_dir=str(output_dir),
        num_train_epochs=cfg.num_train_epochs,
        learning_rate=cfg.learning_rate,
        per_device_train_batch_size=per_device_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        warmup_steps=math.ceil(cfg.warmup_ratio * num_rows * cfg.num_train_epochs / cfg.micro_batch_size),
        lr_scheduler_type="cosine",
        weight_decay=cfg.weight_decay,
        logging_steps=10,
        # use_cpu, bf16/fp16 autocast, gradient checkpointing: the devices policy, never TRL's defaults (its
        # SFTConfig defaults to bf16, which a CPU without AVX512-BF16/AMX emulates ~25x slower, with rounding
        # that differs between CPU models: hence fp32 stays the CPU default in devices.precision).
        **common_arguments(cfg.seed, cfg.save_steps, devices),
        disable_tqdm=False,
        dataset_kwargs={"skip_prepare_dataset": True} if prepared else None,
        include_num_input_tokens_seen="non_padding",  # the summary's tokens_trained (tasks/costs.py)
    )


def _save(trainer, tokenizer, out_dir: Path, trainer_dir: str, work_dir: Path | None, group) -> None:
    """Rank 0 writes the model and tokenizer to out_dir; once every rank is there, rank 0 deletes the trainer's
    folder (trainer_dir) unless it is work_dir."""
    if trainer.is_world_process_zero():
        trainer.model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    if group is not None:
        group.barrier()  # the folder is complete, and no rank still reads the trainer's folder
    if work_dir is None and trainer.is_world_process_zero():
        import shutil

        shutil.rmtree(trainer_dir, ignore_errors=True)


def run(
    cfg: SFTConfig,
    model_dir: Path,
    prompts_path: Path,
    out_dir: Path,
    on_metrics: Callable[[dict, int], None] | None = None,
    work_dir: Path | None = None,
    group=None,
    devices: DeviceConfig | None = None,
) -> dict:
    """Fine-tune the model in model_dir on the split's prompt/completion pairs; save to out_dir.

    Checkpoints go to work_dir (stages/runtime/checkpoints.py), and training continues from the newest
    complete one found there; None: a folder inside out_dir, deleted at the end.

    `group` (stages.runtime.distributed.Group, on ranks launched by stages.runtime.distributed.launch): HF Trainer runs
    DDP over the already-initialized process group; each rank takes micro_batch_size / world_size rows
    per micro-batch, so the global batch, the data order and (TRL averages tokens across devices) the
    loss are one process's. Rank 0 alone writes out_dir.

    `devices` (stages/runtime/devices.py; None: DeviceConfig(), auto): where the model trains and in which precision;
    the summary names the resolved device and precision."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTTrainer

    rows = _read_rows(cfg, prompts_path)
    dataset = _to_dataset(rows, cfg.completion_field)
    world_size = group.world_size if group is not None else 1
    per_device_batch_size = per_device(cfg.micro_batch_size, world_size, "sft.micro_batch_size")
    devices = devices or DeviceConfig()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = devices_module.load_trainable(AutoModelForCausalLM, model_dir, devices)
    prepared = checkpoints.load_prepared(work_dir)  # this key's tokenized rows, saved by an earlier start
    args = _trl_config(cfg, work_dir or out_dir / "_trainer", per_device_batch_size, len(rows), devices,
                       prepared is not None)
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset if prepared is None else prepared, processing_class=tokenizer,
        callbacks=[_report_metrics(on_metrics)],
    )
    if trainer.is_world_process_zero():
        checkpoints.save_prepared(work_dir, trainer.train_dataset)  # tokenized: a rerun of this key skips it
    result, resumed_from = checkpoints.train(trainer, Path(args.output_dir))
    _save(trainer, tokenizer, out_dir, args.output_dir, work_dir, group)
    return {"train_loss": result.training_loss, "steps": result.global_step, "examples": len(rows),
            "resumed_from_step": resumed_from, "reused_tokenized_dataset": prepared is not None,
            "tokens_trained": int(trainer.state.num_input_tokens_seen),  # non-padding input tokens, every epoch
            **devices_module.describe(devices)}
