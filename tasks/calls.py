"""One spec per stage call: the stage function and the arguments it is called with, and the key derived from them.

A task builds a `Call(function, inputs, **arguments)`; `materialize` (tasks/stage_tasks.py) derives the cache key
from that call and, when nothing is stored under the key, calls `function` with the same arguments. So an
argument cannot reach a stage without reaching its key. Each argument is keyed by what it is:

- a config section (pydantic): its key fields (stages/runtime/keys.py `key_fields`; `Config` to key only the
  fields the stage reads, or to add what it reads through the config: user code, files);
- a placement (`stages/runtime/devices.DeviceConfig`): `devices.key_fields`, the resolved precision;
- an artifact (`InputFile`, `InputDir`): its stage and key; a user's file or folder (`UserFile`): its digest;
- plain values (numbers, strings, lists, dicts): themselves; a value with `as_key()` (e.g. replay's
  Replacement, the wrappers here): what that returns;
- what says where or when a stage runs and not what it computes, by its kind: the folders and the metrics
  callback `materialize` hands over (OUT_DIR, WORK_DIR, ON_METRICS), progress callbacks (`Progress`), notes
  about the run written beside the output (`Notes`). These are left out of the key.

An argument equal to the function's default is left out too (calling without it computes the same), so an
optional argument added later keeps the keys of the calls that leave it at its default. Anything else (a bare
Path, a callable) has no key and is refused, naming the argument.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from stages.runtime import devices
from stages.runtime.imports import user_code
from stages.runtime.keys import key_fields
from tasks.store import Artifact, path_digest


@dataclass(frozen=True)
class Slot:
    """An argument `materialize` fills in: the output folder, the resumable work folder, the metrics callback.
    None of them changes what the stage computes; none is in the key."""

    name: str


OUT_DIR = Slot("out_dir")
WORK_DIR = Slot("work_dir")
"""The store's work folder of the key (checkpoints a rerun of the key resumes from)."""
ON_METRICS = Slot("on_metrics")
"""on_metrics(metrics, step): logged to the stage's MLflow run."""


class Arg:
    """An argument wrapper: the stage gets its `value`, the key what its `as_key()` returns."""


@dataclass(frozen=True)
class Progress(Arg):
    """A progress callback (the reporter's bar, or None): watches the stage, not in the key."""

    value: Callable | None


@dataclass(frozen=True)
class Notes(Arg):
    """What a stage writes beside its output about the run that asked for it (export's model card: the run's
    metrics, lineage and config). Not in the key: a folder reused by a later run keeps the notes of the run
    that wrote it."""

    value: Any


@dataclass(frozen=True)
class InputFile(Arg):
    """A file of an input artifact: the stage gets its path, the key the artifact's key and the file name."""

    artifact: Artifact
    name: str

    @property
    def value(self) -> Path:
        return self.artifact.file(self.name)

    def as_key(self) -> list:
        return [self.artifact, self.name]


@dataclass(frozen=True)
class InputDir(Arg):
    """An input artifact's folder: the stage gets its path, the key the artifact's key."""

    artifact: Artifact

    @property
    def value(self) -> Path:
        return self.artifact.path

    def as_key(self) -> Artifact:
        return self.artifact


@dataclass(frozen=True)
class UserFile(Arg):
    """A file or folder the user names by path: the stage gets the path, the key its path and content digest."""

    path: str | Path

    @property
    def value(self) -> Path:
        return Path(self.path)

    def as_key(self) -> list:
        return [str(self.path), path_digest(self.path)]


@dataclass(frozen=True)
class Config(Arg):
    """A config section as an argument. The stage gets the section; the key gets its key fields (`only` those
    the stage reads, where it reads a few; less `keyed_elsewhere`, fields that reach the stage through another
    argument of the call, which keys them as they arrive), and what the stage reads through the section: the
    source digests of the user modules behind the `module.fn` names in `code` (`builtins` left out) and the
    content digests of the files and folders in `files`."""

    value: BaseModel
    only: tuple[str, ...] | None = None
    keyed_elsewhere: tuple[str, ...] = ()
    code: tuple[str, ...] = ()
    builtins: dict | None = None
    files: tuple[str | Path, ...] = ()

    def as_key(self) -> dict:
        fields = {name: v for name, v in key_fields(self.value).items()
                  if (self.only is None or name in self.only) and name not in self.keyed_elsewhere}
        return {"fields": fields, "user_code": user_code(list(self.code), self.builtins),
                "files": [UserFile(p) for p in self.files]}


class Call:
    """`function(**arguments)`, a stage's call, and the artifacts it reads by the names lineage gives them
    (`inputs`, None: no such input; the manifest's and MLflow's inputs). Every artifact an argument reads must
    be one of `inputs`."""

    def __init__(self, function: Callable[..., dict], inputs: dict[str, Artifact | None], **arguments):
        self.signature = inspect.signature(function)
        self.signature.bind(**arguments)  # a misspelt or missing argument fails here, before any key
        self.function, self.arguments = function, arguments
        self.inputs = {name: a for name, a in inputs.items() if a is not None}

    @property
    def module(self):
        """The stage module: its code version (and that of what it imports) is in the key."""
        return sys.modules[self.function.__module__]

    def key(self) -> dict:
        """{argument: its key} for every argument that changes the output (module docstring)."""
        read: list[Artifact] = []
        keyed = {}
        for name, value in self.arguments.items():
            if isinstance(value, (Slot, Progress, Notes)):  # where, when, watched: not what
                continue
            try:
                key = key_value(value, read)
            except TypeError as e:
                raise TypeError(f"{self.function.__module__}.{self.function.__name__}: argument {name}: {e}") from e
            default = self.signature.parameters[name].default
            if default is not inspect.Parameter.empty and key == key_value(default, []):
                continue
            keyed[name] = key
        named = {(a.stage, a.key) for a in self.inputs.values()}
        unnamed = [f"{a.stage}/{a.key}" for a in read if (a.stage, a.key) not in named]
        if unnamed:
            raise ValueError(f"{self.function.__name__} reads {unnamed}, which its call does not name in inputs")
        return keyed

    def kwargs(self, slots: dict[Slot, Any]) -> dict:
        """The arguments as the stage gets them: slots filled, wrappers unwrapped."""
        return {name: slots[value] if isinstance(value, Slot) else stage_value(value)
                for name, value in self.arguments.items()}


def key_value(value, read: list[Artifact]):
    """What the key holds of one argument value (module docstring); artifacts met are appended to `read`."""
    if isinstance(value, (Slot, Progress, Notes)):
        raise TypeError(f"a {type(value).__name__} is left out of keys only as a whole argument")
    if isinstance(value, Artifact):
        read.append(value)
        return f"{value.stage}/{value.key}"
    if hasattr(value, "as_key"):
        return key_value(value.as_key(), read)
    if isinstance(value, devices.DeviceConfig):
        return devices.key_fields(value)
    if isinstance(value, BaseModel):
        return key_fields(value)
    if isinstance(value, dict):
        return {str(k): key_value(v, read) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [key_value(v, read) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"a {type(value).__name__} has no key; pass it as an artifact's InputFile/InputDir, a "
                    "UserFile, a Config, or a kind left out of keys (Progress, Notes)")


def stage_value(value):
    """What the stage gets for an argument value: a wrapper's `value`, through dicts and lists."""
    if isinstance(value, Arg):
        return stage_value(value.value)
    if isinstance(value, dict):
        return {k: stage_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [stage_value(v) for v in value]
    return value
