"""`posttrain serve-rewards CONFIG [--host 127.0.0.1] [--port 8001] [--max-request-mb 16]`: a config's
score.reward_funcs as an HTTP verification service, so scoring can run on another machine (`remote:<name>` in a
run's config).

Routes (NeMo Gym resources-server shape, nemo_gym/base_resources_server.py):
  POST /verify                   BaseVerifyRequest -> the scores of BaseVerifyResponse: `reward` is the weighted
                                 sum of every function (score.reward_weights), `rewards` each one's value,
                                 `mask_sample`, `failure_reason`; the request is not echoed back (NeMo Gym's
                                 response repeats it: a 50 MB request would come back as a 50 MB reply)
  POST /<function>/verify        one function's value as `reward` (e.g. /accuracy/verify)
  POST /verify_batch, /<function>/verify_batch   {"requests": [...]} -> {"responses": [...]} (our extension)
  GET  /health                   the functions served

The functions run in the same reward worker pool as the score stage (stages/scoring/reward_workers.py), with the
config's reward_num_workers, reward_timeout_s and reward_batch_size: a function that raises, hangs or kills
its worker on a sample costs only that sample, whose reply says so with NeMo Gym's `mask_sample: true` and
`failure_reason` ("accuracy: TimeoutError after 60 s"); its `reward` then holds score.reward_on_error. The
client (stages/scoring/rewards/remote.py) gives such a sample its own reward_on_error and errors entry.
Requests that arrive while the pool is busy are scored together in its next call (batched per function).

What is refused: a body over --max-request-mb answers 413 (judged by Content-Length before the body is read;
a body without one is read up to the limit); a request that is not a BaseVerifyRequest (e.g. `response.output`
not a list of output items) answers 422 with one line naming the field, and costs no other request anything.

Who may call: with a token (`--token`, or the POSTTRAIN_REWARDS_TOKEN environment variable) every route but
/health answers 401 to a request without `Authorization: Bearer <token>` and scores nothing; a run's
`remote_verifiers.<name>.token_env` names the variable its workers send. Without a token it listens on
loopback only: another --host without one is refused (stages/runtime/bearer.py).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from contextlib import asynccontextmanager
from typing import Any

from stages.runtime.bearer import authorized, server_token
from stages.scoring.reward_pools import shared_pool
from stages.scoring.reward_workers import REWARD_MODEL_PREFIX, RewardFunctionError, is_model_name
from stages.scoring.rewards.remote import REMOTE_PREFIX, completion_from_response, remote_source

log = logging.getLogger(__name__)

MAX_SAMPLES_PER_CALL = 4096
"""Most queued samples scored in one call of the pool."""

MAX_REQUEST_MB = 16.0
"""Default --max-request-mb: the largest request body (MiB) accepted. A run's batched call (`batch: true`, 64
completions of a few thousand tokens each, their prompts and columns) is a few MB; 20 MB is not a request."""

REQUEST_KEYS = ("responses_create_params", "response")
"""Keys of a verify request that are not columns for the reward functions."""

RESERVED_COLUMNS = ("prompts", "completions")
"""What the reward functions get as prompts and completions: not accepted as a request's own columns."""


class BadRequest(ValueError):
    """A verify request that is not a BaseVerifyRequest; the message names the field (answered 422)."""


def completion_text(response) -> str:
    """The assistant text of a request's `response` (a Responses API object; remote.py
    `completion_from_response`), or BadRequest naming the field that does not have the expected shape."""
    if not isinstance(response, dict):
        raise BadRequest("response: expected an object (an OpenAI Responses API response)")
    output = response.get("output")
    if output is not None and not isinstance(output, list):
        raise BadRequest(f"response.output: expected a list of output items, got {type(output).__name__}")
    for i, item in enumerate(output or []):
        if not isinstance(item, dict):
            raise BadRequest(f"response.output[{i}]: expected an object, got {type(item).__name__}")
        content = item.get("content")
        if item.get("type") != "message" or isinstance(content, (str, type(None))):
            continue
        if not isinstance(content, list):
            raise BadRequest(f"response.output[{i}].content: expected a string or a list of parts, "
                             f"got {type(content).__name__}")
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise BadRequest(f"response.output[{i}].content[{j}]: expected an object, got {type(part).__name__}")
            if part.get("type") == "output_text" and not isinstance(part.get("text") or "", str):
                raise BadRequest(f"response.output[{i}].content[{j}].text: expected a string")
    return completion_from_response(response)


