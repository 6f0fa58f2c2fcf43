"""Which config fields change what a stage computes, declared next to each field.

A stage's cache key holds its config section (tasks/store.py). Most fields change the output; a few only say
when, where or how fast the stage runs (checkpoint steps, worker counts, server addresses, prefetch), and a
changed value of those must reuse the stored artifact. Such a field is declared with `not_in_key(...)` in
place of pydantic's `Field(...)`, with a docstring that says why; `key_fields(section)` is the section as the
key sees it. `key_when_set(...)`: a field added after keys existed, left out while it is None so that older
keys stay valid.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

IN_KEY = "in_key"
"""json_schema_extra entry of a field: False (never in the key) or "when_set" (in it unless None)."""


def not_in_key(*args, **kwargs):
    """pydantic `Field(*args, **kwargs)` for a field that does not change what its stage computes."""
    return Field(*args, json_schema_extra={IN_KEY: False}, **kwargs)


def key_when_set(*args, **kwargs):
    """pydantic `Field(*args, **kwargs)` for a field that is part of the key only when it is not None."""
    return Field(*args, json_schema_extra={IN_KEY: "when_set"}, **kwargs)


def key_rule(model: type[BaseModel], name: str):
    """True (in the key), False (never) or "when_set" for field `name` of config class `model`."""
    extra = model.model_fields[name].json_schema_extra
    return extra.get(IN_KEY, True) if isinstance(extra, dict) else True


def key_fields(section: BaseModel) -> dict:
    """`section` as JSON without the fields its class declares `not_in_key` (nor `key_when_set` ones that are
    None), and so on down into nested sections (also those in a dict or list)."""
    values = section.model_dump(mode="json")
    kept = {}
    for name, value in values.items():
        rule = key_rule(type(section), name)
        if rule is True or (rule == "when_set" and value is not None):
            kept[name] = _nested(getattr(section, name), value)
    return kept


def _nested(field, dumped):
    """A field's key value: its JSON, with nested sections filtered by key_fields."""
    if isinstance(field, BaseModel):
        return key_fields(field)
    if isinstance(field, dict) and any(isinstance(v, BaseModel) for v in field.values()):
        return {k: _nested(v, dumped[k]) for k, v in field.items()}
    if isinstance(field, (list, tuple)) and any(isinstance(v, BaseModel) for v in field):
        return [_nested(v, d) for v, d in zip(field, dumped)]
    return dumped
