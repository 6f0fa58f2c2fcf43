"""preferences: raw preference rows -> preferences table (DPO/IPO/ORPO pairs, KTO, reward models, PRMs).

One Parquet schema, `PREFERENCES`, for every kind of row, told apart by `kind`:

- `pair` (DPO, IPO, ORPO, Bradley-Terry reward models): `prompt`, `chosen`, `rejected`;
- `unpaired` (KTO): `prompt`, `completion`, `label`;
- `stepwise` (process reward models): `prompt`, `completions` (one string per step), `labels`.

Columns a kind does not use are null. One schema rather than one per kind: a trainer
reads a single table type, a user transform may mix kinds, and every row keeps its
`pair_id` (`<split>-<raw row index>`, with several `datasets` sources `<split>-<source>-<index>`;
stable when other rows are dropped). Prompts and
turns are chat messages ({role, content}); a plain string prompt becomes a user message,
a plain string answer an assistant message. Rows carry no template text: the trainer
applies the model's chat template, so axolotl's `chatml.*`/`llama3.*` prefixes, which only
pick axolotl's rendering, read the same fields and give the same rows here.

The rows come from `paths` (a local file per split) or `datasets`/`test_datasets` (axolotl's list:
hub ids, files, folders, split slices, read by stages/data/sources.py; train and eval).

`type` names a built-in (fields as axolotl's dpo/orpo/kto prompt strategies read them; see `BUILTINS`,
and `KTO_BUILTINS` under rl: kto, where axolotl resolves the same names to unpaired rows) or a user
function `module.fn` in axolotl's convention: `fn(cfg)` returns
`transform_fn` or `(transform_fn, {...})`, and `transform_fn(row)` returns a dict with
`prompt` and `chosen`/`rejected` (or `completion`/`label`, or `completions`/`labels`),
each a string or a list of messages.

Rows with a missing field, a wrong type, an empty turn, chosen == rejected, or step labels
not matching the steps are bad: `on_bad_rows: fail` raises `BadRowsError` naming split,
row index, field and reason; `drop` leaves them out and `run()` reports them per split.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Callable, Literal

import pyarrow as pa
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from stages.data import sources
from stages.data.schemas import PREFERENCES, write_table
from stages.data.sources import SUFFIXES, BadRowError, SourceLocation, read_rows
from stages.runtime.imports import example_caller, load_function
from stages.runtime.keys import key_when_set

ROLES = ("system", "user", "assistant", "tool")
MAX_LISTED = 5  # bad rows named in a BadRowsError message
MAX_DROPPED_INDICES = 20  # dropped row indices kept per split in the summary


class PreferenceSource(SourceLocation):
    """One entry of `preferences.datasets` / `test_datasets`, as axolotl writes it under rl: dpo, kto, orpo..."""

    type: str | dict | None = None
    """This source's format (a built-in name, `module.fn`, or a user_defined mapping); unset: preferences.type."""
    ds_type: Literal["json", "jsonl", "parquet", "csv"] | None = None
    """axolotl's file type; when set, the source's local files must have that suffix (json covers .jsonl)."""


