"""Loss parity between stages/training/grpo.py and TRL 1.16's GRPOTrainer.

A real `trl.GRPOTrainer` is built once (tiny random-init Qwen2, locally trained tokenizer,
CPU, fp32). On one hand-made micro-batch -- left-padded prompts, right-padded completions
of ragged length, advantages of both signs, old log-probs perturbed from the model's own so
ratios are != 1 and tokens get clipped on both sides, reference log-probs perturbed too,
beta > 0, epsilon 0.2 / epsilon_high 0.28 -- we check, for every loss_type:

* loss:      grpo_loss(LossInputs(completion_logps(...), ...))  ==  trainer._compute_loss(model, inputs)
* gradients: d loss / d params of both sides agree (catches terms whose value is ~equal
             but whose gradient is not, e.g. a ratio factor that is ~1 in value)
* metrics:   our clip_ratio / kl  ==  TRL's clip_ratio/region_mean / kl

Accumulation scaling is made identical on both sides: `trainer.current_gradient_accumulation_steps`
(set by HF Trainer's loop, so set here by hand) equals our `gradient_accumulation_steps`, and
for dapo TRL's normalizer is `num_items_in_batch * current_gradient_accumulation_steps /
steps_per_generation`, which with the default steps_per_generation == gradient_accumulation_steps
is `num_items_in_batch`: the completion tokens of the whole optimizer step, our argument.

Tolerances: 1e-5 absolute and relative (torch.testing.assert_close: |a-b| <= 1e-5 + 1e-5*|b|).
fp32 throughout; the two sides differ only by op ordering (TRL's chunked fused LM head vs a
full log_softmax), which measured ~1e-6 on these values.
"""

from __future__ import annotations

import os

# Before anything imports transformers / TRL: never reach for the hub, no telemetry, quiet tokenizers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import math
from dataclasses import replace

import pytest
import torch

from stages.training.grpo import collate
from stages.training.grpo_loss import LOSS_TYPES, LossConfig, LossInputs, grpo_loss
from stages.training.logprobs import completion_logps

TEMPERATURE = 0.7
BETA = 0.04
EPSILON = 0.2
EPSILON_HIGH = 0.28
MAX_COMPLETION_LENGTH = 10  # > the longest completion (8), so dr_grpo's normalizer is not the padded width
GRAD_ACCUM = 2
NUM_GENERATIONS = 4
TOL = dict(rtol=1e-5, atol=1e-5)

PROMPT_LENS = [3, 5, 2, 4]
COMPLETION_LENS = [6, 1, 8, 3]  # ragged
ADVANTAGES = [1.0, -0.5, 0.8, -1.2]  # both signs, so both clip sides are exercised
OTHER_MICRO_BATCH_TOKENS = 13  # completion tokens of the step's other micro-batch (dapo's normalizer)
# log(ratio) = logp - old_logp, cycled over the completion tokens: 0.5 -> 1.65 (clipped high when A > 0),
# -0.5 -> 0.61 (clipped low when A < 0), 0.22 -> 1.246 (inside (1.2, 1.28]: clipped only if epsilon_high
# were ignored), +-0.1 -> unclipped.
LOG_RATIOS = [0.5, -0.5, 0.22, 0.1, -0.1, -0.3, 0.4]


def _settings(loss_type: str, **overrides) -> LossConfig:
    """The parity batch's loss settings (TRL's, as the fixture sets them)."""
    return LossConfig(loss_type=loss_type, epsilon=EPSILON, epsilon_high=EPSILON_HIGH, beta=BETA,
                      max_completion_length=MAX_COMPLETION_LENGTH, **overrides)


def _parity_inputs(batch, logps, **extra) -> LossInputs:
    """The parity batch as grpo_loss's input record, with `logps` as pi_theta's."""
    inputs = batch["inputs"]
    return LossInputs(logps, inputs["old_per_token_logps"], inputs["advantages"], inputs["completion_mask"],
                      num_items_in_batch=batch["num_items"], gradient_accumulation_steps=GRAD_ACCUM,
                      ref_logps=inputs["ref_per_token_logps"], **extra)


