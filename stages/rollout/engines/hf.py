"""The transformers rollout engine: batched `model.generate` with KV cache, left padding; a prompt
that repeats in a batch (a GRPO group) is run through the model once (`shared_prompt_cache`).

For every completion token it records log softmax(logits / temperature)[token] -- the
quantity TRL's GRPOTrainer computes for the policy -- so the optimize stage can form the
importance ratio against it. With top_p < 1 the sampler also truncates the tail, which
this log-prob does not include (as in TRL).

Sampling draws from a torch.Generator of the call's own, seeded with `sampling.seed`, never from torch's
global RNG: a rollout's samples depend on its inputs and seed only, whatever other threads of the process
(an eval beside it, an optimize round beside a prefetched rollout) do with the global RNG meanwhile.
The generator is the same kind as the global one, so the tokens are those `torch.manual_seed(seed)` and
HF's sampling gave before (`own_generator`).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable

from stages.rollout.engines import Policy, Prompt, Sampling, prompt_token_ids


def repeats(keys: list) -> tuple[list[int], list[int]]:
    """(the row of each distinct key's first occurrence, each row's position in that list): which rows of a
    batch repeat an earlier one (a GRPO group is one prompt `num_generations` times)."""
    slot: dict = {}
    distinct, index = [], []
    for row, key in enumerate(keys):
        if key not in slot:
            slot[key] = len(distinct)
            distinct.append(row)
        index.append(slot[key])
    return distinct, index


def shared_prompt_cache(model, enc, keys: list):
    """The KV cache of every prompt but its last token, computed once per distinct prompt and copied to
    its repeats, or None when no prompt repeats. `generate` then runs only the last prompt token and
    samples from its logits as it would without it."""
    import torch
    from transformers import DynamicCache

    distinct, index = repeats(keys)
    if len(distinct) == len(keys) or enc["input_ids"].shape[1] < 2:
        return None
    ids = enc["input_ids"][distinct, :-1]
    mask = enc["attention_mask"][distinct, :-1]
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate sets them
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=mask, position_ids=position_ids, past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    cache.batch_select_indices(torch.tensor(index, device=ids.device))
    return cache


class SampledTokenLogps:
    """A logits processor (transformers' `LogitsProcessor` protocol) that records, for every generated token,
    log softmax(raw logits / temperature)[token], keeping one step's log-softmax at a time: `generate` calls
    it with the step's raw logits before its own temperature and top-p warpers (transformers runs the
    caller's processors first, tests/test_determinism.py checks it), and the token it then samples is the last
    of the next call's `input_ids`; `finish` takes the last step's from the generated sequences. With
    `output_logits` instead, every step's fp32 logits are kept to the end (128 rows x 128 steps of a 150k
    vocabulary: 10 GB)."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending = None
        self.steps: list = []

    def __call__(self, input_ids, scores):
        import torch

        self._take(input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _take(self, tokens) -> None:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, tokens[:, None]).squeeze(-1))
            self.pending = None

    def finish(self, sequences):
        """(rows, generated tokens) log-probs, given `generate`'s output sequences."""
        import torch

        self._take(sequences[:, -1])
        return torch.stack(self.steps, dim=1)


_SAMPLER = threading.local()
_PATCH = threading.Lock()


@contextmanager
def own_generator(generator):
    """Within the block, this thread's `torch.multinomial` calls without a generator -- HF generate's
    sampling step, transformers 5.x `GenerationMixin._sample` -- draw from `generator` instead of the
    process-wide default one. Other threads are unaffected. torch.multinomial is wrapped once per process
    (a call with no thread generator set is passed through unchanged): HF generate takes no generator."""
    import torch

    with _PATCH:
        if not getattr(torch.multinomial, "_thread_generator", False):
            original = torch.multinomial

            def multinomial(input, num_samples, replacement=False, *, generator=None, out=None):
                generator = generator if generator is not None else getattr(_SAMPLER, "generator", None)
                return original(input, num_samples, replacement, generator=generator, out=out)

            multinomial._thread_generator = True
            torch.multinomial = multinomial
    previous = getattr(_SAMPLER, "generator", None)
    _SAMPLER.generator = generator
    try:
        yield
    finally:
        _SAMPLER.generator = previous


def generate(model, tokenizer, prompts: list[Prompt], sampling: Sampling, batch_size: int = 256,
             on_progress: Callable[[int], None] | None = None) -> list[dict]:
    """One completion per prompt from an already loaded model (see stages.rollout.engines for the dict). With
    do_sample, samples from a generator seeded with `sampling.seed` (`own_generator`); greedy uses no RNG."""
    import torch

    from stages.runtime.devices import generation_kernels

    with generation_kernels(model):
        if sampling.do_sample:
            with own_generator(torch.Generator(device=model.device).manual_seed(sampling.seed)):
                return _generate(model, tokenizer, prompts, sampling, batch_size, on_progress)
        return _generate(model, tokenizer, prompts, sampling, batch_size, on_progress)


def _generate(model, tokenizer, prompts: list[Prompt], sampling: Sampling, batch_size: int,
              on_progress: Callable[[int], None] | None) -> list[dict]:
    import torch

    eos = tokenizer.eos_token_id
    results = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids = prompt_token_ids(tokenizer, chunk)
        enc = tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(model.device)
        recorder = SampledTokenLogps(sampling.temperature)
        with torch.no_grad():
            out = model.generate(
                **enc,
                past_key_values=shared_prompt_cache(model, enc, [tuple(i) for i in ids]),
                max_new_tokens=sampling.max_new_tokens,
                do_sample=sampling.do_sample,
                temperature=sampling.temperature if sampling.do_sample else None,
                top_p=sampling.top_p if sampling.do_sample else None,
                top_k=0 if sampling.do_sample else None,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
                logits_processor=[recorder],
            )
        new_tokens = out[:, enc["input_ids"].shape[1] :]
        logps = recorder.finish(out)
        new_tokens, logps = new_tokens.cpu(), logps.cpu()  # one read back each, not one per row
        input_ids, attention_mask = enc["input_ids"].cpu(), enc["attention_mask"].cpu()
        for i in range(len(chunk)):
            ids = new_tokens[i].tolist()
            finish = "length"
            if eos in ids:
                ids = ids[: ids.index(eos) + 1]
                finish = "stop"
            prompt_ids = input_ids[i][attention_mask[i].bool()].tolist()
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

    def __init__(self, batch_size: int = 256, devices=None):
        self.batch_size = batch_size
        self.devices = devices  # stages.runtime.devices.DeviceConfig (None: auto)

    def generate(self, policy: Policy, prompts: list[Prompt], sampling: Sampling,
                 on_progress: Callable[[int], None] | None = None) -> list[dict]:
        from stages.runtime.policy import load_policy

        model, tokenizer = load_policy(policy.model_dir, policy.adapter_dir, devices=self.devices)
        return generate(model, tokenizer, prompts, sampling, self.batch_size, on_progress)

    def close(self) -> None:
        pass
