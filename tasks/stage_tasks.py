"""One Prefect task per stage. Each is thin: compute the content key, return the finished
artifact if its manifest is there, otherwise run the stage into the store, log the
nested MLflow run, and report progress. No ML logic here, and no choice of method: a variant
stage is its own task (strided_rollout_task, strided_eval_task, atropos_batch_task, ebft_score_task) that
the method's recipe (flows/recipes/) picks.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from stages.data import base_model, demo_data, demo_pairs, model_source, preferences, schemas, transform
from stages.evaluation import evaluate
from stages.rollout import atropos, rollout
from stages.rollout.engines import Policy, import_eagerly
from stages.rollout.rollout_worker import shared_worker
from stages.runtime import devices, distributed, ray_training
from stages.runtime.imports import user_code
from stages.runtime.keys import key_fields
from stages.scoring import replay, score
from stages.scoring.reward_workers import split_reward_funcs
from stages.scoring.rewards import BUILTIN_REWARDS
from stages.training import dpo, ebft, ebft_strided, export, grpo, reward_model, sft
from tasks.lineage import Lineage
from tasks.reporting import Reporter
from tasks.store import Artifact, ArtifactStore, code_version, path_digest


class RunContext:
    """What every task of one pipeline run shares (a plain class: Prefect does not walk into it)."""

    def __init__(self, config, store: ArtifactStore, lineage: Lineage, reporter: Reporter):
        self.config = config
        self.store = store
        self.lineage = lineage
        self.reporter = reporter


def placement(ctx: RunContext) -> devices.DeviceConfig:
    """Where this run's models run and in which precision (the config's train.device, train.precision, ...)."""
    return devices.of(ctx.config.train)


def runs_model(ctx: RunContext, section: dict) -> dict:
    """A section of a stage that runs a model, with the resolved precision when it is not fp32 (fp32 keys
    stay those of before the precision could be chosen); device, attention kernel and checkpointing change
    rounding only, as train.num_processes does, and are in no key."""
    return {**section, **devices.key_fields(placement(ctx))}


def artifact_key(store: ArtifactStore, stage: str, module, section: dict, inputs: dict[str, Artifact | None]) -> str:
    """The stage's content key: its name, the code version of its module (and what that imports), its
    section and the keys of its inputs (None: no such input)."""
    present = sorted((name, a) for name, a in inputs.items() if a is not None)
    return store.key(stage, code_version(module, schemas), section, [f"{n}={a.stage}/{a.key}" for n, a in present])


def materialize(ctx: RunContext, stage: str, module, section: dict, inputs: dict[str, Artifact | None],
                produce: Callable[..., dict], label: str | None = None, resumable: bool = False) -> Artifact:
    """Return the stage's artifact for these inputs, computing it only if no manifest exists.

    produce(out, on_metrics) writes the folder; with `resumable`, produce(out, on_metrics, work_dir), where
    work_dir (the store's work_path for the key) keeps checkpoints a rerun of the key continues from."""
    key = artifact_key(ctx.store, stage, module, section, inputs)
    label = label or stage
    found, damage = ctx.store.lookup(stage, key)
    if found is not None:
        ctx.reporter.done(label, stage, found.path, cached=True)
        return replace(found, reused=True)
    if damage:  # e.g. a file deleted by hand: recompute this stage only
        ctx.reporter.warn(f"{label}: {ctx.store.path(stage, key)} is damaged ({'; '.join(damage)}); recomputing it")
    started = ctx.reporter.start(label)
    import_eagerly()  # before any stage thread touches transformers/peft; a fully cached run skips it
    input_keys = {n: f"{a.stage}/{a.key}" for n, a in inputs.items() if a is not None}
    run_id = ctx.lineage.stage_run(label, key, section, input_keys)

    logged: set[tuple[str, int]] = set()  # (metric, step): MLflow keeps every copy, so each is logged once

    def on_metrics(metrics: dict, step: int = 0) -> None:
        fresh = {k: v for k, v in metrics.items() if (k, step) not in logged}  # e.g. HF's final log repeats `epoch`
        logged.update((k, step) for k in fresh)
        ctx.lineage.log_metrics(run_id, fresh, step)

    extra = (ctx.store.work_path(stage, key),) if resumable else ()
    try:
        artifact = ctx.store.write(stage, key, lambda out: produce(out, on_metrics, *extra), inputs=input_keys,
                                   config=section)
    except BaseException:
        ctx.lineage.client.set_terminated(run_id, status="FAILED")
        raise
    ctx.lineage.log_metrics(run_id, {k: v for k, v in artifact.manifest["summary"].items()
                                     if isinstance(v, (int, float)) and k not in {name for name, _ in logged}})
    ctx.lineage.log_metrics(run_id, {"wall_time_s": artifact.manifest["wall_time_s"]})
    ctx.lineage.client.set_terminated(run_id)
    ctx.reporter.done(label, stage, artifact.path, cached=artifact.reused, started=started)
    return artifact


def _files_digest(paths: dict[str, str] | None) -> dict[str, str] | None:
    """Content digests of user data files, so editing a file changes the transform's key."""
    return {split: path_digest(p) for split, p in paths.items()} if paths else None


def _pinned_sources(cfg):
    """`cfg` (the transform or preferences section) with each hub dataset of its datasets and test_datasets
    resolved to its commit (the stage reads that commit), and what the key needs of each source: that commit,
    or its local files' digests."""
    from stages.data import sources

    if not cfg.datasets:
        return cfg, None
    pinned, versions = {}, []
    for name in ("datasets", "test_datasets"):
        entries = []
        for source in getattr(cfg, name) or []:
            if sources.kind(source) == "hub":
                source = source.model_copy(update={"revision": sources.hub_revision(source)})
                versions.append(source.revision)
            else:
                versions.append([[str(p), path_digest(p)] for p in sources.local_paths(source)])
            entries.append(source)
        pinned[name] = entries or None
    return cfg.model_copy(update=pinned), versions


def _with_reads(section: dict, code: list[str] = (), builtins: dict | None = None, paths: list[str] = ()) -> dict:
    """`section` plus digests of what else the stage reads (DESIGN.md, artifact contract): the user modules
    behind the `module.fn` names in `code` (built-ins left out) and the files or folders in `paths`. A stage
    that reads none of them keeps the section as it is."""
    section = dict(section)
    if digests := user_code(code, builtins):
        section["user_code"] = digests
    if paths:
        section["path_digests"] = [[p, path_digest(p)] for p in paths]
    return section


@task(name="demo_data", cache_policy=NO_CACHE)
def demo_data_task(ctx: RunContext) -> Artifact:
    cfg = ctx.config.demo_data
    return materialize(ctx, "demo_data", demo_data, key_fields(cfg), {},
                       lambda out, _: demo_data.run(cfg, out))


@task(name="transform", cache_policy=NO_CACHE)
def transform_task(ctx: RunContext, raw: Artifact | None) -> Artifact:
    cfg, source_versions = _pinned_sources(ctx.config.transform)
    if cfg.datasets:  # the stage reads the sources (stages/data/sources.py)
        files = None
    elif cfg.paths:
        files = {split: Path(p) for split, p in cfg.paths.items()}
    else:
        files = {split: raw.file(f"{split}.parquet") for split in demo_data.SPLITS}
    types = [cfg.type, *(s.type for s in (cfg.datasets or []) + (cfg.test_datasets or []) if s.type)]
    section = _with_reads({**cfg.model_dump(mode="json"), "file_digests": _files_digest(cfg.paths),
                           **({"source_versions": source_versions} if source_versions else {})}, types,
                          transform.BUILTINS)
    return materialize(ctx, "transform", transform, section, {"raw": raw},
                       lambda out, _: transform.run(cfg, files, out))


@task(name="base_model", cache_policy=NO_CACHE)
def base_model_task(ctx: RunContext, prompts: Artifact) -> Artifact:
    cfg = ctx.config.model
    split = ctx.config.sft.split if ctx.config.sft.enabled else "train"
    completion_field = ctx.config.sft.completion_field
    # before the key: a hub id's commit (downloaded into the hub cache if it is not there), a path's kind
    source = model_source.resolve(cfg.path, cfg.revision) if cfg.path else None
    options = key_fields(cfg)  # a hub id's revision: as the commit it names (below)
    if source:  # the fields that build a model here (sizes, seed) make nothing of a model read from a path
        options = {name: value for name, value in options.items() if name in base_model.PATH_FIELDS}
    if source and source.commit:  # a hub id: the commit it resolved to, not the id alone
        section = {**options, "commit": source.commit}
    elif source:  # a folder or .gguf: its files, not the prompts, make the model
        section = _with_reads(options, paths=[cfg.path])
    else:  # built here: the tokenizer is trained on these texts
        section = {**options, "texts": {"split": split, "completion_field": completion_field}}

    def produce(out, _):
        import pyarrow.parquet as pq

        if source:  # read from the path: no tokenizer is trained here
            return base_model.run(cfg, [], out, source)
        table = pq.read_table(prompts.file(f"{split}.parquet")).to_pylist()
        texts = [
            "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in row["prompt"])
            + f"<|im_start|>assistant\n{row.get(completion_field) or row['answer']}<|im_end|>\n"
            if row["prompt"] else str(row.get(completion_field) or row.get("text") or "")  # a raw document
            for row in table
        ]
        return base_model.run(cfg, texts, out)

    return materialize(ctx, "base_model", base_model, section, {"prompts": prompts}, produce)


LAUNCHERS = {"torchrun": distributed.launch, "ray": ray_training.launch_on_ray}
"""`train.backend` -> the function that runs a stage on train.num_processes ranks (same arguments)."""


def run_training(ctx: RunContext, function: Callable[..., dict], label: str, on_metrics, on_step=None,
                 **kwargs) -> dict:
    """A training stage's `function(**kwargs)`: in this process (train.num_processes 1), or data-parallel on
    train.num_processes ranks (stages/runtime/distributed.py; where it trains, not what: train.* is in no key)."""
    processes = ctx.config.train.num_processes
    if processes > 1 and ctx.config.train.strategy == "fsdp" and function is not grpo.run:
        logging.getLogger(__name__).warning("%s: train.strategy fsdp shards the optimize stage only; "
                                 "this stage trains with "
                                 "ddp (each rank holds the whole model) on %d processes (HF Trainer, through "
                                 "accelerate, runs CPU ranks as DDP only)", label, processes)
    if processes == 1:
        summary = function(**kwargs, on_metrics=on_metrics, **({"on_step": on_step} if on_step else {}))
    else:
        launch = LAUNCHERS[ctx.config.train.backend]
        summary = launch(f"{function.__module__}:{function.__name__}", kwargs, ctx.config.train, label,
                         on_metrics=on_metrics, on_step=on_step)
    return {**summary, "num_processes": processes}


@task(name="sft", cache_policy=NO_CACHE)
def sft_task(ctx: RunContext, model: Artifact, prompts: Artifact) -> Artifact:
    cfg = ctx.config.sft
    return materialize(
        ctx, "sft", sft, runs_model(ctx, key_fields(cfg)), {"model": model, "prompts": prompts},
        lambda out, log, work: run_training(ctx, sft.run, "sft", log, cfg=cfg, model_dir=model.path,
                                            prompts_path=prompts.file(f"{cfg.split}.parquet"), out_dir=out,
                                            work_dir=work, devices=placement(ctx)),
        resumable=True,
    )


@task(name="eval", task_run_name="eval-{label}", cache_policy=NO_CACHE)
def eval_task(ctx: RunContext, model: Artifact, prompts: Artifact, label: str,
              adapter: Artifact | None = None, version: int = -1) -> Artifact:
    """Evaluate `model`, or with `adapter` (an optimize round's output) the policy `model` + that round: greedy
    accuracy on the eval split's prompts (stages/evaluation/evaluate.py)."""
    scoring = ctx.config.score  # how the verifier runs: workers, timeout, remote verifiers, max_error_rate
    cfg = ctx.config.eval.model_copy(update={"reward_funcs": evaluate.verifier_funcs(ctx.config.eval,
                                                                                     scoring.reward_funcs)})
    functions, folders = split_reward_funcs(cfg.reward_funcs)
    section = _with_reads({**key_fields(cfg), "verifier": evaluate.verifier_key(cfg, scoring)}, functions,
                          BUILTIN_REWARDS, folders)  # the verifier's code, as the score stage's key has it
    evaluated = policy_for(ctx, model, adapter, version)
    bar = ctx.reporter.progress(f"eval {label}", "prompt")
    return materialize(
        ctx, "eval", evaluate, runs_model(ctx, section), {"model": model, "prompts": prompts, "adapter": adapter},
        lambda out, _, work: evaluate.run(cfg, evaluated.model_dir, evaluated.adapter_dir,
                                          prompts.file(f"{cfg.split}.parquet"), out, on_progress=bar,
                                          devices=placement(ctx), scoring=scoring, log_dir=work),
        label=f"eval {label}", resumable=True,  # work: where reward_errors.log stays when the verifier breaks
    )


@task(name="eval", task_run_name="eval-{label}", cache_policy=NO_CACHE)
def strided_eval_task(ctx: RunContext, model: Artifact, prompts: Artifact, label: str,
                      adapter: Artifact | None = None, version: int = -1,
                      feature_model: Artifact | None = None) -> Artifact:
    """rl: ebft, ebft.mode: strided: evaluate as eval_task does, on raw documents: the held-out documents' blocks
    against their own continuations (stages/training/ebft_strided.py). `feature_model`: whose features compare
    continuations (the starting policy); unset: `model`'s."""
    cfg = ctx.config.eval
    evaluated = policy_for(ctx, model, adapter, version)
    bar = ctx.reporter.progress(f"eval {label}", "document")
    features = feature_model or model  # before the rounds: the policy they start from
    return materialize(
        ctx, "eval", ebft_strided, runs_model(ctx, {**key_fields(cfg), "ebft": ctx.config.ebft.block_fields()}),
        {"model": model, "prompts": prompts, "adapter": adapter, "feature_model": features},
        lambda out, _: ebft_strided.evaluate(ctx.config.ebft, cfg.max_prompts, evaluated.model_dir,
                                             evaluated.adapter_dir, features.path,
                                             prompts.file(f"{cfg.split}.parquet"), out, on_progress=bar,
                                             devices=placement(ctx)),
        label=f"eval {label}",
    )


def policy_for(ctx: RunContext, policy: Artifact, adapter: Artifact | None, version: int) -> Policy:
    """The sampling policy after `version` optimize rounds (adapter: that round's output, or the preference
    stage's): a LoRA adapter on the starting policy when the folder holds one (PEFT's adapter_config.json), else
    the folder's full weights (adapter: none)."""
    if adapter is None:
        return Policy(policy.path, version=version)
    if not (adapter.path / "adapter_config.json").exists():
        return Policy(policy.path, weights_dir=adapter.path, version=version)
    return Policy(policy.path, adapter_dir=adapter.path, version=version)


@task(name="rollout", task_run_name="rollout-r{round_index}", cache_policy=NO_CACHE)
def rollout_task(ctx: RunContext, policy: Artifact, adapter: Artifact | None, prompts: Artifact,
                 round_index: int, policy_version: int, reroll_prompt_ids: list[str] = ()) -> Artifact:
    """The round's completions of rollout.prompts_per_round prompts by the rollout engine."""
    cfg = ctx.config.rollout
    section = key_fields(cfg)
    handed = rollout.engine_options(cfg, 0, placement(ctx))  # the vllm options this engine gets
    vllm = {k: handed[k] for k in key_fields(cfg.vllm) if k in handed}  # dtype auto: as resolved
    section.pop("vllm")
    if vllm:
        section["vllm"] = vllm
    section = _with_reads(runs_model(ctx, {**section, "round": round_index, "policy_version": policy_version}),
                          [cfg.rollout_func] if cfg.rollout_func else [])
    if reroll_prompt_ids:  # only then: a round without re-rolls has the key it has with re-roll off
        section["reroll_prompt_ids"] = list(reroll_prompt_ids)
    sampler = policy_for(ctx, policy, adapter, policy_version)
    bar = ctx.reporter.progress(f"rollout r{round_index}", "completion")
    options = rollout.engine_options(cfg, ctx.config.grpo.lora_r, placement(ctx))
    run = shared_worker(cfg.worker_cpus, cfg.prefetch_torch_threads).run if cfg.worker_process else rollout.run
    return materialize(
        ctx, "rollout", rollout, section, {"policy": policy, "adapter": adapter, "prompts": prompts},
        lambda out, _: run(cfg, sampler, prompts.file("train.parquet"), round_index, out, options, on_progress=bar,
                           reroll_prompt_ids=list(reroll_prompt_ids)),
        label=f"rollout r{round_index}",
    )


@task(name="rollout", task_run_name="rollout-r{round_index}", cache_policy=NO_CACHE)
def strided_rollout_task(ctx: RunContext, policy: Artifact, adapter: Artifact | None, prompts: Artifact,
                         round_index: int, policy_version: int, reroll_prompt_ids: list[str] = ()) -> Artifact:
    """rl: ebft, ebft.mode: strided: the round's blocks of raw documents (stages/training/ebft_strided.py);
    re-rolls do not
    apply (flows/config.py refuses them)."""
    cfg = ctx.config.rollout
    keep = ("prompts_per_round", "num_generations", "temperature", "top_p", "seed")
    section = {**{k: v for k, v in key_fields(cfg).items() if k in keep}, "round": round_index,
               "policy_version": policy_version, "ebft": ctx.config.ebft.block_fields()}
    sampler = policy_for(ctx, policy, adapter, policy_version)
    bar = ctx.reporter.progress(f"rollout r{round_index}", "document")
    return materialize(
        ctx, "rollout", ebft_strided, section, {"policy": policy, "adapter": adapter, "prompts": prompts},
        lambda out, _: ebft_strided.rollout(ctx.config.ebft, cfg, sampler, prompts.file("train.parquet"),
                                            round_index, out, on_progress=bar, devices=placement(ctx)),
        label=f"rollout r{round_index}",
    )


def atropos_batch_size(ctx: RunContext) -> int:
    """Sequences per pulled batch (registered with the API): prompts_per_round groups of num_generations."""
    return ctx.config.rollout.prompts_per_round * ctx.config.rollout.num_generations


@task(name="rollout", task_run_name="atropos-r{round_index}", cache_policy=NO_CACHE)
def atropos_batch_task(ctx: RunContext, session, policy: Artifact, adapter: Artifact | None,
                       round_index: int) -> Artifact:
    """Round `round_index`'s batch pulled from the Atropos API (rollout.source: atropos), stored before
    anything trains on it. Its key: the registration (API, batch size, max token length), the round, and
    the policy being served when it was pulled; a resumed run finds it and asks the API for no other."""
    cfg = ctx.config.rollout
    section = {"source": "atropos", **key_fields(cfg.atropos),
               "batch_size": atropos_batch_size(ctx), "num_generations": cfg.num_generations, "round": round_index,
               # what the policy server samples with (the environment asks for temperature and length itself)
               **{k: getattr(cfg, k) for k in ("engine", "temperature", "top_p", "max_completion_length")}}
    return materialize(
        ctx, "rollout", atropos, section, {"policy": policy, "adapter": adapter},
        lambda out, _: atropos.pull(cfg.atropos, session, round_index, cfg.num_generations, policy.path, out),
        label=f"atropos batch r{round_index}",
    )


@task(name="score", task_run_name="atropos-score-r{round_index}", cache_policy=NO_CACHE)
def atropos_score_task(ctx: RunContext, rollouts: Artifact, round_index: int) -> Artifact:
    """The pulled batch with rewards = the environments' scores and group advantages (score.scale_rewards)."""
    n, scale = ctx.config.rollout.num_generations, ctx.config.score.scale_rewards
    return materialize(
        ctx, "score", atropos, {"source": "atropos", "num_generations": n, "scale_rewards": scale},
        {"rollouts": rollouts}, lambda out, _: atropos.score(rollouts.file("rollouts.parquet"), n, scale, out),
        label=f"score r{round_index}",
    )


@task(name="score", task_run_name="ebft-score-r{round_index}", cache_policy=NO_CACHE)
def ebft_score_task(ctx: RunContext, rollouts: Artifact, round_index: int, feature_model: Artifact) -> Artifact:
    """rl: ebft: feature-matching rewards from the frozen `feature_model`, the starting policy
    (stages/training/ebft.py)."""
    n, scale = ctx.config.rollout.num_generations, ctx.config.score.scale_rewards
    section = runs_model(ctx, {**key_fields(ctx.config.ebft), "num_generations": n,
                               "scale_rewards": scale})
    return materialize(
        ctx, "score", ebft, section, {"rollouts": rollouts, "feature_model": feature_model},
        lambda out, _: ebft.run(ctx.config.ebft, rollouts.file("rollouts.parquet"), feature_model.path, n,
                                scale, out, devices=placement(ctx)),
        label=f"score r{round_index}",
    )


@task(name="score", task_run_name="score-r{round_index}", cache_policy=NO_CACHE)
def score_task(ctx: RunContext, rollouts: Artifact, round_index: int, reward_model: Artifact | None = None) -> Artifact:
    """score.reward_funcs on the round's rollouts; `reward_model`: this run's reward_model stage, for the
    `reward_model` entry of reward_funcs."""
    cfg = ctx.config.score
    n = ctx.config.rollout.num_generations
    rm = reward_model if "reward_model" in cfg.reward_funcs else None
    functions, folders = split_reward_funcs(cfg.reward_funcs)
    section = {**key_fields(cfg), "num_generations": n}
    if rm or folders:  # a reward model runs: its precision changes the scores
        section = runs_model(ctx, section)
    section = _with_reads(section, functions, BUILTIN_REWARDS, folders)
    return materialize(
        ctx, "score", score, section, {"rollouts": rollouts, "reward_model": rm},
        lambda out, _, work: score.run(cfg, rollouts.file("rollouts.parquet"), n, out, rm.path if rm else None,
                                       devices=placement(ctx) if rm or folders else None, log_dir=work),
        label=f"score r{round_index}", resumable=True,  # work: where reward_errors.log stays when a function breaks
    )


@task(name="replay", task_run_name="replay-r{round_index}", cache_policy=NO_CACHE)
def replay_task(ctx: RunContext, scored: Artifact, replacements: list, round_index: int) -> Artifact:
    """The round's scored rows with zero-signal groups swapped for cached groups of earlier rounds."""
    section = {"round": round_index, "replacements": [r.as_key() for r in replacements]}
    return materialize(
        ctx, "replay", replay, section, {"scored": scored},
        lambda out, _: replay.run(scored.file("scored.parquet"), replacements, round_index, out),
        label=f"replay r{round_index}",
    )


@task(name="optimize", task_run_name="optimize-r{round_index}", cache_policy=NO_CACHE)
def optimize_task(ctx: RunContext, policy: Artifact, adapter: Artifact | None, scored: Artifact,
                  round_index: int, ce_coef: float = 0.0, rl_coef: float = 1.0) -> Artifact:
    """One round of GRPO updates on the scored rows; `ce_coef` (rl: ebft's): add that times the reference
    completion's cross-entropy to the loss; `rl_coef` (rl: ebft's): the policy-gradient loss's weight."""
    cfg = ctx.config.grpo
    temperature = ctx.config.rollout.temperature
    max_len = ctx.config.rollout.max_completion_length
    section = runs_model(ctx, {**key_fields(cfg), "round": round_index, "temperature": temperature,
                               "max_completion_length": max_len})
    weights = {name: value for name, value, plain in (("ce_coef", ce_coef, 0.0), ("rl_coef", rl_coef, 1.0))
               if value != plain}  # only those: a key without them stays the GRPO one
    section.update(weights)
    bar = ctx.reporter.progress(f"optimize r{round_index}", "step")
    label = f"optimize r{round_index}"
    return materialize(
        ctx, "optimize", grpo, section, {"policy": policy, "adapter": adapter, "scored": scored},
        lambda out, log: run_training(ctx, grpo.run, label, log, on_step=bar, cfg=cfg, base_dir=policy.path,
                                      prev_adapter_dir=adapter.path if adapter else None,
                                      scored_path=scored.file("scored.parquet"), round_index=round_index,
                                      temperature=temperature, max_completion_length=max_len, out_dir=out,
                                      devices=placement(ctx), **weights),
        label=label,
    )


@task(name="preferences", cache_policy=NO_CACHE)
def preferences_task(ctx: RunContext) -> Artifact:
    """The preferences table: your data through `preferences`, or demo pairs for the built-in task."""
    cfg = ctx.config
    if cfg.preferences is not None:
        prefs, source_versions = _pinned_sources(cfg.preferences)
        types = [t for t in (prefs.type, *(s.type for s in (prefs.datasets or []) + (prefs.test_datasets or [])))
                 if isinstance(t, str)]
        section = _with_reads({**key_fields(prefs), "file_digests": _files_digest(prefs.paths),
                               **({"source_versions": source_versions} if source_versions else {})}, types,
                              preferences.builtins(prefs.namespace))
        return materialize(ctx, "preferences", preferences, section, {},
                           lambda out, _: preferences.run(prefs, out))
    section = {"demo_pairs": cfg.demo_pairs.model_dump(mode="json"), "demo_data": cfg.demo_data.model_dump(mode="json")}
    return materialize(ctx, "preferences", demo_pairs, section, {},
                       lambda out, _: demo_pairs.write_demo_pairs(cfg.demo_pairs, out, demo=cfg.demo_data))


@task(name="preference_optimization", task_run_name="{label}", cache_policy=NO_CACHE)
def preference_optimization_task(ctx: RunContext, policy: Artifact, prefs: Artifact, label: str) -> Artifact:
    cfg = ctx.config.dpo
    return materialize(
        ctx, "dpo", dpo, runs_model(ctx, key_fields(cfg)), {"policy": policy, "preferences": prefs},
        lambda out, log, work: run_training(ctx, dpo.run, label, log, cfg=cfg, model_dir=policy.path,
                                            preferences_dir=prefs.path, out_dir=out, work_dir=work,
                                            devices=placement(ctx)),
        label=label, resumable=True,
    )


@task(name="reward_model", cache_policy=NO_CACHE)
def reward_model_task(ctx: RunContext, policy: Artifact, prefs: Artifact) -> Artifact:
    cfg = ctx.config.reward_model
    return materialize(
        ctx, "reward_model", reward_model, runs_model(ctx, key_fields(cfg)), {"policy": policy, "preferences": prefs},
        lambda out, log, work: run_training(ctx, reward_model.run, "reward_model", log, cfg=cfg,
                                            model_dir=policy.path, preferences_dir=prefs.path, out_dir=out,
                                            work_dir=work, devices=placement(ctx)),
        resumable=True,
    )


@task(name="export", cache_policy=NO_CACHE)
def export_task(ctx: RunContext, policy: Artifact, adapter: Artifact | None, lineage_keys: dict,
                train_metrics: dict) -> Artifact:
    cfg = ctx.config.export
    config = ctx.config.model_dump(mode="json")
    final = policy_for(ctx, policy, adapter, version=-1)
    return materialize(
        ctx, "export", export, runs_model(ctx, cfg.model_dump(mode="json")), {"policy": policy, "adapter": adapter},
        lambda out, _: export.run(cfg, final.model_dir, final.adapter_dir, out, metrics=train_metrics,
                                  lineage=lineage_keys, config=config, devices=placement(ctx)),
    )

