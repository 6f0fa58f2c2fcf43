"""A reward model named by hub id in score.reward_funcs (TRL's `reward_funcs`, axolotl's `trl.reward_funcs`):
resolved through the hub cache (here one laid out as huggingface_hub lays it out, read with HF_HUB_OFFLINE=1) to the
commit its main branch is at, scored as TRL's GRPOTrainer scores a reward model, and keyed by that commit, so a
moved branch scores again instead of serving the old model's rewards. No model is downloaded."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import Quiet, tiny_round
from flows.cli import main
from flows.config import ConfigError, PipelineConfig, load_config
from stages.scoring import reward_pools
from stages.scoring.score import ScoreConfig
from tasks import stage_tasks
from tasks.store import Artifact, ArtifactStore

REPO = "org/tiny-rm"
COMMITS = ("c" * 40, "d" * 40)
"""refs/main starts on the first; the second holds the same model with its score head negated."""


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """One round of tiny rollouts (4 prompts x 4 completions) under made/rollouts, and two tiny sequence-
    classification reward models (a 2-layer Qwen2 body with a seeded score head; the second's head negated) under
    made/rm0 and made/rm1."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("hub_rm")
    tiny_round(root, num_prompts=4, prompts_per_round=4)
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(root / "model", num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    for i, sign in enumerate((1.0, -1.0)):
        with torch.no_grad():
            model.score.weight.mul_(sign)
        model.save_pretrained(root / f"rm{i}")
        tokenizer.save_pretrained(root / f"rm{i}")
    return root


def lay_out(cache: Path, repo: str, commit: str, folder: Path) -> Path:
    """`folder` as huggingface_hub caches `repo` at `commit`: each file a blob named by its sha256, linked from
    snapshots/<commit>/; returns the snapshot folder."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        blob = repo_dir / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def point_main(cache: Path, repo: str, commit: str) -> None:
    refs = cache / f"models--{repo.replace('/', '--')}" / "refs"
    refs.mkdir(exist_ok=True)
    (refs / "main").write_text(commit)


@pytest.fixture
def hub(made, tmp_path, monkeypatch) -> Path:
    """An offline hub cache holding org/tiny-rm at both commits, refs/main on the first."""
    cache = tmp_path / "hub"
    for commit, folder in zip(COMMITS, ("rm0", "rm1")):
        lay_out(cache, REPO, commit, made / folder)
    point_main(cache, REPO, COMMITS[0])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    yield cache
    reward_pools.close_pools()


def score_stage(made: Path, root: Path) -> Artifact:
    """The score task as a round calls it (store, MLflow lineage), scoring made/rollouts with org/tiny-rm."""
    from tasks.lineage import Lineage
    from tasks.reporting import Reporter

    lineage = Lineage(root, "hub-rm")
    lineage.parent_id = lineage.client.create_run(lineage.experiment_id, run_name="hub-rm").info.run_id
    cfg = PipelineConfig.model_validate({"rollout": {"num_generations": 4},
                                         "score": {"reward_funcs": [REPO], "reward_num_workers": 1}})
    ctx = stage_tasks.RunContext(cfg, ArtifactStore(root), lineage, Reporter(root, quiet=True))
    rollouts = Artifact("rollout", "round-0", made / "rollouts", {})
    return stage_tasks.score_task.fn(ctx, rollouts, 0)


def rewards(scored: Artifact) -> list[float]:
    return pq.read_table(scored.path / "scored.parquet").column("reward").to_pylist()


def trl_rewards(made: Path, snapshot: Path) -> list[float]:
    """What TRL's GRPOTrainer._calculate_rewards gives the same rows with the reward model at `snapshot` (TRL
    loads a string reward function with AutoModelForSequenceClassification, num_labels=1)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = pq.read_table(made / "rollouts" / "rollouts.parquet").to_pylist()
    prompts = [[{"role": m["role"], "content": m["content"]} for m in r["prompt"]] for r in rows]
    args = GRPOConfig(output_dir=str(made / "trl"), use_cpu=True, report_to=[], bf16=False, num_generations=4,
                      per_device_train_batch_size=4, max_completion_length=2, disable_tqdm=True)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(made / "model", dtype=torch.float32),
                          reward_funcs=str(snapshot), args=args,
                          processing_class=AutoTokenizer.from_pretrained(made / "model"),
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    completions = [[{"role": "assistant", "content": r["completion"]}] for r in rows]
    per_func = trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts, completions,
                                          [r["completion_token_ids"] for r in rows])
    return per_func[:, 0].tolist()


