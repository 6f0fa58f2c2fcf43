"""Reward models on a preferences table: a Bradley-Terry outcome reward model (ORM) with TRL, and a
process reward model (PRM) trained here as TRL's PRMTrainer did.

Reads `<split>.parquet` written by stages/data/preferences.py.

`kind: orm` trains TRL's RewardTrainer (loss -log sigmoid(r(chosen) - r(rejected))) on the rows of
kind `pair`, with a scalar head (AutoModelForSequenceClassification, num_labels=1, head `score`)
initialised from the causal LM folder in model_dir: its transformer body is kept, lm_head is dropped,
the head starts random. The score of a sequence is the head's output at its last non-pad token.

`kind: prm` trains a token classifier (AutoModelForTokenClassification, num_labels=2: 0 bad, 1 good,
head `score`) on the rows of kind `stepwise` (axolotl `stepwise_supervised`) with a plain transformers
Trainer, cross-entropy over the labelled tokens only (-100 elsewhere). TRL 1.16 no longer ships
PRMTrainer; this follows its `tokenize_row` (each step tokenized on its own, steps joined by
`step_separator`, one label per step) except that:
- the prompt is rendered with the chat template plus generation prompt (the steps are the assistant turn);
- a step's label sits on its own last token and the separator only goes between steps (TRL appends it
  to every step and labels it), so the scored text is the completion exactly as the policy wrote it,
  and the tiny model of tests/test_prm.py learns much faster (held-out step accuracy 0.85 vs 0.65,
  majority class 0.65, after 80 steps);
- every step is trained (no `train_on_last_step_only`); too-long rows are dropped, as the ORM does.
A step's score is P(good) at its last token; a sample's score is its weakest step's
(`step_aggregation: min`) or its last step's.

Device and precision: `devices` (stages/runtime/devices.py), like stages/training/dpo.py: the trained model in fp32 with
fp32 optimizer state, forward under the Trainer's bf16/fp16 autocast where the precision asks for it;
the scorer loads a saved folder frozen in the compute dtype. out_dir gets a complete model folder (LoRA
merged into the weights) with the tokenizer and its chat template, plus `reward_model.json` ({kind,
step_separator, step_aggregation, max_length}). `RewardModelScorer` (stages/scoring/rewards/reward_model.py)
loads such a folder once and scores (prompt, completion) samples with TRL's reward-function signature, so a
trained reward model can drive GRPO beside (or instead of) rule-based rewards.
"""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from stages.runtime import checkpoints
from stages.runtime import devices as devices_module
from stages.runtime.devices import DeviceConfig
from stages.runtime.keys import key_when_set, not_in_key
from stages.scoring.rewards.reward_model import (
    IGNORE_INDEX,
    METADATA_FILE,
    collate_steps,
    encode,
    encode_steps,
    keep_last,
    plain_messages,
    score_ids,
    step_scores,
)
from stages.training.trainer_setup import check_eval_steps

METRIC_PREFIX = "reward_model/"
KINDS = ("orm", "prm")


