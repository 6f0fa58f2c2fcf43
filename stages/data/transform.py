"""transform: raw rows -> prompts table (prompt_id, prompt messages, answer, passthrough columns).

A transform follows axolotl's custom-prompt-strategy convention: `fn(cfg)` returns
`(transform_fn, {"remove_columns": [...]})`, and `transform_fn(example, tokenizer=None)` (or axolotl's newer
`processing_class=None`) returns the new row, which must carry `prompt` (a string or a list of chat messages)
and should carry `answer` (the gold answer; without one the row's answer is null, which rewards that need
none accept, and accuracy rewards and the eval stage refuse, naming the prompts). Columns not removed pass
through (reward functions receive them).
`transform.type` names a built-in below or a user function as `module.fn`.

Raw rows come from `transform.paths` (a local file per split), the demo task, or `transform.datasets`
(axolotl's list of sources: hub datasets, local files and folders; stages/data/sources.py reads them): their
rows, in order, are the train split, and `test_datasets` or `val_set_size` gives the eval split (without
either, the prompts have a train split only and the run evaluates nothing held out).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stages.data import sources
from stages.data.schemas import PROMPTS, write_table
from stages.data.sources import BadRowError, DatasetSource, UnreadableRow, read_rows
from stages.runtime.imports import example_caller, load_function
from stages.runtime.keys import key_when_set

SOURCE_FIELDS = ("type", "question_field", "answer_field", "messages_field", "text_field", "system_prompt",
                 "server_name")
"""What a `transform.datasets` entry may set for its own rows; unset, the transform section's applies."""



class TransformConfig(BaseModel):
    """How raw rows become prompts."""

    model_config = ConfigDict(extra="forbid")

    type: str = "question_answer"
    """A built-in (`question_answer`, `messages`, `text`, `nemo_gym`, `reasoning_gym`; under ebft.mode strided axolotl's
    `ebft_strided_structured.transform` and `ebft_pretrain.transform`) or `module.fn` (axolotl convention)."""
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
    server_name: str | None = key_when_set(None)
    """nemo_gym: the NeMo Gym resources server that verifies the rows (axolotl's `nemo_gym_datasets` server_name);
    a row's `agent_ref.name` takes precedence where it names a resources server, not an agent."""
    datasets: list[DatasetSource] | None = None
    """Sources of the train split (axolotl's `datasets:`; instead of `paths`): hub datasets, local files or
    folders, each with its own name, split slice, data_files, revision, type and field names. Their rows, in
    order, are the train split; the stage's summary counts each source's rows. test_datasets or val_set_size
    make an eval split the run evaluates on (base, final, eval.every_rounds); without either, as in axolotl's GRPO
    examples, there is none and the run reports its training metrics. SFT is off
    unless asked for (axolotl's RL runs start from the model as it is); to warm-start, set sft.enabled: true with
    sft.split: train (the same rows) and sft.completion_field at the target column, e.g. answer."""
    test_datasets: list[DatasetSource] | None = None
    """Sources of the eval split (axolotl's `test_datasets:`), same shape as datasets."""
    val_set_size: float | None = Field(None, ge=0)
    """Hold out rows of the datasets as the eval split (axolotl's `val_set_size`): a fraction in (0, 1) of
    the train sources' rows (rounded up), or a row count (a whole number >= 1). 0 or unset: none."""
    val_set_seed: int = 0
    """Seed of the val_set_size draw (random.Random(seed).sample over all train rows). Not the top-level
    `seed`: runs with different training seeds evaluate on the same held-out rows."""
    on_bad_rows: Literal["fail", "drop"] = "fail"
    """A row the transform cannot turn into a prompt (a missing field, a transform that raises or returns
    no prompt; bytes that are not UTF-8, a jsonl line that is not a JSON object, a CSV row of the wrong width).
    A prompt too long for the model is checked later, where the model is known (the transform runs before it):
    rollout and eval stop on it naming its row, leave it out under drop (their `too_long_prompts`, which follows
    this field), and rollout.max_prompt_length cuts it instead. fail: stop before anything is written, naming
    every bad row (file, row, field, reason);
    drop: leave them out, count them and record their indices in the stage's manifest and the run's
    summary (as `preferences.on_bad_rows`)."""

    @model_validator(mode="after")
    def _one_source_of_rows(self):
        holdout = bool(self.val_set_size)
        if self.datasets and self.paths:
            raise ValueError("transform.datasets and transform.paths both name the rows; use one of them")
        if not self.datasets and (self.test_datasets or holdout):
            raise ValueError(f"transform.{'test_datasets' if self.test_datasets else 'val_set_size'} needs "
                             "transform.datasets (the train sources)")
        if self.datasets and self.test_datasets and holdout:
            raise ValueError("transform.test_datasets and transform.val_set_size both make the eval split; use one")
        if holdout and self.val_set_size >= 1 and self.val_set_size != int(self.val_set_size):
            raise ValueError(f"transform.val_set_size {self.val_set_size:g}: a fraction below 1 or a whole row count")
        self._held_out_tasks_apart()
        self._held_out_problems_apart()
        sources_types = {s.type or self.type for s in (self.datasets or []) + (self.test_datasets or [])}
        if self.server_name and "nemo_gym" not in sources_types | {self.type}:
            raise ValueError("transform.server_name names the NeMo Gym server of type: nemo_gym rows; no source "
                             "has that type")
        return self

    def _held_out_problems_apart(self):
        """A human_eval source of test_datasets selects none of the problems of a human_eval source of datasets."""
        def splits(entries):
            return [(i, s.split) for i, s in enumerate(entries or []) if s.path == sources.humaneval.PATH]

        for i, train in splits(self.datasets):
            for j, held in splits(self.test_datasets):
                try:
                    both = sources.humaneval.overlap(train, held)
                except (ValueError, AssertionError):
                    continue  # a split the source cannot read: the source names it
                if both:
                    raise ValueError(
                        f"transform.test_datasets.{j}: human_eval split {held or 'train'} selects {len(both)} "
                        f"problem(s) transform.datasets.{i} (split {train or 'train'}) trains on (HumanEval/"
                        f"{both[0]}, ...), so the eval would repeat train problems; give them disjoint splits "
                        "(train[:132] and train[132:]), or use val_set_size")

    def _held_out_tasks_apart(self):
        """A reasoning-gym source of test_datasets draws none of the seeds of a datasets source of the same task
        and config (item i of seed s comes from Random(s + i): seeds that meet repeat the train problems)."""
        def tasks(entries):
            return [(i, {"name": s.name, "size": s.size, "seed": s.seed, "config": s.config})
                    for i, s in enumerate(entries or []) if s.path == sources.gym.PATH]

        for i, train in tasks(self.datasets):
            for j, held in tasks(self.test_datasets):
                if (both := sources.gym.overlap(train, held)) is not None:
                    raise ValueError(
                        f"transform.test_datasets.{j}: {held['name']} seeds {both.start}..{both.stop - 1} are also "
                        f"drawn by transform.datasets.{i} (item i of seed s is reasoning-gym's Random(s + i)), so the "
                        f"eval would repeat train problems; set its seed to {sources.gym.seeds(train).stop} or more, "
                        "or use val_set_size")