class PreferenceConfig(BaseModel):
    """How raw preference rows become the preferences table."""

    model_config = ConfigDict(extra="forbid")

    type: str | dict | None = None
    """A built-in of `namespace` (see `BUILTINS`, `KTO_BUILTINS`) or a user function `module.fn` (axolotl
    convention). Given as a mapping of user_defined keys (axolotl's `type: {field_prompt: ..., ...}`), it is
    `user_defined.default` with those keys set. Required unless every `datasets` entry names its own."""
    namespace: Literal["pairs", "kto"] | None = key_when_set(None)
    """Where a built-in `type` is looked up, as axolotl resolves it under the RL method: pairs (unset; dpo,
    ipo, orpo, simpo, reward models: prompt/chosen/rejected) or kto (`KTO_BUILTINS`: unpaired
    prompt/completion/label rows; a pairs-only name there gives pairs, which rl: kto splits into a
    desirable and an undesirable row). Follows `rl` (rl: kto -> kto)."""
    paths: dict[str, str] = Field(default_factory=dict, validation_alias=AliasChoices("paths", "data_files"))
    """Local files per split, e.g. {train: prefs/train.jsonl, eval: prefs/eval.jsonl}
    (jsonl, json, parquet, csv). Alias: `data_files`; a single path means {train: path}. Or `datasets`."""
    datasets: list[PreferenceSource] | None = key_when_set(None)
    """axolotl's `datasets:` list (what an axolotl DPO/KTO/ORPO config's top-level `datasets` becomes): hub
    ids, local files or folders, each with its own `split` (slices too) and `type`; their rows together make
    the split train. Instead of `paths`."""
    test_datasets: list[PreferenceSource] | None = key_when_set(None)
    """With `datasets`: the sources of the split eval (axolotl's `test_datasets`)."""
    val_set_size: float | None = key_when_set(None, ge=0)
    """With `datasets` and no test_datasets: hold out rows of the datasets as the eval split (axolotl's
    `val_set_size`): a fraction in (0, 1) of their rows (rounded up), or a row count. 0 or unset: none."""
    val_set_seed: int | None = key_when_set(None)
    """Seed of the val_set_size draw (random.Random(seed).sample over all rows); unset: 0."""
    ds_type: Literal["json", "jsonl", "parquet", "csv"] | None = None
    """axolotl's file type; when set, every file's suffix must match it (json covers .jsonl)."""
    on_bad_rows: Literal["fail", "drop"] = "fail"
    """fail: raise, naming the first bad rows; drop: leave them out and count them."""
    system_prompt: str | None = None
    """Prepended to every prompt as a system message when set."""

    # chat_template.default / chat_template.argilla_chat / bradley_terry.chat_template (list form)
    field_messages: str = "messages"
    """chat_template.default: the column holding the prompt conversation (or a string)."""
    field_chosen: str = "chosen"
    """chat_template.*, user_defined.default: the column holding the chosen answer."""
    field_rejected: str = "rejected"
    """chat_template.*, user_defined.default: the column holding the rejected answer."""
    message_property_mappings: dict[str, str] = {"role": "role", "content": "content"}
    """chat_template.*: which keys of a raw message hold its role and content."""
    roles: dict[str, list[str]] | None = None
    """chat_template.*: {role: [raw role names]}, e.g. {user: [human], assistant: [gpt]}.
    Unset: the roles system/user/assistant/tool as they are."""

    # user_defined.default / kto
    field_prompt: str = "prompt"
    """user_defined.default, kto: the column holding the prompt."""
    field_system: str = "system"
    """user_defined.default, kto: the column holding an optional system prompt."""
    field_completion: str = "completion"
    """kto: the column holding the completion."""
    field_label: str = "label"
    """kto: the column holding the desirable (true) / undesirable (false) label."""
    prompt_format: str = "{prompt}"
    """user_defined.default: the user turn, formatted with {prompt} and {system}. When it
    does not use {system}, a non-empty system field becomes a system message instead."""
    completion_format: str | None = key_when_set(None)
    """user_defined.default under kto: the completion, formatted with {completion}, {prompt}, {system};
    unset: "{completion}"."""
    chosen_format: str = "{chosen}"
    """user_defined.default: the chosen turn, formatted with {chosen}, {prompt}, {system}."""
    rejected_format: str = "{rejected}"
    """user_defined.default: the rejected turn, formatted with {rejected}, {prompt}, {system}."""

    @field_validator("paths", mode="before")
    @classmethod
    def _one_path_is_train(cls, value: Any) -> Any:
        return {"train": value} if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _type_as_mapping(cls, data: Any) -> Any:
        """axolotl's `type: {field_prompt: ..., prompt_format: ...}`: user_defined.default with those keys."""
        if not isinstance(data, dict) or not isinstance(data.get("type"), dict):
            return data
        data, keys = dict(data), dict(data["type"])
        unknown = sorted(set(keys) - set(USER_DEFINED_KEYS))
        if unknown:
            raise ValueError(f"type: {', '.join(unknown)} is not a user_defined key (a mapping `type` is "
                             f"user_defined.default; its keys: {', '.join(USER_DEFINED_KEYS)})")
        for key, value in keys.items():
            if key in data and data[key] != value:
                raise ValueError(f"type.{key} and {key} are the same setting; set one of them")
            data[key] = value
        data["type"] = "user_defined.default"
        return data

    @field_validator("message_property_mappings")
    @classmethod
    def _role_and_content(cls, value: dict[str, str]) -> dict[str, str]:
        if set(value) != {"role", "content"}:
            raise ValueError(f"needs exactly the keys role and content, got {sorted(value)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> "PreferenceConfig":
        if bool(self.paths) == bool(self.datasets):
            raise ValueError("name the rows with paths ({train: prefs.jsonl, ...}) or datasets (a list of sources), "
                             f"one of the two{' (both are set)' if self.paths else ''}")
        if self.test_datasets and not self.datasets:
            raise ValueError("test_datasets needs datasets (the train split's sources)")
        if self.val_set_size and (self.test_datasets or not self.datasets):
            raise ValueError("val_set_size holds out rows of datasets as the eval split: it needs datasets, and "
                             "test_datasets (which make the eval split themselves) unset")
        untyped = [f"{name}.{i}" for name in ("datasets", "test_datasets")
                   for i, source in enumerate(getattr(self, name) or []) if source.type is None]
        if self.type is None and (self.paths or untyped):
            raise ValueError("type: set the rows' format (e.g. chatml.intel, chat_template.default, or module.fn)"
                             + (f"; {', '.join(untyped)} name no type of their own" if untyped else ""))
        for name in ("prompt_format", "chosen_format", "rejected_format", "completion_format"):
            template = getattr(self, name)
            if template is None:
                continue
            try:
                template.format(prompt="", system="", chosen="", rejected="", completion="")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"{name} {template!r}: use only {{prompt}}, {{system}}, {{chosen}}, "
                                 f"{{rejected}}, {{completion}} ({type(e).__name__}: {e})") from None
        unread = [n for n, read_in in (("completion_format", "kto"), ("chosen_format", "pairs"),
                                       ("rejected_format", "pairs"))
                  if getattr(self, n) != type(self).model_fields[n].default and read_in != (self.namespace or "pairs")]
        if unread:
            raise ValueError(f"{', '.join(unread)}: not read for {self.namespace or 'pairs'} rows")
        return self


