"""EBFT (energy-based fine-tuning): the score step of `rl: ebft` rounds -- feature-matching rewards.

"Matching Features, Not Tokens: Energy-Based Fine-Tuning of Language Models" (Jelassi et al., 2026,
arXiv 2603.12248), as axolotl's structured mode (`axolotl/core/trainers/ebft/{rewards,trainer}.py`)
computes it. A frozen feature network phi -- the round-0 policy (the SFT output, or the base model),
never updated -- reads prompt + completion; the hidden states at `feature_layers` (fractions of the
depth: int(f * num_hidden_layers) indexes `hidden_states`, 0 being the embeddings) are concatenated and
pooled per sequence (`embed_method`), then L2-normalized (or, with `use_whitening`, whitened with the
SVD of the group's own embeddings). With n completions y_1..y_n of a prompt and its reference y
(paper eq. 7, axolotl's factor 2):

  alignment_j = 2 cos(phi(y_j), phi(y))
  diversity_j = 2/(n-1) * sum_{j' != j} phi(y_j) . phi(y_j')
  reward_j    = alignment_coef * alignment_j - diversity_coef * diversity_j

and the conditional feature-matching distance (paper eq. 2), logged as `ebft/feature_distance`:
||mean_j phi(y_j) - phi(y)||^2, averaged over prompts (axolotl's `ebft/cfm_loss`). Advantages:
`advantage_estimator` rloo (r_j - mean of the other n-1 rewards; the default here, and axolotl's strided
trainer's), grpo (group normalization by score.scale_rewards, stages/scoring/advantages.py `group_advantages`; axolotl's
`group_norm`, and what its structured trainer, a TRL GRPOTrainer, computes) or reinforce (the raw reward). The
optimize stage is GRPO's (stages/training/grpo.py), plus `ce_coef` times the
cross-entropy of the reference completion (the scored rows carry its tokens, `reference_token_ids`).

The scored table is the score stage's: `rewards` holds {alignment, diversity} per row (the lineage shows
them), `reward` the weighted total, `advantage` the estimator's.

Departures from axolotl:
- The reference completion is `ground_truth`, a str.format template over the prompt row's columns
  (axolotl reads a dataset column `ground_truth`): `{ground_truth}` (default) for that column,
  `<answer>{answer}</answer>` for the demo task's gold answer, `{teacher_completion}` for its teacher.
- Sequences are the rollout's token ids (prompt + completion, trailing special tokens dropped) and the
  prompt's token ids + the tokenized reference; axolotl re-tokenizes prompt + completion text.
- `n_samples_per_prompt` / `generate_max_len` are unset by default and then are rollout.num_generations /
  rollout.max_completion_length (set, they set those; both set differently is an error). axolotl's
  defaults (4, 8) belong to its strided mode.
- `mode: strided` (anchors inside raw documents) is stages/training/ebft_strided.py's rollout; its blocks are then
  scored here like structured prompts, their references read from the rows, each feature layer
  L2-normalized per token before the layers are concatenated and pooled (axolotl's strided trainer does
  that; its structured one, and structured mode here, concatenate the raw hidden states). `adaptive_max_tokens` is not
  ported.
- `ce_coef`'s term runs on the micro-batches the GRPO loss runs on (skipped zero-signal batches skip it).

Run: `posttrain run configs/ebft.yaml`; the pure functions below are tested in tests/test_ebft.py.
"""

from __future__ import annotations

import math
import string
from pathlib import Path
from typing import ClassVar, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.data.schemas import SCORED, write_table
from stages.runtime.imports import LazyModule
from stages.runtime.keys import not_in_key

torch = LazyModule("torch")  # imported on first use: loading a config does not import torch
F = LazyModule("torch.nn.functional")


