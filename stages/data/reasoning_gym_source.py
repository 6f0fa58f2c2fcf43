"""reasoning-gym's procedural tasks as a source of `transform.datasets` (stages/data/sources.py reads them).

An entry `{path: reasoning_gym, name: countdown, size: 2000, seed: 1, config: {...}}` is the rows of
`reasoning_gym.create_dataset(name, size=size, seed=seed, **config)` (https://github.com/open-thought/reasoning-gym),
`name: composite` with `config: {datasets: [{name, weight, config}, ...]}` its weighted mix of tasks (reasoning-gym's
`DatasetSpec`s). Each row is {question, answer, reasoning_gym}: `reasoning_gym` is JSON text of how to rebuild the
entry (the create_dataset call, the row's index, the package version) and of the entry itself (question, answer,
metadata), so that the `reasoning_gym` reward scores a completion with the task's own `score_answer` on the entry
as the package makes it (JSON turns the tuples some scorers compare into lists). No Prefect, no MLflow.

Item i of seed s is drawn from `Random(s + i)`: seed 2 repeats seed 1's items shifted by one, so a held-out
split of the same task takes a seed past the train split's seed + size (`overlap` says where they meet).
"""

from __future__ import annotations

import json
from functools import lru_cache

from stages.runtime.imports import optional_package

PATH = "reasoning_gym"
"""The `path` of a datasets entry that names a reasoning-gym task (not a local folder or a hub id)."""
PACKAGE = "reasoning-gym"
MISSING = (f"path: {PATH} needs the {PACKAGE} package, which is not installed; install the extra: "
           f"pip install -e '.[{PACKAGE}]' (make installs it)")


class TaskError(ValueError):
    """A reasoning-gym source that cannot make rows: the package is missing, the task or its config is unknown."""


def package():
    """The reasoning_gym module; TaskError naming the extra when it is not installed."""
    return optional_package("reasoning_gym", PACKAGE, TaskError(MISSING))[0]


def version() -> str:
    """The installed distribution's version (reasoning_gym.__version__ lags it: 0.1.25 says 0.1.19)."""
    return optional_package("reasoning_gym", PACKAGE, TaskError(MISSING))[1]


def create(name: str, size: int, seed: int, config: dict | None) -> object:
    """`reasoning_gym.create_dataset(name, size=, seed=, **config)`; for `composite`, config's `datasets` entries
    as DatasetSpec (name, weight, config: {} when left out). TaskError names an unknown task or config key, or a
    config the task takes but cannot draw an item from (some tasks check their config only when an item is made:
    the first one is drawn here, so that loading the config, not the transform, says so)."""
    rg = package()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        import difflib

        close = difflib.get_close_matches(name, DATASETS, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise TaskError(f"reasoning-gym has no task {name!r}{hint}; its {len(DATASETS)} tasks: "
                        "python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))'")
    kwargs = dict(config or {})
    if name == "composite":
        from reasoning_gym.composite import DatasetSpec

        try:
            kwargs["datasets"] = [DatasetSpec(**{"config": {}, **spec}) for spec in kwargs.get("datasets") or []]
        except TypeError as e:
            raise TaskError(f"composite: config.datasets entries are {{name, weight, config}}: {e}") from None
        for spec in kwargs["datasets"]:
            create(spec.name, size, seed, spec.config)  # an unknown task inside names itself
    try:
        dataset = rg.create_dataset(name, size=size, seed=seed, **kwargs)
    except (TypeError, AssertionError, ValueError) as e:
        raise TaskError(f"reasoning-gym task {name!r} refuses config {config or {}}: {type(e).__name__}: {e}") from None
    try:
        if size:
            dataset[0]
    except Exception as e:  # the task's generator, on a config its class took: whatever it raises
        raise TaskError(f"reasoning-gym task {name!r} cannot make an item with config {config or {}}: "
                        f"{type(e).__name__}: {e}") from None
    return dataset


def rows(name: str, size: int, seed: int, config: dict | None) -> list[dict]:
    """The task's `size` items as rows {question, answer (None where the task has no single gold answer),
    reasoning_gym: JSON text of {task: {name, size, seed, config}, index, version, entry}}."""
    dataset, task, made_by = create(name, size, seed, config), {"name": name, "size": size, "seed": seed,
                                                                 "config": config or {}}, version()
    out = []
    for index in range(size):
        try:
            entry = dataset[index]
        except Exception as e:  # the task's own generator: name the item, not a traceback inside reasoning-gym
            raise TaskError(f"reasoning-gym task {name!r} (seed {seed}, config {config or {}}) could not make item "
                            f"{index}: {type(e).__name__}: {e}") from e
        record = {"task": task, "index": index, "version": made_by, "entry": entry}
        out.append({"question": entry["question"], "answer": entry.get("answer"),
                    "reasoning_gym": json.dumps(record, default=str)})
    return out


@lru_cache(maxsize=32)
def _dataset(task_json: str):
    task = json.loads(task_json)
    return create(task["name"], task["size"], task["seed"], task["config"])


def entry_of(record: dict) -> tuple[object, dict]:
    """(the dataset, the entry) a row's `reasoning_gym` record names, made again by the installed package; a
    record made by another version whose item differs is a TaskError naming both versions."""
    dataset = _dataset(json.dumps(record["task"], sort_keys=True))
    entry = dataset[record["index"]]
    if entry["question"] != record["entry"]["question"]:
        raise TaskError(f"reasoning-gym {version()} makes item {record['index']} of {record['task']['name']} "
                        f"differently from {record['version']}, which wrote this row; install "
                        f"{PACKAGE}=={record['version']}")
    return dataset, entry


def seeds(task: dict) -> range:
    """The seeds a source ({name, size, seed, config}) draws its items from: seed..seed + size - 1, and a
    composite's tasks from seed + k + 1 on (k: the task's place), that much further.

    >>> seeds({"name": "countdown", "size": 100, "seed": 1, "config": {}})
    range(1, 101)
    """
    tasks = len((task["config"] or {}).get("datasets") or []) if task["name"] == "composite" else 0
    return range(task["seed"], task["seed"] + task["size"] + tasks)


def overlap(train: dict, held_out: dict) -> range | None:
    """The seeds two sources ({name, size, seed, config}) of the same task and config both draw items from, or
    None: a held-out source whose seeds meet the train source's repeats its problems.

    >>> overlap({"name": "countdown", "size": 100, "seed": 1, "config": {}},
    ...         {"name": "countdown", "size": 10, "seed": 50, "config": {}})
    range(50, 60)
    >>> overlap({"name": "countdown", "size": 100, "seed": 1, "config": {}},
    ...         {"name": "countdown", "size": 10, "seed": 101, "config": {}}) is None
    True
    """
    if (train["name"], train["config"] or {}) != (held_out["name"], held_out["config"] or {}):
        return None
    a, b = seeds(train), seeds(held_out)
    both = range(max(a.start, b.start), min(a.stop, b.stop))
    return both if both else None
