"""The transformers rollout engine: batched `model.generate` with KV cache, left padding.

For every completion token it records log softmax(logits / temperature)[token] -- the
quantity TRL's GRPOTrainer computes for the policy -- so the optimize stage can form the
importance ratio against it. With top_p < 1 the sampler also truncates the tail, which
this log-prob does not include (as in TRL).
"""

from __future__ import annotations

from typing import Callable

from stages.engines import Policy, Sampling


def generate(model, tokenizer, prompts: list[list[dict]], sampling: Sampling, batch_size: int = 256,
             on_progress: Callable[[int], None] | None = None) -> list[dict]:
    """One completion per prompt from an already loaded model (see stages.engines for the dict)."""
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
                max_new_tokens=sampling.max_new_tokens,
                do_sample=sampling.do_sample,
                temperature=sampling.temperature if sampling.do_sample else None,
                top_p=sampling.top_p if sampling.do_sample else None,
                top_k=0 if sampling.do_sample else None,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,
            )
        new_tokens = out.sequences[:, enc["input_ids"].shape[1] :]
        logits = torch.stack(out.logits, dim=1).float()  # (B, T, V), raw
        logps = torch.log_softmax(logits / sampling.temperature, dim=-1)
        logps = logps.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
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


class TransformersEngine:
    """Loads the policy (base + merged LoRA) for each call; nothing is kept between rounds."""

    name = "transformers"

    def __init__(self, batch_size: int = 256):
        self.batch_size = batch_size

    def generate(self, policy: Policy, prompts: list[list[dict]], sampling: Sampling,
                 on_progress: Callable[[int], None] | None = None) -> list[dict]:
        import torch

        from stages.policy import load_policy

        model, tokenizer = load_policy(policy.model_dir, policy.adapter_dir)
        torch.manual_seed(sampling.seed)
        return generate(model, tokenizer, prompts, sampling, self.batch_size, on_progress)

    def close(self) -> None:
        pass
