"""One policy for device and precision (stages/runtime/devices.py, issue 26): bf16 on CPU guards the GPU path.

Every model-running stage is run here with train.precision bf16 on the CPU (bf16 works on CPU, slowly) and the
dtypes of its weights, optimizer state and saved files are checked; a scan of stages/ holds that no module but
devices.py loads a model, calls .cuda() or sets use_cpu; configs that ask for what this machine lacks fail at
config time, naming the key.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny_round, write_scored
from safetensors import safe_open

from flows.config import ConfigError, load_config
from stages.evaluation import evaluate
from stages.rollout.engines import Policy, Sampling
from stages.rollout.engines.hf import TransformersEngine
from stages.runtime import devices
from stages.runtime.devices import DeviceConfig
from stages.runtime.policy import load_policy
from stages.training import ebft, export, grpo, logprobs

BF16 = DeviceConfig(device="cpu", precision="bf16")
FP32 = DeviceConfig(device="cpu", precision="fp32")
STAGES = Path(__file__).resolve().parent.parent / "stages"
LOADS_WITHOUT_PLACING = {"model_source.py": "dequantizes a GGUF file into an fp32 folder on the CPU (a file "
                         "conversion: nothing runs on the model)"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(root, scored parquet): a tiny policy and one round of its rollouts with nonzero advantages."""
    root = tmp_path_factory.mktemp("devices")
    rows = tiny_round(root, num_prompts=8, prompts_per_round=4)
    write_scored(root / "scored.parquet", rows, [(1.0, -0.5, 0.8, -1.3)[r["group_index"]] for r in rows])
    return root, root / "scored.parquet"


def _saved_dtypes(folder: Path) -> set[str]:
    dtypes = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            dtypes |= {str(f.get_tensor(name).dtype) for name in f.keys()}
    return dtypes


def _optimize(root, scored, name, devices_cfg, **options):
    out = root / name
    out.mkdir()
    cfg = grpo.GRPOConfig(**{"micro_batch_size": 8, "gradient_accumulation_steps": 2, "learning_rate": 1e-2,
                             **options})
    return grpo.run(cfg, root / "model", None, scored, 0, 1.0, 6, out, devices=devices_cfg), out


# ---------------------------------------------------------------- the policy itself


def test_auto_is_fp32_on_this_cpu_and_fp32_keeps_keys():
    assert str(devices.device()) == "cpu" and devices.precision() == "fp32"
    assert devices.key_fields(FP32) == {} and devices.key_fields() == {}
    assert devices.key_fields(BF16) == {"precision": "bf16"}
    assert devices.trainer_arguments(BF16) == {"use_cpu": True, "bf16": True, "fp16": False,
                                               "gradient_checkpointing": False}


@pytest.mark.parametrize("asked, key", [({"device": "cuda"}, "train.device: cuda"),
                                        ({"precision": "fp16"}, "train.precision: fp16")])
def test_what_this_machine_lacks_fails_naming_the_key(asked, key):
    with pytest.raises(ValueError, match=key):
        devices.check_machine(DeviceConfig(**asked))


def test_flash_attention_without_the_package_names_it():
    with pytest.raises(ValueError, match="flash_attention_2 needs the flash-attn package"):
        devices.check_machine(DeviceConfig(attn_implementation="flash_attention_2"))


# ---------------------------------------------------------------- config time