class RewardModelConfig(BaseModel):
    """Reward model training (TRL RewardTrainer options; names as in stages/training/dpo.py)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["orm", "prm"] = "orm"
    """orm: Bradley-Terry outcome reward model on `pair` rows (TRL RewardTrainer); prm: process reward
    model on `stepwise` rows (token classification, good/bad label at the end of each step)."""
    learning_rate: float = Field(1e-4, gt=0)
    """AdamW learning rate, linear decay (TRL `learning_rate`)."""
    num_train_epochs: float = Field(1.0, gt=0)
    """Passes over the training split (TRL `num_train_epochs`); `max_steps` overrides it."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run; unset: as many as `num_train_epochs` take (TRL `max_steps`, -1)."""
    micro_batch_size: int = Field(8, ge=1)
    """Pairs (orm; each is two sequences) or step sequences (prm) per forward/backward pass
    (TRL `per_device_train_batch_size`)."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step (TRL `gradient_accumulation_steps`)."""
    max_length: int = Field(1024, ge=8)
    """Tokens of prompt + completion. Training drops (does not truncate) longer rows (TRL's RewardTrainer
    does so for pairs; prm does the same for step sequences); the scorer keeps the last `max_length` tokens."""
    logging_steps: int = Field(10, ge=1)
    """Optimizer steps between metric reports to `on_metrics` (TRL `logging_steps`)."""
    save_steps: int | None = not_in_key(100, ge=1)
    """Optimizer steps between checkpoints a rerun resumes from (TRL `save_steps`; stages/runtime/checkpoints.py);
    null: none. Not part of the stage's key: it changes when the weights are saved, not what they are."""
    adapter: Literal["lora", "none"] = "none"
    """none: full fine-tuning of the (small) model; lora: PEFT LoRA on `lora_target_modules` with the
    `score` head (either kind) fully trained (modules_to_save), merged into the saved folder."""
    lora_r: int = Field(16, ge=1)
    """LoRA rank (peft LoraConfig.r)."""
    lora_alpha: int = Field(32, ge=1)
    """LoRA scaling numerator: updates are scaled by lora_alpha / lora_r (peft LoraConfig.lora_alpha)."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input (peft LoraConfig.lora_dropout); restored after TRL's disable_dropout."""
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Linear layers that get LoRA weights (peft LoraConfig.target_modules)."""
    split: str = "train"
    """The preferences split trained on (`<split>.parquet` in the preferences folder)."""
    eval_split: str | None = "eval"
    """Held-out split for accuracy before and after training (orm: pairwise accuracy on its `pair` rows;
    prm: step accuracy on its `stepwise` rows); skipped when unset or absent."""
    eval_steps: int | None = key_when_set(None, ge=1)
    """Also measure that held-out accuracy every eval_steps optimizer steps (axolotl's `eval_steps`), logged as
    `reward_model/eval_pairwise_accuracy` (orm) or `reward_model/eval_step_accuracy` (prm) at its step and
    returned as `eval_history`; needs held-out rows. Unset: before and after training only."""
    seed: int = 0
    """Seed for the head's initialization, data order and LoRA initialization (TRL `seed`)."""
    step_aggregation: Literal["min", "last"] = "min"
    """prm: how per-step scores P(good) become a sample's score, saved in the model folder for the scorer.
    min: the weakest step (one bad step sinks the sample; the usual choice for verifying reasoning);
    last: the last step's (what the model thinks of the whole solution once it has read it)."""
    step_separator: str = Field("\n", min_length=1)
    """prm: text between steps (TRL PRMConfig `step_separator`); each step's label sits on its own last
    token. Saved in the model folder: the scorer splits completions on it, so training steps must
    not contain it (for multi-line steps use a blank line, "\\n\\n")."""


# ---------------------------------------------------------------- TRL config, model, data


def build_trl_config(cfg: RewardModelConfig, output_dir: Path, devices: DeviceConfig | None = None):
    """TRL RewardConfig for `cfg`: the training settings of stages/training/dpo.py's `training_args`."""
    from trl import RewardConfig

    from stages.training.trainer_setup import training_args

    return RewardConfig(**training_args(cfg, output_dir, "reward_model", devices))


def lora_config(cfg: RewardModelConfig):
    """PEFT LoraConfig for `adapter: lora` (None for `adapter: none`); the `score` head is trained in full."""
    if cfg.adapter == "none":
        return None
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_target_modules, modules_to_save=["score"],
                      task_type="TOKEN_CLS" if cfg.kind == "prm" else "SEQ_CLS")


