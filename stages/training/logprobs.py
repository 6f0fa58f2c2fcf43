"""Per-token log-probs of completions under a causal LM: how the optimize stage scores its rows.

Three ways to the same numbers (up to float rounding; tests/test_grpo_options.py):
- `completion_logps`: one plain forward over prompt + completion, logits only where completion tokens are
  predicted (transformers' `logits_to_keep`), as TRL's GRPOTrainer computes them;
- `batch_logps`: rows that share a prompt (a GRPO group) run it once and each row's completion runs on a copy
  of its KV cache (`grpo.shared_prompt_pass`): less compute, twice the operators;
- either with `chunk_tokens` (`grpo.logps_chunk_tokens`): the lm_head and its fp32 log-softmax a chunk of rows
  at a time, each chunk recomputed in the backward, so the (rows, positions, vocabulary) logits never exist
  whole.
Entropies come with the log-probs (no gradient). Sampling temperature divides the logits, as in TRL.
"""

from __future__ import annotations

from stages.runtime.imports import LazyModule

torch = LazyModule("torch")  # imported on first use


def completion_logps(model, input_ids, attention_mask, logits_to_keep: int, temperature: float,
                     chunk_tokens: int = 0):
    """Per-token log-probs (and entropies) of the last `logits_to_keep` tokens under logits / temperature.
    The model computes logits only for the positions that predict them (transformers' `logits_to_keep`);
    with `chunk_tokens`, from its decoder's hidden states a chunk of rows at a time (`chunked_token_logps`).
    No KV cache: one pass has no use for one, and a cache makes `train.compile` specialize every block on its
    own layer index (a compilation per block instead of one shared by all)."""
    return _forward_logps(model, {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False},
                          input_ids[:, -logits_to_keep:], temperature, chunk_tokens)


def _forward_logps(model, inputs: dict, tokens: torch.Tensor, temperature: float, chunk_tokens: int):
    """(log-probs, entropies) of `tokens`, the last of `inputs`' positions: from the logits of the positions
    that predict them, or, with `chunk_tokens`, from the decoder's hidden states a chunk of rows at a time."""
    keep = tokens.size(1)
    if chunk_tokens:
        decoder, head = decoder_and_head(model)
        hidden = decoder(**inputs).last_hidden_state[:, -(keep + 1):]
        return chunked_token_logps(head, hidden, tokens, temperature, chunk_tokens)
    return token_logps(model(**inputs, logits_to_keep=keep + 1).logits, tokens, temperature)


def decoder_and_head(model):
    """(the model's decoder, returning hidden states; its output embedding, the lm_head), under a PEFT
    wrapper too: HF causal LMs compute `lm_head(decoder(...).last_hidden_state)`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def logits_from_hidden(model) -> bool:
    """Whether the model's logits are its lm_head applied to its decoder's last hidden state, as
    `chunked_token_logps` assumes: checked on four tokens in eval mode. False for heads that do more
    (Gemma 2's soft-capping, logit scaling) and for models whose decoder or head is not found. Compiled
    blocks run eagerly for it (no compilation for its shape)."""
    try:
        decoder, head = decoder_and_head(model)
    except (AttributeError, TypeError, ValueError):
        return False
    if decoder is None or head is None or decoder is model:
        return False
    device = next(model.parameters()).device
    ids = torch.arange(4, device=device).unsqueeze(0)
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            whole = model(input_ids=ids).logits.float()
            parts = head(decoder(input_ids=ids).last_hidden_state).float()
    finally:
        model.train(training)
    return whole.shape == parts.shape and torch.allclose(whole, parts, rtol=1e-3, atol=1e-3)


def chunked_token_logps(head, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float, chunk_tokens: int):
    """`token_logps` of head(hidden), a chunk of about `chunk_tokens` tokens (whole rows) at a time: the
    logits exist for one chunk at a time; with gradients each chunk is checkpointed (its logits recomputed
    in the backward), so none are kept between forward and backward. `hidden` holds one position more
    than `tokens`, as `token_logps`'s logits."""
    from torch.utils.checkpoint import checkpoint

    rows = max(1, chunk_tokens // hidden.size(1))
    logps, entropies = [], []
    for start in range(0, hidden.size(0), rows):
        part = (head, hidden[start : start + rows], tokens[start : start + rows], temperature)
        if torch.is_grad_enabled() and hidden.requires_grad:
            logp, entropy = checkpoint(_head_token_logps, *part, use_reentrant=False)
        else:
            logp, entropy = _head_token_logps(*part)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps), torch.cat(entropies)


def _head_token_logps(head, hidden, tokens, temperature):
    return token_logps(head(hidden), tokens, temperature)


def token_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    """(log-prob of each of `tokens`, entropy) from logits whose position t predicts tokens[:, t]; the
    last position of `logits` predicts past the tokens and is dropped. The log-softmax is in fp32; at
    temperature 1 it reads the (bf16) logits itself: no fp32 copy of them and no division, forward or
    backward (the same numbers: tests/test_grpo_options.py)."""
    logits = logits[:, :-1, :]
    if temperature == 1.0:
        log_p = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    else:
        log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    logps = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_p.exp() * log_p).sum(-1)
    return logps, entropy


