"""The vLLM engines against real vLLM (no mocks): LoRA versions, full-weight updates in
place, the vllm_server engine on a real `vllm serve`, and sampling log-probs that agree
with the trainer's own (stages.training.logprobs.completion_logps) on the same tokens.

One tiny Qwen2 (hidden 128, 2 heads of 64, 2 layers) and one engine per module: the engine
start costs ~30 s and the server start ~1 minute on 2 CPU cores.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:  # not imported: collection on every pytest-xdist worker would import it
    pytest.skip("vllm is not installed", allow_module_level=True)  # (~3 s of CPU each)

pytestmark = pytest.mark.slow

TEMPERATURE = 0.7
# Both sides run in float32 on the same weights; what differs is kernel arithmetic
# (vLLM's CPU attention and fused/sharded matmuls vs eager transformers, LoRA applied as
# punica adds vs PEFT). Measured gaps are ~1e-5 per token; 1e-3 is far below what
# would matter for an importance ratio (exp(1e-3) - 1 = 0.1 %) and far above fp32 noise,
# while a wrong temperature, adapter, weight version or token offset gives gaps of 0.1-1+.
LOGP_TOL = 1e-3
PROMPTS = [[{"role": "user", "content": f"largest of {a} {b} {c}"}] for a, b, c in
           [(1, 7, 3), (9, 2, 4), (5, 5, 8), (0, 6, 2)]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Base model folder, two LoRA adapter versions and a full-weights folder whose EOS is likely."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.data.base_model import BaseModelConfig, run

    root = tmp_path_factory.mktemp("vllm")
    texts = [f"<|im_start|>user\nlargest of {i % 10} {i * 7 % 10} {i * 3 % 10}<|im_end|>\n"
             f"<|im_start|>assistant\n{max(i % 10, i * 7 % 10, i * 3 % 10)}<|im_end|>" for i in range(200)]
    cfg = BaseModelConfig(vocab_size=300, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                          intermediate_size=256, num_hidden_layers=2, max_position_embeddings=128)
    base = root / "base"
    run(cfg, texts, base)

    adapters = []
    for version in (1, 2):
        torch.manual_seed(version)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"], task_type="CAUSAL_LM"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3)
        out = root / "optimize" / f"round{version}" / "adapter"
        model.save_pretrained(out)
        adapters.append(out)

    # Full weights: perturbed everywhere, and EOS pushed up along the mean final hidden state
    # so that some completions stop (tests the EOS handling).
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        ids = tokenizer(tokenizer.apply_chat_template(PROMPTS[0], tokenize=False, add_generation_prompt=True),
                        return_tensors="pt", add_special_tokens=False)["input_ids"]
        h = model(ids, output_hidden_states=True).hidden_states[-1][0].mean(0)
        emb = model.get_input_embeddings().weight
        emb[tokenizer.eos_token_id] += 4.0 * h / h.dot(h)
    full = root / "optimize" / "round3" / "model"
    model.save_pretrained(full)
    tokenizer.save_pretrained(full)
    return {"base": base, "adapters": adapters, "full": full, "eos": tokenizer.eos_token_id}


@pytest.fixture(scope="module")
def engine(tiny):
    from stages.rollout.engines.vllm_local import VLLMEngine

    eng = VLLMEngine(tiny["base"], gpu_memory_utilization=0.05, kv_cache_space_gib=0.25, max_model_len=128,
                     dtype="float32", tensor_parallel_size=1, enforce_eager=True, max_lora_rank=8,
                     lora_sync="adapter")
    yield eng
    eng.close()


def sampling(**kw):
    from stages.rollout.engines import Sampling

    return Sampling(**{"max_new_tokens": 12, "temperature": TEMPERATURE, "seed": 7, **kw})


def trainer_logps(model_dir: Path, adapter_dir: Path | None, rows: list[dict]) -> list[list[float]]:
    """The optimize stage's log-probs of each row's completion tokens (stages.training.logprobs.completion_logps)."""
    import torch

    from stages.runtime.policy import load_policy
    from stages.training.logprobs import completion_logps

    model, _ = load_policy(model_dir, adapter_dir, merge=False)
    out = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["prompt_token_ids"] + row["completion_token_ids"]])
            logps, _ = completion_logps(model, ids, torch.ones_like(ids), len(row["completion_token_ids"]),
                                        TEMPERATURE)
            out.append(logps[0].tolist())
    return out


def assert_well_formed(rows, tokenizer_dir, max_new_tokens, eos):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    for prompt, row in zip(PROMPTS, rows):
        text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        assert row["prompt_token_ids"] == tok(text, add_special_tokens=False)["input_ids"]
        assert len(row["sampling_logprobs"]) == len(row["completion_token_ids"])
        assert all(lp <= 0 for lp in row["sampling_logprobs"])
        assert row["completion"] == tok.decode(row["completion_token_ids"], skip_special_tokens=True)
        if row["finish_reason"] == "stop":
            assert row["completion_token_ids"][-1] == eos
            assert eos not in row["completion_token_ids"][:-1]
        else:
            assert row["finish_reason"] == "length"
            assert len(row["completion_token_ids"]) == max_new_tokens and eos not in row["completion_token_ids"]


def assert_logps_close(rows, expected):
    for row, exp in zip(rows, expected):
        gap = max(abs(a - b) for a, b in zip(row["sampling_logprobs"], exp))
        assert gap < LOGP_TOL, (gap, row["sampling_logprobs"], exp)


def test_lora_versions_and_logprobs(engine, tiny):
    from stages.rollout.engines import Policy

    base_policy = Policy(tiny["base"])
    v1, v2 = (Policy(tiny["base"], adapter_dir=a, version=i + 1) for i, a in enumerate(tiny["adapters"]))
    progress = []
    base_rows = engine.generate(base_policy, PROMPTS, sampling(), on_progress=progress.append)
    assert sum(progress) == len(PROMPTS)
    rows1 = engine.generate(v1, PROMPTS, sampling())
    rows2 = engine.generate(v2, PROMPTS, sampling())
    toks = lambda rows: [r["completion_token_ids"] for r in rows]  # noqa: E731
    assert toks(rows1) != toks(base_rows) and toks(rows2) != toks(rows1) and toks(rows2) != toks(base_rows)
    assert len(engine._lora_ids) == 2  # one LoRARequest id per adapter version
    assert toks(engine.generate(v1, PROMPTS, sampling())) == toks(rows1)  # seeded: reproducible
    assert_well_formed(rows1, tiny["base"], 12, tiny["eos"])
    assert_logps_close(rows1, trainer_logps(tiny["base"], tiny["adapters"][0], rows1))
    assert_logps_close(base_rows, trainer_logps(tiny["base"], None, base_rows))
    greedy = engine.generate(v2, PROMPTS, sampling(do_sample=False))
    assert toks(greedy) == toks(engine.generate(v2, PROMPTS, sampling(do_sample=False, seed=99)))


def test_lora_merged_into_the_weights(engine, tiny):
    """lora_sync: merged (auto's choice on CPU): each adapter version is merged once and loaded in place; the
    log-probs are the trainer's for base + adapter, as with vLLM's LoRA kernels; the base comes back after."""
    from stages.rollout.engines import Policy

    v1, v2 = (Policy(tiny["base"], adapter_dir=a, version=i + 1) for i, a in enumerate(tiny["adapters"]))
    base_policy = Policy(tiny["base"])
    base_rows = engine.generate(base_policy, PROMPTS, sampling())
    engine.lora_sync = "merged"
    try:
        assert engine.merges_lora()
        reloads, merges = engine.weight_reloads, engine.merges
        rows1 = engine.generate(v1, PROMPTS, sampling())
        first_folder = engine.loaded_weights
        assert (engine.weight_reloads, engine.merges) == (reloads + 1, merges + 1)
        assert_well_formed(rows1, tiny["base"], 12, tiny["eos"])
        assert_logps_close(rows1, trainer_logps(tiny["base"], tiny["adapters"][0], rows1))
        assert [r["completion_token_ids"] for r in engine.generate(v1, PROMPTS, sampling())] == \
            [r["completion_token_ids"] for r in rows1]
        assert (engine.weight_reloads, engine.merges) == (reloads + 1, merges + 1)  # same version: kept
        rows2 = engine.generate(v2, PROMPTS, sampling())
        assert (engine.weight_reloads, engine.merges) == (reloads + 2, merges + 2)
        assert not first_folder.exists()  # the previous merged folder is gone once the new one is loaded
        assert_logps_close(rows2, trainer_logps(tiny["base"], tiny["adapters"][1], rows2))
        back = engine.generate(base_policy, PROMPTS, sampling())
        assert [r["completion_token_ids"] for r in back] == [r["completion_token_ids"] for r in base_rows]
    finally:
        engine.lora_sync = "adapter"


def test_full_weight_update(engine, tiny):
    """Full fine-tuning: a new weights folder changes the outputs in place (same LLM object, no
    restart), and the log-probs are the new model's."""
    from stages.rollout.engines import Policy

    in_place = True

    base_policy = Policy(tiny["base"])
    full = Policy(tiny["base"], weights_dir=tiny["full"], version=3)
    base_rows = engine.generate(base_policy, PROMPTS, sampling(max_new_tokens=24))
    llm, reloads = engine.llm, engine.weight_reloads
    rows = engine.generate(full, PROMPTS, sampling(max_new_tokens=24))
    assert (engine.llm is llm) == in_place and engine.weight_reloads == reloads + 1
    assert [r["completion_token_ids"] for r in rows] != [r["completion_token_ids"] for r in base_rows]
    assert any(r["finish_reason"] == "stop" for r in rows)  # EOS kept as the last token
    assert_well_formed(rows, tiny["base"], 24, tiny["eos"])
    assert_logps_close(rows, trainer_logps(tiny["full"], None, rows))
    engine.generate(full, PROMPTS, sampling(max_new_tokens=24))
    assert engine.weight_reloads == reloads + 1  # same folder: nothing reloaded
    back = engine.generate(base_policy, PROMPTS, sampling(max_new_tokens=24))
    assert engine.weight_reloads == reloads + 2
    assert [r["completion_token_ids"] for r in back] == [r["completion_token_ids"] for r in base_rows]


def test_engine_steps_wait_for_a_model_load_in_another_thread(engine, tiny):
    """A prefetched rollout beside a stage loading a model: the engine takes no step while a load holds
    MODEL_LOADING (a bf16 load sets torch's default dtype process-wide, which the torch.compile'd functions
    vLLM runs each step guard on), and the same completions once the load is done."""
    import threading
    import time

    import torch

    from stages.rollout.engines import Policy
    from stages.runtime.policy import MODEL_LOADING

    policy = Policy(tiny["base"])
    expected = engine.generate(policy, PROMPTS, sampling(max_new_tokens=8))
    box = {}
    with MODEL_LOADING:  # what a load in bf16 does to the process while it holds the lock
        torch.set_default_dtype(torch.bfloat16)
        try:
            thread = threading.Thread(target=lambda: box.update(rows=engine.generate(policy, PROMPTS,
                                                                                     sampling(max_new_tokens=8))))
            thread.start()
            time.sleep(3)
            assert thread.is_alive() and "rows" not in box  # waiting for its first step
        finally:
            torch.set_default_dtype(torch.float32)
    thread.join(120)
    assert [r["completion_token_ids"] for r in box["rows"]] == [r["completion_token_ids"] for r in expected]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(base_dir: Path, log: Path):
    """A real `vllm serve` on loopback (from serve_command): yields (url, process); terminated at exit."""
    from stages.rollout.engines.vllm_server import serve_command, wait_until_healthy

    port = _free_port()
    argv, env = serve_command(base_dir, port, 8, {"dtype": "float32", "gpu_memory_utilization": 0.05,
                                                  "kv_cache_space_gib": 0.25, "max_model_len": 128,
                                                  "enforce_eager": True})
    with open(log, "wb") as fh:
        # its own process group: vLLM's engine-core and worker processes are stopped with it
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, proc, 600, log)
        yield url, proc
    finally:
        _stop_server(proc)


