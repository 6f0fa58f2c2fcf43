"""Atropos trainer mode (`rollout.source: atropos`): the rounds train on scored batches that Atropos
environments produce, instead of on our own rollouts.

Atropos (NousResearch/atropos, package `atroposlib`) splits RL into environments, which sample from an
OpenAI-compatible inference server and score what they sampled, and a trainer, which pulls scored
batches from Atropos' API server (`run-api`). As its trainer, posttrain:

1. starts `run-api` when `rollout.atropos.api_url` is on this host and nothing answers there;
2. registers with POST /register (batch size, max token length, checkpoint folder, starting step,
   number of steps: the fields of Atropos' example trainer, example_trainer/grpo.py);
3. serves the current policy to the environments at `rollout.atropos.policy_url` (`PolicyServer`:
   /v1/chat/completions, /v1/completions and vLLM's native /generate, so environments with `server_type:
   openai` or `vllm` both work, in front of the `rollout.engine` -- transformers or vLLM in process, or
   `vllm serve` through the vllm_server engine, the round's LoRA adapter loaded per policy version); its
   answers carry what vLLM's carry with `return_token_ids` (prompt and completion token ids, the sampled
   tokens' log-probs) plus `policy_version`;
4. each round, pulls one batch with GET /batch and writes it as the round's rollouts.parquet (`pull`),
   before anything trains on it: Atropos hands a batch out once, and a resumed run finds it on disk;
5. scores it from the environments' own scores (`score`: scored.parquet, group advantages as the score
   stage's), and the optimize stage trains on it as on our own rollouts (same loss, IS correction, health
   checks).

A batch row is one sequence: `tokens` with `masks` (-100 where not trained, the token where trained), the
environment's `scores`, and, from an environment that fills them, `inference_logprobs` (1.0 on prompt
positions, Atropos' convention) and `overrides` (configs/examples/atropos_env.py puts the policy version, its
name and the gold answer there). Without inference_logprobs the sampling log-probs are NaN: the
optimize stage's IS correction then weighs those tokens 1 (counted in `sampling_logprobs_missing_frac`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

from stages.rollout.rollout import AtroposOptions
from stages.runtime.bearer import authorized, named_token, server_token
from stages.runtime.http import client

log = logging.getLogger("posttrain.atropos")

MODEL_NAME = "policy"
"""The model name environments ask the policy server for (`--openai.model_name policy`)."""
GENERATE_FIELDS = ("prompt", "n", "max_tokens", "max_completion_tokens", "max_new_tokens", "temperature", "top_p",
                   "logprobs", "stream", "model")
"""The /generate request fields the policy server honours (vLLM's take every SamplingParams field): `model` is
the one policy, `logprobs` 0 (the sampled token's), `stream` false."""


class AtroposError(RuntimeError):
    """The API or an environment is not there or not as posttrain needs; the message says what to start."""


def is_local(url: str) -> bool:
    return urlparse(url).hostname in ("127.0.0.1", "localhost", "0.0.0.0", "::1")


# ---- the API: start, register, pull ---------------------------------------------------------------------

def _get(url: str, timeout: float = 5.0):
    resp = client().get(url, timeout=timeout)
    resp.raise_for_status()
    return resp.json()


def api_up(url: str) -> bool:
    try:
        return _get(f"{url}/").get("message") == "AtroposLib API"
    except Exception:
        return False


def _api_executable(command: str) -> str | None:
    if os.sep in command:
        return command if Path(command).exists() else None
    beside = Path(sys.executable).parent / command
    return str(beside) if beside.exists() else shutil.which(command)


def ensure_api(opts: AtroposOptions, log_dir: Path) -> subprocess.Popen | None:
    """Make sure the API answers at opts.api_url; start `run-api` there if allowed. The process it started
    (in its own session, so it outlives a killed posttrain), or None."""
    if api_up(opts.api_url):
        return None
    start = f"start it: `{opts.api_command} --host 127.0.0.1 --port {urlparse(opts.api_url).port}`"
    if not (opts.start_api and is_local(opts.api_url)):
        raise AtroposError(f"rollout.atropos.api_url: no Atropos API answers at {opts.api_url}; {start} "
                           "(pip install atroposlib), or fix the URL")
    executable = _api_executable(opts.api_command)
    if executable is None:
        raise AtroposError(f"rollout.atropos.api_command: {opts.api_command!r} not found (beside {sys.executable} or "
                           "on PATH); install Atropos (`pip install -e '.[atropos]'`) or name the executable")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "run-api.log"
    port = urlparse(opts.api_url).port
    process = subprocess.Popen([executable, "--host", urlparse(opts.api_url).hostname, "--port", str(port)],
                               stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + opts.api_start_timeout_s
    while not api_up(opts.api_url):
        if process.poll() is not None or time.time() > deadline:
            process.kill()
            raise AtroposError(f"rollout.atropos: `{executable}` did not answer at {opts.api_url} within "
                               f"{opts.api_start_timeout_s:.0f} s; see {log_path}")
        time.sleep(0.3)
    (log_dir / "run-api.pid").write_text(str(process.pid))  # to stop one a killed run left running
    log.info("atropos: started run-api at %s (pid %d, log %s)", opts.api_url, process.pid, log_path)
    return process


def registration(opts: AtroposOptions, batch_size: int, num_steps: int, checkpoint_dir: Path,
                 starting_step: int) -> dict:
    """POST /register's body (atroposlib.api.server.Registration). posttrain keeps its own checkpoints
    (one adapter per round), so save_checkpoint_interval is the round."""
    return {"wandb_group": opts.wandb_group, "wandb_project": opts.wandb_project, "batch_size": batch_size,
            "max_token_len": opts.max_token_len, "checkpoint_dir": str(checkpoint_dir), "save_checkpoint_interval": 1,
            "starting_step": starting_step, "num_steps": num_steps}


def register(opts: AtroposOptions, body: dict) -> int:
    import httpx

    try:
        resp = client().post(f"{opts.api_url}/register", json=body, timeout=30)
        resp.raise_for_status()
    except httpx.HTTPError as e:
        raise AtroposError(f"rollout.atropos.api_url: registering with {opts.api_url}/register failed ({e}); is "
                           f"`run-api` running there?") from e
    return resp.json()["uuid"]


def pull_batch(opts: AtroposOptions, round_index: int) -> list[dict]:
    """GET /batch until the API has one (a list of scored groups); AtroposError after batch_timeout_s."""
    deadline = time.time() + opts.batch_timeout_s
    waited_note = time.time() + 30
    while True:
        try:
            body = _get(f"{opts.api_url}/batch", timeout=60)
        except Exception as e:
            raise AtroposError(f"round {round_index}: GET {opts.api_url}/batch failed ({e}); is `run-api` still "
                               "running?") from e
        if body.get("status") == "error":
            raise AtroposError(f"round {round_index}: {opts.api_url}/batch: {body.get('message')}")
        if body.get("batch"):
            return body["batch"]
        if time.time() > deadline:
            status = _get(f"{opts.api_url}/status")
            raise AtroposError(
                f"round {round_index}: no batch from {opts.api_url} in {opts.batch_timeout_s:.0f} s (queue: "
                f"{status.get('queue_size')} groups); start an environment pointed at it and at the policy server "
                f"{opts.policy_url}/v1, e.g. `python configs/examples/atropos_env.py serve --env.rollout_server_url "
                f"{opts.api_url} --openai.base_url {opts.policy_url}/v1`")
        if time.time() > waited_note:
            log.warning("atropos: round %d: waiting for a batch from %s (is an environment running?)",
                        round_index, opts.api_url)
            waited_note = time.time() + 60
        time.sleep(0.5)


# ---- one batch as rollouts.parquet, scored.parquet ------------------------------------------------------

def batch_rows(batch: list[dict], round_index: int, num_generations: int, tokenizer) -> list[dict]:
    """The rollouts rows of one pulled batch: one row per sequence, groups kept together. The prompt is the
    masked (-100) prefix of `tokens`, the completion the rest."""
    rows = []
    for g, group in enumerate(batch):
        n = len(group["tokens"])
        if n != num_generations:
            raise AtroposError(f"round {round_index}: the API sent a group of {n} sequences (env id "
                               f"{group.get('env_id')}); rollout.num_generations is {num_generations}: run the "
                               f"environment with --env.group_size {num_generations}")
        logprobs = group.get("inference_logprobs") or [None] * n
        overrides = group.get("overrides") or [{}] * n
        messages = group.get("messages") or [None] * n
        for i, (tokens, masks) in enumerate(zip(group["tokens"], group["masks"])):
            if len(tokens) != len(masks):
                raise AtroposError(f"round {round_index}: group {g} sequence {i}: {len(tokens)} tokens but "
                                   f"{len(masks)} masks")
            start = next((k for k, m in enumerate(masks) if m != -100), len(masks))
            prompt_ids, completion_ids = tokens[:start], tokens[start:]
            lp = logprobs[i]
            sampling = ([float(x) for x in lp[start:]] if lp and len(lp) == len(tokens)
                        else [math.nan] * len(completion_ids))
            extra = overrides[i] or {}
            prompt = [m for m in (messages[i] or []) if m.get("role") != "assistant"] or [
                {"role": "user", "content": tokenizer.decode(prompt_ids, skip_special_tokens=False)}]
            prompt_id = hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:12]
            eos = completion_ids and completion_ids[-1] == tokenizer.eos_token_id
            rows.append({
                "rollout_id": f"r{round_index}-b{g}-{prompt_id}-g{i}", "prompt_id": f"r{round_index}-b{g}-{prompt_id}",
                "group_index": i, "prompt": [{"role": m["role"], "content": str(m["content"])} for m in prompt],
                "completion": tokenizer.decode(completion_ids, skip_special_tokens=True),
                "prompt_token_ids": prompt_ids, "completion_token_ids": completion_ids, "sampling_logprobs": sampling,
                "round_index": round_index, "policy_version": int(extra.get("policy_version", -1)),
                "engine": f"atropos:{extra.get('env', group.get('env_id'))}",
                "finish_reason": "stop" if eos else "length", "rerolled": False,
                "env": str(extra.get("env", group.get("env_id"))), "env_score": float(group["scores"][i]),
                "answer": None if extra.get("answer") is None else str(extra["answer"]),
                "tokens": tokens, "masks": masks,
            })
    return rows


def pull(opts: AtroposOptions, session: "AtroposSession", round_index: int, num_generations: int,
         tokenizer_dir: Path, out_dir: Path) -> dict:
    """Pull the round's batch from the API into out_dir/rollouts.parquet; return a summary."""
    import pyarrow as pa
    from transformers import AutoTokenizer

    from stages.data.schemas import ROLLOUTS, write_table

    session.open(starting_step=round_index)
    started = time.perf_counter()
    batch = pull_batch(opts, round_index)
    seconds = time.perf_counter() - started
    rows = batch_rows(batch, round_index, num_generations, AutoTokenizer.from_pretrained(tokenizer_dir))
    write_table(pa.Table.from_pylist(rows), out_dir / "rollouts.parquet", ROLLOUTS, extra_ok=True)
    log.info("atropos: round %d: pulled a batch of %d sequences in %d groups from %s", round_index, len(rows),
             len(batch), opts.api_url)
    lengths = [len(r["completion_token_ids"]) for r in rows]
    versions = [r["policy_version"] for r in rows]
    missing = sum(math.isnan(x) for r in rows for x in r["sampling_logprobs"])
    return {
        "rows": len(rows), "prompts": len(batch),
        "completion_length_mean": sum(lengths) / len(lengths),
        "truncated_frac": sum(r["finish_reason"] == "length" for r in rows) / len(rows),
        "tokens": sum(lengths), "generate_s": seconds, "tokens_per_s": sum(lengths) / max(seconds, 1e-9),
        "policy_version": min(versions), "policy_version_max": max(versions),
        "staleness": round_index - min(versions),
        "sampling_logprobs_missing_frac": missing / max(sum(lengths), 1),
        "envs": sorted({r["env"] for r in rows}),
    }


def score(rollouts_path: Path, num_generations: int, scale_rewards: str, out_dir: Path) -> dict:
    """scored.parquet from the environments' scores: reward = the env's score (as rewards["atropos"]),
    advantages per group as the score stage's (score.scale_rewards)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from stages.data.schemas import SCORED, write_table
    from stages.scoring.advantages import group_advantages, reward_spread
    from stages.scoring.collapse import collapse_metrics

    table = pq.read_table(rollouts_path)
    rows = table.to_pylist()
    totals = torch.tensor([r["env_score"] for r in rows], dtype=torch.float64)
    advantages = group_advantages(totals, num_generations, scale_rewards)
    scored = (table.append_column("rewards", pa.array([[("atropos", r["env_score"])] for r in rows],
                                                      type=SCORED.field("rewards").type))
              .append_column("reward", pa.array(totals.tolist(), type=pa.float64()))
              .append_column("advantage", pa.array(advantages.tolist(), type=pa.float64()))
              .append_column("errors", pa.array([[] for _ in rows], type=SCORED.field("errors").type)))
    write_table(scored, out_dir / "scored.parquet", SCORED, extra_ok=True)
    answers = [r["answer"] for r in rows]
    return {**reward_spread(totals, num_generations),
            "rewards/atropos/mean": float(totals.mean()), "rewards/atropos/std": float(totals.std()),
            "score/errors": 0,
            **collapse_metrics([r["prompt_id"] for r in rows], [r["completion"] for r in rows],
                               answers if all(a is not None for a in answers) else None)}


# ---- the policy server --------------------------------------------------------------------------------

class PolicyServer:
    """What an Atropos environment calls to sample the current policy, as a vLLM server answers it: OpenAI's
    /v1/chat/completions (`server_type: openai`) and /v1/completions, and vLLM's native /generate
    (`server_type: vllm`: token-id prompts in, [{token_id: logprob}] per sampled token out). One of our
    rollout engines samples; requests that wait for the engine are sampled together in one call. OpenAI
    answers carry vLLM's `prompt_token_ids` and per choice `token_ids` (as with vLLM's `return_token_ids`),
    the sampled tokens' log-probs with `logprobs`, and `policy_version`: the optimize rounds behind the
    weights that sampled."""

    def __init__(self, url: str, engine, policy, token: str | None = None):
        """Serve on `url`'s host and port; with `token`, every route but /health answers 401 to a request
        without `Authorization: Bearer <token>`."""
        self.engine, self.policy = engine, policy
        self._tokenizer = None
        self._lock = threading.Lock()
        self._requests = 0
        self._pending: list[dict] = []  # requests waiting for the engine (see _generate)
        server = self
        parsed = urlparse(url)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: one line per request would flood the run's log
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _refused(self) -> bool:
                if authorized(self.headers.get("Authorization"), token):
                    return False
                self._reply(401, {"error": {"message": "missing or wrong bearer token (the environment's "
                                                       "--openai.api_key)"}})
                return True

            def do_GET(self):
                if self.path.rstrip("/") in ("/health", ""):
                    return self._reply(200, {"status": "ok"})
                if self._refused():
                    return None
                if self.path.rstrip("/") == "/v1/models":
                    return self._reply(200, {"object": "list", "data": [
                        {"id": MODEL_NAME, "object": "model", "owned_by": "posttrain",
                         "root": str(server.policy.model_dir), "policy_version": server.policy.version}]})
                self._reply(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                if self._refused():
                    return None
                routes = {"/v1/chat/completions": server.chat_completion, "/v1/completions": server.completion,
                          "/generate": server.generate}
                route = routes.get(self.path.rstrip("/"))
                if route is None:
                    return self._reply(404, {"error": {"message": f"no route {self.path}; this server has "
                                                                  f"{', '.join(routes)}"}})
                try:
                    request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    self._reply(200, route(request))
                except Exception as e:  # the environment sees why; the run goes on
                    log.warning("atropos policy server: %s: %s", type(e).__name__, e)
                    self._reply(400, {"error": {"message": f"{type(e).__name__}: {e}"}})

        self.httpd = ThreadingHTTPServer((parsed.hostname, parsed.port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="atropos-policy-server", daemon=True)
        self.thread.start()

    def _sample(self, prompt, request: dict) -> tuple[int, int, list[dict]]:
        """(request number, policy version, `n` completions of `prompt`) with the request's max_tokens (or
        max_completion_tokens, max_new_tokens), temperature and top_p."""
        n = int(request.get("n") or 1)
        with self._lock:
            self._requests += 1
            seed = self._requests
        max_tokens = request.get("max_tokens") or request.get("max_completion_tokens") or request.get("max_new_tokens")
        settings = (int(max_tokens or 16), float(request.get("temperature", 1.0) or 1.0),
                    float(request.get("top_p", 1.0) or 1.0))
        version, generated = self._generate([prompt] * n, settings, seed)
        return seed, version, generated

    def _token_prompt(self, prompt) -> dict:
        """vLLM's prompt forms: token ids ({"prompt_token_ids": [...]} or a list of ints) as they are, or a
        string, tokenized as vLLM's /v1/completions does (with the tokenizer's special tokens)."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return {"prompt_token_ids": prompt["prompt_token_ids"]}
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return {"prompt_token_ids": prompt}
        if isinstance(prompt, str) and prompt:
            return {"prompt_token_ids": self.tokenizer()(prompt)["input_ids"]}
        raise ValueError("prompt: expected a string, a list of token ids or {prompt_token_ids: [...]}, got "
                         f"{type(prompt).__name__}")

    def tokenizer(self):
        """The policy's tokenizer (loaded once), for text prompts."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.policy.base_dir)
        return self._tokenizer

    def generate(self, request: dict) -> dict:
        """vLLM's native /generate as atroposlib's VLLMServer calls it (`server_type: vllm`) and Atropos' example
        trainer's vllm_api_server answers it: per completion the sampled tokens as [{token_id: logprob}] entries,
        the finish reasons and texts, the prompt and its token ids. The request's other fields are vLLM's
        SamplingParams: one this server does not honour is an error naming it (GENERATE_FIELDS)."""
        unhonoured = sorted(k for k in request if k not in GENERATE_FIELDS)
        if unhonoured or request.get("stream") or (request.get("logprobs") or 0) > 0:
            named = unhonoured or ["stream" if request.get("stream") else "logprobs"]
            raise ValueError(f"{', '.join(named)}: not honoured by posttrain's policy server (/generate samples with "
                             "n, max_tokens, temperature and top_p, and returns the sampled token's log-prob: "
                             "logprobs 0, no stream); remove it from the environment's request")
        prompt = self._token_prompt(request.get("prompt"))
        seed, version, generated = self._sample(prompt, request)
        return {"text": [g["completion"] for g in generated],
                "prompt": request["prompt"] if isinstance(request["prompt"], str)
                else self.tokenizer().decode(prompt["prompt_token_ids"]),
                "logprobs": [[[{str(t): float(lp)}] for t, lp in zip(g["completion_token_ids"], g["sampling_logprobs"])]
                             for g in generated],
                "finish_reasons": [g["finish_reason"] for g in generated],
                "token_ids": [list(g["completion_token_ids"]) for g in generated],
                "prompt_token_ids": list(generated[0]["prompt_token_ids"]) if generated else [],
                "policy_version": version}

    def completion(self, request: dict) -> dict:
        """OpenAI's /v1/completions (a text or token-id prompt, no chat template), as vLLM answers it."""
        seed, version, generated = self._sample(self._token_prompt(request.get("prompt")), request)
        choices = []
        for i, gen in enumerate(generated):
            choice = {"index": i, "text": gen["completion"], "finish_reason": gen["finish_reason"],
                      "token_ids": list(gen["completion_token_ids"])}
            if request.get("logprobs") is not None:
                choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in gen["completion_token_ids"]],
                                      "token_logprobs": [float(lp) for lp in gen["sampling_logprobs"]],
                                      "top_logprobs": None, "text_offset": None}
            choices.append(choice)
        return self._response("text_completion", seed, version, generated, choices)

    def _response(self, kind: str, seed: int, version: int, generated: list[dict], choices: list[dict]) -> dict:
        prompt_ids = list(generated[0]["prompt_token_ids"]) if generated else []
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        return {"id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{seed}", "object": kind,
                "created": int(time.time()), "model": MODEL_NAME, "choices": choices, "prompt_token_ids": prompt_ids,
                "policy_version": version,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt_ids) + completion_tokens}}

    def chat_completion(self, request: dict) -> dict:
        messages = [{"role": m["role"], "content": m["content"]} for m in request["messages"]]
        seed, version, generated = self._sample(messages, request)
        choices = []
        for i, gen in enumerate(generated):
            choice = {"index": i, "message": {"role": "assistant", "content": gen["completion"]},
                      "finish_reason": gen["finish_reason"], "token_ids": list(gen["completion_token_ids"])}
            if request.get("logprobs"):
                choice["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": float(lp), "bytes": None,
                                                   "top_logprobs": []}
                                                  for t, lp in zip(gen["completion_token_ids"],
                                                                   gen["sampling_logprobs"])]}
            choices.append(choice)
        return self._response("chat.completion", seed, version, generated, choices)

    def _generate(self, prompts: list, settings: tuple, seed: int) -> tuple[int, list[dict]]:
        """(policy version, one result per prompt). Requests that arrive while the engine is busy wait
        together: the first to get the engine samples every waiting request with the same settings in
        one call (one batched generate instead of one per group)."""
        from stages.rollout.engines import Sampling, engine_lock

        job = {"prompts": prompts, "settings": settings, "done": threading.Event()}
        with self._lock:
            self._pending.append(job)
        with engine_lock(self.engine):
            if not job["done"].is_set():  # nobody took it along: sample it and those waiting like it
                with self._lock:
                    batch = [j for j in self._pending if j["settings"] == settings]
                    self._pending = [j for j in self._pending if j["settings"] != settings]
                    policy = self.policy
                max_new_tokens, temperature, top_p = settings
                try:
                    generated = self.engine.generate(policy, [p for j in batch for p in j["prompts"]],
                                                     Sampling(max_new_tokens, temperature, top_p, seed=seed))
                except Exception as e:
                    generated, error = None, e
                start = 0
                for j in batch:
                    if generated is None:
                        j["error"] = error
                    else:
                        j["result"] = (policy.version, generated[start : start + len(j["prompts"])])
                    start += len(j["prompts"])
                    j["done"].set()
        if "error" in job:
            raise job["error"]
        return job["result"]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class AtroposSession:
    """One run's link to Atropos, opened at the first batch a run actually pulls (a fully cached rerun needs
    no API): the API (started if allowed), the registration, the policy server."""

    def __init__(self, opts: AtroposOptions, make_engine, batch_size: int, num_steps: int, artifacts_dir: Path):
        self.opts, self.make_engine = opts, make_engine
        self.batch_size, self.num_steps, self.artifacts_dir = batch_size, num_steps, artifacts_dir
        self.policy = None
        self.server: PolicyServer | None = None
        self.api_process: subprocess.Popen | None = None

    def serve(self, policy) -> None:
        """Sample from `policy` from now on (the server starts at the first batch pulled)."""
        self.policy = policy
        if self.server is not None:
            self.server.policy = policy

    def open(self, starting_step: int) -> None:
        """Start what is missing and register; `starting_step`: the first round this run pulls."""
        if self.server is not None:
            return
        token = self.policy_server_token()  # before anything starts: a missing token stops the run here
        self.api_process = ensure_api(self.opts, self.artifacts_dir / "atropos")
        body = registration(self.opts, self.batch_size, self.num_steps, self.artifacts_dir / "atropos",
                            starting_step)
        register(self.opts, body)
        try:
            self.server = PolicyServer(self.opts.policy_url, self.make_engine(), self.policy, token)
        except OSError as e:
            raise AtroposError(f"rollout.atropos.policy_url: cannot serve the policy at {self.opts.policy_url} "
                               f"({e}); pick a free port") from e
        log.info("atropos: registered with %s (batch %d sequences); serving the policy at %s/v1",
                 self.opts.api_url, self.batch_size, self.opts.policy_url)

    def policy_server_token(self) -> str | None:
        """The bearer token the policy server requires ($policy_token_env); None on loopback without one.
        AtroposError when the variable is named but unset, or policy_url is off loopback without a token."""
        try:
            token = named_token(self.opts.policy_token_env, "rollout.atropos.policy_token_env")
            return server_token(urlparse(self.opts.policy_url).hostname, token, self.opts.policy_token_env or "",
                                "rollout.atropos.policy_url", "rollout.atropos.policy_token_env")
        except ValueError as e:
            raise AtroposError(str(e)) from e

    def close(self) -> None:
        """Stop the policy server, and the run-api this session started (a killed run leaves its run-api
        running: it is in its own session, so the resumed run finds it with the environments attached)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.api_process is not None:
            self.api_process.terminate()
            self.api_process.wait(timeout=30)
            self.api_process = None
