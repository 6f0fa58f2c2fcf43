"""EBFT strided mode (`rl: ebft` with `ebft.mode: strided`): rollouts and held-out eval on raw documents.

Unstructured text has no prompt/completion split. Following the paper (arXiv 2603.12248, sec. 4) and
axolotl's strided trainer (`axolotl/core/trainers/ebft/strided.py`), a document of S tokens gets anchors
at a_b = context_length + b * stride for b = 0 .. num_blocks - 1, num_blocks = (S - L - context_length)
// stride + 1, L = `generate_max_len`. From each anchor the policy writes L tokens in place of the
document's own: block b reads the document's first a_b tokens and its own earlier tokens, at positions
a_b, a_b + 1, ... The reference of block b is the document's real continuation doc[a_b : a_b + L].

Generation is block-parallel: every block of a document (and every one of its n samples) advances by
one token per forward pass of [document, generated tokens step by step], under a dense 4D attention
mask (`strided_attention`) that gives each generated token exactly the view above -- axolotl's eager
fallback (its flex_attention path needs CUDA). So a block's tokens and log-probs are those of sampling
`doc[:a_b]` -> L tokens on its own, in one pass per step for all blocks (tests/test_ebft_strided.py
checks both against plain causal forwards).

Each (document, anchor) is stored as one prompt of the round: prompt_id `<document prompt_id>@<a_b>`,
prompt_token_ids doc[:a_b], n completions, the reference's token ids in `reference_token_ids`. From
there the round is structured mode's: the score step (stages/training/ebft.py) embeds prompt + block and prompt +
reference with the frozen feature network (each layer L2-normalized per token, as axolotl's strided
trainer) -- the same features the strided mask gives, since a block sees exactly that -- and the
optimize stage trains on the rows with the GRPO loss.

Prompt + completion rows (axolotl's `ebft_strided_structured.transform`: transform.type of that name writes the
prompt to `document_prompt` and the completion to `text`) are one document, the prompt tokenized with the tokenizer's
special tokens and the completion without, as axolotl's transform does; anchors start at max(prompt tokens +
`min_completion_prefix`, context_length) (axolotl's anchor offset), so every block and its reference lie in the
completion. `max_document_tokens` (axolotl's `sequence_len`) cuts a document as axolotl's transform does.

Departures from axolotl: the round's rows are trained by the optimize stage (one policy-gradient pass per
round, grpo.* options; axolotl: one REINFORCE step per batch inside its trainer); a document is
processed with its n samples as one batch (axolotl: the batch's documents padded to one length); no KV
cache (each step re-reads the document: fine for the short documents this runs on, on CPU); `ce_coef`'s
cross-entropy is over the blocks' references, i.e. the document's tokens from the first anchor on
(axolotl: over all of the document's tokens); documents are not padded to `sequence_len` (axolotl pads them, and its
anchors then run on into the padding); the anchor offset is each document's own (axolotl: the batch's longest
prompt, the same with its `micro_batch_size: 1` examples).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from stages.data.schemas import ROLLOUTS, write_table
from stages.runtime.imports import LazyModule

torch = LazyModule("torch")

TEXT_COLUMN = "text"
"""The prompts-table column holding a document (transform.type: text writes it)."""
ENGINE = "transformers+strided"
STRUCTURED_NEEDS = ("; a prompt + completion row, its prompt's tokens + ebft.min_completion_prefix + "
                    "ebft.generate_max_len, if that is more")


def anchors(num_tokens: int, context_length: int, stride: int, generate_max_len: int) -> list[int]:
    """Anchor positions of a document of num_tokens tokens (empty when it is too short for one block).

    >>> anchors(40, 8, 8, 8)  # blocks at 8, 16, 24, 32: the last one ends at token 40
    [8, 16, 24, 32]
    >>> anchors(15, 8, 8, 8)
    []
    """
    num_blocks = (num_tokens - generate_max_len - context_length) // stride + 1
    return [context_length + b * stride for b in range(max(num_blocks, 0))]


def strided_attention(doc_length: int, block_anchors: list[int], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention pattern and positions of [document, `steps` generated tokens per block].

    Generated tokens are laid out step-major: token t of block b sits at doc_length + t * num_blocks + b.
    Returns (allowed (T, T) bool, positions (T,)), T = doc_length + steps * num_blocks: document tokens
    attend causally; generated token t of block b attends to doc[:a_b] and to tokens 0..t of block b,
    and sits at position a_b + t.
    """
    nb = len(block_anchors)  # at least 1
    index = torch.arange(doc_length + steps * nb)  # on the CPU: generate_blocks moves the result
    is_doc = index < doc_length
    offset = (index - doc_length).clamp(min=0)
    block, step = offset % nb, offset // nb
    anchor = torch.tensor(block_anchors, dtype=torch.long)[block]
    q, k = index.unsqueeze(1), index.unsqueeze(0)
    doc_q, doc_k = is_doc.unsqueeze(1), is_doc.unsqueeze(0)
    causal_doc = doc_q & doc_k & (k <= q)
    context = ~doc_q & doc_k & (k < anchor.unsqueeze(1))
    own_block = (~doc_q & ~doc_k & (block.unsqueeze(1) == block.unsqueeze(0))
                 & (step.unsqueeze(0) <= step.unsqueeze(1)))
    positions = torch.where(is_doc, index, anchor + step)
    return causal_doc | context | own_block, positions