def parse_request(body, where: str = "") -> dict:
    """The sample a verify request scores ({prompts, completions, columns...}); BadRequest naming the field
    (`where`: its place in a batch, e.g. "requests[3].")."""
    if not isinstance(body, dict):
        raise BadRequest(f"{where or 'body'}: a verify request is a JSON object with `responses_create_params` "
                         "and `response` (NeMo Gym BaseVerifyRequest)")
    params = body.get("responses_create_params")
    if not isinstance(params, dict):
        raise BadRequest(f"{where}responses_create_params: expected an object (with the prompt as `input`)")
    try:
        text = completion_text(body.get("response"))
    except BadRequest as e:
        raise BadRequest(f"{where}{e}") from None
    columns = {k: v for k, v in body.items() if k not in REQUEST_KEYS and not k.startswith("_")}
    for key in RESERVED_COLUMNS:
        if key in columns:
            raise BadRequest(f"{where}{key}: reserved (the prompt goes in responses_create_params.input, the "
                             "completion in response)")
    return {"prompts": params.get("input"), "completions": [{"role": "assistant", "content": text}], **columns}


def route_name(name: str) -> str:
    """The path segment of a function: its reward_funcs name; a reward model (`reward_model:<folder>`, a hub id or a
    folder path) -> reward_model."""
    return "reward_model" if name.startswith(REWARD_MODEL_PREFIX) or is_model_name(name) else name


