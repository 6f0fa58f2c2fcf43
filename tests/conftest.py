"""Shared fixtures: one Prefect test harness per session (its server costs ~10 s to start)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # prefect_test_harness's server: no telemetry

import pytest

# Fixtures that mark a test as end to end (`slow`): a whole flow on the Prefect harness, a Ray cluster.
# `make test-fast` leaves them out (-m "not slow"); `make test` runs everything.
END_TO_END_FIXTURES = {"prefect_harness", "ray_home"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which turns the groups into node ids (`id@group`)
def pytest_collection_modifyitems(config, items):
    """Mark end-to-end tests `slow`, and group tests for pytest-xdist (`make test`: `-n 2 --dist loadgroup`): a
    file's tests stay on one worker (its module-scoped fixtures are built once), except that every test starting
    Ray goes to one worker, so two Ray clusters never compete for the 2 cores (and a dashboard port) at once."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & END_TO_END_FIXTURES:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("xdist_group") is None:  # a test may name its group (a Ray cluster of its own)
            group = "ray" if "ray_home" in fixtures else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(name=group))
    items[:] = heaviest_groups_first(items)


def heaviest_groups_first(items: list) -> list:
    """The tests in groups ordered by how many `slow` tests each holds, most first (stable otherwise). pytest-xdist
    (with --no-loadscope-reorder, as `make test` runs it) hands a worker the next group in this order when it is
    free, so the long groups start early and the last ones are short: both workers end within seconds of each other
    (xdist's own order, most tests first, left SmolLM2's one two-minute test for last, run while the other worker
    sat idle)."""
    groups: dict[str, list] = {}
    for item in items:
        marker = item.get_closest_marker("xdist_group")
        groups.setdefault(marker.kwargs.get("name") or marker.args[0], []).append(item)
    weight = {name: sum(item.get_closest_marker("slow") is not None for item in tests)
              for name, tests in groups.items()}
    return [item for name in sorted(groups, key=lambda name: -weight[name]) for item in groups[name]]


@pytest.fixture(scope="session")
def prefect_harness():
    """The session's Prefect server (a subprocess), its URL in this process's Prefect settings: yields the API URL
    (pass it as PREFECT_API_URL to a `posttrain` subprocess: see `harness_api_url`)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    harness = prefect_test_harness(server_startup_timeout=180)
    with pytest.MonkeyPatch.context() as patch:  # in the server process's environment only (set while it starts)
        patch.setenv(*HARNESS_RECORDER_BATCH)
        harness.__enter__()
    try:
        yield PREFECT_API_URL.value()
    finally:
        harness.__exit__(None, None, None)


HARNESS_RECORDER_BATCH = ("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE", "100")
"""The harness server writes task-run events to its database 100 at a time (or every 5 s), not one transaction per
event as Prefect's default: server CPU per tiny run 1.05-1.19 -> 0.65-0.73 s (benchmarks/harness_server_cpu.py).
No test reads task runs from the harness; the servers tests start themselves (`posttrain server`, a run's temporary
server) keep Prefect's default, and their tests read task runs right after a run."""


@pytest.fixture
def harness_api_url(prefect_harness) -> str:
    """The session's Prefect API URL, for `posttrain` subprocesses whose test is not about the temporary server a
    run starts without one (tests/test_preflight.py, test_sqlite_busy.py and test_atropos.py's kill test keep
    that): a configured server, as `posttrain server` users have. Saves each process its own server start (~9 s of
    CPU) and, in a new Prefect home, its database migrations (~13 s more)."""
    return prefect_harness


# Ray 2.60's token authentication is off for the loopback clusters the tests start: a token lives in
# ~/.ray, ray.init caches it in the process and sets RAY_AUTH_MODE=token there, so a cluster started later
# in another HOME gets another token (or, inheriting the mode, none: its GCS exits) and this process
# presents the stale one. Measured: local instance, then a `ray start` cluster in a new HOME, then a local
# instance again works with auth disabled and fails with it on. Users' clusters keep Ray's default.
os.environ["RAY_AUTH_MODE"] = "disabled"


@pytest.fixture(scope="session")
def ray_home(tmp_path_factory):
    """The HOME of every Ray cluster and local Ray instance this test process starts or joins (Ray writes
    under ~/.ray; this keeps it out of the real HOME)."""
    return tmp_path_factory.mktemp("ray-home")


@pytest.fixture
def tiny_config_text(tmp_path):
    """A whole pipeline small enough for a test: ~1 minute on 2 cores."""
    return tiny_text(tmp_path / "artifacts")


