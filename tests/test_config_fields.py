"""Nothing accepted and ignored: every field of the pipeline config (every section, nested ones included) is read
by some code path, found by reading the source of stages/, flows/ and tasks/ (an attribute read `.name`, a key
`"name"`, a keyword `name=` or a parameter `name:` of a function the section is handed to). Which method reads a
field is the validators' business (flows/config.py refuses a field no code path of the chosen method reads:
tests/test_configs.py); this test catches a field that no code reads at all."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from flows.config import PipelineConfig

ROOT = Path(__file__).resolve().parents[1]

NOT_READ = {}
"""option path -> why no code reads it (none today; a field added here needs its reason)."""


def config_fields(model: type[BaseModel], prefix: str = ""):
    """(option path, field name, the class that declares it) of every field, nested sections included."""
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", name, model
        kinds = [field.annotation, *typing.get_args(field.annotation)]
        for kind in kinds + [k for kind in kinds for k in typing.get_args(kind)]:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                yield from config_fields(kind, f"{prefix}{name}.")


def sources_without_definitions() -> str:
    """The project's source, less each field's own declaration line (`    name: type = ...`)."""
    texts = [p.read_text() for folder in ("stages", "flows", "tasks") for p in (ROOT / folder).rglob("*.py")]
    declaration = re.compile(r"^    \w+: [^=\n(]+(=.*)?$", re.M)
    return "\n".join(declaration.sub("", text) for text in texts)


def names_read(source: str) -> set[str]:
    """Every name the source reads: after a dot (`.name`), quoted whole (`"name"`), as a keyword (`name=`) or as a
    parameter (`name: `). One pass over the source, not one regular expression per field."""
    read = re.compile(r"\.(\w+)\b|[\"'](\w+)(?=[\"'])|\b(\w+)=|\b(\w+): ")
    return {name for match in read.findall(source) for name in match if name}


def test_every_config_field_is_read_by_some_code_path():
    read = names_read(sources_without_definitions())
    unread = [path for path, name, _ in config_fields(PipelineConfig) if name not in read and path not in NOT_READ]
    assert unread == [], f"config fields no code reads (implement them, refuse them, or list them in NOT_READ): {unread}"


def test_the_walk_sees_nested_sections():
    paths = {path for path, _, _ in config_fields(PipelineConfig)}
    assert {"rollout.vllm.dtype", "rollout.atropos.api_url", "score.remote_verifiers.token_env",
            "train.ray.address", "grpo.adam_beta1"} <= paths
    assert len(paths) > 300
