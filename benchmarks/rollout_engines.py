"""Rollout engine throughput: transformers vs in-process vLLM on the same model and sampling.

  .venv/bin/python benchmarks/rollout_engines.py [--sequences 256] [--max-new-tokens 64] [--repeats 3]

Builds a ~30M-parameter Qwen2 (random init, hidden 512, 8 layers, 8 heads of 64) with a locally
trained tokenizer, then for each engine times the first call (time-to-first-batch: engine start
or model load included) and `--repeats` steady-state calls of `--sequences` prompts at
temperature 1.0, reporting generated tokens per second (median). vLLM is also timed with a LoRA
adapter (r=16, all linear layers), which is how the pipeline samples a LoRA policy. A
random-init model rarely emits EOS, so nearly every sequence runs to max-new-tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml


def build_model(root: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    from stages.data.base_model import train_tokenizer
    from stages.data.demo_data import DemoDataConfig, run as make_demo

    (root / "demo").mkdir(parents=True)
    make_demo(DemoDataConfig(num_sft=2000, num_train=10, num_eval=10), root / "demo")
    import pyarrow.parquet as pq

    texts = [r["question"] + " " + r["teacher_completion"]
             for r in pq.read_table(root / "demo" / "sft.parquet").to_pylist()]
    tokenizer = train_tokenizer(texts, 512)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=8, intermediate_size=1536, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    lora = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]))
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)
    lora.save_pretrained(root / "adapter")
    return root


def time_engine(engine, policy, prompts, sampling, repeats: int) -> dict:
    started = time.perf_counter()
    rows = engine.generate(policy, prompts, sampling)
    first = time.perf_counter() - started
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        rows = engine.generate(policy, prompts, sampling)
        rates.append(sum(len(r["completion_token_ids"]) for r in rows) / (time.perf_counter() - started))
    return {"first_call_s": round(first, 1), "tokens_per_s": round(statistics.median(rates)),
            "tokens_per_call": sum(len(r["completion_token_ids"]) for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="transformers,vllm")
    parser.add_argument("--vllm-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra rollout.vllm option for the vllm engine, e.g. enforce_eager=false (repeatable)")
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help="transformers engine: sequences per generate call (default: all at once)")
    parser.add_argument("--no-lora", action="store_true", help="skip the LoRA measurements")
    args = parser.parse_args()

    from stages.rollout.engines import Policy, Sampling, get_engine

    root = build_model(Path(tempfile.mkdtemp(prefix="posttrain-engines-")))
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(root / "model").parameters())
    prompts = [[{"role": "user", "content": f"Which is the largest of {i % 9 + 1}, 3, 7?"}]
               for i in range(args.sequences)]
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1)
    report = {"parameters": params, "vllm_options": args.vllm_option, "hf_batch_size": args.hf_batch_size,
              "sequences": args.sequences,
              "max_new_tokens": args.max_new_tokens}
    for kind in args.engines.split(","):
        options = {"batch_size": args.hf_batch_size or args.sequences} if kind == "transformers" else {
            "max_lora_rank": 16, "kv_cache_space_gib": 2.0, "max_model_len": 256,
            **{k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.vllm_option)}}
        engine = get_engine(kind, root / "model", options)
        report[kind] = time_engine(engine, Policy(root / "model"), prompts, sampling, args.repeats)
        if not args.no_lora:
            report[f"{kind}+lora"] = time_engine(engine,
                                                 Policy(root / "model", adapter_dir=root / "adapter", version=1),
                                                 prompts, sampling, args.repeats)
        engine.close()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main()
