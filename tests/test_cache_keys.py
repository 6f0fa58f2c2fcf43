"""Artifact keys hash everything a stage reads: user code a config names (`module.fn`), files and folders
named by path, and the project modules a stage module imports. The keys are computed by calling the
stage tasks' functions with `materialize` replaced by the key it would look up (no stage runs, no torch);
one pipeline test edits a reward function between two runs."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from conftest import computed
from stages.runtime.imports import local_modules, source_digest
from tasks import stage_tasks, store
from tasks.store import Artifact, code_version


def artifact(stage: str, tmp_path: Path) -> Artifact:
    return Artifact(stage, f"{stage}-key", tmp_path / stage, {})


def user_module(folder: Path, name: str, source: str) -> Path:
    """Write folder/name.py. An edit in a test changes the file's size: the digest cache is keyed by
    mtime and size, and two writes within a clock tick can share an mtime."""
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(source)
    return path


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A folder on sys.path for the tests' user modules (also for spawned reward workers)."""
    folder = tmp_path / "usercode"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


def test_editing_a_reward_function_changes_the_score_key_only(key_of, user_dir, tmp_path):
    user_module(user_dir, "keys_helper", "BONUS = 1.0\n")
    module = user_module(user_dir, "keys_reward", "from keys_helper import BONUS\n\n"
                         "def fixed(completions, **kw):\n    return [0.5] * len(completions)\n")
    config = {"score": {"reward_funcs": ["accuracy", "keys_reward.fixed"]}}
    model, prompts, rollouts = (artifact(s, tmp_path) for s in ("sft", "transform", "rollout"))

    def keys():
        return (key_of(stage_tasks.score_task, config, rollouts, 0),
                key_of(stage_tasks.rollout_task, config, model, None, prompts, 0, 0))

    score_before, rollout_before = keys()
    assert keys() == (score_before, rollout_before)  # nothing edited: the same keys
    module.write_text(module.read_text().replace("[0.5]", "[0.75]"))
    score_after, rollout_after = keys()
    assert score_after != score_before and rollout_after == rollout_before  # round 0's rollout stays cached
    (user_dir / "keys_helper.py").write_text("BONUS = 2.25\n")  # a module the reward module imports
    assert keys()[0] not in (score_before, score_after)
    # optimize r0 reads the scored rows: its key follows the score key
    optimize = [key_of(stage_tasks.optimize_task, config, model, None, Artifact("score", k, tmp_path, {}), 0)
                for k in (score_before, score_after)]
    assert optimize[0] != optimize[1]


def test_a_library_on_pythonpath_is_hashed_only_without_its_install_metadata(key_of, user_dir, tmp_path,
                                                                           monkeypatch):
    """A reward module importing a library that lives outside site-packages, with a namespace subpackage
    whose parent was never imported: the key is computed (issue 42: KeyError), the library's files are
    hashed as your code while nothing says it is installed, and not hashed once its *.dist-info is beside it
    (`pip install --target DIR`): an installed library, as in site-packages."""
    lib = tmp_path / "target"
    (lib / "keys_gym" / "induction").mkdir(parents=True)
    (lib / "keys_gym" / "__init__.py").write_text("")
    task = lib / "keys_gym" / "induction" / "tasks.py"  # a namespace subpackage: no __init__.py
    task.write_text("def score(text):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(lib))
    user_module(user_dir, "keys_gym_reward", "def graded(completions, **kw):\n"
                "    from keys_gym.induction.tasks import score\n    return [score(c) for c in completions]\n")
    config = {"score": {"reward_funcs": ["keys_gym_reward.graded"]}}
    rollouts = artifact("rollout", tmp_path)

    before = key_of(stage_tasks.score_task, config, rollouts, 0)
    task.write_text("def score(text):\n    return 0.5\n")
    assert key_of(stage_tasks.score_task, config, rollouts, 0) != before  # no metadata: hashed

    info = lib / "keys_gym-1.0.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("keys_gym/__init__.py,,\nkeys_gym/induction/tasks.py,,\n"
                                 "keys_gym-1.0.dist-info/RECORD,,\n")
    task.write_text("def score(text):\n    return 0.25\n")
    installed = key_of(stage_tasks.score_task, config, rollouts, 0)
    task.write_text("def score(text):\n    return 0.125\n")
    assert key_of(stage_tasks.score_task, config, rollouts, 0) == installed  # an installed library: not hashed
    assert "keys_gym.induction.tasks" not in local_modules("keys_gym_reward")


