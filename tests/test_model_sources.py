"""model.path as a hub id (resolved from a hub cache laid out as huggingface_hub lays it out, offline), a
local folder, or a .gguf file (written here with the gguf package, dequantized once into the base_model
artifact); and the errors a person gets for what cannot be loaded. No model is downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import tiny_model
from stages.data import base_model, model_source
from stages.data.base_model import CHAT_TEMPLATE, BaseModelConfig
from stages.data.model_source import ModelSourceError
from tasks import stage_tasks
from tasks.store import Artifact, ArtifactStore

TEXTS = ["<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n19<|im_end|>\n"] * 20
COMMITS = ("a" * 40, "b" * 40)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Qwen2 model folder (config.json, model.safetensors, tokenizer)."""
    root = tmp_path_factory.mktemp("tiny")
    tiny_model(root, TEXTS)
    return root / "model"


@pytest.fixture(scope="module")
def gguf_file(folder, tmp_path_factory) -> Path:
    """A 2-layer Llama GGUF, weights in Q8_0 (norms F32), with the tiny tokenizer in its metadata."""
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf", folder)


def write_gguf(path: Path, tokenizer_folder: Path) -> Path:
    """The metadata transformers' GGUF loader reads (llama.* sizes, tokenizer.ggml.*), as llama.cpp writes it."""
    import gguf
    import numpy as np

    spec = json.loads((tokenizer_folder / "tokenizer.json").read_text())
    tokens = {i: t for t, i in spec["model"]["vocab"].items()} | {a["id"]: a["content"] for a in spec["added_tokens"]}
    special = {a["id"] for a in spec["added_tokens"] if a["special"]}
    ids = {t: i for i, t in tokens.items()}
    vocab, hidden, ffn, layers = len(tokens), 64, 128, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(hidden)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")  # byte-level BPE
    writer.add_token_list([tokens[i] for i in range(vocab)])
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(vocab)])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_eos_token_id(ids["<|im_end|>"])
    writer.add_pad_token_id(ids["<|endoftext|>"])
    writer.add_chat_template(CHAT_TEMPLATE)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}  # no output.weight: tied
    for b in range(layers):
        shapes |= {f"blk.{b}.attn_norm.weight": (hidden,), f"blk.{b}.ffn_norm.weight": (hidden,),
                   f"blk.{b}.attn_q.weight": (hidden, hidden), f"blk.{b}.attn_k.weight": (hidden, hidden),
                   f"blk.{b}.attn_v.weight": (hidden, hidden), f"blk.{b}.attn_output.weight": (hidden, hidden),
                   f"blk.{b}.ffn_gate.weight": (ffn, hidden), f"blk.{b}.ffn_up.weight": (ffn, hidden),
                   f"blk.{b}.ffn_down.weight": (hidden, ffn)}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
        else:
            weights = (rng.standard_normal(shape) * 0.05).astype(np.float32)
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(weights, q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, folder) -> Path:
    """An offline hub cache holding `org/tiny` at two commits, refs/main on the first."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    for commit in COMMITS:
        shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMITS[0])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def model_key(key_of, tmp_path):
    """model_key(model_section): the base_model key the task would look up (no stage runs)."""
    return lambda model: key_of(stage_tasks.base_model_task, {"model": model}, prompts(tmp_path))


def prompts(tmp_path: Path) -> Artifact:
    return Artifact("transform", "prompts-key", tmp_path / "transform", {})


def base_model_stage(tmp_path: Path, monkeypatch, model: dict) -> Artifact:
    """The base_model task as a pipeline calls it (store, MLflow lineage, reporter), without Prefect."""
    from flows.config import PipelineConfig
    from tasks.lineage import Lineage
    from tasks.reporting import Reporter

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = tmp_path / "artifacts"
    lineage = Lineage(root, "models")
    lineage.parent_id = lineage.client.create_run(lineage.experiment_id, run_name="models").info.run_id
    ctx = stage_tasks.RunContext(PipelineConfig.model_validate({"model": model}), ArtifactStore(root), lineage,
                                 Reporter(root, quiet=True))
    return stage_tasks.base_model_task.fn(ctx, prompts(tmp_path))


def test_a_hub_id_resolves_from_the_cache_offline_keyed_by_its_commit(hub_cache, model_key):
    source = model_source.resolve("org/tiny")
    assert (source.kind, source.commit) == ("hub", COMMITS[0])
    assert source.path == hub_cache / "models--org--tiny" / "snapshots" / COMMITS[0]
    first = model_key({"path": "org/tiny"})
    assert model_key({"path": "org/tiny", "revision": COMMITS[0]}) == first  # the commit is keyed, not the name
    (hub_cache / "models--org--tiny" / "refs" / "main").write_text(COMMITS[1])  # main moved to a new commit
    assert model_source.resolve("org/tiny").commit == COMMITS[1]
    assert model_key({"path": "org/tiny"}) != first


def test_a_hub_id_runs_through_the_base_model_task(hub_cache, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    artifact = base_model_stage(tmp_path, monkeypatch, {"path": "org/tiny"})
    assert artifact.manifest["config"]["source"]["commit"] == COMMITS[0]  # the key holds the commit
    tokenizer = AutoTokenizer.from_pretrained(artifact.path)
    assert tokenizer.chat_template == CHAT_TEMPLATE and tokenizer.eos_token == "<|im_end|>"
    assert AutoModelForCausalLM.from_pretrained(artifact.path).config.model_type == "qwen2"


def test_a_hub_id_not_in_the_cache_offline_says_how_to_get_it(hub_cache):
    with pytest.raises(ModelSourceError, match=r"'org/absent'.*not in the hub cache.*hf download org/absent"):
        model_source.resolve("org/absent")
    with pytest.raises(ModelSourceError, match=r"'org/tiny' at revision 'v9'.*hf download org/tiny --revision v9"):
        model_source.resolve("org/tiny", "v9")


def test_a_gguf_file_is_dequantized_once_into_an_ordinary_folder(gguf_file, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    artifact = base_model_stage(tmp_path, monkeypatch, {"path": str(gguf_file)})
    assert not artifact.reused and (artifact.path / "model.safetensors").is_file()
    config = json.loads((artifact.path / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config  # a plain folder, for vLLM too
    model, tokenizer = AutoModelForCausalLM.from_pretrained(artifact.path), AutoTokenizer.from_pretrained(artifact.path)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == \
        (tokenizer.eos_token_id, tokenizer.pad_token_id)
    # the weights transformers dequantizes from the file, unchanged
    reference = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert base_model_stage(tmp_path, monkeypatch, {"path": str(gguf_file)}).reused  # converted once


def test_a_gguf_file_is_keyed_by_its_bytes(gguf_file, tmp_path, model_key):
    copy = tmp_path / "copy.gguf"
    shutil.copy(gguf_file, copy)
    before = model_key({"path": str(copy)})
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1  # one byte of the last tensor
    copy.write_bytes(bytes(data))
    assert model_key({"path": str(copy)}) != before
    # the seed of a model built here changes nothing of a model read from a file (its sizes are refused)
    assert model_key({"path": str(copy), "seed": 3}) == model_key({"path": str(copy)})


def test_a_bad_gguf_file_is_named(gguf_file, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(gguf_file.read_bytes()[:4096])
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    for bad in (truncated, not_gguf):
        with pytest.raises(ModelSourceError, match=rf"GGUF file {bad}: transformers .* cannot read it"):
            model_source.load(model_source.resolve(str(bad)))


def test_folders_and_paths_that_cannot_be_loaded_say_what_to_do(folder, tmp_path, monkeypatch):
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    shutil.copy(folder / "config.json", no_tokenizer)
    with pytest.raises(ModelSourceError, match=rf"model folder {no_tokenizer} has no tokenizer"):
        model_source.load(model_source.resolve(str(no_tokenizer)))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text('{"model_type": "not_a_model"}')
    with pytest.raises(ModelSourceError, match="model_type 'not_a_model', an architecture transformers"):
        model_source.load(model_source.resolve(str(unknown)))
    monkeypatch.chdir(tmp_path)
    for typo in ("./models/foo", "models/foo.gguf", "~/no/such/model"):  # never sent to the hub
        with pytest.raises(ModelSourceError, match=rf"model.path '{typo}' does not exist"):
            model_source.resolve(typo)
    with pytest.raises(ModelSourceError, match="is a file but not a .gguf file"):
        model_source.resolve(str(folder / "config.json"))
    with pytest.raises(ModelSourceError, match="model.revision: 'v2' applies to hub ids only"):
        model_source.resolve(str(folder), "v2")


def test_build_fields_beside_a_model_path_are_refused():
    """model.hidden_size etc. shape a model built here; beside model.path they would be ignored, so the config is
    refused naming them. The seed (set by the top-level `seed` for every section) is allowed."""
    from pydantic import ValidationError

    from flows.config import PipelineConfig

    with pytest.raises(ValidationError, match=r"model.hidden_size shapes a model built here, but model.path "
                                              r"'HuggingFaceTB/SmolLM2-135M-Instruct' is read as it is"):
        BaseModelConfig(path="HuggingFaceTB/SmolLM2-135M-Instruct", hidden_size=512, seed=3)
    assert BaseModelConfig(path="HuggingFaceTB/SmolLM2-135M-Instruct", seed=3).seed == 3
    assert BaseModelConfig(hidden_size=512).hidden_size == 512
    assert PipelineConfig.model_validate({"model": {"path": "org/model"}, "seed": 4}).model.seed == 4


def test_chat_template_names_what_the_base_models_tokenizer_renders(folder, tmp_path, monkeypatch):
    """axolotl's top-level chat_template: a built-in name, tokenizer_default_fallback_<name> (the tokenizer's own
    when it has one), or jinja with its text or file; each saved with the tokenizer and in the key only when set."""
    from transformers import AutoTokenizer

    from flows.config import PipelineConfig
    from stages.data.chat_templates import CHATML

    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    cfg = PipelineConfig.model_validate({"base_model": str(folder), "chat_template": "chatml"})
    assert cfg.model.chat_template == "chatml"
    plain = base_model_stage(tmp_path, monkeypatch, {"path": str(folder)})
    default = base_model_stage(tmp_path, monkeypatch, {"path": str(folder), "chat_template": "tokenizer_default"})
    assert default.key == plain.key  # tokenizer_default is what leaving it out does
    (tmp_path / "plain.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                                          "{% if add_generation_prompt %}[assistant] {% endif %}")
    own = base_model_stage(tmp_path, monkeypatch, {"path": str(folder), "chat_template": "jinja",
                                                   "chat_template_jinja": str(tmp_path / "plain.jinja")})
    assert own.key != plain.key
    rendered = AutoTokenizer.from_pretrained(own.path).apply_chat_template(messages, tokenize=False,
                                                                           add_generation_prompt=True)
    assert rendered == "[user] What is 2 + 2?\n[assistant] "
    # a tokenizer without a template: the fallback is the built-in one, its end of turn the eos token
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    for name in ("chat_template.jinja", "chat_template.json"):
        (bare / name).unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    assert AutoTokenizer.from_pretrained(bare).chat_template is None
    fallback = base_model_stage(tmp_path, monkeypatch, {"path": str(bare),
                                                        "chat_template": "tokenizer_default_fallback_chatml"})
    tokenizer = AutoTokenizer.from_pretrained(fallback.path)
    assert (tokenizer.chat_template, tokenizer.eos_token) == (CHATML, "<|im_end|>")
    kept = base_model_stage(tmp_path, monkeypatch, {"path": str(own.path),
                                                    "chat_template": "tokenizer_default_fallback_llama3"})
    assert AutoTokenizer.from_pretrained(kept.path).chat_template.startswith("{% for m in messages %}[")
    with pytest.raises(ValueError, match=r"model.chat_template: llama3 needs the tokens <\|start_header_id\|>, "
                                         r"<\|end_header_id\|>, <\|eot_id\|>, which the model's vocabulary"):
        base_model.run(BaseModelConfig(path=str(folder), chat_template="llama3"), [], tmp_path / "bad")


def test_chat_template_errors_name_the_key():
    """An unknown name lists the ones there are; jinja needs its text; a model built here (ChatML tokens) cannot
    take another family's template."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"model.chat_template: 'vicuna' is not a template posttrain has; "
                                              r"use one of tokenizer_default, chatml, qwen_25, llama3, gemma"):
        BaseModelConfig(path="org/model", chat_template="vicuna")
    with pytest.raises(ValidationError, match=r"model.chat_template_jinja is the template of chat_template: jinja"):
        BaseModelConfig(path="org/model", chat_template="jinja")
    with pytest.raises(ValidationError, match=r"model.chat_template: gemma needs the tokens <start_of_turn>, "
                                              r"<end_of_turn>; a model built here has"):
        BaseModelConfig(chat_template="gemma")
    with pytest.raises(ValidationError, match=r"model.chat_template_jinja: /no/such.jinja is not a file"):
        BaseModelConfig(path="org/model", chat_template_jinja="/no/such.jinja")
    assert BaseModelConfig(chat_template_jinja="{{ messages }}").chat_template == "jinja"
    assert BaseModelConfig(chat_template="tokenizer_default_fallback_gemma").chat_template  # built: has its own


def test_special_tokens_set_tokens_of_the_vocabulary(folder, tmp_path, monkeypatch):
    """axolotl's top-level special_tokens: the pad token becomes one the vocabulary has, the key follows it; a
    token the vocabulary lacks is refused naming it."""
    from transformers import AutoTokenizer

    from flows.config import PipelineConfig

    cfg = PipelineConfig.model_validate({"base_model": str(folder), "special_tokens": {"pad_token": "<|im_start|>"}})
    assert cfg.model.special_tokens == {"pad_token": "<|im_start|>"}
    pad = {"pad_token": "<|im_start|>"}
    artifact = base_model_stage(tmp_path, monkeypatch, {"path": str(folder), "special_tokens": pad})
    assert AutoTokenizer.from_pretrained(artifact.path).pad_token == "<|im_start|>"
    plain = base_model_stage(tmp_path, monkeypatch, {"path": str(folder)})
    assert plain.key != artifact.key
    with pytest.raises(ValueError, match=r"model.special_tokens.pad_token: '<pad-not-there>' is not a token"):
        base_model.run(BaseModelConfig(path=str(folder), special_tokens={"pad_token": "<pad-not-there>"}), [],
                       tmp_path / "bad")
