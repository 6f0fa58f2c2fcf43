"""What every TRL/HF trainer of posttrain is set up with (sft, dpo family, reward models): the training arguments
they share, the callback that hands their logs to `on_metrics`, and the quieting of TRL's console output. No
stage logic; stages/training/grpo.py trains without an HF Trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from stages.runtime import checkpoints
from stages.runtime import devices as devices_module
from stages.runtime.devices import DeviceConfig


def common_arguments(seed: int, save_steps: int | None, devices: DeviceConfig | None = None) -> dict:
    """The arguments every trainer here gets: the seed, checkpoints every `save_steps` (stages/runtime/checkpoints.py),
    device and precision from `devices` (stages/runtime/devices.py trainer_arguments, never TRL's own defaults; None:
    auto), no reporting (metrics go to on_metrics) and no dataloader workers."""
    return dict(report_to=[], seed=seed, **checkpoints.training_args(save_steps),
                **devices_module.trainer_arguments(devices), dataloader_num_workers=0)


def training_args(cfg, output_dir: Path, section: str = "dpo", devices: DeviceConfig | None = None) -> dict:
    """TRL/HF training arguments of the preference stages (dpo, reward_model): the config's schedule and
    `common_arguments`. Under a process group (train.num_processes, stages/runtime/distributed.py) each rank takes
    micro_batch_size / world_size rows, so the global batch is the config's."""
    from stages.runtime.distributed import per_device, world_size

    return dict(
        output_dir=str(output_dir),
        learning_rate=cfg.learning_rate,
        num_train_epochs=cfg.num_train_epochs,
        max_steps=cfg.max_steps if cfg.max_steps is not None else -1,
        per_device_train_batch_size=per_device(cfg.micro_batch_size, world_size(), f"{section}.micro_batch_size"),
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        max_length=cfg.max_length,
        logging_steps=cfg.logging_steps,
        **common_arguments(cfg.seed, cfg.save_steps, devices),
        disable_tqdm=True,
    )


def metrics_callback(prefix: str, on_metrics: Callable[[dict, int], None] | None, logged: list[dict]):
    """A TrainerCallback passing each log's numeric entries to on_metrics (keys prefixed) and
    keeping the training ones (those with a loss) in `logged`."""
    from transformers import TrainerCallback

    class ReportMetrics(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            numeric = {k: float(v) for k, v in (logs or {}).items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if numeric and "loss" in numeric:
                logged.append(numeric)
            if on_metrics and numeric:
                on_metrics({prefix + k: v for k, v in numeric.items()}, state.global_step)

    return ReportMetrics()


def check_eval_steps(section: str, cfg, held_out: bool, rows: str, preferences_dir: Path) -> None:
    """`<section>.eval_steps` needs held-out `rows` to measure: an error naming the key when there are none."""
    if cfg.eval_steps and not held_out:
        raise ValueError(f"{section}.eval_steps: there are no held-out {rows} to evaluate ({section}.eval_split "
                         f"{cfg.eval_split!r} in {preferences_dir}); give preferences.val_set_size or test_datasets, "
                         "or remove eval_steps")


def periodic_eval(every: int | None, evaluate: Callable[[object], float], name: str,
                  on_metrics: Callable[[dict, int], None] | None, history: list[list]):
    """A TrainerCallback that every `every` optimizer steps (axolotl's `eval_steps`, HF's eval_strategy "steps")
    runs `evaluate(model)` on the model being trained, passes {name: value} and the step to on_metrics and
    appends [step, value] to `history`. Not at the last step: the stage's own after-training eval is that one.
    The evaluation runs without gradients in eval mode and draws no random numbers, so the trained weights are
    the same with or without it; every rank runs it (a model sharded across ranks needs them all)."""
    from transformers import TrainerCallback

    class PeriodicEval(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            if every and step % every == 0 and step < state.max_steps:
                value = evaluate(model)
                history.append([step, value])
                if on_metrics:
                    on_metrics({name: value}, step)

    return PeriodicEval()


def quiet_trainer(trainer, cfg):
    """After building a TRL trainer: no printed metric lines (they go to on_metrics), and the LoRA
    dropout TRL's disable_dropout zeroed set back to `cfg.lora_dropout`."""
    import torch
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    if cfg.adapter == "lora" and cfg.lora_dropout > 0:
        for name, module in trainer.model.named_modules():
            if ".lora_dropout." in f"{name}." and isinstance(module, torch.nn.Dropout):
                module.p = cfg.lora_dropout
    return trainer