def _stop_server(proc) -> None:
    """SIGTERM a server's process group, up to 60 s to exit, then SIGKILL what outlived it (or all of it)."""
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    with serving(tiny["base"], tmp_path_factory.mktemp("server") / "server.log") as (url, _):
        yield url


@pytest.fixture(scope="module")
def second_server(tiny, tmp_path_factory):
    """Another replica of `server`, for data-parallel generation; the last test stops it."""
    with serving(tiny["base"], tmp_path_factory.mktemp("server2") / "server.log") as (url, proc):
        yield {"url": url, "proc": proc}


def test_server_engine(server, tiny):
    from stages.rollout.engines import Policy
    from stages.rollout.engines.vllm_server import VLLMServerEngine

    eng = VLLMServerEngine(tiny["base"], server_url=server, server_timeout_s=120, server_adapter_root=None,
                           max_lora_rank=8, lora_sync="adapter")
    try:
        v1 = Policy(tiny["base"], adapter_dir=tiny["adapters"][0], version=1)
        v2 = Policy(tiny["base"], adapter_dir=tiny["adapters"][1], version=2)
        progress = []
        rows1 = eng.generate(v1, PROMPTS, sampling(), on_progress=progress.append)
        assert sum(progress) == len(PROMPTS)
        rows2 = eng.generate(v2, PROMPTS, sampling())
        base_rows = eng.generate(Policy(tiny["base"]), PROMPTS, sampling())
        toks = lambda rows: [r["completion_token_ids"] for r in rows]  # noqa: E731
        assert toks(rows1) != toks(rows2) and toks(rows1) != toks(base_rows)
        assert toks(eng.generate(v1, PROMPTS, sampling())) == toks(rows1)
        assert_well_formed(rows1, tiny["base"], 12, tiny["eos"])
        assert_logps_close(rows1, trainer_logps(tiny["base"], tiny["adapters"][0], rows1))
        assert_logps_close(rows2, trainer_logps(tiny["base"], tiny["adapters"][1], rows2))
        assert eng.weight_loads == 0  # adapters only: the server kept the weights it started with
    finally:
        eng.close()


