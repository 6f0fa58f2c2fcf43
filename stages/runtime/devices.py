"""Where models run and in which precision: the one policy every stage loads, places and casts its models by.

`DeviceConfig` holds the six settings (the config's `train.device`, `train.precision`,
`train.gradient_checkpointing` and its `train.gradient_checkpointing_kwargs`, `train.compile`, `train.attn_implementation`; TrainConfig extends it). A stage takes one
(default: `DeviceConfig()`, i.e. CUDA with bf16 where torch sees a GPU, else CPU with fp32) and calls:

- `load_trainable(auto_class, path, devices)` for weights it trains, `load_frozen(...)` for weights it only
  runs (reference model, reward scorer, EBFT's feature model, rollout and eval policies, the base under a
  LoRA adapter);
- `autocast(devices)` around its training forward passes, `grad_scaler(devices)` for its loss (fp16);
- `adapter_inputs_uncast(model, devices)` on a PEFT model it trains under autocast;
- `trainer_arguments(devices)` for the HF/TRL Trainer stages (sft, the dpo family, reward models).

Precision, as HF Trainer (and so TRL and axolotl's LoRA runs) does it with `bf16: true`:
trained weights stay float32 and so does their optimizer state (AdamW moments, saved in optimizer.pt);
the forward and backward passes run under `torch.autocast` in bf16 (fp16: the same, with a gradient scaler).
Frozen weights are loaded in the compute dtype itself (bf16/fp16): nothing updates them, and they take half
the memory. So a LoRA adapter trains in fp32 on a bf16 base; full fine-tuning keeps an fp32 model. Saved
models (sft, optimize, the dpo family, reward models) are written in the dtype they were trained in (fp32);
export merges on the device in the compute dtype and writes that (bf16 on a GPU, as axolotl's merge).

No other stage module loads a model with `from_pretrained` (tokenizers, configs and PEFT adapters on a placed
model aside; stages/data/model_source.py's GGUF conversion runs nothing), calls `.cuda()` or sets `use_cpu`
(tests/test_devices.py reads them all to hold that).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.runtime.imports import LazyModule

torch = LazyModule("torch")

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class DeviceConfig(BaseModel):
    """Device and precision of every stage that runs a model (the config's `train:` section)."""

    model_config = ConfigDict(extra="forbid")

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when torch sees a GPU, else CPU. cuda: a GPU, or an error when there is none. Each rank of
    a multi-process stage takes the GPU of its LOCAL_RANK (torchrun and Ray Train set it)."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """auto: bf16 on CUDA, fp32 on CPU. bf16/fp16: trained weights and optimizer state in fp32, forward and
    backward under autocast in that dtype, frozen models (reference, scorer, rollout, eval) loaded in it
    (module docstring). bf16 also runs on CPU (slowly, unless it has AVX512-BF16/AMX); fp16 needs CUDA.
    axolotl's `bf16` / `fp16` keys set it. Part of the key of every stage that runs a model (fp32 aside,
    so fp32 runs keep their keys)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them: less memory, ~30% more compute
    (axolotl's `gradient_checkpointing`). Same gradients, so in no key."""
    gradient_checkpointing_kwargs: dict[str, bool] = Field(default_factory=dict)
    """What HF's `gradient_checkpointing_kwargs` passes to torch.utils.checkpoint; the one key honoured is
    `use_reentrant` (default false: PyTorch's recommended non-reentrant checkpointing; true: the reentrant
    autograd.Function, which axolotl's guides ask for with DeepSpeed ZeRO-3 and FlexAttention; true needs
    gradient_checkpointing: true). Same gradients, so in no key."""

    @model_validator(mode="after")
    def _checkpointing_kwargs_honoured(self):
        unknown = sorted(set(self.gradient_checkpointing_kwargs) - {"use_reentrant"})
        if unknown:
            raise ValueError(f"train.gradient_checkpointing_kwargs: {', '.join(unknown)} is not honoured here; the "
                             "one key taken is use_reentrant (true or false)")
        if self.gradient_checkpointing_kwargs.get("use_reentrant") and not self.gradient_checkpointing:
            raise ValueError("train.gradient_checkpointing_kwargs: use_reentrant: true, but train.gradient_checkpointing "
                             "is false (axolotl's and HF's `gradient_checkpointing`): the kwargs are for it; set "
                             "gradient_checkpointing: true or remove them")
        return self
    compile: bool = False
    """torch.compile each transformer block of the models being trained (optimize, sft, the dpo family, reward
    models), as torchtune does: elementwise ops fused into fewer kernels, so a GPU waits less on the host's
    kernel launches (BENCHMARKS.md, issue 26). The first rounds of a process compile (tens of seconds on a
    GPU): for the shapes they meet, then, once a shape changes, for dynamic shapes; later rounds in the same
    process reuse them. Same math up to rounding, so in no key (axolotl's
    `torch_compile`)."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = None
    """transformers' attention kernel for every model loaded; unset: transformers' default (sdpa where the
    architecture has it). flash_attention_2 needs the flash-attn package and a CUDA GPU (axolotl's
    `flash_attention: true`). Same math up to rounding, so in no key."""


def check_machine(devices: DeviceConfig) -> None:
    """Raise ValueError naming the `train.*` key when `devices` asks for what this machine lacks. Imports torch
    only when the answer needs it (cuda or flash_attention_2 named)."""
    if devices.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError("train.attn_implementation: flash_attention_2 needs the flash-attn package, which is not "
                         "installed here (pip install flash-attn --no-build-isolation, on a CUDA machine); or use "
                         "sdpa (PyTorch's fused attention, no package needed)")
    needs_gpu = {"train.device: cuda": devices.device == "cuda",
                 "train.precision: fp16": devices.precision == "fp16",
                 "train.attn_implementation: flash_attention_2": devices.attn_implementation == "flash_attention_2"}
    for key, asked in needs_gpu.items():
        if asked and not _cuda_available():
            raise ValueError(f"{key} needs a CUDA GPU, and torch sees none on this machine "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
                             "use train.device: auto (or cpu) with train.precision: bf16 or fp32")


def _cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def device(devices: DeviceConfig | None = None):
    """The torch.device this process's models go to: cpu, or cuda:<LOCAL_RANK>."""
    devices = devices or DeviceConfig()
    if devices.device == "cpu" or (devices.device == "auto" and not _cuda_available()):
        return torch.device("cpu")
    if not _cuda_available():
        check_machine(devices)  # raises, naming train.device
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return torch.device("cuda", index)


def precision(devices: DeviceConfig | None = None) -> str:
    """fp32, bf16 or fp16: `precision`, with auto resolved for the device (bf16 on CUDA, fp32 on CPU)."""
    devices = devices or DeviceConfig()
    if devices.precision != "auto":
        return devices.precision
    return "bf16" if device(devices).type == "cuda" else "fp32"


def compute_dtype(devices: DeviceConfig | None = None):
    """The torch dtype of forward passes and of frozen weights."""
    return getattr(torch, DTYPES[precision(devices)])


def key_fields(devices: DeviceConfig | None = None) -> dict:
    """What of `devices` goes into the key of a stage that runs a model: the resolved precision, except fp32
    (the precision every key had before it could be chosen)."""
    resolved = precision(devices)
    return {} if resolved == "fp32" else {"precision": resolved}


def _load(auto_class, path: Path | str, devices: DeviceConfig | None, dtype, **kwargs):
    devices = devices or DeviceConfig()
    if devices.attn_implementation is not None:
        kwargs["attn_implementation"] = devices.attn_implementation
    target = device(devices)
    if target.type == "cuda":  # straight onto the GPU, in its dtype (no full copy in CPU memory first)
        kwargs.setdefault("device_map", {"": target.index or 0})
    model = auto_class.from_pretrained(path, dtype=dtype, **kwargs)
    return model.to(target)


@contextlib.contextmanager
def generation_kernels(model):
    """Around a model's `generate`: on a GPU, torch's cuDNN backend of scaled_dot_product_attention is off
    (its flash and memory-efficient kernels stay). cuDNN builds an execution plan for every new sequence
    length and a decode meets a new key length at every step: on an H200, 64 rows x 256 new tokens took
    15.9 s on lengths not seen before against 4.7 s without cuDNN (BENCHMARKS.md, issue 26). Training keeps
    cuDNN (its shapes repeat; there it was ~15% faster). torch's switch is process-wide, so an optimize round
    running beside a prefetched rollout runs without it meanwhile: other kernels, the same math."""
    on_gpu = model.device.type == "cuda"
    was = torch.backends.cuda.cudnn_sdp_enabled()
    if on_gpu:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        if on_gpu:
            torch.backends.cuda.enable_cudnn_sdp(was)


def load_trainable(auto_class, path: Path | str, devices: DeviceConfig | None = None, **kwargs):
    """`auto_class.from_pretrained(path)` in float32 on the device, gradient checkpointing on if asked.
    `auto_class`: AutoModelForCausalLM, AutoModelForSequenceClassification, ..."""
    return compiled(checkpointed(_load(auto_class, path, devices, torch.float32, **kwargs), devices), devices)


def compiled(model, devices: DeviceConfig | None = None):
    """`model` with each transformer block compiled (`torch.compile`, per block) when `devices.compile` asks
    for it; the whole model where no list of blocks is found. The blocks are found by name (`layers`, `h`,
    `blocks` under the decoder), so a PEFT adapter added later is compiled with its block."""
    if devices is None or not devices.compile:
        return model
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    blocks = next((getattr(decoder, name) for name in ("layers", "h", "blocks")
                   if decoder is not None and isinstance(getattr(decoder, name, None), torch.nn.ModuleList)), None)
    if blocks is None:
        model.compile()
        return model
    # Without a KV cache (the optimize stage's forward) one graph serves every block, in a few variants (with
    # and without gradients, static shapes then dynamic ones: 9 over five rounds, benchmarks/compile_graphs.py).
    # With one (transformers' default outside gradient checkpointing, where a caller passes no use_cache) each
    # block is specialized on its layer index, its cache slot: a few graphs per block. Dynamo's default limit
    # of 8 graphs in all would leave blocks eager; 8 per block covers both.
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 8 * len(blocks)))
    for block in blocks:
        block.compile()
    return model


