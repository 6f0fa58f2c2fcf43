"""Resolve user code named `module.fn` in configs (transforms, reward functions), import heavy
libraries on first use, and digest the source of local modules (what artifact keys hash of code).

What is hashed: your own modules and this pipeline's, found by reading files, never by importing them.
Not hashed: the stdlib, whatever sits in site-packages / dist-packages, and an installed library
wherever it lives: a top-level package that sits beside a `*.dist-info` folder listing it (what pip
writes where it installs: `pip install --target DIR`, DIR then on PYTHONPATH). An editable install
(`pip install -e`) keeps its dist-info in site-packages, away from its source (an `*.egg-info` in a
source tree is build output, not an install), so it counts as your code and is hashed: editing it
changes the key. A folder on PYTHONPATH without a dist-info (a git checkout) is hashed too: it cannot
be told from your code. Any importable layout is walked without importing anything: namespace packages
(also a namespace subpackage whose parent was never imported), editable installs' finders, zip imports
(not hashed: no files on disk).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path
from typing import Any, Callable


def example_caller(transform_fn: Callable) -> Callable[[dict], Any]:
    """`transform_fn` as a one-argument call on a row. axolotl's dataset transforms are written
    `fn(example, tokenizer=None)` or, in its newer docs, `fn(example, processing_class=None)`; both are called
    with None (posttrain tokenizes later, with the policy's tokenizer), and a plain `fn(example)` too."""
    import inspect

    try:
        parameters = inspect.signature(transform_fn).parameters
    except (TypeError, ValueError):
        parameters = {}
    for name in ("processing_class", "tokenizer"):
        if name in parameters:
            return lambda example: transform_fn(example, **{name: None})
    return transform_fn


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


def optional_package(module: str, distribution: str, missing: Exception):
    """`module` of an optional extra imported, and its `distribution`'s installed version: (module, version);
    `missing` raised (from the ImportError) where the package is not installed.

    >>> optional_package("json", "no-such-distribution", ValueError("absent"))
    Traceback (most recent call last):
    ...
    importlib.metadata.PackageNotFoundError: No package metadata was found for no-such-distribution
    >>> optional_package("no_such_module", "x", ValueError("install the extra"))
    Traceback (most recent call last):
    ...
    ValueError: install the extra
    """
    from importlib.metadata import version

    try:
        imported = importlib.import_module(module)
    except ImportError as e:
        raise missing from e
    return imported, version(distribution)


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


@functools.cache
def _installed_roots() -> tuple[str, ...]:
    """Folders of the Python installation and its site-packages: modules there are not hashed."""
    import site
    import sysconfig

    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             *sysconfig.get_paths().values(), *site.getsitepackages(), site.getusersitepackages()}
    return tuple(os.path.realpath(r) + os.sep for r in roots if r)


OWN_PACKAGES = tuple(os.path.join(str(Path(os.path.realpath(__file__)).parents[2]), p) + os.sep
                     for p in ("flows", "tasks", "stages"))
"""This pipeline's own packages: hashed even when installed into site-packages."""


_realpath = functools.lru_cache(maxsize=65536)(os.path.realpath)
"""os.path.realpath, remembered: a digest walk asks for the same files over and over (one lstat per folder)."""


def is_local_file(path: str | None) -> bool:
    """True for a source file of your project or of this pipeline: a file that is not in site-packages
    or the Python installation (the stdlib), or one of `OWN_PACKAGES`. Those are the files a code
    digest hashes."""
    if not path or not os.path.isfile(path):
        return False
    real = _realpath(path)
    if real.startswith(OWN_PACKAGES):
        return True
    parts = Path(real).parts
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return not real.startswith(_installed_roots())


