"""What the Ray backends share (reward actors, stages/scoring/ray_rewards.py; vLLM engine actors,
stages/rollout/engines/ray_vllm.py): joining the cluster once per process, and shipping this pipeline's
source to actors so a node needs the installed libraries but no copy of the project.

Code shipping: an actor gets, with its constructor arguments, the source files of the modules it
imports (their project-local closure, stages/runtime/imports.py `local_modules`: the files the stage keys
hash), writes them into a folder of its own and imports from there. So it runs exactly the code
whose digest is in the artifact key. The actor classes themselves are pickled by value (their
modules registered with Ray's cloudpickle). Ray's `runtime_env` working_dir would upload a folder
too, but only once per driver process, at `ray.init`; an edit between two uses in one process
would not reach the actors.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from stages.runtime.imports import local_modules

_CONNECT_LOCK = threading.Lock()


def connect(address: str | None) -> str:
    """Join the Ray cluster at `address` (or RAY_ADDRESS), or start a local instance; once per process.
    Returns where: the address, or "local"."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    with _CONNECT_LOCK:
        if not ray.is_initialized():
            if address:
                ray.init(address=address, log_to_driver=True)
            else:  # a new local instance, small: it shares the machine with training. ("local": without it,
                # ray.init joins a cluster that someone else started on this machine, if there is one.)
                ray.init(address="local", include_dashboard=False, object_store_memory=200 * 1024 * 1024,
                         log_to_driver=True)
    return address or "local"


def _module_path(name: str, file: str) -> str:
    """Where module `name` lives relative to a sys.path entry: a/b.py, or a/b/__init__.py for a package."""
    parts = name.split(".")
    if os.path.basename(file) == "__init__.py":
        return os.path.join(*parts, "__init__.py")
    return os.path.join(*parts[:-1], parts[-1] + ".py")


def source_files(module_names: list[str]) -> dict[str, str]:
    """{path relative to a sys.path entry: source} of the modules and their project-local closure."""
    modules: dict[str, str] = {}
    for name in module_names:
        modules.update(local_modules(name))
    return {_module_path(name, file): Path(file).read_text() for name, file in modules.items()}


def ship_by_value(*modules) -> None:
    """Pickle the classes and functions of these modules by value when they go to Ray actors."""
    import ray

    for module in modules:
        ray.cloudpickle.register_pickle_by_value(module)


def install_code(files: dict[str, str], prefix: str) -> str:
    """Actor side: the shipped files in a temp folder named by their digest (`prefix` + 16 hex digits), put first on
    sys.path; return the folder. Written once per code version and node (into a new folder renamed into place, so a
    folder of that name is whole), and reused by every later actor: actors do not leave a folder each behind."""
    import hashlib
    import shutil
    import tempfile

    digest = hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()[:16]
    root = os.path.join(tempfile.gettempdir(), prefix + digest)
    if not os.path.isdir(root):
        fresh = tempfile.mkdtemp(prefix=f"{prefix}{digest}.tmp-")
        for relative, text in files.items():
            path = os.path.join(fresh, relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        try:
            os.rename(fresh, root)
        except OSError:  # another actor on this node put the same files there first
            shutil.rmtree(fresh, ignore_errors=True)
    sys.path.insert(0, root)
    return root