def load_reward_model(model_dir: Path, tokenizer, seed: int = 0, devices: DeviceConfig | None = None):
    """AutoModelForSequenceClassification (num_labels=1) from a causal LM or reward model folder, trainable
    (fp32 on the device of `devices`), with config.pad_token_id set to the tokenizer's (the score is read at
    the last non-pad token)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from stages.runtime.policy import MODEL_LOADING

    try:  # silences the expected "score missing / lm_head unexpected" load report
        from trl.trainer.reward_trainer import suppress_seqcls_warning
    except ImportError:  # pragma: no cover - other TRL layouts
        from contextlib import nullcontext as suppress_seqcls_warning
    torch.manual_seed(seed)  # the new head's initialization
    with MODEL_LOADING, suppress_seqcls_warning():
        model = devices_module.load_trainable(AutoModelForSequenceClassification, model_dir, devices, num_labels=1)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def to_trl_rows(rows: list[dict], split: str = "train") -> list[dict]:
    """Preferences rows of kind `pair` -> TRL's conversational {prompt, chosen, rejected}; other kinds
    raise ValueError naming them."""
    out, unusable = [], []
    for row in rows:
        kind = row.get("kind") or "pair"
        if kind == "pair":
            out.append({"prompt": plain_messages(row["prompt"]), "chosen": plain_messages(row["chosen"]),
                        "rejected": plain_messages(row["rejected"])})
        else:
            unusable.append((row.get("pair_id"), kind))
    if unusable:
        listed = ", ".join(f"{pid} ({kind})" for pid, kind in unusable[:5])
        raise ValueError(f"preferences split {split!r}: {len(unusable)} row(s) an outcome reward model (kind: orm) "
                         f"cannot train on (it needs kind pair; stepwise rows train kind: prm): {listed}")
    if not out:
        raise ValueError(f"preferences split {split!r} has no rows")
    return out


def check_kind(kind: str) -> None:
    """Raise ValueError naming the kinds when `kind` is none of them."""
    if kind not in KINDS:
        raise ValueError(f"reward_model.kind: unknown {kind!r}; available: {', '.join(KINDS)}")


# ---------------------------------------------------------------- PRM model and data


@contextmanager
def _new_token_head():
    """Silence the expected load report of a token classifier built from a causal LM folder: the
    `score` head is new (missing) and `lm_head` is not used (unexpected), as TRL does for the ORM."""
    from transformers.modeling_layers import GenericForTokenClassification as cls

    names = ("_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected")
    old = {name: cls.__dict__[name] for name in names if name in cls.__dict__}
    cls._keys_to_ignore_on_load_missing = list(getattr(cls, names[0], None) or []) + [r"^score\."]
    cls._keys_to_ignore_on_load_unexpected = list(getattr(cls, names[1], None) or []) + [r"^lm_head\."]
    try:
        yield
    finally:
        for name in names:
            if name in old:
                setattr(cls, name, old[name])
            else:
                delattr(cls, name)


def load_process_reward_model(model_dir: Path, tokenizer, seed: int = 0, devices: DeviceConfig | None = None):
    """AutoModelForTokenClassification (num_labels=2: 0 bad, 1 good) from a causal LM or PRM folder, trainable
    (fp32 on the device of `devices`), with config.pad_token_id set to the tokenizer's."""
    import torch
    from transformers import AutoModelForTokenClassification

    from stages.runtime.policy import MODEL_LOADING

    torch.manual_seed(seed)  # the new head's initialization
    with MODEL_LOADING, _new_token_head():
        model = devices_module.load_trainable(
            AutoModelForTokenClassification, model_dir, devices, num_labels=2, id2label={0: "bad", 1: "good"},
            label2id={"bad": 0, "good": 1})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def step_labels(length: int, ends: list[int], labels: list[bool]) -> list[int]:
    """Token labels for a PRM: 1 (good) / 0 (bad) at each step's last token, IGNORE_INDEX elsewhere.

    >>> step_labels(6, [3, 5], [True, False])
    [-100, -100, -100, 1, -100, 0]
    """
    if len(ends) != len(labels):
        raise ValueError(f"step_labels: {len(labels)} labels for {len(ends)} steps")
    out = [IGNORE_INDEX] * length
    for end, label in zip(ends, labels):
        out[end] = int(bool(label))
    return out


