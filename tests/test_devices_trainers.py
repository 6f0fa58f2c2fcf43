"""The HF/TRL Trainer stages (sft, dpo, reward_model orm and prm) follow stages/runtime/devices.py: with
`DeviceConfig(device="cpu", precision="bf16")` the training forward passes run under bf16 autocast on fp32
weights, the saved weights and the optimizer's moments are float32, a frozen reference model (and the reward
scorer) is loaded in bf16, and each summary names the resolved placement. CPU only: bf16 autocast runs on
any CPU (emulated where it lacks AVX512-BF16/AMX), so the tiny models keep this quick."""

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from stages.data.demo_data import DemoDataConfig
from stages.data.demo_pairs import DemoPairsConfig, write_demo_pairs
from stages.runtime.devices import DeviceConfig, trainer_arguments
from stages.training import dpo, sft
from stages.scoring.rewards import reward_model as rm_scoring
from stages.training import reward_model as rm
from conftest import tiny_preference_model

BF16 = DeviceConfig(device="cpu", precision="bf16")
STEPS = 2  # optimizer steps of each run; a checkpoint (optimizer.pt) is written at the last one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen2 (ChatML) with demo preference pairs (prefs/), stepwise rows (steps/) and
    prompt/completion rows (sft.parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tiny_preference_model(tmp_path_factory.mktemp("devices_trainers"), num_train=16, num_eval=8)
    (root / "steps").mkdir()
    write_demo_pairs(DemoPairsConfig(kind="stepwise", num_train=16, num_eval=8), root / "steps",
                     DemoDataConfig(numbers_per_question=3, num_sft=10, num_train=10, num_eval=10))
    rows = [{"prompt": [{"role": "user", "content": f"Which is the largest of {i % 9 + 1}, 5?"}],
             "teacher_completion": f"<answer>{max(i % 9 + 1, 5)}</answer>"} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), root / "sft.parquet")
    return root


@contextmanager
def training_forwards():
    """(weight dtype, output dtype, CPU autocast on) of every nn.Linear run in training mode while the block
    runs: the Trainer's forward passes. The accuracy passes before and after training and a frozen
    reference model run in eval mode and are left out."""
    seen: set[tuple] = set()

    def hook(module, args, output):
        if isinstance(module, torch.nn.Linear) and module.training and torch.is_tensor(output):
            seen.add((module.weight.dtype, output.dtype, torch.is_autocast_enabled("cpu")))

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def saved_dtypes(folder: Path) -> set:
    """dtypes of every tensor in the folder's safetensors files."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no safetensors in {folder}"
    dtypes = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            dtypes |= {f.get_tensor(name).dtype for name in f.keys()}
    return dtypes


def optimizer_moment_dtypes(work_dir: Path) -> set:
    """dtypes of the AdamW moments (exp_avg, exp_avg_sq) in the newest checkpoint's optimizer.pt."""
    (path,) = sorted(work_dir.glob(f"checkpoint-{STEPS}/optimizer.pt"))
    state = torch.load(path, map_location="cpu", weights_only=True)["state"]
    assert state, f"no optimizer state in {path}"
    return {s[key].dtype for s in state.values() for key in ("exp_avg", "exp_avg_sq")}


def assert_trained_in_bf16(seen: set, summary: dict, out: Path, work: Path) -> None:
    assert seen == {(torch.float32, torch.bfloat16, True)}, seen  # fp32 weights, bf16 autocast forwards
    assert summary["steps"] == STEPS
    assert (summary["device"], summary["precision"]) == ("cpu", "bf16") and "gpu" not in summary
    assert saved_dtypes(out) == {torch.float32}
    assert optimizer_moment_dtypes(work) == {torch.float32}


def test_trainer_arguments_follow_the_precision(tmp_path):
    args = trainer_arguments(BF16)
    assert args["use_cpu"] is True and args["bf16"] is True and args["fp16"] is False
    assert args["gradient_checkpointing"] is False
    assert trainer_arguments(DeviceConfig(device="cpu"))["bf16"] is False  # auto on CPU: fp32
    cfg = dpo.PreferenceOptimizationConfig()
    assert dpo.build_trl_config(cfg, tmp_path, BF16).bf16 and dpo.build_trl_config(cfg, tmp_path, BF16).use_cpu
    assert not dpo.build_trl_config(cfg, tmp_path, DeviceConfig(device="cpu", precision="fp32")).bf16
    assert rm.build_trl_config(rm.RewardModelConfig(), tmp_path, BF16).bf16
    checkpointing = dpo.training_args(cfg, tmp_path, devices=DeviceConfig(device="cpu", gradient_checkpointing=True))
    assert checkpointing["gradient_checkpointing"] and not checkpointing["bf16"]


