"""A whole run in bf16 (issue 26): every stage that runs a model records the precision in its key and summary,
the reward model scores in bf16 inside the reward workers, and the exported model is bf16. On CPU here
(bf16 works on CPU, slowly); the same run on a GPU where torch sees one (`pytest -m gpu`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import computed
from safetensors import safe_open

from tasks.store import MANIFEST

RUNS_A_MODEL = ("sft", "reward_model", "rollout", "score", "optimize", "eval", "export")
OVERRIDES = ["grpo.rounds=1", "score.reward_funcs=[reward_model, format]", "score.reward_weights=[1.0, 0.1]",
             "demo_pairs.num_train=32", "demo_pairs.num_eval=16", "reward_model.max_steps=2",
             "reward_model.micro_batch_size=8", "train.precision=bf16"]


def _manifests(root: Path, stage: str) -> list[dict]:
    return [json.loads((folder / MANIFEST).read_text()) for folder in (root / stage).iterdir()
            if (folder / MANIFEST).exists()]


def _keyed_precision(config: dict) -> str | None:
    """The precision a stage's key (its manifest's config) holds: its placement's, a rollout's engine settings'."""
    return (config.get("devices") or config.get("engine_settings", {}).get("devices") or {}).get("precision")


def _check_bf16_run(root: Path, summary: dict, device_type: str) -> None:
    for stage in RUNS_A_MODEL:
        manifests = _manifests(root, stage)
        assert manifests, stage
        assert all(_keyed_precision(m["config"]) == "bf16" for m in manifests), stage
    for stage in ("sft", "reward_model", "optimize"):
        for manifest in _manifests(root, stage):
            assert manifest["summary"]["precision"] == "bf16", stage
            assert manifest["summary"]["device"].startswith(device_type), stage
    export_dir = Path(summary["exported_model"])
    with safe_open(str(export_dir / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    for folder in (root / "optimize").iterdir():  # the trained adapter stays fp32
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}


def _gpu_flow_check_reads(root: Path, summary: dict) -> None:
    """benchmarks/gpu_flow_check.py (what a GPU lease reads back, issue 48) reads a run as the code writes it."""
    import importlib
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        check = importlib.import_module("gpu_flow_check")
    finally:
        sys.path.pop(0)
    placed = check.stage_placements(root)
    assert {p["precision"] for stage in ("sft", "optimize") for p in placed[stage]} == {"bf16"}
    exported = check.exported_model(Path(summary["exported_model"]), check.eval_prompts(root, 1))
    assert exported["file_dtypes"] == ["torch.bfloat16"] and exported["loaded_on"] == [["cpu", "torch.bfloat16"]]
    assert len(exported["answers"]) == 1


@pytest.mark.first_run  # reads every stage's manifest: the warm fp32 ones would be there too
def test_a_bf16_run_on_cpu_records_and_keeps_its_precision(prefect_harness, tiny_config, tmp_path):
    from flows.pipeline import posttrain_pipeline

    summary = posttrain_pipeline(str(tiny_config), OVERRIDES, quiet=True)
    _check_bf16_run(tmp_path / "artifacts", summary, "cpu")
    _gpu_flow_check_reads(tmp_path / "artifacts", summary)
    fp32 = posttrain_pipeline(str(tiny_config), [o for o in OVERRIDES if "precision" not in o], quiet=True)
    reused = {row["stage"] for row in fp32["stages"]} - set(computed(fp32))
    assert reused == {"demo_data", "transform", "base_model", "preferences"}  # nothing that ran a model in bf16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_run_on_the_gpu_places_every_stage_there(prefect_harness, tiny_config, tmp_path):
    from flows.pipeline import posttrain_pipeline

    summary = posttrain_pipeline(str(tiny_config), [*OVERRIDES, "train.device=cuda"], quiet=True)
    _check_bf16_run(tmp_path / "artifacts", summary, "cuda")