def plain_inputs(batch: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, logits_to_keep) of a collated batch for `completion_logps`: each row's
    left-padded prompt followed by its right-padded completion."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return input_ids, attention_mask, batch["completion_ids"].size(1)


def batch_logps(model, batch: dict, temperature: float, chunk_tokens: int = 0):
    """`completion_logps` of a collated batch; rows that share a prompt (a GRPO group) run it once.

    The prompt minus its last token goes through the model once per distinct prompt, its KV cache is
    copied to every row that has it (by indexing, so gradients flow back into the one prompt pass),
    and each row then runs its last prompt token and its completion on top of that cache, with the
    positions the plain forward gives them. Same log-probs and gradients as the plain forward up to
    float rounding (tests/test_grpo_options.py), for a fraction of the prompt compute. `chunk_tokens`: as
    `completion_logps`."""
    from transformers import DynamicCache

    from stages.rollout.engines.hf import repeats

    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
    if "prompt_index" in batch:  # collate's, worked out on the host
        distinct, index = batch["prompt_distinct"], batch["prompt_index"]
    else:
        found = repeats([tuple(i) for i in prompt_ids.tolist()])
        distinct, index = (torch.tensor(v, device=prompt_ids.device) for v in found)
    if len(distinct) == len(index) or prompt_ids.size(1) < 2:
        return completion_logps(model, *plain_inputs(batch), temperature, chunk_tokens)
    cache = DynamicCache(config=model.config)
    prompt_inputs = {"input_ids": prompt_ids[distinct, :-1], "attention_mask": prompt_mask[distinct, :-1],
                     "past_key_values": cache, "use_cache": True}
    if chunk_tokens:  # the cache is what this pass is for: no head
        decoder_and_head(model)[0](**prompt_inputs)
    else:
        model(**prompt_inputs, logits_to_keep=1)
    _copy_rows(cache, index)
    prompt_length, keep = prompt_ids.size(1), completion_ids.size(1)
    tail = torch.cat([prompt_ids[:, -1:], completion_ids], dim=1)
    positions = torch.arange(prompt_length - 1, prompt_length + keep, device=prompt_ids.device).expand(len(index), -1)
    tail_inputs = {"input_ids": tail, "attention_mask": torch.cat([prompt_mask, completion_mask], dim=1),
                   "past_key_values": cache, "position_ids": positions, "use_cache": True}
    return _forward_logps(model, tail_inputs, completion_ids, temperature, chunk_tokens)


def _copy_rows(cache, index: torch.Tensor) -> None:
    """Give each row of a batch its prompt's KV cache: row i gets the cache of prompt index[i].

    `index_select`, not `DynamicCache.batch_select_indices`: the latter indexes with a tensor, whose backward
    (`index_put_` with accumulate) adds the rows' gradients with atomic float adds on several CPU threads, in
    an order that depends on thread timing -- reruns under CPU load then differ by ~1e-8 (BENCHMARKS.md,
    issue 13). index_select's backward (`index_add_`) adds them in a fixed order."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)
