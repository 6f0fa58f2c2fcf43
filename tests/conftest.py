"""Shared fixtures: one Prefect test harness per session (its server costs ~10 s to start)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture
def tiny_config_text(tmp_path):
    """A whole pipeline small enough for a test: ~1 minute on 2 cores."""
    return f"""
name: test-tiny
artifacts_dir: {tmp_path / 'artifacts'}
demo_data: {{num_sft: 300, num_train: 64, num_eval: 24}}
model: {{hidden_size: 64, num_attention_heads: 1, num_key_value_heads: 1, intermediate_size: 128,
        num_hidden_layers: 2, vocab_size: 300}}
sft: {{num_train_epochs: 1, micro_batch_size: 32}}
rollout: {{num_generations: 4, prompts_per_round: 8, max_completion_length: 8}}
score: {{reward_num_workers: 1}}
grpo: {{rounds: 2, micro_batch_size: 16, gradient_accumulation_steps: 1,
       skip_zero_advantage_batches: false}}  # the tiny policy gets little reward signal; still step
eval: {{max_completion_length: 8}}
export: {{model_name: test-tiny}}
"""


@pytest.fixture
def tiny_config(tmp_path, tiny_config_text, monkeypatch):
    """tiny_config_text written to a file, with MLflow on the sqlite store under its artifacts."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = tmp_path / "tiny.yaml"
    path.write_text(tiny_config_text)
    return path


@pytest.fixture
def out_dir(tmp_path):
    """An empty folder a stage writes into."""
    out = tmp_path / "out"
    out.mkdir()
    return out
