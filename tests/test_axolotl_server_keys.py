"""axolotl's two-terminal workflow (issue 45 item 2): `axolotl vllm-serve config.yaml` in one terminal, `axolotl
train config.yaml` in another. Here `posttrain vllm-serve` starts vLLM's OpenAI server for the config and the run
generates on it: the server keys' mapping, the errors naming a key, the server command line, and the engine's
wait for a server that is still starting. tests/test_vllm.py runs the two terminals on a real server."""

from __future__ import annotations

import logging

import pytest

from flows.config import ConfigError, PipelineConfig, load_config

GRPO = "rl: grpo\nbase_model: {model}\n"


def load(tmp_path, text: str) -> PipelineConfig:
    (tmp_path / "model").mkdir(exist_ok=True)
    path = tmp_path / "axolotl.yaml"
    path.write_text(text.format(model=tmp_path / "model"))
    cfg = load_config(path)
    assert PipelineConfig.model_validate(cfg.run_config()) == cfg  # the saved config loads again
    return cfg


@pytest.mark.parametrize("text, url, serve_host, wait", [
    ("trl:\n  use_vllm: true\n  vllm_mode: server\n", "http://127.0.0.1:8000", "127.0.0.1", 0.0),
    ("vllm:\n  host: 0.0.0.0\n  port: 8011\ntrl:\n  use_vllm: true\n", "http://127.0.0.1:8011", "0.0.0.0", 0.0),
    ("trl:\n  use_vllm: true\n  vllm_server_host: gpu-box\n  vllm_server_port: 8001\n  vllm_server_timeout: 60\n",
     "http://gpu-box:8001", "127.0.0.1", 60.0),
    ("vllm:\n  host: 0.0.0.0\ntrl:\n  use_vllm: true\n  vllm_server_host: 10.0.0.5\n  vllm_mode: server\n",
     "http://10.0.0.5:8000", "0.0.0.0", 0.0),
    ("trl:\n  use_vllm: true\n  vllm_server_host: '::1'\n", "http://[::1]:8000", "127.0.0.1", 0.0),
], ids=["vllm_mode_server", "vllm_host_port", "trl_server_keys", "listen_and_connect_apart", "ipv6"])
def test_server_keys_make_the_run_generate_on_the_server(tmp_path, text, url, serve_host, wait):
    cfg = load(tmp_path, GRPO + text)
    assert (cfg.rollout.engine, cfg.rollout.vllm.server_urls) == ("vllm_server", [url])
    assert (cfg.rollout.vllm.serve_host, cfg.rollout.vllm.server_wait_s) == (serve_host, wait)
    assert cfg.grpo.adapter == "none"  # no `adapter:` key: axolotl's full fine-tuning, the weights go to the server


def test_colocate_and_no_server_keys_stay_in_process(tmp_path):
    for text in ("trl:\n  use_vllm: true\n", "trl:\n  use_vllm: true\n  vllm_mode: colocate\n"):
        cfg = load(tmp_path, GRPO + text)
        assert (cfg.rollout.engine, cfg.rollout.vllm.server_urls) == ("vllm", None)


@pytest.mark.parametrize("text, message", [
    ("trl:\n  use_vllm: false\n  vllm_server_port: 8000\n", r"trl.vllm_server_port: .* trl.use_vllm is false"),
    ("vllm:\n  host: 0.0.0.0\n", r"vllm.host: .* trl.use_vllm is null .*set trl.use_vllm: true"),
    ("trl:\n  use_vllm: true\n  vllm_mode: colocate\n  vllm_server_host: h\n",
     r"trl.vllm_server_host: .* trl.vllm_mode is 'colocate'"),
    ("vllm:\n  port: 8000\ntrl:\n  use_vllm: true\n  vllm_server_port: 8001\n",
     r"vllm.port .* and trl.vllm_server_port .* differ: 8000 and 8001"),
    ("trl:\n  use_vllm: true\n  vllm_server_port: '80x'\n", r"trl.vllm_server_port: '80x'; use a TCP port"),
    ("trl:\n  use_vllm: true\n  vllm_server_host: 'http://h:8000'\n", r"trl.vllm_server_host: 'http://h:8000'"),
    ("trl:\n  use_vllm: true\n  vllm_mode: server\n  vllm_server_timeout: -1\n",
     r"trl.vllm_server_timeout: -1; use seconds"),
    ("rollout:\n  engine: vllm\ntrl:\n  use_vllm: true\nvllm:\n  port: 8000\n",
     r"vllm.port: generating on a vLLM server is rollout.engine vllm_server, but rollout.engine is 'vllm'"),
    ("trl:\n  use_vllm: true\n  vllm_server_host: h\nrollout:\n  vllm:\n    server_urls: ['http://other:8000']\n",
     r"trl.vllm_server_host \(axolotl's key\) and rollout.vllm.server_urls are the same setting"),
], ids=["use_vllm_false", "no_use_vllm", "colocate_and_host",
        "ports_differ", "bad_port", "url_as_host", "negative_timeout", "other_engine", "server_urls_twice"])