def _as_floats(out):
    """(loss, metrics as Python floats) of a LossOutputs."""
    return out.loss, {k: float(v) for k, v in out.metrics.items()}


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Qwen2Config
    from trl import GRPOConfig, GRPOTrainer

    from stages.data.base_model import train_tokenizer

    tmp = tmp_path_factory.mktemp("grpo_parity")
    tokenizer = train_tokenizer(["what is 1 + 2 ? 3", "hello world, the answer is 42"] * 4, 64)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    # Loaded from disk so `_name_or_path` is set: with beta > 0 and no PEFT, TRL builds its ref model from it.
    model = AutoModelForCausalLM.from_pretrained(tmp / "model", dtype=torch.float32)

    args = GRPOConfig(
        output_dir=str(tmp / "out"),
        use_cpu=True,
        report_to=[],
        bf16=False,  # GRPOConfig defaults bf16=True, which would autocast TRL's forward on CPU
        gradient_checkpointing=False,  # GRPOConfig defaults to True; irrelevant to values, only slower
        per_device_train_batch_size=NUM_GENERATIONS,
        num_generations=NUM_GENERATIONS,
        gradient_accumulation_steps=GRAD_ACCUM,
        loss_type="dapo",  # switched per test through `trainer.loss_type`, the attribute _compute_loss reads
        beta=BETA,
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    dataset = Dataset.from_dict({"prompt": ["what is 1 + 2 ?", "hello world"] * 4})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    # Pin the knobs that would otherwise change _compute_loss (all TRL defaults; asserted so a TRL bump is loud).
    assert trainer.args.steps_per_generation == GRAD_ACCUM
    assert trainer.accelerator.num_processes == 1
    assert trainer.importance_sampling_level == "token"
    assert trainer.top_entropy_quantile == 1.0 and trainer.off_policy_mask_threshold is None
    assert not trainer.use_vllm and not trainer._entropy_bonus_enabled and not trainer.aux_loss_enabled
    assert trainer.args.delta is None
    assert trainer.epsilon_low == EPSILON and trainer.epsilon_high == EPSILON_HIGH and trainer.beta == BETA
    assert trainer.temperature == TEMPERATURE and trainer.max_completion_length == MAX_COMPLETION_LENGTH
    assert next(trainer.model.parameters()).dtype == torch.float32
    trainer.model.train()  # _compute_loss applies accumulation scaling in train mode only
    trainer.current_gradient_accumulation_steps = GRAD_ACCUM  # set by HF Trainer's loop on every window
    return trainer


@pytest.fixture(scope="module")
def batch(trainer):
    """One micro-batch in TRL's layout, with old/ref log-probs derived from the model's own."""
    model = trainer.model
    vocab = model.config.vocab_size
    pad_id = trainer.processing_class.pad_token_id
    g = torch.Generator().manual_seed(1234)
    rows = [
        {
            "prompt_token_ids": torch.randint(3, vocab, (p,), generator=g).tolist(),
            "completion_token_ids": torch.randint(3, vocab, (c,), generator=g).tolist(),
            "sampling_logprobs": [0.0] * c,  # replaced below
            "advantage": a,
        }
        for p, c, a in zip(PROMPT_LENS, COMPLETION_LENS, ADVANTAGES)
    ]
    b = collate(rows, pad_id)
    mask = b["completion_mask"].bool()
    assert b["prompt_mask"][:, 0].tolist() == [0, 1, 0, 0]  # left padded
    assert mask[:, -1].tolist() == [False, False, True, False]  # right padded

    input_ids = torch.cat([b["prompt_ids"], b["completion_ids"]], dim=1)
    attention_mask = torch.cat([b["prompt_mask"], b["completion_mask"]], dim=1)
    logits_to_keep = b["completion_ids"].size(1)
    with torch.no_grad():
        logps, _ = completion_logps(model, input_ids, attention_mask, logits_to_keep, TEMPERATURE)

    n = logps.numel()
    log_ratio = torch.tensor(LOG_RATIOS * (n // len(LOG_RATIOS) + 1))[:n].view_as(logps)
    # Padding positions carry 0.0, as collate() pads sampling_logprobs and TRL's fused head returns them.
    old = torch.where(mask, logps - log_ratio, torch.zeros_like(logps))
    ref = torch.where(mask, logps + 0.8 * torch.randn(logps.shape, generator=g), torch.zeros_like(logps))
    num_items = float(mask.sum()) + OTHER_MICRO_BATCH_TOKENS

    inputs = {
        "prompt_ids": b["prompt_ids"],
        "prompt_mask": b["prompt_mask"],
        "completion_ids": b["completion_ids"],
        "completion_mask": b["completion_mask"],
        "advantages": b["advantages"],
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(num_items),
    }
    return {
        "inputs": inputs,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "logits_to_keep": logits_to_keep,
        "num_items": num_items,
    }


# ---------------------------------------------------------------- helpers


def _trl_loss(trainer, inputs, loss_type: str, bias_correction: bool):
    trainer.loss_type = loss_type
    trainer.args.loss_type = loss_type
    trainer.args.use_bias_correction_kl = bias_correction
    trainer._metrics["train"].clear()
    return trainer._compute_loss(trainer.model, inputs)


def _our_loss(trainer, batch, loss_type: str, bias_correction: bool):
    logps, _ = completion_logps(
        trainer.model, batch["input_ids"], batch["attention_mask"], batch["logits_to_keep"], TEMPERATURE
    )
    return _as_floats(grpo_loss(_parity_inputs(batch, logps),
                                _settings(loss_type, use_bias_correction_kl=bias_correction)))


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


# ---------------------------------------------------------------- tests


def test_batch_exercises_clipping_and_kl(trainer, batch):
    """Guard: the parity batch is not degenerate (ratios != 1, clipping on both sides, KL term >> tolerance)."""
    _trl_loss(trainer, batch["inputs"], "bnpo", True)
    metrics = trainer._metrics["train"]
    assert metrics["clip_ratio/high_mean"][-1] > 0.05
    assert metrics["clip_ratio/low_mean"][-1] > 0.05
    assert BETA * metrics["kl"][-1] > 100 * TOL["atol"]  # the KL term moves the loss well past the tolerance


def test_per_token_logps_match_trl(trainer, batch):
    inputs = batch["inputs"]
    mask = inputs["completion_mask"].bool()
    with torch.no_grad():
        ours, our_entropy = completion_logps(
            trainer.model, batch["input_ids"], batch["attention_mask"], batch["logits_to_keep"], TEMPERATURE
        )
        theirs, their_entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, batch["input_ids"], batch["attention_mask"], batch["logits_to_keep"], compute_entropy=True
        )
    assert ours.shape == theirs.shape == mask.shape
    # TRL's fused LM head scores only labels != -100 and returns 0 at completion padding; ours scores every
    # position (the loss masks them), so compare on real completion tokens.
    assert torch.all(theirs[~mask] == 0)
    torch.testing.assert_close(ours[mask], theirs[mask], **TOL)
    torch.testing.assert_close(our_entropy[mask], their_entropy[mask], **TOL)
    assert ours[mask].std() > 0.1  # not a constant distribution


@pytest.mark.parametrize("bias_correction", [True, False],
                         ids=["trl_default_kl_bias_correction", "no_kl_bias_correction"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradients_match_trl(trainer, batch, loss_type, bias_correction):
    """grpo_loss == GRPOTrainer._compute_loss (value, parameter gradients, clip/kl metrics).

    `use_bias_correction_kl` is TRL 1.16's GRPOConfig field (default True): the k3 KL term is multiplied
    by the importance ratio exp(logp - old_logp). Both settings are checked.
    """
    model = trainer.model
    theirs = _trl_loss(trainer, batch["inputs"], loss_type, bias_correction)
    their_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    their_grads = _grads(model, theirs)

    ours, stats = _our_loss(trainer, batch, loss_type, bias_correction)
    our_grads = _grads(model, ours)

    torch.testing.assert_close(ours.detach(), theirs.detach(), **TOL, msg=lambda m: f"{loss_type} loss: {m}")
    assert math.isclose(stats["clip_ratio"], their_metrics["clip_ratio/region_mean"], rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(stats["kl"], their_metrics["kl"],
                        rel_tol=1e-5, abs_tol=1e-5), (stats["kl"], their_metrics["kl"])
    assert stats["tokens"] == float(batch["inputs"]["completion_mask"].sum())

    assert their_grads.keys() == our_grads.keys() and their_grads
    for name, g in their_grads.items():
        # Same 1e-5 absolute / relative bound per element; gradients here are O(1e-2 .. 1).
        torch.testing.assert_close(our_grads[name], g, **TOL, msg=lambda m, n=name: f"{loss_type} grad {n}: {m}")
    assert max(g.abs().max() for g in their_grads.values()) > 1e-3  # non-trivial gradients


def test_accumulation_scaling(trainer, batch):
    """Halving the window: grpo/bnpo/dr_grpo double (divided by GA), dapo does not
    (its normalizer is the step's tokens)."""
    for loss_type in LOSS_TYPES:
        with torch.no_grad():
            two, _ = _our_loss(trainer, batch, loss_type, False)
            logps, _ = completion_logps(
                trainer.model, batch["input_ids"], batch["attention_mask"], batch["logits_to_keep"], TEMPERATURE
            )
            one, _ = _as_floats(grpo_loss(replace(_parity_inputs(batch, logps), gradient_accumulation_steps=1),
                                          _settings(loss_type, use_bias_correction_kl=False)))
        factor = 1.0 if loss_type == "dapo" else 2.0
        torch.testing.assert_close(one, two * factor, **TOL)


def test_clipping_by_hand():
    """2x2 batch, old log-probs 0, so ratio = exp(logp). epsilon 0.2, epsilon_high 0.28.

    row 0, A = +1: ratio 1.5  > 1.28 -> clipped: contributes -1.28, counts in clip_ratio, no gradient
                   ratio 1.25 in (1.2, 1.28] -> NOT clipped (clip-higher): contributes -1.25, gradient -1.25
    row 1, A = -1: ratio 0.5  < 0.8 -> clipped: contributes +0.8, counts, no gradient
                   ratio 9.0, masked out: contributes nothing, never counted
    """
    logps = torch.log(torch.tensor([[1.5, 1.25], [0.5, 9.0]])).requires_grad_()
    old = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    common = dict(epsilon=0.2, epsilon_high=0.28, beta=0.0, max_completion_length=2)

    def grpo_loss_by_hand(logps, loss_type, **settings):
        inputs = LossInputs(logps, old, adv, mask, num_items_in_batch=3.0, gradient_accumulation_steps=1)
        return _as_floats(grpo_loss(inputs, LossConfig(loss_type=loss_type, **settings)))

    loss, stats = grpo_loss_by_hand(logps, loss_type="bnpo", **common)
    assert loss.item() == pytest.approx((-1.28 - 1.25 + 0.8) / 3, abs=1e-6)
    assert stats["clip_ratio"] == pytest.approx(2 / 3, abs=1e-6)
    assert stats["tokens"] == 3.0 and stats["kl"] == 0.0
    loss.backward()
    # d/dlogp of -ratio*A is -ratio*A on the unclipped token; clipped and masked tokens get none.
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, -1.25 / 3], [0.0, 0.0]]))

    expected = {
        "grpo": ((-1.28 - 1.25) / 2 + 0.8) / 2,
        "dr_grpo": (-1.28 - 1.25 + 0.8) / (2 * 2),
        "dapo": (-1.28 - 1.25 + 0.8) / 3,
    }
    for loss_type, value in expected.items():
        loss, _ = grpo_loss_by_hand(logps.detach(), loss_type=loss_type, **common)
        assert loss.item() == pytest.approx(value, abs=1e-6), loss_type

    # With symmetric clipping (epsilon_high = epsilon) the 1.25 token is clipped too.
    loss, stats = grpo_loss_by_hand(logps.detach(), loss_type="bnpo", **{**common, "epsilon_high": 0.2})
    assert loss.item() == pytest.approx((-1.2 - 1.2 + 0.8) / 3, abs=1e-6)
    assert stats["clip_ratio"] == pytest.approx(1.0, abs=1e-6)


def test_unknown_loss_type_raises():
    t = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(LossInputs(t, t, torch.ones(1), torch.ones(1, 1), num_items_in_batch=1,
                             gradient_accumulation_steps=1),
                  LossConfig(loss_type="nope", epsilon=0.2, epsilon_high=0.2, beta=0.0, max_completion_length=1))


@pytest.mark.parametrize("variant", ["is_token_truncate", "is_sequence_mask", "sequence_level_ratio",
                                     "off_policy_mask"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_off_policy_corrections_match_trl(trainer, batch, loss_type, variant):
    """The sampling correction (TRL's vllm_importance_sampling_*), GSPO's sequence-level ratio and
    DeepSeek-V3.2's off-policy mask give TRL's loss and gradients on the same batch."""
    from stages.training.grpo_loss import off_policy_mask, sampling_correction

    inputs = dict(batch["inputs"])
    mask = inputs["completion_mask"].float()
    g = torch.Generator().manual_seed(7)
    # a sampler whose log-probs differ from pi_old by up to +-1.5 per token: ratios both sides of the cap
    sampling = torch.where(mask.bool(), inputs["old_per_token_logps"] + 3 * (torch.rand(mask.shape, generator=g) - 0.5),
                           torch.zeros_like(mask))
    saved = {k: getattr(trainer, k) for k in ("use_vllm", "vllm_importance_sampling_correction",
                                              "importance_sampling_level", "off_policy_mask_threshold")}
    ours_inputs, ours_settings = {}, {}
    try:
        if variant.startswith("is_"):
            mode = "token_truncate" if variant == "is_token_truncate" else "sequence_mask"
            weights = sampling_correction(inputs["old_per_token_logps"], sampling, mask, mode, 1.5)
            assert (weights == 1.5).any() or (weights == 0).any()  # the cap is exercised
            trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
            inputs["importance_sampling_ratio"] = weights
            ours_inputs["is_weights"] = weights
        elif variant == "sequence_level_ratio":
            trainer.importance_sampling_level = "sequence"
            ours_settings["importance_sampling_level"] = "sequence"
        else:
            trainer.off_policy_mask_threshold = 0.1
            inputs["sampling_per_token_logps"] = sampling
        theirs = _trl_loss(trainer, inputs, loss_type, True)
        their_grads = _grads(trainer.model, theirs)

        logps, _ = completion_logps(trainer.model, batch["input_ids"], batch["attention_mask"],
                                    batch["logits_to_keep"], TEMPERATURE)
        if variant == "off_policy_mask":
            keep = off_policy_mask(inputs["advantages"], logps, sampling, mask, 0.1)
            assert 0 < keep.sum() < len(keep)  # some sequences dropped, some kept
            ours_inputs["off_policy_keep"] = keep
        ours, _ = _as_floats(grpo_loss(_parity_inputs(batch, logps, **ours_inputs),
                                       _settings(loss_type, use_bias_correction_kl=True, **ours_settings)))
        our_grads = _grads(trainer.model, ours)
    finally:
        for k, v in saved.items():
            setattr(trainer, k, v)
    torch.testing.assert_close(ours.detach(), theirs.detach(), **TOL)
    for name, grad in their_grads.items():
        torch.testing.assert_close(our_grads[name], grad, **TOL)


def test_mean_ratio_is_the_token_mean_of_pi_over_pi_old():
    """axolotl's `mean_ratio` (training-stability guide): exp(logp - old_logp) averaged over the completion
    tokens the mask keeps."""

    logps = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.3, 0.3]]))
    old = torch.log(torch.tensor([[0.25, 0.2, 0.3], [0.6, 0.3, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    inputs = LossInputs(logps, old, torch.tensor([1.0, -1.0]), mask, num_items_in_batch=5,
                        gradient_accumulation_steps=1)
    _, stats = _as_floats(grpo_loss(inputs, LossConfig(loss_type="dapo", epsilon=0.2, epsilon_high=0.2, beta=0.0,
                                                       max_completion_length=3)))
    assert math.isclose(stats["mean_ratio"], (2.0 + 1.0 + 0.5 + 1.0 + 3.0) / 5, rel_tol=1e-6)
