"""The in-process vLLM rollout engine: one `vllm.LLM` per process, kept across rounds.

- Sampling log-probs: the engine runs with `logprobs_mode="processed_logprobs"` and asks
  for `logprobs=0`, so each sampled token comes back with log softmax(logits / temperature)
  -- the quantity the transformers engine records and TRL uses. With top_p < 1 vLLM takes
  the log-softmax after the top-p mask (TRL does the same with vLLM); the transformers
  engine does not, so only then the two differ by the kept mass. Greedy decoding
  (`do_sample=False`) returns log softmax(logits) (temperature 1).
- LoRA policies, two ways (`lora_sync`). `merged` (the default on CPU): the adapter is merged
  into the base weights once per version (PEFT `merge_and_unload`, as TRL's colocated vLLM does)
  and the merged folder goes in through the full-weight path below; the engine then runs plain
  matmuls. On CPU vLLM's LoRA kernels made a SmolLM2-135M round ~4x slower than the merged
  weights, merge and reload included (BENCHMARKS.md). `adapter` (the default on GPUs, where the
  LoRA kernels are fast and a merge + reload of a large model is not): a new
  `LoRARequest(name, id, adapter_dir)` for every adapter version (a new id when the folder or its
  weights file changes), so vLLM loads it afresh.
- Full fine-tuning: when `policy.model_dir` differs from the weights the engine holds, the
  engine takes the folder's weights in place, without a restart: vLLM's layerwise
  `reload_weights` through a worker extension that also re-ties a tied lm_head and, on CPU,
  re-packs the GEMMs of the layers vLLM keeps weights for (tested on CPU; the GPU path is the
  same minus the re-pack, not run here).
- Prompts go in as token ids (stages.rollout.engines.prompt_token_ids), each request with
  its own seed (sampling.seed, prompt index), so a call is reproducible.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Callable

from stages.rollout.engines import Policy, Prompt, Sampling, prompt_token_ids


def request_seed(seed: int, index: int) -> int:
    """The per-request seed of prompt `index` in a call seeded with `seed` (fits in 63 bits)."""
    return (seed * 1_000_003 + index) % (2**63 - 1)


def sampling_params(sampling: Sampling, indices: list[int], eos_token_id: int | None) -> list:
    """One `vllm.SamplingParams` per prompt: the sampled token's log-prob, a seed each from the prompt's
    index in the whole call (so a share of the prompts sampled elsewhere gets the same seeds)."""
    from vllm import SamplingParams

    params = []
    for i in indices:
        params.append(SamplingParams(
            n=1,
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature if sampling.do_sample else 0.0,
            top_p=sampling.top_p if sampling.do_sample else 1.0,
            top_k=0,
            seed=request_seed(sampling.seed, i),
            logprobs=0,
            stop_token_ids=[eos_token_id] if eos_token_id is not None else None,
            detokenize=False,
        ))
    return params


def to_result(tokenizer, prompt_ids: list[int], output, eos_token_id: int | None) -> dict:
    """The standard per-prompt dict (see stages.rollout.engines) from one vLLM `CompletionOutput`."""
    ids = list(output.token_ids)
    if output.logprobs is None or len(output.logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if output.logprobs is None else len(output.logprobs)} "
                           f"log-probs for {len(ids)} tokens")
    logps = [float(step[tok].logprob) for tok, step in zip(ids, output.logprobs)]
    stopped = output.finish_reason == "stop" or (eos_token_id is not None and eos_token_id in ids)
    if eos_token_id is not None and eos_token_id in ids:
        cut = ids.index(eos_token_id) + 1
        ids, logps = ids[:cut], logps[:cut]
    return {
        "prompt_token_ids": list(prompt_ids),
        "completion_token_ids": ids,
        "sampling_logprobs": logps,
        "completion": tokenizer.decode(ids, skip_special_tokens=True),
        "finish_reason": "stop" if stopped else "length",
    }


def progress_bar(on_progress: Callable[[int], None]):
    """A tqdm factory for `LLM.generate(use_tqdm=...)` that prints nothing and reports
    each finished request to `on_progress`."""
    from tqdm import tqdm

    class _Progress(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = io.StringIO()
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            on_progress(n)
            return super().update(n)

    return _Progress


class WeightUpdateExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`), callable by name through
    `LLM.collective_rpc`: reloads the running model's weights in place from a folder."""

    def load_policy_weights(self, model_dir: str) -> None:
        """vLLM's layerwise `reload_weights` from model_dir, then re-tie shared parameters.

        The reload re-creates each parameter (CPU kernels repack weights after loading, so
        they cannot simply be copied into); a parameter shared by two modules (a tied lm_head
        and embedding) then exists twice, the second copy keeping the old values. Each alias
        is pointed back at the first module's new parameter, as the model built it.
        """
        model = self.model_runner.get_model()
        first: dict[int, str] = {}
        aliases: list[tuple[str, str]] = []
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in first:
                aliases.append((name, first[id(param)]))
            else:
                first[id(param)] = name
        self.reload_weights(weights_path=model_dir)
        for alias, source in aliases:
            module_name, _, attr = alias.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            setattr(module, attr, model.get_parameter(source))
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            repack_cpu_gemms(model)


    def policy_device_type(self) -> str:
        """The device this worker runs on ("cpu", "cuda", ...): how a vllm_server engine picks lora_sync auto."""
        from vllm.platforms import current_platform

        return current_platform.device_type


