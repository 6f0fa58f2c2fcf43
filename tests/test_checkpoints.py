"""Checkpoints inside training stages (stages/runtime/checkpoints.py): a stage SIGKILLed mid-training continues
from its newest complete checkpoint, redoes no step before it, and ends with the weights of an
uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import tiny_model, tiny_preference_model

ROOT = Path(__file__).resolve().parents[1]
KILL_AT_STEP = 20  # the kill comes at the log of step 20, before that step's save: the newest checkpoint is 18
SAVE_STEPS = 6


def sft_inputs(root: Path) -> dict:
    """A tiny model and 60 prompt/completion rows: 15 steps an epoch at micro batch 4, 2 epochs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": f"say {i}"}], "teacher_completion": str(i * 7)} for i in range(60)]
    tiny_model(root, [f"<|im_start|>user\nsay {r['prompt'][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
                      f"{r['teacher_completion']}<|im_end|>" for r in rows])
    pq.write_table(pa.Table.from_pylist(rows), root / "sft.parquet")
    return {"module": "sft", "config": "SFTConfig",
            "options": {"num_train_epochs": 2, "micro_batch_size": 4, "learning_rate": 1e-3, "save_steps": SAVE_STEPS},
            "args": [str(root / "model"), str(root / "sft.parquet")]}


def preference_inputs(module: str, config: str):
    """Inputs for a stage trained on demo preference pairs (dpo, reward_model): 48 steps over 2 epochs."""
    def make(root: Path) -> dict:
        tiny_preference_model(root, num_train=96, num_eval=4)
        return {"module": module, "config": config,
                "options": {"num_train_epochs": 2, "micro_batch_size": 4, "logging_steps": 5,
                            "save_steps": SAVE_STEPS, "max_length": 64},
                "args": [str(root / "model"), str(root / "prefs")]}

    return make


RUN_STAGES = """
import json, os, signal, sys
from pathlib import Path
import importlib

for spec in json.loads(sys.argv[1]):
    module = importlib.import_module("stages.training." + spec["module"])
    cfg = getattr(module, spec["config"])(**spec["options"])
    kill_at = spec.get("kill_at")

    def on_metrics(metrics, step, spec=spec, kill_at=kill_at):
        with open(spec["steps_log"], "a") as f:
            f.write(json.dumps([step, sorted(metrics)]) + "\\n")
        if kill_at is not None and step >= kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    summary = module.run(cfg, *spec["args"], Path(spec["out"]), on_metrics=on_metrics, work_dir=Path(spec["work"]))
    print("summary:", json.dumps(summary, default=str), flush=True)
"""


def placed(spec: dict, out: Path, work: Path, steps_log: Path, kill_at: int | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    return {**spec, "out": str(out), "work": str(work), "steps_log": str(steps_log), "kill_at": kill_at}


def run_stages(*specs: dict) -> subprocess.CompletedProcess:
    """The stages (`placed` specs), one after the other, in a process of their own (its own torch state, as a rerun
    of `posttrain run` has); each prints its summary (`summaries` reads them)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(RUN_STAGES), json.dumps(list(specs))], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def summaries(proc: subprocess.CompletedProcess) -> list[dict]:
    """The summaries run_stages' process printed, in order."""
    return [json.loads(line.removeprefix("summary: ")) for line in proc.stdout.splitlines()
            if line.startswith("summary: ")]


def run_stage(spec: dict, out: Path, work: Path, steps_log: Path, kill_at: int | None = None):
    """One stage in its own process (run_stages)."""
    return run_stages(placed(spec, out, work, steps_log, kill_at))


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    found = sorted(folder.glob("*.safetensors"))
    assert found, f"no weights in {folder}"
    return {k: v for f in found for k, v in load_file(f).items()}


def logged_steps(path: Path) -> list[int]:
    return [json.loads(line)[0] for line in path.read_text().splitlines()]


KINDS = {"sft": sft_inputs, "dpo": preference_inputs("dpo", "PreferenceOptimizationConfig"),
         "reward_model": preference_inputs("reward_model", "RewardModelConfig")}


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory) -> dict:
    """Each kind's inputs and its uninterrupted run, the three in one process one after the other (a process start
    costs ~9 s of CPU here; each stage seeds its own RNG, and the resumed runs, each in a new process, end with the
    same weights): {kind: (spec, out folder, summary)}."""
    root = tmp_path_factory.mktemp("checkpoints")
    for kind in KINDS:
        (root / kind).mkdir()
    specs = {kind: make(root / kind) for kind, make in KINDS.items()}
    runs = [placed(spec, root / kind / "straight", root / kind / "work-straight", root / kind / "straight.log")
            for kind, spec in specs.items()]
    proc = run_stages(*runs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = summaries(proc)
    assert len(done) == len(runs), proc.stdout[-3000:]
    return {kind: (specs[kind], root / kind / "straight", summary) for kind, summary in zip(specs, done)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.slow  # a whole run or process kill: `make test`, not `make test-fast`
def test_stage_killed_mid_training_resumes_from_its_checkpoint(tmp_path, kind, straight_runs):
    spec, straight_out, straight_summary = straight_runs[kind]
    assert straight_summary["resumed_from_step"] == 0

    work = tmp_path / "work"
    killed = run_stage(spec, tmp_path / "killed", work, tmp_path / "killed.log", kill_at=KILL_AT_STEP)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    newest = 18  # the last multiple of SAVE_STEPS before the kill
    assert sorted(p.name for p in work.glob("checkpoint-*")) == [f"checkpoint-{newest}"]
    assert (work / f"checkpoint-{newest}" / "_complete").is_file()
    if spec["module"] == "sft":  # its tokenized rows too, so the rerun skips tokenizing
        assert (work / "prepared-dataset" / "_complete").is_file()
    # What a process killed while saving leaves: a checkpoint folder without its marker. Never read.
    half_written = work / "checkpoint-24"
    half_written.mkdir()
    (half_written / "model.safetensors").write_bytes(b"truncated")

    resumed = run_stage(spec, tmp_path / "resumed", work, tmp_path / "resumed.log")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (summary,) = summaries(resumed)
    assert summary["resumed_from_step"] == newest
    assert summary.get("reused_tokenized_dataset", True)  # (sft only)
    assert summary["steps"] == straight_summary["steps"]
    assert summary["train_loss"] == pytest.approx(straight_summary["train_loss"], rel=1e-6)
    # Steps up to the checkpoint are not trained again: the resumed process logs only later steps.
    assert min(s for s in logged_steps(tmp_path / "resumed.log") if s > 0) > newest
    assert not half_written.exists()

    expected, got = weights(straight_out), weights(tmp_path / "resumed")
    assert expected.keys() == got.keys()
    import torch

    for name in expected:
        assert torch.allclose(expected[name], got[name], rtol=0, atol=1e-6), name


def test_work_folder_outlives_a_failed_attempt_and_goes_with_the_published_folder(tmp_path):
    from tasks.store import ArtifactStore

    store = ArtifactStore(tmp_path)
    work = store.work_path("sft", "k1")

    def fails(out):
        (work / "checkpoint-6").mkdir(parents=True)
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        store.write("sft", "k1", fails, inputs={}, config={})
    assert (work / "checkpoint-6").is_dir()  # what the rerun resumes from
    assert store.get("sft", "k1") is None

    def finishes(out):
        assert (work / "checkpoint-6").is_dir()
        (out / "model.safetensors").write_bytes(b"weights")
        return {}

    store.write("sft", "k1", finishes, inputs={}, config={})
    assert store.get("sft", "k1") is not None and not work.exists()
