"""rollout.source: atropos -- posttrain as an Atropos trainer. The end-to-end test runs the real thing:
Atropos' `run-api` on loopback (started by posttrain), the example environment (configs/examples/atropos_env.py)
in its own process sampling posttrain's policy server, posttrain training 3 rounds from the pulled
batches, SIGKILLed in the middle and resumed: no batch is requested or trained twice."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import copy_warm_stages
from flows.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


def test_misspelt_atropos_key_gets_a_suggestion(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  source: atropos\n  atropos:\n    api_ulr: http://127.0.0.1:8000\n")
    with pytest.raises(ConfigError, match="did you mean 'rollout.atropos.api_url'"):
        load_config(bad)
    bad.write_text("rollout:\n  sorce: atropos\n")
    with pytest.raises(ConfigError, match="did you mean 'rollout.source'"):
        load_config(bad)


def test_atropos_options_are_checked(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  source: atropos\n  async_prefetch: true\n")
    with pytest.raises(ConfigError, match="does not go with rollout.async_prefetch"):
        load_config(bad)
    bad.write_text("rollout:\n  atropos:\n    api_url: localhost\n")
    with pytest.raises(ConfigError, match="rollout.atropos.api_url.*expected a URL with a port"):
        load_config(bad)


def test_api_that_is_down_and_not_startable_names_url_and_what_to_start(tmp_path):
    from stages.rollout.atropos import AtroposError, AtroposOptions, ensure_api

    opts = AtroposOptions(api_url=f"http://127.0.0.1:{free_port()}", start_api=False)
    with pytest.raises(AtroposError, match=f"no Atropos API answers at {opts.api_url}.*run-api"):
        ensure_api(opts, tmp_path)


def test_policy_server_answers_as_vllm_and_its_groups_become_rollouts_and_scores(tmp_path):
    """Without atroposlib: what an environment gets from the policy server, sent back as an Atropos group
    (tokens, -100 masks, inference_logprobs, overrides), becomes rollouts rows and group advantages."""
    import httpx
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from conftest import tiny_model
    from stages.data.schemas import ROLLOUTS, write_table
    from stages.rollout import atropos
    from stages.rollout.engines import Policy, get_engine

    tiny_model(tmp_path, [f"<|im_start|>user\nsay {i}<|im_end|>\n<|im_start|>assistant\n{i}<|im_end|>"
                          for i in range(50)])
    model = tmp_path / "model"
    url = f"http://127.0.0.1:{free_port()}"
    server = atropos.PolicyServer(url, get_engine("transformers", model, {"batch_size": 8}), Policy(model, version=3))
    try:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["root"] == str(model)
        prompt = [{"role": "user", "content": "say 7"}]
        resp = httpx.post(f"{url}/v1/chat/completions", json={"model": "policy", "messages": prompt, "n": 2,
                                                                "max_tokens": 4, "logprobs": True}, timeout=60).json()
        from concurrent.futures import ThreadPoolExecutor

        def ask(i):  # concurrent requests: sampled together, each answered with its own prompt and n
            body = {"model": "policy", "messages": [{"role": "user", "content": f"say {i}"}], "n": i, "max_tokens": 3}
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, [1, 2, 3, 4]))
        tokenizer = AutoTokenizer.from_pretrained(model)
        for i, answer in enumerate(answers, start=1):
            assert len(answer["choices"]) == i and f"say {i}" in tokenizer.decode(answer["prompt_token_ids"])
    finally:
        server.close()
    assert resp["policy_version"] == 3 and len(resp["choices"]) == 2
    prompt_ids = resp["prompt_token_ids"]
    group = {"tokens": [], "masks": [], "inference_logprobs": [], "scores": [1.0, 0.0], "overrides": [], "env_id": 0}
    for choice in resp["choices"]:
        ids, lps = choice["token_ids"], [t["logprob"] for t in choice["logprobs"]["content"]]
        assert len(ids) == len(lps) and all(lp <= 0 for lp in lps)
        group["tokens"].append(prompt_ids + ids)
        group["masks"].append([-100] * len(prompt_ids) + ids)
        group["inference_logprobs"].append([1.0] * len(prompt_ids) + lps)
        group["overrides"].append({"policy_version": resp["policy_version"], "env": "say", "answer": "7"})
    rows = atropos.batch_rows([group, group], 4, 2, AutoTokenizer.from_pretrained(model))
    assert [r["group_index"] for r in rows] == [0, 1, 0, 1] and rows[0]["prompt_token_ids"] == prompt_ids
    assert rows[1]["completion_token_ids"] == resp["choices"][1]["token_ids"]
    assert rows[1]["sampling_logprobs"] == [t["logprob"] for t in resp["choices"][1]["logprobs"]["content"]]
    assert rows[0]["policy_version"] == 3 and rows[0]["engine"] == "atropos:say" and rows[0]["answer"] == "7"
    assert "say 7" in rows[0]["prompt"][0]["content"]
    write_table(pa.Table.from_pylist(rows), tmp_path / "rollouts.parquet", ROLLOUTS, extra_ok=True)
    summary = atropos.score(tmp_path / "rollouts.parquet", 2, "group", tmp_path)
    scored = pq.read_table(tmp_path / "scored.parquet").to_pylist()
    assert [r["reward"] for r in scored] == [1.0, 0.0, 1.0, 0.0] and scored[0]["advantage"] > 0 > scored[1]["advantage"]
    assert summary["reward_mean"] == 0.5
    with pytest.raises(atropos.AtroposError, match="--env.group_size 4"):
        atropos.batch_rows([group], 0, 4, AutoTokenizer.from_pretrained(model))


def test_policy_server_answers_atroposlib_vllm_server_clients(tmp_path):
    """An environment with `server_type: vllm`: atroposlib's own VLLMServer client calls the policy server's
    /generate (token ids in, [{token_id: logprob}] out) and /v1/completions, directly and through its
    ManagedServer (chat messages in, masked tokens and log-probs out, as gsm8k's environment trains on); the
    tokens are the policy's samples of that prompt and the log-probs the engine's."""
    import asyncio

    pytest.importorskip("atroposlib")
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.managed_server import ManagedServer
    from atroposlib.envs.server_handling.vllm_server import VLLMServer
    from transformers import AutoTokenizer

    from conftest import tiny_model
    from stages.rollout import atropos
    from stages.rollout.engines import Policy, Sampling, get_engine

    tiny_model(tmp_path, [f"<|im_start|>user\nsay {i}<|im_end|>\n<|im_start|>assistant\n{i}<|im_end|>"
                          for i in range(50)])
    model = tmp_path / "model"
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "say 7"}], tokenize=False,
                                           add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    url = f"http://127.0.0.1:{free_port()}"
    engine = get_engine("transformers", model, {"batch_size": 8})
    server = atropos.PolicyServer(url, engine, Policy(model, version=2), token="s3cret")
    client = VLLMServer(APIServerConfig(model_name="policy", base_url=f"{url}/v1", api_key="s3cret",
                                        tokenizer_name=str(model), health_check=False, timeout=120))
    try:
        got_prompt, tokens, logprobs, finish = asyncio.run(client.tokens_and_logprobs_completion(
            model="policy", input_ids=prompt_ids, n=3, max_tokens=4, temperature=1.0))
        completion = asyncio.run(client.completion(model="policy", prompt=prompt, n=2, max_tokens=4, logprobs=0))
        managed = ManagedServer(client, tokenizer=tokenizer)  # what a `vllm` environment (gsm8k's) samples through
        chat = asyncio.run(managed.chat_completion(messages=[{"role": "user", "content": "say 7"}], n=2, max_tokens=4,
                                                   temperature=1.0))
        nodes = list(managed.current_nodes)
        httpx = __import__("httpx")
        refused = httpx.post(f"{url}/generate", json={"prompt": {"prompt_token_ids": prompt_ids}})
        auth = {"Authorization": "Bearer s3cret"}
        native = httpx.post(f"{url}/generate", headers=auth, timeout=60,
                            json={"prompt": prompt, "n": 1, "max_tokens": 3, "logprobs": 0}).json()
        unhonoured = httpx.post(f"{url}/generate", headers=auth, timeout=60,
                                json={"prompt": prompt, "max_tokens": 3, "stop": ["\n"], "seed": 3})
    finally:
        server.close()
    # the example trainer's vllm_api_server's answer: texts, prompt, finish reasons, per-token log-probs, token ids
    assert native["prompt"] == prompt and native["prompt_token_ids"] == tokenizer(prompt)["input_ids"]
    assert [[int(next(iter(entry[0]))) for entry in out] for out in native["logprobs"]] == native["token_ids"]
    assert len(native["text"]) == len(native["finish_reasons"]) == 1
    # a sampling field it would not honour is an error naming it, not a sample that ignores it
    assert unhonoured.status_code == 400 and "seed, stop: not honoured" in unhonoured.json()["error"]["message"]
    assert len(chat.choices) == 2 and len(nodes) == 2
    for node in nodes:  # prompt positions masked, each completion token with the engine's log-prob
        completion_at = node.masked_tokens.index(next(t for t in node.masked_tokens if t != -100))
        assert node.tokens[:completion_at] == prompt_ids and all(lp <= 0 for lp in node.logprobs[completion_at:])
        assert node.logprobs[:completion_at] == [1.0] * completion_at
    assert got_prompt == prompt_ids and len(tokens) == len(logprobs) == len(finish) == 3
    for ids, lps, why in zip(tokens, logprobs, finish):
        assert 0 < len(ids) == len(lps) <= 4 and all(lp <= 0 for lp in lps) and why in ("stop", "length")
    # the same request again is the engine's samples of those token ids (request 1 was seeded 1)
    again = engine.generate(Policy(model, version=2), [{"prompt_token_ids": prompt_ids}] * 3,
                            Sampling(max_new_tokens=4, temperature=1.0, seed=1))
    assert [g["completion_token_ids"] for g in again] == tokens
    assert [g["sampling_logprobs"] for g in again] == logprobs
    assert len(completion.choices) == 2 and all(c.text is not None for c in completion.choices)
    assert refused.status_code == 401


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_env(artifacts: Path) -> dict:
    """A Prefect home per artifacts folder, and the temporary Prefect server each `posttrain` process starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_TRACKING"))}
    return {**env, "PREFECT_HOME": str(artifacts / "prefect"), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
            "OMP_WAIT_POLICY": "PASSIVE"}


def manifests(artifacts: Path, stage: str) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (artifacts / stage).glob("*/_manifest.json")}