class BadRowsError(BadRowError):
    """Bad preference rows under `on_bad_rows: fail`; `bad` holds every (split, index, field, reason)."""

    def __init__(self, bad: list[tuple[str, int, str, str]]):
        self.bad = bad
        listed = "\n".join(f"  {split} row {index}, field {field!r}: {reason}"
                           for split, index, field, reason in bad[:MAX_LISTED])
        more = f"\n  ... and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
        super().__init__(f"preferences: {len(bad)} bad row(s) (set on_bad_rows: drop to leave them out):\n"
                         f"{listed}{more}")


class _Bad(Exception):
    """One bad field of one row."""

    def __init__(self, field: str, reason: str):
        super().__init__(field, reason)
        self.field, self.reason = field, reason


# ---------- reading raw values ----------


def _present(row: dict, field: str) -> Any:
    value = row.get(field)
    if value is None:
        raise _Bad(field, "missing")
    return value


def _text(row: dict, field: str) -> str:
    value = _present(row, field)
    if not isinstance(value, str):
        raise _Bad(field, f"expected a string, got {type(value).__name__}")
    if not value.strip():
        raise _Bad(field, "empty")
    return value


def _string_prompt(row: dict, field: str) -> list[dict]:
    """The row's optional `system` string, then its `field` string as the user's turn."""
    return _optional_system(row) + [{"role": "user", "content": _text(row, field)}]


def _optional_system(row: dict, field: str = "system") -> list[dict]:
    value = row.get(field)
    if value is None or (isinstance(value, str) and not value.strip()):
        return []
    if not isinstance(value, str):
        raise _Bad(field, f"expected a string, got {type(value).__name__}")
    return [{"role": "system", "content": value}]


def _role_map(cfg: PreferenceConfig) -> dict[str, str]:
    if cfg.roles is None:
        return {role: role for role in ROLES}
    return {source: target for target, sources in cfg.roles.items() for source in sources}


def _raw_message(value: Any, field: str, cfg: PreferenceConfig, role_map: dict[str, str], i: int = 0) -> dict:
    """A raw message dict -> {role, content}, through message_property_mappings and roles."""
    role_key, content_key = cfg.message_property_mappings["role"], cfg.message_property_mappings["content"]
    if not isinstance(value, dict):
        raise _Bad(field, f"message {i}: expected {{{role_key}, {content_key}}}, got {type(value).__name__}")
    if value.get(role_key) is None or value.get(content_key) is None:
        raise _Bad(field, f"message {i} has no {role_key!r} or {content_key!r} (has {sorted(value)})")
    if value[role_key] not in role_map:
        raise _Bad(field, f"message {i} has role {value[role_key]!r}, not one of roles {sorted(role_map)}")
    role, content = role_map[value[role_key]], value[content_key]
    if not isinstance(content, str):
        raise _Bad(field, f"message {i} has {type(content).__name__} content, expected a string")
    if not content.strip():
        raise _Bad(field, f"message {i} ({role}) has empty content")
    return {"role": role, "content": content}


def _raw_messages(value: Any, field: str, cfg: PreferenceConfig, role_map: dict[str, str]) -> list[dict]:
    if not isinstance(value, list):
        raise _Bad(field, f"expected a list of messages, got {type(value).__name__}")
    if not value:
        raise _Bad(field, "empty list of messages")
    return [_raw_message(m, field, cfg, role_map, i) for i, m in enumerate(value)]


# ---------- built-in transforms (axolotl field names) ----------


def _strings_pair(prompt_field: str, chosen_field: str, rejected_field: str):
    """{system?, <prompt_field>, <chosen_field>, <rejected_field>}, all strings."""

    def builder(cfg: PreferenceConfig):
        def transform_fn(row: dict) -> dict:
            return {"prompt": _string_prompt(row, prompt_field),
                    "chosen": _text(row, chosen_field), "rejected": _text(row, rejected_field)}

        return transform_fn, {"fields": {"prompt": prompt_field, "chosen": chosen_field, "rejected": rejected_field}}

    return builder