def _find_module(name: str) -> list[tuple[str, str]]:
    """(module name, file) of `name` and of each local package above it; [] if it is not a local module.
    Imports nothing: a top-level name goes through the import system's finders, a submodule is looked
    up in its package's folders, and nothing installed is looked into (`is_local_file`, `_installed_library`)."""
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
    except Exception:  # a module in sys.modules without a spec (__main__), a finder that fails
        return []
    found = []
    for part in [None, *rest]:
        if part is not None:
            if not locations:
                return []  # `from module import attribute`: the attribute is no module
            spec, locations = _find_in(f"{spec.name}.{part}", locations)
        if spec is None:
            return []
        if spec.has_location and (not is_local_file(spec.origin) or _installed_library(spec.name, spec.origin)):
            return []  # installed (or stdlib): neither hashed nor walked into
        if spec.has_location:
            found.append((spec.name, spec.origin))
    return found


def _find_in(fullname: str, locations: list[str]):
    """(spec, its submodule folders) of submodule `fullname` in its package's folders, or (None, []).

    As `importlib.machinery.PathFinder.find_spec(fullname, locations)`, but a namespace portion comes back
    as a plain spec with its folders: PathFinder builds a `_NamespacePath`, which reads the parent package
    from sys.modules and raises KeyError when it was never imported (`reasoning_gym.induction`)."""
    portions: list[str] = []
    for entry in locations:
        try:
            finder = pkgutil.get_importer(entry)  # FileFinder, zipimporter, ... (cached in sys.path_importer_cache)
            spec = finder.find_spec(fullname) if finder is not None and hasattr(finder, "find_spec") else None
        except Exception:  # an entry that is no folder, or a finder that fails on it: nothing found there
            continue
        if spec is None:
            continue
        if spec.loader is not None:  # a module or a regular package
            try:
                return spec, list(spec.submodule_search_locations or [])
            except Exception:
                return spec, []
        portions += list(spec.submodule_search_locations or [])  # a namespace portion: keep looking
    if portions:
        return importlib.machinery.ModuleSpec(fullname, None, is_package=True), portions
    return None, []


def _installed_library(name: str, origin: str) -> bool:
    """True when the file of module `name` belongs to a top-level package that sits beside a dist-info folder
    naming it (`pip install --target DIR`: DIR/<pkg>-<version>.dist-info): an installed library, wherever its
    folder is on sys.path. Never for `OWN_PACKAGES`."""
    real = _realpath(origin)
    if real.startswith(OWN_PACKAGES):
        return False
    parts = name.split(".")
    depth = len(parts) if os.path.basename(origin) == "__init__.py" else len(parts) - 1
    entry = Path(origin).parents[depth]  # the sys.path entry it was found in (where pip put its dist-info)
    try:
        stamp = os.stat(entry).st_mtime_ns
    except OSError:
        return False
    return parts[0] in _distributed_names(str(entry), stamp)


SKIPPED_IN_RECORD = (".dist-info", ".egg-info", ".pth")
"""RECORD lines that name no module (the metadata itself, path hooks)."""


@functools.lru_cache(maxsize=256)
def _distributed_names(entry: str, stamp: int) -> frozenset[str]:
    """Top-level module names the `*.dist-info` folders in `entry` list (their top_level.txt, else the first
    part of each path in RECORD); cached by the folder's mtime."""
    names: set[str] = set()
    try:
        infos = [e for e in os.scandir(entry) if e.name.endswith(".dist-info") and e.is_dir()]
    except OSError:
        return frozenset()
    for info in infos:
        for listing in ("top_level.txt", "RECORD"):
            try:
                lines = Path(info.path, listing).read_text(errors="replace").splitlines()
            except OSError:
                continue
            for line in lines:
                first = line.split(",", 1)[0].strip().replace("\\", "/").split("/", 1)[0]
                if first and first not in ("..", "__pycache__") and not first.endswith(SKIPPED_IN_RECORD):
                    names.add(first.removesuffix(".py"))
            break
    return frozenset(names)


