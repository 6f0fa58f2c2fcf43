"""rollout: `num_generations` sampled completions per prompt from a policy.

The engine (stages/rollout/engines) does the sampling; this stage picks the round's prompts,
expands them into groups, and writes the rollouts table with, for every row, the engine
and the policy version that produced it. A user `rollout_func` (multi-step or
tool-using generation) gets the engine and returns the completions itself.
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Callable, Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.data.schemas import ROLLOUTS, write_table
from stages.data.sources import BadRowError
from stages.rollout.engines import Policy, Sampling, engine_lock, get_engine
from stages.runtime.keys import key_when_set, not_in_key
from stages.training import scope_rl

log = logging.getLogger(__name__)


class VLLMOptions(BaseModel):
    """vLLM engine settings (`vllm`, `ray_vllm`'s engines, and `vllm_server`)."""

    model_config = ConfigDict(extra="forbid")

    gpu_memory_utilization: float = Field(0.05, gt=0, le=1)
    """Fraction of GPU memory for weights + KV cache (on CPU vLLM reads it as a fraction of RAM)."""
    kv_cache_space_gib: float = Field(1.0, gt=0)
    """CPU only: KV cache size (sets VLLM_CPU_KVCACHE_SPACE)."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + completion; unset: the model's max_position_embeddings, on CPU at most 1024 (vLLM's
    CPU runner holds memory for 256 whole sequences of this length: SmolLM2's 8192 made a 10 GiB process).
    Set it when prompt + completion can be longer."""
    dtype: str = "auto"
    """Engine dtype; auto: the run's train.precision (float32 on CPU, bfloat16 on a GPU), the dtype the
    trainer computes in, so that sampling log-probs match the trainer's most closely."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one vLLM engine shards the model over (vLLM's `tensor_parallel_size`); 1 on a CPU."""
    sleep_mode: bool = not_in_key(False)
    """vllm, ray_vllm on a GPU (TRL's `vllm_enable_sleep_mode`): after each round's generation the engine
    sleeps (vLLM level 1: weights moved to CPU memory, KV cache freed), so the optimize stage on the same GPU
    gets its memory back; it wakes before the next generation. Costs a weight copy each way per round. vLLM's
    sleep mode is CUDA-only: on a CPU it is refused at config time."""
    enforce_eager: bool = True
    """No CUDA graphs / compilation: slower steady state, much faster start."""
    lora_sync: Literal["auto", "merged", "adapter"] = "auto"
    """vllm, ray_vllm, vllm_server: how a LoRA policy reaches the engine. merged: the round's adapter is merged
    into the weights (as TRL's colocated vLLM does) and loaded in place, so generation runs plain matmuls
    (vllm_server: the server loads the merged folder through its dev-mode /collective_rpc, which `posttrain
    vllm-serve` enables); adapter: vLLM's LoRA kernels apply it (a LoRARequest per version; vllm_server: POST
    /v1/load_lora_adapter, axolotl's vllm_lora_sync). auto: merged on CPU (vllm_server: a server on CPU that
    takes weights and sees this machine's paths), where vLLM's LoRA path made a SmolLM2-135M round ~4x slower
    than merged weights, merge included; adapter on GPUs, where the kernels are fast and merging and reloading a
    large model each round is not."""
    in_process: bool = True
    """vllm: run vLLM's engine core and worker inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
    On a 2-core CPU this is ~1.8x faster than vLLM's default of separate processes, which poll
    each other; set false to get that default (e.g. tensor_parallel_size > 1 on GPUs)."""
    server_url: str = not_in_key("http://127.0.0.1:8000")
    """vllm_server: base URL of `vllm serve` (started by you or by `posttrain serve-vllm`)."""
    server_urls: list[str] | None = not_in_key(None)
    """vllm_server: several servers to generate on, data parallel (replaces server_url): each round's
    prompts are shared out among them, the round's adapter is loaded on each, and a server that stops
    answering is dropped with a warning, its prompts re-sent to the others. Per-prompt seeds: the same
    completions whichever server samples a prompt."""
    server_timeout_s: float = not_in_key(300.0, gt=0)
    """vllm_server: per-request timeout."""
    server_wait_s: float = not_in_key(0.0, ge=0)
    """vllm_server: how long a run waits for a server that does not answer yet (axolotl's
    trl.vllm_server_timeout), saying what it waits for; 0: it fails at once, naming the fix. Set it when the
    server starts beside the run (`posttrain vllm-serve CONFIG` in another terminal: a minute or more)."""
    serve_host: str = not_in_key("127.0.0.1")
    """`posttrain vllm-serve`: the address its server listens on (axolotl's vllm.host). 127.0.0.1: this machine
    only; 0.0.0.0: every interface, for runs on other machines (vLLM's server has no authentication here)."""
    server_adapter_root: str | None = None
    """vllm_server: the artifacts folder as the server sees it, when it runs on another host
    or container (adapter paths are sent with this prefix instead of the local one)."""


class RayVLLMOptions(BaseModel):
    """ray_vllm: where its vLLM engines run (the engines' own settings are `rollout.vllm`'s)."""

    model_config = ConfigDict(extra="forbid")

    num_engines: int = Field(1, ge=1)
    """vLLM engines, one Ray actor each; each round's prompts are shared out among them."""
    address: str | None = None
    """Ray cluster to join; unset: RAY_ADDRESS, else a local Ray instance started by the run."""
    num_cpus_per_engine: float = Field(1.0, gt=0)
    """CPUs Ray reserves for each engine actor (Ray's `num_cpus`)."""
    num_gpus_per_engine: float | None = Field(None, ge=0)
    """unset: rollout.vllm.tensor_parallel_size when the cluster has GPUs, else 0."""
    startup_timeout_s: float = Field(900.0, gt=0)
    """How long the engines may take to be placed and built before the rollout fails."""


class AtroposOptions(BaseModel):
    """`rollout.source: atropos` (stages/rollout/atropos.py): where Atropos' API server is and how posttrain serves
    its policy."""

    model_config = ConfigDict(extra="forbid")

    api_url: str = "http://127.0.0.1:8000"
    """Atropos' API server (`run-api`). Atropos' default port; part of the round's batch key (another API
    is another stream of batches)."""
    start_api: bool = not_in_key(True)
    """Start `run-api` (from `api_command`) when api_url is on this host and nothing answers there; posttrain
    stops it at the end of the run, but a killed run leaves it running, so the resumed run finds it with the
    environments still attached. false: fail with a message saying what to start."""
    api_command: str = not_in_key("run-api")
    """The `run-api` executable: a name on PATH or beside this Python, or a path."""
    api_start_timeout_s: float = not_in_key(60.0, gt=0)
    """How long `run-api` may take to answer after it is started."""
    policy_url: str = not_in_key("http://127.0.0.1:9100")
    """Where posttrain serves the current policy to the environments (OpenAI-compatible, model name
    `policy`): point each environment's `--openai.base_url` at this URL + /v1."""
    policy_token_env: str | None = not_in_key(None)
    """The environment variable holding the bearer token the policy server requires (give it to each
    environment as `--openai.api_key`; it is sent as `Authorization: Bearer <token>`). Unset: no token, which is
    allowed only when policy_url is on loopback (stages/runtime/bearer.py)."""
    max_token_len: int = Field(512, ge=8)
    """Longest prompt + completion in tokens (registered; environments drop longer sequences).
    Higher: longer reasoning fits, more memory per sequence."""
    batch_timeout_s: float = not_in_key(900.0, gt=0)
    """How long one round may wait for the API to have a full batch before the run fails (the error
    names the API and says to start an environment)."""
    wandb_project: str = "posttrain"
    """Registered with the API (environments log to W&B under it when they use W&B)."""
    wandb_group: str = "posttrain"
    """Registered with the API, as wandb_project."""

    @field_validator("api_url", "policy_url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")) or not urlparse(value).port:
            raise ValueError(f"{value!r}: expected a URL with a port, like http://127.0.0.1:8000")
        return value.rstrip("/")


