"""Reward models on a preferences table: a Bradley-Terry outcome reward model (ORM) with TRL.

Reads `<split>.parquet` written by stages/preferences.py. `kind: orm` trains TRL's RewardTrainer
(loss -log sigmoid(r(chosen) - r(rejected))) on the rows of kind `pair`, with a scalar head
(AutoModelForSequenceClassification, num_labels=1, head `score`) initialised from the causal LM
folder in model_dir: its transformer body is kept, lm_head is dropped, the head starts random.
The score of a sequence is the head's output at its last non-pad token. Training runs in fp32 on
CPU like stages/dpo.py.

out_dir gets a complete model folder (LoRA merged into the weights) with the tokenizer and its
chat template, loadable with AutoModelForSequenceClassification. `RewardModelScorer` loads such a
folder once and scores (prompt, completion) samples with TRL's reward-function signature, so a
trained reward model can drive GRPO beside (or instead of) rule-based rewards.

`kind: prm` (process reward model: token classification over steps, rows of kind `stepwise`)
needs TRL's PRMTrainer, which TRL 1.16 no longer ships; `run` raises a ValueError saying so
before loading anything.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

METRIC_PREFIX = "reward_model/"
KINDS = ("orm", "prm")


class RewardModelConfig(BaseModel):
    """Reward model training (TRL RewardTrainer options; names as in stages/dpo.py)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["orm", "prm"] = "orm"
    """orm: Bradley-Terry outcome reward model on `pair` rows (TRL RewardTrainer); prm: process reward
    model on `stepwise` rows (TRL PRMTrainer, absent from TRL 1.16: a ValueError)."""
    learning_rate: float = Field(1e-4, gt=0)
    """AdamW learning rate, linear decay (TRL `learning_rate`)."""
    num_train_epochs: float = Field(1.0, gt=0)
    """Passes over the training split (TRL `num_train_epochs`); `max_steps` overrides it."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run; unset: as many as `num_train_epochs` take (TRL `max_steps`, -1)."""
    micro_batch_size: int = Field(8, ge=1)
    """Pairs per forward/backward pass (TRL `per_device_train_batch_size`; each pair is two sequences)."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step (TRL `gradient_accumulation_steps`)."""
    max_length: int = Field(1024, ge=8)
    """Tokens of prompt + completion. TRL's RewardTrainer drops (does not truncate) training pairs
    with a longer chosen or rejected sequence; the scorer keeps the last `max_length` tokens."""
    logging_steps: int = Field(10, ge=1)
    """Optimizer steps between metric reports to `on_metrics` (TRL `logging_steps`)."""
    adapter: Literal["lora", "none"] = "none"
    """none: full fine-tuning of the (small) model; lora: PEFT LoRA on `lora_target_modules` with the
    `score` head fully trained (modules_to_save), merged into the saved folder."""
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
    """Held-out split for pairwise accuracy before and after training; skipped when unset or absent."""
    seed: int = 0
    """Seed for the head's initialization, data order and LoRA initialization (TRL `seed`)."""
    step_aggregation: Literal["min", "last"] = "min"
    """prm: how per-step scores become one score (the weakest step, or the last step)."""


# ---------------------------------------------------------------- TRL config, model, data


def build_trl_config(cfg: RewardModelConfig, output_dir: Path):
    """TRL RewardConfig for `cfg`: fp32-on-CPU training settings as in stages/dpo.py."""
    from trl import RewardConfig

    from stages.dpo import cpu_training_args

    return RewardConfig(**cpu_training_args(cfg, output_dir))


def lora_config(cfg: RewardModelConfig):
    """PEFT LoraConfig for `adapter: lora` (None for `adapter: none`); the `score` head is trained in full."""
    if cfg.adapter == "none":
        return None
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_target_modules, modules_to_save=["score"], task_type="SEQ_CLS")


