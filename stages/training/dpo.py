"""Offline preference optimization (DPO, IPO, KTO, ORPO, SimPO) with TRL on a preferences table.

Reads `<split>.parquet` written by stages/data/preferences.py (chat-message rows), trains the
starting policy with the TRL trainer that implements `rl`, and saves a LoRA adapter (PEFT
format; the export stage merges it) or, with `adapter: none`, a complete model folder.

| rl     | TRL 1.16 trainer / config                          | options                                   |
|--------|----------------------------------------------------|-------------------------------------------|
| dpo    | trl.DPOTrainer / DPOConfig, loss_type ["sigmoid"]  | beta = rl_beta                            |
| ipo    | trl.DPOTrainer / DPOConfig, loss_type ["ipo"]      | beta = rl_beta (IPO's tau)                |
| kto    | trl.KTOTrainer / KTOConfig                         | beta, desirable/undesirable_weight        |
| orpo   | trl.experimental.orpo.ORPOTrainer / ORPOConfig     | beta = orpo_alpha (ORPO's lambda)         |
| simpo  | trl.experimental.cpo.CPOTrainer / CPOConfig        | loss_type "simpo", beta, simpo_gamma,     |
|        |                                                    | cpo_alpha                                 |

dpo, ipo and kto compare with a reference policy: with LoRA, the starting model is the adapter-
disabled base (nothing extra in memory) unless `rl_adapter_ref_model` asks for a separate
frozen copy; with `adapter: none`, always a frozen copy. orpo and simpo use no reference.
Device and precision: `devices` (stages/runtime/devices.py), like stages/training/sft.py: the trained model (and under
LoRA its base) in fp32 with fp32 optimizer state, forward under the Trainer's bf16/fp16 autocast where
the precision asks for it; a separate reference copy is frozen in the compute dtype.
"""

from __future__ import annotations

import random
import shutil
import warnings
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from stages.data.schemas import read_rows
from stages.runtime import checkpoints
from stages.runtime import devices as devices_module
from stages.runtime.devices import DeviceConfig
from stages.runtime.keys import key_when_set, not_in_key
from stages.training.trainer_setup import (check_eval_steps, metrics_callback, periodic_eval, quiet_trainer,
                                           training_args)

RL_TYPES = ("dpo", "ipo", "kto", "orpo", "simpo")
REFERENCE_RL = ("dpo", "ipo", "kto")  # the losses that compare with a reference policy
METRIC_PREFIX = "preference/"