def _weight_version(url: str) -> str | None:
    import httpx

    return httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"]


def test_server_takes_full_weights_and_merged_adapters_in_place(server, tiny):
    """Full fine-tuning and lora_sync merged (auto's choice for a server on CPU): the round's weights go into the
    running server in place (/collective_rpc, no restart); its log-probs are the trainer's for those weights, the
    server records which folder it holds, a new engine reads that and puts the base back before sampling it."""
    from stages.rollout.engines import Policy
    from stages.rollout.engines.vllm_server import VLLMServerEngine

    toks = lambda rows: [r["completion_token_ids"] for r in rows]  # noqa: E731
    eng = VLLMServerEngine(tiny["base"], server_url=server, server_timeout_s=120, max_lora_rank=8)
    try:
        base_rows = eng.generate(Policy(tiny["base"]), PROMPTS, sampling())
        full = eng.generate(Policy(tiny["base"], weights_dir=tiny["full"], version=3), PROMPTS, sampling())
        assert eng.weight_loads == 1 and _weight_version(server) == f"posttrain:{tiny['full'].resolve()}"
        assert toks(full) != toks(base_rows)
        assert_well_formed(full, tiny["base"], 12, tiny["eos"])
        assert_logps_close(full, trainer_logps(tiny["full"], None, full))

        v1, v2 = (Policy(tiny["base"], adapter_dir=a, version=i + 1) for i, a in enumerate(tiny["adapters"]))
        rows1 = eng.generate(v1, PROMPTS, sampling())  # auto: merged on this CPU server
        first_merged = eng._merged.folder(v1)
        assert eng.weight_loads == 2 and _weight_version(server) == f"posttrain:{first_merged.resolve()}"
        assert_logps_close(rows1, trainer_logps(tiny["base"], tiny["adapters"][0], rows1))
        assert toks(eng.generate(v1, PROMPTS, sampling())) == toks(rows1) and eng.weight_loads == 2  # kept
        rows2 = eng.generate(v2, PROMPTS, sampling())
        assert eng.weight_loads == 3 and not first_merged.exists()  # the last version's folder is gone once loaded
        assert_logps_close(rows2, trainer_logps(tiny["base"], tiny["adapters"][1], rows2))
    finally:
        eng.close()
    fresh = VLLMServerEngine(tiny["base"], server_url=server, server_timeout_s=120, max_lora_rank=8,
                             lora_sync="adapter")
    try:  # the server still holds v2's merged weights: a new engine sees it and loads the base back
        assert toks(fresh.generate(Policy(tiny["base"]), PROMPTS, sampling())) == toks(base_rows)
        assert fresh.weight_loads == 1 and _weight_version(server) == f"posttrain:{tiny['base'].resolve()}"
    finally:
        fresh.close()


