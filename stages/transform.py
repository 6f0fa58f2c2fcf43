"""transform: raw rows -> prompts table (prompt_id, prompt messages, answer, passthrough columns).

A transform follows axolotl's custom-prompt-strategy convention: `fn(cfg)` returns
`(transform_fn, {"remove_columns": [...]})`, and `transform_fn(example, tokenizer=None)`
returns the new row, which must carry `prompt` (a string or a list of chat messages)
and `answer`. Columns not removed pass through (reward functions receive them).
`transform.type` names a built-in below or a user function as `module.fn`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from stages.imports import load_function
from stages.schemas import PROMPTS, write_table

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class TransformConfig(BaseModel):
    """How raw rows become prompts."""

    model_config = ConfigDict(extra="forbid")

    type: str = "question_answer"
    """A built-in (`question_answer`, `messages`, `text`) or `module.fn` (axolotl convention)."""
    paths: dict[str, str] | None = None
    """Local files per split, e.g. {train: data/train.jsonl, eval: data/eval.jsonl}
    (jsonl, json, parquet, csv). Unset: the built-in demo task's splits."""
    question_field: str = "question"
    """question_answer: the column holding the user's question."""
    answer_field: str = "answer"
    """question_answer: the column holding the reference answer."""
    messages_field: str = "messages"
    """messages: the column holding a chat; its last assistant turn becomes the answer."""
    text_field: str = "text"
    """text: the column holding a raw document; it becomes the prompts table's `text` (no prompt, no answer)."""
    system_prompt: str | None = None
    """Prepended as a system message when set."""
    on_bad_rows: Literal["fail", "drop"] = "fail"
    """A row the transform cannot turn into a prompt (a missing field, a transform that raises or returns
    no prompt). fail: stop before anything is written, naming every bad row (file, row, field, reason);
    drop: leave them out, count them and record their indices in the stage's manifest and the run's
    summary (as `preferences.on_bad_rows`)."""


MAX_LISTED = 10  # bad rows named in a BadRowsError message
MAX_DROPPED_INDICES = 100  # dropped row indices kept per split in the manifest


class BadRowError(ValueError):
    """A raw row the transform cannot turn into a prompt."""


class BadRowsError(BadRowError):
    """Bad rows under `on_bad_rows: fail`; `bad` holds every (file, row index, reason)."""

    def __init__(self, bad: list[tuple[str, int, str]]):
        self.bad = bad
        listed = "\n".join(f"  {source} row {index}: {reason}" for source, index, reason in bad[:MAX_LISTED])
        more = f"\n  ... and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
        super().__init__(f"transform: {len(bad)} bad row(s) (set transform.on_bad_rows: drop to leave them "
                         f"out):\n{listed}{more}")


def _question_answer(cfg: TransformConfig):
    def transform_fn(example: dict, tokenizer=None) -> dict:
        for field in (cfg.question_field, cfg.answer_field):
            if example.get(field) in (None, ""):
                raise KeyError(field)
        return {"prompt": [{"role": "user", "content": str(example[cfg.question_field])}],
                "answer": str(example[cfg.answer_field])}

    return transform_fn, {"remove_columns": [cfg.question_field, cfg.answer_field]}


def _messages(cfg: TransformConfig):
    def transform_fn(example: dict, tokenizer=None) -> dict:
        messages = example.get(cfg.messages_field)
        if not messages or messages[-1].get("role") != "assistant":
            raise KeyError(f"{cfg.messages_field} (needs a chat ending with an assistant turn)")
        return {"prompt": list(messages[:-1]), "answer": messages[-1]["content"]}

    return transform_fn, {"remove_columns": [cfg.messages_field]}


def _text(cfg: TransformConfig):
    """Raw documents (axolotl's `completion` type): no prompt, the document in column `text` (ebft.mode: strided
    and language-modelling SFT read it)."""
    def transform_fn(example: dict, tokenizer=None) -> dict:
        if example.get(cfg.text_field) in (None, ""):
            raise KeyError(cfg.text_field)
        return {"prompt": [], "answer": "", "text": str(example[cfg.text_field])}

    return transform_fn, {"remove_columns": [cfg.text_field]}


BUILTINS: dict[str, Callable] = {"question_answer": _question_answer, "messages": _messages, "text": _text}


