"""export: merge the final LoRA adapter into the base and save a standalone model.

The folder holds safetensors weights, the tokenizer (with chat template) and a
README.md model card carrying the config, metrics and lineage it is given. It loads
with `AutoModelForCausalLM.from_pretrained(folder)`. The merge runs on the run's device in its precision
(stages/runtime/devices.py), and the weights are saved in that dtype: fp32 on CPU, bf16 on a GPU (as axolotl's
merge writes its torch_dtype).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict


class ExportConfig(BaseModel):
    """Merged-model export."""

    model_config = ConfigDict(extra="forbid")

    model_name: str | None = None
    """Name in the model card and in the MLflow Model Registry; unset: the config's `name`. Promotion
    (champion/challenger) compares versions of this one registered model only."""


def model_card(name: str, metrics: dict, lineage: dict, config: dict) -> str:
    return "\n".join(
        [
            "---", "library_name: transformers", "tags: [posttrain, grpo]", "---", f"# {name}", "",
            "Merged policy exported by posttrain (base + final LoRA adapter).", "", "## Metrics", "",
            "```json", json.dumps(metrics, indent=2, sort_keys=True), "```", "", "## Lineage", "",
            "Artifact keys of every stage that produced this model:", "",
            "```json", json.dumps(lineage, indent=2, sort_keys=True), "```", "", "## Config", "",
            "```json", json.dumps(config, indent=2, sort_keys=True), "```", "",
        ]
    )


def run(cfg: ExportConfig, base_dir: Path, adapter_dir: Path | None, out_dir: Path, *, metrics: dict,
        lineage: dict, config: dict, devices=None) -> dict:
    """Merge and save; return the parameter count and the dtype written."""
    from stages.runtime.policy import load_policy

    model, tokenizer = load_policy(base_dir, adapter_dir, merge=True, devices=devices)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "README.md").write_text(model_card(cfg.model_name, metrics, lineage, config))
    return {"num_parameters": sum(p.numel() for p in model.parameters()),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}