class RolloutConfig(BaseModel):
    """Sampling settings (names as in TRL's GRPOConfig) and the engine that samples."""

    model_config = ConfigDict(extra="forbid")

    source: Literal["prompts", "atropos"] = not_in_key("prompts")
    """prompts: each round samples the train split's prompts here. atropos: each round pulls one scored
    batch from Atropos environments (rollout.atropos; stages/rollout/atropos.py), which sample the policy posttrain
    serves with `engine`; a batch is prompts_per_round groups of num_generations sequences."""
    atropos: AtroposOptions = not_in_key(default_factory=AtroposOptions)
    engine: Literal["transformers", "vllm", "vllm_server", "ray_vllm"] = "transformers"
    """transformers: in-process generate, always available. vllm: in-process vLLM engine kept
    across rounds. vllm_server: external `vllm serve --enable-lora` servers. ray_vllm: vLLM engines
    in Ray actors, kept across rounds (rollout.ray_vllm)."""
    vllm: VLLMOptions = Field(default_factory=VLLMOptions)
    ray_vllm: RayVLLMOptions = not_in_key(default_factory=RayVLLMOptions)
    rollout_func: str | None = None
    """`module.fn`: your own rollout, fn(prompts, engine, policy, sampling, tokenizer) -> one dict per
    prompt with completion_token_ids, sampling_logprobs (and optionally completion, finish_reason)."""
    num_generations: int = Field(8, ge=2)
    """Completions per prompt (the GRPO group). Higher: better baseline, more generation time."""
    prompts_per_round: int = Field(64, ge=1)
    """Prompts drawn from the train split each round (without replacement, cycling)."""
    max_completion_length: int = Field(16, ge=1)
    """Tokens generated at most per completion; longer ones end with finish_reason=length."""
    max_prompt_length: int | None = key_when_set(None, ge=1)
    """Tokens of a chat-templated prompt kept, from its end (TRL's former `max_prompt_length`, which cut
    prompts on the left); the optimize stage trains on the prompt as sampled. Unset: whole prompts. The round's
    `prompts_truncated_frac` counts the prompts cut. A prompt longer than the model's context leaves beside
    max_completion_length is an error (too_long_prompts: fail) or left out (drop); this cuts it instead."""
    too_long_prompts: Literal["fail", "drop"] = "fail"
    """A prompt that, as the engine gets it (its last max_prompt_length tokens when that is set), leaves less room
    than max_completion_length in the model's context (its max_position_embeddings, or vllm.max_model_len): no
    engine cuts it, and it runs past the positions the model was trained on. fail: round 0 stops, naming its row
    in the prompts file and its length. drop: it is left out of the pool every round draws from (the same rows in
    every round, rerun and resume), with a warning naming the count and the first row, and the count as the
    round's `prompts_too_long`. A run's config sets it from transform.on_bad_rows (the transform runs before the
    model exists, so it cannot see such a prompt) unless it is set here."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the optimize stage scales logits by the same value."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p; 1: off (TRL's
    default). Below 1, vLLM's sampling log-probs are taken after the cut (stages/rollout/engines/vllm_local.py)."""
    generation_batch_size: int = Field(256, ge=1)
    """transformers engine: sequences per generate call. Higher: faster, more memory."""
    async_prefetch: bool = not_in_key(False)
    """Generate round r+1 (from the newest finished policy) while round r optimizes."""
    prefetch_depth: int = not_in_key(1, ge=1)
    """How many rounds ahead rollouts may be generated."""
    max_staleness: int = not_in_key(1, ge=0)
    """Most optimize rounds a rollout's policy may lag its round; 0 = synchronous."""
    prefetch_torch_threads: int | None = not_in_key(None, ge=1)
    """While prefetching, torch's intra-op threads for each side (the rollout thread and the
    optimizer thread); unset: torch's default (all cores each). On 2 cores, 1 each measured
    slower than the default (BENCHMARKS.md)."""
    worker_process: bool = not_in_key(False)
    """Generate in a separate long-lived process (stages/rollout/rollout_worker.py) with its own GIL and
    torch threads, so a prefetched rollout runs truly beside the optimizer; the engine is kept
    there across rounds. Off: rollouts run in the flow's process."""
    worker_cpus: list[int] | None = not_in_key(None)
    """CPU cores the rollout worker is pinned to (needs worker_process); unset: all cores."""
    trainer_cpus: list[int] | None = not_in_key(None)
    """CPU cores the flow's process (optimizer, and reward workers it spawns) is pinned to while
    the rounds run; unset: all. With worker_cpus it splits the machine between engine and trainer."""
    seed: int = 0
    """Seed of the prompts each round draws and of the sampling (per round and prompt): the same seed, the
    same completions from the same policy."""

    @model_validator(mode="after")
    def _check_server_urls(self) -> "RolloutConfig":
        urls = self.vllm.server_urls
        if urls is not None:
            if not urls:
                raise ValueError("rollout.vllm.server_urls is empty: list at least one URL, or leave it unset "
                                 "to use rollout.vllm.server_url")
            bad = [u for u in urls if not u.startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"rollout.vllm.server_urls: {bad} -- each must be a URL like http://host:8000")
            twice = sorted({u for u in urls if urls.count(u) > 1})
            if twice:
                raise ValueError(f"rollout.vllm.server_urls lists {twice} more than once")
        return self

    @model_validator(mode="after")
    def _check_lora_sync(self) -> "RolloutConfig":
        if self.vllm.lora_sync != "auto" and self.engine not in ("vllm", "ray_vllm", "vllm_server"):
            raise ValueError(f"rollout.vllm.lora_sync: {self.vllm.lora_sync} applies to the vLLM engines, not "
                             f"{self.engine}; remove it")
        if self.engine == "vllm_server" and self.vllm.lora_sync == "merged" and self.vllm.server_adapter_root:
            raise ValueError("rollout.vllm.lora_sync: merged writes each round's merged weights to a folder on this "
                             "machine, which a server reached through server_adapter_root (another host) cannot "
                             "read; use lora_sync: adapter there, or unset server_adapter_root")
        return self

    @model_validator(mode="after")
    def _check_cpus(self) -> "RolloutConfig":
        available = list(range(os.cpu_count() or 1))
        for key in ("worker_cpus", "trainer_cpus"):
            cpus = getattr(self, key)
            if cpus is not None:
                unknown = [c for c in cpus if c not in available]
                if not cpus or unknown:
                    raise ValueError(f"rollout.{key}: {cpus} -- cores here are {available}")
        if self.worker_cpus is not None and not self.worker_process:
            raise ValueError("rollout.worker_cpus needs rollout.worker_process: true")
        return self

    @model_validator(mode="after")
    def _check_atropos(self) -> "RolloutConfig":
        if self.max_prompt_length and self.rollout_func:
            raise ValueError("rollout.max_prompt_length cuts the prompts the engine samples, but rollout.rollout_func "
                             "samples them itself (it gets the conversations); cut them there, or unset one")
        if self.source == "atropos":
            clash = [k for k in ("async_prefetch", "worker_process", "max_prompt_length") if getattr(self, k)] + (
                ["rollout_func"] if self.rollout_func else [])
            if clash:
                raise ValueError(f"rollout.source: atropos does not go with rollout.{', rollout.'.join(clash)}: "
                                 "the environments decide what is sampled and when; leave them unset")
        return self

    def lag(self) -> int:
        """Rounds between the policy a rollout samples from and the round it trains (0: sync)."""
        return min(self.prefetch_depth, self.max_staleness) if self.async_prefetch else 0