def test_server_keys_posttrain_cannot_honour_are_errors_naming_them(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, GRPO + text)


def test_full_fine_tuning_generates_on_the_server_too(tmp_path):
    """The server takes each round's full weights in place (vllm_server: /collective_rpc), so a config that
    trains the whole model keeps axolotl's two terminals."""
    for text in ("adapter:\ntrl:\n  use_vllm: true\n  vllm_server_host: 0.0.0.0\n",
                 "grpo:\n  adapter: none\ntrl:\n  use_vllm: true\n  vllm_mode: server\n"):
        cfg = load(tmp_path, GRPO + text)
        assert (cfg.rollout.engine, cfg.grpo.adapter) == ("vllm_server", "none")
    cfg = PipelineConfig.model_validate({"rl": "grpo", "rollout": {"engine": "vllm_server"}, "grpo": {"adapter": "none"}})
    assert cfg.rollout.engine == "vllm_server"


def test_vllm_serve_refuses_a_bad_config_naming_the_key_under_both_spellings(tmp_path, capsys):
    from flows.cli import main

    (tmp_path / "model").mkdir()
    path = tmp_path / "axolotl.yaml"
    path.write_text(GRPO.format(model=tmp_path / "model") + "trl:\n  use_vllm: false\n  vllm_mode: server\n")
    for command in ("vllm-serve", "serve-vllm"):
        assert main([command, str(path), "--print"]) == 2
        assert "trl.vllm_mode: server: the vLLM server a run generates on, but trl.use_vllm is false" in \
            capsys.readouterr().err


def test_serve_command_listens_where_asked_and_enables_lora_for_a_lora_policy(tmp_path):
    from stages.rollout.engines.vllm_server import serve_command

    options = {"dtype": "bfloat16", "gpu_memory_utilization": 0.85, "tensor_parallel_size": 2, "max_model_len": 512,
               "enforce_eager": False}
    argv, env = serve_command(tmp_path / "model", 8011, 32, options, host="0.0.0.0")
    line = " ".join(argv)
    for flag in ("--host 0.0.0.0", "--port 8011", "--enable-lora", "--max-lora-rank 32", "--dtype bfloat16",
                 "--gpu-memory-utilization 0.85", "--tensor-parallel-size 2", "--max-model-len 512"):
        assert flag in line
    assert "--enforce-eager" not in argv and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    argv, env = serve_command(tmp_path / "model", 8011, 32, options, lora=False)
    assert "--enable-lora" not in argv and "--max-lora-rank" not in argv and "--host 127.0.0.1" in " ".join(argv)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    # every server takes full weights in place: vLLM's dev-mode /collective_rpc calling posttrain's worker extension
    assert argv[argv.index("--worker-extension-cls") + 1] == "stages.rollout.engines.vllm_local.WeightUpdateExtension"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"


def test_vllm_serve_enables_lora_only_where_the_adapter_is_sent_as_one():
    """On this CPU machine lora_sync auto merges the adapter into the weights (vLLM's CPU LoRA kernels cost ~4x):
    the server needs no LoRA; lora_sync adapter needs it; full fine-tuning never does."""
    from stages.rollout.engines.vllm_server import serves_adapters

    assert (serves_adapters("lora", "auto"), serves_adapters("lora", "merged")) == (False, False)
    assert serves_adapters("lora", "adapter") and not serves_adapters("none", "adapter")


def test_the_engine_waits_for_a_server_that_is_not_up_saying_what_for(tmp_path, caplog):
    import socket
    import time

    from stages.rollout.engines import Policy, Sampling
    from stages.rollout.engines.vllm_server import VLLMServerEngine, VLLMServerError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    engine = VLLMServerEngine(tmp_path, server_urls=[url], server_timeout_s=5, server_wait_s=3)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="stages.rollout.engines.vllm_server"):
        with pytest.raises(VLLMServerError, match=f"no vLLM server answers at {url}.*posttrain vllm-serve CONFIG"):
            engine.generate(Policy(tmp_path), [[{"role": "user", "content": "hi"}]], Sampling(max_new_tokens=2))
    assert time.monotonic() - start >= 3
    assert f"waiting up to 3 s for the vLLM server at {url} (start it with: posttrain vllm-serve CONFIG)" \
        in caplog.text