def _split_conversations(row: dict, cfg: PreferenceConfig) -> dict:
    """chosen/rejected full conversations -> shared prompt + last (assistant) turns."""
    role_map = _role_map(cfg)
    chosen = _raw_messages(_present(row, cfg.field_chosen), cfg.field_chosen, cfg, role_map)
    rejected = _raw_messages(_present(row, cfg.field_rejected), cfg.field_rejected, cfg, role_map)
    if len(chosen) < 2:
        raise _Bad(cfg.field_chosen, "needs the prompt turn(s) before the answer")
    if chosen[:-1] != rejected[:-1]:
        raise _Bad(cfg.field_rejected, f"conversation before the last turn differs from {cfg.field_chosen!r}'s")
    return {"prompt": chosen[:-1], "chosen": chosen[-1:], "rejected": rejected[-1:]}


def _argilla_chat(cfg: PreferenceConfig):
    """{chosen: [..., answer], rejected: [..., answer]}; the prompt is their shared prefix."""

    def transform_fn(row: dict) -> dict:
        return _split_conversations(row, cfg)

    return transform_fn, {"fields": {"prompt": cfg.field_chosen, "chosen": cfg.field_chosen,
                                     "rejected": cfg.field_rejected}}


def _answer(value: Any, field: str, cfg: PreferenceConfig, role_map: dict[str, str]) -> list[dict]:
    """chat_template.default's chosen/rejected: a string, a message, or messages (the last is the answer)."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        return [_raw_message(value, field, cfg, role_map)]
    return _raw_messages(value, field, cfg, role_map)[-1:]


def _chat_template_default(cfg: PreferenceConfig):
    """{messages: prompt conversation (or a string), chosen, rejected} with configurable fields and roles."""
    role_map = _role_map(cfg)

    def transform_fn(row: dict) -> dict:
        messages = _present(row, cfg.field_messages)
        if isinstance(messages, str):
            prompt = [{"role": "user", "content": messages}]
        else:
            prompt = _raw_messages(messages, cfg.field_messages, cfg, role_map)
        return {"prompt": prompt,
                "chosen": _answer(_present(row, cfg.field_chosen), cfg.field_chosen, cfg, role_map),
                "rejected": _answer(_present(row, cfg.field_rejected), cfg.field_rejected, cfg, role_map)}

    return transform_fn, {"fields": {"prompt": cfg.field_messages, "chosen": cfg.field_chosen,
                                     "rejected": cfg.field_rejected}}


def _user_defined_prompt(row: dict, cfg: PreferenceConfig, answers: tuple[str, ...]) -> tuple[list[dict], dict]:
    """user_defined.default's prompt (prompt_format, with the system field as a system message unless the
    format uses {system}) and the values the answer formats read: prompt, system and each answer field."""
    values = {"prompt": _text(row, cfg.field_prompt), "system": ""}
    system = _optional_system(row, cfg.field_system)
    if system:
        values["system"] = system[0]["content"]
    for answer in answers:
        values[answer] = _text(row, getattr(cfg, f"field_{answer}"))
    user = cfg.prompt_format.format(**values)
    return ([] if "{system}" in cfg.prompt_format else system) + [{"role": "user", "content": user}], values


def _user_defined(cfg: PreferenceConfig):
    """axolotl's user_defined.default: configurable fields and format strings."""

    def transform_fn(row: dict) -> dict:
        prompt, values = _user_defined_prompt(row, cfg, ("chosen", "rejected"))
        return {"prompt": prompt,
                "chosen": cfg.chosen_format.format(**values),
                "rejected": cfg.rejected_format.format(**values)}

    return transform_fn, {"fields": {"prompt": cfg.field_prompt, "chosen": cfg.field_chosen,
                                     "rejected": cfg.field_rejected}}


def _kto(cfg: PreferenceConfig):
    """Unpaired KTO rows {system?, prompt, completion, label}; prompt/completion may be strings or messages."""

    def transform_fn(row: dict) -> dict:
        prompt = _present(row, cfg.field_prompt)
        system = _optional_system(row, cfg.field_system)
        if isinstance(prompt, str):
            prompt = system + [{"role": "user", "content": prompt}]
        elif system and isinstance(prompt, list):
            prompt = system + prompt
        return {"prompt": prompt, "completion": _present(row, cfg.field_completion),
                "label": _present(row, cfg.field_label)}

    return transform_fn, {"fields": {"prompt": cfg.field_prompt, "completion": cfg.field_completion,
                                     "label": cfg.field_label}}


def _bradley_terry(cfg: PreferenceConfig):
    """Reward-model pairs: axolotl's documented {system?, input, chosen, rejected} strings,
    or chosen/rejected full conversations as in chat_template.argilla_chat."""
    strings, _ = _strings_pair("input", "chosen", "rejected")(cfg)

    def transform_fn(row: dict) -> dict:
        if isinstance(row.get(cfg.field_chosen), list):
            return _split_conversations(row, cfg)
        return strings(row)

    return transform_fn, {"fields": {"prompt": "input", "chosen": cfg.field_chosen, "rejected": cfg.field_rejected}}


