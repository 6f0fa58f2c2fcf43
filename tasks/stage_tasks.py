"""One Prefect task per stage. Each is thin: it names the stage function and the arguments it calls it with (one
`Call`, tasks/calls.py, from which the content key is derived), returns the finished artifact if its manifest is
there, otherwise makes the call into the store, logs the nested MLflow run, and reports progress. No ML logic
here, and no choice of method: a variant stage is its own task (strided_rollout_task, strided_eval_task,
atropos_batch_task, ebft_score_task) that the method's recipe (flows/recipes/) picks. What the key needs of an
argument beyond its value is a small wrapper beside the task that passes it (ResolvedModel, Sampled,
EngineSettings, Served).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from stages.data import base_model, demo_data, demo_pairs, model_source, preferences, schemas, transform
from stages.evaluation import evaluate
from stages.rollout import atropos, rollout
from stages.rollout.engines import Policy, import_eagerly
from stages.rollout.rollout_worker import shared_worker
from stages.runtime import devices, distributed, ray_training
from stages.runtime.keys import key_fields
from stages.scoring import replay, score
from stages.scoring.reward_workers import is_model_name, resolve_model_name, split_reward_funcs
from stages.scoring.rewards import BUILTIN_REWARDS
from stages.training import dpo, ebft, ebft_strided, export, grpo, reward_model, scope_rl, sft
from tasks import costs
from tasks.calls import (ON_METRICS, OUT_DIR, WORK_DIR, Arg, Call, Config, InputDir, InputFile, Notes, Progress,
                         UserFile)
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
    """Where this run's models run and in which precision (the config's train.device, train.precision, ...); as
    an argument its key is the resolved precision (devices.key_fields): device, attention kernel and
    checkpointing change rounding only, as train.num_processes does."""
    return devices.of(ctx.config.train)


def artifact_key(store: ArtifactStore, stage: str, call: Call, section: dict | None = None) -> str:
    """The stage's content key: its name, the code version of the called function's module (and what that
    imports), the call's key (`section`: call.key(), where the caller has it) and its named inputs' keys."""
    section = call.key() if section is None else section
    inputs = [f"{name}={a.stage}/{a.key}" for name, a in sorted(call.inputs.items())]
    return store.key(stage, code_version(call.module, schemas), section, inputs)


DATA_STAGES = frozenset({"demo_data", "transform", "preferences"})
"""Stages that only read and write tables, first in a run and never beside another stage: they compute without
`import_eagerly`."""


def in_process(function: Callable[..., dict], kwargs: dict) -> dict:
    """materialize's default runner: the call, here."""
    return function(**kwargs)


