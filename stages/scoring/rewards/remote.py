"""Remote verifiers: a reward function that asks an HTTP verification service for each completion.

`score.reward_funcs: [remote:math]` with `score.remote_verifiers: {math: {url: http://host:8001}}` POSTs
every completion to `<url>/verify` in the request shape of NeMo Gym's resources servers
(nemo_gym/base_resources_server.py `BaseVerifyRequest`):

    {"responses_create_params": {"input": <the prompt's messages>},
     "response": <an OpenAI Responses API object whose output is the completion as an assistant message>,
     "completion_ids": [...], "answer": "5", ...}         # the row's other columns, top level, as NeMo
                                                          # Gym's dataset fields (mcqa's expected_answer)

and reads `reward` from the reply (`BaseVerifyResponse`; null: not applicable, as a local function's
None). A reply with `mask_sample: true` means the verifier itself failed on the sample (NeMo Gym: "the
environment or its infrastructure failed"); the sample then gets `reward_on_error`, with the reply's
`failure_reason` in the errors column. So NeMo Gym resources servers and `posttrain serve-rewards`
(flows/serve_rewards.py) both work as remote verifiers.

Requests run `max_concurrency` at a time. A request that times out, cannot connect, or gets a 5xx or
429 answer is retried `retries` times after `backoff_s`, 2 x backoff_s, ...; one that still fails comes
back as a `SampleError` for its sample alone (stages/scoring/reward_workers.py turns that into reward_on_error
and an `errors` entry such as "remote:math: HTTP 500 from http://host:8001/verify after 3 attempts").
With `batch: true` each call's completions go in one request to `<url>/verify_batch` (serve-rewards'
extension, not NeMo Gym's): fewer round trips, but a failed request fails all of its samples.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from stages.runtime.bearer import client_headers
from stages.runtime.keys import not_in_key
from stages.scoring.rewards.common import SampleError

REMOTE_PREFIX = "remote:"
"""`remote:<name>` in score.reward_funcs names the verifier `<name>` of score.remote_verifiers."""

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]+$")


class RemoteVerifierConfig(BaseModel):
    """One HTTP verification service (NeMo Gym resources-server `/verify`, or `posttrain serve-rewards`)."""

    model_config = ConfigDict(extra="forbid")

    url: str
    """Base URL of the service; requests go to `<url>/verify` (`<url>/verify_batch` with `batch`). For one
    function of a `posttrain serve-rewards` server: `http://host:port/<function>`, e.g. .../accuracy."""
    timeout_s: float = Field(15.0, gt=0)
    """Seconds one request may take (connect, send, each read); past it the request counts as failed and is
    retried. Keep timeout_s x (retries + 1) below score.reward_timeout_s, or the worker pool's timeout
    fires first and the batch is re-scored one sample at a time."""
    max_concurrency: int = Field(8, ge=1)
    """Requests in flight at once per reward call (per worker). Higher: more throughput from a service that
    scales, more load on it; total in flight is at most this x score.reward_num_workers."""
    retries: int = Field(2, ge=0)
    """Retries of a request that timed out, could not connect, or got HTTP 5xx/429. Other 4xx answers and
    malformed replies are not retried (asking again gets the same answer)."""
    backoff_s: float = Field(0.5, ge=0)
    """Wait before the first retry; doubled before each next one (0.5, 1, 2 s ...)."""
    batch: bool = False
    """Send each call's completions (score.reward_batch_size) in one request to `<url>/verify_batch`
    (posttrain serve-rewards only). Fewer round trips; a request that fails costs all its samples."""
    version: str | None = None
    """A label for what the service computes, e.g. its git commit. The score stage's key holds every option
    here, the URL included (token_env excepted), but not the service's code: change `version` when the
    service's scoring changes behind the same URL, or cached scores of the old service are reused."""
    token_env: str | None = not_in_key(None)
    """The environment variable that holds the service's bearer token (`posttrain serve-rewards --token`),
    sent as `Authorization: Bearer <token>`; unset: no header. Not in the key (who may call, not what)."""

    def worst_case_s(self) -> float:
        """Longest one request can take with its retries and backoff."""
        return self.timeout_s * (self.retries + 1) + self.backoff_s * (2 ** self.retries - 1)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not a URL like http://host:8001")
        return url.rstrip("/")


def check_remote_names(reward_funcs: list[str], verifiers: dict[str, RemoteVerifierConfig]) -> None:
    """Each `remote:<name>` names a verifier of score.remote_verifiers; raise with the closest name."""
    import difflib

    bad = [n for n in verifiers if not NAME_PATTERN.match(n)]
    if bad:
        raise ValueError(f"remote_verifiers: name {bad[0]!r} may only use letters, digits, '_' and '-'")
    for name in reward_funcs:
        if name.startswith(REMOTE_PREFIX) and name[len(REMOTE_PREFIX):] not in verifiers:
            wanted = name[len(REMOTE_PREFIX):]
            close = difflib.get_close_matches(wanted, list(verifiers), n=1, cutoff=0.5)
            hint = f"; did you mean '{REMOTE_PREFIX}{close[0]}'?" if close else ""
            defined = ", ".join(verifiers) or "none"
            raise ValueError(f"reward_funcs: {name!r} names no entry of score.remote_verifiers{hint} "
                             f"(defined: {defined})")


# ---- the NeMo Gym request and reply shapes ---------------------------------------------------------------

