"""Training across processes (issue 14 item 3): 1 vs 2 processes at equal global batch.

The optimize stage (one GRPO round) and SFT on a model of the quickstart's size (4 layers, width 128),
each run several ways: in the flow's process (what `train.num_processes: 1` does), launched with
torchrun (stages/runtime/distributed.py) on 1 and on 2 processes, on 2 processes with `train.strategy: fsdp`
(optimize only: the HF Trainer stages run ddp), and on 2 Ray Train workers of a local Ray instance
(`train.backend: ray`, stages/runtime/ray_training.py). Reports wall time (the launcher's start and the ranks'
imports included), the time inside the stage function (rank 0's), the loss, the trainable weights each
rank holds (fsdp: a shard), and max |weight difference| against the in-process run. `--warm`: every launch
inside one `warm_ranks()` scope, as a pipeline run has: the first torchrun launch starts the ranks, the later ones
(every way and repeat after it) run on them.

    .venv/bin/python benchmarks/train_processes.py [--rows 512] [--sft-rows 1024] [--repeat 2] [--warm]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

QUICKSTART_MODEL = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=512)
GRPO = dict(micro_batch_size=32, gradient_accumulation_steps=4, learning_rate=1e-3)  # 128-row optimizer steps
SFT = dict(num_train_epochs=1, micro_batch_size=32, learning_rate=2e-3, save_steps=None)


def setup(root: Path, rows: int, sft_rows: int) -> Path:
    """A quickstart-sized model, `rows` rollouts of it scored with random-sign advantages, `sft_rows` SFT rows."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from stages.data import base_model, transform
    from stages.data.schemas import ROLLOUTS, SCORED, write_table
    from stages.rollout import rollout
    from stages.rollout.engines import Policy

    texts = [f"<|im_start|>user\nsay {i}<|im_end|>\n<|im_start|>assistant\n{i * 7}<|im_end|>" for i in range(400)]
    base_model.run(base_model.BaseModelConfig(**QUICKSTART_MODEL), texts, root / "model")
    prompts = rows // 16
    (root / "raw.jsonl").write_text("\n".join(json.dumps({"question": f"say {i}", "answer": str(i)})
                                              for i in range(prompts)))
    (root / "prompts").mkdir()
    transform.run(transform.TransformConfig(), {"train": root / "raw.jsonl"}, root / "prompts")
    (root / "rollouts").mkdir()
    rollout.run(rollout.RolloutConfig(num_generations=16, prompts_per_round=prompts, max_completion_length=16),
                Policy(root / "model"), root / "prompts" / "train.parquet", 0, root / "rollouts")
    table = pq.read_table(root / "rollouts" / "rollouts.parquet")
    rng = random.Random(0)
    values = [rng.choice([-1.0, 1.0]) * rng.random() for _ in range(table.num_rows)]
    table = (pa.Table.from_pylist(table.to_pylist(), schema=ROLLOUTS)
             .append_column("rewards", pa.array([[("toy", a)] for a in values], type=SCORED.field("rewards").type))
             .append_column("reward", pa.array(values, type=pa.float64()))
             .append_column("advantage", pa.array(values, type=pa.float64()))
             .append_column("errors", pa.array([[] for _ in values], type=SCORED.field("errors").type)))
    write_table(table, root / "scored.parquet", SCORED)
    sft_table = [{"prompt": [{"role": "user", "content": f"say {i}"}], "teacher_completion": str(i * 7)}
                 for i in range(sft_rows)]
    pq.write_table(pa.Table.from_pylist(sft_table), root / "sft.parquet")
    return root


def optimize(root: str, out: str, on_metrics=None, on_step=None, group=None) -> dict:
    from stages.training import grpo

    started = time.perf_counter()
    summary = grpo.run(grpo.GRPOConfig(**GRPO), Path(root) / "model", None, Path(root) / "scored.parquet", 0, 1.0,
                       16, Path(out), on_metrics=on_metrics, on_step=on_step, group=group)
    return {**summary, "stage_s": time.perf_counter() - started}  # in the rank: no torchrun start, no imports


def sft(root: str, out: str, on_metrics=None, group=None) -> dict:
    from stages.training import sft as stage

    started = time.perf_counter()
    summary = stage.run(stage.SFTConfig(**SFT), Path(root) / "model", Path(root) / "sft.parquet", Path(out),
                        on_metrics=on_metrics, group=group)
    return {**summary, "stage_s": time.perf_counter() - started}


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


WAYS = {"in-process": None, "torchrun 1": dict(num_processes=1), "torchrun 2": dict(num_processes=2),
        "torchrun 2 fsdp": dict(num_processes=2, strategy="fsdp"), "ray 2": dict(num_processes=2, backend="ray")}


def measure(name: str, function, root: Path, loss_key: str, repeat: int, ways: list[str]) -> list[dict]:
    """Each way `repeat` times, interleaved (the host is shared: the fastest of the repeats is reported)."""
    from stages.runtime import distributed, ray_training

    results = {how: {"stage": name, "how": how, "walls": []} for how in ways}
    for attempt in range(repeat):
        for how, r in results.items():
            out = root / f"{name}-{how.replace(' ', '')}-{attempt}"
            out.mkdir()
            started = time.perf_counter()
            if WAYS[how] is None:
                summary = function(str(root), str(out))
            else:
                launch = ray_training.launch_on_ray if WAYS[how].get("backend") == "ray" else distributed.launch
                summary = launch(f"train_processes:{function.__name__}",
                                             {"root": str(root), "out": str(out)},
                                             distributed.TrainConfig(**WAYS[how]), name)
            r["walls"].append(time.perf_counter() - started)
            r["held"] = summary.get("trainable_params_per_rank")
            r.setdefault("stage_walls", []).append(summary["stage_s"])
            r.update(loss=summary[loss_key], out=out, wall_s=min(r["walls"]), stage_s=min(r["stage_walls"]))
    results = list(results.values())
    reference = weights(results[0]["out"])
    for r in results:
        w = weights(r["out"])
        r["max_dw"] = max(float((w[k] - reference[k]).abs().max()) for k in reference)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512, help="rollouts in the optimize round (16 per prompt)")
    parser.add_argument("--sft-rows", type=int, default=1024, help="SFT rows (one epoch)")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each way; the fastest is reported")
    parser.add_argument("--warm", action="store_true", help="every launch inside one warm_ranks() scope")
    args = parser.parse_args()
    from stages.runtime import distributed

    with (tempfile.TemporaryDirectory(prefix="train_processes-") as tmp,
          distributed.warm_ranks() if args.warm else contextlib.nullcontext()):
        root = setup(Path(tmp), args.rows, args.sft_rows)
        rows = (measure("optimize", optimize, root, "loss", args.repeat, list(WAYS))
                + measure("sft", sft, root, "train_loss", args.repeat,
                          [w for w in WAYS if "fsdp" not in w]))
    print("| stage | how | wall (fastest) | all walls | in the stage function | loss | trainable weights per rank "
          "| max abs weight diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        walls = ", ".join(f"{w:.1f}" for w in r["walls"])
        held = f"{r['held']:,}" if r.get("held") else "-"
        print(f"| {r['stage']} | {r['how']} | {r['wall_s']:.1f} s | {walls} | {r['stage_s']:.1f} s | {r['loss']:.6f} "
              f"| {held} | {r['max_dw']:.1e} |")


if __name__ == "__main__":
    main()