MAX_LISTED = 10  # bad rows named in a BadRowsError message
MAX_DROPPED_INDICES = 100  # dropped row indices kept per split in the manifest


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


def _reasoning_gym(cfg: TransformConfig):
    """A reasoning-gym source's rows (stages/data/reasoning_gym_source.py): the question as the prompt, the
    answer as gold (None where the task has no single one: its scorer checks the answer against the entry), the
    `reasoning_gym` column kept for the `reasoning_gym` reward."""
    def transform_fn(example: dict, tokenizer=None) -> dict:
        if not example.get("question") or not example.get("reasoning_gym"):
            raise KeyError("question and reasoning_gym (the rows of a path: reasoning_gym source)")
        return {"prompt": [{"role": "user", "content": example["question"]}], "answer": example.get("answer")}

    return transform_fn, {"remove_columns": ["question"]}


def _human_eval(cfg: TransformConfig):
    """A human_eval source's rows (stages/data/human_eval_source.py): the problem's code prompt (signature and
    docstring) in a user message asking for the whole function in a ```python block, no gold answer (the
    problem's tests judge), the `human_eval` column kept for the `human_eval` reward."""
    def transform_fn(example: dict, tokenizer=None) -> dict:
        if not example.get("prompt") or not example.get("human_eval"):
            raise KeyError("prompt and human_eval (the rows of a path: human_eval source)")
        return {"prompt": [{"role": "user", "content": sources.humaneval.user_message(example["prompt"])}],
                "answer": None}

    return transform_fn, {"remove_columns": []}