class PreferenceOptimizationConfig(BaseModel):
    """Offline preference optimization (option names as in axolotl's RLHF config)."""

    model_config = ConfigDict(extra="forbid")

    rl: Literal["dpo", "ipo", "kto", "orpo", "simpo"] = "dpo"
    """The loss. dpo: TRL DPOTrainer (sigmoid loss); ipo: DPOTrainer with loss_type "ipo"; kto:
    KTOTrainer (unpaired rows; pairs are split into a desirable and an undesirable row); orpo:
    experimental ORPOTrainer; simpo: experimental CPOTrainer with loss_type "simpo"."""
    rl_beta: float = Field(0.1, gt=0)
    """TRL's `beta` for dpo/ipo/kto/simpo: for dpo/kto the strength of the pull to the reference,
    for ipo the regularization tau (target margin 1/(2 tau)), for simpo the reward scale. Unused by orpo."""
    orpo_alpha: float = Field(0.1, gt=0)
    """orpo: weight of the odds-ratio term added to the chosen NLL (ORPO's lambda; TRL ORPOConfig.beta)."""
    simpo_gamma: float = Field(0.5, ge=0)
    """simpo: target reward margin (TRL CPOConfig.simpo_gamma)."""
    cpo_alpha: float = Field(1.0, ge=0)
    """simpo: weight of the chosen NLL term added to the loss (TRL CPOConfig.cpo_alpha; 1.0 is TRL's
    default, CPO-SimPO). 0.0: pure SimPO."""
    kto_desirable_weight: float = Field(1.0, gt=0)
    """kto: weight of desirable rows' losses (TRL KTOConfig.desirable_weight)."""
    kto_undesirable_weight: float = Field(1.0, gt=0)
    """kto: weight of undesirable rows' losses (TRL KTOConfig.undesirable_weight)."""
    rl_adapter_ref_model: bool = False
    """With LoRA and dpo/ipo/kto: false, the reference is the base with the adapter disabled (TRL's
    default with PEFT); true, a separate frozen copy of the starting model is loaded and passed as
    TRL's `ref_model`. Ignored by orpo/simpo (no reference) and by `adapter: none` (always a copy)."""
    learning_rate: float = Field(5e-5, gt=0)
    """AdamW learning rate, linear decay (TRL `learning_rate`; TRL's default 1e-6 suits full fine-tuning
    of large models, LoRA needs more)."""
    num_train_epochs: float = Field(1.0, gt=0)
    """Passes over the training split (TRL `num_train_epochs`); `max_steps` overrides it."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run; unset: as many as `num_train_epochs` take (TRL `max_steps`, -1)."""
    micro_batch_size: int = Field(8, ge=1)
    """Rows per forward/backward pass (TRL `per_device_train_batch_size`). kto estimates its KL term
    from mismatched rows of the same micro-batch, so use at least 2 there."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step (TRL `gradient_accumulation_steps`)."""
    max_length: int = Field(1024, ge=8)
    """Prompt + completion tokens kept per sequence, truncated at the end (TRL `max_length`)."""
    logging_steps: int = Field(10, ge=1)
    """Optimizer steps between metric reports to `on_metrics` (TRL `logging_steps`)."""
    save_steps: int | None = not_in_key(100, ge=1)
    """Optimizer steps between checkpoints a rerun resumes from (TRL `save_steps`; stages/runtime/checkpoints.py);
    null: none. Not part of the stage's key: it changes when the weights are saved, not what they are."""
    adapter: Literal["lora", "none"] = "lora"
    """lora: train a PEFT LoRA adapter (TRL `peft_config`), saved as an adapter folder; none: full
    fine-tuning, saved as a complete model folder with the tokenizer."""
    lora_r: int = Field(16, ge=1)
    """LoRA rank (peft LoraConfig.r)."""
    lora_alpha: int = Field(32, ge=1)
    """LoRA scaling numerator: updates are scaled by lora_alpha / lora_r (peft LoraConfig.lora_alpha)."""
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input (peft LoraConfig.lora_dropout). TRL's `disable_dropout` (on) zeroes every
    dropout of the model; this one is set back after the trainer is built."""
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Linear layers that get LoRA weights (peft LoraConfig.target_modules); not lm_head (TRL refuses it)."""
    split: str = "train"
    """The preferences split trained on (`<split>.parquet` in the preferences folder)."""
    eval_split: str | None = "eval"
    """Held-out split for preference accuracy before and after training; skipped when unset or absent."""
    eval_steps: int | None = key_when_set(None, ge=1)
    """Also measure the held-out preference accuracy every eval_steps optimizer steps (axolotl's `eval_steps`),
    logged as `preference/eval_accuracy` at its step and returned as `eval_history`; needs held-out pairs.
    Unset: before and after training only."""
    seed: int = 0
    """Seed for data order and LoRA initialization (TRL `seed`)."""


# ---------------------------------------------------------------- TRL classes and options