@pytest.mark.slow  # TRL's GRPOTrainer beside our score stage (~25 s): `make test`, not `make test-fast`
def test_a_hub_reward_model_scores_as_trls_grpo_trainer_and_its_commit_is_keyed(made, hub, tmp_path):
    first = score_stage(made, tmp_path / "artifacts")
    assert first.manifest["config"]["reward_models"] == {REPO: {"commit": COMMITS[0]}}
    snapshot = hub / "models--org--tiny-rm" / "snapshots"
    assert rewards(first) == pytest.approx(trl_rewards(made, snapshot / COMMITS[0]), abs=1e-5)
    assert len(set(rewards(first))) > 1  # the rewards tell completions apart: the comparison means something

    point_main(hub, REPO, COMMITS[1])  # the model changed on the hub: a new key, scored with the new weights
    moved = score_stage(made, tmp_path / "artifacts")
    assert not moved.reused and moved.key != first.key
    assert rewards(moved) == pytest.approx([-r for r in rewards(first)], abs=1e-5)

    point_main(hub, REPO, COMMITS[0])  # back on the first commit: its scores, from the store
    again = score_stage(made, tmp_path / "artifacts")
    assert again.reused and again.key == first.key


def test_a_run_resolves_its_hub_reward_models_once(made, hub, tmp_path):
    """Every round of a run scores with the commit the run started on (the recipe resolves them once)."""
    ctx = stage_tasks.RunContext(PipelineConfig.model_validate({"score": {"reward_funcs": ["format", REPO]}}),
                                 ArtifactStore(tmp_path / "artifacts"), lineage=None, reporter=Quiet())
    resolved = stage_tasks.resolve_reward_models(ctx)
    assert list(resolved) == [REPO] and resolved[REPO].as_key() == {"commit": COMMITS[0]}
    assert resolved[REPO].value.path == hub / "models--org--tiny-rm" / "snapshots" / COMMITS[0]


def test_a_hub_reward_model_not_in_the_cache_offline_stops_before_scoring_naming_the_key(made, hub, tmp_path):
    from stages.data.model_source import ModelSourceError
    from stages.scoring import score

    cfg = ScoreConfig(reward_funcs=["format", "org/absent-rm"], reward_num_workers=1)
    with pytest.raises(ModelSourceError, match=r"^score.reward_funcs: hub id 'org/absent-rm' at revision 'main' is "
                                               r"not in the hub cache .*hf download org/absent-rm"):
        score.run(cfg, made / "rollouts" / "rollouts.parquet", 4, tmp_path / "out")


AXOLOTL = """base_model: {model}
rl: grpo
datasets:
  - path: {rows}
    type: rewards.prompt_transform
    split: train
adapter: lora
micro_batch_size: 4
gradient_accumulation_steps: 1
max_steps: 2
trl:
  num_generations: 4
  max_completion_length: 6
  reward_funcs:
    - {reward_model}
    - rewards.format_reward
  reward_weights:
    - 1.0
    - 0.3
"""
"""A config of axolotl's with docs/grpo.qmd's "reward model from the hub" block (its hub id replaced by the
cached tiny one)."""

REWARDS = '''
def format_reward(completions, **kwargs):
    return [1.0 if "<answer>" in c[0]["content"] else 0.0 for c in completions]


def prompt_transform(cfg, *args, **kwargs):
    def transform_fn(example, tokenizer=None):
        return {"prompt": [{"role": "user", "content": example["question"]}], "answer": example["answer"]}
    return transform_fn, {"remove_columns": ["question"]}
'''


@pytest.fixture
def axolotl_config(made, tmp_path, monkeypatch):
    """axolotl_config(reward_model): the config's path, beside its rewards module and 8 rows."""
    import json

    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps({"question": f"say {i}", "answer": str(i)})
                                                   for i in range(8)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "rewards", raising=False)  # another test's rewards.py, imported first

    def write(reward_model: str) -> Path:
        path = tmp_path / "config.yaml"
        path.write_text(AXOLOTL.format(model=made / "model", rows=tmp_path / "rows.jsonl", reward_model=reward_model))
        return path

    return write


def test_axolotls_hub_reward_model_validates_from_the_cache(hub, axolotl_config, capsys):
    path = axolotl_config(REPO)
    assert load_config(path).score.reward_funcs == [REPO, "rewards.format_reward"]
    code, shown = main(["validate", str(path)]), capsys.readouterr().err
    assert code == 0, shown
    assert f"note: score.reward_funcs.0: hub id {REPO} (main) is in the hub cache" in shown


def test_axolotls_hub_reward_model_missing_offline_is_one_line_naming_the_key(hub, axolotl_config, capsys):
    assert main(["validate", str(axolotl_config("org/absent-rm"))]) == 2
    shown = [line for line in capsys.readouterr().err.splitlines() if "score.reward_funcs.0" in line]
    assert len(shown) == 1 and "not in the hub cache" in shown[0] and "hf download org/absent-rm" in shown[0]


def test_the_eval_does_not_judge_with_a_hub_reward_model(tmp_path):
    """The eval's verifier is a verdict: a reward model named by hub id is left out of the default one and refused
    as eval.reward_funcs, naming the key."""
    from stages.evaluation.evaluate import EvalConfig, verifier_funcs

    assert verifier_funcs(EvalConfig(), [REPO, "format"]) == ["accuracy"]
    path = tmp_path / "config.yaml"
    path.write_text(f"eval:\n  reward_funcs: [{REPO}]\n")
    with pytest.raises(ConfigError, match=r"eval.reward_funcs.*'org/tiny-rm': a reward model named by hub id"):
        load_config(path)
