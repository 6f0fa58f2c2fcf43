"""Remote verifiers (stages/scoring/rewards/remote.py) against real servers: `posttrain serve-rewards` in a uvicorn
subprocess on a free loopback port, and a NeMo Gym-shaped service that hangs, fails or dies on purpose
(tests/flaky_verifier.py)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster import free_port
from flows.cli import main
from flows.config import ConfigError, load_config
from stages.data.schemas import ROLLOUTS
from stages.runtime.http import client
from stages.scoring import reward_pools, score
from stages.scoring.rewards.common import SampleError
from stages.scoring.rewards.remote import RemoteVerifier, RemoteVerifierConfig, verify_request
from stages.scoring.score import ScoreConfig

ROOT = Path(__file__).resolve().parent.parent
NUM_GENERATIONS = 4


@pytest.fixture(autouse=True)
def close_pools():
    reward_pools.close_pools()  # an earlier module's runs keep theirs for this process
    yield
    reward_pools.close_pools()
    assert mp.active_children() == []


def write_rollouts(path: Path, num_prompts: int = 8, prompt_ids: list[str] | None = None) -> Path:
    """A rollouts table of arithmetic prompts with right, wrong, unformatted and equivalent-form answers."""
    rng = random.Random(0)
    rows = []
    for p in range(num_prompts):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        pid = prompt_ids[p] if prompt_ids else f"train-{p}"
        kinds = [f"<answer>{a + b}</answer>", f"<answer>{a + b + 1}</answer>", f"{a + b}",
                 f"<answer>{(a + b) * 2}/2</answer> done"]
        for g, completion in enumerate(kinds[:NUM_GENERATIONS]):
            rows.append({
                "rollout_id": f"r0-{pid}-g{g}", "prompt_id": pid, "group_index": g,
                "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "completion": completion,
                "prompt_token_ids": [1, 2, 3], "completion_token_ids": list(range(len(completion))),
                "sampling_logprobs": [-0.5] * len(completion), "policy_version": 0, "engine": "hf",
                "finish_reason": "stop", "answer": str(a + b),
            })
    schema = pa.schema(list(ROLLOUTS) + [pa.field("answer", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def start_server(argv: list[str], url: str, env: dict | None = None, timeout_s: float = 120.0) -> subprocess.Popen:
    """Start a server subprocess and wait until GET <url>/health (or any HTTP answer) comes back."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
           "OMP_WAIT_POLICY": "PASSIVE", **(env or {})}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            client().get(f"{url}/health", timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not answer on {url} within {timeout_s} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`posttrain serve-rewards` on a config with accuracy + format and a function that hangs on some samples."""
    config = tmp_path_factory.mktemp("serve") / "rewards.yaml"
    config.write_text("score:\n  reward_funcs: [accuracy, format, flaky_verifier.hangs_on_hang]\n"
                      "  reward_num_workers: 2\n  reward_timeout_s: 3\n  reward_on_error: -5.0\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server([sys.executable, "-m", "flows.cli", "serve-rewards", str(config), "--port", str(port)], url)
    yield url
    stop(proc)
    output = proc.stdout.read()
    assert proc.returncode in (0, -signal.SIGTERM), output  # uvicorn re-raises the SIGTERM it handled
    assert "Traceback" not in output, output  # bad requests (test_serve_rewards_refuses_...) print none


def remote_config(url: str, routes: dict[str, str], **options) -> ScoreConfig:
    """remote:<name> for each {name: the served function's route}."""
    return ScoreConfig(reward_funcs=[f"remote:{n}" for n in routes], reward_num_workers=2, reward_on_error=-1.0,
                       max_error_rate=1.0,  # samples fail on purpose
                       remote_verifiers={n: {"url": f"{url}/{route}", **options} for n, route in routes.items()})


def run_score(cfg: ScoreConfig, rollouts: Path, out: Path, num_generations: int = NUM_GENERATIONS) -> dict:
    out.mkdir(parents=True)
    return score.run(cfg, rollouts, num_generations, out)


def read_scored(out: Path) -> list[dict]:
    return pq.read_table(out / "scored.parquet").to_pylist()


@pytest.mark.parametrize("batch", [False, True], ids=["per-sample", "batch"])
def test_remote_scores_equal_in_process(tmp_path, served, batch):
    rollouts = write_rollouts(tmp_path / "rollouts.parquet")
    local_metrics = run_score(ScoreConfig(reward_funcs=["accuracy", "format"], reward_num_workers=2), rollouts,
                              tmp_path / "local")
    remote_metrics = run_score(remote_config(served, {"accuracy": "accuracy", "format": "format"}, batch=batch),
                               rollouts, tmp_path / "remote")
    local, remote = read_scored(tmp_path / "local"), read_scored(tmp_path / "remote")
    assert [[v for _, v in r["rewards"]] for r in remote] == [[v for _, v in r["rewards"]] for r in local]
    assert [r["reward"] for r in remote] == [r["reward"] for r in local]
    assert [r["advantage"] for r in remote] == [r["advantage"] for r in local]
    assert all(r["errors"] == [] for r in remote) and remote_metrics["score/errors"] == 0
    assert remote_metrics["rewards/remote:accuracy/mean"] == local_metrics["rewards/accuracy/mean"]
    # the rows have signal: right, wrong and equivalent-form answers, with and without the format
    assert {v for r in local for _, v in r["rewards"]} == {0.0, 1.0}
    assert remote[3]["rewards"] == [("remote:accuracy", 1.0), ("remote:format", 0.0)]  # "(2n)/2" is n


def test_whole_service_reward_is_the_weighted_sum(tmp_path, served):
    """`<url>/verify` answers the served config's weighted sum; null (None) rewards count 0 as in the stage."""
    rollouts = write_rollouts(tmp_path / "rollouts.parquet", num_prompts=2)
    cfg = ScoreConfig(reward_funcs=["remote:all"], reward_num_workers=1, remote_verifiers={"all": {"url": served}})
    run_score(cfg, rollouts, tmp_path / "remote")
    local = ScoreConfig(reward_funcs=["accuracy", "format", "flaky_verifier.hangs_on_hang"], reward_num_workers=1)
    run_score(local, rollouts, tmp_path / "local")
    assert ([r["reward"] for r in read_scored(tmp_path / "remote")]
            == [r["reward"] for r in read_scored(tmp_path / "local")])


@pytest.mark.slow  # a whole run or process kill: `make test`, not `make test-fast`
def test_function_hanging_inside_the_server_costs_only_its_samples(tmp_path, served):
    """The server's own worker pool times the function out (reward_timeout_s 3 there) on the samples of
    prompt `hang-1`; those, and only those, get the client's reward_on_error and the server's reason."""
    rollouts = write_rollouts(tmp_path / "rollouts.parquet", num_prompts=3, prompt_ids=["train-0", "hang-1", "train-2"])
    cfg = remote_config(served, {"hangs": "flaky_verifier.hangs_on_hang"}, timeout_s=50, retries=0)
    cfg = cfg.model_copy(update={"reward_timeout_s": 120.0})
    run_score(cfg, rollouts, tmp_path / "out")
    rows = read_scored(tmp_path / "out")
    for r in rows:
        value = r["rewards"][0][1]
        if r["prompt_id"] == "hang-1":
            assert value == -1.0
            assert len(r["errors"]) == 1 and "TimeoutError after 3 s" in r["errors"][0], r["errors"]
            assert r["errors"][0].startswith("remote:hangs: flaky_verifier.hangs_on_hang: ")
        else:
            assert value == 1.0 and r["errors"] == []


def test_serve_rewards_refuses_oversized_and_malformed_requests_and_does_not_echo(served):
    """A body over --max-request-mb (default 16) answers 413, with Content-Length or without (chunked); a
    malformed `response.output` answers 422 with one line naming the field (and no server traceback: `served`);
    a reply carries the scores only, not the request."""
    body = verify_request([{"role": "user", "content": "say 7"}], "<answer>7</answer>", {"answer": "7"})
    big = {**body, "padding": "x" * (20 * 2**20)}
    refused = httpx.post(f"{served}/verify", json=big, timeout=60)
    assert refused.status_code == 413 and "--max-request-mb" in refused.json()["detail"], refused.text[:300]
    with pytest.raises(urllib.error.HTTPError) as plain:  # sends the whole body before it reads the reply
        urllib.request.urlopen(urllib.request.Request(f"{served}/verify", data=json.dumps(big).encode(),
                                                      headers={"Content-Type": "application/json"}), timeout=60)
    assert plain.value.code == 413

    def chunks():
        data = httpx.Request("POST", served, json=big).content
        for start in range(0, len(data), 2**20):
            yield data[start : start + 2**20]

    chunked = httpx.post(f"{served}/verify", content=chunks(), headers={"content-type": "application/json"},
                         timeout=60)
    assert chunked.status_code == 413, chunked.text[:300]

    for output, field in (("not a list", "response.output"), ([{"type": "message", "content": 5}],
                                                              "response.output[0].content"),
                          ([{"type": "message", "content": ["text"]}], "response.output[0].content[0]")):
        bad = {**body, "response": {**body["response"], "output": output}}
        reply = httpx.post(f"{served}/accuracy/verify", json=bad)
        assert reply.status_code == 422, reply.text[:300]
        detail = reply.json()["detail"]
        assert detail.startswith(field + ":") and "\n" not in detail, detail
        batch = httpx.post(f"{served}/verify_batch", json={"requests": [body, bad]})
        assert batch.status_code == 422 and batch.json()["detail"].startswith(f"requests[1].{field}:"), batch.text
    assert httpx.post(f"{served}/verify", content=b"{not json").status_code == 422
    assert httpx.post(f"{served}/verify_batch", json={"requests": "x"}).status_code == 422

    padded = {**body, "notes": "y" * 100_000}  # a column the functions ignore
    reply = httpx.post(f"{served}/accuracy/verify", json=padded)
    assert reply.status_code == 200 and len(reply.content) < 1000, len(reply.content)
    assert reply.json() == {"reward": 1.0, "rewards": {"accuracy": 1.0}, "mask_sample": False,
                            "failure_reason": None}


@pytest.fixture
def flaky(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server([sys.executable, "-m", "uvicorn", "--app-dir", str(ROOT / "tests"), "flaky_verifier:app",
                         "--port", str(port), "--log-level", "warning"], url)
    yield url, proc
    stop(proc)


@pytest.mark.slow  # a whole run or process kill: `make test`, not `make test-fast`
def test_hang_and_500_cost_only_their_samples(tmp_path, flaky):
    url, _ = flaky
    rollouts = write_rollouts(tmp_path / "rollouts.parquet", num_prompts=4,
                              prompt_ids=["train-0", "hang-1", "error-2", "train-3"])
    cfg = ScoreConfig(reward_funcs=["remote:math"], reward_num_workers=1, reward_on_error=-1.0, max_error_rate=1.0,
                      remote_verifiers={"math": {"url": url, "timeout_s": 1.5, "retries": 1, "backoff_s": 0.1}})
    started = time.monotonic()
    metrics = run_score(cfg, rollouts, tmp_path / "out")
    elapsed = time.monotonic() - started
    rows = read_scored(tmp_path / "out")
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    for r in by_prompt["hang-1"]:
        assert r["rewards"] == [("remote:math", -1.0)]
        assert r["errors"] == [f"remote:math: TimeoutError: no answer from {url}/verify "
                               "within 1.5 s (after 2 attempts)"]
    for r in by_prompt["error-2"]:
        assert r["rewards"] == [("remote:math", -1.0)]
        assert r["errors"][0].startswith(f"remote:math: HTTP 500 from {url}/verify: ")
        assert "verifier crashed" in r["errors"][0] and "after 2 attempts" in r["errors"][0]
    for pid in ("train-0", "train-3"):  # right, wrong, unformatted-but-right, equivalent form
        assert [r["rewards"][0][1] for r in by_prompt[pid]] == [1.0, 0.0, 1.0, 1.0]
        assert all(r["errors"] == [] for r in by_prompt[pid])
    assert metrics["score/errors"] == 8
    assert elapsed < 30  # concurrent: the 4 hanging samples' 2 x 1.5 s waits overlap


def test_server_killed_mid_batch(tmp_path, flaky):
    """One request at a time: the samples answered before the server died keep their rewards; the one it
    died on and every later one get reward_on_error, saying the connection failed."""
    url, proc = flaky
    rollouts = write_rollouts(tmp_path / "rollouts.parquet", num_prompts=3, prompt_ids=["train-0", "die-1", "train-2"])
    cfg = ScoreConfig(reward_funcs=["remote:math"], reward_num_workers=1, reward_on_error=-1.0, max_error_rate=1.0,
                      remote_verifiers={"math": {"url": url, "max_concurrency": 1, "retries": 1, "backoff_s": 0.1}})
    run_score(cfg, rollouts, tmp_path / "out")
    rows = read_scored(tmp_path / "out")
    assert proc.wait(timeout=10) == -9  # it was killed
    assert [r["rewards"][0][1] for r in rows[:4]] == [1.0, 0.0, 1.0, 1.0] and all(r["errors"] == [] for r in rows[:4])
    for r in rows[4:]:
        assert r["rewards"] == [("remote:math", -1.0)]
        [error] = r["errors"]
        assert error.startswith("remote:math: ") and ("ConnectError" in error or "RemoteProtocolError" in error)
        assert "after 2 attempts" in error


def test_request_is_nemo_gym_verify_shape():
    """The request's `response` validates as an OpenAI Responses API object (what NeMo Gym's
    BaseVerifyRequest.response extends), and the prompt is its create params' input. (openai comes with the
    vllm extras; without them this test is skipped.)"""
    Response = pytest.importorskip("openai.types.responses").Response

    body = verify_request([{"role": "user", "content": "2+3?"}],
                          [{"role": "assistant", "content": "<answer>5</answer>"}],
                          {"answer": "5"})
    response = Response.model_validate(body["response"])
    assert response.output_text == "<answer>5</answer>"
    assert body["responses_create_params"] == {"input": [{"role": "user", "content": "2+3?"}]}
    assert body["answer"] == "5"


def test_unreachable_service_fails_each_sample_not_the_call():
    verifier = RemoteVerifier(RemoteVerifierConfig(url=f"http://127.0.0.1:{free_port()}", retries=0))
    values = verifier(prompts=["a", "b"], completions=["1", "2"], answer=["1", "2"])
    assert [type(v).__name__ for v in values] == ["SampleError", "SampleError"]
    assert "ConnectError" in str(values[0])


def test_a_row_whose_fields_are_not_json_fails_alone_in_a_batch(served):
    """fields_column: each row's JSON object goes in the request in place of its columns; a row whose column is not
    one is that sample's error, and the others of the batch are scored (`format`: the served config's accuracy
    imports math-verify on its first call, which a loaded machine can take past the served workers' 3 s timeout;
    tests/test_nemo_gym.py checks the fields reach a real server's /verify)."""
    verifier = RemoteVerifier(RemoteVerifierConfig(url=f"{served}/format", batch=True, fields_column="f"))
    values = verifier(prompts=["2+3?"] * 3, completions=["<answer>5</answer>", "5", "x"],
                      f=['{"answer": "5"}', '{"answer": "5"}', "not json"])
    assert values[:2] == [1.0, 0.0]
    assert isinstance(values[2], SampleError) and "column 'f' is not JSON text" in str(values[2])


def test_a_head_that_does_not_answer_fails_each_sample_once_asked(monkeypatch):
    """A NeMo Gym head that is down fails every sample naming it; asked once, not once per sample (a head that hangs
    would otherwise cost each sample its timeout in turn)."""
    from stages.scoring.rewards import remote

    asked, ask = [], remote.listed_servers
    monkeypatch.setattr(remote, "listed_servers", lambda *args, **kwargs: asked.append(args) or ask(*args, **kwargs))
    verifier = RemoteVerifier(RemoteVerifierConfig(head_url=f"http://127.0.0.1:{free_port()}", server="env",
                                                   retries=0))
    values = verifier(prompts=["a"] * 4, completions=["1"] * 4)
    assert all(isinstance(v, SampleError) and "no NeMo Gym head server answers at" in str(v) for v in values)
    assert len(asked) == 1


def test_config_typos_get_suggestions(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("score:\n  reward_funcs: [remote:math]\n  remote_verifiers:\n"
                   "    math: {url: 'http://127.0.0.1:8001', timeut_s: 3}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'score.remote_verifiers.math.timeut_s'; "
                                          r"did you mean 'score.remote_verifiers.math.timeout_s'\?"):
        load_config(bad)
    bad.write_text("score:\n  reward_funcs: [remote:mth]\n  remote_verifiers:\n    math: {url: 'http://h:1'}\n")
    with pytest.raises(ConfigError, match=r"'remote:mth' names no entry of score.remote_verifiers; "
                                          r"did you mean 'remote:math'\?"):
        load_config(bad)
    bad.write_text("score:\n  reward_funcs: [remote:math]\n  remote_verifiers:\n    math: {url: 'host:8001'}\n")
    with pytest.raises(ConfigError, match=r"score.remote_verifiers.math.url: .*'host:8001' is not a URL"):
        load_config(bad)
    bad.write_text("score:\n  reward_funcs: [remote:math]\n  remote_verifiers:\n    math: {url: 'http://h:1', "
                   "timeout_s: 40}\n")
    with pytest.raises(ConfigError, match=r"remote_verifiers.math: timeout_s x \(retries \+ 1\) \+ backoff = 121.5 s "
                                          r"is more than reward_timeout_s = 60 s"):
        load_config(bad)


def test_serve_rewards_config_error_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("score:\n  reward_fucns: [accuracy]\n")
    assert main(["serve-rewards", str(bad)]) == 2
    assert "did you mean 'score.reward_funcs'" in capsys.readouterr().err
    bad.write_text("score:\n  reward_funcs: [reward_model]\n")
    assert main(["serve-rewards", str(bad)]) == 2
    assert "reward_model:<folder>" in capsys.readouterr().err


def test_multiturn_run_episodes_through_rollout_func(tmp_path, monkeypatch):
    """configs/examples/multiturn: the rollout_func serves the tiny policy at /v1/responses, the episode server's
    /run plays up to two turns per prompt (a wrong answer gets feedback and another try); each row is the
    episode's last model turn, scored by the same server's /verify as a remote verifier."""
    from conftest import tiny_say_policy
    from transformers import AutoTokenizer

    from stages.rollout import rollout
    from stages.rollout.engines import Policy

    root = tiny_say_policy(tmp_path, num_prompts=4)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server([sys.executable, "-m", "uvicorn", "--app-dir",
                           str(ROOT / "configs" / "examples" / "multiturn"),
                           "episode_server:app", "--port", str(port), "--log-level", "warning"], url)
    try:
        monkeypatch.setenv("EPISODE_SERVER_URL", url)
        monkeypatch.syspath_prepend(str(ROOT / "configs" / "examples" / "multiturn"))
        out = tmp_path / "rollouts"
        out.mkdir()
        cfg = rollout.RolloutConfig(num_generations=2, prompts_per_round=3, max_completion_length=6,
                                    rollout_func="multiturn_rollout.run_episodes")
        rollout.run(cfg, Policy(root / "model"), root / "prompts" / "train.parquet", 0, out)
        rows = pq.read_table(out / "rollouts.parquet").to_pylist()
        tokenizer = AutoTokenizer.from_pretrained(root / "model")
        assert len(rows) == 6
        for row in rows:
            assert row["engine"] == "transformers+multiturn_rollout.run_episodes"
            assert len(row["sampling_logprobs"]) == len(row["completion_token_ids"]) >= 1
            assert all(lp <= 0 for lp in row["sampling_logprobs"])
            assert tokenizer.decode(row["completion_token_ids"], skip_special_tokens=True) == row["completion"]
            conversation = tokenizer.decode(row["prompt_token_ids"])
            assert conversation.startswith("<|im_start|>user\n" + row["prompt"][0]["content"])
        # the untrained policy answers "say i" wrongly, so episodes went to a second turn after feedback
        second_turns = [r for r in rows if "That is not it." in tokenizer.decode(r["prompt_token_ids"])]
        assert second_turns
        for r in second_turns:  # the first turn's answer and the feedback are in the prompt tokens
            assert tokenizer.decode(r["prompt_token_ids"]).count("<|im_start|>assistant") == 2

        cfg = ScoreConfig(reward_funcs=["remote:episode"], reward_num_workers=1,
                          remote_verifiers={"episode": {"url": url}})
        run_score(cfg, out / "rollouts.parquet", tmp_path / "scored", num_generations=2)
        scored = read_scored(tmp_path / "scored")
        for r in scored:
            said = r["completion"].replace("<answer>", "").replace("</answer>", "").strip()
            assert r["rewards"] == [("remote:episode", float(said == r["prompt"][0]["content"].split()[-1]))]
            assert r["errors"] == []
    finally:
        stop(server)


def test_score_key_has_the_verifier_url_and_version_not_code(monkeypatch, tmp_path):
    """A remote verifier is keyed like user code by name: its options (URL and `version` label) are in the
    score stage's key; nothing of this machine is hashed for it (no `user_code` entry)."""
    from tasks import stage_tasks
    from tasks.store import Artifact, ArtifactStore

    sections = []
    monkeypatch.setattr(stage_tasks, "materialize", lambda ctx, stage, call, **_:
                        sections.append(call.key()) or stage_tasks.artifact_key(ctx.store, stage, call))

    def key(**verifier):
        config = {"score": {"reward_funcs": ["remote:math"], "remote_verifiers": {"math": verifier}}}
        ctx = stage_tasks.RunContext(load_config_dict(config), ArtifactStore(tmp_path / "artifacts"), None, None)
        return stage_tasks.score_task.fn(ctx, Artifact("rollout", "k", tmp_path, {}), 0)

    base = key(url="http://a:1")
    assert sections[-1]["cfg"]["user_code"] == []
    assert key(url="http://a:1") == base
    assert key(url="http://b:1") != base
    assert key(url="http://a:1", version="v2") != base
    assert key(url="http://a:1", token_env="REWARDS_TOKEN") == base  # who may call, not what it computes


def load_config_dict(data: dict):
    from flows.config import PipelineConfig

    return PipelineConfig.model_validate(data)


def test_a_function_returning_sample_errors_fails_only_those_samples(tmp_path):
    rollouts = write_rollouts(tmp_path / "rollouts.parquet", num_prompts=2)
    metrics = run_score(ScoreConfig(reward_funcs=["flaky_verifier.refuses_long"], reward_num_workers=1,
                                    reward_on_error=-2.0, max_error_rate=1.0), rollouts, tmp_path / "out")
    rows = read_scored(tmp_path / "out")
    for r in rows:
        if len(r["completion"]) > 10:
            assert r["rewards"] == [("flaky_verifier.refuses_long", -2.0)]
            assert r["errors"] == [f"flaky_verifier.refuses_long: {len(r['completion'])} characters is too long"]
        else:
            assert r["rewards"] == [("flaky_verifier.refuses_long", 1.0)] and r["errors"] == []
    assert 0 < metrics["score/errors"] < len(rows)


def test_serve_rewards_with_a_token_refuses_callers_without_it(tmp_path, monkeypatch):
    """`--token`: a request without the bearer token (or with another) gets 401 and no reward function runs; a
    run whose remote verifier names the token's variable (`token_env`) scores through it."""
    config = tmp_path / "rewards.yaml"
    config.write_text("score:\n  reward_funcs: [flaky_verifier.logs_calls]\n  reward_num_workers: 1\n")
    calls = tmp_path / "calls.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "CALLS_LOG": str(calls), "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = start_server([sys.executable, "-m", "flows.cli", "serve-rewards", str(config), "--port", str(port),
                         "--token", "s3cret"], url, env=env)
    try:
        body = verify_request([{"role": "user", "content": "say 7"}], "7", {"answer": "7"})
        assert httpx.post(f"{url}/verify", json=body).status_code == 401
        wrong = httpx.post(f"{url}/verify", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "bearer token" in wrong.json()["detail"]
        assert not calls.exists()  # nothing was scored
        good = httpx.post(f"{url}/verify", json=body, headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200 and good.json()["reward"] == 1.0
        assert calls.read_text() == "1\n"

        monkeypatch.setenv("REWARDS_TOKEN", "s3cret")
        verifier = RemoteVerifier(RemoteVerifierConfig(url=url, token_env="REWARDS_TOKEN", retries=0))
        assert verifier([[{"role": "user", "content": "say 7"}]], ["7"], answer=["7"]) == [1.0]
        anonymous = RemoteVerifier(RemoteVerifierConfig(url=url, retries=0))
        assert "401" in str(anonymous([[{"role": "user", "content": "say 7"}]], ["7"], answer=["7"])[0])
    finally:
        stop(proc)


def test_serve_rewards_off_loopback_needs_a_token(tmp_path, capsys, monkeypatch):
    config = tmp_path / "rewards.yaml"
    config.write_text("score:\n  reward_funcs: [accuracy]\n")
    monkeypatch.delenv("POSTTRAIN_REWARDS_TOKEN", raising=False)
    assert main(["serve-rewards", str(config), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "listening on 0.0.0.0 needs a bearer token" in err and "--token" in err
    monkeypatch.setenv("RUN_TOKEN", "")
    with pytest.raises(ValueError, match="token_env names RUN_TOKEN, which is not set"):
        RemoteVerifier(RemoteVerifierConfig(url="http://127.0.0.1:1", token_env="RUN_TOKEN"))