SERVER_KEYS = ("server_url", "server_urls", "server_timeout_s", "server_wait_s", "server_adapter_root")
"""rollout.vllm keys of the vllm_server engine alone."""
SERVER_ENGINE_KEYS = (*SERVER_KEYS, "lora_sync")
"""rollout.vllm keys the vllm_server engine takes (the rest are the server's flags: `posttrain vllm-serve`)."""


def engine_options(cfg: RolloutConfig, max_lora_rank: int, devices=None) -> dict:
    """What `get_engine` needs for this config's engine; `devices` (stages/runtime/devices.py): where the transformers
    engine runs, and the dtype `vllm.dtype: auto` means."""
    from stages.runtime.devices import DeviceConfig

    if cfg.engine == "transformers":
        return {"batch_size": cfg.generation_batch_size, "devices": devices or DeviceConfig()}
    options = vllm_options(cfg, devices)
    options.pop("serve_host")  # `posttrain vllm-serve`'s, not an engine's
    if cfg.engine in ("vllm", "ray_vllm"):
        for key in SERVER_KEYS:
            options.pop(key)
    else:
        options = {k: options[k] for k in SERVER_ENGINE_KEYS}
    if cfg.engine == "ray_vllm":
        options.update(cfg.ray_vllm.model_dump())
    return {**options, "max_lora_rank": max_lora_rank}


