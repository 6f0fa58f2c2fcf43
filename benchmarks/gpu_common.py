"""benchmarks/gpu.py's shared pieces: the sizes it runs at, timing and memory helpers, the random Qwen2 it
builds, its prompts and synthetic scored rows, and sections 1-2 (environment, the bf16 matmul peak).
benchmarks/dispatch_ops.py and compile_graphs.py build their models and rows with it too.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

QWEN25_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 4096}

SIZES = {
    "full": {
        "model": QWEN25_05B, "tokenizer_vocab": 4096, "matmul_n": 8192,
        # optimize
        "opt_prompts": 64, "opt_generations": 8, "opt_prompt_tokens": 128, "opt_completion_tokens": 384,
        "micro_batch": 16, "warmup_prompts": 2,
        # generation
        "gen_prompts": 64, "gen_prompt_tokens": 128, "gen_new_tokens": 256,
        # vs TRL
        "trl_prompts": 32, "trl_generations": 8, "trl_prompt_tokens": 128, "trl_new_tokens": 128,
        "trl_micro_batch": 16, "rollout_batch": 256,
    },
    "tiny": {
        "model": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 1, "num_key_value_heads": 1,
                  "intermediate_size": 128, "vocab_size": None, "max_position_embeddings": 256},
        "tokenizer_vocab": 300, "matmul_n": 256,
        "opt_prompts": 4, "opt_generations": 4, "opt_prompt_tokens": 16, "opt_completion_tokens": 24,
        "micro_batch": 8, "warmup_prompts": 2,
        "gen_prompts": 8, "gen_prompt_tokens": 16, "gen_new_tokens": 16,
        "trl_prompts": 4, "trl_generations": 4, "trl_prompt_tokens": 16, "trl_new_tokens": 16,
        "trl_micro_batch": 8, "rollout_batch": 16,
    },
}

STARTED = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f} s] {message}", flush=True)


def significant(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits (a CPU without bf16 matmul units reads ~0.001 TFLOP/s: rounding to
    decimals would make it 0)."""
    return float(f"{x:.{digits}g}")


def sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def reset_peak(on_cuda: bool) -> None:
    import torch

    if on_cuda:
        torch.cuda.reset_peak_memory_stats()


def peak_memory(on_cuda: bool) -> dict:
    import torch

    if not on_cuda:
        return {"peak_gpu_mem_gib": None}
    return {"peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}


# ---------------------------------------------------------------- the model


def tokenizer_corpus(n: int = 3000) -> list[str]:
    """Chat-formatted text of digits and words, so the template's markers get merged like real data."""
    rng = random.Random(0)
    words = ("the answer is which largest number of say repeat these digits list sum first last and then "
             "please think step by step about because therefore result value").split()
    texts = []
    for i in range(n):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))
        texts.append(f"<|im_start|>user\n{question} {rng.randint(0, 10**6)}<|im_end|>\n"
                     f"<|im_start|>assistant\n{answer} {i * 7}<|im_end|>")
    return texts


def build_model(folder: Path, sizes: dict, device) -> None:
    """A random-init Qwen2 of `sizes["model"]` (vocab_size None: the tokenizer's) in fp32, with a tokenizer
    trained here, saved to `folder`. Initialized on `device` (fast on a GPU), saved from there."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from stages.data.base_model import train_tokenizer

    tokenizer = train_tokenizer(tokenizer_corpus(), sizes["tokenizer_vocab"])
    dims = dict(sizes["model"])
    dims["vocab_size"] = max(dims["vocab_size"] or 0, len(tokenizer))
    config = Qwen2Config(**dims, tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    model = model.float()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    free_memory()


def model_folder(args, sizes: dict, work: Path, device) -> tuple[Path, str]:
    """(the model folder every section uses, where it came from)."""
    if args.model is None:
        built = "random-init Qwen2" + (" (tiny)" if args.tiny else " (Qwen2.5-0.5B dimensions)")
        folder = args.model_cache or work / "model"
        if args.model_cache and (folder / "config.json").exists():
            return folder, f"{built}, reused from {folder}"
        build_model(folder, sizes, device)
        return folder, f"{built} built here" + (f" (kept in {folder})" if args.model_cache else "")
    path = Path(args.model)
    if path.suffix == ".gguf":
        from stages.data import base_model

        folder = work / "model"
        base_model.run(base_model.BaseModelConfig(path=str(path.resolve())), [], folder)
        return folder, f"{path} (GGUF, dequantized to fp32)"
    return path, str(path)


def parameter_counts(folder: Path) -> dict:
    """N (all parameters, a tied embedding once), N_head (the lm_head's), N_body (those of the transformer
    blocks and norms: what every token runs through)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    body = total - embedding - (0 if tied else head)
    return {"n_params": total, "n_head": head, "n_body": body, "tied_embeddings": tied,
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers}


