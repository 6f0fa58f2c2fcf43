"""A NeMo Gym-shaped /verify service that misbehaves on purpose, for tests/test_remote_verifier.py.

Run: `python -m uvicorn --app-dir tests flaky_verifier:app --port N`. The request's `prompt_id` column picks
the behaviour: one containing "hang" is never answered, "error" gets HTTP 500, "die" kills this server
(SIGKILL, mid-request); others get the built-in accuracy reward of the completion, as the in-process one.
"""

import asyncio
import os
import signal
import time

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse

from stages.scoring.rewards import accuracy_reward
from stages.scoring.rewards.remote import completion_from_response

app = FastAPI()


@app.post("/verify")
async def verify(body: dict = Body()):
    prompt_id = body.get("prompt_id", "")
    if "hang" in prompt_id:
        await asyncio.sleep(3600)
    if "error" in prompt_id:
        return JSONResponse({"detail": "verifier crashed"}, status_code=500)
    if "die" in prompt_id:
        os.kill(os.getpid(), signal.SIGKILL)
    text = completion_from_response(body["response"])
    [reward] = accuracy_reward([body["responses_create_params"]["input"]],
                               [[{"role": "assistant", "content": text}]], answer=[body["answer"]])
    return {**body, "reward": reward}


def hangs_on_hang(completions, prompt_id, **kwargs):
    """A reward function for `posttrain serve-rewards`: hangs on prompts whose id contains "hang", else 1.0."""
    if any("hang" in p for p in prompt_id):
        time.sleep(3600)
    return [1.0] * len(completions)


def refuses_long(completions, **kwargs):
    """Fails single samples without raising: a SampleError for completions over 10 characters, else 1.0."""
    from stages.scoring.rewards import completion_text
    from stages.scoring.rewards.common import SampleError

    return [SampleError(f"{len(completion_text(c))} characters is too long") if len(completion_text(c)) > 10
            else 1.0 for c in completions]


def logs_calls(completions, **kwargs):
    """1.0 per completion; appends one line per call to $CALLS_LOG (a test reads whether it was called)."""
    import os

    with open(os.environ["CALLS_LOG"], "a") as log:
        log.write(f"{len(completions)}\n")
    return [1.0] * len(completions)