def test_server_down_is_a_clear_error(tiny):
    from stages.rollout.engines import Policy
    from stages.rollout.engines.vllm_server import VLLMServerEngine, VLLMServerError

    url = f"http://127.0.0.1:{_free_port()}"
    eng = VLLMServerEngine(tiny["base"], server_url=url, server_timeout_s=5, server_adapter_root=None, max_lora_rank=8)
    with pytest.raises(VLLMServerError, match=f"no vLLM server answers at {url}.*posttrain vllm-serve CONFIG"):
        eng.generate(Policy(tiny["base"]), PROMPTS, sampling())
    urls = [url, f"http://127.0.0.1:{_free_port()}"]
    several = VLLMServerEngine(tiny["base"], server_urls=urls, server_timeout_s=5, max_lora_rank=8)
    with pytest.raises(VLLMServerError, match="none of rollout.vllm.server_urls answers.*"
                                              f"no vLLM server answers at {urls[1]}"):
        several.generate(Policy(tiny["base"]), PROMPTS, sampling())
    from flows.launch import input_errors

    assert issubclass(VLLMServerError, input_errors())  # `posttrain run` prints it without a traceback


def test_serve_command_and_adapter_root(tiny):
    from stages.rollout.engines.vllm_server import adapter_path, serve_command

    argv, env = serve_command(tiny["base"], 8123, 16, {"dtype": "bfloat16", "max_model_len": 64,
                                                       "kv_cache_space_gib": 1.5})
    assert argv[1:5] == ["-m", "stages.rollout.engines.vllm_api_server", "--model", str(tiny["base"])]
    for flag, value in [("--port", "8123"), ("--max-lora-rank", "16"), ("--dtype", "bfloat16"),
                        ("--max-model-len", "64"), ("--logprobs-mode", "processed_logprobs"),
                        ("--host", "127.0.0.1")]:
        assert argv[argv.index(flag) + 1] == value
    assert "--enable-lora" in argv and "--enforce-eager" in argv
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                   "VLLM_CPU_KVCACHE_SPACE": "2"}
    # on CPU the in-process engine's step budget, which keeps every prefill whole (vLLM 0.32's CPU runner fails
    # on a split one: "CPU Generator does not use offset", met at 128 requests in flight)
    assert (argv[argv.index("--max-num-seqs") + 1], argv[argv.index("--max-num-batched-tokens") + 1]) == (
        "256", str(256 * 64))
    adapter = tiny["adapters"][0]
    assert adapter_path(adapter, "/mnt/art") == "/mnt/art/optimize/round1/adapter"
    assert adapter_path(adapter, None) == str(adapter.resolve())


MANY = [[{"role": "user", "content": f"largest of {a} {b} {c}"}] for a in range(4) for b in range(4) for c in range(3)]


