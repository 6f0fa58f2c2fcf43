"""benchmarks/gpu.py section 4: generation tokens/s, the transformers engine and (on CUDA, where installed) vLLM,
and `--attention-backends` (cuDNN attention on new shapes).
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path

from gpu_common import digit_prompts, free_memory, peak_memory, reset_peak, say, sync


def transformers_engine(batch_size: int, devices):
    from stages.rollout.engines.hf import TransformersEngine

    return TransformersEngine(batch_size=batch_size, devices=devices)


def generation(model_dir: Path, sizes: dict, devices, on_cuda: bool, skip_vllm: bool) -> dict:
    from transformers import AutoTokenizer

    from stages.rollout.engines import Policy, Sampling
    from stages.rollout.engines.hf import generate
    from stages.runtime.policy import load_policy

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = digit_prompts(tokenizer, sizes["gen_prompts"], sizes["gen_prompt_tokens"], seed=3)
    sampling = Sampling(max_new_tokens=sizes["gen_new_tokens"], temperature=1.0, seed=0)
    batch = len(prompts)
    out = {"prompts": len(prompts), "max_new_tokens": sampling.max_new_tokens, "batch_size": batch}
    engine = transformers_engine(batch, devices)
    say("generation: transformers engine warm-up")
    engine.generate(Policy(model_dir), prompts, Sampling(max_new_tokens=8, seed=1))
    free_memory()
    reset_peak(on_cuda)
    say(f"generation: transformers engine, {len(prompts)} prompts x {sampling.max_new_tokens} new tokens")
    started = time.perf_counter()
    rows = engine.generate(Policy(model_dir), prompts, sampling)
    sync()
    call_s = time.perf_counter() - started
    generated = sum(len(r["completion_token_ids"]) for r in rows)
    prompt_tokens = [len(r["prompt_token_ids"]) for r in rows]
    out["transformers"] = {"engine_call_s": round(call_s, 2), "generated_tokens": generated,
                           "engine_call_tokens_per_s": round(generated / call_s, 1),
                           "prompt_tokens_mean": round(statistics.mean(prompt_tokens), 1), **peak_memory(on_cuda)}
    engine.close()
    del rows
    free_memory()
    model, tokenizer = load_policy(model_dir, devices=devices)
    params = list(model.parameters())
    say("generation: generate() on the loaded policy")
    sync()
    started = time.perf_counter()
    rows = generate(model, tokenizer, prompts, sampling, batch)
    sync()
    generate_s = time.perf_counter() - started
    generated = sum(len(r["completion_token_ids"]) for r in rows)
    out["transformers"].update(generate_s=round(generate_s, 2), generate_tokens_per_s=round(generated / generate_s, 1),
                               policy_devices=sorted({str(p.device) for p in params}),
                               policy_dtypes=sorted({str(p.dtype) for p in params}))
    del model, params, rows
    free_memory()
    out["vllm"] = vllm_generation(model_dir, prompts, sampling, on_cuda, skip_vllm)
    return out


def attention_backends(model_dir: Path, sizes: dict, devices, on_cuda: bool) -> dict:
    """`generate` on shapes this process has not run before, with torch's cuDNN attention off, then on (its
    default): cuDNN builds an execution plan per new key length, which a decode pays at every step the first
    time a length is seen. Each is timed twice: first (new lengths) and again (the same lengths)."""
    import torch

    from stages.rollout.engines import Sampling
    from stages.rollout.engines.hf import generate
    from stages.runtime.policy import load_policy

    if not on_cuda:
        return {"measured": False, "why": "cuDNN attention is CUDA's"}
    model, tokenizer = load_policy(model_dir, devices=devices)
    out = {}
    for name, cudnn, prompt_tokens in (("cudnn_off", False, 160), ("cudnn_on", True, 96)):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        prompts = digit_prompts(tokenizer, sizes["gen_prompts"], prompt_tokens, seed=7)
        sampling = Sampling(max_new_tokens=sizes["gen_new_tokens"], temperature=1.0, seed=0)
        times = []
        for _ in range(2):
            sync()
            started = time.perf_counter()
            rows = generate(model, tokenizer, prompts, sampling, len(prompts))
            sync()
            times.append(round(time.perf_counter() - started, 2))
        generated = sum(len(r["completion_token_ids"]) for r in rows)
        out[name] = {"prompt_tokens": prompt_tokens, "first_s": times[0], "again_s": times[1],
                     "generated_tokens": generated}
    torch.backends.cuda.enable_cudnn_sdp(True)
    del model
    free_memory()
    return out


def vllm_generation(model_dir: Path, prompts: list, sampling, on_cuda: bool, skip_vllm: bool) -> dict:
    """The in-process vLLM engine in bf16 on the same prompts, where it can run; else why not."""
    if skip_vllm:
        return {"measured": False, "why": "--skip-vllm"}
    if importlib.util.find_spec("vllm") is None:
        return {"measured": False, "why": "vllm not installed"}
    if not on_cuda:
        return {"measured": False, "why": "not on a CUDA device (vLLM on CPU: benchmarks/rollout_engines.py)"}
    from stages.rollout.engines import Policy, Sampling
    from stages.rollout.engines.vllm_local import VLLMEngine

    say("generation: vLLM engine (bf16)")
    max_len = max(len(p[0]["content"]) for p in prompts) + sampling.max_new_tokens + 64
    engine = VLLMEngine(model_dir, gpu_memory_utilization=0.4, dtype="bfloat16", enforce_eager=False,
                        max_model_len=max_len)
    try:
        started = time.perf_counter()
        engine.start()
        engine.generate(Policy(model_dir), prompts[:4], Sampling(max_new_tokens=8, seed=1))
        start_s = time.perf_counter() - started
        started = time.perf_counter()
        rows = engine.generate(Policy(model_dir), prompts, sampling)
        call_s = time.perf_counter() - started
    finally:
        engine.close()
        free_memory()
    generated = sum(len(r["completion_token_ids"]) for r in rows)
    return {"measured": True, "start_s": round(start_s, 1), "engine_call_s": round(call_s, 2),
            "generated_tokens": generated, "engine_call_tokens_per_s": round(generated / call_s, 1)}