def vllm_options(cfg: RolloutConfig, devices=None) -> dict:
    """rollout.vllm's settings with `dtype: auto` resolved to the dtype the trainer computes in (`devices`)."""
    from stages.runtime.devices import DTYPES, precision

    options = cfg.vllm.model_dump()
    if options["dtype"] == "auto":
        options["dtype"] = DTYPES[precision(devices)]
    return options


def select_prompts(rows: list[dict], round_index: int, per_round: int, seed: int) -> list[dict]:
    """The round's prompts: a fixed shuffle of the split, walked in slices, wrapping around."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    start = (round_index * per_round) % len(rows)
    picked = [order[(start + i) % len(rows)] for i in range(min(per_round, len(rows)))]
    return [rows[i] for i in picked]


def with_rerolls(picked: list[dict], rows: list[dict], reroll_prompt_ids: list[str]) -> tuple[list[dict], set[str]]:
    """The round's prompts with the re-rolled ones (stages/scoring/replay.py) in place of the last of the slice:
    (prompts, ids of the re-rolled). A re-rolled prompt already in the slice replaces nothing."""
    by_id = {row["prompt_id"]: row for row in rows}
    unknown = [p for p in reroll_prompt_ids if p not in by_id]
    if unknown:
        raise ValueError(f"rollout: re-roll prompt(s) {unknown} are not in the prompts table")
    present = {row["prompt_id"] for row in picked}
    extra = [by_id[p] for p in reroll_prompt_ids if p not in present][: len(picked)]
    kept = picked[: len(picked) - len(extra)]
    return kept + extra, set(reroll_prompt_ids)


def _sample(cfg: RolloutConfig, engine, policy: Policy, prompts: list, sampling: Sampling, progress) -> list[dict]:
    """The engine's completions of `prompts`, or the user's rollout_func's; `progress(n)` after each."""
    if not cfg.rollout_func:
        return engine.generate(policy, prompts, sampling, on_progress=progress)
    generated = _user_rollout(cfg, engine, policy, prompts, sampling)
    progress(len(generated))
    return generated