def atropos_config(tiny_config_text: str, tmp_path: Path, rounds: int, extra: str = "") -> tuple[Path, str, str]:
    """The tiny pipeline as an Atropos trainer on loopback ports: (config file, API url, policy url)."""
    api, policy = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    config = tmp_path / "atropos.yaml"
    config.write_text(tiny_config_text.replace("grpo: {rounds: 2,", f"grpo: {{rounds: {rounds}, {extra}").replace(
        "rollout: {num_generations: 4, prompts_per_round: 8, max_completion_length: 8}",
        "rollout: {source: atropos, num_generations: 4, prompts_per_round: 4, max_completion_length: 8,\n"
        f"          atropos: {{api_url: '{api}', policy_url: '{policy}', batch_timeout_s: 300}}}}"))
    return config, api, policy


def train_from_environment(config: Path, api: str, policy: str, tmp_path: Path, warm: Path, kill_when=None) -> dict:
    """`posttrain run config` in its own process (on its own temporary Prefect server), from a copy of `warm`'s
    stages up to SFT, then the example environment once posttrain started run-api.
    kill_when(artifacts): SIGKILL posttrain when it turns true, then run it again to the end. Returns the
    manifests of the batches pulled and of the rounds trained before the kill (empty without one)."""
    artifacts = tmp_path / "artifacts"
    copy_warm_stages(warm, artifacts)
    command = [sys.executable, "-m", "flows.cli", "run", str(config)]
    env_command = [sys.executable, str(REPO / "configs" / "examples" / "atropos_env.py"), "serve",
                   "--env.rollout_server_url", api, "--openai.base_url", f"{policy}/v1", "--env.group_size", "4",
                   "--env.max_completion_tokens", "8", "--env.ensure_scores_are_not_same", "false",
                   "--env.num_items", "64"]
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("killed", "resumed", "env")}
    environment, before = None, {"pulled": {}, "trained": {}}
    first = subprocess.Popen(command, cwd=REPO, stdout=logs["killed"], stderr=subprocess.STDOUT,
                             start_new_session=True, env=own_env(artifacts))
    try:
        deadline = time.time() + 400
        while not (artifacts / "atropos" / "run-api.pid").exists():  # posttrain started run-api
            assert first.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert time.time() < deadline, "posttrain never started run-api"
            time.sleep(0.2)
        environment = subprocess.Popen(env_command, cwd=tmp_path, stdout=logs["env"], stderr=subprocess.STDOUT,
                                       start_new_session=True, env=own_env(artifacts))
        if kill_when is None:
            assert first.wait(timeout=600) == 0, (tmp_path / "killed.log").read_text()[-3000:]
            return before
        while not kill_when(artifacts):
            assert first.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert environment.poll() is None, (tmp_path / "env.log").read_text()[-3000:]
            assert time.time() < deadline, "no progress"
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        before = {"pulled": manifests(artifacts, "rollout"), "trained": manifests(artifacts, "optimize")}
        resumed = subprocess.run(command, cwd=REPO, stdout=logs["resumed"], stderr=subprocess.STDOUT,
                                 env=own_env(artifacts), timeout=600)
        assert resumed.returncode == 0, (tmp_path / "resumed.log").read_text()[-3000:]
        return before
    finally:
        for process in (environment, first):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        pid_file = artifacts / "atropos" / "run-api.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