def materialize(ctx: RunContext, stage: str, call: Call, label: str | None = None,
                runner: Callable[[Callable[..., dict], dict], dict] = in_process,
                loads_models: bool | None = None) -> Artifact:
    """Return the stage's artifact for this call, computing it only if no manifest exists.

    The key is derived from the call (tasks/calls.py); computing it, `runner(call.function, kwargs)` makes the
    call with its slots filled: OUT_DIR the folder being written, WORK_DIR the store's work_path for the key
    (checkpoints a rerun of the key continues from), ON_METRICS the stage run's MLflow metrics. `loads_models`:
    whether the call may import transformers in this process (then `import_eagerly` first); None: every stage but
    the DATA_STAGES."""
    section = call.key()
    key = artifact_key(ctx.store, stage, call, section)
    label = label or stage
    found, damage = ctx.store.lookup(stage, key)
    if found is not None:
        record_cached(ctx, label, key, found)
        return replace(found, reused=True)
    if damage:  # e.g. a file deleted by hand: recompute this stage only
        ctx.reporter.warn(f"{label}: {ctx.store.path(stage, key)} is damaged ({'; '.join(damage)}); recomputing it")
    started = ctx.reporter.start(label)
    if loads_models is None:
        loads_models = stage not in DATA_STAGES  # a bad row is reported without first importing transformers (~6 s)
    if loads_models:
        import_eagerly()  # before any stage thread touches transformers/peft; a fully cached run skips it
    input_keys = {n: f"{a.stage}/{a.key}" for n, a in call.inputs.items()}
    run_id = ctx.lineage.stage_run(label, key, section, input_keys)

    logged: set[tuple[str, int]] = set()  # (metric, step): MLflow keeps every copy, so each is logged once

    def on_metrics(metrics: dict, step: int = 0) -> None:
        fresh = {k: v for k, v in metrics.items() if (k, step) not in logged}  # e.g. HF's final log repeats `epoch`
        logged.update((k, step) for k in fresh)
        ctx.lineage.log_metrics(run_id, fresh, step)

    slots = {WORK_DIR: ctx.store.work_path(stage, key), ON_METRICS: on_metrics}
    meter = costs.Meter()  # what the call costs: tasks/costs.py says what is counted

    def produce(out):
        with meter:
            return runner(call.function, call.kwargs({**slots, OUT_DIR: out}))

    try:
        artifact = ctx.store.write(stage, key, produce, inputs=input_keys, config=section,
                                   cost=lambda out, summary: meter.cost(costs.stage_tokens(stage, out, summary)))
    except BaseException:
        ctx.lineage.client.set_terminated(run_id, status="FAILED")
        raise
    ctx.lineage.log_metrics(run_id, {k: v for k, v in artifact.manifest["summary"].items()
                                     if isinstance(v, (int, float)) and k not in {name for name, _ in logged}})
    if artifact.reused:  # another run computed it while this one waited for its lock: nothing spent here
        ctx.lineage.log_metrics(run_id, costs.metrics(costs.recorded_cost(artifact.manifest), "cost_avoided_"))
    else:
        ctx.lineage.log_metrics(run_id, {"wall_time_s": artifact.manifest["wall_time_s"],
                                         **costs.metrics(artifact.manifest["cost"], "cost_")})
    ctx.lineage.set_tags(run_id, {"posttrain.cached": str(artifact.reused).lower()})
    ctx.lineage.client.set_terminated(run_id)
    ctx.reporter.done(label, stage, artifact.path, cached=artifact.reused, started=started,
                      cost=costs.recorded_cost(artifact.manifest))
    return artifact


def record_cached(ctx: RunContext, label: str, key: str, found: Artifact) -> None:
    """A stage read from the cache: it costs nothing in this run; its nested MLflow run (tag posttrain.cached)
    and its summary row record what it cost when it was computed as avoided (`cost_avoided_*`). No parent run
    open (a rescore that has computed nothing yet, flows/rescore.py): the row only."""
    avoided = costs.recorded_cost(found.manifest)
    if ctx.lineage.parent_id is not None:
        run_id = ctx.lineage.stage_run(label, found.key, {}, found.manifest.get("inputs", {}),
                                       tags={"posttrain.cached": "true"})
        ctx.lineage.log_metrics(run_id, costs.metrics(avoided, "cost_avoided_"))
        ctx.lineage.client.set_terminated(run_id)
    ctx.reporter.done(label, found.stage, found.path, cached=True, cost=avoided)


def pinned_sources(cfg):
    """`cfg` (the transform or preferences section) with each hub dataset of its datasets and test_datasets
    resolved to its commit (the stage reads that commit, and the section's key shows it), and the local files of
    the others (which the key holds by digest)."""
    from stages.data import sources

    if not cfg.datasets:
        return cfg, ()
    pinned, files = {}, []
    for name in ("datasets", "test_datasets"):
        entries = []
        for source in getattr(cfg, name) or []:
            if sources.kind(source) == "hub":
                source = source.model_copy(update={"revision": sources.hub_revision(source)})
            else:
                files += [str(p) for p in sources.local_paths(source)]
            entries.append(source)
        pinned[name] = entries or None
    return cfg.model_copy(update=pinned), tuple(files)


@task(name="demo_data", cache_policy=NO_CACHE)
def demo_data_task(ctx: RunContext) -> Artifact:
    return materialize(ctx, "demo_data", Call(demo_data.run, {}, cfg=ctx.config.demo_data, out_dir=OUT_DIR))