def verify_request(prompt, completion, columns: dict) -> dict:
    """NeMo Gym's BaseVerifyRequest for one completion: the prompt as `responses_create_params.input`, the
    completion as the output message of an OpenAI Responses API `response`, other columns top level."""
    text = completion if isinstance(completion, str) else "".join(
        m.get("content") or "" for m in completion if m.get("role") == "assistant")
    response = {
        "id": "resp_posttrain", "object": "response", "created_at": 0, "model": "posttrain",
        "output": [{"type": "message", "id": "msg_0", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
    }
    return {"responses_create_params": {"input": prompt}, "response": response, **columns}


def completion_from_response(response: dict) -> str:
    """The assistant text of a Responses API object (its output messages' output_text parts, joined)."""
    texts = []
    for item in response.get("output") or []:
        if item.get("type") == "message" and item.get("role", "assistant") == "assistant":
            content = item.get("content")
            if isinstance(content, str):
                texts.append(content)
            else:
                texts += [part.get("text") or "" for part in content or [] if part.get("type") == "output_text"]
    return "".join(texts)


def reward_from_reply(reply) -> float | None | SampleError:
    """A /verify reply's reward (None: not applicable), or SampleError when it reports a failure or has none."""
    if not isinstance(reply, dict) or "reward" not in reply:
        return SampleError(f"reply without a reward: {str(reply)[:120]}")
    if reply.get("mask_sample"):
        return SampleError(reply.get("failure_reason") or "the verifier failed on this sample (mask_sample)")
    reward = reply["reward"]
    if reward is not None and not isinstance(reward, (int, float)):
        return SampleError(f"reward {reward!r} is not a number")
    return None if reward is None else float(reward)


# ---- the client -------------------------------------------------------------------------------------------

class _Failed(Exception):
    """A request that failed; `retry` says whether asking again may help."""

    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.retry = retry


class RemoteVerifier:
    """Callable with TRL's reward signature that scores through `<url>/verify` (see the module docstring)."""

    def __init__(self, cfg: RemoteVerifierConfig):
        import httpx

        self.cfg = cfg
        self.auth = client_headers(cfg.token_env, f"remote verifier {cfg.url}")
        self.client = httpx.Client(timeout=cfg.timeout_s,
                                   limits=httpx.Limits(max_connections=cfg.max_concurrency,
                                                       max_keepalive_connections=cfg.max_concurrency))
        self.executor = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="remote-verifier")

    def __call__(self, prompts, completions, **columns) -> list:
        n = len(completions)
        bodies = [verify_request(prompts[i], completions[i], {k: v[i] for k, v in columns.items()})
                  for i in range(n)]
        if self.cfg.batch:
            return self._post_batch(bodies)
        return list(self.executor.map(self._post_one, bodies))

    def _post_one(self, body: dict):
        try:
            return reward_from_reply(self._post("/verify", body))
        except _Failed as e:
            return SampleError(str(e))

    def _post_batch(self, bodies: list[dict]) -> list:
        try:
            reply = self._post("/verify_batch", {"requests": bodies})
        except _Failed as e:
            return [SampleError(str(e)) for _ in bodies]
        replies = reply.get("responses") if isinstance(reply, dict) else None
        if not isinstance(replies, list) or len(replies) != len(bodies):
            return [SampleError(f"/verify_batch reply without {len(bodies)} responses") for _ in bodies]
        return [reward_from_reply(r) for r in replies]

    def _post(self, path: str, body: dict):
        """POST with retries and backoff; the decoded JSON reply, or _Failed saying why."""
        import httpx

        url = self.cfg.url + path
        content = json.dumps(body, default=str)  # Parquet values json cannot write (dates) as text
        attempts = self.cfg.retries + 1
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
            try:
                r = self.client.post(url, content=content, headers={"content-type": "application/json",
                                                                     **self.auth})
            except httpx.TimeoutException:
                error = _Failed(f"TimeoutError: no answer from {url} within {self.cfg.timeout_s:g} s", retry=True)
            except httpx.TransportError as e:  # refused, reset, server died mid-request
                error = _Failed(f"{type(e).__name__} from {url}: {e}", retry=True)
            else:
                if r.status_code == 200:
                    try:
                        return r.json()
                    except ValueError:
                        raise _Failed(f"reply from {url} is not JSON: {r.text[:120]!r}", retry=False) from None
                error = _Failed(f"HTTP {r.status_code} from {url}: {r.text[:160]!r}",
                                retry=r.status_code >= 500 or r.status_code == 429)
            if not error.retry:
                raise error
        plural = "s" if attempts > 1 else ""
        raise _Failed(f"{error} (after {attempts} attempt{plural})", retry=False)


_VERIFIERS: dict[str, RemoteVerifier] = {}
_VERIFIERS_LOCK = threading.Lock()


def remote_verifier(cfg: RemoteVerifierConfig) -> Callable:
    """The process's client for this verifier (kept, so connections are reused across calls)."""
    key = cfg.model_dump_json()
    with _VERIFIERS_LOCK:
        if key not in _VERIFIERS:
            _VERIFIERS[key] = RemoteVerifier(cfg)
        return _VERIFIERS[key]


def remote_source(cfg: RemoteVerifierConfig) -> str:
    """What a worker resolves the verifier from (stages/scoring/reward_workers.py `resolve_reward`)."""
    return REMOTE_PREFIX + cfg.model_dump_json()


def verifier_from_source(source: str) -> RemoteVerifierConfig:
    """The config of a `remote:{json}` source (the inverse of remote_source)."""
    return RemoteVerifierConfig.model_validate_json(source[len(REMOTE_PREFIX):])