@functools.lru_cache(maxsize=4096)
def _parse(path: str, stamp: tuple) -> tuple[str, tuple[tuple[int, str | None, tuple[str, ...]], ...]]:
    """sha256 of a file and its import statements as (level, module, names); cached by path and stat."""
    data = Path(path).read_bytes()
    try:
        tree = ast.parse(data, filename=path)
    except (SyntaxError, ValueError):
        return hashlib.sha256(data).hexdigest(), ()
    imports = []
    for node in ast.walk(tree):  # module level and inside functions (lazy imports)
        if isinstance(node, ast.Import):
            imports += [(0, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imports.append((node.level, node.module, tuple(a.name for a in node.names if a.name != "*")))
    return hashlib.sha256(data).hexdigest(), tuple(imports)


def _stamp(path: str) -> tuple:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


def _imported_names(name: str, path: str, imports) -> list[str]:
    """Absolute names of what a module imports: `x`, `x.y` (a module or an attribute of x)."""
    package = name if os.path.basename(path) == "__init__.py" else name.rpartition(".")[0]
    names = []
    for level, module, attributes in imports:
        if level:
            base = package.rsplit(".", level - 1)[0] if level > 1 else package
            module = f"{base}.{module}" if module else base
        if module and not module.startswith("."):  # (a relative import outside a package: nothing to find)
            names += [module, *(f"{module}.{a}" for a in attributes)]
    return names


def local_modules(module_name: str) -> dict[str, str]:
    """{module name: file} of `module_name`, the packages above it, and every local module they import,
    transitively: module-level and function-level imports, found by reading the files (`ast`), never
    by importing them. Local: a file outside site-packages and the Python installation (`is_local_file`).
    Empty when `module_name` is not a local module."""
    files: dict[str, str] = {}
    todo, seen = [module_name], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for found, path in _find_module(name):
            if found not in files:
                files[found] = path
                todo += _imported_names(found, path, _parse(path, _stamp(path))[1])
    return files if module_name in files else {}


_digests: dict[tuple, tuple[tuple, str]] = {}  # (module, sys.path) -> ((file, stamp), ...), digest


def source_digest(module_name: str) -> str | None:
    """sha256 of the source files of `local_modules(module_name)`; None when it is not a local module.
    Installed packages are not hashed, nor are their versions. Cached per process while every file
    keeps its mtime and size: editing any of them changes the digest."""
    cache_key = (module_name, tuple(sys.path))
    cached = _digests.get(cache_key)
    try:
        if cached is not None and all(_stamp(path) == stamp for path, stamp in cached[0]):
            return cached[1]
    except OSError:  # a file is gone: look again
        pass
    files = local_modules(module_name)
    if not files:
        return None
    digest = hashlib.sha256()
    stamps = []
    for name, path in sorted(files.items()):
        stamp = _stamp(path)
        stamps.append((path, stamp))
        digest.update(f"{name}\0{_parse(path, stamp)[0]}\0".encode())
    _digests[cache_key] = (tuple(stamps), digest.hexdigest())
    return digest.hexdigest()


def user_code(names, builtins: dict | None = None) -> list[list[str | None]]:
    """[name, source digest] for each `module.fn` in `names` that is not a built-in: what a stage's key
    holds of the user code a config names (`source_digest` of the module; None if it is not local)."""
    return [[name, source_digest(name.rpartition(".")[0])] for name in names
            if "." in name and name not in (builtins or {})]


def add_code_dirs(dirs) -> list[str]:
    """Make `module.fn` user code in these folders importable (axolotl finds `file.fn` in the working folder;
    posttrain also looks beside the config): each folder, absolute, is appended to sys.path unless it is there,
    so an installed package of the same name still wins. Spawned workers (reward workers, the rollout worker)
    get the parent's sys.path from multiprocessing, torchrun ranks as PYTHONPATH (stages/runtime/distributed.py).
    Returns the folders as added (absolute paths)."""
    added = []
    for folder in dirs:
        path = os.path.abspath(folder)
        if path not in [os.path.abspath(p or ".") for p in sys.path]:
            sys.path.append(path)
        added.append(path)
    importlib.invalidate_caches()
    return added