def test_dpo_reference_model_is_frozen_in_the_compute_dtype(tiny):
    cfg = dpo.PreferenceOptimizationConfig(rl="dpo", adapter="none")
    model, ref_model = dpo.load_models(cfg, tiny / "model", BF16)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.dtype for p in ref_model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in ref_model.parameters()) and not ref_model.training
    model, ref_model = dpo.load_models(cfg, tiny / "model", DeviceConfig(device="cpu", precision="fp32"))
    assert {p.dtype for p in ref_model.parameters()} == {torch.float32}


def test_sft_trains_in_bf16_autocast(tiny, tmp_path):
    cfg = sft.SFTConfig(num_train_epochs=1, micro_batch_size=4, learning_rate=1e-3, save_steps=STEPS)
    with training_forwards() as seen:
        summary = sft.run(cfg, tiny / "model", tiny / "sft.parquet", tmp_path / "out", work_dir=tmp_path / "work",
                          devices=BF16)
    assert_trained_in_bf16(seen, summary, tmp_path / "out", tmp_path / "work")


@pytest.mark.parametrize("adapter", ["none", "lora"])
def test_dpo_trains_in_bf16_autocast(tiny, tmp_path, adapter):
    cfg = dpo.PreferenceOptimizationConfig(rl="dpo", adapter=adapter, max_steps=STEPS, save_steps=STEPS,
                                           micro_batch_size=4, logging_steps=1, lora_r=4, lora_alpha=8)
    with training_forwards() as seen:
        summary = dpo.run(cfg, tiny / "model", tiny / "prefs", tmp_path / "out", work_dir=tmp_path / "work",
                          devices=BF16)
    assert_trained_in_bf16(seen, summary, tmp_path / "out", tmp_path / "work")
    assert summary["reference"] == ("separate_copy" if adapter == "none" else "adapter_disabled")
    assert summary["eval_accuracy_after"] is not None
    assert (tmp_path / "out" / ("adapter_model.safetensors" if adapter == "lora" else "model.safetensors")).exists()


def test_kto_lora_under_reentrant_checkpointing_trains_the_same_adapter(tiny, tmp_path):
    """A TRL Trainer stage (KTO, LoRA) with train.gradient_checkpointing_kwargs use_reentrant: true (axolotl's KTO
    guide block): the adapter after two steps is the one non-reentrant checkpointing trains, and it moved."""
    from safetensors.torch import load_file

    adapters = []
    for reentrant in (False, True):
        devices_cfg = DeviceConfig(device="cpu", gradient_checkpointing=True,
                                   gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        cfg = dpo.PreferenceOptimizationConfig(rl="kto", adapter="lora", max_steps=STEPS, save_steps=STEPS,
                                               micro_batch_size=4, logging_steps=1, lora_r=4, lora_alpha=8)
        torch.manual_seed(0)
        out = tmp_path / f"reentrant_{reentrant}"
        dpo.run(cfg, tiny / "model", tiny / "prefs", out, work_dir=tmp_path / f"work_{reentrant}", devices=devices_cfg)
        adapters.append(load_file(str(out / "adapter_model.safetensors")))
    plain, reentrant = adapters
    assert plain.keys() == reentrant.keys() and all(torch.equal(plain[k], reentrant[k]) for k in plain)
    assert max(v.abs().max().item() for k, v in reentrant.items() if "lora_B" in k) > 0


@pytest.mark.parametrize("kind, data, metric", [("orm", "prefs", "eval_pairwise_accuracy"),
                                                ("prm", "steps", "eval_step_accuracy")])
def test_reward_models_train_in_bf16_autocast_and_score_in_bf16(tiny, tmp_path, kind, data, metric):
    cfg = rm.RewardModelConfig(kind=kind, adapter="none", max_steps=STEPS, save_steps=STEPS, micro_batch_size=4,
                               logging_steps=1)
    with training_forwards() as seen:
        summary = rm.run(cfg, tiny / "model", tiny / data, tmp_path / "out", work_dir=tmp_path / "work",
                         devices=BF16)
    assert_trained_in_bf16(seen, summary, tmp_path / "out", tmp_path / "work")
    assert summary[metric] is not None

    bf16 = rm_scoring.reward_model_function(tmp_path / "out", devices=BF16)
    assert bf16.scorer.kind == kind and {p.dtype for p in bf16.scorer.model.parameters()} == {torch.bfloat16}
    assert not bf16.scorer.model.training
    if kind == "prm":
        (score,) = bf16([[{"role": "user", "content": "Which is the largest of 3, 8, 5?"}]],
                        ["Compare 3 and 8: keep 8\n<answer>8</answer>"])
        assert 0.0 <= score <= 1.0
        return
    prompts = [[{"role": "user", "content": "Which is the largest of 3, 8?"}]] * 2
    completions = ["<answer>8</answer>", "<answer>3</answer>"]
    fp32 = rm_scoring.RewardModelScorer(tmp_path / "out", devices=DeviceConfig(device="cpu", precision="fp32"))
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    assert bf16(prompts, completions) == pytest.approx(fp32(prompts, completions), abs=0.1)
