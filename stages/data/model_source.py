"""Where `model.path` points: a hub id, a local transformers folder, or a `.gguf` file.

`resolve` runs before the base_model key is computed. It finds the local files and what the key needs
to know about them: a hub id is resolved through huggingface_hub into the user's hub cache (online, or
from the cache when HF_HUB_OFFLINE is set or the hub cannot be reached) and keyed by the commit it
resolved to; a folder or a GGUF file is keyed by its bytes (the task digests `path`).
`load` reads the files as a transformers model and tokenizer; a GGUF's weights are dequantized to fp32
there, once, and the base_model stage saves them as an ordinary safetensors folder.

Every failure a person can fix raises ModelSourceError, whose message names the id or file and says
what to do. No Prefect, no MLflow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from stages.data import hub

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt", "tokenizer.tiktoken")
"""Any one of these in a folder is a tokenizer transformers can load."""

IGNORED_HUB_FILES = ["*.gguf", "*.onnx", "*.onnx_data", "onnx/*", "*.msgpack", "*.h5", "*.tflite", "*.ot",
                     "openvino/*", "coreml/*", "original/*", "consolidated*"]
"""Files of a hub repo that transformers' PyTorch loading never reads (other runtimes' formats, the
original checkpoint some repos ship beside the transformers one): not downloaded."""


class ModelSourceError(ValueError):
    """`model.path` names something that cannot be loaded; the message says what and what to do."""


@dataclass(frozen=True)
class ModelSource:
    """What `model.path` resolved to."""

    kind: Literal["hub", "folder", "gguf"]
    name: str
    """model.path as written."""
    path: Path
    """The local files: a folder (the user's, or the hub cache's snapshot of the commit) or a .gguf file."""
    commit: str | None = None
    """hub: the 40-hex commit the revision resolved to (a new commit, a new key)."""


def resolve(name: str, revision: str = "main", key: str = "model.path") -> ModelSource:
    """The local files behind `name` (a folder, a .gguf file, or a hub id at `revision`), downloading a
    hub id into the hub cache when it is not there yet; `key`: the config key the errors name."""
    local = Path(name).expanduser()
    if name.endswith(".gguf") or local.exists() or not hub.is_repo_id(name):
        if revision != "main":
            raise ModelSourceError(f"model.revision: {revision!r} applies to hub ids only; model.path {name!r} is a "
                                   "local path. Remove model.revision, or set model.path to a hub id.")
        if local.is_dir():
            return ModelSource("folder", name, local.resolve())
        if local.is_file() and local.suffix == ".gguf":
            return ModelSource("gguf", name, local.resolve())
        if local.is_file():
            raise ModelSourceError(f"{key} {name!r} is a file but not a .gguf file. Point it at a transformers "
                                   "model folder (config.json, weights, tokenizer), a .gguf file or a hub id.")
        raise ModelSourceError(f"{key} {name!r} does not exist ({local.absolute()}). Fix the path, or give a "
                               "hub id such as HuggingFaceTB/SmolLM2-135M-Instruct.")
    return _resolve_hub(name, revision, key)


def _resolve_hub(repo_id: str, revision: str, key: str = "model.path") -> ModelSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, IncompleteSnapshotError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    cache, offline = hub.cache_dir(), hub.offline()
    where = f"hub id {repo_id!r} at revision {revision!r}"
    instead = f"or point {key} at a local model folder" + (" or a .gguf file" if key == "model.path" else "")
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline,
                                        ignore_patterns=IGNORED_HUB_FILES))
    except RevisionNotFoundError as e:
        raise ModelSourceError(f"{where}: the hub has no such branch, tag or commit. Set model.revision to one that "
                               f"exists (https://huggingface.co/{repo_id}/tree/main lists them).") from e
    except GatedRepoError as e:
        raise ModelSourceError(f"{where}: the repository is gated. Accept its terms on "
                               f"https://huggingface.co/{repo_id} and log in (`hf auth login`), {instead}.") from e
    except RepositoryNotFoundError as e:
        raise ModelSourceError(f"{where}: no such model on the hub (or it is private: log in with `hf auth login`), "
                               f"and no local folder {Path(repo_id).absolute()} exists. "
                               f"Check the id, {instead}.") from e
    except IncompleteSnapshotError as e:
        raise ModelSourceError(f"{where}: the hub cache {cache} holds only part of it and the hub cannot be reached "
                               f"({e}). Download it again on a machine with a network: `hf download {repo_id} "
                               f"--revision {revision}`.") from e
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ModelSourceError(
            f"{where} is not in the hub cache {cache}, and {why}. Download it once on a machine with a network: "
            f"`hf download {repo_id} --revision {revision}` (older huggingface_hub: `huggingface-cli download "
            f"{repo_id} --revision {revision}`), then copy that cache here (or set HF_HUB_CACHE to it); {instead}. "
            f"(No local folder {Path(repo_id).absolute()} exists either.)") from e
    return ModelSource("hub", repo_id, folder, commit=folder.name)


def load(source: ModelSource):
    """(model, tokenizer) read from the source's files; a GGUF's weights dequantized to a plain fp32 model."""
    if source.kind == "gguf":
        return _load_gguf(source.path)
    return _load_folder(source)


def _load_folder(source: ModelSource):
    import transformers
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer

    folder, what = source.path, (f"hub model {source.name!r} ({source.path})" if source.kind == "hub"
                                 else f"model folder {source.path}")
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"{what} has no readable config.json ({e}); it is not a transformers model. Point "
                               "model.path at a folder saved with save_pretrained, a hub id of one, or a .gguf file "
                               "(a repo of GGUF files: `hf download REPO FILE.gguf`, then the file's path).") from e
    if model_type not in CONFIG_MAPPING:
        raise ModelSourceError(f"{what}: config.json has model_type {model_type!r}, an architecture transformers "
                               f"{transformers.__version__} does not know. Upgrade transformers if a newer release "
                               "has it, or use a model of a known architecture (models that need "
                               "trust_remote_code are not supported).")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelSourceError(f"{what} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}). Save the model's "
                               f"tokenizer into it (`tokenizer.save_pretrained('{folder}')`).")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # a library's message about its own internals: say which folder and what to do
        raise ModelSourceError(f"{what}: transformers cannot load its tokenizer ({type(e).__name__}: {e}). Save a "
                               "working tokenizer into the folder with `tokenizer.save_pretrained`.") from e
    return AutoModelForCausalLM.from_pretrained(folder), tokenizer


def _load_gguf(file: Path):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        quantized, info = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                               output_loading_info=True)
    except Exception as e:  # a bad file, an unknown architecture or quantization: the reader's own words
        raise ModelSourceError(
            f"GGUF file {file}: transformers {transformers.__version__} cannot read it ({type(e).__name__}: {e}). "
            "It needs a complete GGUF of an architecture transformers reads from GGUF (llama, mistral, qwen2, "
            "qwen3, phi3, gemma3, ...) with its tokenizer in the metadata, in a quantization the gguf package "
            "dequantizes. Use another quantization of the model, its transformers folder, or its hub id.") from e
    if info["missing_keys"]:
        raise ModelSourceError(f"GGUF file {file} lacks weights the {quantized.config.model_type} model needs "
                               f"({', '.join(sorted(info['missing_keys'])[:5])}, ...). Use a complete GGUF of the "
                               "model, its transformers folder, or its hub id.")
    # The loaded model holds dequantized tensors but refuses save_pretrained (its quantizer is GGUF's): the
    # same weights go into a plain model of its config, built on the meta device so they are held once.
    config = quantized.config
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict(), assign=True)  # strict: every saved tensor is a real one
    computed = dict(quantized.named_buffers(remove_duplicate=False))  # e.g. rotary inv_freq: not in a state dict
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if buffer.is_meta:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, computed[name])
    model.tie_weights()
    return model, tokenizer