def _stepwise(cfg: PreferenceConfig):
    """PRM rows {prompt, completions: [step, ...], labels: [bool, ...]}."""

    def transform_fn(row: dict) -> dict:
        return {"prompt": _present(row, "prompt"), "completions": _present(row, "completions"),
                "labels": _present(row, "labels")}

    return transform_fn, {"fields": {"prompt": "prompt", "completions": "completions", "labels": "labels"}}


def _last_answer(row: dict, field: str, cfg: PreferenceConfig) -> list[dict]:
    """A conversation whose last turn is the answer ({role: assistant}); that turn."""
    turns = _raw_messages(_present(row, field), field, cfg, _role_map(cfg))
    if turns[-1]["role"] != "assistant":
        raise _Bad(field, f"last message has role {turns[-1]['role']!r}, expected 'assistant'")
    return turns[-1:]


def _ultra(cfg: PreferenceConfig):
    """UltraFeedback binarized: {system?, prompt, chosen: [user, assistant], rejected: [user, assistant]};
    the answers are the conversations' assistant turns (axolotl: dpo chatml/llama3.ultra, orpo
    chat_template.argilla)."""

    def transform_fn(row: dict) -> dict:
        return {"prompt": _string_prompt(row, "prompt"),
                "chosen": _last_answer(row, cfg.field_chosen, cfg),
                "rejected": _last_answer(row, cfg.field_rejected, cfg)}

    return transform_fn, {"fields": {"prompt": "prompt", "chosen": cfg.field_chosen, "rejected": cfg.field_rejected}}


def _nectar(cfg: PreferenceConfig):
    """Nectar: {prompt, answers: [{answer, rank}, ...]}; chosen is the best-ranked answer, rejected the
    next. Rank 1 is the best, as the Nectar dataset defines it (axolotl's zephyr.nectar takes the largest
    rank as chosen instead: reverse the ranks to get its pairs)."""

    def transform_fn(row: dict) -> dict:
        answers = _present(row, "answers")
        if not isinstance(answers, list) or len(answers) < 2:
            raise _Bad("answers", "expected a list of at least 2 {answer, rank}")
        for i, a in enumerate(answers):
            if not isinstance(a, dict) or not isinstance(a.get("answer"), str) or \
                    not isinstance(a.get("rank"), (int, float)) or isinstance(a.get("rank"), bool):
                raise _Bad("answers", f"answer {i} is not {{answer: str, rank: number}}")
        best, second = sorted(answers, key=lambda a: a["rank"])[:2]
        if best["rank"] == second["rank"]:
            raise _Bad("answers", f"the two best answers share rank {best['rank']}: no preference between them")
        return {"prompt": _text(row, "prompt"), "chosen": best["answer"], "rejected": second["answer"]}

    return transform_fn, {"fields": {"prompt": "prompt", "chosen": "answers", "rejected": "answers"}}


def _chatml_default(cfg: PreferenceConfig):
    """axolotl's dpo chatml.default (`type: chatml`): {system?, prompt | input | question | instruction,
    chosen | chosen_response, rejected | rejected_response}, the first of each present."""

    def first(row: dict, names: tuple[str, ...]) -> str:
        return next((n for n in names if row.get(n) is not None), names[0])

    def transform_fn(row: dict) -> dict:
        prompt = first(row, ("prompt", "input", "question", "instruction"))
        chosen, rejected = first(row, ("chosen", "chosen_response")), first(row, ("rejected", "rejected_response"))
        return {"prompt": _string_prompt(row, prompt),
                "chosen": _text(row, chosen), "rejected": _text(row, rejected)}

    return transform_fn, {"fields": {}}


_intel = _strings_pair("question", "chosen", "rejected")
_prompt_pairs = _strings_pair("prompt", "chosen", "rejected")
_argilla = _strings_pair("instruction", "chosen_response", "rejected_response")
_icr = _strings_pair("input", "chosen", "rejected")

BUILTINS: dict[str, Callable] = {
    "chatml.intel": _intel,  # {system?, question, chosen, rejected}
    "chatml.prompt_pairs": _prompt_pairs,  # {system?, prompt, chosen, rejected}
    "chatml.argilla": _argilla,  # {system?, instruction, chosen_response, rejected_response}
    "chatml.icr": _icr,  # {system?, input, chosen, rejected}
    "chatml.default": _chatml_default,  # {system?, prompt|input|question|instruction, chosen(_response), ...}
    "chatml": _chatml_default,  # axolotl's `type: chatml` is chatml.default
    "chatml.ultra": _ultra,  # {system?, prompt, chosen: [user, assistant], rejected: [user, assistant]}
    "chat_template.argilla": _ultra,  # ORPO's name for the same rows
    "zephyr.nectar": _nectar,  # {prompt, answers: [{answer, rank}]}
    "chat_template.argilla_chat": _argilla_chat,  # {chosen: [msgs], rejected: [msgs]}
    "chat_template.default": _chat_template_default,  # {messages, chosen, rejected} + field/role mappings
    "user_defined.default": _user_defined,  # field_* + *_format
    "kto": _kto,  # {system?, prompt, completion, label}
    "bradley_terry.chat_template": _bradley_terry,  # {system?, input, chosen, rejected}
    "stepwise_supervised": _stepwise,  # {prompt, completions, labels}
    # Same fields as above; in axolotl the prefix only picks the rendering template.
    "llama3.intel": _intel,
    "llama3.prompt_pairs": _prompt_pairs,
    "llama3.argilla": _argilla,
    "llama3.icr": _icr,
    "llama3.default": _chatml_default,
    "llama3": _chatml_default,
    "llama3.ultra": _ultra,
    "chatml.argilla_chat": _argilla_chat,
    "llama3.argilla_chat": _argilla_chat,
}
"""The pairs namespace (rl dpo, ipo, orpo, simpo; reward models): axolotl's dpo/orpo type names."""