def to_prm_rows(rows: list[dict], split: str, step_separator: str) -> list[dict]:
    """Preferences rows of kind `stepwise` -> {prompt, completions, labels}; other kinds, and steps containing
    the separator (the scorer could not find their ends), raise ValueError naming the rows."""
    out, unusable, split_inside = [], [], []
    for row in rows:
        kind = row.get("kind") or "pair"
        if kind != "stepwise":
            unusable.append((row.get("pair_id"), kind))
        elif any(step_separator in step for step in row["completions"]):
            split_inside.append(row.get("pair_id"))
        else:
            out.append({"prompt": plain_messages(row["prompt"]), "completions": list(row["completions"]),
                        "labels": [bool(v) for v in row["labels"]]})
    if unusable:
        listed = ", ".join(f"{pid} ({kind})" for pid, kind in unusable[:5])
        raise ValueError(f"preferences split {split!r}: {len(unusable)} row(s) a process reward model (kind: prm) "
                         f"cannot train on (it needs kind stepwise, e.g. preferences.type: stepwise_supervised "
                         f"or demo_pairs.kind: stepwise): {listed}")
    if split_inside:
        raise ValueError(f"preferences split {split!r}: {len(split_inside)} row(s) with a step that contains "
                         f"reward_model.step_separator {step_separator!r}: {', '.join(split_inside[:5])}; "
                         f"set a separator the steps do not contain (e.g. '\\n\\n')")
    if not out:
        raise ValueError(f"preferences split {split!r} has no rows")
    return out


def prm_features(tokenizer, rows: list[dict], step_separator: str) -> list[dict]:
    """{input_ids, labels} per stepwise row (to_prm_rows output), labels at step ends (see step_labels)."""
    out = []
    for row in rows:
        ids, ends = encode_steps(tokenizer, row["prompt"], row["completions"], step_separator)
        out.append({"input_ids": ids, "labels": step_labels(len(ids), ends, row["labels"])})
    return out


# ---------------------------------------------------------------- scoring


def pairwise_accuracy(model, tokenizer, rows: list[dict], max_length: int | None = None,
                      batch_size: int = 32) -> float:
    """Fraction of pairs with score(prompt + chosen) > score(prompt + rejected)."""
    pairs = [r for r in rows if r.get("chosen") is not None and r.get("rejected") is not None]
    if not pairs:
        raise ValueError("pairwise_accuracy: no rows with chosen and rejected")
    chosen = [encode(tokenizer, r["prompt"], r["chosen"], max_length) for r in pairs]
    rejected = [encode(tokenizer, r["prompt"], r["rejected"], max_length) for r in pairs]
    scores = score_ids(model, chosen + rejected, model.config.pad_token_id, batch_size)
    n = len(pairs)
    return sum(c > r for c, r in zip(scores[:n], scores[n:])) / n


def step_accuracy(model, tokenizer, rows: list[dict], step_separator: str, max_length: int | None = None,
                  batch_size: int = 32) -> float:
    """Fraction of labelled steps of stepwise rows whose prediction (P(good) > 0.5) matches the label."""
    sequences, labels = [], []
    for row in rows:
        ids, ends = encode_steps(tokenizer, row["prompt"], row["completions"], step_separator)
        ids, kept = keep_last(ids, ends, max_length)
        sequences.append((ids, kept))
        labels.append([bool(v) for v in row["labels"]][len(ends) - len(kept):])
    if not sequences:
        raise ValueError("step_accuracy: no stepwise rows")
    scores = step_scores(model, sequences, model.config.pad_token_id, batch_size)
    hits = [(p > 0.5) == label for ps, ls in zip(scores, labels) for p, label in zip(ps, ls)]
    return sum(hits) / len(hits)


# ---------------------------------------------------------------- training