@task(name="transform", cache_policy=NO_CACHE)
def transform_task(ctx: RunContext, raw: Artifact | None) -> Artifact:
    cfg, source_files = pinned_sources(ctx.config.transform)
    if cfg.datasets:  # the stage reads the sources (stages/data/sources.py)
        files = None
    elif cfg.paths:
        files = {split: UserFile(p) for split, p in cfg.paths.items()}
    else:
        files = {split: InputFile(raw, f"{split}.parquet") for split in demo_data.SPLITS}
    types = (cfg.type, *(s.type for s in (cfg.datasets or []) + (cfg.test_datasets or []) if s.type))
    return materialize(ctx, "transform", Call(
        transform.run, {"raw": raw},
        cfg=Config(cfg, code=types, builtins=transform.BUILTINS, files=source_files), raw_files=files,
        out_dir=OUT_DIR))


@dataclass(frozen=True)
class ResolvedModel(Arg):
    """model.path as resolved before the key (a hub id is downloaded into the hub cache if it is not there): the
    stage gets the ModelSource, the key its commit (a hub id: the commit, not the id alone) or the digest of its
    files (a folder or a .gguf file)."""

    value: model_source.ModelSource

    def as_key(self) -> dict:
        return {"commit": self.value.commit} if self.value.commit else {"files": path_digest(self.value.path)}


@task(name="base_model", cache_policy=NO_CACHE)
def base_model_task(ctx: RunContext, prompts: Artifact) -> Artifact:
    cfg = ctx.config.model
    if cfg.path:  # read from the path: the fields that build a model here (sizes, seed) make nothing of it
        source = ResolvedModel(model_source.resolve(cfg.path, cfg.revision))
        call = Call(base_model.run, {}, cfg=Config(cfg, only=base_model.PATH_FIELDS), texts=[], out_dir=OUT_DIR,
                    source=source)
    else:  # built here: the tokenizer is trained on the prompts' texts
        split = ctx.config.sft.split if ctx.config.sft.enabled else "train"
        call = Call(base_model.build, {"prompts": prompts}, cfg=cfg,
                    prompts_path=InputFile(prompts, f"{split}.parquet"),
                    completion_field=ctx.config.sft.completion_field, out_dir=OUT_DIR)
    return materialize(ctx, "base_model", call)


LAUNCHERS = {"torchrun": distributed.launch, "ray": ray_training.launch_on_ray}
"""`train.backend` -> the function that runs a stage on train.num_processes ranks (same arguments)."""


def run_training(ctx: RunContext, function: Callable[..., dict], label: str, **kwargs) -> dict:
    """A training stage's `function(**kwargs)`: in this process (train.num_processes 1), or data-parallel on
    train.num_processes ranks (stages/runtime/distributed.py; where it trains, not what: train.* is in no key),
    its on_metrics and on_step callbacks called here."""
    processes = ctx.config.train.num_processes
    if processes > 1 and ctx.config.train.strategy == "fsdp" and function is not grpo.run:
        logging.getLogger(__name__).warning("%s: train.strategy fsdp shards the optimize stage only; "
                                 "this stage trains with "
                                 "ddp (each rank holds the whole model) on %d processes (HF Trainer, through "
                                 "accelerate, runs CPU ranks as DDP only)", label, processes)
    if processes == 1:
        summary = function(**kwargs)
    else:
        launch = LAUNCHERS[ctx.config.train.backend]
        on_metrics, on_step = kwargs.pop("on_metrics"), kwargs.pop("on_step", None)
        summary = launch(f"{function.__module__}:{function.__name__}", kwargs, ctx.config.train, label,
                         on_metrics=on_metrics, on_step=on_step)
    return {**summary, "num_processes": processes}


def trainer(ctx: RunContext, label: str) -> Callable[[Callable[..., dict], dict], dict]:
    """materialize's runner for a training stage: `run_training`."""
    return lambda function, kwargs: run_training(ctx, function, label, **kwargs)


@task(name="sft", cache_policy=NO_CACHE)
def sft_task(ctx: RunContext, model: Artifact, prompts: Artifact) -> Artifact:
    cfg = ctx.config.sft
    return materialize(ctx, "sft", Call(
        sft.run, {"model": model, "prompts": prompts}, cfg=cfg, model_dir=InputDir(model),
        prompts_path=InputFile(prompts, f"{cfg.split}.parquet"), out_dir=OUT_DIR, on_metrics=ON_METRICS,
        work_dir=WORK_DIR, devices=placement(ctx)), runner=trainer(ctx, "sft"))


