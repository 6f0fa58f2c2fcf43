"""Read back the runs benchmarks/gpu_flow_lease.sh made (issue 48 step 1): one JSON of what ran where.

For each run under ARTIFACTS/runs/*/summary.json: its stage rows and results; for every stage folder a model ran
in, the device and precision its manifest's summary recorded; the exported model's tensor dtypes, then the model
loaded onto the GPU (every parameter's device and dtype asserted) answering two eval prompts; and the run's metrics
from MLflow. Exits 1 when a stage that runs a model ran off the GPU while torch saw one.

    python benchmarks/gpu_flow_check.py artifacts --out flow-check.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL_STAGES = ("sft", "reward_model", "optimize", "dpo", "export")


def stage_placements(root: Path) -> dict[str, list[dict]]:
    """{stage: [{folder, device, precision}]} from each computed folder's manifest summary."""
    from tasks.store import MANIFEST

    found: dict[str, list[dict]] = {}
    for manifest in sorted(root.glob(f"*/*/{MANIFEST}")):
        summary = json.loads(manifest.read_text()).get("summary", {})
        if "device" in summary or "precision" in summary:
            found.setdefault(manifest.parent.parent.name, []).append(
                {"folder": manifest.parent.name[:16], "device": summary.get("device"),
                 "precision": summary.get("precision")})
    return found


def exported_model(folder: Path, prompts: list[str]) -> dict:
    """The exported model's file dtypes; loaded on the GPU (if any) in its own dtype, asked `prompts`."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtypes = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            dtypes |= {str(f.get_tensor(k).dtype) for k in f.keys()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").to(device)
    placed = {(str(p.device.type), str(p.dtype)) for p in model.parameters()}
    assert {d for d, _ in placed} == {device}, placed
    tokenizer = AutoTokenizer.from_pretrained(folder)
    answers = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt").to(device)
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
        answers.append({"prompt": prompt, "completion": tokenizer.decode(out[0, ids["input_ids"].shape[1]:],
                                                                          skip_special_tokens=True)})
    return {"file_dtypes": sorted(dtypes), "loaded_on": sorted(map(list, placed)), "answers": answers}


def mlflow_metrics(root: Path, run_id: str | None) -> dict:
    from mlflow.tracking import MlflowClient

    from tasks.lineage import tracking_uri

    if not run_id:
        return {}
    run = MlflowClient(tracking_uri(root)).get_run(run_id)
    return {"metrics": run.data.metrics, "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")}}


def eval_prompts(root: Path, n: int = 2) -> list[str]:
    import pyarrow.parquet as pq

    for file in sorted(root.glob("transform/*/eval.parquet")):
        return [str(p if isinstance(p, str) else p[-1]["content"]) for p in pq.read_table(file)["prompt"].to_pylist()[:n]]
    return ["Which is the largest of 3, 8, 1, 5, 2?"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    root = args.artifacts
    report: dict = {"cuda": torch.cuda.is_available(), "placements": stage_placements(root), "runs": []}
    prompts = eval_prompts(root)
    for summary_file in sorted(root.glob("runs/*/summary.json")):
        summary = json.loads(summary_file.read_text())
        entry = {"run": summary_file.parent.name, "summary": summary}
        for name, step in (("mlflow", lambda: mlflow_metrics(root, summary.get("mlflow_run_id"))),
                           ("exported", lambda: exported_model(Path(summary["exported_model"]), prompts))):
            try:
                entry[name] = step()
            except Exception as e:  # noqa: BLE001 - a report: record what failed, go on with the rest
                entry[name] = {"error": f"{type(e).__name__}: {e}"}
        report["runs"].append(entry)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    args.out.write_text(json.dumps(report, indent=1, default=str))
    off_gpu = [f"{stage}/{p['folder']}: {p['device']}" for stage, rows in report["placements"].items()
               if stage in MODEL_STAGES for p in rows if report["cuda"] and not str(p["device"]).startswith("cuda")]
    for entry in report["runs"]:
        s = entry["summary"]
        print(entry["run"], {k: v for k, v in s.items() if isinstance(v, (int, float, str)) and k != "exported_model"})
        print("  exported:", json.dumps(entry.get("exported"), default=str)[:400])
    print("placements:", json.dumps(report["placements"])[:1500])
    print("off the GPU:", off_gpu or "none")
    return 1 if off_gpu else 0


if __name__ == "__main__":
    sys.exit(main())