AXOLOTL_ROLLOUT_PARAMETERS = ("model", "processing_class")
"""A rollout_func with these parameters is called as axolotl's GRPO guide (its OpenEnv section) describes:
fn(model, processing_class, prompts, generation_config) -> one completion string per prompt."""


def is_axolotl_rollout_func(fn) -> bool:
    """fn takes axolotl's guide's parameters (`model`, `processing_class`) rather than posttrain's."""
    import inspect

    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(name in names for name in AXOLOTL_ROLLOUT_PARAMETERS)


def _user_rollout(cfg: RolloutConfig, engine, policy: Policy, prompts: list, sampling: Sampling) -> list[dict]:
    """Call the user's rollout_func and check what it returns, naming the function and the row."""
    from transformers import AutoTokenizer

    from stages.runtime.imports import load_function

    fn = load_function(cfg.rollout_func, "rollout.rollout_func", {})
    if is_axolotl_rollout_func(fn):
        return _axolotl_rollout(cfg.rollout_func, fn, policy, prompts, sampling)
    tokenizer = AutoTokenizer.from_pretrained(policy.model_dir)
    out = fn(prompts=prompts, engine=engine, policy=policy, sampling=sampling, tokenizer=tokenizer)
    if not isinstance(out, list) or len(out) != len(prompts):
        got = f"{len(out)} items" if isinstance(out, list) else type(out).__name__
        raise ValueError(f"rollout.rollout_func {cfg.rollout_func}: returned {got} for {len(prompts)} prompts")
    results = []
    for i, (prompt, item) in enumerate(zip(prompts, out)):
        where = f"rollout.rollout_func {cfg.rollout_func}: item {i}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a dict, got {type(item).__name__}")
        for key in ("completion_token_ids", "sampling_logprobs"):
            if key not in item:
                raise ValueError(f"{where}: missing {key!r}")
        ids, logps = list(item["completion_token_ids"]), list(item["sampling_logprobs"])
        if len(ids) != len(logps):
            raise ValueError(f"{where}: {len(ids)} completion_token_ids but {len(logps)} sampling_logprobs")
        prompt_ids = item.get("prompt_token_ids") or tokenizer.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=True)
        if isinstance(prompt_ids, dict):
            prompt_ids = prompt_ids["input_ids"]
        finish = item.get("finish_reason") or (
            "stop" if ids and ids[-1] == tokenizer.eos_token_id else "length")
        results.append({"prompt_token_ids": list(prompt_ids), "completion_token_ids": ids, "sampling_logprobs": logps,
                        "completion": item.get("completion") or tokenizer.decode(ids, skip_special_tokens=True),
                        "finish_reason": finish})
    return results


def _axolotl_rollout(name: str, fn, policy: Policy, prompts: list, sampling: Sampling) -> list[dict]:
    """axolotl's guide's rollout_func: called with the round's policy as a transformers model (`model`, the round's
    adapter merged in), its tokenizer (`processing_class`), the prompts ({"messages": chat} each, as the guide's
    docstring says, each repeated num_generations times, as TRL batches them) and a transformers GenerationConfig of
    rollout's sampling settings; it returns one completion string per prompt. Each string is tokenized as the
    completion (its tokens after the chat-templated prompt; cut at max_completion_length, as an engine stops, with
    finish_reason `length`), and its sampling log-probs are the policy's own under rollout.temperature, computed
    here: the function is taken to have sampled from the model it was given (a function that samples elsewhere
    gets no importance-sampling correction for it)."""
    import inspect

    import torch
    from transformers import GenerationConfig

    from stages.rollout.engines import prompt_token_ids
    from stages.runtime.policy import load_policy
    from stages.training.logprobs import completion_logps

    model, tokenizer = load_policy(policy.model_dir, policy.adapter_dir)
    config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=sampling.do_sample,
                              temperature=sampling.temperature, top_p=sampling.top_p,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    kwargs = {"model": model, "processing_class": tokenizer, "prompts": [{"messages": p} for p in prompts]}
    if "generation_config" in inspect.signature(fn).parameters:
        kwargs["generation_config"] = config
    torch.manual_seed(sampling.seed)
    out = fn(**kwargs)
    if not isinstance(out, list) or len(out) != len(prompts):
        got = f"{len(out)} items" if isinstance(out, list) else type(out).__name__
        raise ValueError(f"rollout.rollout_func {name}: returned {got} for {len(prompts)} prompts (axolotl's "
                         "rollout_func returns one completion string per prompt)")
    results = []
    for i, (prompt_ids, text) in enumerate(zip(prompt_token_ids(tokenizer, prompts), out)):
        if not isinstance(text, str):
            raise ValueError(f"rollout.rollout_func {name}: item {i} is a {type(text).__name__}; axolotl's "
                             "rollout_func returns completion strings")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        cut = len(ids) > sampling.max_new_tokens  # cut as an engine stops at max_new_tokens
        if cut:
            ids = ids[: sampling.max_new_tokens]
            text = tokenizer.decode(ids)
        logps = []
        if ids:
            tokens = torch.tensor([prompt_ids + ids], device=model.device)
            with torch.no_grad():
                logps = completion_logps(model, tokens, torch.ones_like(tokens), len(ids),
                                         sampling.temperature)[0][0].float().tolist()
        results.append({"prompt_token_ids": prompt_ids, "completion_token_ids": ids, "sampling_logprobs": logps,
                        "completion": text,
                        "finish_reason": "length" if cut or len(ids) == sampling.max_new_tokens else "stop"})
    return results