def test_editing_a_transform_function_changes_the_transform_key(key_of, user_dir, tmp_path):
    module = user_module(user_dir, "keys_transform", "def qa(cfg):\n    return (lambda row: row), {}\n")
    config = {"transform": {"type": "keys_transform.qa"}}
    raw = artifact("demo_data", tmp_path)
    before = key_of(stage_tasks.transform_task, config, raw)
    assert before != key_of(stage_tasks.transform_task, {}, raw)  # (the built-in: no user code)
    module.write_text(module.read_text() + "# edited\n")
    assert key_of(stage_tasks.transform_task, config, raw) != before


def test_editing_a_rollout_func_changes_the_rollout_key(key_of, user_dir, tmp_path):
    module = user_module(user_dir, "keys_rollout", "def once(prompts, engine, policy, sampling, tokenizer):\n"
                         "    return engine.generate(policy, prompts, sampling)\n")
    config = {"rollout": {"rollout_func": "keys_rollout.once"}}
    args = (artifact("sft", tmp_path), None, artifact("transform", tmp_path), 0, 0)
    before = key_of(stage_tasks.rollout_task, config, *args)
    module.write_text(module.read_text() + "\n\ndef twice(**kw):\n    return []\n")
    assert key_of(stage_tasks.rollout_task, config, *args) != before


def test_editing_a_preferences_builder_changes_the_preferences_key(key_of, user_dir, tmp_path):
    module = user_module(user_dir, "keys_prefs", "def pairs(cfg):\n    return lambda row: row\n")
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    config = {"rl": "dpo", "preferences": {"type": "keys_prefs.pairs", "paths": {"train": str(data)}}}
    before = key_of(stage_tasks.preferences_task, config)
    module.write_text(module.read_text() + "# edited\n")
    assert key_of(stage_tasks.preferences_task, config) != before


def test_a_model_folder_is_hashed_into_the_base_model_key(key_of, tmp_path):
    folder = tmp_path / "my_model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "weights.bin").write_bytes(b"\0" * 8)
    config = {"model": {"path": str(folder)}}
    prompts = artifact("transform", tmp_path)
    before = key_of(stage_tasks.base_model_task, config, prompts)
    assert key_of(stage_tasks.base_model_task, config, prompts) == before
    (folder / "sub" / "weights.bin").write_bytes(b"\1" * 9)
    edited = key_of(stage_tasks.base_model_task, config, prompts)
    assert edited != before
    (folder / "tokenizer.json").write_text("{}")  # a new file
    assert key_of(stage_tasks.base_model_task, config, prompts) not in (before, edited)
    # a model read from a folder is not built from the prompts' texts: sft options do not reach its key
    assert key_of(stage_tasks.base_model_task, {**config, "sft": {"split": "train"}}, prompts) == \
        key_of(stage_tasks.base_model_task, config, prompts)


def test_a_reward_model_folder_is_hashed_into_the_score_key(key_of, tmp_path):
    folder = tmp_path / "rm.v1"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    config = {"score": {"reward_funcs": ["accuracy", f"reward_model:{folder}"]}}
    rollouts = artifact("rollout", tmp_path)
    before = key_of(stage_tasks.score_task, config, rollouts, 0)
    (folder / "config.json").write_text('{"a": 22}')
    assert key_of(stage_tasks.score_task, config, rollouts, 0) != before


