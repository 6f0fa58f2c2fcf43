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
from typing import Any, Callable

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from stages.imports import load_function
from stages.schemas import PROMPTS, write_table

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class TransformConfig(BaseModel):
    """How raw rows become prompts."""

    model_config = ConfigDict(extra="forbid")

    type: str = "question_answer"
    """A built-in (`question_answer`, `messages`) or `module.fn` (axolotl convention)."""
    paths: dict[str, str] | None = None
    """Local files per split, e.g. {train: data/train.jsonl, eval: data/eval.jsonl}
    (jsonl, json, parquet, csv). Unset: the built-in demo task's splits."""
    question_field: str = "question"
    """question_answer: the column holding the user's question."""
    answer_field: str = "answer"
    """question_answer: the column holding the reference answer."""
    messages_field: str = "messages"
    """messages: the column holding a chat; its last assistant turn becomes the answer."""
    system_prompt: str | None = None
    """Prepended as a system message when set."""


class BadRowError(ValueError):
    """A raw row the transform cannot turn into a prompt."""


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


BUILTINS: dict[str, Callable] = {"question_answer": _question_answer, "messages": _messages}


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


def transform_rows(cfg: TransformConfig, rows: list[dict], split: str, source: str) -> list[dict]:
    """Apply the configured transform to raw rows; a bad row raises with its index."""
    builder = load_function(cfg.type, "transform.type", BUILTINS)
    transform_fn, options = builder(cfg)
    remove = set((options or {}).get("remove_columns", []))
    out = []
    for index, example in enumerate(rows):
        where = f"{source} row {index}"
        try:
            new = transform_fn(dict(example), tokenizer=None)
        except KeyError as e:
            raise BadRowError(f"{where}: missing or empty field {e.args[0]!s}") from None
        except Exception as e:
            raise BadRowError(f"{where}: transform {cfg.type!r} failed: {type(e).__name__}: {e}") from e
        if not isinstance(new, dict):
            raise BadRowError(f"{where}: transform {cfg.type!r} returned {type(new).__name__}, expected a dict")
        for field in ("prompt", "answer"):
            if new.get(field) is None:
                raise BadRowError(f"{where}: transformed row has no {field!r} (got keys {sorted(new)})")
        try:
            prompt = _normalize_prompt(new["prompt"])
        except TypeError as e:
            raise BadRowError(f"{where}: field 'prompt': {e}") from None
        if cfg.system_prompt:
            prompt = [{"role": "system", "content": cfg.system_prompt}] + prompt
        row = {k: v for k, v in example.items() if k not in remove}
        row.update(new)
        row.update(prompt=prompt, answer=str(new["answer"]))
        row.setdefault("prompt_id", f"{split}-{index:06d}")
        row["prompt_id"] = str(row["prompt_id"])
        out.append(row)
    return out


def run(cfg: TransformConfig, raw_files: dict[str, Path], out_dir: Path) -> dict:
    """Transform each split's raw file into out_dir/<split>.parquet; return row counts."""
    counts = {}
    for split, path in raw_files.items():
        rows = transform_rows(cfg, read_rows(Path(path)), split, str(path))
        if not rows:
            raise BadRowError(f"{path}: no rows")
        try:
            # columns from every row, not only the first (Table.from_pylist keeps only the first row's keys)
            names = list(dict.fromkeys(k for row in rows for k in row))
            table = pa.Table.from_pydict({k: [row.get(k) for row in rows] for k in names})
            write_table(table, out_dir / f"{split}.parquet", PROMPTS, extra_ok=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise BadRowError(f"{path}: rows do not share one column type: {e}") from e
        counts[split] = len(rows)
    return counts
