"""A rollout_func that plays multi-turn episodes on a NeMo Gym-style `/run` server (episode_server.py).

    EPISODE_SERVER_URL=http://127.0.0.1:8002 PYTHONPATH=configs/examples/multiturn \\
        posttrain run CONFIG rollout.rollout_func=multiturn_rollout.run_episodes

For the round it serves the policy as an OpenAI Responses API endpoint (`POST /v1/responses`, loopback,
a free port) backed by the rollout engine, then POSTs one `/run` per prompt, all at once; the server
drives each episode and calls the endpoint for every model turn. Calls that arrive together are
generated in one batch. Each model turn's output message carries NeMo Gym's training fields
(`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`), so the rollout row is the
episode's last model turn: its prompt tokens are the whole conversation before it (earlier turns and
the environment's feedback), its completion tokens and log-probs exactly what the engine sampled.
The episode's `/run` reward is not carried over (a rollout row has no column for it): score the rows
with the server's `/verify` as a remote verifier (`score.reward_funcs: [remote:episode]`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

DEFAULT_SERVER_URL = "http://127.0.0.1:8002"
"""Where the episode server listens unless EPISODE_SERVER_URL says otherwise."""
RUN_TIMEOUT_S = 600.0


class PolicyEndpoint:
    """`POST /v1/responses` from the rollout engine, in a uvicorn thread while the `with` block runs (the
    rollout stage holds the engine's lock meanwhile, and only this endpoint's one batching task uses it)."""

    def __init__(self, engine, policy, sampling):
        self.engine, self.policy, self.sampling = engine, policy, sampling
        self.calls = 0

    def app(self):
        from fastapi import Body, FastAPI

        queue: asyncio.Queue = asyncio.Queue()

        async def batches():  # whatever is queued goes to the engine in one generate call
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                sampling = dataclasses.replace(self.sampling, seed=self.sampling.seed + self.calls)
                self.calls += 1
                try:
                    outs = await asyncio.to_thread(self.engine.generate, self.policy, [m for m, _ in items], sampling)
                except Exception as e:
                    outs = [e] * len(items)
                for (_, future), out in zip(items, outs):
                    future.set_exception(out) if isinstance(out, Exception) else future.set_result(out)

        @contextlib.asynccontextmanager
        async def lifespan(app):
            task = asyncio.create_task(batches())
            yield
            task.cancel()

        app = FastAPI(lifespan=lifespan)

        @app.post("/v1/responses")
        async def responses(body: dict = Body()) -> dict:
            messages = [{"role": m["role"], "content": m["content"]} for m in body["input"]]
            future = asyncio.get_running_loop().create_future()
            await queue.put((messages, future))
            out = await future
            message = {"type": "message", "id": "msg_0", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": out["completion"], "annotations": []}],
                       "prompt_token_ids": out["prompt_token_ids"], "generation_token_ids": out["completion_token_ids"],
                       "generation_log_probs": out["sampling_logprobs"], "finish_reason": out["finish_reason"]}
            return {"id": "resp_policy", "object": "response", "created_at": 0, "model": "policy",
                    "output": [message], "parallel_tool_calls": False, "tool_choice": "auto", "tools": []}

        return app

    def __enter__(self) -> str:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # log_config None: leave this process's logging alone (reconfiguring it would flush Prefect's API
        # log handler from inside a task run, which deadlocks on the logging lock)
        self.server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=port, log_config=None))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the policy endpoint did not start")
            threading.Event().wait(0.05)
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def last_model_turn(reply: dict) -> dict:
    """The rollout row's generation fields from a /run reply: its last assistant message with token ids."""
    turns = [o for o in reply["response"]["output"] if o.get("role") == "assistant" and "generation_token_ids" in o]
    if not turns:
        raise ValueError(f"/run reply without a model turn: {str(reply)[:200]}")
    last = turns[-1]
    return {"prompt_token_ids": last["prompt_token_ids"], "completion_token_ids": last["generation_token_ids"],
            "sampling_logprobs": last["generation_log_probs"],
            "completion": "".join(part["text"] for part in last["content"]), "finish_reason": last["finish_reason"]}


def run_episodes(prompts, engine, policy, sampling, tokenizer) -> list[dict]:
    """One episode per prompt on EPISODE_SERVER_URL's /run; one rollout row per episode (its last model turn)."""
    server_url = os.environ.get("EPISODE_SERVER_URL", DEFAULT_SERVER_URL).rstrip("/")
    token = os.environ.get("EPISODE_SERVER_TOKEN")  # the server's bearer token, when it requires one
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with PolicyEndpoint(engine, policy, sampling) as model_url, \
            httpx.Client(timeout=RUN_TIMEOUT_S, headers=headers) as client:
        def episode(prompt) -> dict:
            r = client.post(f"{server_url}/run",
                            json={"responses_create_params": {"input": prompt}, "model_url": model_url})
            r.raise_for_status()
            return r.json()

        with ThreadPoolExecutor(max(1, min(64, len(prompts)))) as pool:
            replies = list(pool.map(episode, prompts))
    return [last_model_turn(reply) for reply in replies]