def test_base_model_key_has_the_texts_its_tokenizer_is_trained_on(key_of, tmp_path):
    prompts = artifact("transform", tmp_path)
    default = key_of(stage_tasks.base_model_task, {}, prompts)
    assert key_of(stage_tasks.base_model_task, {"sft": {"split": "train"}}, prompts) != default
    assert key_of(stage_tasks.base_model_task, {"sft": {"completion_field": "answer"}}, prompts) != default
    assert key_of(stage_tasks.base_model_task, {"sft": {"enabled": False}}, prompts) != default
    # without sft the texts come from the train split, whatever sft.split says
    assert key_of(stage_tasks.base_model_task, {"sft": {"enabled": False, "split": "x"}}, prompts) == \
        key_of(stage_tasks.base_model_task, {"sft": {"enabled": False}}, prompts)
    assert key_of(stage_tasks.base_model_task, {"sft": {"learning_rate": 0.1}}, prompts) == default


def test_a_rollout_key_has_only_the_vllm_options_its_engine_gets(key_of, tmp_path):
    args = (artifact("sft", tmp_path), None, artifact("transform", tmp_path), 0, 0)

    def key(engine, **vllm):
        return key_of(stage_tasks.rollout_task, {"rollout": {"engine": engine, "vllm": vllm}}, *args)

    assert key("transformers", dtype="bfloat16", gpu_memory_utilization=0.5) == key("transformers")
    assert key("vllm", dtype="bfloat16") != key("vllm")
    assert key("vllm", server_url="http://elsewhere:8000", server_adapter_root="/srv") == key("vllm")
    assert key("vllm_server", dtype="bfloat16", enforce_eager=False) == key("vllm_server")  # the server's own
    assert key("vllm_server", server_adapter_root="/srv") != key("vllm_server")
    # the stage's prompt-length check reads max_model_len wherever a vLLM engine runs (a server's included)
    assert key("vllm_server", max_model_len=64) != key("vllm_server")
    assert key("transformers", max_model_len=64) == key("transformers")


def _stage(cfg, data_path, out_dir, scale: float = 1.0, on_progress=None) -> dict:
    """A stand-in stage function for the Call tests."""
    return {}


def test_a_call_keys_every_argument_it_passes(tmp_path):
    """The key of a Call is derived from its arguments: every one is in it unless it is at the function's default
    or of a kind that says where or when (out_dir, progress); an argument without a key (a bare path) or an
    artifact the call does not name among its inputs is refused."""
    from stages.scoring.score import ScoreConfig
    from tasks.calls import OUT_DIR, Call, InputFile, Progress

    data = artifact("rollout", tmp_path)

    def key(**arguments) -> dict:
        return Call(_stage, {"data": data}, **{"cfg": ScoreConfig(), "data_path": InputFile(data, "x.parquet"),
                                               "out_dir": OUT_DIR, **arguments}).key()

    plain = key()
    assert set(plain) == {"cfg", "data_path"} and plain["data_path"] == ["rollout/rollout-key", "x.parquet"]
    assert key(scale=1.0, on_progress=Progress(print)) == plain  # the default; a progress callback
    assert key(scale=0.5)["scale"] == 0.5
    assert key(cfg=ScoreConfig(backend="ray")) == plain  # score.backend is declared not_in_key
    with pytest.raises(TypeError, match="argument data_path: a PosixPath has no key"):
        key(data_path=tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"reads \['sft/sft-key'\]"):
        key(data_path=InputFile(artifact("sft", tmp_path), "x.parquet"))
    with pytest.raises(TypeError):
        Call(_stage, {}, cfg=ScoreConfig(), out_dir=OUT_DIR)  # data_path missing: refused before any key