def is_adapter(folder: Artifact) -> bool:
    """Whether an optimize round's (or the preference stage's) output is a LoRA adapter (PEFT's
    adapter_config.json), not full weights."""
    return (folder.path / "adapter_config.json").exists()


@dataclass(frozen=True)
class Sampled(Arg):
    """The sampling policy after `version` optimize rounds (adapter: that round's output, or the preference
    stage's), as a rollout's argument: the stage gets the Policy (a LoRA adapter on the starting policy when the
    folder holds one, else the folder's full weights, adapter: none), the key both artifacts and the version
    (the rows record it)."""

    policy: Artifact
    adapter: Artifact | None
    version: int

    @property
    def value(self) -> Policy:
        if self.adapter is None:
            return Policy(self.policy.path, version=self.version)
        if not is_adapter(self.adapter):
            return Policy(self.policy.path, weights_dir=self.adapter.path, version=self.version)
        return Policy(self.policy.path, adapter_dir=self.adapter.path, version=self.version)

    def as_key(self) -> list:
        return [self.policy, self.adapter, self.version]


def policy_for(ctx: RunContext, policy: Artifact, adapter: Artifact | None, version: int) -> Policy:
    """The sampling policy after `version` optimize rounds (`Sampled`), e.g. for the policy server of a recipe."""
    return Sampled(policy, adapter, version).value


def policy_dirs(policy: Artifact, adapter: Artifact | None) -> tuple[InputDir, InputDir | None]:
    """(model_dir, adapter_dir) of the policy `policy` + `adapter` (policy_for's cases) as a stage's arguments:
    full weights replace the starting policy's folder."""
    if adapter is not None and not is_adapter(adapter):
        return InputDir(adapter), None
    return InputDir(policy), InputDir(adapter) if adapter is not None else None


@task(name="eval", task_run_name="eval-{label}", cache_policy=NO_CACHE)
def eval_task(ctx: RunContext, model: Artifact, prompts: Artifact, label: str,
              adapter: Artifact | None = None, version: int = -1) -> Artifact:
    """Evaluate `model`, or with `adapter` (an optimize round's output) the policy `model` + that round: greedy
    accuracy on the eval split's prompts (stages/evaluation/evaluate.py)."""
    scoring = ctx.config.score  # how the verifier runs: workers, timeout, remote verifiers, max_error_rate
    cfg = ctx.config.eval.model_copy(update={"reward_funcs": evaluate.verifier_funcs(ctx.config.eval,
                                                                                     scoring.reward_funcs)})
    functions, folders = split_reward_funcs(cfg.reward_funcs)  # the verifier: keyed as the score stage keys it
    model_dir, adapter_dir = policy_dirs(model, adapter)
    return materialize(ctx, "eval", Call(
        evaluate.run, {"model": model, "prompts": prompts, "adapter": adapter},
        cfg=Config(cfg, code=tuple(functions), builtins=BUILTIN_REWARDS, files=tuple(folders)), model_dir=model_dir,
        adapter_dir=adapter_dir, prompts_path=InputFile(prompts, f"{cfg.split}.parquet"), out_dir=OUT_DIR,
        on_progress=Progress(ctx.reporter.progress(f"eval {label}", "prompt")), devices=placement(ctx),
        scoring=Config(scoring, only=evaluate.SCORING_FIELDS), log_dir=WORK_DIR),
        label=f"eval {label}")


