"""benchmarks/ablations.py's atomic_grad_order variant: on PYTHONPATH, Python imports this at start-up.

It puts back the optimize stage's KV-cache copy as it was before commit a762107 (tensor indexing, as
`DynamicCache.batch_select_indices` does), whose backward adds the rows' gradients with atomic float adds across
threads, instead of `index_select`'s fixed order. Only this benchmark uses it."""

import stages.grpo


def _copy_rows_by_indexing(cache, index):
    for layer in cache.layers:
        layer.keys = layer.keys[index]
        layer.values = layer.values[index]


stages.grpo._copy_rows = _copy_rows_by_indexing