class EBFTConfig(BaseModel):
    """Energy-based fine-tuning (`rl: ebft`), option names as axolotl's `ebft:` section."""

    model_config = ConfigDict(extra="forbid")

    feature_layers: list[float] = Field(default_factory=lambda: [0.25, 0.5, 0.75], min_length=1)
    """Depths (fractions in [0, 1]) of the frozen model's hidden states that make the features, concatenated:
    int(f * num_hidden_layers) indexes hidden_states (0 = embeddings). axolotl's default: three depths, low
    layers (surface form) to high (meaning); more layers: a richer but larger feature vector."""
    embed_method: Literal["last_token", "mean_pooling", "completion_mean", "concat"] = "last_token"
    """Pooling of per-token features into one vector per sequence (axolotl's). last_token: the last token
    (it has read the whole sequence; axolotl's default). mean_pooling: mean over prompt + completion.
    completion_mean: mean over the completion's tokens only. concat: tokens at 1/4, 1/2, 3/4 of the length.
    mode: strided: a block is the completion; mean_pooling means its tokens (as axolotl's strided trainer), and
    concat is an error."""
    use_whitening: bool = False
    """Whiten each group's embeddings with the SVD of its n completions' embeddings (axolotl's
    `whiten_embeddings_batched`) instead of L2-normalizing: no single feature direction dominates; rewards
    then scale with the group size. False (axolotl's default): cosine features."""
    alignment_coef: float = 1.0
    """Weight of the alignment reward 2 cos(phi(y_j), phi(y)). Higher: closer to the reference's features."""
    diversity_coef: float = 1.0
    """Weight of the diversity penalty 2/(n-1) sum phi(y_j).phi(y_j'). 1 (paper, axolotl): the reward is an
    unbiased estimate of the feature-matching distance's gradient; 0: pure alignment (mode seeking)."""
    ce_coef: float = Field(0.0, ge=0)
    """Weight of the cross-entropy of the reference completion added to the optimize loss (axolotl's
    `ce_coef`): per micro-batch, the mean token NLL of its prompts' references. 0 (default): none."""
    ground_truth: str = "{ground_truth}"
    """The reference completion of a prompt: a str.format template over the prompt row's columns (departure:
    axolotl reads the column `ground_truth`). The demo task: `<answer>{answer}</answer>` (the gold answer)."""
    mode: Literal["structured", "strided"] = "structured"
    """structured: prompt/reference rows, completions from the rollout stage. strided (axolotl's block-parallel
    mode): raw documents (column `text`, transform.type: text), blocks of generate_max_len tokens written
    from anchors every `stride` tokens, each matched against the document's own continuation
    (stages/training/ebft_strided.py)."""
    stride: int | None = Field(None, ge=1)
    """strided: tokens between anchors (unset: 8, axolotl's default). Lower: more, overlapping blocks per
    document (more rollouts per round). Structured mode has no anchors: setting it there is an error."""
    context_length: int | None = Field(None, ge=1)
    """strided: where the first anchor is, i.e. the fewest document tokens a block reads (unset: 8,
    axolotl's default); block b reads the document's first context_length + b * stride tokens. Structured
    mode: an error."""
    min_completion_prefix: int = Field(0, ge=0)
    """strided, on prompt + completion rows (transform.type ebft_strided_structured.transform): completion tokens
    every block reads before it writes, at the least: the first anchor is max(prompt tokens + this,
    context_length) (axolotl's). 0: blocks may start right after the prompt. Raw documents have no prompt: there
    it is an error."""
    max_document_tokens: int | None = Field(None, ge=1)
    """strided: tokens of a document kept at most (axolotl's `sequence_len` there); a longer one is cut, a prompt +
    completion row's completion first, then its prompt (one completion token kept). Unset: whole documents."""
    generate_max_len: int | None = Field(None, ge=1)
    """Tokens generated per completion (strided: per block): sets rollout.max_completion_length. Unset:
    rollout's (strided: 8, axolotl's default, unless rollout.max_completion_length is set)."""
    n_samples_per_prompt: int | None = Field(None, ge=2)
    """Completions per prompt (the group whose diversity is penalized): sets rollout.num_generations.
    Unset: rollout's. At least 2: diversity and rloo need another sample of the prompt."""
    temperature: float | None = not_in_key(None, gt=0)
    """Sampling temperature of the completions (axolotl's strided `temperature`): sets rollout.temperature
    (the rollout key holds it). Unset: rollout's."""
    top_p: float | None = not_in_key(None, gt=0, le=1)
    """Nucleus sampling of the completions (axolotl's strided `top_p`): sets rollout.top_p. Unset: rollout's."""
    rl_coef: float = not_in_key(1.0, ge=0)
    """Weight of the policy-gradient loss in the optimize stage (axolotl's `rl_coef`): loss = rl_coef * GRPO's
    loss + ce_coef * the reference's cross-entropy. The optimize key holds it when it is not 1; 0 with
    ce_coef 0 trains nothing (an error)."""
    advantage_estimator: Literal["rloo", "grpo", "reinforce"] = "rloo"
    """rloo (axolotl's strided default): A_j = r_j - mean of the other n-1 rewards (unbiased, unscaled). grpo:
    group mean subtracted, divided by score.scale_rewards' std (axolotl's `group_norm`, read as grpo; what
    axolotl's structured EBFT computes, being a TRL GRPOTrainer). reinforce: A_j = r_j."""

    @field_validator("advantage_estimator", mode="before")
    @classmethod
    def _axolotl_group_norm(cls, value):
        return "grpo" if value == "group_norm" else value

    BLOCK_FIELDS: ClassVar[tuple[str, ...]] = ("stride", "context_length", "generate_max_len", "feature_layers",
                                              "embed_method", "min_completion_prefix", "max_document_tokens")
    """The fields that decide strided mode's blocks and the features they are compared by: the strided rollout's
    and eval's keys hold these (the rest of the section is scoring's: its key holds the whole section)."""

    def block_fields(self) -> dict:
        """BLOCK_FIELDS with their values, as a strided rollout's or eval's key holds them."""
        values = self.model_dump(mode="json")
        return {name: values[name] for name in values if name in self.BLOCK_FIELDS}

    @property
    def pooling(self) -> str:
        """The `pool` method for this mode: in strided mode mean_pooling means the block's tokens (axolotl's
        strided trainer), i.e. completion_mean; the sequence before it is the document's prefix."""
        return ("completion_mean" if self.mode == "strided" and self.embed_method == "mean_pooling"
                else self.embed_method)

    @field_validator("feature_layers")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        bad = [f for f in v if not 0.0 <= f <= 1.0]
        if bad:
            raise ValueError(f"feature_layers are fractions of the model's depth in [0, 1]; got {bad} "
                             "(e.g. [0.25, 0.5, 0.75])")
        return v

    @field_validator("ground_truth")
    @classmethod
    def _template(cls, v: str) -> str:
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(v) if name is not None]
        except ValueError as e:
            raise ValueError(f"ground_truth {v!r} is not a str.format template ({e})") from None
        if not fields or any(not f.isidentifier() for f in fields):
            raise ValueError(f"ground_truth {v!r}: name the prompt row's column(s) in braces, "
                             "e.g. '{ground_truth}' or '<answer>{answer}</answer>'")
        return v

    @model_validator(mode="after")
    def _mode_options(self):
        if self.mode == "structured":
            for key in ("stride", "context_length", "max_document_tokens", "min_completion_prefix"):
                if getattr(self, key) not in (None, 0):
                    raise ValueError(f"ebft.{key} belongs to mode: strided (anchors in raw documents); leave it "
                                     "out, or set ebft.mode: strided")
            return self
        if self.embed_method == "concat":
            raise ValueError("ebft.embed_method: concat is not used in mode: strided (axolotl's strided trainer pools "
                             "a block by last_token or mean_pooling); use last_token, mean_pooling or completion_mean")
        if self.ground_truth != type(self).model_fields["ground_truth"].default:  # a saved config lists it as is
            raise ValueError("ebft.ground_truth belongs to mode: structured; in mode: strided each block's "
                             "reference is the document's own continuation. Leave it out")
        self.stride = 8 if self.stride is None else self.stride
        self.context_length = 8 if self.context_length is None else self.context_length
        return self


