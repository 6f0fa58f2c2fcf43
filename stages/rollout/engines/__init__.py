"""Rollout engines: who turns prompts into sampled completions with their log-probs.

Every engine returns, per prompt, the same dict -- prompt_token_ids, completion_token_ids,
sampling_logprobs (log softmax(logits / temperature) of each sampled token), completion
text, finish_reason ("stop" | "length") -- so the stages after rollout cannot tell engines
apart.

- `transformers`: in-process `model.generate`, always available (stages/rollout/engines/hf.py).
- `vllm`: an in-process vLLM engine started once per process and kept across rounds;
  LoRA policies through a new `LoRARequest` per round, full fine-tuning through an
  in-place weight update (stages/rollout/engines/vllm_local.py).
- `vllm_server`: OpenAI-compatible `vllm serve --enable-lora` servers, one or several
  (stages/rollout/engines/vllm_server.py).
- `ray_vllm`: in-process vLLM engines in Ray actors, several in data parallel
  (stages/rollout/engines/ray_vllm.py).

`get_engine` keeps one engine per (kind, settings, base model) per process; the flow
calls `close_engines()` when it ends.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol


@dataclass(frozen=True)
class Policy:
    """The weights to sample from.

    `base_dir`: the model the run starts from (engines are started from it). LoRA training:
    `adapter_dir` is the round's adapter on top of it. Full fine-tuning: `weights_dir` is the
    round's complete model folder, whose weights replace the base's. `version` counts the
    optimize rounds behind these weights (0 = the base policy).
    """

    base_dir: Path
    adapter_dir: Path | None = None
    weights_dir: Path | None = None
    version: int = 0

    @property
    def model_dir(self) -> Path:
        """The complete model folder (base or fine-tuned) the adapter, if any, applies to."""
        return self.weights_dir or self.base_dir


@dataclass(frozen=True)
class Sampling:
    """How to sample (names as in TRL)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    do_sample: bool = True
    seed: int = 0


Prompt = list[dict] | dict
"""A chat conversation (message dicts; the tokenizer's chat template makes the prompt), or
{"prompt_token_ids": [...]}: the prompt's tokens as they are (vLLM's TokensPrompt; the Atropos policy
server's /generate and /v1/completions send these)."""


def prompt_token_ids(tokenizer, prompts: list[Prompt]) -> list[list[int]]:
    """Each prompt's token ids: a conversation chat-templated with the generation prompt and tokenized without
    added special tokens (the template has them), or the given ids."""
    out = []
    for p in prompts:
        if isinstance(p, dict):
            ids = p.get("prompt_token_ids")
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise ValueError(f"a token prompt needs prompt_token_ids, a non-empty list of ints; got {p!r:.80}")
            out.append(list(ids))
        else:
            text = tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


class RolloutEngine(Protocol):
    name: str

    def generate(self, policy: Policy, prompts: list[Prompt], sampling: Sampling,
                 on_progress: Callable[[int], None] | None = None) -> list[dict]:
        """One completion per prompt (`Prompt`: a conversation or token ids), in order."""

    def close(self) -> None:
        """Free the engine's memory and processes."""


_ENGINES: dict[tuple, RolloutEngine] = {}
_LOCK = threading.Lock()
_USE_LOCKS: dict[int, threading.Lock] = {}


def engine_lock(engine: RolloutEngine) -> threading.Lock:
    """The lock a caller holds while using `engine`: engines are not thread-safe, and with
    async prefetch two rounds' rollouts can reach the same engine at once."""
    with _LOCK:
        return _USE_LOCKS.setdefault(id(engine), threading.Lock())


def get_engine(kind: str, base_dir: Path, options: dict | None = None) -> RolloutEngine:
    """The process-wide engine of this kind and settings for this base model (made on first use)."""
    options = options or {}
    key = (kind, str(Path(base_dir).resolve()), tuple(sorted((k, repr(v)) for k, v in options.items())))
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = _make(kind, Path(base_dir), options)
            _ENGINES[key] = engine
        return engine


def _make(kind: str, base_dir: Path, options: dict) -> RolloutEngine:
    if kind == "transformers":
        from stages.rollout.engines.hf import TransformersEngine

        return TransformersEngine(**options)
    if kind == "vllm":
        from stages.rollout.engines.vllm_local import VLLMEngine

        return VLLMEngine(base_dir, **options)
    if kind == "vllm_server":
        from stages.rollout.engines.vllm_server import VLLMServerEngine

        return VLLMServerEngine(base_dir, **options)
    if kind == "ray_vllm":
        from stages.rollout.engines.ray_vllm import RayVLLMEngine

        return RayVLLMEngine(base_dir, **options)
    raise ValueError(f"rollout.engine: unknown engine {kind!r}; use transformers, vllm, vllm_server or ray_vllm")


_IMPORTED = threading.Event()
_IMPORT_LOCK = threading.Lock()


def import_eagerly(trainers: bool = False) -> None:
    """Resolve transformers' and peft's lazy imports once per process, one thread at a time (~9 s here). Two
    threads resolving the same lazy attribute at once (an async rollout beside an optimize step)
    can fail with "cannot import name 'AutoTokenizer' from 'transformers'". Called before a model stage
    computes (tasks/stage_tasks.py), so a fully cached run never pays for these imports; `posttrain resume`
    calls it with `trainers` (TRL's too) while the Prefect server boots, since a resumed run computes."""
    if trainers:
        import_eagerly()
        from trl import SFTTrainer  # noqa: F401  (trl's lazy module: same caveat, and only this thread runs)
    if _IMPORTED.is_set():
        return
    with _IMPORT_LOCK:
        if _IMPORTED.is_set():
            return
        import peft  # noqa: F401
        import transformers

        for name in ("AutoTokenizer", "AutoModelForCausalLM", "AutoConfig", "PreTrainedModel"):
            getattr(transformers, name)
        from peft import LoraConfig, PeftModel, get_peft_model  # noqa: F401
        _IMPORTED.set()


def close_engines() -> None:
    """Close every engine this process started (the flow's last step), each once no rollout is using it."""
    with _LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for engine in engines:
        with engine_lock(engine):  # a prefetched rollout still generating: closed under it, it fails oddly
            engine.close()
