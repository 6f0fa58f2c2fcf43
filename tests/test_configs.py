"""Every YAML in configs/ validates; typos and wrong types fail with the path and a hint."""

import re
from pathlib import Path

import pytest

from flows.cli import main
from flows.config import ConfigError, PipelineConfig, load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
QUICKSTART = Path(__file__).parent.parent / "configs" / "quickstart.yaml"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate(path):
    assert isinstance(load_config(path), PipelineConfig)


def test_quickstart_exists():
    assert any(p.name == "quickstart.yaml" for p in CONFIGS)


def test_typo_names_full_path_and_suggestion(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  learning_rte: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    message = str(e.value)
    assert "bad.yaml" in message
    assert "'grpo.learning_rte'" in message
    assert "did you mean 'grpo.learning_rate'" in message


def test_unknown_section_suggests_closest(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollot:\n  temperature: 0.5\n")
    with pytest.raises(ConfigError, match="did you mean 'rollout'"):
        load_config(bad)


def test_wrong_type_names_path_value_and_expected(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  num_generations: many\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    message = str(e.value)
    assert "rollout.num_generations" in message and "'many'" in message and "integer" in message


def test_dotted_overrides_parse_values():
    cfg = load_config(QUICKSTART, ["grpo.rounds=2", "rollout.temperature=0.8", "score.reward_funcs=[accuracy]",
                                      "score.reward_weights=[1.0]"])
    assert cfg.grpo.rounds == 2
    assert cfg.rollout.temperature == 0.8
    assert cfg.score.reward_funcs == ["accuracy"]


def test_override_typo_fails():
    with pytest.raises(ConfigError, match="did you mean 'grpo.rounds'"):
        load_config(CONFIGS[0], ["grpo.round=2"])


def test_reward_weights_must_match_functions(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("score:\n  reward_funcs: [accuracy, format]\n  reward_weights: [1.0]\n")
    with pytest.raises(ConfigError, match="reward_weights has 1 values for 2 reward_funcs"):
        load_config(bad)


def test_cli_validate_reports_error_and_exit_code(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  betta: 0.1\n")
    assert main(["validate", str(bad)]) == 2
    assert "did you mean 'grpo.beta'" in capsys.readouterr().err
    assert main(["validate", str(CONFIGS[0]), "grpo.rounds=3"]) == 0
    assert "rounds: 3" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["inf", ".inf", "-.inf", "nan"])
def test_a_number_that_is_not_finite_is_refused_naming_the_key(value, tmp_path, capsys):
    # gt=0 refuses nan and -inf itself (nan > 0 is false) but lets inf through: every number is checked.
    with pytest.raises(ConfigError, match=r"grpo\.learning_rate: got \S*(inf|nan)"):
        load_config(QUICKSTART, [f"grpo.learning_rate={value}"])
    with pytest.raises(ConfigError, match=r"grpo\.learning_rate: got inf; expected a finite number"):
        load_config(QUICKSTART, ["grpo.learning_rate=inf"])
    with pytest.raises(ConfigError, match=r"score\.reward_weights\.1: got inf; expected a finite number"):
        load_config(QUICKSTART, ["score.reward_weights=[1.0, .inf]"])
    assert main(["validate", str(QUICKSTART), "grpo.learning_rate=inf"]) == 2
    assert "grpo.learning_rate" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "# nothing here yet\n", "{}\n"])
def test_an_empty_config_file_is_an_error_naming_it(text, tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(empty))}: empty config.*configs/quickstart.yaml"):
        load_config(empty)
    assert main(["validate", str(empty)]) == 2
    assert "empty config" in capsys.readouterr().err


def test_cli_overrides_may_follow_options(capsys):
    # grpo.rounds=0 is invalid: the error proves the override after --quiet was read.
    assert main(["run", str(CONFIGS[0]), "--quiet", "grpo.rounds=0"]) == 2
    assert "grpo.rounds: got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", str(CONFIGS[0]), "--no-such-flag"])