def read_rows(path: Path) -> list[dict]:
    """Rows of a local jsonl/json/parquet/csv file."""
    suffix = path.suffix.lower()
    if not path.exists():
        raise FileNotFoundError(f"transform.paths: {path} does not exist")
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if suffix == ".csv":
        import pyarrow.csv as pcsv

        # Every column as text: type inference would turn an answer "5" into "5.0" and "007" into "7.0".
        names = pcsv.open_csv(path).schema.names
        as_text = pcsv.ConvertOptions(column_types={name: pa.string() for name in names})
        return pcsv.read_csv(path, convert_options=as_text).to_pylist()
    if suffix == ".jsonl":
        rows = []
        for line_no, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise BadRowError(f"{path}:{line_no}: not valid JSON ({e.msg})") from e
        return rows
    if suffix == ".json":
        data = json.loads(path.read_text())
        return data if isinstance(data, list) else data.get("data", data.get("rows"))
    raise ValueError(f"transform.paths: {path} has suffix {suffix!r}; use one of {SUFFIXES}")


def _normalize_prompt(prompt: Any) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise TypeError("prompt must be a string or a list of {role, content} messages")


def _transform_row(cfg: TransformConfig, transform_fn: Callable, remove: set, example: dict, split: str,
                   index: int) -> dict:
    """One raw row as a prompts row; BadRowError(reason) when it cannot be one."""
    try:
        new = transform_fn(dict(example), tokenizer=None)
    except KeyError as e:
        raise BadRowError(f"missing or empty field {e.args[0]!s}") from None
    except Exception as e:
        raise BadRowError(f"transform {cfg.type!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(new, dict):
        raise BadRowError(f"transform {cfg.type!r} returned {type(new).__name__}, expected a dict")
    for field in ("prompt", "answer"):
        if new.get(field) is None:
            raise BadRowError(f"transformed row has no {field!r} (got keys {sorted(new)})")
    try:
        prompt = _normalize_prompt(new["prompt"])
    except TypeError as e:
        raise BadRowError(f"field 'prompt': {e}") from None
    if cfg.system_prompt:
        prompt = [{"role": "system", "content": cfg.system_prompt}] + prompt
    row = {k: v for k, v in example.items() if k not in remove}
    row.update(new)
    row.update(prompt=prompt, answer=str(new["answer"]))
    row.setdefault("prompt_id", f"{split}-{index:06d}")
    row["prompt_id"] = str(row["prompt_id"])
    return row


def split_rows(cfg: TransformConfig, rows: list[dict], split: str, source: str) -> tuple[list[dict], list[tuple]]:
    """(prompts rows, bad rows as (source, row index, reason)) of one split's raw rows."""
    builder = load_function(cfg.type, "transform.type", BUILTINS)
    transform_fn, options = builder(cfg)
    remove = set((options or {}).get("remove_columns", []))
    good, bad = [], []
    for index, example in enumerate(rows):
        try:
            good.append(_transform_row(cfg, transform_fn, remove, example, split, index))
        except BadRowError as e:
            bad.append((source, index, str(e)))
    return good, bad


def transform_rows(cfg: TransformConfig, rows: list[dict], split: str, source: str) -> list[dict]:
    """Apply the configured transform to raw rows; bad rows raise one BadRowsError naming each."""
    good, bad = split_rows(cfg, rows, split, source)
    if bad:
        raise BadRowsError(bad)
    return good


def run(cfg: TransformConfig, raw_files: dict[str, Path], out_dir: Path) -> dict:
    """Transform each split's raw file into out_dir/<split>.parquet; return row counts per split, and
    under `on_bad_rows: drop` a `dropped` entry per split with bad rows ({rows, indices, reasons}).
    Under `fail`, a bad row anywhere raises BadRowsError before any file is written."""
    results, all_bad = {}, []
    for split, path in raw_files.items():
        raw = read_rows(Path(path))
        if not raw:
            raise BadRowError(f"{path}: no rows")
        good, bad = split_rows(cfg, raw, split, f"{path} ({split})")
        results[split] = (path, good, bad)
        all_bad += bad
    if all_bad and cfg.on_bad_rows == "fail":
        raise BadRowsError(all_bad)
    counts: dict = {}
    for split, (path, rows, bad) in results.items():
        if not rows:
            reasons = "; ".join(f"row {index}: {reason}" for _, index, reason in bad[:3])
            raise BadRowError(f"{path}: every row is bad ({reasons}{'; ...' if len(bad) > 3 else ''})")
        try:
            # columns from every row, not only the first (Table.from_pylist keeps only the first row's keys)
            names = list(dict.fromkeys(k for row in rows for k in row))
            table = pa.Table.from_pydict({k: [row.get(k) for row in rows] for k in names})
            write_table(table, out_dir / f"{split}.parquet", PROMPTS, extra_ok=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise BadRowError(f"{path}: rows do not share one column type: {e}") from e
        counts[split] = len(rows)
        if bad:
            counts.setdefault("dropped", {})[split] = {
                "rows": len(bad), "indices": [index for _, index, _ in bad[:MAX_DROPPED_INDICES]],
                "reasons": [reason for _, _, reason in bad[:MAX_LISTED]]}
    return counts