def trl_classes(rl: str) -> tuple[type, type]:
    """(trainer class, config class) of TRL 1.16 that implements `rl`."""
    if rl in ("dpo", "ipo"):
        from trl import DPOConfig, DPOTrainer

        return DPOTrainer, DPOConfig
    if rl == "kto":
        from trl import KTOConfig, KTOTrainer

        return KTOTrainer, KTOConfig
    if rl in ("orpo", "simpo"):
        try:
            with warnings.catch_warnings():  # chosen knowingly: TRL 1.16 keeps ORPO and CPO/SimPO in trl.experimental
                warnings.filterwarnings("ignore", message=".*trl.experimental.*")
                from trl.experimental.cpo import CPOConfig, CPOTrainer
                from trl.experimental.orpo import ORPOConfig, ORPOTrainer
        except ImportError as e:
            import trl

            raise ValueError(f"rl: {rl!r} needs trl.experimental's ORPOTrainer/CPOTrainer, which TRL {trl.__version__} "
                             f"does not provide ({e}); available: dpo, ipo, kto") from e
        return (ORPOTrainer, ORPOConfig) if rl == "orpo" else (CPOTrainer, CPOConfig)
    raise ValueError(f"rl: unknown {rl!r}; available: {', '.join(RL_TYPES)}")


def trl_options(cfg: PreferenceOptimizationConfig) -> dict:
    """The loss options of the TRL config for `cfg.rl` (see the module table)."""
    if cfg.rl == "dpo":
        return {"beta": cfg.rl_beta, "loss_type": ["sigmoid"]}
    if cfg.rl == "ipo":
        return {"beta": cfg.rl_beta, "loss_type": ["ipo"]}
    if cfg.rl == "kto":
        return {"beta": cfg.rl_beta, "desirable_weight": cfg.kto_desirable_weight,
                "undesirable_weight": cfg.kto_undesirable_weight}
    if cfg.rl == "orpo":
        return {"beta": cfg.orpo_alpha}
    return {"beta": cfg.rl_beta, "loss_type": "simpo", "simpo_gamma": cfg.simpo_gamma, "cpo_alpha": cfg.cpo_alpha}


def build_trl_config(cfg: PreferenceOptimizationConfig, output_dir: Path, devices: DeviceConfig | None = None):
    """The TRL config object for `cfg`: loss options plus the training settings of `training_args`."""
    _, config_class = trl_classes(cfg.rl)
    counted = {"include_num_input_tokens_seen": "non_padding"} if cfg.rl in ("dpo", "ipo") else {}  # DPOTrainer's
    # batches have input_ids; KTO's and CPO/ORPO's do not (HF would warn each step and count nothing)
    return config_class(**training_args(cfg, output_dir, devices=devices), **trl_options(cfg), **counted)


def lora_config(cfg: PreferenceOptimizationConfig):
    """The PEFT LoraConfig for `adapter: lora` (None for `adapter: none`)."""
    if cfg.adapter == "none":
        return None
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_target_modules, task_type="CAUSAL_LM")


# ---------------------------------------------------------------- data


def _messages(value: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in value]


def to_trl_rows(rows: list[dict], rl: str, split: str = "train") -> list[dict]:
    """Preferences rows -> TRL's conversational format.

    Paired losses: {prompt, chosen, rejected}, each a message list. kto: {prompt, completion, label};
    a pair becomes two rows, its chosen turn desirable and its rejected turn undesirable (TRL's
    `unpair_preference_dataset`). Rows a loss cannot use (unpaired rows for pair losses, stepwise
    rows for any) raise ValueError naming them.
    """
    out, unusable = [], []
    for row in rows:
        kind = row.get("kind") or "pair"
        prompt = _messages(row["prompt"])
        if kind == "pair":
            if rl == "kto":
                out.append({"prompt": prompt, "completion": _messages(row["chosen"]), "label": True})
                out.append({"prompt": prompt, "completion": _messages(row["rejected"]), "label": False})
            else:
                out.append({"prompt": prompt, "chosen": _messages(row["chosen"]),
                            "rejected": _messages(row["rejected"])})
        elif kind == "unpaired" and rl == "kto":
            out.append({"prompt": prompt, "completion": _messages(row["completion"]), "label": bool(row["label"])})
        else:
            unusable.append((row.get("pair_id"), kind))
    if unusable:
        listed = ", ".join(f"{pid} ({kind})" for pid, kind in unusable[:5])
        needs = "pair or unpaired" if rl == "kto" else "pair"
        raise ValueError(f"preferences split {split!r}: {len(unusable)} row(s) rl={rl!r} cannot train on "
                         f"(it needs kind {needs}): {listed}")
    if not out:
        raise ValueError(f"preferences split {split!r} has no rows")
    return out