def tiny_text(artifacts) -> str:
    return f"""
name: test-tiny
artifacts_dir: {artifacts}
demo_data: {{num_sft: 300, num_train: 64, num_eval: 24}}
model: {{hidden_size: 64, num_attention_heads: 1, num_key_value_heads: 1, intermediate_size: 128,
        num_hidden_layers: 2, vocab_size: 300}}
sft: {{num_train_epochs: 1, micro_batch_size: 32}}
rollout: {{num_generations: 4, prompts_per_round: 8, max_completion_length: 8}}
score: {{reward_num_workers: 1}}
grpo: {{rounds: 2, micro_batch_size: 16, gradient_accumulation_steps: 1,
       skip_zero_advantage_batches: false}}  # the tiny policy gets little reward signal; still step
eval: {{max_completion_length: 8}}
export: {{model_name: test-tiny}}
"""


@pytest.fixture(scope="session")
def empty_mlflow_store(tmp_path_factory):
    """An MLflow sqlite store with its tables and nothing else, made once (MLflow's migrations take ~2 s a store)."""
    from tasks.lineage import create_store_whole

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    create_store_whole(f"sqlite:///{path}")
    return path


WARM_STAGES = ("demo_data", "transform", "base_model", "sft")
"""The stages a tiny run starts with, before any round (~10 s of CPU in a test process)."""


@pytest.fixture(scope="session")
def tiny_warm_store(prefect_harness, tmp_path_factory, empty_mlflow_store):
    """An artifacts folder holding tiny_config_text's WARM_STAGES, computed once per test process."""
    import shutil

    from flows.pipeline import prepare_policy_flow

    root = tmp_path_factory.mktemp("tiny-warm")
    (root / "artifacts").mkdir()
    shutil.copyfile(empty_mlflow_store, root / "artifacts" / "mlflow.db")
    (root / "tiny.yaml").write_text(tiny_text(root / "artifacts"))
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        prepare_policy_flow(str(root / "tiny.yaml"), quiet=True)
    return root / "artifacts"


@pytest.fixture
def tiny_config(tmp_path, tiny_config_text, monkeypatch, empty_mlflow_store, request):
    """tiny_config_text written to a file, with MLflow on the sqlite store under its artifacts (a copy of
    `empty_mlflow_store`: what the run would create first; tests/test_resume.py and test_concurrency.py create
    stores the run's way). A test on the Prefect harness also finds WARM_STAGES there (copies of
    `tiny_warm_store`'s, which its run reuses where its config gives them the same keys), unless it is marked
    `first_run` (it asserts what a run computes from nothing)."""
    import shutil

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = tmp_path / "tiny.yaml"
    path.write_text(tiny_config_text)
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir(exist_ok=True)
    shutil.copyfile(empty_mlflow_store, artifacts / "mlflow.db")
    if "prefect_harness" in request.fixturenames and request.node.get_closest_marker("first_run") is None:
        copy_warm_stages(request.getfixturevalue("tiny_warm_store"), artifacts)
    return path


def copy_warm_stages(warm, artifacts) -> None:
    """Copy the WARM_STAGES of an artifacts folder (tiny_warm_store's, or test_demo_learns' prepared quickstart)
    into another (without the store's dot files)."""
    import shutil

    for stage in WARM_STAGES:
        shutil.copytree(warm / stage, artifacts / stage, ignore=shutil.ignore_patterns(".*"))


def warm_tiny_folder(root, warm, mlflow_store):
    """`root`/tiny.yaml (the tiny config) on `root`/artifacts: a copy of the empty MLflow store and of `warm`'s
    WARM_STAGES, so a run of it computes only its rounds on. Returns the artifacts folder."""
    import shutil

    artifacts = root / "artifacts"
    artifacts.mkdir()
    shutil.copyfile(mlflow_store, artifacts / "mlflow.db")
    copy_warm_stages(warm, artifacts)
    (root / "tiny.yaml").write_text(tiny_text(artifacts))
    return artifacts


@pytest.fixture
def out_dir(tmp_path):
    """An empty folder a stage writes into."""
    out = tmp_path / "out"
    out.mkdir()
    return out


def tiny_model(root, texts: list[str]):
    """A tiny Qwen2 causal LM (2 layers, width 64, vocab 300) with the ChatML template under root/model,
    its tokenizer trained on `texts`."""
    from stages.data import base_model

    cfg = base_model.BaseModelConfig(vocab_size=300, hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
                                     intermediate_size=128, num_hidden_layers=2)
    base_model.run(cfg, texts, root / "model")


def tiny_say_policy(root, num_prompts: int):
    """tiny_model on "say i" chats under root/model and `num_prompts` "say i" prompts under
    root/prompts/train.parquet (shared by the GRPO tests)."""
    import json

    from stages.data import transform

    tiny_model(root, [f"<|im_start|>user\nsay {i}<|im_end|>\n<|im_start|>assistant\n{i * 7}<|im_end|>"
                      for i in range(200)])
    raw = [{"question": f"say {i}", "answer": str(i)} for i in range(num_prompts)]
    (root / "raw.jsonl").write_text("\n".join(json.dumps(r) for r in raw))
    (root / "prompts").mkdir()
    transform.run(transform.TransformConfig(), {"train": root / "raw.jsonl"}, root / "prompts")
    return root