# ---------- KTO's namespace: unpaired rows {prompt, completion, label} ----------


def _kto_strings(prompt_field: str):
    """{system?, <prompt_field>, completion, label}, prompt and completion strings."""

    def builder(cfg: PreferenceConfig):
        def transform_fn(row: dict) -> dict:
            return {"prompt": _string_prompt(row, prompt_field),
                    "completion": _text(row, "completion"), "label": _present(row, "label")}

        return transform_fn, {"fields": {"prompt": prompt_field, "completion": "completion", "label": "label"}}

    return builder


def _kto_conversation(cfg: PreferenceConfig):
    """{completion: [turn, ..., assistant answer], label} (argilla/kto-mix-15k): the prompt is every turn
    before the last; or, as axolotl's docs show chatml.argilla_chat, {chosen: [prompt turns], completion:
    [answer], label}."""

    def transform_fn(row: dict) -> dict:
        turns = _raw_messages(_present(row, "completion"), "completion", cfg, _role_map(cfg))
        if len(turns) == 1 and isinstance(row.get("chosen"), list):
            turns = _raw_messages(row["chosen"], "chosen", cfg, _role_map(cfg)) + turns
        if len(turns) < 2:
            raise _Bad("completion", "needs the prompt turn(s) before the answer")
        if turns[-1]["role"] != "assistant":
            raise _Bad("completion", f"last message has role {turns[-1]['role']!r}, expected 'assistant'")
        return {"prompt": turns[:-1], "completion": turns[-1:], "label": _present(row, "label")}

    return transform_fn, {"fields": {"prompt": "completion", "completion": "completion", "label": "label"}}


def _kto_user_defined(cfg: PreferenceConfig):
    """axolotl's kto user_defined.default: field_prompt/system/completion/label, prompt_format and
    completion_format."""

    def transform_fn(row: dict) -> dict:
        prompt, values = _user_defined_prompt(row, cfg, ("completion",))
        return {"prompt": prompt, "completion": (cfg.completion_format or "{completion}").format(**values),
                "label": _present(row, cfg.field_label)}

    return transform_fn, {"fields": {"prompt": cfg.field_prompt, "completion": cfg.field_completion,
                                     "label": cfg.field_label}}


KTO_BUILTINS: dict[str, Callable] = {
    "kto": _kto,  # {system?, prompt, completion, label}, prompt/completion strings or messages
    "chatml.argilla": _kto_strings("instruction"),  # {system?, instruction, completion, label}
    "chatml.intel": _kto_strings("question"),  # {system?, question, completion, label}
    "chatml.prompt_pairs": _kto_strings("prompt"),  # {system?, prompt, completion, label}
    "chatml.ultra": _kto_strings("prompt"),  # {system?, prompt, completion, label}
    "chatml.argilla_chat": _kto_conversation,  # {completion: [msgs..., answer], label}
    "user_defined.default": _kto_user_defined,  # field_prompt/system/completion/label + formats
}
"""The kto namespace (rl: kto): axolotl's kto type names; the chatml./llama3. prefix only picks axolotl's
rendering, so both read the same fields."""
KTO_BUILTINS.update({"llama3." + name.split(".", 1)[1]: fn for name, fn in list(KTO_BUILTINS.items())
                     if name.startswith("chatml.")})

USER_DEFINED_KEYS = ("field_prompt", "field_system", "field_chosen", "field_rejected", "field_completion",
                     "field_label", "prompt_format", "chosen_format", "rejected_format", "completion_format")
"""The keys a mapping `type` (user_defined.default) may hold."""


def builtins(namespace: str) -> dict[str, Callable]:
    """The built-in types of a namespace: pairs, or kto (its own names first, then the pairs-only ones)."""
    return {**BUILTINS, **KTO_BUILTINS} if namespace == "kto" else BUILTINS


# ---------- normalizing any transform's output ----------