def checkpointed(model, devices: DeviceConfig | None = None):
    """`model` with gradient checkpointing on when `devices` asks for it (also for a frozen base under a LoRA
    adapter: the activations are the adapter's to keep). Non-reentrant unless train.gradient_checkpointing_kwargs
    says use_reentrant: true (transformers then makes the embeddings' output require grad, so a frozen base's
    checkpointed layers still pass gradients to the adapter)."""
    if devices is not None and devices.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(devices))
        model.config.use_cache = False
    return model


def checkpointing_kwargs(devices: DeviceConfig) -> dict:
    """torch.utils.checkpoint's keyword arguments for `devices` (use_reentrant false unless set)."""
    return {"use_reentrant": bool(devices.gradient_checkpointing_kwargs.get("use_reentrant", False))}


def load_frozen(auto_class, path: Path | str, devices: DeviceConfig | None = None, **kwargs):
    """`auto_class.from_pretrained(path)` in the compute dtype on the device, in eval mode, no gradients."""
    model = _load(auto_class, path, devices, compute_dtype(devices), **kwargs)
    model.requires_grad_(False)
    return model.eval()


def adapter_inputs_uncast(model, devices: DeviceConfig | None = None):
    """`model` (a PEFT model) with peft's cast of each adapted linear's input to the adapter's dtype turned off
    when forwards run under autocast (bf16/fp16). There the input is in the compute dtype (the frozen base's),
    peft casts it to the adapter's fp32 and autocast casts it straight back: an exact round trip costing four
    copies of the activations per adapted linear and micro-batch (two forward, two backward; one in nine of a
    LoRA micro-batch's GPU kernels, benchmarks/dispatch_ops.py). The model must then run under `autocast`
    (an fp32 adapter on a bf16 input outside it is a dtype error, not a silent change). fp32: unchanged."""
    if precision(devices) == "fp32":
        return model
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False
    return model