# ---- pure functions (tested on hand-written tensors in tests/test_ebft.py) -------------------------------------


def layer_indices(fractions: list[float], num_hidden_layers: int) -> list[int]:
    """Indices into `hidden_states` (0 = embeddings) of the fractional depths (axolotl: int(f * L)).

    >>> layer_indices([0.25, 0.5, 0.75], 4)
    [1, 2, 3]
    """
    return [int(f * num_hidden_layers) for f in fractions]


def pool(hidden: torch.Tensor, method: str, attention_mask: torch.Tensor,
         prompt_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sequence embeddings (B, D) of right-padded hidden states (B, S, D), axolotl's `apply_embed_method`."""
    batch = torch.arange(hidden.shape[0], device=hidden.device)
    lengths = attention_mask.sum(dim=1).long()
    if method == "last_token":
        return hidden[batch, lengths - 1]
    if method in ("mean_pooling", "completion_mean"):
        mask = attention_mask.bool()
        if method == "completion_mean":
            mask = mask & (torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
                           >= prompt_lengths.unsqueeze(1))
        mask = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    if method == "concat":
        last = hidden.shape[1] - 1
        quarters = [(lengths * k // 4).clamp(0, last) for k in (1, 2, 3)]
        return torch.cat([hidden[batch, q] for q in quarters], dim=-1)
    raise ValueError(f"unknown embed_method {method!r}")


def whiten(phi: torch.Tensor, phi_ref: torch.Tensor, tol: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """Whiten a group's embeddings (n, D) and its reference's (1, D) with W = U diag(1/s) U^T, U, s from the
    SVD of phi^T; singular values below tol * max are dropped (axolotl's `whiten_embeddings_batched`)."""
    u, s, _ = torch.linalg.svd(phi.double().T, full_matrices=False)
    inv = torch.where(s > tol * s.max(), 1.0 / (s + 1e-12), torch.zeros_like(s))
    w = (u * inv.unsqueeze(0)) @ u.T
    return (phi.double() @ w).to(phi.dtype), (phi_ref.double() @ w).to(phi_ref.dtype)


def feature_matching_rewards(gen: torch.Tensor, ref: torch.Tensor, num_generations: int,
                             alignment_coef: float = 1.0, diversity_coef: float = 1.0,
                             use_whitening: bool = False) -> dict[str, torch.Tensor]:
    """EBFT rewards of completions' embeddings `gen` (P*n, D), laid out prompt by prompt, against their
    references' `ref` (P, D): alignment, diversity, reward (each (P*n,)) and feature_distance (scalar).

    Two completions of one prompt, unit features: phi(y) = (1, 0), phi(y_1) = (1, 0), phi(y_2) = (0, 1):
    alignment = 2 cos = (2, 0), diversity = 2 * phi(y_1).phi(y_2) = (0, 0), distance = |(.5, .5) - (1, 0)|^2.

    >>> out = feature_matching_rewards(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 0.0]]), 2)
    >>> out["reward"].tolist(), round(out["feature_distance"].item(), 3)
    ([2.0, 0.0], 0.5)
    """
    n = num_generations
    if use_whitening:
        pairs = [whiten(g, r.unsqueeze(0)) for g, r in zip(gen.view(-1, n, gen.shape[-1]), ref)]
        gen = torch.cat([g for g, _ in pairs])
        ref = torch.cat([r for _, r in pairs])
    else:
        gen, ref = F.normalize(gen, p=2, dim=-1), F.normalize(ref, p=2, dim=-1)
    alignment = 2 * F.cosine_similarity(gen, ref.repeat_interleave(n, dim=0), dim=-1)
    grouped = gen.view(-1, n, gen.shape[-1])
    sims = torch.bmm(grouped, grouped.transpose(1, 2))
    sims = sims.masked_fill(torch.eye(n, dtype=torch.bool).unsqueeze(0), 0.0)
    diversity = 2 * (sims.sum(dim=-1) / (n - 1)).reshape(-1)
    distance = ((grouped.mean(dim=1) - ref) ** 2).sum(dim=-1).mean()  # paper eq. 2; axolotl's cfm_loss
    return {"alignment": alignment, "diversity": diversity, "feature_distance": distance,
            "reward": alignment_coef * alignment - diversity_coef * diversity}


def advantages(rewards: torch.Tensor, num_generations: int, estimator: str,
               scale_rewards: str = "group") -> torch.Tensor:
    """Advantages of rewards laid out group by group: rloo, grpo (score's group_advantages) or reinforce.

    >>> advantages(torch.tensor([3.0, 1.0, 2.0]), 3, "rloo").tolist()  # 3 - (1+2)/2, 1 - 2.5, 2 - 2
    [1.5, -1.5, 0.0]
    """
    if estimator == "rloo":
        grouped = rewards.view(-1, num_generations)
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
        return (grouped - baseline).reshape(-1)
    if estimator == "grpo":
        from stages.scoring.advantages import group_advantages

        return group_advantages(rewards, num_generations, scale_rewards)
    return rewards.clone()


# ---- the stage ---------------------------------------------------------------------------------------------


def reference_text(template: str, row: dict, where: str) -> str:
    """The row's reference completion; a missing column is an error naming the template and the columns."""
    try:
        return template.format(**row)
    except KeyError as e:
        columns = sorted(k for k, v in row.items() if isinstance(v, (str, int, float)))
        raise ValueError(f"{where}: ebft.ground_truth {template!r} names column {e.args[0]!r}, which the prompt "
                         f"rows do not have (they have {columns}); set ebft.ground_truth to a template over "
                         "those, e.g. '<answer>{answer}</answer>'") from None


def strip_special(ids: list[int], special: set[int]) -> list[int]:
    """Token ids without trailing special tokens (EOS, padding): the completion as its text reads."""
    end = len(ids)
    while end and ids[end - 1] in special:
        end -= 1
    return list(ids[:end])


class FeatureNetwork:
    """The frozen feature model phi: a policy folder loaded once, eval mode, no gradients."""

    def __init__(self, model_dir: Path, feature_layers: list[float], batch_size: int = 64,
                 normalize_layers: bool = False, devices=None):
        from stages.runtime.policy import load_policy

        self.model, self.tokenizer = load_policy(Path(model_dir), devices=devices)
        self.model.requires_grad_(False)
        self.layers = layer_indices(feature_layers, self.model.config.num_hidden_layers)
        self.batch_size = batch_size
        self.normalize_layers = normalize_layers  # strided (axolotl's): each layer L2-normalized per token
        self.special = set(self.tokenizer.all_special_ids)

    def embed(self, sequences: list[list[int]], prompt_lengths: list[int], method: str) -> torch.Tensor:
        """Pooled features (B, len(layers) * hidden) of token sequences (prompt + completion)."""
        with torch.no_grad():  # (not a decorator: that would import torch when a config is loaded)
            out = []
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
            body = getattr(self.model, "model", self.model)  # the transformer without lm_head (axolotl does the same)
            for start in range(0, len(sequences), self.batch_size):
                chunk = sequences[start : start + self.batch_size]
                width = max(len(s) for s in chunk)
                ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk], device=self.model.device)
                mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk], device=self.model.device)
                hidden = body(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
                layers = [hidden[i].float() for i in self.layers]
                if self.normalize_layers:  # no layer outweighs the others by its norm
                    layers = [F.normalize(h, p=2, dim=-1) for h in layers]
                features = torch.cat(layers, dim=-1)
                lengths = torch.tensor(prompt_lengths[start : start + self.batch_size], device=self.model.device)
                out.append(pool(features, method, mask, lengths))
            return torch.cat(out).cpu()

    def reference_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def score_rows(cfg: EBFTConfig, network: FeatureNetwork, rows: list[dict], num_generations: int,
               where: str) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Feature-matching rewards of rollout rows (group by group): (feature_matching_rewards' dict, the
    reference token ids per row)."""
    n = num_generations
    firsts = rows[::n]
    for g, first in enumerate(firsts):
        if any(r["prompt_id"] != first["prompt_id"] for r in rows[g * n : (g + 1) * n]):
            raise ValueError(f"{where}: rows {g * n}..{(g + 1) * n - 1} are not one prompt's group of {n}")
    if cfg.mode == "strided":  # a block's reference is the document's continuation, and is as long as the block
        references = [list(r["reference_token_ids"]) for r in firsts]
        completions = [list(r["completion_token_ids"]) for r in rows]
    else:
        references = [network.reference_ids(reference_text(cfg.ground_truth, r, where)) for r in firsts]
        completions = [strip_special(r["completion_token_ids"], network.special) for r in rows]
    gen = network.embed([list(r["prompt_token_ids"]) + c for r, c in zip(rows, completions)],
                        [len(r["prompt_token_ids"]) for r in rows], cfg.pooling)
    ref = network.embed([list(r["prompt_token_ids"]) + ids for r, ids in zip(firsts, references)],
                        [len(r["prompt_token_ids"]) for r in firsts], cfg.pooling)
    out = feature_matching_rewards(gen, ref, n, cfg.alignment_coef, cfg.diversity_coef, cfg.use_whitening)
    return out, [ids for ids in references for _ in range(n)]


def run(cfg: EBFTConfig, rollouts_path: Path, feature_model_dir: Path, num_generations: int, scale_rewards: str,
        out_dir: Path, devices=None) -> dict:
    """Score a round's rollouts with the frozen feature model (on `devices`, stages/runtime/devices.py) into
    out_dir/scored.parquet; return metrics (the score stage's reward_mean, rewards/<alignment|diversity>/mean,
    collapse metrics, and ebft/*)."""
    from stages.scoring.advantages import reward_spread
    from stages.scoring.collapse import collapse_metrics

    table = pq.read_table(rollouts_path)
    rows = table.to_pylist()
    if len(rows) % num_generations:
        raise ValueError(f"{rollouts_path}: {len(rows)} rows is not a multiple of num_generations={num_generations}")
    network = FeatureNetwork(feature_model_dir, cfg.feature_layers, normalize_layers=cfg.mode == "strided",
                             devices=devices)
    out, reference_ids = score_rows(cfg, network, rows, num_generations, str(rollouts_path))
    rewards = out["reward"].double()
    adv = advantages(rewards, num_generations, cfg.advantage_estimator, scale_rewards)
    per_function = [[("alignment", float(a)), ("diversity", float(d))]
                    for a, d in zip(out["alignment"].tolist(), out["diversity"].tolist())]
    scored = (
        table.append_column("rewards", pa.array(per_function, type=SCORED.field("rewards").type))
        .append_column("reward", pa.array(rewards.tolist(), type=pa.float64()))
        .append_column("advantage", pa.array(adv.tolist(), type=pa.float64()))
        .append_column("errors", pa.array([[] for _ in rows], type=SCORED.field("errors").type))
    )
    if "reference_token_ids" not in scored.column_names:  # strided rollouts carry them already
        scored = scored.append_column("reference_token_ids", pa.array(reference_ids, type=pa.list_(pa.int32())))
    write_table(scored, out_dir / "scored.parquet", SCORED, extra_ok=True)
    metrics = {
        **reward_spread(rewards, num_generations),
        "score/errors": 0,
        "ebft/alignment": float(out["alignment"].mean()),
        "ebft/diversity": float(out["diversity"].mean()),
        "ebft/feature_distance": float(out["feature_distance"]),
        "ebft/reward": float(rewards.mean()),
    }
    for name in ("alignment", "diversity"):
        metrics[f"rewards/{name}/mean"] = float(out[name].mean())
        metrics[f"rewards/{name}/std"] = float(out[name].std())
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    metrics.update(collapse_metrics([r["prompt_id"] for r in rows], [r["completion"] for r in rows],
                                    [r["answer"] for r in rows] if "answer" in table.column_names else None))
    return metrics

