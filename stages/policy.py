"""Load a policy: base model folder plus an optional PEFT LoRA adapter folder."""

from __future__ import annotations

import threading
from pathlib import Path

MODEL_LOADING = threading.Lock()
"""Held around every model load. transformers' from_pretrained patches process-wide state while
it builds a model (weight tying, init functions), so two threads loading at once -- an async
rollout beside an optimize round -- can leave one model's tied lm_head unloaded (meta)."""


def load_policy(base_dir: Path, adapter_dir: Path | None = None, merge: bool = True):
    """Return (model, tokenizer) in eval mode. With an adapter and `merge`, the LoRA
    weights are folded in (faster generation; the files on disk are untouched)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.padding_side = "left"
    with MODEL_LOADING:
        model = AutoModelForCausalLM.from_pretrained(base_dir)
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter_dir)
            if merge:
                model = model.merge_and_unload()
    model.eval()
    return model, tokenizer
