"""benchmarks/gpu.py section 3: the optimize stage's throughput and MFU (`optimize`), where its GPU time goes
(`profile_optimize`), and what it runs through the model (`ForwardMeter`, also used by the rounds against TRL).
The module docstring of benchmarks/gpu.py says what each number is.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from gpu_common import free_memory, peak_memory, reset_peak, say, significant, sync, synthetic_scored


class ForwardMeter:
    """Counts what stages.training.grpo runs through the model during one grpo.run; times its training window.

    Wraps logprobs.batch_logps and logprobs.completion_logps (stages/training/logprobs.py, looked up at call
    time by the stage): the first call (synchronized) starts the window; `on_step` (called by the stage after
    each optimizer step, synchronized) ends it. Each call adds its body tokens (positions through the
    transformer blocks: a shared prompt pass counts each distinct prompt once) and logit positions (where the
    lm_head runs), with or without gradients. The first call also records where the trained model's weights
    are and in which dtype, and whether autocast is on."""

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