def left_truncated(prompts: list, model_dir: Path, max_tokens: int) -> tuple[list[dict], int]:
    """The prompts as token prompts ({prompt_token_ids}) of at most their last `max_tokens` chat-templated
    tokens, and how many were cut."""
    from transformers import AutoTokenizer

    from stages.rollout.engines import prompt_token_ids

    ids = prompt_token_ids(AutoTokenizer.from_pretrained(model_dir), prompts)
    return [{"prompt_token_ids": i[-max_tokens:]} for i in ids], sum(len(i) > max_tokens for i in ids)


class PromptTooLongError(BadRowError):
    """Prompts of a split that leave less room than the completion budget (rollout.max_completion_length,
    eval.max_completion_length) in the model's context."""


CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where a transformers config holds the model's context in tokens (Llama/Qwen, GPT-2, others)."""

_measured: dict[tuple, list[tuple[int, str, int]]] = {}
"""(prompts file, its stat stamp, rows, model, room, cut) -> its too-long rows, as found once in this process."""
_warned: set[tuple[str, int]] = set()  # (prompts file, rows left out): warned of in this process


def model_context(cfg: RolloutConfig | None, model_dir: Path) -> tuple[int, str] | None:
    """(the longest sequence the engine takes in tokens, where that number comes from): the model config's
    max_position_embeddings (or its like), or rollout.vllm.max_model_len where a vLLM engine runs with a smaller
    one set (cfg None: the transformers engine); None when neither names one."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
    except (OSError, ValueError):  # no transformers config: the engine knows the model; nothing to check here
        config = None
    field = next((f for f in CONTEXT_FIELDS if isinstance(getattr(config, f, None), int)), None)
    context = (getattr(config, field), f"{field} of {model_dir}") if field else None
    limit = cfg.vllm.max_model_len if cfg is not None and cfg.engine != "transformers" else None
    if limit and (context is None or limit < context[0]):
        context = (limit, "rollout.vllm.max_model_len")
    return context


def too_long_rows(rows: list[dict], prompts_path: Path, model_dir: Path, room: int,
                  cut: int | None = None) -> list[tuple[int, str, int]]:
    """(row index, prompt_id, prompt tokens) of each row whose chat-templated prompt, as the engine gets it (its
    last `cut` tokens when that is set: TRL's left truncation), takes more than `room` tokens. Measured once per
    process for a given file, model and room; the same rows on every call, so a dropped row is dropped in every
    round and on every rerun."""
    measured = (str(prompts_path), prompts_path.stat().st_mtime_ns, prompts_path.stat().st_size, len(rows),
                str(model_dir), room, cut)
    if measured in _measured:
        return _measured[measured]
    if cut and cut <= room:  # every prompt is cut to fit
        _measured[measured] = []
        return []
    from transformers import AutoTokenizer

    from stages.rollout.engines import prompt_token_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def may_not_fit(prompt: list[dict]) -> bool:
        """Whether the prompt's text could take more tokens than `room`: a token covers at least one byte of the
        normalized text, and NFC normalization at most triples a text's UTF-8 bytes (Unicode UAX #15)."""
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return 3 * len(text.encode()) + 1 > room

    chats = [(i, row) for i, row in enumerate(rows) if row["prompt"] and may_not_fit(row["prompt"])]  # text: none
    lengths = [len(ids) for ids in prompt_token_ids(tokenizer, [row["prompt"] for _, row in chats])]
    found = [(i, row["prompt_id"], n) for (i, row), n in zip(chats, lengths) if min(n, cut or n) > room]
    _measured[measured] = found
    return found


def rows_named(too_long: list[tuple[int, str, int]]) -> str:
    """The first three too-long rows, for a message."""
    named = ", ".join(f"row {i} (prompt_id {pid}) has {n} prompt tokens" for i, pid, n in too_long[:3])
    return f"{named}{', ...' if len(too_long) > 3 else ''} ({len(too_long)} row(s))"


def check_prompt_lengths(cfg: RolloutConfig, rows: list[dict], prompts_path: Path,
                         model_dir: Path) -> list[tuple[int, str, int]]:
    """The too-long rows of the split (too_long_rows): those whose prompt, as the engine gets it, leaves less room
    than rollout.max_completion_length in the model's context: such a prompt is cut by no engine, and it runs past
    the positions the model was trained on (slowly: 16,714 tokens for a context of 256 took 87 s). Under
    rollout.too_long_prompts fail they raise PromptTooLongError naming them; under drop they are returned, for the
    caller to leave out of the pool. The whole split is checked, so round 0 stops, not the round that first draws
    such a row."""
    context = model_context(cfg, model_dir)
    if context is None:
        return []
    return prompts_that_do_not_fit("rollout", cfg.too_long_prompts, rows, prompts_path, model_dir, context,
                                   cfg.max_completion_length, cfg.max_prompt_length)


def prompts_that_do_not_fit(stage: str, mode: str, rows: list[dict], prompts_path: Path, model_dir: Path,
                            context: tuple[int, str], max_completion_length: int,
                            max_prompt_length: int | None = None) -> list[tuple[int, str, int]]:
    """The rows (too_long_rows) whose prompt leaves less room than `stage`.max_completion_length in the model's
    `context` (tokens, where that number comes from); under `mode` fail, PromptTooLongError naming them (with the
    ways out: rollout.max_prompt_length's left truncation where the stage has it, dropping them, shortening them);
    under drop, the rows, unless none would be left."""
    (tokens, where), room = context, context[0] - max_completion_length
    budget = f"{stage}.max_completion_length {max_completion_length}"
    if room < 1:
        raise PromptTooLongError(f"{stage}: {budget} leaves no room for a prompt in the model's context of {tokens} "
                                 f"tokens ({where}); lower it")
    too_long = too_long_rows(rows, prompts_path, model_dir, room, max_prompt_length)
    cut = (f"set rollout.max_prompt_length: {room} to keep each prompt's last {room} tokens (TRL's left "
           "truncation), " if stage == "rollout" else "set ")
    if too_long and mode == "fail":
        raise PromptTooLongError(
            f"{stage}: {prompts_path}: {rows_named(too_long)}: more than the model's context of {tokens} tokens "
            f"({where}) leaves beside {budget}; {cut}transform.on_bad_rows: drop ({stage}.too_long_prompts: drop) "
            "to leave these rows out, or shorten or remove them")
    if too_long and len(too_long) == len(rows):
        raise PromptTooLongError(f"{stage}: {prompts_path}: every one of its {len(rows)} prompts is longer than the "
                                 f"model's context of {tokens} tokens ({where}) leaves beside {budget}, so none is "
                                 f"left (e.g. {rows_named(too_long)}); "
                                 + (f"set rollout.max_prompt_length: {room}, or " if stage == "rollout" else "")
                                 + "give shorter prompts")
    return too_long


def run(cfg: RolloutConfig, policy: Policy, prompts_path: Path, round_index: int, out_dir: Path,
        engine_settings: dict | None = None, on_progress: Callable[[int, int], None] | None = None,
        reroll_prompt_ids: list[str] = (), scope_alpha: float = 0.0, scope_temperature: float = 1.0) -> dict:
    """Sample the round's completions into out_dir/rollouts.parquet; return a summary.
    `reroll_prompt_ids`: prompts sampled again in place of the last of the round's slice. `scope_alpha` > 0
    (grpo.scope_rl): that share of the round's groups sampled once more at `scope_temperature` times the temperature,
    appended as whole groups marked `scope_aux` (stages/training/scope_rl.py)."""
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, too_long = _fitting_rows(cfg, pq.read_table(prompts_path).to_pylist(), prompts_path, policy)
    picked = select_prompts(rows, round_index, cfg.prompts_per_round, cfg.seed)
    picked, rerolled = with_rerolls(picked, rows, list(reroll_prompt_ids))
    aux = [picked[i] for i in scope_rl.aux_groups(len(picked), scope_alpha, cfg.seed * 100_003 + round_index)]
    expanded = [(row, g) for row in picked + aux for g in range(cfg.num_generations)]
    total = len(expanded)
    done = 0

    def progress(n):
        nonlocal done
        done += n
        if on_progress:
            on_progress(done, total)

    engine = get_engine(cfg.engine, policy.base_dir,
                        engine_settings if engine_settings is not None else engine_options(cfg, 16))
    sampling = Sampling(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                        seed=cfg.seed * 100_003 + round_index)
    prompts = [row["prompt"] for row, _ in expanded]
    cut = 0
    if cfg.max_prompt_length:
        prompts, cut = left_truncated(prompts, policy.base_dir, cfg.max_prompt_length)
    main = len(picked) * cfg.num_generations
    aux_sampling = Sampling(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature * scope_temperature,
                            top_p=cfg.top_p, seed=sampling.seed + 1)  # SCOPE-RL's groups, at their temperature
    with engine_lock(engine):
        started = time.perf_counter()
        generated = _sample(cfg, engine, policy, prompts[:main], sampling, progress)
        if aux:
            generated += _sample(cfg, engine, policy, prompts[main:], aux_sampling, progress)
        seconds = time.perf_counter() - started
    engine_name = f"{cfg.engine}+{cfg.rollout_func}" if cfg.rollout_func else cfg.engine
    passthrough = [c for c in rows[0] if c not in ROLLOUTS.names]
    records = []
    for i, ((row, g), gen) in enumerate(zip(expanded, generated)):
        rec = {c: row[c] for c in passthrough}
        rec.update(gen)
        rec.update(rollout_id=f"r{round_index}-{row['prompt_id']}-{'aux-' if i >= main else ''}g{g}",
                   prompt_id=row["prompt_id"], group_index=g, prompt=row["prompt"], round_index=round_index,
                   policy_version=policy.version, engine=engine_name, rerolled=row["prompt_id"] in rerolled,
                   **({scope_rl.AUX_COLUMN: i >= main} if aux else {}))
        records.append(rec)
    write_table(pa.Table.from_pylist(records), out_dir / "rollouts.parquet", ROLLOUTS, extra_ok=True)
    lengths = [len(r["completion_token_ids"]) for r in records]
    metrics = {
        "rows": len(records),
        "prompts": len(picked),
        "rerolled_prompts": len(rerolled),
        "prompts_too_long": len(too_long),
        "prompts_truncated_frac": cut / len(prompts),
        "completion_length_mean": sum(lengths) / len(lengths),
        "truncated_frac": sum(r["finish_reason"] == "length" for r in records) / len(records),
        "tokens": sum(lengths),
        "generate_s": seconds,
        "tokens_per_s": sum(lengths) / max(seconds, 1e-9),
        "policy_version": policy.version,
        "staleness": round_index - policy.version,
        **({"scope/temperature": scope_temperature, "scope/aux_rows": len(records) - main} if aux else {}),
    }
    return {**metrics, **_share_metrics(cfg, engine, seconds)}


def _fitting_rows(cfg: RolloutConfig, rows: list[dict], prompts_path: Path, policy: Policy) -> tuple[list, list]:
    """(the prompt rows a round draws from, the too-long ones left out): rollout.too_long_prompts drop leaves out
    every round the same rows, with one warning per process; fail stops here (`check_prompt_lengths`)."""
    too_long = check_prompt_lengths(cfg, rows, prompts_path, policy.base_dir)
    if too_long:
        i, pid, n = too_long[0]
        if (str(prompts_path), len(too_long)) not in _warned:  # once per process, not every round
            _warned.add((str(prompts_path), len(too_long)))
            log.warning("rollout: left out %d prompt(s) of %s longer than the model's context leaves beside "
                        "rollout.max_completion_length %d (rollout.too_long_prompts: drop), e.g. row %d (prompt_id "
                        "%s, %d tokens)", len(too_long), prompts_path, cfg.max_completion_length, i, pid, n)
        dropped = {i for i, _, _ in too_long}
        rows = [row for i, row in enumerate(rows) if i not in dropped]
    return rows, too_long


def _share_metrics(cfg: RolloutConfig, engine, seconds: float) -> dict:
    """Data parallel over several vLLM servers or Ray engines: how the round was shared out ({} otherwise)."""
    shares = getattr(engine, "last_call", None) or {}
    if len(shares) <= 1:
        return {}
    prefix = "servers" if cfg.engine == "vllm_server" else "engines"
    metrics = {f"{prefix}/count": len(shares), f"{prefix}/answered": sum(s["completions"] > 0 for s in shares.values())}
    for index, share in enumerate(shares.values()):  # servers: in rollout.vllm.server_urls order
        metrics[f"{prefix}/{index}/completions"] = share["completions"]
        metrics[f"{prefix}/{index}/completions_per_s"] = share["completions"] / max(seconds, 1e-9)
    return metrics