def _same_completions(got: list[dict], expected: list[dict]) -> None:
    """Equal tokens and (to float noise) equal log-probs, prompt by prompt."""
    assert [r["completion_token_ids"] for r in got] == [r["completion_token_ids"] for r in expected]
    gap = max(abs(a - b) for g, e in zip(got, expected) for a, b in zip(g["sampling_logprobs"], e["sampling_logprobs"]))
    assert gap < 1e-6, gap


class _ResettingProxy:
    """A TCP proxy in front of a real server that resets (RST) the connection carrying the `reset_at`-th
    POST /v1/completions instead of passing it on, as uvicorn does to a keep-alive connection it closes
    while idle just as a request arrives on it. Everything else is passed through unchanged."""

    def __init__(self, upstream: str, reset_at: int):
        import threading

        self.upstream = ("127.0.0.1", int(upstream.rsplit(":", 1)[1]))
        self.reset_at, self.posts, self.resets = reset_at, 0, 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        import struct

        try:
            while chunk := src.recv(65536):
                if from_client and chunk.startswith(b"POST /v1/completions"):
                    with self.lock:
                        self.posts += 1
                        reset = self.posts == self.reset_at
                        self.resets += reset
                    if reset:
                        src.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        break
                dst.sendall(chunk)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        self.listener.close()


def test_a_reset_connection_is_sent_again_not_a_lost_server(server, tiny, caplog):
    """One connection reset mid-round by a server that still answers costs one resend: the completions
    are the ones the server gives directly, and no server is dropped."""
    from stages.rollout.engines import Policy
    from stages.rollout.engines.vllm_server import VLLMServerEngine

    policy = Policy(tiny["base"], version=0)
    direct = VLLMServerEngine(tiny["base"], server_url=server, server_timeout_s=120, max_lora_rank=8)
    proxy = _ResettingProxy(server, reset_at=3)
    through = VLLMServerEngine(tiny["base"], server_url=proxy.url, server_timeout_s=120, max_lora_rank=8,
                               max_concurrency=2)
    try:
        expected = direct.generate(policy, MANY[:8], sampling(seed=5))
        with caplog.at_level(logging.INFO, logger="stages.rollout.engines.vllm_server"):
            got = through.generate(policy, MANY[:8], sampling(seed=5))
        assert proxy.resets == 1 and proxy.posts == 9  # 8 prompts, one of them sent twice
        _same_completions(got, expected)
        assert "dropped a connection" in caplog.text and "stopped answering" not in caplog.text
    finally:
        direct.close()
        through.close()
        proxy.close()


def test_two_servers_give_one_servers_completions(server, second_server, tiny):
    """Data parallel over two replicas: both serve a share, and per-prompt seeds make the result the
    single server's, for every adapter version (each loaded on both servers)."""
    from stages.rollout.engines import Policy
    from stages.rollout.engines.vllm_server import VLLMServerEngine

    one = VLLMServerEngine(tiny["base"], server_url=server, server_timeout_s=120, max_lora_rank=8)
    two = VLLMServerEngine(tiny["base"], server_urls=[server, second_server["url"]], server_timeout_s=120,
                           max_lora_rank=8, max_concurrency=4)
    try:
        for version, adapter in enumerate(tiny["adapters"], start=1):
            policy = Policy(tiny["base"], adapter_dir=adapter, version=version)
            expected = one.generate(policy, MANY, sampling())
            progress = []
            got = two.generate(policy, MANY, sampling(), on_progress=progress.append)
            assert sum(progress) == len(MANY)
            _same_completions(got, expected)
            served = {url: s["completions"] for url, s in two.last_call.items()}
            assert sum(served.values()) == len(MANY) and min(served.values()) > 0, served
    finally:
        one.close()
        two.close()


def test_server_processes_start_without_scikit_learn(second_server):
    """serve_command's module (vllm_api_server.py) imports `stages` first in the server and in each process vLLM
    spawns on the CPU (engine core, worker): transformers, loaded by all three, leaves scikit-learn unloaded
    (`python -m vllm.entrypoints.openai.api_server` loads it in each: 5-7 s more CPU a start,
    benchmarks/vllm_serve_start.py)."""
    group = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _process_group(int(pid)) ==
             second_server["proc"].pid]
    loaded = {pid: maps for pid in group if "libtorch" in (maps := _memory_map(pid))}
    # The API server and the worker it spawns; the engine core is a third process unless the server inherited
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 from this pytest process (set by an in-process engine, vllm_local.py).
    assert len(loaded) >= 2, group
    assert [pid for pid, maps in loaded.items() if "/sklearn/" in maps] == []


def _process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _memory_map(pid: int) -> str:
    """The files a process has mapped (its shared libraries among them); "" once it has exited."""
    try:
        return (Path("/proc") / str(pid) / "maps").read_text()
    except OSError:
        return ""