def test_code_version_follows_the_modules_a_stage_imports(tmp_path, monkeypatch):
    import importlib

    package = tmp_path / "keys_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "stage.py").write_text("import json\nfrom keys_pkg.losses import loss\n\n"
                                      "def run():\n    from . import workers\n    return workers, loss, json\n")
    (package / "losses.py").write_text("from .math import square\n\ndef loss(x):\n    return square(x)\n")
    (package / "math.py").write_text("def square(x):\n    return x * x\n")
    (package / "workers.py").write_text("N = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stage = importlib.import_module("keys_pkg.stage")
    before = source_digest("keys_pkg.stage")
    assert code_version(stage) == code_version(stage)
    for name, edit in (("math.py", "def square(x):\n    return x ** 2\n"),  # imported by an imported module
                       ("workers.py", "N = 22\n"),  # a function-level relative import
                       ("__init__.py", "# the package\n")):
        (package / name).write_text(edit)
        after = source_digest("keys_pkg.stage")
        assert after != before, name
        before = after
    # this process still runs the code it imported: it refuses to key results by the edited files
    with pytest.raises(RuntimeError, match="changed on disk after this process loaded it"):
        code_version(stage)
    monkeypatch.setattr(store, "_first_versions", {})  # a new process: the new code, a new version
    assert len(code_version(stage)) == 12


def test_stage_code_versions_cover_their_imports_without_importing_torch():
    from stages.runtime.imports import local_modules

    assert {"stages.scoring.reward_workers", "stages.scoring.rewards.math",
            "stages.scoring.rewards.reward_model"} <= set(local_modules("stages.scoring.score"))
    assert {"stages.rollout.engines.hf",
            "stages.rollout.engines.vllm_local"} <= set(local_modules("stages.rollout.rollout"))
    assert "stages.training.trainer_setup" in local_modules("stages.training.reward_model")  # training_args, as dpo's
    assert not any(name.startswith(("torch", "transformers", "pydantic"))
                   for name in local_modules("stages.training.grpo"))
    script = ("import sys\nfrom stages.data import schemas\nfrom tasks.store import code_version\n"
              "import stages.training.grpo, stages.rollout.rollout, stages.scoring.score, "
              "stages.training.reward_model, "
              "stages.training.sft, stages.training.dpo, stages.evaluation.evaluate, stages.training.export, "
              "stages.data.base_model, stages.data.transform, stages.data.preferences\n"
              "for name in [m for m in sys.modules if m.startswith('stages.')]:\n"
              "    code_version(sys.modules[name], schemas)\n"
              "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported torch'\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_an_edited_reward_function_rescored_on_the_next_run(prefect_harness, tiny_config, user_dir):
    from flows.pipeline import posttrain_pipeline

    module = user_module(user_dir, "keys_e2e_reward", "def fixed(completions, **kw):\n"
                         "    return [0.25] * len(completions)\n")
    overrides = ["grpo.rounds=2", "score.reward_funcs=[accuracy, keys_e2e_reward.fixed]"]
    first = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    assert "score r0" in computed(first)
    module.write_text(module.read_text().replace("0.25", "0.750"))
    second = posttrain_pipeline(str(tiny_config), overrides, quiet=True)
    # rollout r0 (and everything before it) cached; the evals judge with the run's own verifier (its one
    # non-built-in reward function, issue 44), so their keys hold its digest too
    assert computed(second) == ["eval base", "score r0", "optimize r0", "rollout r1", "score r1", "optimize r1",
                                "export", "eval final"]
    scored = Path(next(row["path"] for row in second["stages"] if row["stage"] == "score r0")) / "scored.parquet"
    rewards = [dict(r)["keys_e2e_reward.fixed"] for r in pq.read_table(scored).column("rewards").to_pylist()]
    assert set(rewards) == {0.75}


def test_where_training_runs_is_not_part_of_its_key(key_of, tmp_path):
    """train.* (how many processes, which port) changes where optimize and sft train, not what."""
    policy, scored, prompts = (artifact(s, tmp_path) for s in ("sft", "score", "transform"))
    elsewhere = {"train": {"num_processes": 2, "master_port": 29511}}
    for config in ({}, elsewhere):
        assert key_of(stage_tasks.optimize_task, config, policy, None, scored, 0) == \
            key_of(stage_tasks.optimize_task, {}, policy, None, scored, 0)
        assert (key_of(stage_tasks.sft_task, config, policy, prompts)
                == key_of(stage_tasks.sft_task, {}, policy, prompts))


RUN_OPTIONS = {
    # option -> (another valid value, with what it needs, the stage tasks whose key must not change)
    "model.revision": ("v2", {}, ["base_model"]),
    "sft.save_steps": (7, {}, ["sft"]),
    "dpo.save_steps": (7, {}, ["dpo"]),
    "reward_model.save_steps": (7, {}, ["reward_model"]),
    "eval.every_rounds": (3, {}, ["eval"]),
    "grpo.rounds": (99, {}, ["optimize", "rollout"]),
    "grpo.replay_buffer_size": (64, {}, ["optimize"]),
    "grpo.reroll_start_fraction": (0.5, {}, ["optimize"]),
    "grpo.reroll_max_groups": (2, {}, ["optimize"]),
    "grpo.logps_chunk_tokens": (4096, {}, ["optimize"]),
    "score.backend": ("ray", {}, ["score"]),
    "score.ray": ({"num_cpus": 3}, {}, ["score"]),
    "rollout.async_prefetch": (True, {}, ["rollout"]),
    "rollout.prefetch_depth": (2, {"rollout.async_prefetch": True, "rollout.max_staleness": 2}, ["rollout"]),
    "rollout.max_staleness": (0, {}, ["rollout"]),
    "rollout.prefetch_torch_threads": (1, {}, ["rollout"]),
    "rollout.worker_process": (True, {}, ["rollout"]),
    "rollout.worker_cpus": ([0], {"rollout.worker_process": True}, ["rollout"]),
    "rollout.trainer_cpus": ([1], {}, ["rollout"]),
    "rollout.ray_vllm": ({"num_engines": 2}, {}, ["rollout"]),
    "rollout.source": ("atropos", {}, ["rollout"]),
    "rollout.atropos": ({"api_url": "http://elsewhere:8000"}, {}, ["rollout"]),
    "rollout.vllm.sleep_mode": (True, {}, ["rollout"]),
    "rollout.vllm.server_url": ("http://elsewhere:8000", {}, ["rollout"]),
    "rollout.vllm.server_urls": (["http://a:8000", "http://b:8000"], {}, ["rollout"]),
    "rollout.vllm.server_timeout_s": (5.0, {}, ["rollout"]),
    "rollout.vllm.server_wait_s": (30.0, {}, ["rollout"]),
    "rollout.vllm.serve_host": ("0.0.0.0", {}, ["rollout"]),
    "rollout.atropos.start_api": (False, {}, ["atropos"]),
    "rollout.atropos.api_command": ("/opt/run-api", {}, ["atropos"]),
    "rollout.atropos.api_start_timeout_s": (5.0, {}, ["atropos"]),
    "rollout.atropos.policy_url": ("http://127.0.0.1:9999", {}, ["atropos"]),
    "rollout.atropos.batch_timeout_s": (5.0, {}, ["atropos"]),
    "rollout.atropos.policy_token_env": ("POLICY_TOKEN", {}, ["atropos"]),
    # rl: ebft's sampling keys set rollout's (whose key holds them); its score key is checked in test_ebft.py
    "ebft.temperature": (0.6, {}, ["score"]),
    "ebft.top_p": (0.9, {}, ["score"]),
    "ebft.rl_coef": (0.5, {}, ["score", "rollout"]),
}
"""Every field declared `not_in_key` (stages/runtime/keys.py), with a value to change it to and the stages it must not
change the key of. A field declared so and missing here fails `test_run_options_are_listed`."""


def declared_outside_keys() -> set[str]:
    """The option paths of every field whose class declares it outside the key."""
    from flows.config import PipelineConfig
    from stages.runtime.keys import key_rule

    found, pending = set(), [("", PipelineConfig)]
    while pending:
        prefix, model = pending.pop()
        for name, field in model.model_fields.items():
            path = f"{prefix}{name}"
            if prefix and key_rule(model, name) is False:
                found.add(path)
            if typing.get_origin(field.annotation) in (dict, list):  # named entries: tested where they are used
                continue
            for kind in (field.annotation, *getattr(field.annotation, "__args__", ())):
                if isinstance(kind, type) and hasattr(kind, "model_fields"):
                    pending.append((path + ".", kind))
    return found


def test_run_options_are_listed():
    assert declared_outside_keys() == set(RUN_OPTIONS)


def stage_keys(key_of, config: dict, tmp_path: Path) -> dict[str, str]:
    """{stage: the key its task would look up} for one config dict (the stages it can key without a run)."""
    a = {s: artifact(s, tmp_path) for s in ("sft", "transform", "rollout", "score", "preferences", "demo_data")}
    tasks = {
        "demo_data": (stage_tasks.demo_data_task,),
        "sft": (stage_tasks.sft_task, a["sft"], a["transform"]),
        "eval": (stage_tasks.eval_task, a["sft"], a["transform"], "base"),
        "rollout": (stage_tasks.rollout_task, a["sft"], None, a["transform"], 1, 1),
        "atropos": (stage_tasks.atropos_batch_task, None, a["sft"], None, 1),
        "score": (stage_tasks.score_task, a["rollout"], 1),
        "optimize": (stage_tasks.optimize_task, a["sft"], None, a["score"], 1),
        "dpo": (stage_tasks.preference_optimization_task, a["sft"], a["preferences"], "dpo"),
        "reward_model": (stage_tasks.reward_model_task, a["sft"], a["preferences"]),
    }
    if not (config.get("model") or {}).get("path"):  # a path is resolved (read) before the key
        tasks["base_model"] = (stage_tasks.base_model_task, a["transform"])
    return {stage: key_of(task, config, *args) for stage, (task, *args) in tasks.items()}


def with_option(config: dict, path: str, value) -> dict:
    config = {**config}
    *sections, name = path.split(".")
    node = config
    for section in sections:
        node[section] = dict(node.get(section) or {})
        node = node[section]
    node[name] = value
    return config


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml")),
                         ids=lambda p: p.name)
def test_which_options_change_which_stage_key(key_of, tmp_path, path):
    """For each config of configs/: every run option (RUN_OPTIONS) changed alone leaves its stages' keys as they
    are; and one option of each stage's own section changes that stage's key, nothing upstream of it."""
    from flows.config import load_config

    config = load_config(str(path), []).model_dump(mode="json", exclude_unset=True)
    config.pop("name", None)
    before, refused = stage_keys(key_of, config, tmp_path), []
    for option, (value, needs, stages) in RUN_OPTIONS.items():
        changed = config
        for need, need_value in {**needs, option: value}.items():
            changed = with_option(changed, need, need_value)
        try:
            after = stage_keys(key_of, changed, tmp_path)
        except ValidationError as e:  # refused for this config (e.g. replay under Atropos): not an option of it
            if "not read under" not in str(e):  # a section the config's method never reads: not counted
                refused.append(option)
            continue
        for stage in stages:
            if stage in before:
                assert after[stage] == before[stage], f"{path.name}: {option} changed the {stage} key"
    assert len(refused) <= len(RUN_OPTIONS) // 3, refused
    changes = {"grpo.learning_rate": ["optimize"], "rollout.temperature": ["rollout", "optimize", "atropos"],
               "eval.max_completion_length": ["eval"], "sft.learning_rate": ["sft"], "dpo.rl_beta": ["dpo"],
               "score.reward_weights": [], "demo_data.num_train": ["demo_data"]}
    for option, stages in changes.items():
        section, name = option.split(".")
        current = getattr(getattr(load_config(str(path), []), section), name)
        other = {"grpo.learning_rate": 3.3e-4, "rollout.temperature": 0.55, "eval.max_completion_length": 9,
                 "sft.learning_rate": 3.3e-4, "dpo.rl_beta": 0.33, "demo_data.num_train": 1234}.get(option, current)
        try:
            after = stage_keys(key_of, with_option(config, option, other), tmp_path)
        except ValidationError as e:  # the config's method reads nothing of this section
            assert "not read under" in str(e), e
            continue
        assert {s for s in before if after[s] != before[s]} == set(stages), f"{path.name}: {option}"


def test_key_fields_leave_out_what_the_class_declares():
    from pydantic import BaseModel

    from stages.runtime.keys import key_fields, key_when_set, not_in_key

    class Section(BaseModel):
        lr: float = 1e-3
        save_steps: int = not_in_key(100, ge=1)
        added_later: int | None = key_when_set(None)

    assert key_fields(Section()) == {"lr": 1e-3}
    assert key_fields(Section(save_steps=5)) == {"lr": 1e-3}
    assert key_fields(Section(added_later=3)) == {"lr": 1e-3, "added_later": 3}