# ---------------------------------------------------------------- preference accuracy


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              add_generation_prompt=add_generation_prompt)["input_ids"])


def _prompt_completion_ids(tokenizer, prompt: list[dict], completion: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the prompt (with the generation prompt) and of the completion after it, split where
    the two renderings diverge, as TRL's DPOTrainer splits them."""
    prompt_ids = _chat_ids(tokenizer, prompt, add_generation_prompt=True)
    full_ids = _chat_ids(tokenizer, prompt + completion, add_generation_prompt=False)
    n = 0
    while n < min(len(prompt_ids), len(full_ids)) and prompt_ids[n] == full_ids[n]:
        n += 1
    return full_ids[:n], full_ids[n:]


def completion_logps(model, tokenizer, pairs: list[tuple[list[dict], list[dict]]], batch_size: int = 32) -> list[float]:
    """Sum of the completion's token log-probs given the prompt, chat template applied, per (prompt, completion)."""
    import torch

    encoded = [_prompt_completion_ids(tokenizer, p, c) for p, c in pairs]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    out: list[float] = []
    with torch.no_grad():
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start : start + batch_size]
            width = max(len(p) + len(c) for p, c in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            completion = torch.zeros((len(chunk), width), dtype=torch.bool)
            for i, (p, c) in enumerate(chunk):
                ids[i, : len(p) + len(c)] = torch.tensor(p + c)
                attention[i, : len(p) + len(c)] = 1
                completion[i, len(p) : len(p) + len(c)] = True
            ids, attention, completion = ids.to(device), attention.to(device), completion.to(device)
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
            token_logps = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            out += (token_logps * completion[:, 1:]).sum(-1).tolist()
    return out


def preference_accuracy(model, tokenizer, rows: list[dict]) -> float:
    """Fraction of pairs with log pi(chosen | prompt) > log pi(rejected | prompt) under `model`.

    `rows`: preference pairs {prompt, chosen, rejected} as message lists (preferences rows of kind
    "pair", or TRL rows). Log-probs are summed over the completion tokens of the chat-templated text.
    """
    pairs = [r for r in rows if r.get("chosen") is not None and r.get("rejected") is not None]
    if not pairs:
        raise ValueError("preference_accuracy: no rows with chosen and rejected")
    was_training = model.training
    model.eval()
    try:
        chosen = completion_logps(model, tokenizer, [(_messages(r["prompt"]), _messages(r["chosen"])) for r in pairs])
        rejected = completion_logps(model, tokenizer,
                                    [(_messages(r["prompt"]), _messages(r["rejected"])) for r in pairs])
    finally:
        model.train(was_training)
    return sum(c > r for c, r in zip(chosen, rejected)) / len(pairs)


def kto_rows_logps(model, tokenizer, rows: list[dict]) -> list[float]:
    """log pi(completion | prompt) under `model` for KTO rows {prompt, completion, label} (to_trl_rows)."""
    was_training = model.training
    model.eval()
    try:
        return completion_logps(model, tokenizer, [(r["prompt"], r["completion"]) for r in rows])
    finally:
        model.train(was_training)


def kto_heldout(rows: list[dict], start_logps: list[float], end_logps: list[float], beta: float) -> dict:
    """KTO's held-out metrics, as TRL's KTOTrainer logs them: the implicit reward beta * (log pi - log pi_start) of
    each held-out row, its means over desirable (`rewards_chosen`) and undesirable rows (`rewards_rejected`), their
    difference (`rewards_margins`), and `label_accuracy`: the share of rows whose reward has the label's sign
    (> 0 desirable, < 0 undesirable). The starting policy is KTO's reference: its rewards are all 0."""
    rewards = [beta * (end - start) for start, end in zip(start_logps, end_logps)]
    good = [r for r, row in zip(rewards, rows) if row["label"]]
    bad = [r for r, row in zip(rewards, rows) if not row["label"]]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    chosen, rejected = mean(good), mean(bad)
    return {"rows": len(rows), "desirable": len(good), "undesirable": len(bad),
            "rewards_chosen": chosen, "rewards_rejected": rejected,
            "rewards_margins": None if chosen is None or rejected is None else chosen - rejected,
            "label_accuracy": (sum(r > 0 for r in good) + sum(r < 0 for r in bad)) / len(rows)}


# ---------------------------------------------------------------- models and trainer


def load_models(cfg: PreferenceOptimizationConfig, model_dir: Path, devices: DeviceConfig | None = None):
    """(starting policy, frozen reference model or None). None means: TRL uses the adapter-disabled
    base (LoRA) or needs no reference (orpo, simpo). The policy is trainable (fp32 on the device), the
    reference frozen in the compute dtype (stages/runtime/devices.py)."""
    from transformers import AutoModelForCausalLM

    from stages.runtime.policy import MODEL_LOADING

    separate_ref = cfg.rl in REFERENCE_RL and (cfg.adapter == "none" or cfg.rl_adapter_ref_model)
    with MODEL_LOADING:
        model = devices_module.load_trainable(AutoModelForCausalLM, model_dir, devices)
        ref_model = devices_module.load_frozen(AutoModelForCausalLM, model_dir, devices) if separate_ref else None
    return model, ref_model


def build_trainer(cfg: PreferenceOptimizationConfig, model, ref_model, tokenizer, train_rows: list[dict],
                  output_dir: Path, callbacks: list | None = None, devices: DeviceConfig | None = None):
    """The TRL trainer for `cfg.rl` on TRL-format rows (see `to_trl_rows`), not yet trained."""
    import datasets

    trainer_class, _ = trl_classes(cfg.rl)
    args = build_trl_config(cfg, output_dir, devices)
    kwargs = dict(model=model, args=args, train_dataset=datasets.Dataset.from_list(train_rows),
                  processing_class=tokenizer, callbacks=callbacks, peft_config=lora_config(cfg))
    if cfg.rl in REFERENCE_RL:
        kwargs["ref_model"] = ref_model
    elif ref_model is not None:
        raise ValueError(f"rl={cfg.rl!r} uses no reference model")
    return quiet_trainer(trainer_class(**kwargs), cfg)


def reference_kind(cfg: PreferenceOptimizationConfig) -> str:
    """What the loss compares with: "none", "adapter_disabled" or "separate_copy"."""
    if cfg.rl not in REFERENCE_RL:
        return "none"
    return "separate_copy" if cfg.adapter == "none" or cfg.rl_adapter_ref_model else "adapter_disabled"


def run(
    cfg: PreferenceOptimizationConfig,
    model_dir: Path,
    preferences_dir: Path,
    out_dir: Path,
    on_metrics: Callable[[dict, int], None] | None = None,
    work_dir: Path | None = None,
    group=None,
    devices: DeviceConfig | None = None,
) -> dict:
    """Train the policy in model_dir on preferences_dir/<split>.parquet; save to out_dir.

    out_dir gets a PEFT adapter folder (`adapter: lora`; merge with export.run(cfg, model_dir,
    out_dir, ...)) or a complete model folder with the tokenizer (`adapter: none`). `on_metrics`
    receives each logging step's numeric train metrics, keys prefixed "preference/" (loss,
    rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, ...), and the step.
    Returns {rl, reference, rows, train_rows, steps, train_loss, final_metrics, eval_pairs,
    eval_accuracy_before, eval_accuracy_after, device, precision (, gpu)}; the eval entries are None
    without an eval split of pairs. kto with an eval split also returns eval_kto (kto_heldout). Checkpoints go to work_dir and training resumes from the newest
    complete one there (stages/runtime/checkpoints.py); None: a folder inside out_dir, deleted at the end.
    `group`: on ranks launched by stages/runtime/distributed.py HF Trainer runs DDP; rank 0 alone writes out_dir.
    `devices` (stages/runtime/devices.py; None: DeviceConfig(), auto): device and precision of the models.
    """
    from transformers import AutoTokenizer

    model_dir, preferences_dir, out_dir = Path(model_dir), Path(preferences_dir), Path(out_dir)
    train_path = preferences_dir / f"{cfg.split}.parquet"
    if not train_path.exists():
        raise FileNotFoundError(f"preference_optimization.split: {train_path} does not exist")
    rows = read_rows(train_path)
    train_rows = to_trl_rows(rows, cfg.rl, cfg.split)
    if cfg.rl == "kto":  # KTOTrainer samples in order (its KL term pairs neighbours): mix labels and prompts
        random.Random(cfg.seed).shuffle(train_rows)
    eval_pairs: list[dict] = []
    kto_eval: list[dict] = []  # KTO: every held-out row, unpaired or a pair's two turns
    if cfg.eval_split and (preferences_dir / f"{cfg.eval_split}.parquet").exists():
        eval_rows = read_rows(preferences_dir / f"{cfg.eval_split}.parquet")
        eval_pairs = [r for r in eval_rows if r.get("kind") == "pair"]
        usable = [r for r in eval_rows if (r.get("kind") or "pair") in ("pair", "unpaired")]
        if cfg.rl == "kto" and usable:
            kto_eval = to_trl_rows(usable, "kto", cfg.eval_split)

    check_eval_steps("dpo", cfg, bool(eval_pairs), "pairs", preferences_dir)
    devices = devices or DeviceConfig()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model, ref_model = load_models(cfg, model_dir, devices)
    accuracy_before = preference_accuracy(model, tokenizer, eval_pairs) if eval_pairs else None
    kto_start = kto_rows_logps(model, tokenizer, kto_eval) if kto_eval else None

    logged: list[dict] = []
    history: list[list] = []
    evaluate = periodic_eval(cfg.eval_steps, lambda m: preference_accuracy(m, tokenizer, eval_pairs),
                             METRIC_PREFIX + "eval_accuracy", on_metrics, history)
    trainer = build_trainer(cfg, model, ref_model, tokenizer, train_rows, work_dir or out_dir / "_trainer",
                            [metrics_callback(METRIC_PREFIX, on_metrics, logged), evaluate], devices)
    result, resumed_from = checkpoints.train(trainer, Path(trainer.args.output_dir))
    trained = trainer.model
    accuracy_after = preference_accuracy(trained, tokenizer, eval_pairs) if eval_pairs else None
    kto = kto_heldout(kto_eval, kto_start, kto_rows_logps(trained, tokenizer, kto_eval), cfg.rl_beta) if kto_eval \
        else None

    if group is None or group.rank == 0:
        trained.save_pretrained(out_dir)  # PeftModel: adapter_model.safetensors + adapter_config.json
        if cfg.adapter == "none":
            tokenizer.save_pretrained(out_dir)  # a complete model folder: engines and export load it as is
        if work_dir is None:
            shutil.rmtree(trainer.args.output_dir, ignore_errors=True)
    return {
        "rl": cfg.rl,
        "reference": reference_kind(cfg),
        "rows": len(rows),
        "train_rows": len(train_rows),
        "steps": result.global_step,
        "resumed_from_step": resumed_from,
        "train_loss": result.training_loss,
        # non-padding input tokens, every epoch (rl: dpo, ipo; tasks/costs.py)
        "tokens_trained": int(trainer.state.num_input_tokens_seen) if cfg.rl in ("dpo", "ipo") else None,
        "final_metrics": logged[-1] if logged else {},
        "eval_pairs": len(eval_pairs),
        "eval_accuracy_before": accuracy_before,
        "eval_accuracy_after": accuracy_after,
        **({"eval_kto": kto} if kto else {}),
        **({"eval_history": history} if cfg.eval_steps else {}),
        **devices_module.describe(devices),
    }
