"""Operator dispatches per optimize micro-batch: posttrain (shared prompt pass / plain forward) against TRL.

  PYTHONPATH=. .venv/bin/python benchmarks/dispatch_ops.py [--layers 24] [--rows 32] [--micro-batch 16]
                                                           [--prompt-tokens 64] [--completion-tokens 64]
                                                           [--out dispatch.json]

Why: on a GPU, a micro-batch of a small model (a 0.5B Qwen2 at 16 rows x 256 tokens) costs what the host
takes to dispatch its operators, not what the GPU takes to run them (BENCHMARKS.md, issue 26: the LoRA
window's 325 ms per micro-batch). The number of aten operators one micro-batch's forward + backward
dispatches does not depend on the device, so it is counted here, on the CPU, with torch.profiler: every
aten operator the profiler records with no aten operator under it (`leaf_ops`), and the operators that would
launch a GPU kernel (`kernel_ops`: those that call no kernel-launching operator themselves, with views,
allocations and conj/neg flag checks left out).

What is counted, per micro-batch, each on a random-init Qwen2 of `--layers` blocks (hidden 64: the count
does not depend on the width) in bf16 autocast on fp32 weights (train.precision bf16):
- posttrain: `stages.training.grpo.RoundTrainer.accumulate` of a GRPO round (loss dapo, beta 0), LoRA r16
  on all linear layers and full fine-tuning, with grpo.shared_prompt_pass true (each group's prompt once,
  then every row's completion on its KV cache: two passes through the blocks) and false (one plain
  forward over prompt + completion, as TRL);
- TRL's GRPOTrainer (trl, LoRA, use_cpu): its `compute_loss` and the `accelerator.backward` of each
  micro-batch of a training step, the same rows' shapes (TRL generates its completions here; a random model
  runs to max_completion_length).
A warm-up round runs first on each side. `host_ms`: the wall time of one micro-batch's forward + backward on
this CPU, one thread, unprofiled (a round of its own, before the counted one): with a model this narrow the
arithmetic is small, so it is mostly what the host spends dispatching -- a proxy for what a GPU waits on,
not a GPU time.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

# aten operators that launch no kernel on a GPU themselves: views, allocations, dtype/conj bookkeeping (aten::to
# launches its copy through aten::copy_, counted there)
NO_KERNEL = {"aten::as_strided", "aten::view", "aten::_unsafe_view", "aten::_reshape_alias", "aten::empty",
             "aten::empty_strided", "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg",
             "aten::lift_fresh", "aten::result_type", "aten::detach", "aten::alias", "aten::t", "aten::transpose",
             "aten::expand", "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select",
             "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::reshape", "aten::split",
             "aten::narrow", "aten::unbind", "aten::chunk", "aten::_has_compatible_shallow_copy_type",
             "aten::set_", "aten::resize_", "aten::contiguous", "aten::to"}


def _launches(event) -> bool:
    """The profiled operator, or one it calls, would launch a GPU kernel."""
    return event.name.startswith("aten::") and (event.name not in NO_KERNEL
                                                or any(_launches(c) for c in event.cpu_children))


class Counter:
    """Sums the leaf aten operators of every profiled call it wraps."""

    def __init__(self):
        self.leaf = self.kernels = 0
        self.seconds = 0.0
        self.names = collections.Counter()

    def timed(self, fn):
        """`fn`, its wall time added to `seconds` (no profiler: what the host spends)."""
        def timing(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timing

    def wrap(self, fn):
        import torch

        def profiled(*args, **kwargs):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                result = fn(*args, **kwargs)
            for event in prof.events():
                if not event.name.startswith("aten::"):
                    continue
                children = [c for c in event.cpu_children if c.name.startswith("aten::")]
                self.leaf += not children
                # a kernel: an operator that launches one and calls no operator that does (aten::mm calls
                # resolve_conj only; aten::linear calls aten::mm)
                if event.name not in NO_KERNEL and not any(_launches(c) for c in children):
                    self.kernels += 1
                    self.names[event.name] += 1
            return result
        return profiled

    def per(self, micro_batches: int) -> dict:
        return {"leaf_ops": self.leaf // micro_batches, "kernel_ops": self.kernels // micro_batches,
                "host_ms": round(1000 * self.seconds / micro_batches, 1),
                "top_kernel_ops": {k: v // micro_batches for k, v in self.names.most_common(8)}}


def posttrain(model_dir: Path, work: Path, args, adapter: str, shared: bool, vocab: int) -> dict:
    """Host time over one round's micro-batches (`accumulate`: forward and backward), then counts over the same
    round again (a warm-up round first)."""
    import gpu_common
    from stages.runtime.devices import DeviceConfig
    from stages.training import grpo

    devices = DeviceConfig(device="cpu", precision="bf16")
    cfg = grpo.GRPOConfig(adapter=adapter, beta=0.0, loss_type="dapo", rounds=1, micro_batch_size=args.micro_batch,
                          gradient_accumulation_steps=args.rows // args.micro_batch, shared_prompt_pass=shared,
                          learning_rate=2e-4, optim="adamw")
    prompts = args.rows // args.generations
    name = f"{adapter}-{'shared' if shared else 'plain'}"
    for tag in ("warmup", "timed"):
        gpu_common.synthetic_scored(work / f"{name}-{tag}.parquet", prompts, args.generations, args.prompt_tokens,
                                    args.completion_tokens, vocab, vocab, seed=1 if tag == "warmup" else 2)
    grpo.run(cfg, model_dir, None, work / f"{name}-warmup.parquet", 0, 1.0, args.completion_tokens,
             work / f"{name}-warmup", devices=devices)
    counter, original = Counter(), grpo.RoundTrainer.accumulate
    try:
        for measure in (counter.timed, counter.wrap):  # a timed round, then the same round counted
            grpo.RoundTrainer.accumulate = measure(original)
            out = work / f"{name}-{measure.__name__}"
            metrics = grpo.run(cfg, model_dir, None, work / f"{name}-timed.parquet", 0, 1.0, args.completion_tokens,
                               out, devices=devices)
    finally:
        grpo.RoundTrainer.accumulate = original
    return {"adapter": adapter, "shared_prompt_pass": shared, "trained_rows": metrics.get("trained_rows"),
            **counter.per(args.rows // args.micro_batch)}


def trl(model_dir: Path, work: Path, args) -> dict:
    """Host time over TRL's second optimizer step and counts over its third (the first warms up): compute_loss and
    backward per micro-batch."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import GRPOConfig, GRPOTrainer

    import gpu_common
    import gpu_rounds
    from stages.training.grpo import GRPOConfig as PosttrainGRPO

    ours = PosttrainGRPO()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = args.rows // args.generations
    prompt_list = gpu_common.digit_prompts(tokenizer, 3 * prompts, args.prompt_tokens, seed=4)
    dataset = Dataset.from_list([{"prompt": p} for p in prompt_list])
    config = GRPOConfig(
        output_dir=str(work / "trl"), use_cpu=True, bf16=True, seed=0, shuffle_dataset=False,
        num_generations=args.generations, generation_batch_size=args.rows, max_completion_length=args.completion_tokens,
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.rows // args.micro_batch,
        max_steps=3, num_iterations=1, learning_rate=2e-4, lr_scheduler_type="constant", optim="adamw_torch",
        loss_type="dapo", beta=0.0, scale_rewards="group", use_vllm=False, save_strategy="no", report_to="none",
        logging_steps=1, disable_tqdm=True, temperature=1.0, top_k=0, top_p=1.0)
    set_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=ours.lora_r, lora_alpha=ours.lora_alpha, lora_dropout=ours.lora_dropout,
                      target_modules=ours.lora_target_modules, task_type="CAUSAL_LM")
    def reward(completion_ids, **_):
        return [gpu_rounds.even_token_share(c) for c in completion_ids]

    trainer = GRPOTrainer(model=model, reward_funcs=[reward],
                          args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=lora)
    counter, micro_batches = Counter(), args.rows // args.micro_batch
    original_loss, original_backward = trainer.compute_loss, trainer.accelerator.backward
    steps = {"n": 0}

    def measured(fn):  # step 1: as is; step 2: timed; step 3: counted
        step = steps["n"] // micro_batches
        return fn if step == 0 else counter.timed(fn) if step == 1 else counter.wrap(fn)

    def compute_loss(*a, **k):
        return measured(original_loss)(*a, **k)

    def backward(*a, **k):
        result = measured(original_backward)(*a, **k)
        steps["n"] += 1
        return result

    trainer.compute_loss, trainer.accelerator.backward = compute_loss, backward
    trainer.train()
    return {"adapter": "lora", "trl": __import__("trl").__version__, "micro_batches_counted": steps["n"] - 2 * micro_batches,
            **counter.per(micro_batches)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from transformers.utils import logging as hf_logging

    import gpu_common

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="posttrain-dispatch-"))
    tiny = gpu_common.SIZES["tiny"]
    sizes = {**tiny, "model": {**tiny["model"], "num_hidden_layers": args.layers, "num_attention_heads": 2}}
    gpu_common.build_model(work / "model", sizes, "cpu")
    vocab = gpu_common.parameter_counts(work / "model")["vocab_size"]
    results = {"command": " ".join(sys.argv), "torch": torch.__version__, "layers": args.layers, "rows": args.rows,
               "micro_batch": args.micro_batch, "prompt_tokens": args.prompt_tokens,
               "completion_tokens": args.completion_tokens, "rows_per_prompt": args.generations, "runs": []}
    for adapter in ("lora", "none"):
        for shared in (True, False):
            results["runs"].append(posttrain(work / "model", work, args, adapter, shared, vocab))
            print(json.dumps(results["runs"][-1]), flush=True)
    if not args.skip_trl:
        results["runs"].append({"side": "trl", **trl(work / "model", work, args)})
        print(json.dumps(results["runs"][-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