def additive_mask(allowed: torch.Tensor, batch: int, dtype) -> torch.Tensor:
    """A (batch, 1, T, T) float mask: 0 where allowed, the dtype's minimum elsewhere (eager and sdpa take it)."""
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask.expand(batch, 1, *allowed.shape)


def generate_blocks(model, doc_ids: list[int], block_anchors: list[int], generate_max_len: int, batch: int,
                    temperature: float = 1.0, top_p: float = 1.0, generator: torch.Generator | None = None,
                    greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` samples of every block of one document, block-parallel: (tokens, log-probs), each
    (batch, num_blocks, generate_max_len). Log-probs are log pi(token) under logits / temperature (greedy:
    under the plain logits)."""
    with torch.no_grad():  # not a decorator: that would import torch with this module
        nb, length = len(block_anchors), len(doc_ids)
        dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
        sequence = torch.tensor([doc_ids] * batch, dtype=torch.long, device=device)
        first_logits_at = torch.tensor([a - 1 for a in block_anchors], device=device)  # the token before an anchor
        # predicts it
        tokens, logprobs = [], []
        for step in range(generate_max_len):
            allowed, positions = strided_attention(length, block_anchors, step)
            logits = model(input_ids=sequence, attention_mask=additive_mask(allowed.to(device), batch, dtype),
                           position_ids=positions.to(device).expand(batch, -1)).logits
            at = first_logits_at if step == 0 else length + (step - 1) * nb + torch.arange(nb, device=device)
            step_logits = logits[:, at, :].float()
            if not greedy:
                step_logits = step_logits / temperature
            logp = torch.log_softmax(step_logits, dim=-1)
            if greedy:
                chosen = logp.argmax(dim=-1)
            else:
                probs = logp.exp()
                if top_p < 1.0:
                    probs = _top_p(probs, top_p)
                chosen = torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=generator).view(batch, nb)
            tokens.append(chosen)
            logprobs.append(logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1))
            sequence = torch.cat([sequence, chosen], dim=1)
        return torch.stack(tokens, dim=-1).cpu(), torch.stack(logprobs, dim=-1).cpu()


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of tokens whose probability reaches top_p, renormalized.

    >>> _top_p(torch.tensor([[0.3, 0.5, 0.2]]), 0.7).tolist()  # 0.5 + 0.3 reach 0.7: 0.2 goes
    [[0.375, 0.625, 0.0]]
    """
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


PROMPT_COLUMN = "document_prompt"
"""The prompts-table column holding a prompt + completion row's prompt (transform.type
ebft_strided_structured.transform writes it; `text` is then the completion): the prompt is context only, anchors
sit in the completion."""


def document_ids(tokenizer, row: dict, where: str, max_tokens: int | None = None) -> tuple[list[int], int]:
    """A prompts row's document as token ids, and how many of them are a prompt (0 for a raw document).

    A raw document (`text`): its tokens, no special tokens added. A prompt + completion row (`document_prompt`
    too, axolotl's ebft_strided_structured): the prompt tokenized with the tokenizer's special tokens, then the
    completion without, as axolotl's transform does; an empty prompt (axolotl's ebft_pretrain) leaves the
    special tokens at the document's start. `max_tokens` (ebft.max_document_tokens, axolotl's sequence_len)
    cuts a longer one as axolotl does: the completion first, then the prompt, keeping one completion token. A
    missing text column is an error."""
    if TEXT_COLUMN not in row:
        raise ValueError(f"{where}: ebft.mode strided reads documents from column {TEXT_COLUMN!r}, which the prompt "
                         f"rows do not have (columns: {sorted(row)}); use transform.type: text (with "
                         "transform.text_field naming your column) or demo_data.records_per_document")
    text = str(row[TEXT_COLUMN] or "")
    prompt = row.get(PROMPT_COLUMN)
    if prompt is None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[:max_tokens], 0
    prompt_ids = tokenizer(str(prompt), add_special_tokens=True)["input_ids"]
    completion_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not prompt:  # no prompt: the special tokens begin the document
        return (prompt_ids + completion_ids)[:max_tokens], 0
    if max_tokens is not None and len(prompt_ids) + len(completion_ids) > max_tokens:
        if max_tokens - len(prompt_ids) < 1:
            prompt_ids, completion_ids = prompt_ids[: max_tokens - 1], completion_ids[:1]
        else:
            completion_ids = completion_ids[: max_tokens - len(prompt_ids)]
    return prompt_ids + completion_ids, len(prompt_ids)


def document_anchors(ebft, num_tokens: int, prompt_tokens: int) -> list[int]:
    """The anchors of a document: from context_length on, or for a prompt + completion row from
    max(prompt tokens + ebft.min_completion_prefix, context_length) on (axolotl's anchor offset), so that no block
    is written inside the prompt.

    >>> from types import SimpleNamespace as N
    >>> document_anchors(N(context_length=8, stride=8, generate_max_len=8, min_completion_prefix=4), 48, 10)
    [14, 22, 30, 38]
    """
    offset = max(prompt_tokens + ebft.min_completion_prefix, ebft.context_length) if prompt_tokens else \
        ebft.context_length
    return anchors(num_tokens, offset, ebft.stride, ebft.generate_max_len)


def rollout(ebft, rollout_cfg, policy, prompts_path: Path, round_index: int, out_dir: Path,
            on_progress: Callable[[int, int], None] | None = None, devices=None) -> dict:
    """The round's strided rollouts: rollout.prompts_per_round documents (rollout.py's `select_prompts`),
    num_generations samples of each of their blocks, into out_dir/rollouts.parquet; return a summary."""
    from stages.rollout.rollout import select_prompts
    from stages.runtime.policy import load_policy

    rows = pq.read_table(prompts_path).to_pylist()
    picked = select_prompts(rows, round_index, rollout_cfg.prompts_per_round, rollout_cfg.seed)
    model, tokenizer = load_policy(policy.model_dir, policy.adapter_dir, devices=devices)
    n, length = rollout_cfg.num_generations, ebft.generate_max_len
    generator = torch.Generator(device=model.device).manual_seed(rollout_cfg.seed * 100_003 + round_index)
    passthrough = [c for c in rows[0] if c not in ROLLOUTS.names and c not in (TEXT_COLUMN, PROMPT_COLUMN)]
    records, skipped, started = [], 0, time.perf_counter()
    for done, row in enumerate(picked, start=1):
        ids, prompt_tokens = document_ids(tokenizer, row, str(prompts_path), ebft.max_document_tokens)
        block_anchors = document_anchors(ebft, len(ids), prompt_tokens)
        if not block_anchors:
            skipped += 1
            continue
        tokens, logprobs = generate_blocks(model, ids, block_anchors, length, n, rollout_cfg.temperature,
                                           rollout_cfg.top_p, generator)
        for b, anchor in enumerate(block_anchors):
            prompt_id = f"{row['prompt_id']}@{anchor}"
            reference = ids[anchor : anchor + length]
            for g in range(n):
                block = tokens[g, b].tolist()
                records.append({
                    **{c: row[c] for c in passthrough},
                    "rollout_id": f"r{round_index}-{prompt_id}-g{g}", "prompt_id": prompt_id, "group_index": g,
                    "prompt": [], "completion": tokenizer.decode(block), "prompt_token_ids": ids[:anchor],
                    "completion_token_ids": block, "sampling_logprobs": logprobs[g, b].tolist(),
                    "round_index": round_index, "policy_version": policy.version, "engine": ENGINE,
                    "finish_reason": "length", "rerolled": False, "document_id": row["prompt_id"],
                    "anchor": anchor, "reference_token_ids": reference,
                    "reference": tokenizer.decode(reference)})
        if on_progress:
            on_progress(done, len(picked))
    seconds = time.perf_counter() - started
    if not records:
        raise ValueError(f"{prompts_path}: none of the round's {len(picked)} documents has room for one block "
                         f"(a document needs at least ebft.context_length + ebft.generate_max_len = "
                         f"{ebft.context_length + length} tokens{STRUCTURED_NEEDS}); lower them or use longer "
                         "documents")
    table = pa.Table.from_pylist(records)
    column = table.schema.get_field_index("reference_token_ids")  # int32, as the score step writes it
    table = table.set_column(column, "reference_token_ids", table.column(column).cast(pa.list_(pa.int32())))
    write_table(table, out_dir / "rollouts.parquet", ROLLOUTS, extra_ok=True)
    tokens_total = len(records) * length
    return {"rows": len(records), "prompts": len(records) // n, "documents": len(picked) - skipped,
            "documents_too_short": skipped, "rerolled_prompts": 0, "completion_length_mean": float(length),
            "truncated_frac": 0.0, "tokens": tokens_total, "generate_s": seconds,
            "tokens_per_s": tokens_total / max(seconds, 1e-9), "policy_version": policy.version,
            "staleness": round_index - policy.version}


def evaluate(ebft, max_documents: int | None, model_dir: Path, adapter_dir: Path | None, feature_model_dir: Path,
             prompts_path: Path, out_dir: Path, on_progress: Callable[[int, int], None] | None = None,
             devices=None) -> dict:
    """Greedy blocks at every anchor of the held-out documents, against the documents' own continuations:
    `accuracy` (share of generated tokens equal to the document's token at that place), `exact_blocks`,
    `feature_distance` (mean over blocks of ||phi(block) - phi(reference)||^2, features of the frozen
    feature network, L2-normalized) and `constant_baseline` (the share of reference tokens equal to their
    most common token: what repeating one token scores). Writes every block to out_dir/eval.parquet."""
    import torch.nn.functional as F

    from stages.runtime.policy import load_policy
    from stages.training.ebft import FeatureNetwork

    rows = pq.read_table(prompts_path).to_pylist()[:max_documents]
    model, tokenizer = load_policy(model_dir, adapter_dir, devices=devices)
    length = ebft.generate_max_len
    blocks = []
    for done, row in enumerate(rows, start=1):
        ids, prompt_tokens = document_ids(tokenizer, row, str(prompts_path), ebft.max_document_tokens)
        block_anchors = document_anchors(ebft, len(ids), prompt_tokens)
        if block_anchors:
            tokens, _ = generate_blocks(model, ids, block_anchors, length, 1, greedy=True)
            blocks += [(row["prompt_id"], a, ids[:a], tokens[0, b].tolist(), ids[a : a + length])
                       for b, a in enumerate(block_anchors)]
        if on_progress:
            on_progress(done, len(rows))
    if not blocks:
        raise ValueError(f"{prompts_path}: no held-out document has room for one block "
                         f"(ebft.context_length + ebft.generate_max_len = {ebft.context_length + length} tokens"
                         f"{STRUCTURED_NEEDS})")
    del model
    network = FeatureNetwork(feature_model_dir, ebft.feature_layers, normalize_layers=True, devices=devices)
    prompt_lengths = [len(p) for _, _, p, _, _ in blocks]
    generated = network.embed([p + g for _, _, p, g, _ in blocks], prompt_lengths, ebft.pooling)
    reference = network.embed([p + r for _, _, p, _, r in blocks], prompt_lengths, ebft.pooling)
    distance = ((F.normalize(generated, dim=-1) - F.normalize(reference, dim=-1)) ** 2).sum(dim=-1)
    matches = [sum(a == b for a, b in zip(g, r)) for _, _, _, g, r in blocks]
    reference_tokens = [t for *_, r in blocks for t in r]
    top_token, top_count = max(((t, reference_tokens.count(t)) for t in set(reference_tokens)), key=lambda x: x[1])
    pq.write_table(pa.table({
        "document_id": [d for d, *_ in blocks], "anchor": [a for _, a, *_ in blocks],
        "completion": [tokenizer.decode(g) for *_, g, _ in blocks],
        "reference": [tokenizer.decode(r) for *_, r in blocks],
        "completion_token_ids": [g for *_, g, _ in blocks], "reference_token_ids": [r for *_, r in blocks],
        "tokens_correct": matches, "feature_distance": distance.tolist()}), out_dir / "eval.parquet")
    return {"accuracy": sum(matches) / len(reference_tokens),
            "exact_blocks": sum(m == length for m in matches) / len(blocks),
            "feature_distance": float(distance.mean()), "constant_baseline": top_count / len(reference_tokens),
            "baseline_answer": tokenizer.decode([top_token]), "num_prompts": len(rows), "num_blocks": len(blocks)}

