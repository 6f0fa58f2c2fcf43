"""Chat templates by name, as axolotl's `chat_template` names them: the tokenizer's own, one built in here, or
your own Jinja text.

`model.chat_template` picks the template the base_model stage saves with the tokenizer, so every stage after it
(transform, rollout, eval, the DPO family, reward models, export) renders prompts the same way:

- `tokenizer_default` (the default): the tokenizer's own template, unchanged.
- a built-in name (`BUILT_IN`: chatml, llama3, gemma, qwen_25): that template. Its turn markers must already be
  single tokens of the model's vocabulary (no tokens are added: that would need new embedding rows), and the
  token that ends a turn becomes the tokenizer's eos token, as TRL's `clone_chat_template` does, so generation
  stops at the end of the answer (`model.special_tokens.eos_token` still wins).
- `tokenizer_default_fallback_<name>`: the tokenizer's own template when it has one, else the built-in `<name>`.
- `jinja`: the Jinja text of `model.chat_template_jinja` (or the .jinja file it names), as written; eos unchanged.

Assistant turns of the built-in templates are wrapped in `{% generation %}` marks so TRL can compute
assistant-only masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChatTemplate:
    """A built-in template, the tokens it needs in the vocabulary and the one that ends a turn."""

    jinja: str
    markers: tuple[str, ...]
    end_of_turn: str


CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML (Qwen2, SmolLM2, Hermes): `<|im_start|>role\\ncontent<|im_end|>\\n` per message."""

QWEN_25 = (
    "{% if messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "{% endif %}" + CHATML
)
"""Qwen2.5's: ChatML with Qwen's default system message when the conversation has none."""

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}<|eot_id|>"
    "{% endgeneration %}{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""Llama 3 Instruct's: a header per message, `<|eot_id|>` after each."""

GEMMA = (
    "{{ bos_token }}{% set system = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{% if message['role'] == 'assistant' %}<start_of_turn>model\n{% generation %}{{ message['content'] | trim }}"
    "<end_of_turn>{% endgeneration %}\n"
    "{% else %}<start_of_turn>{{ message['role'] }}\n{{ (system if loop.first else '') + message['content'] | trim }}"
    "<end_of_turn>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
"""Gemma's: `model` for the assistant's role, a system message folded into the first user turn."""

BUILT_IN = {
    "chatml": ChatTemplate(CHATML, ("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
    "qwen_25": ChatTemplate(QWEN_25, ("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
    "llama3": ChatTemplate(LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>"),
    "gemma": ChatTemplate(GEMMA, ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>"),
}
TOKENIZER_DEFAULT = "tokenizer_default"
FALLBACK = "tokenizer_default_fallback_"
NAMES = (TOKENIZER_DEFAULT, *BUILT_IN, *(FALLBACK + name for name in BUILT_IN), "jinja")
"""Every value `model.chat_template` takes."""


def check_name(name: str, jinja: str | None) -> None:
    """Raise ValueError naming model.chat_template / model.chat_template_jinja when they do not fit together."""
    if name not in NAMES:
        raise ValueError(f"model.chat_template: {name!r} is not a template posttrain has; use one of "
                         f"{', '.join(NAMES)} (`jinja` with model.chat_template_jinja for any other)")
    if (name == "jinja") != (jinja is not None):
        raise ValueError("model.chat_template_jinja is the template of chat_template: jinja; give both or neither")


def built_in(name: str) -> ChatTemplate | None:
    """The built-in template `name` (or the fallback of `tokenizer_default_fallback_<name>`) picks; else None."""
    return BUILT_IN.get(name.removeprefix(FALLBACK))


def jinja_text(value: str) -> str:
    """`model.chat_template_jinja`: the template itself, or the path of a .jinja file that holds it."""
    if value.endswith(".jinja") and "\n" not in value:
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"model.chat_template_jinja: {value} is not a file")
        return path.read_text()
    return value


def apply(tokenizer, name: str, jinja: str | None) -> None:
    """Set the tokenizer's chat template (and eos, for a built-in one) as `name` says; see the module docstring."""
    if name == TOKENIZER_DEFAULT or (name.startswith(FALLBACK) and tokenizer.chat_template):
        return
    if name == "jinja":
        tokenizer.chat_template = jinja_text(jinja)
        return
    template = built_in(name)
    vocabulary = tokenizer.get_vocab()
    missing = [token for token in template.markers if token not in vocabulary]
    if missing:
        raise ValueError(f"model.chat_template: {name} needs the tokens {', '.join(missing)}, which the model's "
                         f"vocabulary ({len(tokenizer)} tokens) lacks; pick a template of this model's family, or "
                         "tokenizer_default (adding tokens is not supported)")
    tokenizer.chat_template = template.jinja
    tokenizer.eos_token = template.end_of_turn