def test_three_rounds_from_an_atropos_environment_killed_and_resumed(tiny_config_text, tiny_warm_store, tmp_path):
    """Killed and resumed on their own temporary Prefect servers (a first run's, as tests/test_resume.py's are not),
    with grpo.adapter: none: every round trains all the weights on its pulled batch, and the policy server then
    samples the round's full weights (its LoRA adapters: test_policy_server_answers_as_vllm_..., test_vllm.py's
    Atropos tests): a batch comes from a policy never newer than its round, and each optimize folder is a whole
    model. (One run for what were two: the full fine-tuning run was a test of its own.)"""
    pytest.importorskip("atroposlib")
    artifacts = tmp_path / "artifacts"
    config, api, policy = atropos_config(tiny_config_text, tmp_path, rounds=3, extra="adapter: none,")

    def round_1_optimizing(artifacts: Path) -> bool:  # rounds 0 and 1 pulled and stored, round 0 trained
        return len(manifests(artifacts, "optimize")) >= 1 and bool(list((artifacts / "optimize").glob(".tmp-*")))

    before = train_from_environment(config, api, policy, tmp_path, tiny_warm_store, kill_when=round_1_optimizing)
    pulled_before = before["pulled"]
    assert len(pulled_before) == 2 and len(before["trained"]) == 1
    import pyarrow.parquet as pq

    pulled = manifests(artifacts, "rollout")
    assert len(pulled) == 3  # one batch per round, each pulled once
    assert {k: v for k, v in pulled.items() if k in pulled_before} == pulled_before  # not asked for again
    rows = [r for k in pulled for r in pq.read_table(artifacts / "rollout" / k / "rollouts.parquet").to_pylist()]
    assert len(rows) == 3 * 16 and len({r["rollout_id"] for r in rows}) == 48
    assert {r["round_index"] for r in rows} == {0, 1, 2}
    assert all(r["env"] == "largest_number" and r["engine"] == "atropos:largest_number" for r in rows)
    assert all(r["masks"][: len(r["prompt_token_ids"])] == [-100] * len(r["prompt_token_ids"]) for r in rows)
    assert all(not any(map(lambda x: x != x, r["sampling_logprobs"])) for r in rows)  # the env's log-probs
    for r in rows:  # the policy that sampled a batch is never newer than the round that trains on it
        assert 0 <= r["policy_version"] <= r["round_index"]
    trained = manifests(artifacts, "optimize")
    assert len(trained) == 3 and len({m["inputs"]["scored"] for m in trained.values()}) == 3
    for key in trained:  # full fine-tuning: whole models, no adapters
        assert (artifacts / "optimize" / key / "model.safetensors").exists()
        assert not (artifacts / "optimize" / key / "adapter_config.json").exists()
    summary = json.loads(next((artifacts / "runs").glob("*/summary.json")).read_text())
    assert {s["stage"]: s["status"] for s in summary["stages"]}["sft"] == "cached"  # the warm stages' SFT
    assert summary["final_accuracy"] is not None