@pytest.mark.slow  # a whole run or process kill: `make test`, not `make test-fast`
def test_cli_bad_data_row_is_a_few_lines_not_a_traceback(tmp_path, monkeypatch, harness_api_url):
    """`posttrain run` on prompts with a bad row: exit 2 and the row named, without Prefect's traceback;
    `--debug` shows it. On the session's Prefect server (tests/test_preflight.py runs a bad config on a run's own
    temporary server)."""
    import json
    import subprocess
    import sys

    for name in ("MLFLOW_TRACKING_URI", "PREFECT_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_API_URL", harness_api_url)
    data = tmp_path / "train.jsonl"
    # the bad row after the rows `posttrain validate` tries (flows/preflight.py HEAD_ROWS): the transform stage meets it
    rows = [{"question": f"{i}+1?", "answer": str(i + 1)} for i in range(40)] + [{"question": "2+2?"}]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    config = tmp_path / "bad.yaml"
    config.write_text(f"name: bad-row\nartifacts_dir: {tmp_path / 'artifacts'}\n"
                      f"transform: {{paths: {{train: {data}, eval: {data}}}}}\n")
    posttrain = str(Path(sys.executable).with_name("posttrain"))
    out = subprocess.run([posttrain, "run", str(config), "--quiet"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "error: transform: 2 bad row(s)" in out.stderr
    assert f"{data} (train) row 40: missing or empty field answer" in out.stderr
    # no traceback through our code (Prefect's own server may log unrelated ones when the machine is busy)
    assert "stages/data/transform.py" not in out.stderr and "flows/pipeline.py" not in out.stderr
    debug = subprocess.run([posttrain, "run", str(config), "--quiet", "--debug"], capture_output=True, text=True,
                           cwd=tmp_path, timeout=300)
    assert debug.returncode != 0 and "stages/data/transform.py" in debug.stderr


def test_rl_gdpo_sets_normalize_then_sum_and_rejects_the_other():
    quickstart = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    cfg = load_config(quickstart, ["rl=gdpo"])
    assert cfg.uses_rounds and cfg.score.multi_objective_aggregation == "normalize_then_sum"
    assert load_config(quickstart).score.multi_objective_aggregation == "sum_then_normalize"
    with pytest.raises(ConfigError, match="rl: gdpo uses score.multi_objective_aggregation: normalize_then_sum"):
        load_config(quickstart, ["rl=gdpo", "score.multi_objective_aggregation=sum_then_normalize"])


def test_cpu_split_names_the_key():
    quickstart = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    with pytest.raises(ConfigError, match=r"rollout.worker_cpus: \[999\]"):
        load_config(quickstart, ["rollout.worker_process=true", "rollout.worker_cpus=[999]"])
    with pytest.raises(ConfigError, match="rollout.worker_cpus needs rollout.worker_process: true"):
        load_config(quickstart, ["rollout.worker_cpus=[0]"])


def test_server_urls_are_checked():
    quickstart = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
    ok = load_config(quickstart, ["rollout.engine=vllm_server",
                                  'rollout.vllm.server_urls=["http://a:8000", "http://b:8000"]'])
    assert ok.rollout.vllm.server_urls == ["http://a:8000", "http://b:8000"]
    with pytest.raises(ConfigError, match="rollout.vllm.server_urls lists .'http://a:8000'. more than once"):
        load_config(quickstart, ['rollout.vllm.server_urls=["http://a:8000", "http://a:8000"]'])
    with pytest.raises(ConfigError, match="each must be a URL"):
        load_config(quickstart, ['rollout.vllm.server_urls=["a:8000"]'])
    with pytest.raises(ConfigError, match="server_urls is empty"):
        load_config(quickstart, ["rollout.vllm.server_urls=[]"])


def test_prm_reward_model_trains_on_stepwise_demo_rows():
    rm_grpo = Path(__file__).parent.parent / "configs" / "rm_grpo.yaml"
    assert load_config(rm_grpo).demo_pairs.kind == "pair"
    assert load_config(rm_grpo, ["reward_model.kind=prm"]).demo_pairs.kind == "stepwise"
    with pytest.raises(ConfigError, match="reward_model.kind: prm trains on stepwise rows"):
        load_config(rm_grpo, ["reward_model.kind=prm", "demo_pairs.kind=pair"])


def test_train_section_typos_and_batch_split(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'train.num_processes'"):
        load_config(CONFIGS[0], ["train.num_proceses=2"])
    with pytest.raises(ConfigError, match="sft.micro_batch_size is 30, not divisible by train.num_processes = 4"):
        load_config(CONFIGS[0], ["train.num_processes=4", "sft.micro_batch_size=30"])
    with pytest.raises(ConfigError, match="train.strategy: fsdp shards the optimizer state"):
        load_config(CONFIGS[0], ["train.num_processes=2", "train.strategy=fsdp", "grpo.optim=adafactor"])
    with pytest.raises(ConfigError, match="did you mean 'train.ray.num_cpus_per_process'"):
        load_config(CONFIGS[0], ["train.backend=ray", "train.ray.num_cpus_per_proces=2"])
    with pytest.raises(ConfigError, match="train.backend"):
        load_config(CONFIGS[0], ["train.backend=slurm"])
    with pytest.raises(ConfigError, match="ebft.ce_coef with train.strategy: fsdp is not built"):
        load_config(next(c for c in CONFIGS if c.name == "ebft.yaml"),
                    ["train.num_processes=2", "train.strategy=fsdp", "ebft.ce_coef=0.1"])
    sharded = load_config(CONFIGS[0], ["train.num_processes=2", "train.strategy=fsdp", "train.backend=ray"])
    assert (sharded.train.strategy, sharded.train.backend, sharded.train.ray.placement) == ("fsdp", "ray", "spread")
    cfg = load_config(CONFIGS[0], ["train.num_processes=2"])
    assert cfg.train.num_processes == 2 and cfg.train.strategy == "ddp" and cfg.train.master_port is None


@pytest.mark.parametrize("overrides, message", [
    (["rollout.source=atropos", "rl=ebft"], "rl: ebft with rollout.source: atropos"),
    (["rollout.source=atropos", "rl=gdpo"], "rl: gdpo with rollout.source: atropos"),
    (["rollout.source=atropos", "score.reward_funcs=[reward_model]"],
     "score.reward_funcs: not read under rollout.source"),
    (["rollout.source=atropos", "score.multi_objective_aggregation=normalize_then_sum", "grpo.replay_buffer_size=4",
      "rollout.top_p=0.9"], "score.multi_objective_aggregation, grpo.replay_buffer_size, rollout.top_p: not read"),
    (["rollout.source=atropos", "grpo.reroll_start_fraction=0.5"], "grpo.reroll_start_fraction: not read"),
    (["rl=ebft", "score.reward_weights=[1.0, 2.0]"], "score.reward_weights: not read under rl: ebft"),
    (["rollout.prefetch_depth=2"], "rollout.prefetch_depth needs rollout.async_prefetch"),
    (["rollout.async_prefetch=true", "rollout.prefetch_depth=3", "rollout.max_staleness=2"],
     "max_staleness 2 caps the lag at 2"),
    # a section the method reads nothing of
    (["dpo.rl_beta=0.3"], r"dpo.rl_beta: not read under rl: grpo \(the DPO family's section\)"),
    (["dpo.rl_beta=0.1"], r"dpo.rl_beta: not read under rl: grpo"),  # set, even to its default (issue 44 item 8)
    (["ebft.ce_coef=0.1"], r"ebft.ce_coef: not read under rl: grpo \(rl: ebft's section\)"),
    (["reward_model.learning_rate=0.01"], "reward_model.learning_rate: not read under rl: grpo without reward_model "
                                          "in score.reward_funcs"),
    (["rl=dpo"], r"rollout.max_completion_length, rollout.num_generations, rollout.prompts_per_round: not read "
                 r"under rl: dpo \(one preference-optimization stage"),
])
def test_options_the_method_never_reads_are_refused(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(tiny_config, overrides)


def test_options_the_method_reads_still_load(tiny_config):
    load_config(tiny_config, ["rollout.source=atropos", "score.scale_rewards=batch"])  # makes the advantages
    load_config(tiny_config, ["rl=ebft", "score.scale_rewards=none"])
    load_config(tiny_config, ["rollout.async_prefetch=true", "rollout.prefetch_depth=2", "rollout.max_staleness=2"])
    load_config(tiny_config, ["score.reward_funcs=[reward_model]", "reward_model.learning_rate=0.01"])
    load_config(tiny_config, ["rl=ebft", "ebft.ce_coef=0.1"])
    load_config(tiny_config, ["seed=5"])  # the top-level seed sets every section's, read or not


def test_a_saved_config_of_an_atropos_run_loads_back(tmp_path):
    """A run's saved config.yaml (run_config: every field of the sections the method reads) loads back."""
    import yaml

    cfg = load_config(CONFIGS[0])  # configs/atropos.yaml
    assert cfg.rollout.source == "atropos"
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(cfg.run_config()))
    assert load_config(saved).model_dump() == cfg.model_dump()


def test_a_key_set_twice_is_an_error(tmp_path):
    """YAML keeps the last of two equal keys; a config file that sets one twice is refused, naming both lines."""
    path = tmp_path / "twice.yaml"
    path.write_text("grpo:\n  rounds: 2\n  learning_rate: 1.0e-3\n  rounds: 3\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: not valid YAML: .*key 'rounds' is set twice in one section "
                                          r"\(line 2 and line 4\)"):
        load_config(path)


def test_axolotl_trl_section_and_training_keys_move_to_their_sections(tmp_path):
    """An axolotl GRPO config's `trl:` section and top-level training keys land where posttrain reads them; the DPO
    family's go to `dpo`; a `trl:` key posttrain does not have is an error naming it."""
    path = tmp_path / "axolotl_grpo.yaml"
    path.write_text(
        "rl: grpo\n"
        "trl:\n  beta: 0.001\n  num_generations: 4\n  max_completion_length: 24\n  temperature: 0.9\n"
        "  reward_funcs: [accuracy, format]\n  reward_weights: [1.0, 0.2]\n  use_vllm: true\n  scale_rewards: false\n"
        "adapter: lora\nlora_r: 8\nlora_alpha: 16\nlora_dropout: 0.05\nmicro_batch_size: 8\n"
        "gradient_accumulation_steps: 2\nlearning_rate: 1.0e-5\noptimizer: adamw_torch\nlr_scheduler: constant\n"
        "weight_decay: 0.01\nadam_beta2: 0.99\n")
    cfg = load_config(path)
    assert (cfg.grpo.beta, cfg.grpo.lora_r, cfg.grpo.lora_alpha, cfg.grpo.lora_dropout) == (0.001, 8, 16, 0.05)
    assert (cfg.grpo.micro_batch_size, cfg.grpo.gradient_accumulation_steps, cfg.grpo.learning_rate) == (8, 2, 1e-5)
    assert (cfg.grpo.optim, cfg.grpo.lr_scheduler_type, cfg.grpo.weight_decay, cfg.grpo.adam_beta2) == \
        ("adamw", "constant", 0.01, 0.99)
    assert (cfg.rollout.num_generations, cfg.rollout.max_completion_length, cfg.rollout.temperature,
            cfg.rollout.engine) == (4, 24, 0.9, "vllm")
    assert (cfg.score.reward_funcs, cfg.score.reward_weights, cfg.score.scale_rewards) == \
        (["accuracy", "format"], [1.0, 0.2], "none")
    assert PipelineConfig.model_validate(cfg.run_config()) == cfg  # the saved translation round-trips

    vllm = tmp_path / "axolotl_vllm.yaml"  # axolotl's vllm: section and TRL's colocate keys
    vllm.write_text("rl: grpo\nvllm:\n  device: auto\n  tensor_parallel_size: 2\n  dtype: bfloat16\n"
                    "  max_model_len: 2048\n  enable_prefix_caching: true\n  enforce_eager: false\n"
                    "trl:\n  use_vllm: true\n  vllm_mode: colocate\n  vllm_gpu_memory_utilization: 0.3\n"
                    "  vllm_enable_sleep_mode: false\n  vllm_device: auto\n  vllm_enable_prefix_caching: true\n"
                    "  log_completions: false\n")
    assert load_config(vllm).tracking.completions_per_round == 0
    options = load_config(vllm).rollout.vllm
    assert (options.tensor_parallel_size, options.dtype, options.max_model_len, options.enforce_eager,
            options.gpu_memory_utilization, options.sleep_mode) == (2, "bfloat16", 2048, False, 0.3, False)

    dpo = tmp_path / "axolotl_dpo.yaml"
    dpo.write_text("rl: dpo\nlearning_rate: 5.0e-6\nmicro_batch_size: 4\nnum_epochs: 2\nlora_r: 16\n")
    cfg = load_config(dpo)
    assert (cfg.dpo.learning_rate, cfg.dpo.micro_batch_size, cfg.dpo.num_train_epochs, cfg.dpo.lora_r) == \
        (5e-6, 4, 2, 16)


@pytest.mark.parametrize("text, message", [
    ("rl: grpo\ntrl:\n  use_liger_loss: true\n", r"trl.use_liger_loss: not an option posttrain has"),
    ("rl: grpo\nvllm:\n  serve_module: trl.scripts.vllm_serve\n",
     r"vllm.serve_module: 'trl.scripts.vllm_serve' is the Python module axolotl runs as its server .*remove it"),
    ("rl: grpo\nvllm:\n  worker_extension_cls: trl.scripts.vllm_serve.WeightSyncWorkerExtension\n",
     r"vllm.worker_extension_cls: .* is the vLLM worker class TRL's server loads"),
    ("rl: grpo\ntrl:\n  use_vllm: true\n  vllm_mode: remote\n", r"trl.vllm_mode: 'remote': use colocate .* or server"),
    ("rl: grpo\nvllm:\n  data_parallel_size: 2\n", r"vllm.data_parallel_size: 2 is not honoured here \(several "
                                                   r"engines: rollout.engine: ray_vllm"),
    ("rl: grpo\nvllm:\n  reasoning_parser: deepseek_r1\n", r"vllm.reasoning_parser: 'deepseek_r1' is not honoured"),
    ("rl: grpo\nvllm:\n  dtype: float16\nrollout:\n  vllm:\n    dtype: bfloat16\n",
     r"vllm.dtype \(axolotl's key\) and rollout.vllm.dtype are the same setting"),
    ("rl: grpo\nlearning_rate: 1.0e-5\ngrpo:\n  learning_rate: 2.0e-5\n",
     r"learning_rate \(axolotl's key\) and grpo.learning_rate are the same"),
    ("rl: grpo\nnum_epochs: 2\ngrpo:\n  rounds: 3\n", r"num_epochs \(axolotl's key\) and grpo.rounds are the same"),
    ("rl: grpo\nmax_steps: 0\n", r"max_steps: 0; expected a whole number >= 1"),
    ("output_dir: a\nartifacts_dir: b\n", r"output_dir \(axolotl's key\) and artifacts_dir are the same setting"),
], ids=["unknown_trl_key", "vllm_serve_module", "vllm_worker_extension", "vllm_mode_unknown", "vllm_data_parallel",
        "vllm_unknown",
        "vllm_conflict", "conflict", "num_epochs_grpo", "max_steps_grpo", "output_dir_conflict"])
def test_axolotl_keys_we_cannot_honour_are_errors(tmp_path, text, message):
    path = tmp_path / "axolotl.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_axolotl_output_dir_max_steps_and_tracker_keys(tmp_path, caplog):
    """output_dir is where everything goes (artifacts_dir); max_steps is the DPO family's; wandb_* keys are
    dropped with a warning that says runs are tracked in MLflow."""
    import logging

    path = tmp_path / "axolotl_dpo.yaml"
    path.write_text(f"rl: dpo\nmax_steps: 30\noutput_dir: {tmp_path / 'out'}\nwandb_project: mine\nwandb_entity: me\n")
    with caplog.at_level(logging.WARNING, logger="posttrain.config"):
        cfg = load_config(path)
    assert (cfg.dpo.max_steps, cfg.artifacts_dir) == (30, str(tmp_path / "out"))
    assert "wandb_project, wandb_entity: axolotl's experiment-tracker keys, not used: posttrain logs every run to " \
           "MLflow" in caplog.text


# axolotl's documented example configs (docs/rlhf.qmd, docs/reward_modelling.qmd, docs/ebft.qmd), as written there,
# with the paths changed to local files: each loads into what it means here, or fails naming the keys posttrain
# does not honour and why, and loads without them (tests/test_own_data.py runs them to their starting policy).
AXOLOTL_DOC_EXAMPLES = {
    "rlhf dpo": ("rl: dpo\ndatasets:\n  - path: {prefs}\n    split: train\n    type: chatml.intel\n"
                 "  - path: {prefs}\n    split: train\n    type: chatml\n", None),
    "rlhf dpo user_defined": (
        "rl: dpo\ndatasets:\n  - path: {prefs}\n    split: train\n    type:\n      field_prompt: \"prompt\"\n"
        "      field_system: \"system\"\n      field_chosen: \"chosen\"\n      field_rejected: \"rejected\"\n"
        "      prompt_format: \"{{prompt}}\"\n      chosen_format: \"{{chosen}}\"\n"
        "      rejected_format: \"{{rejected}}\"\n",
        None),
    "rlhf ipo": ("rl: ipo\ndatasets:\n  - path: {prefs}\n    type: chatml.intel\n", None),
    "rlhf orpo": ("rl: orpo\norpo_alpha: 0.1\nremove_unused_columns: false\n\nchat_template: chatml\ndatasets:\n"
                  "  - path: {prefs}\n    type: chat_template.argilla\n", None),
    "rlhf kto": ("rl: kto\nrl_beta: 0.1  # default\nkto_desirable_weight: 1.0  # default\n"
                 "kto_undesirable_weight: 1.0  # default\n\nremove_unused_columns: false\n\ndatasets:\n"
                 "  - path: {prefs}\n    type: llama3.ultra\n    split: train\n\ngradient_checkpointing: true\n"
                 "gradient_checkpointing_kwargs:\n  use_reentrant: true\n", None),
    "rlhf grpo vllm": ("base_model: {model}\n\nvllm:\n    host: 0.0.0.0\n    port: 8000\n    tensor_parallel_size: 2\n"
                       "    gpu_memory_utilization: 0.85\n    dtype: auto\n\nrl: grpo\ntrl:\n    use_vllm: true\n"
                       "    vllm_server_host: 0.0.0.0\n    vllm_server_port: 8000\n    vllm_server_timeout: 300\n",
                       None),
    "rlhf grpo rewards": ("rl: grpo\n\ntrl:\n    beta: 0.001\n    max_completion_length: 256\n    use_vllm: True\n"
                          "    num_generations: 4\n    reward_funcs: [\"accuracy\"]\n    reward_weights: [1.0]\n"
                          "datasets:\n  - path: {prompts}\n    type: question_answer\n", None),
    "reward_modelling orm": ("base_model: {model}\nmodel_type: AutoModelForSequenceClassification\nnum_labels: 1\n"
                             "tokenizer_type: AutoTokenizer\n\nreward_model: true\nchat_template: gemma\ndatasets:\n"
                             "  - path: {prefs}\n    type: bradley_terry.chat_template\n\nval_set_size: 0.1\n"
                             "eval_steps: 100\n", None),
    "ebft structured": (
        "base_model: {model}\nrl: ebft\nebft:\n  feature_layers: [0.25, 0.5, 0.75]\n  embed_method: last_token\n"
        "  alignment_coef: 1.0\n  diversity_coef: 1.0\ntrl:\n  num_generations: 4\n  max_completion_length: 256\n"
        "  temperature: 0.7\n  use_vllm: true\n  vllm_server_host: 0.0.0.0\n  vllm_server_port: 8000\n"
        "  vllm_lora_sync: true\n  vllm_sync_interval: 3\n  use_data_producer: true\n  async_prefetch: false\n"
        "  scale_rewards: true\n  loss_type: grpo\nvllm:\n  gpu_memory_utilization: 0.5\n  max_model_len: 1024\n"
        "datasets:\n  - path: {prompts}\n    type: question_answer\n    split: train[:500]\nadapter: lora\n"
        "lora_r: 16\nlora_alpha: 32\nlora_target_linear: true\nsequence_len: 1024\nmicro_batch_size: 2\n"
        "gradient_accumulation_steps: 4\nmax_steps: 20\nlearning_rate: 5.0e-6\nbf16: auto\n"
        "gradient_checkpointing: true\noutput_dir: ./outputs/ebft-quickstart\n",
        None),
    "ebft strided": (  # docs/ebft.qmd's strided settings with its example's dataset type, axolotl's
        # ebft_pretrain.transform (raw text from `question`), built in here
        "base_model: {model}\nrl: ebft\nebft:\n  mode: strided\n  stride: 8              # tokens between anchor "
        "points\n  context_length: 8      # context window per block\n  generate_max_len: 8    # tokens generated "
        "per block\n  n_samples_per_prompt: 4  # independent rollouts per document\n  temperature: 0.6\n"
        "  rl_coef: 1.0           # RL loss weight\n  advantage_estimator: rloo  # rloo, group_norm, or reinforce\n"
        "flash_attention: false\ndatasets:\n  - path: {prompts}\n    type: ebft_pretrain.transform\n", None),
    "reward_modelling prm": ("base_model: {model}\nmodel_type: AutoModelForTokenClassification\nnum_labels: 2\n\n"
                             "process_reward_model: true\ndatasets:\n  - path: {prefs}\n    type: stepwise_supervised\n"
                             "    split: train\n\nval_set_size: 0.1\neval_steps: 100\n", None),
}


AXOLOTL_DOC_TRANSLATIONS = {
    "rlhf orpo": {"model.chat_template": "chatml"},
    "reward_modelling orm": {"model.chat_template": "gemma", "reward_model.eval_steps": 100},
    "reward_modelling prm": {"reward_model.eval_steps": 100},
    # axolotl's two-terminal workflow: `posttrain vllm-serve` listens at vllm.host:port, the run generates there;
    # no `adapter:` key: the whole model trains, as in axolotl
    "rlhf grpo vllm": {"rollout.engine": "vllm_server", "rollout.vllm.server_urls": ["http://127.0.0.1:8000"],
                       "rollout.vllm.serve_host": "0.0.0.0", "rollout.vllm.server_wait_s": 300.0,
                       "rollout.vllm.tensor_parallel_size": 2, "rollout.vllm.gpu_memory_utilization": 0.85,
                       "grpo.adapter": "none"},
    "rlhf grpo rewards": {"rollout.engine": "vllm", "grpo.adapter": "none"},
    "ebft structured": {"grpo.rounds": 7, "rollout.prompts_per_round": 6,  # max_steps 20 in rounds of the 3
                        # generation batches (2 x 4 completions, one step each) between vllm_sync_interval 3's pushes
                        "rollout.max_prompt_length": 768,  # sequence_len 1024
                        # its trl.vllm_server_host/port: the server the run generates on, the round's adapter
                        # registered on it (vllm_lora_sync: true)
                        "rollout.engine": "vllm_server", "rollout.vllm.server_urls": ["http://127.0.0.1:8000"],
                        "rollout.vllm.serve_host": "127.0.0.1", "rollout.vllm.lora_sync": "adapter",
                        "grpo.adapter": "lora"},
    "ebft strided": {"ebft.mode": "strided", "rollout.num_generations": 4, "rollout.max_completion_length": 8,
                     "rollout.temperature": 0.6, "ebft.rl_coef": 1.0, "grpo.adapter": "none"},
}
"""Keys of the doc examples that are ours under another name, and what they read as here."""


def test_eval_steps_goes_to_the_preference_trainers_and_is_refused_for_grpo(tmp_path):
    """axolotl's eval_steps: held-out accuracy every N steps for the DPO family and reward models; a GRPO run
    evaluates between rounds, so there it is an error that names eval.every_rounds."""
    assert PipelineConfig.model_validate({"rl": "kto", "eval_steps": 5}).dpo.eval_steps == 5
    assert PipelineConfig.model_validate({"rl": "reward_model", "eval_steps": 7}).reward_model.eval_steps == 7
    with pytest.raises(ValueError, match=r"eval_steps: a GRPO/EBFT run measures held-out accuracy between rounds: "
                                         r"set eval.every_rounds"):
        PipelineConfig.model_validate({"rl": "grpo", "eval_steps": 5})


def _without(lines: list[str], keys: list[str]) -> str:
    """The YAML lines less those starting with one of `keys` and the more indented lines under each."""
    kept, dropping = [], None
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if dropping is not None and indent > dropping:
            continue
        dropping = indent if line.startswith(tuple(keys)) else None
        if dropping is None:
            kept.append(line)
    return "".join(kept)


@pytest.mark.parametrize("name", list(AXOLOTL_DOC_EXAMPLES))
def test_axolotl_doc_examples_load_or_name_what_is_not_honoured(tmp_path, name):
    text, refused = AXOLOTL_DOC_EXAMPLES[name]
    (tmp_path / "model").mkdir()
    (tmp_path / "prefs.jsonl").write_text('{"question": "2+2?", "chosen": "4", "rejected": "5"}\n')
    (tmp_path / "prompts.jsonl").write_text('{"question": "2+2?", "answer": "4"}\n'
                                            '{"question": "1+1?", "answer": "2"}\n')
    path = tmp_path / "axolotl.yaml"
    path.write_text(text.format(prefs=tmp_path / "prefs.jsonl", prompts=tmp_path / "prompts.jsonl",
                                model=tmp_path / "model"))
    if refused:
        message, refused_lines = refused
        with pytest.raises(ConfigError, match=message):
            load_config(path)
        lines = path.read_text().splitlines(keepends=True)
        for kept in refused_lines:  # each refused key alone is an error that names it
            path.write_text(_without(lines, [p for p in refused_lines if p != kept]))
            with pytest.raises(ConfigError, match=re.escape(kept.strip().split(":")[0])):
                load_config(path)
        # without the refused keys, the rest of the example loads
        path.write_text(_without(lines, refused_lines))
    cfg = load_config(path)
    assert PipelineConfig.model_validate(cfg.run_config()) == cfg  # the translation round-trips
    for dotted, value in AXOLOTL_DOC_TRANSLATIONS.get(name, {}).items():
        target = cfg
        for part in dotted.split("."):
            target = getattr(target, part)
        assert target == value, dotted
    if cfg.rl in ("dpo", "ipo", "kto", "orpo", "simpo", "reward_model"):
        assert cfg.preferences.datasets and cfg.transform.datasets is None