@task(name="eval", task_run_name="{label}-rejudged", cache_policy=NO_CACHE)
def rejudge_task(ctx: RunContext, evaluated: Artifact, prompts: Artifact, label: str) -> Artifact:
    """The eval `evaluated` judged again, nothing generated: its eval.parquet's completions by the verifiers of
    ctx.config.score.reward_funcs, chosen as a run chooses them when eval.reward_funcs is unset (`posttrain
    rescore`, flows/rescore.py: what an edited reward says of the run's held-out completions)."""
    scoring = ctx.config.score
    unset = ctx.config.eval.model_copy(update={"reward_funcs": None})
    cfg = ctx.config.eval.model_copy(update={"reward_funcs": evaluate.verifier_funcs(unset, scoring.reward_funcs)})
    functions, folders = split_reward_funcs(cfg.reward_funcs)
    return materialize(ctx, "eval", Call(
        evaluate.rejudge, {"eval": evaluated, "prompts": prompts},
        cfg=Config(cfg, code=tuple(functions), builtins=BUILTIN_REWARDS, files=tuple(folders)),
        eval_path=InputFile(evaluated, "eval.parquet"), prompts_path=InputFile(prompts, f"{cfg.split}.parquet"),
        out_dir=OUT_DIR, scoring=Config(scoring, only=evaluate.SCORING_FIELDS), log_dir=WORK_DIR,
        devices=placement(ctx)), label=f"{label} rejudged", loads_models=bool(folders))


@task(name="eval", task_run_name="eval-{label}", cache_policy=NO_CACHE)
def strided_eval_task(ctx: RunContext, model: Artifact, prompts: Artifact, label: str,
                      adapter: Artifact | None = None, version: int = -1,
                      feature_model: Artifact | None = None) -> Artifact:
    """rl: ebft, ebft.mode: strided: evaluate as eval_task does, on raw documents: the held-out documents' blocks
    against their own continuations (stages/training/ebft_strided.py). `feature_model`: whose features compare
    continuations (the starting policy); unset: `model`'s."""
    cfg = ctx.config.eval
    model_dir, adapter_dir = policy_dirs(model, adapter)
    features = feature_model or model  # before the rounds: the policy they start from
    return materialize(ctx, "eval", Call(
        ebft_strided.evaluate, {"model": model, "prompts": prompts, "adapter": adapter, "feature_model": features},
        ebft=Config(ctx.config.ebft, only=ctx.config.ebft.BLOCK_FIELDS),  # the blocks; the rest is scoring's
        max_documents=cfg.max_prompts, model_dir=model_dir, adapter_dir=adapter_dir,
        feature_model_dir=InputDir(features), prompts_path=InputFile(prompts, f"{cfg.split}.parquet"),
        out_dir=OUT_DIR, on_progress=Progress(ctx.reporter.progress(f"eval {label}", "document")),
        devices=placement(ctx)), label=f"eval {label}")


@dataclass(frozen=True)
class EngineSettings(Arg):
    """rollout.engine_options(cfg, max_lora_rank, devices) as the rollout's argument, which keys the config's
    `vllm` (the rollout task's Config leaves it to this). The key holds the rollout.vllm options the engine is
    handed, dtype as resolved for the placement (those a vllm_server engine is not handed are the server's own),
    vllm.max_model_len wherever a vLLM engine runs (the stage's prompt-length check reads it off the config),
    and the placement. The rest says how the engine runs, not what it samples: batch_size is
    rollout.generation_batch_size (the config's key holds it), rollout.ray_vllm places the engines,
    max_lora_rank is the largest adapter the engine is ready to load."""

    cfg: rollout.RolloutConfig
    max_lora_rank: int
    devices: devices.DeviceConfig

    @property
    def value(self) -> dict:
        return rollout.engine_options(self.cfg, self.max_lora_rank, self.devices)

    def as_key(self) -> dict:
        handed = self.value
        vllm = {k: handed[k] for k in key_fields(self.cfg.vllm) if k in handed}
        if self.cfg.engine != "transformers":  # rollout.check_prompt_lengths: rows too long for it
            vllm["max_model_len"] = self.cfg.vllm.max_model_len
        return {"vllm": vllm, "devices": self.devices}


