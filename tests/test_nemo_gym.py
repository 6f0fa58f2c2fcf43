"""axolotl's NeMo Gym plugin (flows/nemo_gym.py): its keys land where they mean the same or are one line naming
the key; NeMo Gym rows become prompts (type nemo_gym); and against NeMo Gym's own servers, `ng_run` from the
nemo-gym package (`make nemo-gym` installs it into .nemo-gym) with the reasoning_gym resources server, as axolotl's
NeMo Gym guide starts them, the guide's single-turn config runs and each completion's reward is that server's
/verify answer."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import free_port
from flows.cli import main
from flows.config import ConfigError, load_config
from stages.scoring.rewards.common import SampleError
from stages.scoring.rewards.remote import RemoteVerifier, RemoteVerifierConfig, head_servers, listed_servers

GYM = Path(__file__).resolve().parents[1] / ".nemo-gym"
"""Where `make nemo-gym` installs the nemo-gym package (its own folder: its pins cannot share .venv; Makefile)."""
EXAMPLE = "resources_servers/reasoning_gym/data/example.jsonl"
"""The reasoning_gym server's example rows, shipped in the package: five knights-and-knaves puzzles."""

SINGLE_TURN = """base_model: {model}

rl: grpo
chat_template: tokenizer_default

trl:
  use_vllm: false
  num_generations: 4
  max_completion_length: 16
  temperature: 0.9
  reward_funcs:
    - axolotl.integrations.nemo_gym.rewards.reward_nemo_gym_verify

plugins:
  - axolotl.integrations.nemo_gym.NemoGymPlugin

nemo_gym_enabled: true
nemo_gym_dir: {gym}
nemo_gym_auto_start: false
nemo_gym_head_port: {port}
nemo_gym_datasets:
  - path: {example}
    server_name: reasoning_gym

datasets:
  - path: {gym}/{example}
    type: chat_template
    field_messages: responses_create_params.input
    message_field_content: content
    message_field_role: role

learning_rate: 1e-5
micro_batch_size: 4
gradient_accumulation_steps: 2
max_steps: 1
sequence_len: 256
output_dir: {out}
"""
"""axolotl's NeMo Gym guide's single-turn config (its README's and docs/rlhf.qmd's), with the model, paths, port and
sizes changed (max_completion_length 128 -> 16, max_steps 50 -> 1, the tiny model's 256 tokens as sequence_len,
vllm: off on this CPU machine)."""


def rows_folder(tmp_path: Path) -> Path:
    """A NeMo Gym clone's stand-in for the tests that only read configs: the example rows at their path."""
    (tmp_path / "gym" / EXAMPLE).parent.mkdir(parents=True)
    (tmp_path / "gym" / EXAMPLE).write_text((GYM / EXAMPLE).read_text() if (GYM / EXAMPLE).exists() else
                                             json.dumps(ROW) + "\n")
    return tmp_path / "gym"


ROW = {"responses_create_params": {"input": [{"role": "user", "content": "2+3? Answer in <answer></answer>."}]},
       "question": "2+3?", "answer": "5",
       "metadata": {"source_dataset": "basic_arithmetic", "source_index": 0, "expression": "2 + 3"}}
"""A reasoning_gym row in NeMo Gym's dataset shape."""


def config(tmp_path: Path, text: str = SINGLE_TURN, port: int = 11000, gym: Path | None = None,
           model: Path | None = None) -> Path:
    """`text` for the user's folder tmp_path: a stand-in model folder unless `model`, the rows of `gym` or a stand-in
    clone's."""
    path = tmp_path / "ax.yaml"
    if model is None:
        model = tmp_path / "model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text("{}")
    path.write_text(text.format(model=model, gym=gym or rows_folder(tmp_path), port=port, example=EXAMPLE,
                                out=tmp_path / "out"))
    return path


def warm_model(tiny_warm_store) -> Path:
    """A real model folder: the tiny run's base model."""
    return next(p for p in (tiny_warm_store / "base_model").iterdir() if (p / "config.json").is_file())


def test_the_single_turn_config_lands_where_each_key_means_the_same(tmp_path):
    cfg = load_config(config(tmp_path))
    gym = tmp_path / "gym"
    assert [s.model_dump(exclude_none=True) for s in cfg.transform.datasets] == [
        {"path": str(gym / EXAMPLE), "type": "nemo_gym", "server_name": "reasoning_gym"}]
    assert cfg.score.reward_funcs == ["remote:nemo_gym"]  # the plugin's reward and reward_nemo_gym_verify: one call
    verifier = cfg.score.remote_verifiers["nemo_gym"]
    assert (verifier.url, verifier.head_url, verifier.server_column, verifier.fields_column) == (
        None, "http://127.0.0.1:11000", "nemo_gym_server", "nemo_gym")
    assert (verifier.timeout_s, verifier.response_model) == (30, str(tmp_path / "model"))  # axolotl's defaults
    assert cfg.score.reward_timeout_s >= verifier.worst_case_s()
    notes = "\n".join(cfg.translation_notes)
    assert "datasets: replaced by nemo_gym_datasets' rows" in notes
    assert "reward_nemo_gym_verify -> remote:nemo_gym" in notes


