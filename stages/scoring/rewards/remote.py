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

NeMo Gym's own servers (started by `ng_run`) listen on ports ng_run picks at each start; its head server lists
them. With `head_url` (the head, http://127.0.0.1:11000 by default) instead of `url`, each request goes to the
`/verify` of the resources server named by `server` or by the row's `server_column`, looked up on the head once
per process and again when a server cannot be reached (ng_run restarted it elsewhere). `fields_column` names a
column of JSON text holding the dataset row's own fields (NeMo Gym rows: question, answer, metadata, ..., shaped
per task), which then go top level in the request in place of the row's columns, as NeMo Gym's rollout
collection sends them; axolotl's NeMo Gym plugin is this (flows/nemo_gym.py).
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.runtime.bearer import client_headers
from stages.runtime.keys import key_when_set, not_in_key
from stages.scoring.rewards.common import SampleError

REMOTE_PREFIX = "remote:"
"""`remote:<name>` in score.reward_funcs names the verifier `<name>` of score.remote_verifiers."""

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]+$")
HEAD_RETRY_S = 10.0
"""Seconds a NeMo Gym head that did not answer is taken as down before it is asked again."""


class RemoteVerifierConfig(BaseModel):
    """One HTTP verification service (NeMo Gym resources-server `/verify`, or `posttrain serve-rewards`)."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    """Base URL of the service; requests go to `<url>/verify` (`<url>/verify_batch` with `batch`). For one
    function of a `posttrain serve-rewards` server: `http://host:port/<function>`, e.g. .../accuracy. Unset:
    head_url finds the service."""
    head_url: str | None = key_when_set(None)
    """A NeMo Gym head server (what `ng_run` serves, http://127.0.0.1:11000 by default), instead of url: each
    request goes to the `/verify` of the resources server it lists under `server`, or under the row's
    `server_column`. The key holds this URL and the server names, not the ports ng_run picks at each start."""
    server: str | None = key_when_set(None)
    """head_url: the resources server (its name in the head's config, e.g. reasoning_gym) for every row."""
    server_column: str | None = key_when_set(None)
    """head_url: the column whose value names each row's resources server (several environments in one run)."""
    fields_column: str | None = key_when_set(None)
    """A column of JSON text holding an object whose fields go top level in the request, in place of the row's
    columns (NeMo Gym dataset rows keep their own fields so: question, answer, metadata, ..., shaped per task);
    its `responses_create_params`, if any, is sent with `input` set to the prompt."""
    response_model: str | None = key_when_set(None)
    """The `model` of the Responses API object sent as `response` (axolotl's `nemo_gym_model_name`); unset:
    posttrain."""
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

    @field_validator("url", "head_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not a URL like http://host:8001")
        return None if url is None else url.rstrip("/")

    @model_validator(mode="after")
    def _one_way_to_the_service(self):
        if (self.url is None) == (self.head_url is None):
            raise ValueError("set url (the service) or head_url (a NeMo Gym head server that lists it), one of them")
        routing = [f for f in ("server", "server_column") if getattr(self, f) is not None]
        if self.url is not None and routing:
            raise ValueError(f"{routing[0]} names a server of a NeMo Gym head: it goes with head_url, not url")
        if self.head_url is not None and len(routing) != 1:
            raise ValueError("head_url needs server (one resources server for every row) or server_column (the "
                             "column naming each row's), one of them")
        if self.head_url is not None and self.batch:
            raise ValueError("batch sends to /verify_batch, which NeMo Gym's servers do not have; leave it out")
        return self

    @property
    def where(self) -> str:
        """The service as errors name it: its URL, or the head and the server(s) it looks up there."""
        if self.url is not None:
            return self.url
        return f"{self.server or 'the server in column ' + repr(self.server_column)} on NeMo Gym head {self.head_url}"


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

def verify_request(prompt, completion, columns: dict, model: str = "posttrain") -> dict:
    """NeMo Gym's BaseVerifyRequest for one completion: the prompt as `responses_create_params.input`, the
    completion as the output message of an OpenAI Responses API `response` of `model`, other columns top level
    (a column's own `responses_create_params` keeps its other fields)."""
    text = completion if isinstance(completion, str) else "".join(
        m.get("content") or "" for m in completion if m.get("role") == "assistant")
    response = {
        "id": "resp_posttrain", "object": "response", "created_at": 0, "model": model,
        "output": [{"type": "message", "id": "msg_0", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
    }
    params = columns.get("responses_create_params")
    params = {**params, "input": prompt} if isinstance(params, dict) else {"input": prompt}
    return {**columns, "responses_create_params": params, "response": response}


def row_fields(columns: dict, fields_column: str | None) -> dict:
    """What goes top level in a row's request: its columns, or the object in the JSON text of `fields_column`."""
    if fields_column is None:
        return columns
    if fields_column not in columns:
        raise SampleError(f"the row has no column {fields_column!r} (fields_column)")
    try:
        fields = json.loads(columns[fields_column])
    except (TypeError, ValueError):
        raise SampleError(f"column {fields_column!r} is not JSON text: {str(columns[fields_column])[:80]!r}") from None
    if not isinstance(fields, dict):
        raise SampleError(f"column {fields_column!r} holds {type(fields).__name__}, not a JSON object")
    return fields


class HeadError(ValueError):
    """A NeMo Gym head server that does not answer, or answers what is not its config."""


def listed_servers(head_url: str, client=None) -> dict[str, str]:
    """{server name: base URL} of the resources servers the NeMo Gym head at head_url lists (`head_servers`), asked
    with `client` (default: the process's shared one, stages/runtime/http.py); HeadError saying what to do when it
    does not answer."""
    import httpx

    from stages.runtime import http

    url = f"{head_url}/global_config_dict_yaml"
    try:
        r = (client or http.client()).get(url, timeout=5.0)
        r.raise_for_status()
    except httpx.HTTPError as e:
        raise HeadError(f"no NeMo Gym head server answers at {url} ({type(e).__name__}: {e}); start NeMo Gym's "
                        "servers with ng_run, or fix the head's port") from None
    try:
        return head_servers(r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text)
    except Exception as e:  # not JSON, not YAML
        raise HeadError(f"the NeMo Gym head at {url} answered what is not its YAML config ({type(e).__name__}: "
                        f"{str(e)[:120]})") from None


def head_servers(config_text: str) -> dict[str, str]:
    """{server name: base URL} of the resources servers a NeMo Gym head's `/global_config_dict_yaml` lists (the
    head answers with its YAML as a YAML string); each by its top-level name and by its own name."""
    import yaml

    config = yaml.safe_load(config_text)
    if isinstance(config, str):
        config = yaml.safe_load(config)
    servers = {}
    for top, section in (config or {}).items() if isinstance(config, dict) else ():
        for name, server in ((section or {}).get("resources_servers") or {}).items() \
                if isinstance(section, dict) else ():
            if isinstance(server, dict) and server.get("host") and server.get("port"):
                url = f"http://{server['host']}:{server['port']}"
                servers.setdefault(top, url)
                servers.setdefault(name, url)
    return servers


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
        self.auth = client_headers(cfg.token_env, f"remote verifier {cfg.where}")
        self.client = httpx.Client(timeout=cfg.timeout_s,
                                   limits=httpx.Limits(max_connections=cfg.max_concurrency,
                                                       max_keepalive_connections=cfg.max_concurrency))
        self.executor = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="remote-verifier")
        self.servers: dict[str, str] | None = None  # head_url: the resources servers the head listed
        self.servers_lock = threading.Lock()
        self.head_failed: tuple[float, _Failed] | None = None  # when the head last failed to answer, and how

    def __call__(self, prompts, completions, **columns) -> list:
        jobs = []
        for i in range(len(completions)):
            row = {k: v[i] for k, v in columns.items()}
            try:
                body = verify_request(prompts[i], completions[i], row_fields(row, self.cfg.fields_column),
                                      self.cfg.response_model or "posttrain")
                jobs.append((self._server_of(row), body))
            except SampleError as e:
                jobs.append((None, e))
        if self.cfg.batch:
            good = [i for i, (_, body) in enumerate(jobs) if not isinstance(body, SampleError)]
            replies = dict(zip(good, self._post_batch([jobs[i][1] for i in good]) if good else []))
            return [replies.get(i, body) for i, (_, body) in enumerate(jobs)]
        return list(self.executor.map(lambda job: self._post_one(*job), jobs))

    def _server_of(self, row: dict) -> str | None:
        """The resources server a row goes to under head_url (None: the verifier's url)."""
        if self.cfg.head_url is None:
            return None
        if self.cfg.server is not None:
            return self.cfg.server
        server = row.get(self.cfg.server_column)
        if not isinstance(server, str) or not server:
            raise SampleError(f"the row's {self.cfg.server_column!r} names no resources server ({server!r})")
        return server

    def _post_one(self, server: str | None, body):
        if isinstance(body, SampleError):
            return body
        try:
            return reward_from_reply(self._post("/verify", body, server))
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

    def _base_url(self, server: str | None, fresh: bool = False) -> str:
        """The verifier's url, or the URL the head lists for `server` (asked once, again when `fresh`)."""
        if server is None:
            return self.cfg.url
        with self.servers_lock:
            if self.servers is None or fresh or server not in self.servers:
                self.servers = self._ask_head()
            if server not in self.servers:
                listed = ", ".join(sorted(self.servers)) or "none"
                raise _Failed(f"NeMo Gym head {self.cfg.head_url} lists no resources server {server!r} (it lists: "
                              f"{listed}); start it with ng_run, or fix the server name", retry=False)
            return self.servers[server]

    def _ask_head(self) -> dict[str, str]:
        """The head's servers; a head that failed to answer in the last HEAD_RETRY_S fails again without being
        asked (a call's samples would otherwise each wait for it in turn)."""
        if self.head_failed is not None and time.monotonic() - self.head_failed[0] < HEAD_RETRY_S:
            raise self.head_failed[1]
        try:
            return listed_servers(self.cfg.head_url, self.client)
        except HeadError as e:
            self.head_failed = (time.monotonic(), _Failed(str(e), retry=False))
            raise self.head_failed[1] from None

    def _post(self, path: str, body: dict, server: str | None = None):
        """POST with retries and backoff; the decoded JSON reply, or _Failed saying why."""
        import httpx

        url = self._base_url(server) + path
        content = json.dumps(body, default=str)  # Parquet values json cannot write (dates) as text
        attempts, refused = self.cfg.retries + 1, False
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
                if server is not None and refused:  # ng_run may have started the server again on another port
                    url = self._base_url(server, fresh=True) + path
            refused = False
            try:
                r = self.client.post(url, content=content, headers={"content-type": "application/json",
                                                                     **self.auth})
            except httpx.TimeoutException:
                error = _Failed(f"TimeoutError: no answer from {url} within {self.cfg.timeout_s:g} s", retry=True)
            except httpx.TransportError as e:  # refused, reset, server died mid-request
                error = _Failed(f"{type(e).__name__} from {url}: {e}", retry=True)
                refused = isinstance(e, httpx.ConnectError)
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