def test_policy_server_with_a_token_answers_only_callers_that_send_it(tmp_path, monkeypatch):
    """rollout.atropos.policy_token_env: the policy server answers 401 (sampling nothing) without the bearer
    token an environment sends as its --openai.api_key; off loopback it refuses to start without one."""
    import httpx

    from conftest import tiny_model
    from stages.rollout import atropos
    from stages.rollout.engines import Policy, get_engine
    from stages.rollout.rollout import AtroposOptions

    tiny_model(tmp_path, [f"<|im_start|>user\nsay {i}<|im_end|>\n<|im_start|>assistant\n{i}<|im_end|>"
                          for i in range(50)])
    model = tmp_path / "model"
    url = f"http://127.0.0.1:{free_port()}"
    server = atropos.PolicyServer(url, get_engine("transformers", model, {"batch_size": 8}), Policy(model, version=0),
                                  token="env-key")
    body = {"model": "policy", "messages": [{"role": "user", "content": "say 7"}], "max_tokens": 2}
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 401
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert server._requests == 0  # nothing sampled
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                            headers={"Authorization": "Bearer env-key"})
        assert answer.status_code == 200 and answer.json()["choices"]
    finally:
        server.close()

    monkeypatch.delenv("POLICY_TOKEN", raising=False)
    exposed = atropos.AtroposSession(AtroposOptions(policy_url="http://0.0.0.0:9", start_api=False), None, 8, 1,
                                     tmp_path)
    with pytest.raises(atropos.AtroposError, match="listening on 0.0.0.0 needs a bearer token"):
        exposed.policy_server_token()
    named = atropos.AtroposSession(AtroposOptions(policy_token_env="POLICY_TOKEN", start_api=False), None, 8, 1,
                                   tmp_path)
    with pytest.raises(atropos.AtroposError, match="policy_token_env names POLICY_TOKEN, which is not set"):
        named.policy_server_token()
