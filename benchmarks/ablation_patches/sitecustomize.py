"""benchmarks/ablations.py's patched variants: on PYTHONPATH, Python imports this at start-up and applies the
patches named in ABLATION_PATCHES (comma-separated). Only that benchmark puts this folder on the path.

- atomic_grad_order: the optimize stage's KV-cache copy as it was before commit a762107 (tensor indexing, as
  `DynamicCache.batch_select_indices` does), whose backward adds the rows' gradients with atomic float adds
  across threads, instead of `index_select`'s fixed order.
- trl_dapo_normalizer: dapo divides every step's loss by the round's completion tokens over its number of
  steps (TRL's `num_items_in_batch` * gradient_accumulation_steps / steps_per_generation), not by the step's own.
"""

import os

import stages.training.grpo
import stages.training.logprobs

PATCHES = {name for name in os.environ.get("ABLATION_PATCHES", "").split(",") if name}


def _copy_rows_by_indexing(cache, index):
    for layer in cache.layers:
        layer.keys = layer.keys[index]
        layer.values = layer.values[index]


_step_normalizer = stages.training.grpo.dapo_normalizer


def _round_mean_normalizer(steps, step_index, masked_out):
    return sum(_step_normalizer(steps, s, masked_out) for s in range(len(steps))) / len(steps)


unknown = PATCHES - {"atomic_grad_order", "trl_dapo_normalizer"}
if unknown:
    raise SystemExit(f"ABLATION_PATCHES: unknown patch(es) {sorted(unknown)}")
if "atomic_grad_order" in PATCHES:
    stages.training.logprobs._copy_rows = _copy_rows_by_indexing
if "trl_dapo_normalizer" in PATCHES:
    stages.training.grpo.dapo_normalizer = _round_mean_normalizer