@task(name="rollout", task_run_name="rollout-r{round_index}", cache_policy=NO_CACHE)
def rollout_task(ctx: RunContext, policy: Artifact, adapter: Artifact | None, prompts: Artifact,
                 round_index: int, policy_version: int, reroll_prompt_ids: list[str] = ()) -> Artifact:
    """The round's completions of rollout.prompts_per_round prompts by the rollout engine (in the rollout worker
    process with rollout.worker_process: where, not what)."""
    cfg = ctx.config.rollout
    worker = shared_worker(cfg.worker_cpus, cfg.prefetch_torch_threads) if cfg.worker_process else None
    return materialize(ctx, "rollout", Call(
        rollout.run, {"policy": policy, "adapter": adapter, "prompts": prompts},
        cfg=Config(cfg, keyed_elsewhere=("vllm",), code=(cfg.rollout_func,) if cfg.rollout_func else ()),
        policy=Sampled(policy, adapter, policy_version), prompts_path=InputFile(prompts, "train.parquet"),
        round_index=round_index, out_dir=OUT_DIR,
        engine_settings=EngineSettings(cfg, ctx.config.grpo.lora_r, placement(ctx)),
        on_progress=Progress(ctx.reporter.progress(f"rollout r{round_index}", "completion")),
        reroll_prompt_ids=list(reroll_prompt_ids),  # grpo.scope_rl: its groups' share and temperature
        **scope_rl.sampling(ctx.config.grpo, adapter.manifest["summary"].get("entropy") if adapter else None)),
        label=f"rollout r{round_index}",
        runner=(lambda _, kwargs: (costs.claim(worker.pid()), worker.run(**kwargs))[1]) if worker else in_process)


@task(name="rollout", task_run_name="rollout-r{round_index}", cache_policy=NO_CACHE)
def strided_rollout_task(ctx: RunContext, policy: Artifact, adapter: Artifact | None, prompts: Artifact,
                         round_index: int, policy_version: int, reroll_prompt_ids: list[str] = ()) -> Artifact:
    """rl: ebft, ebft.mode: strided: the round's blocks of raw documents (stages/training/ebft_strided.py);
    re-rolls do not apply (flows/config.py refuses them)."""
    sampling = ("prompts_per_round", "num_generations", "temperature", "top_p", "seed")  # what it reads of rollout
    return materialize(ctx, "rollout", Call(
        ebft_strided.rollout, {"policy": policy, "adapter": adapter, "prompts": prompts},
        ebft=Config(ctx.config.ebft, only=ctx.config.ebft.BLOCK_FIELDS),  # the blocks; the rest is scoring's
        rollout_cfg=Config(ctx.config.rollout, only=sampling),
        policy=Sampled(policy, adapter, policy_version), prompts_path=InputFile(prompts, "train.parquet"),
        round_index=round_index, out_dir=OUT_DIR,
        on_progress=Progress(ctx.reporter.progress(f"rollout r{round_index}", "document")), devices=placement(ctx)),
        label=f"rollout r{round_index}")


def atropos_batch_size(ctx: RunContext) -> int:
    """Sequences per pulled batch (registered with the API): prompts_per_round groups of num_generations."""
    return ctx.config.rollout.prompts_per_round * ctx.config.rollout.num_generations


@dataclass(frozen=True)
class Served(Arg):
    """An Atropos session as a pull's argument. The recipe opened it and set what it serves (session.serve)
    outside this call; the key holds that: the policy (`policy` + `adapter`), the batch size it registered,
    and the rollout settings its policy server samples with (the environment asks for temperature and length
    itself)."""

    value: object
    policy: Artifact
    adapter: Artifact | None
    batch_size: int
    sampling: dict

    def as_key(self) -> dict:
        return {"policy": [self.policy, self.adapter], "batch_size": self.batch_size, **self.sampling}


@task(name="rollout", task_run_name="atropos-r{round_index}", cache_policy=NO_CACHE)
def atropos_batch_task(ctx: RunContext, session, policy: Artifact, adapter: Artifact | None,
                       round_index: int) -> Artifact:
    """Round `round_index`'s batch pulled from the Atropos API (rollout.source: atropos), stored before
    anything trains on it. Its key: the registration (API, batch size, max token length), the round, and
    the policy being served when it was pulled; a resumed run finds it and asks the API for no other."""
    cfg = ctx.config.rollout
    sampling = {k: getattr(cfg, k) for k in ("engine", "temperature", "top_p", "max_completion_length")}
    return materialize(ctx, "rollout", Call(
        atropos.pull, {"policy": policy, "adapter": adapter}, opts=ctx.config.rollout.atropos,
        session=Served(session, policy, adapter, atropos_batch_size(ctx), sampling), round_index=round_index,
        num_generations=cfg.num_generations, tokenizer_dir=InputDir(policy), out_dir=OUT_DIR),
        label=f"atropos batch r{round_index}")


