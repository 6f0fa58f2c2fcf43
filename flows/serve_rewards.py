"""`posttrain serve-rewards CONFIG [--host 127.0.0.1] [--port 8001]`: a config's score.reward_funcs as an
HTTP verification service, so scoring can run on another machine (`remote:<name>` in a run's config).

Routes (NeMo Gym resources-server shape, nemo_gym/base_resources_server.py):
  POST /verify                   BaseVerifyRequest -> BaseVerifyResponse; `reward` is the weighted sum of
                                 every function (score.reward_weights), `rewards` each one's value
  POST /<function>/verify        one function's value as `reward` (e.g. /accuracy/verify)
  POST /verify_batch, /<function>/verify_batch   {"requests": [...]} -> {"responses": [...]} (our extension)
  GET  /health                   the functions served

The functions run in the same reward worker pool as the score stage (stages/scoring/reward_workers.py), with the
config's reward_num_workers, reward_timeout_s and reward_batch_size: a function that raises, hangs or kills
its worker on a sample costs only that sample, whose reply says so with NeMo Gym's `mask_sample: true` and
`failure_reason` ("accuracy: TimeoutError after 60 s"); its `reward` then holds score.reward_on_error. The
client (stages/scoring/rewards/remote.py) gives such a sample its own reward_on_error and errors entry.
Requests that arrive while the pool is busy are scored together in its next call (batched per function).

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

from stages.runtime.bearer import authorized, server_token
from stages.scoring.reward_pools import shared_pool
from stages.scoring.reward_workers import REWARD_MODEL_PREFIX, RewardFunctionError
from stages.scoring.rewards.remote import REMOTE_PREFIX, completion_from_response, remote_source

log = logging.getLogger(__name__)

MAX_SAMPLES_PER_CALL = 4096
"""Most queued samples scored in one call of the pool."""

REQUEST_KEYS = ("responses_create_params", "response")
"""Keys of a verify request that are not columns for the reward functions."""


def route_name(name: str) -> str:
    """The path segment of a function: its reward_funcs name; `reward_model:<folder>` -> reward_model."""
    return "reward_model" if name.startswith(REWARD_MODEL_PREFIX) else name


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
        return shared_pool(self.names, self.cfg.reward_num_workers, self.cfg.reward_timeout_s, self.sources)

    async def verify(self, body: dict, names: list[str]) -> dict:
        """Score one verify request with `names`; the BaseVerifyResponse as a dict."""
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((body, names, future))
        return await future

    async def run(self) -> None:
        """Take whatever is queued, score it in one pool call in a thread, answer each request; repeat."""
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty() and len(items) < MAX_SAMPLES_PER_CALL:
                items.append(self.queue.get_nowait())
            try:
                replies = await asyncio.to_thread(self.score, [(body, names) for body, names, _ in items])
            except Exception as e:  # a broken function (RewardFunctionError), or a bad request batch
                for _, _, future in items:
                    if not future.done():
                        future.set_exception(e)
                continue
            for (_, _, future), reply in zip(items, replies):
                if not future.done():  # (the client may have gone)
                    future.set_result(reply)

    def score(self, requests: list[tuple[dict, list[str]]]) -> list[dict]:
        """Score requests in one call of the pool: a job per (function, columns) group and chunk, the
        chunks shared out among the workers."""
        samples = []
        for body, _ in requests:
            columns = {k: v for k, v in body.items() if k not in REQUEST_KEYS and not k.startswith("_")}
            samples.append({
                "prompts": body["responses_create_params"].get("input"),
                "completions": [{"role": "assistant", "content": completion_from_response(body["response"])}],
                **columns,
            })
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
        for (body, names), value, error in zip(requests, values, errors):
            if len(names) == 1:
                reward = value[names[0]]
            else:  # as the score stage: weighted sum, a None counting 0 (TRL's nansum)
                reward = sum(self.weights[n] * value[n] for n in names if value[n] is not None)
            replies.append({**body, "reward": reward, "rewards": {route_name(n): value[n] for n in names},
                            "mask_sample": bool(error),
                            "failure_reason": "; ".join(error[n] for n in names if n in error) or None})
        return replies


TOKEN_ENV = "POSTTRAIN_REWARDS_TOKEN"
"""Environment variable holding the server's bearer token when --token is not given."""


def create_app(score_cfg, token: str | None = None):
    """The FastAPI app serving score_cfg's reward functions; with `token`, only to callers that send it."""
    from fastapi import Body, FastAPI, HTTPException, Request
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

    def check(body) -> dict:
        if not isinstance(body, dict) or not isinstance(body.get("responses_create_params"), dict) \
                or not isinstance(body.get("response"), dict):
            raise HTTPException(422, "a verify request is a JSON object with `responses_create_params` "
                                     "and `response` (NeMo Gym BaseVerifyRequest)")
        return body

    async def answer(bodies: list[dict], route: str | None) -> list[dict]:
        names = functions(route)
        try:
            return await asyncio.gather(*(scorer.verify(check(b), names) for b in bodies))
        except RewardFunctionError as e:
            raise HTTPException(500, str(e)) from None

    @app.get("/health")
    async def health() -> dict:
        return {"reward_funcs": list(scorer.routes)}

    @app.post("/verify")
    async def verify(body: dict = Body()) -> dict:
        return (await answer([body], None))[0]

    @app.post("/verify_batch")
    async def verify_batch(body: dict = Body()) -> dict:
        return {"responses": await answer(body.get("requests") or [], None)}

    @app.post("/{route}/verify")
    async def verify_one(route: str, body: dict = Body()) -> dict:
        return (await answer([body], route))[0]

    @app.post("/{route}/verify_batch")
    async def verify_one_batch(route: str, body: dict = Body()) -> dict:
        return {"responses": await answer(body.get("requests") or [], route)}

    return app


def add_arguments(p):
    p.add_argument("config", help="YAML config whose score section names the reward functions")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. score.reward_timeout_s=30")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only; any other "
                                                      "needs a token)")
    p.add_argument("--token", default=None, help=f"bearer token callers must send (default: ${TOKEN_ENV}; "
                                                 "required off loopback)")
    p.add_argument("--port", type=int, default=8001, help="port (default 8001)")
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
        app = create_app(cfg.score, token)
    except (ConfigError, ValueError) as e:
        print(f"config error:\n{e}", file=sys.stderr)
        return 2
    routes = ", ".join(f"/{route_name(n)}/verify" for n in cfg.score.reward_funcs)
    print(f"serving reward_funcs {cfg.score.reward_funcs} on http://{args.host}:{args.port}/verify "
          f"(and {routes}); {cfg.score.reward_num_workers} workers, timeout {cfg.score.reward_timeout_s:g} s",
          flush=True)
    if token:
        print("callers must send Authorization: Bearer <token>", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