def _save(trained, tokenizer, cfg: RewardModelConfig, out_dir: Path) -> None:
    """The model folder: weights, tokenizer with its chat template, reward_model.json for the scorer."""
    trained.config.pad_token_id = tokenizer.pad_token_id
    trained.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)  # with the chat template the scorer renders samples with
    metadata = {"kind": cfg.kind, "max_length": cfg.max_length}
    if cfg.kind == "prm":
        metadata.update(step_separator=cfg.step_separator, step_aggregation=cfg.step_aggregation)
    (out_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")


def _read_split(cfg: RewardModelConfig, preferences_dir: Path) -> list[dict]:
    """The rows of the trained split (<split>.parquet); FileNotFoundError naming reward_model.split without it."""
    from stages.data.schemas import read_rows

    train_path = preferences_dir / f"{cfg.split}.parquet"
    if not train_path.exists():
        raise FileNotFoundError(f"reward_model.split: {train_path} does not exist")
    return read_rows(train_path)


def _held_out(cfg: RewardModelConfig, preferences_dir: Path, kind: str) -> list[dict]:
    """The eval split's rows of `kind` (pair, stepwise); none without eval_split or that split."""
    from stages.data.schemas import read_rows

    if cfg.eval_split and (preferences_dir / f"{cfg.eval_split}.parquet").exists():
        return [r for r in read_rows(preferences_dir / f"{cfg.eval_split}.parquet") if r.get("kind") == kind]
    return []


def _callbacks(cfg: RewardModelConfig, held_out_accuracy: Callable, metric: str,
               on_metrics: Callable[[dict, int], None] | None, logged: list[dict], history: list[list]) -> list:
    """The trainer's callbacks: each log's train metrics to on_metrics (and appended to `logged`), and the held-out
    accuracy every eval_steps steps, logged as reward_model/<metric> (and appended to `history`)."""
    from stages.training.trainer_setup import metrics_callback, periodic_eval

    evaluate = periodic_eval(cfg.eval_steps, held_out_accuracy, METRIC_PREFIX + metric, on_metrics, history)
    return [metrics_callback(METRIC_PREFIX, on_metrics, logged), evaluate]


def _train_and_save(trainer, cfg: RewardModelConfig, tokenizer, held_out_accuracy: Callable, out_dir: Path,
                    work_dir: Path | None, group, report: Callable[[float | None, int], None] | None = None):
    """Train (from the newest complete checkpoint in the trainer's folder, if any), merge LoRA, measure the held-out
    accuracy (passed to `report` with the last step), then on rank 0 alone (ranks launched by
    stages/runtime/distributed.py) write the model folder to out_dir, deleting the trainer's folder unless it is
    work_dir. Returns (the TrainOutput, the step resumed from, the held-out accuracy after training)."""
    result, resumed_from = checkpoints.train(trainer, Path(trainer.args.output_dir))
    trained = trainer.model
    if cfg.adapter == "lora":
        trained = trained.merge_and_unload()  # the plain sequence/token-classification model, score head trained
    trained.eval()
    accuracy_after = held_out_accuracy(trained)
    if report is not None:
        report(accuracy_after, result.global_step)
    if group is None or group.rank == 0:
        if work_dir is None:
            shutil.rmtree(trainer.args.output_dir, ignore_errors=True)
        _save(trained, tokenizer, cfg, out_dir)
    return result, resumed_from, accuracy_after


def _summary(cfg: RewardModelConfig, rows: list[dict], train_rows: int, result, resumed_from: int,
             logged: list[dict], history: list[list], devices: DeviceConfig, evals: dict) -> dict:
    """The stage's result: rows read and trained on, steps, losses, the last logged train metrics, the held-out
    `evals`, eval_history (with eval_steps), and the device and precision."""
    return {
        "kind": cfg.kind,
        "rows": len(rows),
        "train_rows": train_rows,
        "steps": result.global_step,
        "resumed_from_step": resumed_from,
        "train_loss": result.training_loss,
        "final_metrics": logged[-1] if logged else {},
        **evals,
        **({"eval_history": history} if cfg.eval_steps else {}),
        **devices_module.describe(devices),
    }


def _orm_splits(cfg: RewardModelConfig, preferences_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """(the train split's rows, its pairs as TRL rows, the eval split's `pair` rows; none without eval_split or that
    split)."""
    rows = _read_split(cfg, preferences_dir)
    train_rows = to_trl_rows(rows, cfg.split)
    return rows, train_rows, _held_out(cfg, preferences_dir, "pair")


def _orm_trainer(cfg: RewardModelConfig, model, tokenizer, train_rows: list[dict], callbacks: list, output_dir: Path,
                 devices: DeviceConfig):
    """TRL RewardTrainer on the TRL rows (it tokenizes them and drops those longer than max_length), quiet; a
    ValueError when it drops them all."""
    import datasets
    from trl import RewardTrainer

    from stages.training.trainer_setup import quiet_trainer

    args = build_trl_config(cfg, output_dir, devices)
    trainer = quiet_trainer(RewardTrainer(model=model, args=args,
                                          train_dataset=datasets.Dataset.from_list(train_rows),
                                          processing_class=tokenizer, callbacks=callbacks,
                                          peft_config=lora_config(cfg)), cfg)
    if len(trainer.train_dataset) == 0:
        raise ValueError(f"reward_model: every {cfg.split!r} pair is longer than max_length={cfg.max_length} tokens")
    return trainer


def run(
    cfg: RewardModelConfig,
    model_dir: Path,
    preferences_dir: Path,
    out_dir: Path,
    on_metrics: Callable[[dict, int], None] | None = None,
    work_dir: Path | None = None,
    group=None,
    devices: DeviceConfig | None = None,
) -> dict:
    """Train a reward model from the causal LM in model_dir on preferences_dir/<split>.parquet.

    out_dir gets a complete model folder (LoRA merged) with the tokenizer, chat template and
    reward_model.json: AutoModelForSequenceClassification for `kind: orm`, AutoModelForTokenClassification
    for `kind: prm` (see run_prm). `on_metrics` receives each logging step's numeric train metrics, keys
    prefixed "reward_model/" (orm: loss, accuracy, margin, min_reward, mean_reward, max_reward, ...),
    and the step. Returns {kind, rows, train_rows, steps, train_loss, final_metrics, eval_pairs,
    eval_pairwise_accuracy_before, eval_pairwise_accuracy, device, precision (, gpu)}; the eval entries
    are None without an eval split of pairs. Checkpoints go to work_dir and training resumes from the
    newest complete one there (stages/runtime/checkpoints.py); None: a folder inside out_dir, deleted at the end.
    `devices` (stages/runtime/devices.py; None: DeviceConfig(), auto): device and precision of the model.
    """
    from transformers import AutoTokenizer

    check_kind(cfg.kind)
    if cfg.kind == "prm":
        return run_prm(cfg, model_dir, preferences_dir, out_dir, on_metrics, work_dir, group, devices)
    devices = devices or DeviceConfig()
    model_dir, preferences_dir, out_dir = Path(model_dir), Path(preferences_dir), Path(out_dir)
    rows, train_rows, eval_pairs = _orm_splits(cfg, preferences_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_reward_model(model_dir, tokenizer, cfg.seed, devices)

    def held_out_accuracy(m) -> float | None:
        return pairwise_accuracy(m, tokenizer, eval_pairs, cfg.max_length) if eval_pairs else None

    accuracy_before = held_out_accuracy(model)
    check_eval_steps("reward_model", cfg, bool(eval_pairs), "pairs", preferences_dir)
    logged: list[dict] = []
    history: list[list] = []
    callbacks = _callbacks(cfg, held_out_accuracy, "eval_pairwise_accuracy", on_metrics, logged, history)
    trainer = _orm_trainer(cfg, model, tokenizer, train_rows, callbacks, work_dir or out_dir / "_trainer", devices)
    result, resumed_from, accuracy_after = _train_and_save(trainer, cfg, tokenizer, held_out_accuracy, out_dir,
                                                           work_dir, group)
    return _summary(cfg, rows, len(trainer.train_dataset), result, resumed_from, logged, history, devices,
                    {"eval_pairs": len(eval_pairs), "eval_pairwise_accuracy_before": accuracy_before,
                     "eval_pairwise_accuracy": accuracy_after})


def labelled_token_loss(outputs, labels, num_items_in_batch=None):
    """Cross-entropy summed over the labelled step-end tokens, divided by the labelled tokens of the whole
    optimizer step (Trainer's `num_items_in_batch`: every micro-batch of the step, on every rank). So a
    step's loss weighs every labelled token alike however the rows are cut into micro-batches and ranks,
    and train.num_processes 2 trains what one process does (a per-rank mean would weigh a rank's tokens
    by its own count)."""
    import torch

    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                                              ignore_index=IGNORE_INDEX, reduction="sum")
    count = num_items_in_batch if num_items_in_batch is not None else (labels != IGNORE_INDEX).sum()
    return total / count


def _step_trainer_class():
    """transformers Trainer that also reports `step_accuracy` (train steps whose argmax matches the label,
    over the labelled tokens since the last log), as TRL's RewardTrainer reports `accuracy`."""
    import torch
    from transformers import Trainer

    class StepTrainer(Trainer):
        _correct, _total = 0, 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs["labels"]
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            with torch.no_grad():
                mask = labels != IGNORE_INDEX
                self._correct += int((outputs.logits.argmax(-1)[mask] == labels[mask]).sum())
                self._total += int(mask.sum())
            return (loss, outputs) if return_outputs else loss

        def log(self, logs, *args, **kwargs):
            if "loss" in logs:  # every rank logs the loss at the same steps: the counts are summed over ranks
                from stages.runtime.distributed import world_size

                correct, total = self._correct, self._total
                if world_size() > 1:
                    import torch.distributed as dist

                    counts = torch.tensor([correct, total], dtype=torch.float64)
                    dist.all_reduce(counts)
                    correct, total = counts.tolist()
                if total:
                    logs["step_accuracy"] = correct / total
                self._correct, self._total = 0, 0
            super().log(logs, *args, **kwargs)

    return StepTrainer


def _prm_splits(cfg: RewardModelConfig, preferences_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """(the train split's rows, its stepwise rows as PRM rows, the eval split's stepwise rows as PRM rows; none
    without eval_split or that split)."""
    rows = _read_split(cfg, preferences_dir)
    train_rows = to_prm_rows(rows, cfg.split, cfg.step_separator)
    held_out = _held_out(cfg, preferences_dir, "stepwise")
    eval_rows = to_prm_rows(held_out, cfg.eval_split, cfg.step_separator) if held_out else []
    return rows, train_rows, eval_rows


def _trainable_prm(cfg: RewardModelConfig, model_dir: Path, tokenizer, devices: DeviceConfig):
    """load_process_reward_model with dropout off (TRL PRMConfig disable_dropout=True; the head's dropout is 0.1)."""
    import torch

    model = load_process_reward_model(model_dir, tokenizer, cfg.seed, devices)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _prm_train_features(cfg: RewardModelConfig, tokenizer, train_rows: list[dict]) -> list[dict]:
    """prm_features of the train rows, without those longer than max_length; a ValueError when none is left."""
    features = [f for f in prm_features(tokenizer, train_rows, cfg.step_separator)
                if len(f["input_ids"]) <= cfg.max_length]
    if not features:
        raise ValueError(f"reward_model: every {cfg.split!r} stepwise row is longer than "
                         f"max_length={cfg.max_length} tokens")
    return features


def _prm_trainer(cfg: RewardModelConfig, model, tokenizer, features: list[dict], callbacks: list, output_dir: Path,
                 devices: DeviceConfig):
    """The step-accuracy transformers Trainer (_step_trainer_class) on the features with labelled_token_loss and
    the training settings of `training_args` (less max_length), quiet."""
    import datasets
    from transformers import TrainingArguments

    from stages.training.trainer_setup import quiet_trainer, training_args

    args = {k: v for k, v in training_args(cfg, output_dir, "reward_model", devices).items() if k != "max_length"}
    return quiet_trainer(_step_trainer_class()(
        model=model, args=TrainingArguments(**args, remove_unused_columns=False),
        train_dataset=datasets.Dataset.from_list(features),
        data_collator=lambda batch: collate_steps(batch, tokenizer.pad_token_id),
        compute_loss_func=labelled_token_loss, callbacks=callbacks), cfg)


def _report_step_accuracy(on_metrics: Callable[[dict, int], None] | None, accuracy: float | None, step: int) -> None:
    """The held-out step accuracy, when measured, to on_metrics at `step`."""
    if on_metrics and accuracy is not None:
        on_metrics({METRIC_PREFIX + "eval_step_accuracy": accuracy}, step)


def _prm_evals(eval_rows: list[dict], accuracy_before: float | None, accuracy_after: float | None) -> dict:
    """The held-out entries of run_prm's result (the pairwise ones empty: a PRM has no pairs)."""
    eval_labels = [label for row in eval_rows for label in row["labels"]]
    return {
        "eval_rows": len(eval_rows),
        "eval_labelled_steps": len(eval_labels),
        "eval_good_step_fraction": sum(eval_labels) / len(eval_labels) if eval_labels else None,
        "eval_step_accuracy_before": accuracy_before,
        "eval_step_accuracy": accuracy_after,
        "eval_pairs": 0,
        "eval_pairwise_accuracy_before": None,
        "eval_pairwise_accuracy": None,
    }


def run_prm(
    cfg: RewardModelConfig,
    model_dir: Path,
    preferences_dir: Path,
    out_dir: Path,
    on_metrics: Callable[[dict, int], None] | None = None,
    work_dir: Path | None = None,
    group=None,
    devices: DeviceConfig | None = None,
) -> dict:
    """`kind: prm`: train a process reward model on the `stepwise` rows of preferences_dir/<split>.parquet.

    Token classification (0 bad, 1 good) on the last token of each step, cross-entropy over
    those tokens only (labels -100 elsewhere), with a plain transformers Trainer on the training settings
    of stages/training/dpo.py's `training_args` (device and precision from `devices`; None: auto); dropout off as
    TRL's `disable_dropout` (LoRA dropout as configured).
    `on_metrics` receives each logging step's loss, step_accuracy (train batches), grad_norm and
    learning_rate, and eval_step_accuracy on the held-out stepwise rows at step 0 and after the last
    step; keys prefixed "reward_model/". Returns {kind, rows, train_rows, steps, train_loss,
    final_metrics, eval_rows, eval_labelled_steps, eval_good_step_fraction, eval_step_accuracy_before,
    eval_step_accuracy, eval_pairs, eval_pairwise_accuracy_before, eval_pairwise_accuracy, device,
    precision (, gpu)}; the eval
    entries are None without held-out stepwise rows (the pairwise ones always: a PRM has no pairs).
    """
    from transformers import AutoTokenizer

    devices = devices or DeviceConfig()
    model_dir, preferences_dir, out_dir = Path(model_dir), Path(preferences_dir), Path(out_dir)
    rows, train_rows, eval_rows = _prm_splits(cfg, preferences_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = _trainable_prm(cfg, model_dir, tokenizer, devices)
    features = _prm_train_features(cfg, tokenizer, train_rows)

    def held_out_accuracy(m) -> float | None:
        return step_accuracy(m, tokenizer, eval_rows, cfg.step_separator, cfg.max_length) if eval_rows else None

    accuracy_before = held_out_accuracy(model)
    check_eval_steps("reward_model", cfg, bool(eval_rows), "stepwise rows", preferences_dir)
    _report_step_accuracy(on_metrics, accuracy_before, 0)
    peft_config = lora_config(cfg)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)

    logged: list[dict] = []
    history: list[list] = []
    callbacks = _callbacks(cfg, held_out_accuracy, "eval_step_accuracy", on_metrics, logged, history)
    trainer = _prm_trainer(cfg, model, tokenizer, features, callbacks, work_dir or out_dir / "_trainer", devices)
    result, resumed_from, accuracy_after = _train_and_save(trainer, cfg, tokenizer, held_out_accuracy, out_dir,
                                                           work_dir, group, partial(_report_step_accuracy, on_metrics))
    return _summary(cfg, rows, len(features), result, resumed_from, logged, history, devices,
                    _prm_evals(eval_rows, accuracy_before, accuracy_after))