def _messages(value: Any, field: str, default_role: str) -> list[dict]:
    """A string (one `default_role` turn), a message, or a list of messages -> validated messages."""
    if isinstance(value, str):
        value = [{"role": default_role, "content": value}]
    elif isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise _Bad(field, f"expected a string or a list of messages, got {type(value).__name__}")
    if not value:
        raise _Bad(field, "empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _Bad(field, f"message {i} is not {{role: str, content: str}}")
        if m["role"] not in ROLES:
            raise _Bad(field, f"message {i} has role {m['role']!r}, not one of {list(ROLES)}")
        if not m["content"].strip():
            raise _Bad(field, f"message {i} ({m['role']}) has empty content")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _answer_turns(value: Any, field: str) -> list[dict]:
    turns = _messages(value, field, "assistant")
    if turns[-1]["role"] != "assistant":
        raise _Bad(field, f"last message has role {turns[-1]['role']!r}, expected 'assistant'")
    return turns


def _bool(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")  # csv files are read as text
    raise _Bad(field, f"expected a bool, got {value!r}")


def normalize_row(new: dict, fields: dict[str, str] | None = None,
                  system_prompt: str | None = None) -> dict:
    """A transform's output -> one preferences row (without pair_id); raises _Bad naming the raw field."""
    fields = fields or {}

    def name(key: str) -> str:
        return fields.get(key, key)

    if not isinstance(new, dict):
        raise _Bad("<transform>", f"returned {type(new).__name__}, expected a dict")
    kind = "stepwise" if "completions" in new else "unpaired" if "completion" in new else "pair"
    needed = {"pair": ("prompt", "chosen", "rejected"), "unpaired": ("prompt", "completion", "label"),
              "stepwise": ("prompt", "completions", "labels")}[kind]
    for key in needed:
        if new.get(key) is None:
            raise _Bad(name(key), "missing")
    prompt = _messages(new["prompt"], name("prompt"), "user")
    if system_prompt:
        prompt = [{"role": "system", "content": system_prompt}] + prompt
    row = {"kind": kind, "prompt": prompt}
    if kind == "pair":
        row["chosen"] = _answer_turns(new["chosen"], name("chosen"))
        row["rejected"] = _answer_turns(new["rejected"], name("rejected"))
        if row["chosen"] == row["rejected"]:
            raise _Bad(name("rejected"), "identical to chosen")
    elif kind == "unpaired":
        row["completion"] = _answer_turns(new["completion"], name("completion"))
        row["label"] = _bool(new["label"], name("label"))
    else:
        steps, labels = new["completions"], new["labels"]
        if not isinstance(steps, list) or not steps:
            raise _Bad(name("completions"), "expected a non-empty list of step strings")
        for i, step in enumerate(steps):
            if not isinstance(step, str) or not step.strip():
                raise _Bad(name("completions"), f"step {i} is not a non-empty string")
        if not isinstance(labels, list):
            raise _Bad(name("labels"), f"expected a list of bools, got {type(labels).__name__}")
        if len(labels) != len(steps):
            raise _Bad(name("labels"), f"{len(labels)} labels for {len(steps)} completions")
        row["completions"] = list(steps)
        row["labels"] = [_bool(v, name("labels")) for v in labels]
    return row


def _builder_output(builder: Callable, cfg: PreferenceConfig) -> tuple[Callable, dict]:
    result = builder(cfg)
    transform_fn, options = result if isinstance(result, tuple) else (result, {})
    if not callable(transform_fn):
        raise ValueError(f"preferences.type: {cfg.type!r} returned {type(transform_fn).__name__}, "
                         "expected transform_fn or (transform_fn, {...})")
    return example_caller(transform_fn), dict(options or {})


def transform_rows(cfg: PreferenceConfig, rows: list[tuple[int, dict]], where: str,
                   id_prefix: str) -> tuple[list[dict], list[tuple]]:
    """Apply the configured transform to (raw index, row) pairs; return (good rows, pair_id
    `<id_prefix>-<raw index>`; bad rows as (where, index, field, reason))."""
    known = builtins(cfg.namespace)
    builder = load_function(cfg.type, "preferences.type", known)
    transform_fn, options = _builder_output(builder, cfg)
    fields = options.get("fields") if cfg.type in known else None
    good, bad = [], []
    for index, example in rows:
        try:
            try:
                new = transform_fn(dict(example))
            except _Bad:
                raise
            except KeyError as e:
                raise _Bad(str(e.args[0]) if e.args else "?", "missing") from None
            except Exception as e:
                raise _Bad("<transform>", f"{cfg.type!r} failed: {type(e).__name__}: {e}") from None
            row = normalize_row(new, fields, cfg.system_prompt)
        except _Bad as e:
            bad.append((where, index, e.field, e.reason))
            continue
        row["pair_id"] = f"{id_prefix}-{index:06d}"
        good.append(row)
    return good, bad


def source_config(cfg: PreferenceConfig, source: PreferenceSource) -> PreferenceConfig:
    """The config a `datasets` entry's rows go through: preferences' own, with the source's `type`."""
    if source.type is None:
        return cfg
    own = cfg.model_dump(exclude_unset=True, exclude={"type", "paths", "datasets", "test_datasets"})
    if isinstance(source.type, dict):  # its user_defined keys replace preferences' own
        own = {k: v for k, v in own.items() if k not in USER_DEFINED_KEYS}
    return PreferenceConfig.model_validate({**own, "type": source.type, "datasets": [source]})


def _check_source(source: PreferenceSource) -> None:
    if source.ds_type is None or sources.kind(source) == "hub":
        return
    for path in sources.local_paths(source):
        if path.is_file():
            _check_path_suffix(path, source.ds_type, sources.describe(source))


def _raw_parts(cfg: PreferenceConfig) -> dict[str, list[tuple[str, str, PreferenceConfig, list[tuple[int, dict]]]]]:
    """Per split, its parts as (where errors name them, pair_id prefix, config, (index, row) pairs)."""
    if cfg.paths:
        parts = {}
        for split, raw_path in cfg.paths.items():
            path = Path(raw_path)
            _check_path(cfg, split, path)
            raw = read_rows(path)
            if not isinstance(raw, list) or not raw:
                raise BadRowError(f"preferences.paths.{split}: {path} has no rows")
            parts[split] = [(split, split, cfg, list(enumerate(raw)))]
        return parts
    parts = {}
    for name, split in (("datasets", "train"), ("test_datasets", "eval")):
        entries = getattr(cfg, name) or []
        for i, source in enumerate(entries):
            _check_source(source)
            prefix = split if len(entries) == 1 else f"{split}-{i}"
            parts.setdefault(split, []).append((f"{name}.{i} {sources.describe(source)}", prefix,
                                                source_config(cfg, source), sources.load(source)))
    if cfg.val_set_size:  # eval: a share of the datasets' rows, each keeping its raw index
        train = parts["train"]
        kept, held = sources.hold_out([rows for *_, rows in train], cfg.val_set_size, cfg.val_set_seed or 0,
                                      "preferences.val_set_size")
        parts = {"train": [(w, p, c, rows) for (w, p, c, _), rows in zip(train, kept) if rows],
                 "eval": [(w, p.replace("train", "eval", 1), c, rows) for (w, p, c, _), rows in zip(train, held)
                          if rows]}
    return parts


def _check_path(cfg: PreferenceConfig, split: str, path: Path) -> None:
    where = f"preferences.paths.{split}"
    suffix = path.suffix.lower()
    if not path.exists():
        raise FileNotFoundError(f"{where}: {path} does not exist")
    if suffix not in SUFFIXES:
        raise ValueError(f"{where}: {path} has suffix {suffix!r}; use one of {SUFFIXES}")
    if cfg.ds_type:
        _check_path_suffix(path, cfg.ds_type, where)


def _check_path_suffix(path: Path, ds_type: str, where: str) -> None:
    suffix = path.suffix.lower()
    if suffix.lstrip(".") != ds_type and not (ds_type == "json" and suffix == ".jsonl"):
        raise ValueError(f"{where}: {path} does not match ds_type {ds_type!r}")


def write_split(rows: list[dict], path: Path) -> pa.Table:
    """Write preferences rows (every PREFERENCES column; absent ones null) as Parquet."""
    table = pa.Table.from_pydict({f.name: [row.get(f.name) for row in rows] for f in PREFERENCES}, schema=PREFERENCES)
    return write_table(table, path, PREFERENCES)


def run(cfg: PreferenceConfig, out_dir: Path) -> dict:
    """Transform each split's rows (`paths`: one file per split; `datasets`: the sources' rows, train, and
    test_datasets', eval) into out_dir/<split>.parquet; return per split {kinds, kept, dropped,
    dropped_indices (first 20), dropped_fields}, with `datasets` also `sources` ({where: kept}). Under
    `on_bad_rows: fail`, any bad row raises BadRowsError before anything is written."""
    out_dir = Path(out_dir)
    results, all_bad = {}, []
    for split, parts in _raw_parts(cfg).items():
        good, bad, kept = [], [], {}
        for where, prefix, part_cfg, rows in parts:
            part_good, part_bad = transform_rows(part_cfg, rows, where, prefix)
            good, bad, kept[where] = good + part_good, bad + part_bad, len(part_good)
        results[split] = (good, bad, kept)
        all_bad += bad
    if all_bad and cfg.on_bad_rows == "fail":
        raise BadRowsError(all_bad)
    summary = {}
    for split, (good, bad, kept) in results.items():
        if not good:
            reasons = "; ".join(f"{w} row {i}, field {f!r}: {r}" for w, i, f, r in bad[:MAX_LISTED])
            raise BadRowError(f"preferences: every row of split {split!r} is bad ({reasons})")
        write_split(good, out_dir / f"{split}.parquet")
        summary[split] = {
            "kinds": dict(Counter(row["kind"] for row in good)),
            "kept": len(good),
            "dropped": len(bad),
            "dropped_indices": [index for _, index, _, _ in bad[:MAX_DROPPED_INDICES]],
            "dropped_fields": dict(Counter(field for _, _, field, _ in bad)),
            **({"sources": kept} if cfg.datasets else {}),
        }
    return summary