def load_reward_model(model_dir: Path, tokenizer, seed: int = 0):
    """AutoModelForSequenceClassification (num_labels=1, fp32) from a causal LM or reward model folder,
    with config.pad_token_id set to the tokenizer's (the score is read at the last non-pad token)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from stages.policy import MODEL_LOADING

    try:  # silences the expected "score missing / lm_head unexpected" load report
        from trl.trainer.reward_trainer import suppress_seqcls_warning
    except ImportError:  # pragma: no cover - other TRL layouts
        from contextlib import nullcontext as suppress_seqcls_warning
    torch.manual_seed(seed)  # the new head's initialization
    with MODEL_LOADING, suppress_seqcls_warning():
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype="float32")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def _messages(value) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in value]


def to_trl_rows(rows: list[dict], split: str = "train") -> list[dict]:
    """Preferences rows of kind `pair` -> TRL's conversational {prompt, chosen, rejected}; other kinds
    raise ValueError naming them."""
    out, unusable = [], []
    for row in rows:
        kind = row.get("kind") or "pair"
        if kind == "pair":
            out.append({"prompt": _messages(row["prompt"]), "chosen": _messages(row["chosen"]),
                        "rejected": _messages(row["rejected"])})
        else:
            unusable.append((row.get("pair_id"), kind))
    if unusable:
        listed = ", ".join(f"{pid} ({kind})" for pid, kind in unusable[:5])
        raise ValueError(f"preferences split {split!r}: {len(unusable)} row(s) an outcome reward model (kind: orm) "
                         f"cannot train on (it needs kind pair): {listed}")
    if not out:
        raise ValueError(f"preferences split {split!r} has no rows")
    return out


def check_kind(kind: str) -> None:
    """Raise ValueError when this TRL cannot train reward models of `kind`."""
    if kind == "orm":
        return
    if kind == "prm":
        try:
            from trl import PRMTrainer  # noqa: F401  (TRL <= 0.2x)
        except ImportError:
            try:
                from trl.experimental.prm import PRMTrainer  # noqa: F401
            except ImportError:
                import trl

                raise ValueError(
                    f"reward_model.kind: 'prm' needs TRL's PRMTrainer (token classification over stepwise rows), "
                    f"which TRL {trl.__version__} does not provide; use kind: orm on pair rows") from None
        raise ValueError("reward_model.kind: 'prm' is not wired to this TRL's PRMTrainer yet; use kind: orm")
    raise ValueError(f"reward_model.kind: unknown {kind!r}; available: {', '.join(KINDS)}")


# ---------------------------------------------------------------- scoring


def _as_messages(value, role: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value)


def encode(tokenizer, prompt, completion, max_length: int | None = None) -> list[int]:
    """Token ids of prompt + completion with the chat template, as TRL's RewardTrainer tokenizes a
    conversational pair side (no generation prompt). Plain strings become a user / an assistant message.
    Longer than `max_length`: the last `max_length` tokens (the score reads the last one)."""
    messages = _as_messages(prompt, "user") + _as_messages(completion, "assistant")
    ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    return ids[-max_length:] if max_length else ids


def score_ids(model, sequences: list[list[int]], pad_token_id: int, batch_size: int = 32) -> list[float]:
    """Scalar scores of token-id sequences (right-padded batches, no grad, eval mode restored after)."""
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[float] = []
    try:
        with torch.no_grad():
            for start in range(0, len(sequences), batch_size):
                chunk = sequences[start : start + batch_size]
                width = max(len(s) for s in chunk)
                ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
                attention = torch.zeros((len(chunk), width), dtype=torch.long)
                for i, s in enumerate(chunk):
                    ids[i, : len(s)] = torch.tensor(s)
                    attention[i, : len(s)] = 1
                logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits
                out += logits[:, 0].float().tolist()
    finally:
        model.train(was_training)
    return out


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


class RewardModelScorer:
    """A saved reward model as a TRL reward function: `scorer(prompts, completions, **kwargs) -> list[float]`.

    Loads the folder once (AutoModelForSequenceClassification, fp32, eval mode). Prompts are chat
    message lists or strings (a string is a user message); completions are assistant message lists,
    as TRL passes them for conversational data, or strings (an assistant message). Each sample is
    rendered with the folder's chat template exactly as in training and scored in batches without grad.
    `step_aggregation` is kept for process reward models (min or last step score); an outcome model
    gives one score per sample and ignores it.
    """

    def __init__(self, model_dir: Path | str, batch_size: int = 32, step_aggregation: Literal["min", "last"] = "min",
                 max_length: int | None = None, device: str | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from stages.policy import MODEL_LOADING

        if step_aggregation not in ("min", "last"):
            raise ValueError(f"step_aggregation: {step_aggregation!r}, expected 'min' or 'last'")
        self.model_dir = Path(model_dir)
        self.batch_size = batch_size
        self.step_aggregation = step_aggregation
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        with MODEL_LOADING:
            self.model = AutoModelForSequenceClassification.from_pretrained(self.model_dir, dtype="float32")
        if self.model.config.num_labels != 1:
            raise ValueError(f"{self.model_dir}: num_labels={self.model.config.num_labels}; a reward model has 1")
        if self.model.config.pad_token_id is None:
            if self.tokenizer.pad_token is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if device:
            self.model.to(device)
        self.model.eval().requires_grad_(False)
        self.max_length = max_length or getattr(self.model.config, "max_position_embeddings", None)
        self.__name__ = "reward_model"

    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"reward_model: {len(prompts)} prompts but {len(completions)} completions")
        sequences = [encode(self.tokenizer, p, c, self.max_length) for p, c in zip(prompts, completions)]
        return score_ids(self.model, sequences, self.model.config.pad_token_id, self.batch_size)


def reward_model_function(model_dir: Path | str, batch_size: int = 32,
                          step_aggregation: Literal["min", "last"] = "min") -> Callable[..., list[float]]:
    """A TRL reward function scoring with the reward model in model_dir (loaded now, once);
    its `__name__` is "reward_model" (the name TRL and the reports give its column)."""
    scorer = RewardModelScorer(model_dir, batch_size=batch_size, step_aggregation=step_aggregation)

    def reward_model(prompts: list, completions: list, **kwargs) -> list[float]:
        return scorer(prompts, completions, **kwargs)

    reward_model.scorer = scorer
    return reward_model


# ---------------------------------------------------------------- training


def run(
    cfg: RewardModelConfig,
    model_dir: Path,
    preferences_dir: Path,
    out_dir: Path,
    on_metrics: Callable[[dict, int], None] | None = None,
) -> dict:
    """Train a reward model from the causal LM in model_dir on preferences_dir/<split>.parquet.

    out_dir gets a complete AutoModelForSequenceClassification folder (LoRA merged) with the tokenizer
    and chat template. `on_metrics` receives each logging step's numeric train metrics, keys prefixed
    "reward_model/" (loss, accuracy, margin, min_reward, mean_reward, max_reward, ...), and the step.
    Returns {kind, rows, train_rows, steps, train_loss, final_metrics, eval_pairs,
    eval_pairwise_accuracy_before, eval_pairwise_accuracy}; the eval entries are None without an
    eval split of pairs.
    """
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import RewardTrainer

    from stages.dpo import quiet_trainer, read_rows

    check_kind(cfg.kind)
    model_dir, preferences_dir, out_dir = Path(model_dir), Path(preferences_dir), Path(out_dir)
    train_path = preferences_dir / f"{cfg.split}.parquet"
    if not train_path.exists():
        raise FileNotFoundError(f"reward_model.split: {train_path} does not exist")
    rows = read_rows(train_path)
    train_rows = to_trl_rows(rows, cfg.split)
    eval_pairs: list[dict] = []
    if cfg.eval_split and (preferences_dir / f"{cfg.eval_split}.parquet").exists():
        eval_pairs = [r for r in read_rows(preferences_dir / f"{cfg.eval_split}.parquet") if r.get("kind") == "pair"]

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_reward_model(model_dir, tokenizer, cfg.seed)
    accuracy_before = pairwise_accuracy(model, tokenizer, eval_pairs, cfg.max_length) if eval_pairs else None

    logged: list[dict] = []

    class ReportMetrics(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            numeric = {k: float(v) for k, v in (logs or {}).items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if numeric and "loss" in numeric:
                logged.append(numeric)
            if on_metrics and numeric:
                on_metrics({METRIC_PREFIX + k: v for k, v in numeric.items()}, state.global_step)

    work_dir = out_dir / "_trainer"
    trainer = quiet_trainer(RewardTrainer(model=model, args=build_trl_config(cfg, work_dir),
                                          train_dataset=datasets.Dataset.from_list(train_rows),
                                          processing_class=tokenizer, callbacks=[ReportMetrics()],
                                          peft_config=lora_config(cfg)), cfg)
    if len(trainer.train_dataset) == 0:
        raise ValueError(f"reward_model: every {cfg.split!r} pair is longer than max_length={cfg.max_length} tokens")
    result = trainer.train()

    trained = trainer.model
    if cfg.adapter == "lora":
        trained = trained.merge_and_unload()  # the plain sequence-classification model, score head trained
    trained.eval()
    accuracy_after = pairwise_accuracy(trained, tokenizer, eval_pairs, cfg.max_length) if eval_pairs else None
    trained.config.pad_token_id = tokenizer.pad_token_id
    shutil.rmtree(work_dir, ignore_errors=True)
    trained.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)  # with the chat template the scorer renders samples with
    return {
        "kind": cfg.kind,
        "rows": len(rows),
        "train_rows": len(trainer.train_dataset),
        "steps": result.global_step,
        "train_loss": result.training_loss,
        "final_metrics": logged[-1] if logged else {},
        "eval_pairs": len(eval_pairs),
        "eval_pairwise_accuracy_before": accuracy_before,
        "eval_pairwise_accuracy": accuracy_after,
    }
