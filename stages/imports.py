"""Resolve user code named `module.fn` in configs (transforms, reward functions), and import heavy
libraries on first use."""

from __future__ import annotations

import importlib
from typing import Callable


def load_function(dotted: str, what: str, builtins: dict[str, Callable] | None = None) -> Callable:
    """A built-in by name, or `module.fn` imported; errors name the config key (`what`) and the missing part."""
    if builtins and dotted in builtins:
        return builtins[dotted]
    module_name, _, fn_name = dotted.rpartition(".")
    if not module_name:
        hint = f" (built-ins: {', '.join(sorted(builtins))})" if builtins else ""
        raise ValueError(f"{what}: {dotted!r} is neither a built-in nor `module.fn`{hint}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what}: cannot import module {module_name!r} for {dotted!r} ({e})") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{what}: module {module_name!r} has no function {fn_name!r}")
    return fn


class LazyModule:
    """A module imported on first attribute access: `torch = LazyModule("torch")` at the top of a stage
    whose config the CLI loads, so loading a config (and a fully cached run) does not import torch (~3 s).

    >>> json = LazyModule("json")
    >>> json.dumps([1])
    '[1]'
    """

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str):
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"<LazyModule {self._name}>"