@task(name="score", task_run_name="atropos-score-r{round_index}", cache_policy=NO_CACHE)
def atropos_score_task(ctx: RunContext, rollouts: Artifact, round_index: int) -> Artifact:
    """The pulled batch with rewards = the environments' scores and group advantages (score.scale_rewards)."""
    return materialize(ctx, "score", Call(
        atropos.score, {"rollouts": rollouts}, rollouts_path=InputFile(rollouts, "rollouts.parquet"),
        num_generations=ctx.config.rollout.num_generations, scale_rewards=ctx.config.score.scale_rewards,
        out_dir=OUT_DIR), label=f"score r{round_index}")


@task(name="score", task_run_name="ebft-score-r{round_index}", cache_policy=NO_CACHE)
def ebft_score_task(ctx: RunContext, rollouts: Artifact, round_index: int, feature_model: Artifact) -> Artifact:
    """rl: ebft: feature-matching rewards from the frozen `feature_model`, the starting policy
    (stages/training/ebft.py)."""
    return materialize(ctx, "score", Call(
        ebft.run, {"rollouts": rollouts, "feature_model": feature_model}, cfg=ctx.config.ebft,
        rollouts_path=InputFile(rollouts, "rollouts.parquet"), feature_model_dir=InputDir(feature_model),
        num_generations=ctx.config.rollout.num_generations, scale_rewards=ctx.config.score.scale_rewards,
        out_dir=OUT_DIR, devices=placement(ctx)), label=f"score r{round_index}")


def resolve_reward_models(ctx: RunContext) -> dict:
    """{score.reward_funcs entry: ResolvedModel} for the reward models named TRL's way (a hub id: the commit its
    main branch is at now; a folder: its files). A run resolves them once, so every round scores with the same
    commit, and the score key holds it."""
    funcs = ctx.config.score.reward_funcs
    return {name: ResolvedModel(resolve_model_name(name, f"score.reward_funcs.{funcs.index(name)}"))
            for name in funcs if is_model_name(name)}


@task(name="score", task_run_name="score-r{round_index}", cache_policy=NO_CACHE)
def score_task(ctx: RunContext, rollouts: Artifact, round_index: int, reward_model: Artifact | None = None,
               reward_models: dict | None = None) -> Artifact:
    """score.reward_funcs on the round's rollouts; `reward_model`: this run's reward_model stage, for the
    `reward_model` entry of reward_funcs; `reward_models`: `resolve_reward_models`' (None: resolved now)."""
    cfg = ctx.config.score
    rm = reward_model if "reward_model" in cfg.reward_funcs else None
    functions, folders = split_reward_funcs(cfg.reward_funcs)
    models = resolve_reward_models(ctx) if reward_models is None else reward_models
    models_here = bool(rm or folders or models)  # reward models run; the functions themselves run in workers
    return materialize(ctx, "score", Call(
        score.run, {"rollouts": rollouts, "reward_model": rm},
        cfg=Config(cfg, code=tuple(functions), builtins=BUILTIN_REWARDS, files=tuple(folders)),
        rollouts_path=InputFile(rollouts, "rollouts.parquet"), num_generations=ctx.config.rollout.num_generations,
        out_dir=OUT_DIR, reward_model_dir=InputDir(rm) if rm else None,
        devices=placement(ctx) if models_here else None,  # only where a reward model runs
        log_dir=WORK_DIR,  # where reward_errors.log stays when a function fails too often
        reward_models=models or None, streaming=ctx.config.grpo.streaming_partial_batch,
        scope_positive_threshold=ctx.config.grpo.scope_positive_threshold if ctx.config.grpo.scope_rl else None),
        label=f"score r{round_index}", loads_models=models_here)


@task(name="replay", task_run_name="replay-r{round_index}", cache_policy=NO_CACHE)
def replay_task(ctx: RunContext, scored: Artifact, replacements: list, round_index: int) -> Artifact:
    """The round's scored rows with zero-signal groups swapped for cached groups of earlier rounds."""
    return materialize(ctx, "replay", Call(
        replay.run, {"scored": scored}, scored_path=InputFile(scored, "scored.parquet"), replacements=replacements,
        round_index=round_index, out_dir=OUT_DIR), label=f"replay r{round_index}")


