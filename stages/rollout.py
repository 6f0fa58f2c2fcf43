"""rollout: `num_generations` sampled completions per prompt from the current policy.

Engine `transformers`: batched `model.generate` with KV cache, left padding. For every
completion token it records the sampling log-prob log softmax(logits / temperature)[token]
-- the same quantity TRL's GRPOTrainer computes for the policy -- so the optimize stage
can form the importance ratio pi_theta / pi_sampling against it. With top_p < 1 the
sampler also truncates the tail, which this log-prob does not include (as in TRL).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from stages.schemas import ROLLOUTS, write_table


class RolloutConfig(BaseModel):
    """Sampling settings (names as in TRL's GRPOConfig)."""

    model_config = ConfigDict(extra="forbid")

    engine: Literal["transformers"] = "transformers"
    """transformers: in-process generate, always available."""
    num_generations: int = Field(8, ge=2)
    """Completions per prompt (the GRPO group). Higher: better baseline, more generation time."""
    prompts_per_round: int = Field(64, ge=1)
    """Prompts drawn from the train split each round (without replacement, cycling)."""
    max_completion_length: int = Field(16, ge=1)
    """Tokens generated at most per completion; longer ones end with finish_reason=length."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the optimize stage scales logits by the same value."""
    top_p: float = Field(1.0, gt=0, le=1)
    generation_batch_size: int = Field(256, ge=1)
    """Sequences per generate call. Higher: faster, more memory."""
    seed: int = 0


def select_prompts(rows: list[dict], round_index: int, per_round: int, seed: int) -> list[dict]:
    """The round's prompts: a fixed shuffle of the split, walked in slices, wrapping around."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    start = (round_index * per_round) % len(rows)
    picked = [order[(start + i) % len(rows)] for i in range(min(per_round, len(rows)))]
    return [rows[i] for i in picked]


def generate(model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, do_sample: bool = True, batch_size: int = 256,
             on_progress: Callable[[int], None] | None = None) -> list[dict]:
    """Generate one completion per prompt. Returns dicts with prompt_token_ids,
    completion_token_ids, sampling_logprobs, completion text and finish_reason."""
    import torch

    eos = tokenizer.eos_token_id
    results = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                temperature=temperature if do_sample else None,
                top_p=top_p if do_sample else None,
                top_k=0 if do_sample else None,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,
            )
        new_tokens = out.sequences[:, enc["input_ids"].shape[1] :]
        logits = torch.stack(out.logits, dim=1).float()  # (B, T, V), raw
        logps = torch.log_softmax(logits / temperature, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        for i in range(len(chunk)):
            ids = new_tokens[i].tolist()
            finish = "length"
            if eos in ids:
                ids = ids[: ids.index(eos) + 1]
                finish = "stop"
            prompt_ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
            results.append(
                {
                    "prompt_token_ids": prompt_ids,
                    "completion_token_ids": ids,
                    "sampling_logprobs": logps[i, : len(ids)].tolist(),
                    "completion": tokenizer.decode(ids, skip_special_tokens=True),
                    "finish_reason": finish,
                }
            )
        if on_progress:
            on_progress(len(chunk))
    return results


def run(cfg: RolloutConfig, base_dir: Path, adapter_dir: Path | None, prompts_path: Path, round_index: int,
        policy_version: int, out_dir: Path, on_progress: Callable[[int, int], None] | None = None) -> dict:
    """Sample the round's completions into out_dir/rollouts.parquet."""
    import pyarrow.parquet as pq
    import torch

    from stages.policy import load_policy

    rows = pq.read_table(prompts_path).to_pylist()
    picked = select_prompts(rows, round_index, cfg.prompts_per_round, cfg.seed)
    model, tokenizer = load_policy(base_dir, adapter_dir)
    torch.manual_seed(cfg.seed * 100_003 + round_index)
    expanded = [(row, g) for row in picked for g in range(cfg.num_generations)]
    total = len(expanded)
    done = 0

    def progress(n):
        nonlocal done
        done += n
        if on_progress:
            on_progress(done, total)

    generated = generate(model, tokenizer, [row["prompt"] for row, _ in expanded],
                         max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                         batch_size=cfg.generation_batch_size, on_progress=progress)
    passthrough = [c for c in rows[0] if c not in ROLLOUTS.names]
    records = []
    for (row, g), gen in zip(expanded, generated):
        rec = {c: row[c] for c in passthrough}
        rec.update(gen)
        rec.update(rollout_id=f"r{round_index}-{row['prompt_id']}-g{g}", prompt_id=row["prompt_id"],
                   group_index=g, prompt=row["prompt"], policy_version=policy_version, engine=cfg.engine)
        records.append(rec)
    import pyarrow as pa

    write_table(pa.Table.from_pylist(records), out_dir / "rollouts.parquet", ROLLOUTS, extra_ok=True)
    lengths = [len(r["completion_token_ids"]) for r in records]
    return {
        "rows": len(records),
        "prompts": len(picked),
        "completion_length_mean": sum(lengths) / len(lengths),
        "truncated_frac": sum(r["finish_reason"] == "length" for r in records) / len(records),
        "tokens": sum(lengths),
    }