def test_a_plugin_reward_beside_the_users_own_and_max_samples(tmp_path):
    text = SINGLE_TURN.replace("    - axolotl.integrations.nemo_gym.rewards.reward_nemo_gym_verify\n",
                               "    - rewards.length\n  reward_weights: [0.5]\n").replace(
        "    server_name: reasoning_gym\n", "    server_name: reasoning_gym\n    max_samples: 3\n")
    (tmp_path / "rewards.py").write_text("def length(completions, **kw):\n    return [0.0 for _ in completions]\n")
    cfg = load_config(config(tmp_path, text))
    assert cfg.score.reward_funcs == ["rewards.length", "remote:nemo_gym"]  # the plugin adds its reward
    assert cfg.score.reward_weights == [0.5, 1.0]
    assert cfg.transform.datasets[0].split == "train[:3]"


REFUSED = {
    "nemo_gym_auto_start: true": ("nemo_gym_auto_start: false", "nemo_gym_auto_start: true",
                                  "nemo_gym_auto_start: true: posttrain does not clone or start NeMo Gym"),
    "nemo_gym_config_paths": ("nemo_gym_auto_start: false", "nemo_gym_config_paths: [a.yaml]",
                              "nemo_gym_config_paths: posttrain does not clone or start NeMo Gym"),
    "nemo_gym_multi_turn": ("nemo_gym_auto_start: false", "nemo_gym_auto_start: false\nnemo_gym_multi_turn: true",
                            "nemo_gym_multi_turn: true: multi-turn rollouts through NeMo Gym's agent servers"),
    "reward_env": ("rewards.reward_nemo_gym_verify", "rewards.reward_env",
                   "trl.reward_funcs: axolotl.integrations.nemo_gym.rewards.reward_env: multi-turn"),
    "another plugin": ("  - axolotl.integrations.nemo_gym.NemoGymPlugin",
                       "  - axolotl.integrations.nemo_gym.NemoGymPlugin\n  - axolotl.integrations.liger.LigerPlugin",
                       "plugins: axolotl's plugins other than NeMo Gym's"),
    "disabled": ("nemo_gym_enabled: true", "nemo_gym_enabled: false",
                 "nemo_gym_dir: nemo_gym_enabled is not true, so axolotl's NeMo Gym plugin reads none of its keys"),
    "no plugin": ("plugins:\n  - axolotl.integrations.nemo_gym.NemoGymPlugin\n", "",
                  "nemo_gym_enabled: a key of axolotl's NeMo Gym plugin, which plugins does not list"),
    "a dpo run": ("rl: grpo", "rl: dpo", "plugins: axolotl's NeMo Gym plugin scores GRPO's completions"),
    "a misspelt key": ("nemo_gym_auto_start: false", "nemo_gym_auto_strat: false",
                       "nemo_gym_auto_strat: not a key of axolotl's NeMo Gym plugin; did you mean "
                       "nemo_gym_auto_start?"),
}
"""What posttrain does not do (start or clone NeMo Gym, multi-turn agents, other plugins) and keys that do nothing:
(text replaced, its replacement, the start of the one line)."""


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_the_plugin_does_here_not_is_one_line_naming_the_key(tmp_path, name, capsys):
    old, new, line = REFUSED[name]
    assert old in SINGLE_TURN
    assert main(["validate", str(config(tmp_path, SINGLE_TURN.replace(old, new)))]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 2 and err[0] == "config error:" and line in err[1], err


def test_a_missing_clone_is_named_and_not_cloned(tmp_path, capsys):
    assert main(["validate", str(config(tmp_path, gym=tmp_path / "no-gym"))]) == 2
    assert "nemo_gym_dir: " + str(tmp_path / "no-gym") + " is not a folder (nemo_gym_auto_clone: posttrain clones " \
           "nothing)" in capsys.readouterr().err


def test_nemo_gym_rows_become_prompts_with_their_server_and_fields(tmp_path):
    from stages.data import transform

    rows = [ROW,
            {**ROW, "agent_ref": {"type": "resources_servers", "name": "other_env"}},  # a resources server: its own
            {**ROW, "agent_ref": {"type": "responses_api_agents", "name": "simple_agent"}},  # an agent: the source's
            {"responses_create_params": {"input": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "input_text", "text": "2+"},
                                             {"type": "input_text", "text": "3?"}]}]}},
            {"responses_create_params": {"input": "2+3?"}}]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = transform.TransformConfig(datasets=[{"path": str(tmp_path / "rows.jsonl"), "type": "nemo_gym",
                                               "server_name": "reasoning_gym"}])
    (tmp_path / "out").mkdir()
    transform.run(cfg, None, tmp_path / "out")
    import pyarrow.parquet as pq

    got = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["nemo_gym_server"] for r in got] == ["reasoning_gym", "other_env", "reasoning_gym", "reasoning_gym",
                                                   "reasoning_gym"]
    assert [r["answer"] for r in got] == ["5", "5", "5", None, None]
    assert got[3]["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    assert got[4]["prompt"] == [{"role": "user", "content": "2+3?"}]
    assert json.loads(got[0]["nemo_gym"]) == ROW  # every field, as /verify gets it back
    assert set(got[0]) == {"prompt_id", "prompt", "answer", "nemo_gym_server", "nemo_gym"}


def test_a_nemo_gym_row_that_is_not_a_prompt_is_named(tmp_path):
    from stages.data import transform

    rows = [{"question": "no input"},
            {"responses_create_params": {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}}]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = transform.TransformConfig(datasets=[{"path": str(tmp_path / "rows.jsonl"), "type": "nemo_gym",
                                               "server_name": "s"}])
    (tmp_path / "out").mkdir()
    with pytest.raises(transform.BadRowsError) as e:
        transform.run(cfg, None, tmp_path / "out")
    assert "row 0: missing or empty field responses_create_params.input" in str(e.value)
    assert "row 1: transform 'question_answer' failed" not in str(e.value)
    assert "holds a 'function_call' item, not a message" in str(e.value)
    assert not (tmp_path / "out" / "train.parquet").exists()


@pytest.mark.parametrize("options, message", [
    ({}, "set url (the service) or head_url"),
    ({"url": "http://h:1", "head_url": "http://h:2"}, "set url (the service) or head_url"),
    ({"head_url": "http://h:2"}, "head_url needs server"),
    ({"head_url": "http://h:2", "server": "a", "server_column": "b"}, "head_url needs server"),
    ({"url": "http://h:1", "server": "a"}, "server names a server of a NeMo Gym head: it goes with head_url"),
    ({"head_url": "http://h:2", "server": "a", "batch": True}, "/verify_batch, which NeMo Gym's servers do not have"),
])
def test_a_verifier_has_one_way_to_its_service(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RemoteVerifierConfig(**options)


def test_the_heads_double_encoded_yaml_lists_its_resources_servers():
    import yaml

    config = {"reasoning_gym": {"resources_servers": {"reasoning_gym": {"host": "127.0.0.1", "port": 11488}}},
              "math_env": {"resources_servers": {"math": {"host": "10.0.0.2", "port": 12000}}},
              "head_server": {"host": "127.0.0.1", "port": 11000}, "policy_model": {"responses_api_models": {}}}
    assert head_servers(yaml.safe_dump(yaml.safe_dump(config))) == {
        "reasoning_gym": "http://127.0.0.1:11488", "math_env": "http://10.0.0.2:12000", "math": "http://10.0.0.2:12000"}


# --- NeMo Gym's own servers ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ng_run(tmp_path_factory, ray_home):
    """`ng_run` with the reasoning_gym resources server on a free head port, as axolotl's guide runs it (with
    `+skip_venv_if_present=true`: the server's environment is .venv with the package on PYTHONPATH, not a uv venv
    of Python 3.12, which this machine cannot download); yields the head's URL. ng_run starts a local Ray
    instance (initialize_ray), so this is one of the suite's Ray tests (tests/conftest.py)."""
    if not (GYM / ".installed").exists():
        pytest.skip("NeMo Gym is not installed here: make nemo-gym")
    root = tmp_path_factory.mktemp("ng-run")
    activate = root / "venvs" / "resources_servers" / "reasoning_gym" / ".venv" / "bin"
    activate.mkdir(parents=True)
    (activate / "python").symlink_to(sys.executable)
    (activate / "activate").write_text(f"export PATH={Path(sys.executable).parent}:$PATH\nexport PYTHONPATH={GYM}\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(HOME=str(ray_home), PYTHONPATH=str(GYM))
    log = root / "ng_run.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(GYM / "bin" / "ng_run"),
                                 "+config_paths=[resources_servers/reasoning_gym/configs/resources_only.yaml]",
                                 "+skip_venv_if_present=true", f"+uv_venv_dir={root / 'venvs'}",
                                 f"+head_server={{host:127.0.0.1,port:{port}}}"],
                                cwd=GYM, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    head = f"http://127.0.0.1:{port}"
    try:
        _wait_for_the_resources_server(head, proc, log)
        yield head
    finally:
        _stop(proc)


def _wait_for_the_resources_server(head: str, proc: subprocess.Popen, log: Path) -> None:
    import httpx

    from stages.runtime import http

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ng_run exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            url = listed_servers(head).get("reasoning_gym")
            if url and http.client().get(url + "/", timeout=2).status_code < 500:
                return
        except (ValueError, httpx.HTTPError):
            pass
        time.sleep(1)
    pytest.fail(f"ng_run's reasoning_gym server did not answer within 240 s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """ng_run stops its servers and its Ray instance on Ctrl-C; its process group is killed after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _asked(url: str, row: dict, completion: str) -> float:
    """The reward a resources server gives `completion` on `row`, asked the way axolotl's plugin asks it."""
    import httpx

    body = {**row, "response": {
        "id": "resp", "created_at": 0, "model": "axolotl", "object": "response", "parallel_tool_calls": True,
        "tool_choice": "auto", "tools": [], "output": [{
            "id": "msg", "role": "assistant", "type": "message", "status": "completed",
            "content": [{"type": "output_text", "text": completion, "annotations": []}]}]}}
    return float(httpx.post(url + "/verify", json=body, timeout=30).json()["reward"])


def test_each_row_goes_to_its_server_and_a_server_the_head_lacks_is_named(ng_run):
    verifier = RemoteVerifier(RemoteVerifierConfig(head_url=ng_run, server_column="s", fields_column="f", retries=0))
    row = json.loads((GYM / EXAMPLE).read_text().splitlines()[0])
    prompt = row["responses_create_params"]["input"]
    got = verifier([prompt] * 3, [f"<answer>{row['answer']}</answer>", "<answer>nobody</answer>", "x"],
                   s=["reasoning_gym", "reasoning_gym", "no_such_env"], f=[json.dumps(row)] * 3)
    assert got[:2] == [1.0, 0.0]
    assert isinstance(got[2], SampleError)
    assert f"NeMo Gym head {ng_run} lists no resources server 'no_such_env' (it lists: reasoning_gym)" in str(got[2])


def test_validate_asks_the_head_for_the_rows_servers(ng_run, tmp_path, tiny_warm_store, capsys):
    port, model = int(ng_run.rsplit(":", 1)[1]), warm_model(tiny_warm_store)
    assert main(["validate", str(config(tmp_path, port=port, gym=GYM, model=model))]) == 0
    notes = capsys.readouterr().err
    assert f"note: score.remote_verifiers.nemo_gym.head_url: NeMo Gym head {ng_run} lists reasoning_gym" in notes
    assert main(["validate", str(config(tmp_path, port=free_port(), gym=GYM, model=model))]) == 2
    err = capsys.readouterr().err
    assert "score.remote_verifiers.nemo_gym.head_url: no NeMo Gym head server answers at http://127.0.0.1:" in err
    assert "start NeMo Gym's servers with ng_run" in err


def test_the_guides_single_turn_config_runs_on_the_resources_servers_verify(ng_run, tmp_path, monkeypatch,
                                                                          tiny_warm_store, empty_mlflow_store):
    """The guide's config, as axolotl users run it beside `ng_run`: a GRPO round whose rewards are the
    reasoning_gym server's /verify answers for each completion (asked again here, the same), none failed."""
    import shutil

    import pyarrow.parquet as pq

    from flows.pipeline import posttrain_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "out").mkdir()
    shutil.copyfile(empty_mlflow_store, tmp_path / "out" / "mlflow.db")
    path = config(tmp_path, port=int(ng_run.rsplit(":", 1)[1]), gym=GYM, model=warm_model(tiny_warm_store))
    posttrain_pipeline(str(path), quiet=True)
    scored = pq.read_table(next((tmp_path / "out" / "score").glob("*/scored.parquet"))).to_pylist()
    assert len(scored) == 8  # max_steps 1: one round of micro_batch_size 4 x 2 accumulation steps
    assert all(r["errors"] == [] and [name for name, _ in r["rewards"]] == ["remote:nemo_gym"] for r in scored)
    url = listed_servers(ng_run)["reasoning_gym"]
    for r in scored:
        row = json.loads(r["nemo_gym"])
        assert r["reward"] == _asked(url, row, r["completion"])
        assert r["prompt"] == row["responses_create_params"]["input"]