def _nemo_gym(cfg: TransformConfig):
    """A NeMo Gym dataset's rows (JSON Lines: `responses_create_params.input` and the task's own fields, such as
    reasoning_gym's question, answer and metadata): the input messages as the prompt, `answer` as gold where it is
    text or a number, the row's fields as JSON text in column `nemo_gym` (what `/verify` receives back, whatever
    their shape per task: Parquet would need one shape) and the resources server that verifies the row in column
    `nemo_gym_server` (its agent_ref.name where that names a resources server, as axolotl's plugin reads it, else
    the source's server_name)."""
    def transform_fn(example: dict, tokenizer=None) -> dict:
        params = example.get("responses_create_params")
        given = params.get("input") if isinstance(params, dict) else None
        if not given:
            raise KeyError("responses_create_params.input")
        ref = example.get("agent_ref") if isinstance(example.get("agent_ref"), dict) else {}
        server = ref.get("name") if ref.get("name") and ref.get("type") != "responses_api_agents" else cfg.server_name
        if not server:
            raise KeyError("server_name (set it on the source, or give the row an agent_ref.name)")
        answer = example.get("answer")
        return {"prompt": _input_messages(given), "nemo_gym_server": server,
                "answer": answer if isinstance(answer, (str, int, float)) and not isinstance(answer, bool) else None,
                "nemo_gym": json.dumps(example, ensure_ascii=False)}

    return transform_fn, {"remove_columns": ALL_COLUMNS}


