"""A small multi-turn environment server in NeMo Gym's agent-server shape: POST /run plays one episode.

    python -m uvicorn --app-dir configs/examples/multiturn episode_server:app --port 8002

/run takes NeMo Gym's BaseRunRequest ({"responses_create_params": {"input": [messages]}}) plus `model_url`,
the OpenAI Responses API endpoint of the policy (`<model_url>/v1/responses`, which
multiturn_rollout.py serves from the rollout engine). The episode: the model answers; a wrong answer
gets a user turn back ("That is not it. ...") and another try, up to MAX_TURNS model turns. The reply
is NeMo Gym's BaseVerifyResponse: the request, `response` (every turn as output items, the model's
with the token ids and log-probs it sent), `reward` (1.0 if the last answer is right) and `turns`.
POST /verify grades a completion the same way, so the score stage can use this server as a remote
verifier (`remote:episode`).

The task is read from the question, as a rollout_func sees only the prompts: "Which is the largest of
3, 8, 5?" (the demo data) or "say 7" (the tests' tiny policy).

Who may call: with EPISODE_SERVER_TOKEN set, /run and /verify answer 401 to a request without
`Authorization: Bearer <token>` (multiturn_rollout.py sends the same variable's value; a remote verifier sets
`token_env: EPISODE_SERVER_TOKEN`). Serve it off loopback only with a token.
"""

from __future__ import annotations

import re

import os

import httpx
from fastapi import Body, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from stages.runtime.bearer import authorized

MAX_TURNS = 2
FEEDBACK = "That is not it. Answer again, as <answer>N</answer>."

app = FastAPI(title="multi-turn episode server")


@app.middleware("http")
async def bearer_token(request: Request, call_next):
    """With EPISODE_SERVER_TOKEN set, only callers that send it are served."""
    if not authorized(request.headers.get("authorization"), os.environ.get("EPISODE_SERVER_TOKEN") or None):
        return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401)
    return await call_next(request)


def solve(question: str) -> str:
    """The right answer of a question this environment knows."""
    numbers = re.findall(r"-?\d+", question)
    if "largest of" in question and numbers:
        return str(max(int(n) for n in numbers))
    if question.strip().startswith("say ") and numbers:
        return numbers[0]
    raise HTTPException(422, f"no task this environment knows in {question[:80]!r}")


def answer_of(text: str) -> str:
    """The text inside <answer>...</answer>, or the whole text, stripped."""
    found = re.search(r"<answer>(.*?)</answer>", text, re.S)
    return (found.group(1) if found else text).strip()


def question_of(messages: list[dict]) -> str:
    return next(m["content"] for m in messages if m.get("role") == "user")


def last_text(output: list[dict]) -> str:
    messages = [o for o in output if o.get("type") == "message" and o.get("role") == "assistant"]
    return "".join(part.get("text", "") for part in messages[-1]["content"]) if messages else ""


@app.post("/run")
async def run(body: dict = Body()) -> dict:
    params = body["responses_create_params"]
    expected = solve(question_of(params["input"]))
    output: list[dict] = []
    turns = 0
    async with httpx.AsyncClient(timeout=300) as client:
        while True:
            turns += 1
            conversation = params["input"] + [{"role": o["role"], "content": o["content"] if o["role"] == "user"
                                               else last_text([o])} for o in output]
            r = await client.post(f"{body['model_url']}/v1/responses", json={**params, "input": conversation})
            r.raise_for_status()
            output += r.json()["output"]
            if answer_of(last_text(output)) == expected or turns >= MAX_TURNS:
                break
            output.append({"type": "message", "role": "user", "content": FEEDBACK})
    reward = float(answer_of(last_text(output)) == expected)
    response = {"id": "resp_episode", "object": "response", "created_at": 0, "model": "policy", "output": output,
                "parallel_tool_calls": False, "tool_choice": "auto", "tools": []}
    return {**body, "response": response, "reward": reward, "turns": turns}


@app.post("/verify")
async def verify(body: dict = Body()) -> dict:
    expected = solve(question_of(body["responses_create_params"]["input"]))
    return {**body, "reward": float(answer_of(last_text(body["response"]["output"])) == expected)}


@app.get("/health")
async def health() -> dict:
    return {"ok": True}
