"""The base policy as a transformers folder: built offline (a BPE tokenizer trained locally, `build`: on a prompts
table's texts, and a randomly initialised Qwen2 model from a transformers config), or read from `model.path`: a
hub id, a local folder or a .gguf file (stages/data/model_source.py), which is saved again here as plain
safetensors + tokenizer, so a GGUF is dequantized once and every stage and vLLM loads an ordinary folder.

head_dim = hidden_size / num_attention_heads is kept >= 64 so vLLM can load a built model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.data import chat_templates, model_source
from stages.data.model_source import ModelSource
from stages.runtime.keys import key_when_set, not_in_key

CHAT_TEMPLATE = chat_templates.CHATML
"""The template of a model built here: ChatML, as Qwen2 uses."""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


BUILD_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "max_position_embeddings")
"""BaseModelConfig's fields that shape a model built here (none applies to a model read from `path`)."""
PATH_FIELDS = ("path", "special_tokens", "chat_template", "chat_template_jinja")
"""BaseModelConfig's fields that change what is saved of a model read from `path` (its key holds these)."""


class BaseModelConfig(BaseModel):
    """Where the base policy comes from: built from a config here, or `path` (a hub id, a folder, a .gguf)."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    """The model to start from instead of building one: a hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`,
    from the hub cache when HF_HUB_OFFLINE is set or the hub cannot be reached), a local transformers folder
    (config.json, weights, tokenizer) or a .gguf file (dequantized to fp32 once). Unset: build one here
    (the fields below)."""
    revision: str = not_in_key("main")
    """A hub id's branch, tag or commit. The key holds the commit it resolves to: a new commit on the branch,
    a new base model. Hub ids only."""
    vocab_size: int = Field(512, ge=64)
    """BPE vocabulary trained on the task text. Digits are always single tokens."""
    hidden_size: int = Field(256, ge=64)
    """Width of a model built here. Keep hidden_size / num_attention_heads >= 64: vLLM loads no smaller head."""
    num_hidden_layers: int = Field(4, ge=1)
    """Transformer blocks of a model built here. More: more capacity, slower rounds."""
    num_attention_heads: int = Field(4, ge=1)
    """Query heads of a model built here; must divide hidden_size."""
    num_key_value_heads: int = Field(2, ge=1)
    """Key/value heads of a model built here (grouped-query attention); must divide num_attention_heads."""
    intermediate_size: int = Field(512, ge=16)
    """Width of each MLP of a model built here."""
    max_position_embeddings: int = Field(256, ge=32)
    """Context length of a model built here, in tokens: prompt and completion must fit in it (longer prompts
    are refused or dropped by rollout and eval, `too_long_prompts`)."""
    seed: int = 0
    """Initialization of a model built here. Unused with `path` (set with the top-level `seed` there too)."""
    special_tokens: dict[Literal["pad_token", "eos_token", "bos_token", "unk_token"], str] | None = \
        key_when_set(None)
    """The tokenizer's pad/eos/bos/unk tokens, set to tokens its vocabulary already has (axolotl's top-level
    `special_tokens`, e.g. {pad_token: "<|end_of_text|>"}); the model's generation config follows eos and pad.
    A token not in the vocabulary is an error (adding one would need new embedding rows)."""
    chat_template: str | None = key_when_set(None)
    """How prompts are rendered (axolotl's `chat_template`): unset or `tokenizer_default` for the tokenizer's own,
    a built-in name (chatml, llama3, gemma, qwen_25), `tokenizer_default_fallback_<name>`, or `jinja`
    (stages/data/chat_templates.py). The template is saved with the base model's tokenizer."""
    chat_template_jinja: str | None = key_when_set(None)
    """The Jinja text of `chat_template: jinja`, or the path of a .jinja file (its text is what the key holds)."""

    @model_validator(mode="after")
    def _chat_template_known(self):
        """A known name; `jinja` with its text; on a model built here, a template whose tokens it has."""
        if self.chat_template_jinja is not None and self.chat_template is None:
            self.chat_template = "jinja"  # axolotl reads chat_template_jinja alone the same way
        if self.chat_template == chat_templates.TOKENIZER_DEFAULT:
            self.chat_template = None  # the same artifact as leaving it out
        if self.chat_template is None:
            return self
        chat_templates.check_name(self.chat_template, self.chat_template_jinja)
        if self.chat_template_jinja is not None:
            self.chat_template_jinja = chat_templates.jinja_text(self.chat_template_jinja)
        template = chat_templates.built_in(self.chat_template)
        fallback = self.chat_template.startswith(chat_templates.FALLBACK)  # a built model has its own template
        if template and not fallback and not self.path and not set(template.markers) <= set(SPECIAL_TOKENS):
            raise ValueError(f"model.chat_template: {self.chat_template} needs the tokens "
                             f"{', '.join(template.markers)}; a model built here has {', '.join(SPECIAL_TOKENS)} "
                             "(ChatML): use chatml, or give model.path")
        return self

    @model_validator(mode="after")
    def _build_fields_need_no_path(self):
        """A model read from `path` keeps its own architecture: the build fields would be silently ignored."""
        fields = type(self).model_fields  # a saved config lists every field: only a value of one's own counts
        ignored = sorted(f for f in BUILD_FIELDS if getattr(self, f) != fields[f].default) if self.path else []
        if ignored:
            raise ValueError(f"model.{ignored[0]} shapes a model built here, but model.path {self.path!r} is read as "
                             f"it is, with its own architecture; remove {', '.join('model.' + f for f in ignored)}")
        return self

    @model_validator(mode="after")
    def _head_dim_fits_vllm(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.hidden_size // self.num_attention_heads < 64:
            raise ValueError(
                f"head_dim = hidden_size / num_attention_heads = "
                f"{self.hidden_size // self.num_attention_heads}; vLLM needs >= 64"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        return self


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer with single-digit tokens and the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def run(cfg: BaseModelConfig, texts: list[str], out_dir: Path, source: ModelSource | None = None) -> dict:
    """Save the model and tokenizer to out_dir: read from cfg.path (`source`: it resolved already), or a
    tokenizer trained on `texts` and a model built from cfg."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if cfg.path:
        model, tokenizer = model_source.load(source or model_source.resolve(cfg.path, cfg.revision))
    else:
        # chat-formatted text so the template's markers get merged like the real data
        tokenizer = train_tokenizer(texts, cfg.vocab_size)
        torch.manual_seed(cfg.seed)
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads,
            intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model = AutoModelForCausalLM.from_config(config)
    if cfg.chat_template:
        chat_templates.apply(tokenizer, cfg.chat_template, cfg.chat_template_jinja)
    for name, token in (cfg.special_tokens or {}).items():
        if token not in tokenizer.get_vocab():
            raise ValueError(f"model.special_tokens.{name}: {token!r} is not a token of the model's vocabulary "
                             f"({len(tokenizer)} tokens); name one it has (adding tokens is not supported)")
        setattr(tokenizer, name, token)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {"num_parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer)}


def prompt_texts(prompts_path: Path, completion_field: str) -> list[str]:
    """The texts of a prompts table a tokenizer is trained on: a chat row in ChatML with its completion
    (`completion_field`, else `answer`), a raw document (a row without a prompt) as it is."""
    import pyarrow.parquet as pq

    return [
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in row["prompt"])
        + f"<|im_start|>assistant\n{row.get(completion_field) or row['answer']}<|im_end|>\n"
        if row["prompt"] else str(row.get(completion_field) or row.get("text") or "")
        for row in pq.read_table(prompts_path).to_pylist()
    ]


def build(cfg: BaseModelConfig, prompts_path: Path, completion_field: str, out_dir: Path) -> dict:
    """`run` for a model built here (no cfg.path): its tokenizer trained on the prompts table's texts
    (`prompt_texts`)."""
    return run(cfg, prompt_texts(prompts_path, completion_field), out_dir)