def test_a_server_stopped_mid_round_leaves_its_share_to_the_other(server, second_server, tiny, caplog):
    """Kill one replica while a round is being generated: the round finishes on the other, with the
    completions one server alone gives, and a warning naming the stopped server. Runs last: the
    second server stays down."""
    from stages.rollout.engines import Policy
    from stages.rollout.engines.vllm_server import VLLMServerEngine

    policy = Policy(tiny["base"], adapter_dir=tiny["adapters"][0], version=1)
    one = VLLMServerEngine(tiny["base"], server_url=server, server_timeout_s=120, max_lora_rank=8)
    two = VLLMServerEngine(tiny["base"], server_urls=[server, second_server["url"]], server_timeout_s=120,
                           max_lora_rank=8, max_concurrency=2)
    expected = one.generate(policy, MANY, sampling(seed=11))
    done = []

    def progress(n):
        done.append(n)
        if len(done) == 6:
            _signal_group(second_server["proc"], signal.SIGKILL)  # the server and its engine processes

    try:
        with caplog.at_level(logging.WARNING, logger="stages.rollout.engines.vllm_server"):
            got = two.generate(policy, MANY, sampling(seed=11), on_progress=progress)
        _same_completions(got, expected)
        assert sum(done) == len(MANY)
        assert f"vllm_server: {second_server['url']} stopped answering" in caplog.text
        served = two.last_call
        assert served[server]["completions"] + served[second_server["url"]]["completions"] == len(MANY)
        assert served[second_server["url"]]["completions"] < len(MANY) - 6
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stages.rollout.engines.vllm_server"):
            again = two.generate(policy, MANY[:8], sampling(seed=11))  # the next round: on the live server alone
        _same_completions(again, expected[:8])
        assert f"no vLLM server answers at {second_server['url']}" in caplog.text
        assert two.last_call[server]["completions"] == 8
    finally:
        one.close()
        two.close()


# The Ray tests of this file run on this file's pytest-xdist worker, not with the suite's other Ray tests
# (conftest.py): they need the module's `tiny` models and in-process `engine`, which a second worker would build
# again (a vLLM start, ~25 s of CPU), and their local Ray instance takes free ports and no dashboard, so it can
# run beside another worker's cluster.
WITH_THIS_FILE = pytest.mark.xdist_group(name="tests/test_vllm.py")