def autocast(devices: DeviceConfig | None = None):
    """The context a training forward runs in: torch.autocast in bf16/fp16, nothing in fp32."""
    dtype = precision(devices)
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device(devices).type, dtype=getattr(torch, DTYPES[dtype]))


def grad_scaler(devices: DeviceConfig | None = None):
    """A torch GradScaler for fp16 (its small range underflows gradients otherwise); None for fp32 and bf16."""
    if precision(devices) != "fp16":
        return None
    return torch.amp.GradScaler(device(devices).type)


def trainer_arguments(devices: DeviceConfig | None = None) -> dict:
    """HF TrainingArguments / TRL config fields for `devices`: where the Trainer places the model
    (use_cpu), its autocast dtype (bf16 / fp16 on an fp32 model: the precision above) and gradient
    checkpointing."""
    devices = devices or DeviceConfig()
    resolved = precision(devices)
    return {"use_cpu": device(devices).type == "cpu", "bf16": resolved == "bf16", "fp16": resolved == "fp16",
            "gradient_checkpointing": devices.gradient_checkpointing,
            **({"gradient_checkpointing_kwargs": checkpointing_kwargs(devices)} if devices.gradient_checkpointing
               else {})}


def to_device(batch: dict, devices: DeviceConfig | None = None) -> dict:
    """The batch's tensors moved to the models' device (other values as they are). To a GPU through pinned
    memory without waiting (`non_blocking`): the host queues the copy behind the running kernels and goes on,
    instead of waiting for the GPU to drain, as a copy from pageable memory does."""
    target = device(devices)
    if target.type == "cpu":
        return dict(batch)
    return {k: v.pin_memory().to(target, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


def describe(devices: DeviceConfig | None = None) -> dict:
    """The resolved placement, for a stage's summary: device, precision, the GPU's name."""
    target = device(devices)
    out = {"device": str(target), "precision": precision(devices)}
    if target.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(target)
    return out


def of(train) -> DeviceConfig:
    """The DeviceConfig part of a TrainConfig (the config's `train:` section), as a plain DeviceConfig."""
    return DeviceConfig(**{name: getattr(train, name) for name in DeviceConfig.model_fields})