def _input_messages(given) -> list[dict]:
    """A Responses API `input` (text, or messages whose content is text or input_text parts) as chat messages."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages = []
    for item in given:
        if not isinstance(item, dict) or "role" not in item or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise ValueError(f"responses_create_params.input holds a {kind!r} item, not a message: a prompt here is "
                             "messages (single-turn; a multi-turn environment is rollout.rollout_func)")
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text") or "" for part in content
                              if isinstance(part, dict) and part.get("type") in ("input_text", "text", "output_text"))
        messages.append({"role": "system" if item["role"] == "developer" else item["role"], "content": content or ""})
    return messages


def _first(example: dict, fields: tuple[str, ...]):
    """The value of the first of `fields` the row has (axolotl's nested `example.get(a, example.get(b, ...))`)."""
    return next((example[f] for f in fields if f in example), None)


def _ebft_strided_structured(cfg: TransformConfig):
    """axolotl's `ebft_strided_structured.transform` (strided EBFT on prompt + completion rows): the prompt from
    `input`, else `prompt`, else `question`, the completion from `output`, else `completion`, else `answer` (its
    fields, in its order). The row keeps both texts, the prompt as `document_prompt`, the completion as `text`;
    the strided rollout tokenizes them with the policy's tokenizer, as axolotl's transform does, and writes blocks
    in the completion only (stages/training/ebft_strided.py)."""
    def transform_fn(example: dict, tokenizer=None) -> dict:
        completion = _first(example, ("output", "completion", "answer"))
        if completion in (None, ""):
            raise KeyError("output (or completion, or answer: the completion)")
        prompt = _first(example, ("input", "prompt", "question"))
        return {"prompt": [], "answer": "", "text": str(completion), "document_prompt": str(prompt or "")}

    return transform_fn, {"remove_columns": ALL_COLUMNS}


def _ebft_pretrain(cfg: TransformConfig):
    """axolotl's example `ebft_pretrain.transform` (strided EBFT on raw text): the document from `question`, else
    `text`, tokenized with the tokenizer's special tokens (`document_prompt` empty), as its transform does."""
    def transform_fn(example: dict, tokenizer=None) -> dict:
        text = _first(example, ("question", "text"))
        if text in (None, ""):
            raise KeyError("question (or text: the document)")
        return {"prompt": [], "answer": "", "text": str(text), "document_prompt": ""}

    return transform_fn, {"remove_columns": ["question", "answer"]}


BUILTINS: dict[str, Callable] = {"question_answer": _question_answer, "messages": _messages, "text": _text,
                                 "nemo_gym": _nemo_gym, "reasoning_gym": _reasoning_gym, "human_eval": _human_eval,
                                 "ebft_strided_structured.transform": _ebft_strided_structured,
                                 "ebft_pretrain.transform": _ebft_pretrain}
"""Built-in transform types; the last two are axolotl's strided EBFT transforms by their names (axolotl ships the
first and its examples the second; both tokenize with the policy's tokenizer, which posttrain's strided rollout
does), so its configs run as written and a file of that name beside the config is not imported."""





def _normalize_prompt(prompt: Any) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise TypeError("prompt must be a string or a list of {role, content} messages")


ALL_COLUMNS = "__all__"
"""`remove_columns: "__all__"` (axolotl's transforms): drop every column of the raw row, keep what the transform
returns."""


def removed_columns(value, type_name: str) -> set:
    """The columns a transform's `remove_columns` option drops: a list of names, one name, or ALL_COLUMNS."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, (list, tuple, set)) and all(isinstance(v, str) for v in value):
        return set(value)
    raise ValueError(f"transform {type_name!r}: remove_columns {value!r}; use a list of column names or "
                     f"{ALL_COLUMNS!r}")


def _transform_row(cfg: TransformConfig, transform_fn: Callable, remove: set, example: dict, split: str,
                   index: int) -> dict:
    """One raw row as a prompts row; BadRowError(reason) when it cannot be one."""
    if isinstance(example, UnreadableRow):  # bytes that are not UTF-8, a line that is not a JSON object, ...
        raise BadRowError(example.reason)
    try:
        new = example_caller(transform_fn)(dict(example))
    except KeyError as e:
        raise BadRowError(f"missing or empty field {e.args[0]!s}") from None
    except Exception as e:
        raise BadRowError(f"transform {cfg.type!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(new, dict):
        raise BadRowError(f"transform {cfg.type!r} returned {type(new).__name__}, expected a dict")
    if new.get("prompt") is None:
        raise BadRowError(f"transformed row has no 'prompt' (got keys {sorted(new)})")
    try:
        prompt = _normalize_prompt(new["prompt"])
    except TypeError as e:
        raise BadRowError(f"field 'prompt': {e}") from None
    if cfg.system_prompt:
        prompt = [{"role": "system", "content": cfg.system_prompt}] + prompt
    row = {k: v for k, v in example.items() if k not in remove and ALL_COLUMNS not in remove}
    row.update(new)
    # no answer: fine for rewards that need none (format, a reward model); accuracy rewards and eval refuse it
    row.update(prompt=prompt, answer=None if new.get("answer") is None else str(new["answer"]))
    row.setdefault("prompt_id", f"{split}-{index:06d}")
    row["prompt_id"] = str(row["prompt_id"])
    return row


def split_rows(cfg: TransformConfig, rows: list, split: str, source: str, first_id: int = 0,
               what: str = "transform.type") -> tuple[list[dict], list[tuple]]:
    """(prompts rows, bad rows as (source, row index, reason)) of raw rows: dicts (row index = position) or
    (row index in the source, row) pairs. Prompt ids number the rows of the split from first_id on; `what`
    is the config key of the type, for its errors."""
    builder = load_function(cfg.type, what, BUILTINS)
    transform_fn, options = builder(cfg)
    remove = removed_columns((options or {}).get("remove_columns", []), cfg.type)
    good, bad = [], []
    for position, item in enumerate(rows):
        index, example = item if isinstance(item, tuple) else (position, item)
        try:
            good.append(_transform_row(cfg, transform_fn, remove, example, split, first_id + position))
        except BadRowError as e:
            bad.append((source, index, str(e)))
    return good, bad


def transform_rows(cfg: TransformConfig, rows: list[dict], split: str, source: str) -> list[dict]:
    """Apply the configured transform to raw rows; bad rows raise one BadRowsError naming each."""
    good, bad = split_rows(cfg, rows, split, source)
    if bad:
        raise BadRowsError(bad)
    return good


@dataclass
class Part:
    """Raw rows bound for one split from one source: a file of transform.paths or an entry of datasets."""

    source: str
    """Names the source in errors and counts: `path (split)`, or `path (name=..., split=...)`."""
    cfg: TransformConfig
    """The transform its rows go through: the section's, with the source's own type and field names."""
    rows: list[tuple[int, dict]]
    """(row index in the source, raw row)."""
    key: str = ""
    """The config entry of a datasets source (`datasets.0`), for its counts; '' for a file of paths."""
    what: str = "transform.type"
    """The config key of its type, for errors."""


def file_parts(cfg: TransformConfig, raw_files: dict[str, Path]) -> dict[str, list[Part]]:
    """One part per split: the rows of its local file."""
    parts = {}
    for split, path in raw_files.items():
        raw = read_rows(Path(path))
        if not raw:
            raise BadRowError(f"{path}: no rows")
        parts[split] = [Part(f"{path} ({split})", cfg, list(enumerate(raw)))]
    return parts


def dataset_parts(cfg: TransformConfig) -> dict[str, list[Part]]:
    """With transform.datasets: a part per source of the train split, and of the eval split those of
    test_datasets, or val_set_size rows drawn from the train parts."""
    def parts_of(entries: list[DatasetSource], name: str) -> list[Part]:
        own = [(i, s, {f: getattr(s, f) for f in SOURCE_FIELDS if getattr(s, f) is not None})
               for i, s in enumerate(entries)]
        return [Part(sources.describe(s), cfg.model_copy(update=fields), sources.load(s), f"{name}.{i}",
                     f"transform.{name}.{i}.type" if s.type else "transform.type") for i, s, fields in own]

    train = parts_of(cfg.datasets, "datasets")
    if cfg.test_datasets:
        return {"train": train, "eval": parts_of(cfg.test_datasets, "test_datasets")}
    if not cfg.val_set_size:  # a train split only (axolotl's GRPO examples): the run has no held-out eval
        return {"train": train}
    kept, held = hold_out(train, cfg.val_set_size, cfg.val_set_seed)
    return {"train": kept, "eval": held}


def hold_out(parts: list[Part], size: float, seed: int) -> tuple[list[Part], list[Part]]:
    """(train parts, eval parts): `size` of all the parts' rows held out (sources.hold_out); parts left empty
    are left out."""
    kept, held = sources.hold_out([p.rows for p in parts], size, seed, "transform.val_set_size")
    return ([Part(p.source, p.cfg, rows, p.key, p.what) for p, rows in zip(parts, kept) if rows],
            [Part(p.source, p.cfg, rows, p.key, p.what) for p, rows in zip(parts, held) if rows])


def run(cfg: TransformConfig, raw_files: dict[str, Path] | None, out_dir: Path) -> dict:
    """Transform each split's raw rows into out_dir/<split>.parquet: the files in raw_files ({split: path}),
    or with transform.datasets the sources' rows (train) and test_datasets' or val_set_size's (eval). Return
    row counts per split; under `on_bad_rows: drop` a `dropped` entry per split with bad rows ({rows,
    indices, reasons}); with datasets, `sources`: each source's kept and dropped rows per split.
    Under `fail`, a bad row anywhere raises BadRowsError before any file is written."""
    parts = dataset_parts(cfg) if cfg.datasets else file_parts(cfg, raw_files)
    results, all_bad, per_part = {}, [], []
    for split, split_parts in parts.items():
        good, bad, first_id = [], [], 0
        for part in split_parts:
            part_good, part_bad = split_rows(part.cfg, part.rows, split, part.source, first_id, part.what)
            good, bad, first_id = good + part_good, bad + part_bad, first_id + len(part.rows)
            per_part.append((part, split, len(part_good), len(part_bad)))
        results[split] = (" + ".join(p.source for p in split_parts), good, bad)
        all_bad += bad
    if all_bad and cfg.on_bad_rows == "fail":
        raise BadRowsError(all_bad)
    counts: dict = {}
    for split, (where, rows, bad) in results.items():
        if not rows:
            reasons = "; ".join(f"row {index}: {reason}" for _, index, reason in bad[:3])
            raise BadRowError(f"{where}: every row is bad ({reasons}{'; ...' if len(bad) > 3 else ''})")
        try:
            # columns from every row, not only the first (Table.from_pylist keeps only the first row's keys)
            names = list(dict.fromkeys(k for row in rows for k in row))
            table = pa.Table.from_pydict({k: [row.get(k) for row in rows] for k in names})
            write_table(table, out_dir / f"{split}.parquet", PROMPTS, extra_ok=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise BadRowError(f"{where}: rows do not share one column type: {e}") from e
        counts[split] = len(rows)
        if bad:
            counts.setdefault("dropped", {})[split] = {
                "rows": len(bad), "indices": [index for _, index, _ in bad[:MAX_DROPPED_INDICES]],
                "reasons": [f"{source} row {index}: {reason}" for source, index, reason in bad[:MAX_LISTED]]}
    if cfg.datasets:
        counts["sources"] = source_counts(per_part)
    return counts


def source_counts(per_part: list[tuple[Part, str, int, int]]) -> list[dict]:
    """Per datasets entry, in config order: {key, source, rows (kept), dropped, splits: {split: kept rows}}."""
    entries: dict[str, dict] = {}
    for part, split, kept, dropped in per_part:
        entry = entries.setdefault(part.key, {"key": part.key, "source": part.source, "rows": 0, "dropped": 0,
                                              "splits": {}})
        entry["rows"] += kept
        entry["dropped"] += dropped
        entry["splits"][split] = entry["splits"].get(split, 0) + kept
    return list(entries.values())