@task(name="optimize", task_run_name="optimize-r{round_index}", cache_policy=NO_CACHE)
def optimize_task(ctx: RunContext, policy: Artifact, adapter: Artifact | None, scored: Artifact,
                  round_index: int, ce_coef: float = 0.0, rl_coef: float = 1.0) -> Artifact:
    """One round of GRPO updates on the scored rows; `ce_coef` (rl: ebft's): add that times the reference
    completion's cross-entropy to the loss; `rl_coef` (rl: ebft's): the policy-gradient loss's weight."""
    label = f"optimize r{round_index}"
    return materialize(ctx, "optimize", Call(
        grpo.run, {"policy": policy, "adapter": adapter, "scored": scored}, cfg=ctx.config.grpo,
        base_dir=InputDir(policy), prev_adapter_dir=InputDir(adapter) if adapter else None,
        scored_path=InputFile(scored, "scored.parquet"), round_index=round_index,
        temperature=ctx.config.rollout.temperature, max_completion_length=ctx.config.rollout.max_completion_length,
        out_dir=OUT_DIR, on_step=Progress(ctx.reporter.progress(label, "step")), on_metrics=ON_METRICS,
        ce_coef=ce_coef, devices=placement(ctx), rl_coef=rl_coef), label=label, runner=trainer(ctx, label))


@task(name="preferences", cache_policy=NO_CACHE)
def preferences_task(ctx: RunContext) -> Artifact:
    """The preferences table: your data through `preferences`, or demo pairs for the built-in task."""
    cfg = ctx.config
    if cfg.preferences is None:
        return materialize(ctx, "preferences", Call(demo_pairs.write_demo_pairs, {}, cfg=cfg.demo_pairs,
                                                    out_dir=OUT_DIR, demo=cfg.demo_data))
    prefs, source_files = pinned_sources(cfg.preferences)
    types = tuple(t for t in (prefs.type, *(s.type for s in (prefs.datasets or []) + (prefs.test_datasets or [])))
                  if isinstance(t, str))
    return materialize(ctx, "preferences", Call(
        preferences.run, {}, cfg=Config(prefs, code=types, builtins=preferences.builtins(prefs.namespace),
                                        files=(*(prefs.paths or {}).values(), *source_files)), out_dir=OUT_DIR))


@task(name="preference_optimization", task_run_name="{label}", cache_policy=NO_CACHE)
def preference_optimization_task(ctx: RunContext, policy: Artifact, prefs: Artifact, label: str) -> Artifact:
    return materialize(ctx, "dpo", Call(
        dpo.run, {"policy": policy, "preferences": prefs}, cfg=ctx.config.dpo, model_dir=InputDir(policy),
        preferences_dir=InputDir(prefs), out_dir=OUT_DIR, on_metrics=ON_METRICS, work_dir=WORK_DIR,
        devices=placement(ctx)), label=label, runner=trainer(ctx, label))


@task(name="reward_model", cache_policy=NO_CACHE)
def reward_model_task(ctx: RunContext, policy: Artifact, prefs: Artifact) -> Artifact:
    return materialize(ctx, "reward_model", Call(
        reward_model.run, {"policy": policy, "preferences": prefs}, cfg=ctx.config.reward_model,
        model_dir=InputDir(policy), preferences_dir=InputDir(prefs), out_dir=OUT_DIR, on_metrics=ON_METRICS,
        work_dir=WORK_DIR, devices=placement(ctx)), runner=trainer(ctx, "reward_model"))


@task(name="export", cache_policy=NO_CACHE)
def export_task(ctx: RunContext, policy: Artifact, adapter: Artifact | None, lineage_keys: dict,
                train_metrics: dict) -> Artifact:
    base_dir, adapter_dir = policy_dirs(policy, adapter)
    return materialize(ctx, "export", Call(
        export.run, {"policy": policy, "adapter": adapter}, cfg=ctx.config.export, base_dir=base_dir,
        adapter_dir=adapter_dir, out_dir=OUT_DIR, metrics=Notes(train_metrics), lineage=Notes(lineage_keys),
        config=Notes(ctx.config.model_dump(mode="json")), devices=placement(ctx)))