def tiny_round(root, num_prompts: int, prompts_per_round: int) -> list[dict]:
    """tiny_say_policy under root and one round of its rollouts (4 generations of 6 tokens per prompt) in
    root/rollouts/rollouts.parquet; returns the rows."""
    import pyarrow.parquet as pq

    from stages.rollout import rollout
    from stages.rollout.engines import Policy

    tiny_say_policy(root, num_prompts)
    (root / "rollouts").mkdir()
    rollout.run(rollout.RolloutConfig(num_generations=4, prompts_per_round=prompts_per_round, max_completion_length=6),
                Policy(root / "model"), root / "prompts" / "train.parquet", 0, root / "rollouts")
    return pq.read_table(root / "rollouts" / "rollouts.parquet").to_pylist()


def output_logits_logps(model, tokenizer, prompts: list, sampling) -> tuple:
    """(new tokens, expected log-probs) of the engine's sampling done again with transformers' `output_logits`:
    the same seeded generator, and log softmax(raw logits / temperature)[token] of every step, the reference
    the engine's recorded `sampling_logprobs` must equal bit for bit. expected(row, ids) -> [float]."""
    import torch

    from stages.rollout.engines import prompt_token_ids
    from stages.rollout.engines.hf import own_generator

    enc = tokenizer.pad({"input_ids": prompt_token_ids(tokenizer, prompts)}, return_tensors="pt").to(model.device)
    with torch.no_grad(), own_generator(torch.Generator(device=model.device).manual_seed(sampling.seed)):
        out = model.generate(**enc, max_new_tokens=sampling.max_new_tokens, do_sample=True,
                             temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             return_dict_in_generate=True, output_logits=True)

    def expected(row: int, ids: list[int]) -> list[float]:
        return [torch.log_softmax(out.logits[t][row].float() / sampling.temperature, dim=-1)[token].item()
                for t, token in enumerate(ids)]

    return out.sequences[:, enc["input_ids"].shape[1]:], expected


def write_scored(path, rows: list[dict], advantages: list[float]) -> None:
    """Rollout rows written as a scored parquet whose reward and advantage are `advantages` (one toy reward)."""
    import pyarrow as pa

    from stages.data.schemas import ROLLOUTS, SCORED, write_table

    table = (pa.Table.from_pylist(rows, schema=ROLLOUTS)
             .append_column("rewards", pa.array([[("toy", a)] for a in advantages], type=SCORED.field("rewards").type))
             .append_column("reward", pa.array(advantages, type=pa.float64()))
             .append_column("advantage", pa.array(advantages, type=pa.float64()))
             .append_column("errors", pa.array([[] for _ in rows], type=SCORED.field("errors").type)))
    write_table(table, path, SCORED)


def tiny_preference_model(root, num_train: int, num_eval: int):
    """A tiny Qwen2 causal LM with the ChatML template under root/model and demo preference pairs
    under root/prefs (shared by the DPO and reward-model tests)."""
    from stages.data.demo_data import DemoDataConfig
    from stages.data.demo_pairs import DemoPairsConfig, write_demo_pairs

    tiny_model(root, [f"<|im_start|>user\nWhich is the largest of {i % 9 + 1}, {i * 3 % 9 + 1}?<|im_end|>\n"
                      f"<|im_start|>assistant\n<answer>{i % 9 + 1}</answer><|im_end|>" for i in range(200)])
    (root / "prefs").mkdir()
    write_demo_pairs(DemoPairsConfig(num_train=num_train, num_eval=num_eval), root / "prefs",
                     DemoDataConfig(num_sft=10, num_train=10, num_eval=10))
    return root


def computed(results) -> list[str]:
    """The stages a pipeline run computed (not served from the cache), in order."""
    return [row["stage"] for row in results["stages"] if row["status"] == "computed"]


class Quiet:
    """A reporter that shows nothing."""

    def progress(self, *args, **kwargs):
        return None


@pytest.fixture
def key_of(monkeypatch, tmp_path):
    """key_of(task, config_dict, *args): the key the task would look up for that config (no stage runs)."""
    from flows.config import PipelineConfig
    from tasks import stage_tasks
    from tasks.store import ArtifactStore

    monkeypatch.setattr(stage_tasks, "materialize",
                        lambda ctx, stage, call, **_: stage_tasks.artifact_key(ctx.store, stage, call))

    def key_of(task, config: dict, *args):
        ctx = stage_tasks.RunContext(PipelineConfig.model_validate(config), ArtifactStore(tmp_path / "artifacts"),
                                     lineage=None, reporter=Quiet())
        return task.fn(ctx, *args)

    return key_of