@pytest.fixture(scope="module")
def local_ray(ray_home):
    """A local Ray instance in this process (temporary HOME: Ray 2.60 keeps its auth token under ~/.ray)."""
    ray = pytest.importorskip("ray")
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_ADDRESS")}
    os.environ["HOME"] = str(ray_home)
    os.environ.pop("RAY_ADDRESS", None)
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024 * 1024)
    try:
        yield ray
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@WITH_THIS_FILE
def test_ray_vllm_engines_sample_as_the_in_process_engine(tiny, engine, local_ray, caplog):
    """Two vLLM engines in Ray actors: LoRA versions and full weights synced to both, the same completions
    as one in-process engine; an engine killed before a round costs nothing but its share's time, and
    the next round starts a replacement."""
    from stages.rollout.engines import Policy
    from stages.rollout.engines.ray_vllm import RayVLLMEngine

    ray_engine = RayVLLMEngine(tiny["base"], num_engines=2, num_cpus_per_engine=1, gpu_memory_utilization=0.05,
                               kv_cache_space_gib=0.25, max_model_len=128, dtype="float32", tensor_parallel_size=1,
                               enforce_eager=True, max_lora_rank=8, lora_sync="adapter")  # as `engine`
    policies = [Policy(tiny["base"], adapter_dir=tiny["adapters"][0], version=1),
                Policy(tiny["base"], adapter_dir=tiny["adapters"][1], version=2),
                Policy(tiny["base"], weights_dir=tiny["full"], version=3)]
    try:
        for policy in policies:
            progress = []
            got = ray_engine.generate(policy, MANY, sampling(), on_progress=progress.append)
            _same_completions(got, engine.generate(policy, MANY, sampling()))
            assert sum(progress) == len(MANY)
            assert [share["completions"] for share in ray_engine.last_call.values()] == [len(MANY) // 2] * 2
        assert len({node_pid for node_pid in ray_engine.placement()}) == 2

        policy = policies[0]
        local_ray.kill(ray_engine.actors[1], no_restart=True)
        with caplog.at_level(logging.WARNING, logger="stages.rollout.engines.ray_vllm"):
            got = ray_engine.generate(policy, MANY, sampling(seed=5))
        _same_completions(got, engine.generate(policy, MANY, sampling(seed=5)))
        assert "ray_vllm: an engine was lost" in caplog.text
        assert [(s["completions"], s["lost"]) for s in ray_engine.last_call.values()] == [(len(MANY), False),
                                                                                           (0, True)]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stages.rollout.engines.ray_vllm"):
            ray_engine.generate(policy, MANY[:4], sampling())
        assert "starting 1 engine(s) in place of those lost" in caplog.text
        assert [s["completions"] for s in ray_engine.last_call.values()] == [2, 2]
    finally:
        ray_engine.close()


@WITH_THIS_FILE
def test_ray_vllm_engine_that_cannot_start_says_why(local_ray, tmp_path):
    from stages.rollout.engines import Policy
    from stages.rollout.engines.ray_vllm import RayVLLMEngine, RayVLLMError

    missing = tmp_path / "no-model"
    ray_engine = RayVLLMEngine(missing, num_engines=1, startup_timeout_s=300, max_model_len=128,
                               kv_cache_space_gib=0.25)
    with pytest.raises(RayVLLMError,
                       match=f"(?s)a vLLM engine on {missing} failed to start on its Ray actor.*no-model"):
        ray_engine.generate(Policy(missing), PROMPTS, sampling())
    assert ray_engine.actors == []


def _ask_policy_server(url: str, n: int = 2) -> dict:
    """One Atropos-environment request to a PolicyServer: PROMPTS[0], n samples at TEMPERATURE, log-probs."""
    import httpx

    body = {"model": "policy", "messages": PROMPTS[0], "n": n, "max_tokens": 12, "temperature": TEMPERATURE,
            "logprobs": True}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()


def _as_rows(answer: dict) -> list[dict]:
    return [{"prompt_token_ids": answer["prompt_token_ids"], "completion_token_ids": c["token_ids"],
             "sampling_logprobs": [t["logprob"] for t in c["logprobs"]["content"]]} for c in answer["choices"]]


def test_atropos_policy_server_on_a_vllm_server_with_the_round_adapter(server, tiny):
    """rollout.source: atropos with rollout.engine vllm_server: the policy server the environments call
    samples through a real `vllm serve`, with the round's LoRA adapter loaded per policy version; its
    answers' log-probs are the optimize stage's for that adapter."""
    from stages.rollout import atropos
    from stages.rollout.engines import Policy
    from stages.rollout.engines.vllm_server import VLLMServerEngine

    engine = VLLMServerEngine(tiny["base"], server_url=server, server_timeout_s=120, server_adapter_root=None,
                              max_lora_rank=8, lora_sync="adapter")
    url = f"http://127.0.0.1:{_free_port()}"
    policy_server = atropos.PolicyServer(url, engine, Policy(tiny["base"], adapter_dir=tiny["adapters"][0], version=1))
    try:
        first = _ask_policy_server(url)
        policy_server.policy = Policy(tiny["base"], adapter_dir=tiny["adapters"][1], version=2)  # the next round
        second = _ask_policy_server(url)
    finally:
        policy_server.close()
        engine.close()
    assert (first["policy_version"], second["policy_version"]) == (1, 2)
    assert_logps_close(_as_rows(first), trainer_logps(tiny["base"], tiny["adapters"][0], _as_rows(first)))
    assert_logps_close(_as_rows(second), trainer_logps(tiny["base"], tiny["adapters"][1], _as_rows(second)))


def test_atropos_policy_server_serves_full_weights(engine, tiny):
    """grpo.adapter: none under rollout.source: atropos: the policy server samples the round's full weights
    (the in-process vLLM engine takes them in place), and says which version they are."""
    from stages.rollout import atropos
    from stages.rollout.engines import Policy

    url = f"http://127.0.0.1:{_free_port()}"
    policy_server = atropos.PolicyServer(url, engine, Policy(tiny["base"], weights_dir=tiny["full"], version=4))
    try:
        answer = _ask_policy_server(url)
    finally:
        policy_server.close()
    assert answer["policy_version"] == 4
    assert_logps_close(_as_rows(answer), trainer_logps(tiny["full"], None, _as_rows(answer)))


def test_weight_reload_waits_for_a_model_load_in_another_thread(engine, tiny):
    """vLLM's in-place weight reload re-creates every parameter; a transformers load in another thread (the
    eval beside a prefetched rollout) patches nn.Module process-wide and would put them on the meta device
    ("Cannot copy out of meta tensor", issue 42). The reload waits for MODEL_LOADING like an engine step."""
    import threading
    import time

    from stages.rollout.engines import Policy
    from stages.runtime.policy import MODEL_LOADING

    base, full = Policy(tiny["base"]), Policy(tiny["base"], weights_dir=tiny["full"], version=3)
    engine.generate(base, PROMPTS, sampling(max_new_tokens=4))  # the base weights loaded
    expected = engine.generate(full, PROMPTS, sampling(max_new_tokens=8))
    engine.generate(base, PROMPTS, sampling(max_new_tokens=4))
    reloads, box = engine.weight_reloads, {}
    with MODEL_LOADING:
        thread = threading.Thread(target=lambda: box.update(rows=engine.generate(full, PROMPTS,
                                                                                 sampling(max_new_tokens=8))))
        thread.start()
        time.sleep(3)
        assert thread.is_alive() and engine.weight_reloads == reloads  # the reload has not started
    thread.join(120)
    assert engine.weight_reloads == reloads + 1
    assert [r["completion_token_ids"] for r in box["rows"]] == [r["completion_token_ids"] for r in expected]


def test_prefetched_vllm_rounds_with_evals_between_them(prefect_harness, tiny_config, tmp_path):
    """The quickstart's shape on vLLM (issue 42): LoRA merged into the engine's weights each round, rollouts
    prefetched a round ahead, and an eval after every round loading the policy beside the next round's
    reload. Every round and eval finishes, and a rerun computes nothing."""
    from flows.pipeline import posttrain_pipeline

    from conftest import computed

    overrides = ["rollout.engine=vllm", "rollout.async_prefetch=true", "grpo.rounds=4", "eval.every_rounds=1",
                 "rollout.vllm.kv_cache_space_gib=0.25"]
    first = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    stages = computed(first)
    assert {"rollout r0", "rollout r1", "rollout r2", "rollout r3", "eval r0", "eval r1", "eval r2",
            "eval final"} <= set(stages), stages
    rollouts = pq_rows(tmp_path / "artifacts" / "rollout")
    assert {row["engine"] for row in rollouts} == {"vllm"}
    assert sorted({(row["round_index"], row["policy_version"]) for row in rollouts}) == [(0, 0), (1, 0), (2, 1),
                                                                                         (3, 2)]
    assert computed(posttrain_pipeline(str(tiny_config), overrides, quiet=True)) == []


def pq_rows(stage_dir: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [row for path in sorted(stage_dir.glob("*/rollouts.parquet")) for row in pq.read_table(path).to_pylist()]


def test_two_terminals_posttrain_vllm_serve_then_run(prefect_harness, tiny_config, tmp_path, caplog):
    """axolotl's two-terminal workflow (issue 45 item 2) with axolotl's keys: `posttrain vllm-serve config.yaml`
    in one process builds (here: finds) the starting policy and execs vLLM's OpenAI server for it; the run, started
    once the server's command line is printed, waits for it (trl.vllm_server_timeout) and generates every round
    there, the round's LoRA adapter loaded into the server (trl.vllm_lora_sync: true; without it, on CPU, the
    adapter is merged into the weights first: test_server_takes_full_weights_and_merged_adapters_in_place)."""
    import sys
    import time

    import httpx
    import yaml

    from flows.pipeline import posttrain_pipeline

    port = _free_port()
    config = yaml.safe_load(tiny_config.read_text())
    config["rollout"]["vllm"] = {"kv_cache_space_gib": 0.25}
    config["vllm"] = {"host": "0.0.0.0", "port": port, "max_model_len": 128}  # where vllm-serve listens
    config["adapter"] = "lora"  # as axolotl's Quick Start (without it axolotl, and posttrain, train the whole model)
    config["trl"] = {"use_vllm": True, "vllm_mode": "server", "vllm_server_host": "0.0.0.0",
                     "vllm_server_port": port, "vllm_server_timeout": 600,
                     "vllm_lora_sync": True}  # as axolotl's Quick Start: the adapter goes to the server as it is
    tiny_config.write_text(yaml.safe_dump(config))
    log = tmp_path / "vllm-serve.log"
    repo = Path(__file__).resolve().parent.parent
    # as a user's shell starts it: without the VLLM_ENABLE_V1_MULTIPROCESSING=0 an in-process engine of this pytest
    # process set (vllm_local.py), so vLLM runs its engine core in a process of its own, as it does for users
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with open(log, "wb") as fh:  # its own process group: vLLM's engine-core process is stopped with it
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "vllm-serve", str(tiny_config), "--quiet"],
                                cwd=repo, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**env, "PREFECT_API_URL": prefect_harness,  # the session's server
                                     "PREFECT_HOME": str(tmp_path / "prefect")})
    try:
        deadline = time.monotonic() + 300
        while "stages.rollout.engines.vllm_api_server" not in log.read_text(errors="replace"):  # the policy is ready
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(1)
        command = next(line for line in log.read_text().splitlines() if "vllm_api_server" in line)
        assert f"--host 0.0.0.0 --port {port} --worker-extension-cls" in command and "--max-model-len 128" in command
        assert "--enable-lora" in command and "VLLM_SERVER_DEV_MODE=1" in command
        with caplog.at_level(logging.WARNING, logger="stages.rollout.engines.vllm_server"):
            results = posttrain_pipeline(str(tiny_config), quiet=True)
        url = f"http://127.0.0.1:{port}"
        assert "waiting up to" in caplog.text and f"for the vLLM server at {url}" in caplog.text
        rollouts = pq_rows(tmp_path / "artifacts" / "rollout")
        assert {row["engine"] for row in rollouts} == {"vllm_server"}
        assert sorted({(row["round_index"], row["policy_version"]) for row in rollouts}) == [(0, 0), (1, 1)]
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        served = {m["id"]: m["root"] for m in models}
        base = next(m for m in models if not m.get("parent"))
        policy = next(r for r in results["stages"] if r["stage"] == "sft")["path"]
        assert Path(base["root"]).resolve() == Path(policy).resolve()  # the config's starting policy
        adapters = [root for name, root in served.items() if name.startswith("policy-v1-")]
        assert len(adapters) == 1 and "/optimize/" in adapters[0]  # round 1's adapter, pushed by the run
        group = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _process_group(int(pid)) == proc.pid]
        assert len([pid for pid in group if "libtorch" in _memory_map(pid)]) == 3, group  # server, engine core, worker
    finally:
        _stop_server(proc)