class Scorer:
    """Queues verify requests and scores them in batches with the reward worker pool, off the event loop."""

    def __init__(self, score_cfg):
        if "reward_model" in score_cfg.reward_funcs:
            raise ValueError("score.reward_funcs: 'reward_model' means a pipeline run's own reward model; "
                             "to serve a trained one, name its folder: reward_model:<folder>")
        self.cfg = score_cfg
        self.names = list(score_cfg.reward_funcs)
        self.weights = dict(zip(self.names, score_cfg.reward_weights or [1.0] * len(self.names)))
        self.routes = {route_name(n): n for n in self.names}
        self.queue: asyncio.Queue | None = None
        self.sources = {}
        for name in self.names:  # a served config may itself use remote verifiers (a proxy)
            if name.startswith(REMOTE_PREFIX):
                self.sources[name] = remote_source(score_cfg.remote_verifiers[name[len(REMOTE_PREFIX):]])

    def pool(self):
        """The worker pool (started on first use, replaced if broken)."""
        return shared_pool(self.names, self.cfg.reward_num_workers, self.cfg.reward_timeout_s, self.sources,
                           memory_mb=self.cfg.reward_memory_mb)

    async def verify(self, sample: dict, names: list[str]) -> dict:
        """Score one parsed verify request (`parse_request`) with `names`; the reply's scores as a dict."""
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((sample, names, future))
        return await future

    async def run(self) -> None:
        """Take whatever is queued, score it in one pool call in a thread, answer each request; repeat."""
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty() and len(items) < MAX_SAMPLES_PER_CALL:
                items.append(self.queue.get_nowait())
            try:
                replies = await asyncio.to_thread(self.score, [(body, names) for body, names, _ in items])
            except Exception as e:  # a broken function (RewardFunctionError)
                for _, _, future in items:
                    if not future.done():
                        future.set_exception(e)
                continue
            for (_, _, future), reply in zip(items, replies):
                if not future.done():  # (the client may have gone)
                    future.set_result(reply)

    def score(self, requests: list[tuple[dict, list[str]]]) -> list[dict]:
        """Score parsed requests (`parse_request`) in one call of the pool: a job per (function, columns) group
        and chunk, the chunks shared out among the workers."""
        samples = [sample for sample, _ in requests]
        groups: dict[tuple, list[int]] = {}  # same function and same columns: one batch
        for i, (_, names) in enumerate(requests):
            for name in names:
                groups.setdefault((name, tuple(sorted(samples[i]))), []).append(i)
        jobs, where = [], []
        for (name, keys), members in groups.items():
            # even one request's batch is shared out, in 4 chunks per worker so that none waits long for
            # the slowest at the end of the call; at most reward_batch_size samples per chunk
            size = min(self.cfg.reward_batch_size, -(-len(members) // (4 * self.cfg.reward_num_workers)))
            for start in range(0, len(members), size):
                chunk = members[start : start + size]
                jobs.append((name, {k: [samples[i][k] for i in chunk] for k in keys}, [f"request {i}" for i in chunk]))
                where.append(chunk)
        values: list[dict] = [{} for _ in requests]
        errors: list[dict] = [{} for _ in requests]
        for (name, _, _), chunk, (got, failed) in zip(jobs, where, self.pool().score(jobs)):
            for position, i in enumerate(chunk):
                if position in failed:
                    errors[i][name] = failed[position]
                    values[i][name] = self.cfg.reward_on_error
                else:
                    values[i][name] = got[position]
        replies = []
        for (_, names), value, error in zip(requests, values, errors):
            if len(names) == 1:
                reward = value[names[0]]
            else:  # as the score stage: weighted sum, a None counting 0 (TRL's nansum)
                reward = sum(self.weights[n] * value[n] for n in names if value[n] is not None)
            replies.append({"reward": reward, "rewards": {route_name(n): value[n] for n in names},
                            "mask_sample": bool(error),
                            "failure_reason": "; ".join(error[n] for n in names if n in error) or None})
        return replies


TOKEN_ENV = "POSTTRAIN_REWARDS_TOKEN"
"""Environment variable holding the server's bearer token when --token is not given."""


DISCARD_AT_MOST = 1 << 30
"""Bytes of a refused body read (and dropped) so that its client can read the 413; past it the connection closes."""


class RequestSizeLimit:
    """ASGI middleware: a request body over `max_bytes` answers 413 and reaches no route. Judged by Content-Length
    before anything is read; a body without one (chunked) is read up to the limit, then handed on whole."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await self.refuse(send, 400, "Content-Length is not a number")
            if int(length) > self.max_bytes:
                await self.discard_body(receive, int(length))
                return await self.refuse(send, 413, f"the request body ({int(length) / 2**20:.1f} MB) is over this "
                                                    f"server's limit of {self.max_bytes / 2**20:g} MB (--max-request-mb)")
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                if message.get("more_body"):
                    await self.discard_body(receive, DISCARD_AT_MOST)
                return await self.refuse(send, 413, f"the request body is over this server's limit of "
                                                    f"{self.max_bytes / 2**20:g} MB (--max-request-mb)")
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    @staticmethod
    async def discard_body(receive, length: int) -> None:
        """Read the rest of a refused body chunk by chunk, keeping none of it, when it is at most DISCARD_AT_MOST
        bytes: a client that sends its whole body before it reads the reply (urllib, requests) then gets the 413,
        not a connection reset half-way through its upload. A larger one is not read at all."""
        if length > DISCARD_AT_MOST:
            return
        while True:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                return

    @staticmethod
    async def refuse(send, status: int, detail: str) -> None:
        """Answer `status` with {"detail": ...} and close the connection."""
        import json

        content = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": content})


def create_app(score_cfg, token: str | None = None, max_request_mb: float = MAX_REQUEST_MB):
    """The FastAPI app serving score_cfg's reward functions; with `token`, only to callers that send it; request
    bodies up to `max_request_mb` MiB."""
    from fastapi import Body, FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    scorer = Scorer(score_cfg)

    @asynccontextmanager
    async def lifespan(app):
        scorer.queue = asyncio.Queue()
        await asyncio.to_thread(scorer.pool)  # spawn the workers before the first request
        task = asyncio.create_task(scorer.run())
        yield
        task.cancel()
        from stages.scoring.reward_pools import close_pools

        close_pools()

    app = FastAPI(title="posttrain reward functions", lifespan=lifespan)

    @app.middleware("http")
    async def bearer_token(request: Request, call_next):
        if request.url.path != "/health" and not authorized(request.headers.get("authorization"), token):
            return JSONResponse({"detail": "missing or wrong bearer token (Authorization: Bearer <token>)"},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    def functions(route: str | None) -> list[str]:
        if route is None:
            return scorer.names
        if route not in scorer.routes:
            raise HTTPException(404, f"no reward function {route!r} here (served: {', '.join(scorer.routes)})")
        return [scorer.routes[route]]

    @app.exception_handler(RequestValidationError)
    async def one_line(request, exc) -> JSONResponse:  # e.g. a body that is not JSON: FastAPI's list, in one line
        detail = "; ".join(f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"detail": detail}, status_code=422)

    async def answer(bodies: list, route: str | None, batch: bool = False) -> list[dict]:
        names = functions(route)
        try:  # every request of a batch is checked before any is scored
            samples = [parse_request(b, f"requests[{i}]." if batch else "") for i, b in enumerate(bodies)]
        except BadRequest as e:
            raise HTTPException(422, str(e)) from None
        try:
            return await asyncio.gather(*(scorer.verify(sample, names) for sample in samples))
        except RewardFunctionError as e:
            raise HTTPException(500, str(e)) from None

    def batch_requests(body) -> list:
        requests = body.get("requests") if isinstance(body, dict) else None
        if not isinstance(requests, list):
            raise HTTPException(422, "requests: expected a list of verify requests ({\"requests\": [...]})")
        return requests

    @app.get("/health")
    async def health() -> dict:
        return {"reward_funcs": list(scorer.routes)}

    @app.post("/verify")
    async def verify(body: Any = Body()) -> dict:
        return (await answer([body], None))[0]

    @app.post("/verify_batch")
    async def verify_batch(body: Any = Body()) -> dict:
        return {"responses": await answer(batch_requests(body), None, batch=True)}

    @app.post("/{route}/verify")
    async def verify_one(route: str, body: Any = Body()) -> dict:
        return (await answer([body], route))[0]

    @app.post("/{route}/verify_batch")
    async def verify_one_batch(route: str, body: Any = Body()) -> dict:
        return {"responses": await answer(batch_requests(body), route, batch=True)}

    app.add_middleware(RequestSizeLimit, max_bytes=int(max_request_mb * 2**20))
    return app


def add_arguments(p):
    p.add_argument("config", help="YAML config whose score section names the reward functions")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. score.reward_timeout_s=30")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only; any other "
                                                      "needs a token)")
    p.add_argument("--token", default=None, help=f"bearer token callers must send (default: ${TOKEN_ENV}; "
                                                 "required off loopback)")
    p.add_argument("--port", type=int, default=8001, help="port (default 8001)")
    p.add_argument("--max-request-mb", type=float, default=MAX_REQUEST_MB,
                   help=f"largest request body in MiB (default {MAX_REQUEST_MB:g}); a larger one answers 413 unread")
    return p


def serve_command(args) -> int:
    """Load the config and serve its reward functions until interrupted."""
    import uvicorn

    from flows.config import ConfigError, load_config

    try:
        token = server_token(args.host, args.token, TOKEN_ENV, "posttrain serve-rewards", "--token")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        if not args.max_request_mb > 0:
            raise ValueError(f"--max-request-mb must be positive, not {args.max_request_mb:g}")
        app = create_app(cfg.score, token, args.max_request_mb)
    except (ConfigError, ValueError) as e:
        print(f"config error:\n{e}", file=sys.stderr)
        return 2
    routes = ", ".join(f"/{route_name(n)}/verify" for n in cfg.score.reward_funcs)
    print(f"serving reward_funcs {cfg.score.reward_funcs} on http://{args.host}:{args.port}/verify "
          f"(and {routes}); {cfg.score.reward_num_workers} workers, timeout {cfg.score.reward_timeout_s:g} s, "
          f"requests up to {args.max_request_mb:g} MB",
          flush=True)
    if token:
        print("callers must send Authorization: Bearer <token>", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