def digit_prompts(tokenizer, count: int, target_tokens: int, seed: int) -> list[list[dict]]:
    """`count` distinct chat prompts of about `target_tokens` tokens after the chat template: a short
    instruction and random digits (each digit is one token of this tokenizer)."""
    rng = random.Random(seed)

    def length(content: str) -> int:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return len(ids)

    head = "digits "
    digits = max(1, target_tokens - length(head))
    digits = max(1, digits + target_tokens - length(head + "7" * digits))  # how the head joins the digits
    return [[{"role": "user", "content": head + "".join(rng.choice("0123456789") for _ in range(digits))}]
            for _ in range(count)]


# ---------------------------------------------------------------- 1-2: environment, peak


def environment(devices) -> dict:
    import torch

    from stages.runtime import devices as placement

    def version(name: str):
        try:
            return __import__(name).__version__
        except Exception:  # noqa: BLE001  (not installed, or broken: either way, say so)
            return "not installed"

    target = placement.device(devices)
    out = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
           **{name: version(name) for name in ("transformers", "peft", "trl", "accelerate", "datasets")},
           "vllm": "installed" if importlib.util.find_spec("vllm") else "not installed",
           "flash_attn": "installed" if importlib.util.find_spec("flash_attn") else "not installed",
           **placement.describe(devices)}
    if target.type == "cuda":
        props = torch.cuda.get_device_properties(target)
        out.update(gpu_memory_gib=round(props.total_memory / 2**30, 1), gpu_capability=f"{props.major}.{props.minor}",
                   gpu_count=torch.cuda.device_count())
    return out


def matmul_peak(device, n: int, warmups: int = 3, repeats: int = 10) -> dict:
    """TFLOP/s of an n x n x n bf16 matmul on `device` (2 n^3 FLOPs each)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(warmups):
        a @ b
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    seconds = (time.perf_counter() - started) / repeats
    del a, b
    free_memory()
    return {"n": n, "dtype": "bfloat16", "warmups": warmups, "repeats": repeats, "seconds_each": seconds,
            "tflops": significant(2 * n**3 / seconds / 1e12)}


# ---------------------------------------------------------------- synthetic scored rows (the optimize sections' input)


def synthetic_scored(path: Path, prompts: int, generations: int, prompt_tokens: int, completion_tokens: int,
                     token_limit: int, model_vocab: int, seed: int = 0, round_index: int = 0) -> list[dict]:
    """Write a scored Parquet (stages.data.schemas.SCORED) of `prompts` x `generations` rows: random token ids in
    [3, token_limit) (past the special tokens), every completion `completion_tokens` long (finish "length"),
    sampling log-probs of a uniform policy, nonzero advantages of both signs in every group, sampled by the
    transformers engine from the round's starting policy (so the stage may reuse them as pi_old)."""
    import pyarrow as pa

    from stages.data.schemas import SCORED, write_table

    rng = random.Random(seed)
    uniform = -math.log(model_vocab)
    rows = []
    for p in range(prompts):
        prompt_ids = [rng.randrange(3, token_limit) for _ in range(prompt_tokens)]
        for g in range(generations):
            advantage = (1.0 if g % 2 == 0 else -1.0) * (0.5 + g / generations)
            rows.append({
                "rollout_id": f"r{round_index}-p{p}-g{g}", "prompt_id": f"p{p}", "group_index": g,
                "prompt": [{"role": "user", "content": f"synthetic prompt {p}"}], "completion": "",
                "prompt_token_ids": prompt_ids,
                "completion_token_ids": [rng.randrange(3, token_limit) for _ in range(completion_tokens)],
                "sampling_logprobs": [uniform] * completion_tokens,
                "round_index": round_index, "policy_version": round_index, "engine": "transformers",
                "finish_reason": "length", "rerolled": False,
                "rewards": [("synthetic", advantage)], "reward": advantage, "advantage": advantage, "errors": []})
    write_table(pa.Table.from_pylist(rows, schema=SCORED), path, SCORED)
    return rows