def repack_cpu_gemms(model) -> list[str]:
    """CPU: rebuild the GEMM closures of layers that keep their weights (vocab embedding, lm_head).

    vLLM 0.32 gives each CPU layer a `cpu_linear` closure over a packed copy of its weight.
    Linear layers drop their weight after packing, and the layerwise reload re-packs them;
    the vocab layers keep theirs and are not re-packed, so a tied lm_head would go on
    multiplying by the start-up embedding. Re-dispatching them from the current weights
    fixes that (checked: tokens and log-probs equal to a fresh engine on the new folder).
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    repacked = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2 and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked.append(name)
    return repacked


def adapter_key(adapter_dir: Path, version: int) -> tuple:
    """What identifies an adapter version: its folder, version and weights file's modification time."""
    adapter_dir = Path(adapter_dir).resolve()
    weights = adapter_dir / "adapter_model.safetensors"
    return str(adapter_dir), version, weights.stat().st_mtime_ns if weights.exists() else 0


class MergedAdapters:
    """Full-weight folders of LoRA policies with their adapters merged in (PEFT `merge_and_unload`, as TRL's
    colocated vLLM does), made once per adapter version in a scratch folder that is removed on `close` (or at
    exit). An engine loads the newest folder, then calls `release_older` to delete the ones before it."""

    def __init__(self):
        self.merges = 0
        self._scratch: Path | None = None
        self._current: tuple[tuple, Path] | None = None  # (adapter key + model folder, merged folder)
        self._older: list[Path] = []

    def folder(self, policy: Policy) -> Path:
        """The merged folder of `policy` (base or full weights + adapter), made now unless it is the last one."""
        key = adapter_key(policy.adapter_dir, policy.version) + (str(Path(policy.model_dir).resolve()),)
        if self._current and self._current[0] == key:
            return self._current[1]
        from stages.runtime.policy import load_policy

        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="posttrain-vllm-merged-"))
            weakref.finalize(self, shutil.rmtree, self._scratch, True)
        model, _ = load_policy(policy.model_dir, policy.adapter_dir)
        self.merges += 1
        folder = self._scratch / f"v{policy.version}-{self.merges}"
        model.save_pretrained(folder)
        del model
        if self._current:
            self._older.append(self._current[1])
        self._current = (key, folder)
        return folder

    def release_older(self) -> None:
        """Delete the merged folders before the newest (no engine reads them any more)."""
        while self._older:
            shutil.rmtree(self._older.pop(), ignore_errors=True)

    def close(self) -> None:
        """Delete every merged folder."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        self._scratch, self._current, self._older = None, None, []


MAX_NUM_SEQS = 256  # sequences per engine step (vLLM's default on GPU)
CPU_MAX_MODEL_LEN = 1024
"""max_model_len on CPU when none is set and the model allows more. The CPU step budget is sized for
MAX_NUM_SEQS whole sequences of this length, and vLLM's CPU runner holds memory in proportion: SmolLM2's
8192 made a 10 GiB process, 512 a 4 GiB one (BENCHMARKS.md)."""


def cpu_step_budget(model_dir: Path, max_model_len: int | None) -> tuple[int, dict]:
    """(max_model_len, vLLM engine settings) on CPU: vLLM 0.32's CPU runner fails ("CPU Generator does not use
    offset") when a seeded request's prefill is split across steps, so each step's token budget fits
    MAX_NUM_SEQS whole sequences; max_model_len unset: the model's, at most CPU_MAX_MODEL_LEN. The in-process
    engine and the server `posttrain vllm-serve` starts (vllm_server.serve_command) both take it."""
    import json

    if max_model_len is None:  # (a folder without config.json: a hint's command line, not a server)
        config = Path(model_dir) / "config.json"
        model_max = json.loads(config.read_text()).get("max_position_embeddings", 2048) if config.is_file() else 2048
        max_model_len = min(model_max, CPU_MAX_MODEL_LEN)
    return max_model_len, {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_SEQS * max_model_len}


class VLLMEngine:
    """An in-process `vllm.LLM` on `base_dir`, started on first use and kept until `close()`."""

    name = "vllm"

    def __init__(self, base_dir, gpu_memory_utilization: float = 0.05, kv_cache_space_gib: float = 1.0,
                 max_model_len: int | None = None, dtype: str = "float32", tensor_parallel_size: int = 1,
                 enforce_eager: bool = True, max_lora_rank: int = 16, in_process: bool = True,
                 lora_sync: str = "auto", sleep_mode: bool = False):
        self.base_dir = Path(base_dir)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.kv_cache_space_gib = kv_cache_space_gib
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.tensor_parallel_size = tensor_parallel_size
        self.enforce_eager = enforce_eager
        self.max_lora_rank = max_lora_rank
        self.in_process = in_process
        if lora_sync not in ("auto", "merged", "adapter"):
            raise ValueError(f"rollout.vllm.lora_sync: {lora_sync!r}; use auto, merged or adapter")
        self.lora_sync = lora_sync
        self.sleep_mode = sleep_mode  # sleep between generations (rollout.vllm.sleep_mode)
        self.asleep = False
        self.llm = None
        self.tokenizer = None
        self.loaded_weights: Path = self.base_dir.resolve()
        self._lora_ids: dict[tuple, int] = {}
        self.weight_reloads = 0
        self._merged = MergedAdapters()

    def start(self) -> None:
        """Build the engine now rather than at the first generate (nothing to do once built)."""
        if self.llm is None:
            self._start()

    def _start(self, model_dir: Path | None = None):
        from transformers import AutoTokenizer

        from vllm import LLM
        from vllm.platforms import current_platform

        extra = {"enable_sleep_mode": True} if self.sleep_mode else {}
        if self.sleep_mode and current_platform.is_cpu():
            raise ValueError("rollout.vllm.sleep_mode: vLLM's sleep mode needs a CUDA GPU; this vLLM runs on the "
                             "CPU (set it false)")
        if current_platform.is_cpu():
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                # What VLLM_CPU_KVCACHE_SPACE (whole GiB only) would set; a set variable still wins.
                extra["kv_cache_memory_bytes"] = int(self.kv_cache_space_gib * 2**30)
            self.max_model_len, budget = cpu_step_budget(model_dir or self.base_dir, self.max_model_len)
            extra.update(budget)

        # Read by vLLM when the engine is built: 0 keeps the engine core and worker in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.in_process else "1"
        from stages.runtime.policy import MODEL_LOADING

        self.tokenizer = AutoTokenizer.from_pretrained(self.base_dir)
        with MODEL_LOADING:  # vLLM builds the model with transformers helpers too
            self.llm = LLM(
                model=str(model_dir or self.base_dir),
                tokenizer=str(self.base_dir),
                dtype=self.dtype,
                gpu_memory_utilization=self.gpu_memory_utilization,
                max_model_len=self.max_model_len,
                tensor_parallel_size=self.tensor_parallel_size,
                enforce_eager=self.enforce_eager,
                enable_lora=True,
                max_lora_rank=self.max_lora_rank,
                max_loras=1,
                logprobs_mode="processed_logprobs",
                seed=0,
                worker_extension_cls=f"{__name__}.WeightUpdateExtension",
                **extra,
            )
        engine = self.llm.llm_engine
        step = engine.step

        def step_between_model_loads():  # an async-prefetch rollout beside a stage loading a model: see MODEL_LOADING
            with MODEL_LOADING:
                return step()

        engine.step = step_between_model_loads  # LLM.generate runs its requests one engine step at a time

    def _set_weights(self, model_dir: Path) -> None:
        """Make the engine sample from `model_dir`'s weights if it holds other ones.

        In place, no restart (worker extension: layerwise reload, re-tie, CPU re-pack).
        """
        model_dir = Path(model_dir).resolve()
        if model_dir == self.loaded_weights:
            return
        if not any(model_dir.glob("*.safetensors")):
            raise FileNotFoundError(f"vllm engine: no *.safetensors in {model_dir} to load the policy's weights from")
        from stages.runtime.policy import MODEL_LOADING

        # The layerwise reload re-creates every parameter, which a transformers load in another thread (an eval
        # or optimize stage beside a prefetched rollout) would put on the meta device: it patches nn.Module
        # process-wide while it builds a model ("Cannot copy out of meta tensor" in vLLM's reload, issue 42).
        with MODEL_LOADING:
            self.llm.collective_rpc("load_policy_weights", args=(str(model_dir),))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.loaded_weights = model_dir
        self.weight_reloads += 1

    @property
    def merges(self) -> int:
        """Adapter merges made so far (one per new adapter version under lora_sync merged)."""
        return self._merged.merges

    def merges_lora(self) -> bool:
        """Whether LoRA policies are merged into the weights (`lora_sync`; auto: on CPU) rather than
        applied by vLLM's LoRA kernels."""
        if self.lora_sync != "auto":
            return self.lora_sync == "merged"
        from vllm.platforms import current_platform

        return current_platform.is_cpu()

    def _merged_weights(self, policy: Policy) -> Path:
        """A full-weight folder of `policy`'s model with its adapter merged in (MergedAdapters)."""
        return self._merged.folder(policy)

    def _lora_request(self, adapter_dir: Path, version: int):
        """A LoRARequest whose id is new for every (folder, version, weights file) seen."""
        from vllm.lora.request import LoRARequest

        key = adapter_key(adapter_dir, version)
        adapter_dir = Path(adapter_dir).resolve()
        if key not in self._lora_ids:
            self._lora_ids[key] = len(self._lora_ids) + 1
        lora_id = self._lora_ids[key]
        return LoRARequest(f"policy-v{version}-{lora_id}", lora_id, str(adapter_dir))

    def generate(self, policy: Policy, prompts: list[Prompt], sampling: Sampling,
                 on_progress: Callable[[int], None] | None = None, indices: list[int] | None = None) -> list[dict]:
        """One completion per prompt from `policy` (base, base + LoRA, or full weights), in order.
        `indices`: the prompts' positions in a larger call split across engines (their seeds); default 0..n-1."""
        if self.llm is None:
            self._start()
        if self.asleep:  # weights back from CPU memory, a new KV cache; then the round's weights below
            self.llm.wake_up()
            self.asleep = False
        lora = None
        if policy.adapter_dir and self.merges_lora():
            self._set_weights(self._merged_weights(policy))
            self._merged.release_older()  # the engine no longer reads them
        else:
            self._set_weights(policy.model_dir)
            lora = self._lora_request(policy.adapter_dir, policy.version) if policy.adapter_dir else None
        eos = self.tokenizer.eos_token_id
        ids = prompt_token_ids(self.tokenizer, prompts)
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in ids],
            sampling_params(sampling, list(range(len(ids))) if indices is None else list(indices), eos),
            lora_request=lora,
            use_tqdm=progress_bar(on_progress) if on_progress else False,
        )
        if self.sleep_mode:  # the GPU's memory is the trainer's until the next generation
            self.llm.sleep(level=1)
            self.asleep = True
        return [to_result(self.tokenizer, p, out.outputs[0], eos) for p, out in zip(ids, outputs)]

    def close(self) -> None:
        """Shut the engine down (its worker processes and memory) and delete its merged weights."""
        self._merged.close()
        if self.llm is not None:
            llm, self.llm = self.llm, None
            try:
                llm.llm_engine.engine_core.shutdown()
            finally:
                del llm
                import gc

                gc.collect()