@pytest.mark.parametrize("override, message", [
    ("train.device=cuda", "train.device: cuda needs a CUDA GPU"),
    ("train.precision=fp16", "train.precision: fp16 needs a CUDA GPU"),
    ("grpo.optim=adamw_8bit", "grpo.optim: adamw_8bit .* needs a CUDA GPU"),
])
def test_config_asking_for_a_gpu_fails_at_load(tiny_config, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(tiny_config, [override])


def test_axolotl_precision_keys_set_train(tmp_path, tiny_config_text):
    path = tmp_path / "axolotl.yaml"
    path.write_text(tiny_config_text + "bf16: true\ngradient_checkpointing: true\nsdp_attention: true\n"
                    "torch_compile: true\n")
    cfg = load_config(path)
    assert (cfg.train.precision, cfg.train.gradient_checkpointing, cfg.train.attn_implementation,
            cfg.train.compile) == ("bf16", True, "sdpa", True)
    path.write_text(tiny_config_text + "bf16: false\nfp16: false\n")
    assert load_config(path).train.precision == "fp32"
    path.write_text(tiny_config_text + "bf16: true\ntrain:\n  precision: fp32\n")
    with pytest.raises(ConfigError, match="bf16 .*sets train.precision: bf16, but train.precision is 'fp32'"):
        load_config(path)
    path.write_text(tiny_config_text + "flash_attention: true\n")
    with pytest.raises(ConfigError, match="flash-attn"):
        load_config(path)


# ---------------------------------------------------------------- every stage loads through devices.py


def _model_loads(tree: ast.AST) -> list[str]:
    """`X.from_pretrained(...)` calls whose X is not a tokenizer, config or PeftModel (an adapter goes where the
    base model it wraps is, which devices.py placed), `.cuda()` calls and `use_cpu=` keywords."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if node.func.attr == "from_pretrained" and not any(
                    allowed in owner for allowed in ("Tokenizer", "Config", "PeftModel")):
                found.append(f"line {node.lineno}: {ast.unparse(node.func)}")
            if node.func.attr == "cuda":
                found.append(f"line {node.lineno}: .cuda()")
        if isinstance(node, ast.keyword) and node.arg == "use_cpu":
            found.append(f"line {getattr(node.value, 'lineno', '?')}: use_cpu=")
    return found


def test_no_stage_places_or_casts_a_model_by_itself():
    offenders = {}
    for path in sorted(STAGES.rglob("*.py")):
        if path.name in ("devices.py", *LOADS_WITHOUT_PLACING):
            continue
        if found := _model_loads(ast.parse(path.read_text())):
            offenders[str(path.relative_to(STAGES.parent))] = found
    assert not offenders, f"load models through stages/runtime/devices.py: {offenders}"


def test_the_scan_finds_a_stray_load():
    stray = ast.parse("from transformers import AutoModelForCausalLM as M\nm = M.from_pretrained('x').cuda()\n"
                      "args = dict(use_cpu=True)\nt = AutoTokenizer.from_pretrained('x')\n"
                      "a = PeftModel.from_pretrained(m, 'adapter')\n")
    assert len(_model_loads(stray)) == 3


# ---------------------------------------------------------------- the stages in bf16 on CPU


def test_optimize_full_finetune_in_bf16(tiny):
    root, scored = tiny
    model, ref = grpo._load_trainable(grpo.GRPOConfig(adapter="none", beta=0.04), root / "model", None, BF16)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert ({p.dtype for p in ref.parameters()} == {torch.bfloat16}
            and not any(p.requires_grad for p in ref.parameters()))

    bf16, out = _optimize(root, scored, "full_bf16", BF16, adapter="none", beta=0.04)
    fp32, out32 = _optimize(root, scored, "full_fp32", FP32, adapter="none", beta=0.04)
    assert (bf16["precision"], bf16["device"], fp32["precision"]) == ("bf16", "cpu", "fp32")
    assert _saved_dtypes(out) == {"torch.float32"}
    state = torch.load(out / "optimizer.pt", weights_only=True)["state_dict"]["state"]
    assert {v["exp_avg"].dtype for v in state.values()} == {torch.float32}
    # the forward ran in bf16: the same round in fp32 ends elsewhere
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as a, \
            safe_open(str(next(out32.glob("*.safetensors"))), "pt") as b:
        name = next(n for n in a.keys() if "layers.0.mlp" in n)
        assert not torch.equal(a.get_tensor(name), b.get_tensor(name))
    assert abs(bf16["loss"] - fp32["loss"]) < 0.05  # and near the same place


def test_optimize_lora_in_bf16_trains_an_fp32_adapter_on_a_bf16_base(tiny):
    root, scored = tiny
    model, _ = grpo._load_trainable(grpo.GRPOConfig(adapter="lora"), root / "model", None, BF16)
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {torch.bfloat16}
    summary, out = _optimize(root, scored, "lora_bf16", BF16, beta=0.04)
    assert summary["precision"] == "bf16" and summary["optimizer_steps"] > 0
    assert _saved_dtypes(out) == {"torch.float32"}


def test_lora_under_autocast_skips_peft_input_casts_with_the_same_numbers(tiny):
    """bf16: peft's cast of an adapted linear's input to the fp32 adapter (and autocast's straight back) is off
    (devices.adapter_inputs_uncast); the micro-batch's log-probs and adapter gradients are the same bit for bit
    as with the casts, for fewer copies. fp32 leaves peft as it is."""
    root, scored = tiny
    cfg = grpo.GRPOConfig(adapter="lora", micro_batch_size=8)
    model, _ = grpo._load_trainable(cfg, root / "model", None, BF16)
    adapted = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert adapted and not any(m.cast_input_dtype_enabled for m in adapted)
    fp32_model, _ = grpo._load_trainable(cfg, root / "model", None, FP32)
    assert all(m.cast_input_dtype_enabled for m in fp32_model.modules() if hasattr(m, "cast_input_dtype_enabled"))

    rows = pq.read_table(scored).to_pylist()[:8]
    batch = grpo.collate(rows, 0)
    results = []
    for cast in (True, False):
        for module in adapted:
            module.cast_input_dtype_enabled = cast
        model.zero_grad(set_to_none=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with devices.autocast(BF16):
                logps, _ = logprobs.batch_logps(model, batch, 1.0)
            (logps * batch["completion_mask"]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        copies = sum(e.name == "aten::copy_" for e in prof.events())
        results.append((logps.detach(), grads, copies))
    (logps_cast, grads_cast, copies_cast), (logps_uncast, grads_uncast, copies_uncast) = results
    assert torch.equal(logps_cast, logps_uncast)
    assert grads_cast.keys() == grads_uncast.keys() and all(torch.equal(grads_cast[n], grads_uncast[n])
                                                            for n in grads_cast)
    # at least the two forward copies of each adapted linear in each of the shared prompt pass's two passes
    assert copies_cast - copies_uncast >= 2 * 2 * len(adapted), (copies_cast, copies_uncast, len(adapted))


def test_gradient_checkpointing_gives_the_same_round(tiny):
    root, scored = tiny
    plain, out = _optimize(root, scored, "no_ckpt", DeviceConfig(device="cpu", precision="fp32"), adapter="none",
                           shared_prompt_pass=False)
    ckpt, out_ckpt = _optimize(root, scored, "ckpt", DeviceConfig(device="cpu", gradient_checkpointing=True),
                               adapter="none")
    assert ckpt["loss"] == pytest.approx(plain["loss"], abs=1e-5)
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as a, \
            safe_open(str(next(out_ckpt.glob("*.safetensors"))), "pt") as b:
        for name in a.keys():
            torch.testing.assert_close(a.get_tensor(name), b.get_tensor(name), atol=1e-5, rtol=1e-4)


def test_reentrant_checkpointing_gives_a_lora_adapter_the_same_gradients(tiny):
    """train.gradient_checkpointing_kwargs use_reentrant: true (axolotl's ZeRO-3 and FlexAttention blocks): the
    layers run torch's reentrant checkpoint, and the adapter's gradients under a frozen base are those without
    checkpointing (the embeddings' output is made to require grad, else reentrant checkpointing passes none)."""
    root, scored = tiny
    cfg = grpo.GRPOConfig(adapter="lora", micro_batch_size=8)
    batch = grpo.collate(pq.read_table(scored).to_pylist()[:8], 0)
    reentrant = DeviceConfig(device="cpu", gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": True})
    grads = {}
    for name, devices_cfg in (("plain", FP32), ("reentrant", reentrant)):
        torch.manual_seed(0)  # the same initial adapter
        model, _ = grpo._load_trainable(cfg, root / "model", None, devices_cfg)
        funcs = {getattr(m, "_gradient_checkpointing_func", None) for m in model.modules()
                 if getattr(m, "gradient_checkpointing", False)}
        assert [f.keywords for f in funcs if f is not None] == ([{"use_reentrant": True}] if name == "reentrant"
                                                                else [])
        logps, _ = logprobs.batch_logps(model, batch, 1.0)
        (logps * batch["completion_mask"]).sum().backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads["plain"].keys() == grads["reentrant"].keys()
    assert all(grads["reentrant"][n].abs().sum() > 0 for n in grads["reentrant"] if "lora_B" in n)
    for n in grads["plain"]:
        torch.testing.assert_close(grads["reentrant"][n], grads["plain"][n], atol=1e-6, rtol=1e-4)


def test_reentrant_checkpointing_without_checkpointing_names_both_keys():
    with pytest.raises(ValueError, match="use_reentrant: true, but train.gradient_checkpointing is false"):
        DeviceConfig(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="gradient_checkpointing_kwargs: preserve_rng_state is not honoured"):
        DeviceConfig(gradient_checkpointing=True, gradient_checkpointing_kwargs={"preserve_rng_state": False})
    reentrant = DeviceConfig(device="cpu", gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    assert devices.trainer_arguments(reentrant)["gradient_checkpointing_kwargs"] == {"use_reentrant": True}


def test_rollout_eval_export_and_features_run_in_bf16(tiny, tmp_path):
    root, _ = tiny
    model, _ = load_policy(root / "model", devices=BF16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}

    engine = TransformersEngine(batch_size=8, devices=BF16)
    prompts = [r["prompt"] for r in pq.read_table(root / "prompts" / "train.parquet").to_pylist()[:2]]
    out = engine.generate(Policy(root / "model"), prompts, Sampling(max_new_tokens=4, seed=1))
    assert len(out) == 2 and all(len(o["sampling_logprobs"]) == len(o["completion_token_ids"]) for o in out)

    (tmp_path / "eval").mkdir()
    result = evaluate.run(evaluate.EvalConfig(max_prompts=4, max_completion_length=4), root / "model", None,
                          root / "prompts" / "train.parquet", tmp_path / "eval", devices=BF16)
    assert result["num_prompts"] == 4

    (tmp_path / "export").mkdir()
    summary = export.run(export.ExportConfig(model_name="t"), root / "model", None, tmp_path / "export",
                         metrics={}, lineage={}, config={}, devices=BF16)
    assert summary["dtype"] == "bfloat16" and _saved_dtypes(tmp_path / "export") == {"torch.bfloat16"}
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dtype"] == "bfloat16"

    network = ebft.FeatureNetwork(root / "model", [0.5], devices=BF16)
    assert {p.dtype for p in network.model.parameters()} == {torch.bfloat16}
    features = network.embed([[1, 2, 3], [4, 5]], [1, 1], "mean_pooling")
    assert features.dtype == torch.float32 and features.shape[0] == 2


@pytest.mark.slow  # torch.compile compiles the model first (~10 s): `make test`, not `make test-fast`
def test_compiled_round_runs_the_plain_forward(tiny, monkeypatch):
    root, scored = tiny
    monkeypatch.setattr(logprobs, "batch_logps", lambda *a, **k: pytest.fail("the shared prompt pass ran"))
    summary, _ = _optimize(root, scored, "compiled_default", DeviceConfig(device="cpu", compile=True),
                           adapter="none")
    assert summary["optimizer_steps"] > 0


def test_vllm_sleep_mode_without_a_gpu_is_refused(tiny_config):
    with pytest.raises(ConfigError, match="rollout.vllm.sleep_mode .*CUDA only"):
        load_config(tiny_config, ["rollout.engine=vllm", "rollout.vllm.sleep_mode=true"])


def test_compiled_blocks_train_the_same_round(tiny):
    root, scored = tiny
    plain, _ = _optimize(root, scored, "not_compiled", FP32, adapter="none")
    fast, _ = _optimize(root, scored, "compiled", DeviceConfig(device="cpu", compile=True), adapter="none")
    assert fast["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)
    assert fast["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    model, _ = grpo._load_trainable(grpo.GRPOConfig(adapter="lora"), root / "model", None,
                                    DeviceConfig(device="cpu", compile=True))
    blocks = model.get_decoder().layers
    assert all(getattr(block, "_compiled_call_impl", None) is not None for block in blocks)


def test_compiled_blocks_share_one_graph_in_the_plain_forward(tiny):
    """The plain forward runs without a KV cache, so the compiled blocks are not specialized on their layer
    index: one graph serves every block (with a cache: one per block)."""
    from torch._dynamo.utils import counters

    root, scored = tiny
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    _optimize(root, scored, "compiled_plain", DeviceConfig(device="cpu", compile=True), adapter="none",
              shared_prompt_pass=False)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_each_reward_worker_is_its_own_local_rank():
    """A reward model in worker i goes to GPU i % GPUs: workers know their slot as LOCAL_RANK."""
    import sys

    from stages.scoring.reward_workers import RewardWorkerPool

    sys.path.insert(0, str(Path(__file__).parent))
    pool = RewardWorkerPool(["toy_rewards.local_rank"], num_workers=2, timeout_s=30)
    try:
        jobs = [("toy_rewards.local_rank", {"prompts": [[]], "completions": ["x"]}, [f"s{i}"]) for i in range(4)]
        ranks = {values[0] for values, _ in pool.score(jobs)}
    finally:
        pool.close()
    assert ranks == {0.0, 1.0}
