"""Tests for stages/data/transform.py: raw files -> prompts.parquet."""

from __future__ import annotations

import json
import re
import textwrap
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.data import transform
from stages.data.schemas import PROMPTS
from stages.data.sources import SourceError
from stages.data.transform import BadRowError, TransformConfig

RAW = [
    {"question": "What is 2+3?", "answer": "5", "source": "gsm", "level": 1},
    {"question": "What is 7*6?", "answer": "42", "source": "mathqa", "level": 2},
    {"question": "Write 0.5 as a fraction.", "answer": "1/2", "source": "gsm", "level": 3},
]

EXPECTED = [
    {
        "prompt_id": "train-000000",
        "prompt": [{"role": "user", "content": "What is 2+3?"}],
        "answer": "5",
        "source": "gsm",
        "level": 1,
    },
    {
        "prompt_id": "train-000001",
        "prompt": [{"role": "user", "content": "What is 7*6?"}],
        "answer": "42",
        "source": "mathqa",
        "level": 2,
    },
    {
        "prompt_id": "train-000002",
        "prompt": [{"role": "user", "content": "Write 0.5 as a fraction."}],
        "answer": "1/2",
        "source": "gsm",
        "level": 3,
    },
]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")  # trailing blank line is skipped


def _write_json(path: Path, rows: list[dict]) -> None:
    path.write_text(json.dumps(rows))


def _write_json_data(path: Path, rows: list[dict]) -> None:
    path.write_text(json.dumps({"data": rows}))


def _write_parquet(path: Path, rows: list[dict]) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path)


def _write_csv(path: Path, rows: list[dict]) -> None:
    columns = list(rows[0])
    lines = [",".join(columns)] + [",".join(f'"{r[c]}"' if isinstance(r[c], str) else str(r[c]) for c in columns)
                                   for r in rows]
    path.write_text("\n".join(lines) + "\n")


WRITERS = {
    "jsonl": (".jsonl", _write_jsonl),
    "json": (".json", _write_json),
    "json-data": (".json", _write_json_data),
    "parquet": (".parquet", _write_parquet),
    "csv": (".csv", _write_csv),
}


def _raw_file(tmp_path: Path, fmt: str, rows: list[dict], stem: str = "train") -> Path:
    suffix, writer = WRITERS[fmt]
    path = tmp_path / f"{stem}{suffix}"
    writer(path, rows)
    return path


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch):
    """Write a user module into tmp_path under a unique name; return the name."""

    def write(source: str) -> str:
        name = f"user_transform_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        return name

    return write


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_question_answer_each_format(tmp_path, out_dir, fmt):
    path = _raw_file(tmp_path, fmt, RAW)

    counts = transform.run(TransformConfig(), {"train": path}, out_dir)

    assert counts == {"train": 3}
    table = pq.read_table(out_dir / "train.parquet")
    # The prompts schema comes first, then passthrough columns; `question` is removed.
    assert table.column_names == ["prompt_id", "prompt", "answer", "source", "level"]
    assert table.schema.field("prompt_id").type == pa.string()
    assert table.schema.field("prompt").type == PROMPTS.field("prompt").type
    assert table.schema.field("answer").type == pa.string()
    rows = table.to_pylist()
    if fmt == "csv":  # CSV has no types: accept the passthrough `level` as int or as text
        rows = [{**r, "level": int(r["level"])} for r in rows]
    assert rows == EXPECTED


def test_csv_numeric_answers_are_kept_verbatim(tmp_path, out_dir):
    path = tmp_path / "train.csv"
    path.write_text('question,answer\n"What is 2+3?","5"\n"Pad 7 to three digits.","007"\n')

    transform.run(TransformConfig(), {"train": path}, out_dir)

    assert pq.read_table(out_dir / "train.parquet").column("answer").to_pylist() == ["5", "007"]


def test_passthrough_column_missing_from_first_row_is_kept(tmp_path, out_dir):
    rows = [{"question": "a?", "answer": "1"}, {"question": "b?", "answer": "2", "hint": "think"}]

    transform.run(TransformConfig(), {"train": _raw_file(tmp_path, "jsonl", rows)}, out_dir)

    table = pq.read_table(out_dir / "train.parquet")
    assert table.column("hint").to_pylist() == [None, "think"]


def test_question_answer_custom_fields_and_multiple_splits(tmp_path, out_dir):
    train = [{"problem": "1+1?", "solution": 2, "prompt_id": 17, "tag": "a"},
             {"problem": "2+2?", "solution": 4, "prompt_id": 18, "tag": "b"}]
    evaluation = [{"problem": "3+3?", "solution": 6, "tag": "c"}]
    cfg = TransformConfig(question_field="problem", answer_field="solution")

    counts = transform.run(cfg, {"train": _raw_file(tmp_path, "jsonl", train, "train"),
                                 "eval": _raw_file(tmp_path, "parquet", evaluation, "eval")}, out_dir)

    assert counts == {"train": 2, "eval": 1}
    train_rows = pq.read_table(out_dir / "train.parquet").to_pylist()
    # An existing prompt_id column is kept (as a string); numeric answers become strings.
    assert train_rows == [
        {"prompt_id": "17", "prompt": [{"role": "user", "content": "1+1?"}], "answer": "2", "tag": "a"},
        {"prompt_id": "18", "prompt": [{"role": "user", "content": "2+2?"}], "answer": "4", "tag": "b"},
    ]
    eval_rows = pq.read_table(out_dir / "eval.parquet").to_pylist()
    assert eval_rows == [
        {"prompt_id": "eval-000000", "prompt": [{"role": "user", "content": "3+3?"}], "answer": "6", "tag": "c"},
    ]


def test_system_prompt_is_prepended(tmp_path, out_dir):
    cfg = TransformConfig(system_prompt="Answer inside <answer></answer>.")

    transform.run(cfg, {"train": _raw_file(tmp_path, "jsonl", RAW[:2])}, out_dir)

    prompts = pq.read_table(out_dir / "train.parquet").column("prompt").to_pylist()
    assert prompts == [
        [{"role": "system", "content": "Answer inside <answer></answer>."},
         {"role": "user", "content": "What is 2+3?"}],
        [{"role": "system", "content": "Answer inside <answer></answer>."},
         {"role": "user", "content": "What is 7*6?"}],
    ]


def test_messages_builtin(tmp_path, out_dir):
    rows = [{"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}], "k": 1}]
    cfg = TransformConfig(type="messages", system_prompt="Be brief.")

    transform.run(cfg, {"train": _raw_file(tmp_path, "jsonl", rows)}, out_dir)

    assert pq.read_table(out_dir / "train.parquet").to_pylist() == [
        {"prompt_id": "train-000000",
         "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}],
         "answer": "hi", "k": 1},
    ]


USER_TRANSFORM = """
    SEEN = []

    def gsm8k(cfg):
        SEEN.append(cfg)

        def transform_fn(example, tokenizer=None):
            SEEN.append(("tokenizer", tokenizer))
            return {
                "prompt": [{"role": "user", "content": "Solve: " + example["problem"]}],
                "answer": example["solution"].split("####")[-1].strip(),
                "difficulty": example["meta"]["level"],
            }

        return transform_fn, {"remove_columns": ["problem", "solution", "meta"]}

    def plain_string(cfg):
        def transform_fn(example, tokenizer=None):
            return {"prompt": example["q"], "answer": example["a"]}

        return transform_fn, {"remove_columns": ["q", "a"]}

    def processing_class_style(cfg):
        def transform_fn(example, processing_class=None):  # axolotl's newer docs name the tokenizer so
            return {"prompt": example["q"], "answer": example["a"]}

        return transform_fn, {"remove_columns": ["q", "a"]}

    def example_only(cfg):
        return (lambda example: {"prompt": example["q"], "answer": example["a"]}), {"remove_columns": ["q", "a"]}

    def prompt_only(cfg):
        return (lambda example: {"prompt": example["q"]}), {"remove_columns": ["q", "a"]}

    def drop_all(cfg):
        return (lambda example: {"prompt": example["q"], "answer": example["a"]}), {"remove_columns": "__all__"}

    def drop_one(cfg):
        return (lambda example: {"prompt": example["q"], "answer": example["a"]}), {"remove_columns": "src"}

    def not_a_dict(cfg):
        return (lambda example, tokenizer=None: [example]), {}

    def bad_prompt(cfg):
        return (lambda example, tokenizer=None: {"prompt": [{"text": "x"}], "answer": "1"}), {}
"""


def test_remove_columns_all_or_one_name_as_axolotl_writes_them(tmp_path, out_dir, user_module):
    """axolotl's transforms return remove_columns as "__all__" (every raw column) or one name: neither is a set of
    letters."""
    name = user_module(USER_TRANSFORM)
    rows = [{"q": "1+1?", "a": "2", "src": "x", "s": 1}]
    for fn, columns in (("drop_all", ["prompt_id", "prompt", "answer"]),
                        ("drop_one", ["prompt_id", "prompt", "answer", "q", "a", "s"])):
        transform.run(TransformConfig(type=f"{name}.{fn}"), {"train": _raw_file(tmp_path, "jsonl", rows)}, out_dir)
        assert sorted(pq.read_table(out_dir / "train.parquet").column_names) == sorted(columns), fn


def test_user_transform_axolotl_convention(tmp_path, out_dir, user_module):
    name = user_module(USER_TRANSFORM)
    rows = [
        {"problem": "Tom has 3 apples and eats 1.", "solution": "3-1=2 #### 2", "meta": {"level": "easy"}, "src": "x"},
        {"problem": "Double 21.", "solution": "21*2 #### 42", "meta": {"level": "hard"}, "src": "y"},
    ]
    cfg = TransformConfig(type=f"{name}.gsm8k", system_prompt="Think step by step.")

    counts = transform.run(cfg, {"train": _raw_file(tmp_path, "jsonl", rows)}, out_dir)

    assert counts == {"train": 2}
    table = pq.read_table(out_dir / "train.parquet")
    assert table.column_names == ["prompt_id", "prompt", "answer", "src", "difficulty"]
    assert table.to_pylist() == [
        {"prompt_id": "train-000000",
         "prompt": [{"role": "system", "content": "Think step by step."},
                    {"role": "user", "content": "Solve: Tom has 3 apples and eats 1."}],
         "answer": "2", "src": "x", "difficulty": "easy"},
        {"prompt_id": "train-000001",
         "prompt": [{"role": "system", "content": "Think step by step."},
                    {"role": "user", "content": "Solve: Double 21."}],
         "answer": "42", "src": "y", "difficulty": "hard"},
    ]
    import importlib

    seen = importlib.import_module(name).SEEN
    assert seen[0] is cfg  # fn(cfg) receives the transform config
    assert seen[1:] == [("tokenizer", None), ("tokenizer", None)]


def test_user_transform_string_prompt_is_normalized(tmp_path, out_dir, user_module):
    name = user_module(USER_TRANSFORM)
    rows = [{"q": "Capital of France?", "a": "Paris"}]

    transform.run(TransformConfig(type=f"{name}.plain_string"), {"train": _raw_file(tmp_path, "csv", rows)}, out_dir)

    assert pq.read_table(out_dir / "train.parquet").to_pylist() == [
        {"prompt_id": "train-000000", "prompt": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris"},
    ]


@pytest.mark.parametrize("fn", ["processing_class_style", "example_only"])
def test_user_transform_with_processing_class_or_the_example_alone(tmp_path, out_dir, user_module, fn):
    """axolotl's `transform_fn(example, processing_class=None)` and a plain `transform_fn(example)` both run."""
    name = user_module(USER_TRANSFORM)
    rows = [{"q": "Capital of France?", "a": "Paris"}]

    transform.run(TransformConfig(type=f"{name}.{fn}"), {"train": _raw_file(tmp_path, "csv", rows)}, out_dir)

    assert pq.read_table(out_dir / "train.parquet").to_pylist() == [
        {"prompt_id": "train-000000", "prompt": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris"},
    ]


def test_bad_row_missing_field_names_row_and_field(tmp_path, out_dir):
    rows = [dict(RAW[0]), {"question": "What is 7*6?", "source": "mathqa", "level": 2}, dict(RAW[2])]
    path = _raw_file(tmp_path, "jsonl", rows)

    with pytest.raises(BadRowError) as info:
        transform.run(TransformConfig(), {"train": path}, out_dir)

    message = str(info.value)
    assert "row 1" in message
    assert "answer" in message
    assert str(path) in message
    assert not (out_dir / "train.parquet").exists()


def test_bad_rows_fail_names_every_one_and_writes_nothing(tmp_path, out_dir):
    rows = [dict(RAW[0]), {"question": "What is 7*6?"}, dict(RAW[2]), {"answer": "3"}]
    train, evals = _raw_file(tmp_path, "jsonl", rows), tmp_path / "eval.jsonl"
    evals.write_text("\n".join(json.dumps(r) for r in [dict(RAW[1]), {"question": "", "answer": "2"}]))

    with pytest.raises(transform.BadRowsError) as info:
        transform.run(TransformConfig(), {"train": train, "eval": evals}, out_dir)

    assert [(source, index) for source, index, _ in info.value.bad] == [
        (f"{train} (train)", 1), (f"{train} (train)", 3), (f"{evals} (eval)", 1)]
    message = str(info.value)
    assert "3 bad row(s)" in message and "transform.on_bad_rows: drop" in message
    assert f"{train} (train) row 1: missing or empty field answer" in message
    assert f"{train} (train) row 3: missing or empty field question" in message
    assert f"{evals} (eval) row 1: missing or empty field question" in message
    assert not list(out_dir.iterdir())  # not even the good split


def test_bad_rows_drop_keeps_the_rest_and_records_them(tmp_path, out_dir):
    rows = [dict(RAW[0]), {"question": "What is 7*6?"}, dict(RAW[2]), {"answer": "3"}]
    summary = transform.run(TransformConfig(on_bad_rows="drop"), {"train": _raw_file(tmp_path, "jsonl", rows)},
                            out_dir)

    kept = pq.read_table(out_dir / "train.parquet").to_pylist()
    assert [r["prompt_id"] for r in kept] == ["train-000000", "train-000002"]  # ids keep the raw row index
    assert summary["train"] == 2
    assert summary["dropped"]["train"]["rows"] == 2 and summary["dropped"]["train"]["indices"] == [1, 3]
    assert "missing or empty field answer" in summary["dropped"]["train"]["reasons"][0]

    every_row_bad = _raw_file(tmp_path, "parquet", [{"question": "q"}, {"question": "r"}])
    with pytest.raises(BadRowError, match=r"every row is bad \(row 0: missing or empty field answer"):
        transform.run(TransformConfig(on_bad_rows="drop"), {"train": every_row_bad}, out_dir)


def test_bad_row_empty_field(tmp_path, out_dir):
    rows = [dict(RAW[0]), dict(RAW[1]), {"question": "", "answer": "1", "source": "s", "level": 0}]

    with pytest.raises(BadRowError, match=r"row 2: missing or empty field question"):
        transform.run(TransformConfig(), {"train": _raw_file(tmp_path, "parquet", rows)}, out_dir)


def test_bad_row_in_user_transform_names_row_and_field(tmp_path, out_dir, user_module):
    name = user_module(USER_TRANSFORM)
    rows = [
        {"problem": "Double 21.", "solution": "#### 42", "meta": {"level": "easy"}},
        {"problem": "Double 4.", "solution": "#### 8", "meta": {"level": "easy"}},
        {"solution": "#### 1", "meta": {"level": "easy"}},
    ]

    with pytest.raises(BadRowError) as info:
        transform.run(TransformConfig(type=f"{name}.gsm8k"), {"train": _raw_file(tmp_path, "jsonl", rows)}, out_dir)

    assert "row 2" in str(info.value)
    assert "problem" in str(info.value)


@pytest.mark.parametrize(
    "fn, pattern",
    [("not_a_dict", r"row 0: transform '.*not_a_dict' returned list, expected a dict"),
     ("bad_prompt", r"row 0: field 'prompt': prompt must be a string or a list of \{role, content\} messages")],
)
def test_user_transform_bad_output(tmp_path, out_dir, user_module, fn, pattern):
    name = user_module(USER_TRANSFORM)

    with pytest.raises(BadRowError, match=pattern):
        transform.run(TransformConfig(type=f"{name}.{fn}"), {"train": _raw_file(tmp_path, "jsonl", RAW)}, out_dir)


def test_invalid_jsonl_line_names_line(tmp_path, out_dir):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(RAW[0]) + "\n{not json\n")

    with pytest.raises(BadRowError, match=r"train\.jsonl:2: not valid JSON"):
        transform.run(TransformConfig(), {"train": path}, out_dir)


def _bad_bytes_file(tmp_path: Path, fmt: str) -> Path:
    """A train file of three rows whose row 1 holds a byte that is not UTF-8."""
    rows = [{"question": "q0", "answer": "1"}, {"question": "BAD", "answer": "2"}, {"question": "q2", "answer": "3"}]
    path = _raw_file(tmp_path, fmt, rows)
    if fmt == "parquet":  # written by a tool that does not check UTF-8: the bytes as they are, viewed as strings
        questions = pa.array([b"q0", b"bad \xff", b"q2"]).view(pa.string())
        pq.write_table(pa.table({"question": questions, "answer": ["1", "2", "3"]}), path)
    else:
        path.write_bytes(path.read_bytes().replace(b"BAD", b"bad \xff"))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_bytes_that_are_not_utf8_are_a_bad_row(tmp_path, out_dir, fmt):
    """A row with a byte that is not UTF-8 is a bad row naming file and row (not a UnicodeDecodeError), and
    `on_bad_rows: drop` leaves it out."""
    path = _bad_bytes_file(tmp_path, fmt)

    with pytest.raises(transform.BadRowsError) as info:
        transform.run(TransformConfig(), {"train": path}, out_dir)
    assert [(source, index) for source, index, _ in info.value.bad] == [(f"{path} (train)", 1)]
    assert "not UTF-8" in str(info.value)

    summary = transform.run(TransformConfig(on_bad_rows="drop"), {"train": path}, out_dir)
    assert [r["prompt_id"] for r in pq.read_table(out_dir / "train.parquet").to_pylist()] == [
        "train-000000", "train-000002"]
    assert summary["dropped"]["train"]["rows"] == 1 and summary["dropped"]["train"]["indices"] == [1]


@pytest.mark.parametrize("suffix, text, reason", [
    (".jsonl", '{"question": "q0", "answer": "1"}\n{not json\n["q", "2"]\n{"question": "q3", "answer": "4"}\n',
     [(1, r"train\.jsonl:2: not valid JSON"), (2, r"train\.jsonl:3: a JSON array, not an object")]),
    (".csv", "question,answer\nq0,1\nq1,2,3\nq2\nq3,4\n",
     [(1, r"train\.csv:3: 3 columns, the header has 2"), (2, r"train\.csv:4: 1 column, the header has 2")]),
    (".json", '[{"question": "q0", "answer": "1"}, "q1", 2, {"question": "q3", "answer": "4"}]',
     [(1, "element 1: a JSON string, not an object"), (2, "element 2: a JSON number, not an object")]),
])
def test_rows_of_the_wrong_shape_are_bad_rows(tmp_path, out_dir, suffix, text, reason):
    path = tmp_path / f"train{suffix}"
    path.write_text(text)

    with pytest.raises(transform.BadRowsError) as info:
        transform.run(TransformConfig(), {"train": path}, out_dir)
    assert [index for _, index, _ in info.value.bad] == [index for index, _ in reason]
    for (_, _, message), (_, pattern) in zip(info.value.bad, reason):
        assert re.search(pattern, message), message

    summary = transform.run(TransformConfig(on_bad_rows="drop"), {"train": path}, out_dir)
    assert summary["train"] == 2 and summary["dropped"]["train"]["indices"] == [1, 2]


ARRAY_IN_JSONL = r"train\.jsonl: not JSON Lines \(the whole file is a JSON array.*name it \.json"


@pytest.mark.parametrize("suffix, text, pattern", [
    (".jsonl", json.dumps(RAW), ARRAY_IN_JSONL),
    (".jsonl", json.dumps(RAW, indent=2), ARRAY_IN_JSONL),
    (".jsonl", "question,answer\nq,1\n", r"train\.jsonl: not JSON Lines .*train\.jsonl:1: not valid JSON"),
    (".json", json.dumps({"questions": RAW}), r"train\.json: .*a JSON array of objects.*got a JSON object"),
    (".json", '[{"question": "q"}', r"train\.json:1:19: not valid JSON"),
    (".parquet", "not parquet", r"train\.parquet: not a readable Parquet file"),
])
def test_a_file_of_the_wrong_shape_is_one_error_naming_it(tmp_path, out_dir, suffix, text, pattern):
    """A JSON array (or any other content) in a .jsonl file is "not JSON Lines", under drop too."""
    path = tmp_path / f"train{suffix}"
    path.write_text(text)

    for on_bad_rows in ("fail", "drop"):
        with pytest.raises(SourceError, match=pattern):
            transform.run(TransformConfig(on_bad_rows=on_bad_rows), {"train": path}, out_dir)


def test_json_lines_in_a_json_file_are_read(tmp_path, out_dir):
    """As datasets.load_dataset("json") reads them (axolotl's `path: json` often names such files)."""
    path = tmp_path / "train.json"
    _write_jsonl(path, RAW)

    transform.run(TransformConfig(), {"train": path}, out_dir)

    assert pq.read_table(out_dir / "train.parquet").to_pylist() == EXPECTED


@pytest.mark.parametrize(
    "type_, pattern",
    [("nosuchmodule.fn", r"transform\.type: cannot import module 'nosuchmodule'"),
     ("json.no_such_fn", r"transform\.type: module 'json' has no function 'no_such_fn'"),
     ("nodots", r"transform\.type: 'nodots' is neither a built-in nor `module.fn`")],
)
def test_bad_type_names_config_key(tmp_path, out_dir, type_, pattern):
    path = _raw_file(tmp_path, "jsonl", RAW)

    with pytest.raises(ValueError, match=pattern):
        transform.run(TransformConfig(type=type_), {"train": path}, out_dir)


def test_missing_file_and_bad_suffix(tmp_path, out_dir):
    with pytest.raises(FileNotFoundError, match=r"transform\.paths: .*nope\.jsonl does not exist"):
        transform.run(TransformConfig(), {"train": tmp_path / "nope.jsonl"}, out_dir)
    txt = tmp_path / "train.txt"
    txt.write_text("hello")
    with pytest.raises(ValueError, match=r"has suffix '\.txt'"):
        transform.run(TransformConfig(), {"train": txt}, out_dir)


def test_empty_file_fails(tmp_path, out_dir):
    path = tmp_path / "train.jsonl"
    path.write_text("\n")

    with pytest.raises(BadRowError, match="no rows"):
        transform.run(TransformConfig(), {"train": path}, out_dir)


def test_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="question_feild"):
        TransformConfig(question_feild="q")


def test_a_transform_may_return_only_a_prompt(tmp_path, out_dir, user_module):
    """No `answer`: the row's answer is null (a format reward or a reward model needs none); an accuracy reward
    and the eval stage refuse such prompts, saying why."""
    from stages.evaluation import evaluate
    from stages.scoring.rewards import accuracy_reward

    name = user_module(USER_TRANSFORM)
    transform.run(TransformConfig(type=f"{name}.prompt_only"),
                  {"train": _raw_file(tmp_path, "csv", [{"q": "Write a haiku.", "a": ""}])}, out_dir)
    (row,) = pq.read_table(out_dir / "train.parquet").to_pylist()
    assert row["answer"] is None and row["prompt"] == [{"role": "user", "content": "Write a haiku."}]
    with pytest.raises(ValueError, match="accuracy_reward needs a gold `answer` for every prompt"):
        accuracy_reward(completions=["7"], answer=[None])
    with pytest.raises(ValueError, match=r"eval: 1 of the 1 prompts .* have no answer \(e.g. \['train-000000'\]"):
        evaluate.run(evaluate.EvalConfig(), tmp_path / "no-model", None, out_dir / "train.parquet", tmp_path)


def _tiny_model_and_a_long_prompt(root: Path) -> Path:
    """A tiny model (context 256) under root/model and a train split whose row 3 is ~600 tokens long."""
    from conftest import tiny_model

    tiny_model(root, ["<|im_start|>user\nsay 1<|im_end|>\n<|im_start|>assistant\n7<|im_end|>"] * 20)
    raw = root / "raw.jsonl"
    _write_jsonl(raw, [{"question": f"say {i}", "answer": str(i)} for i in range(3)]
                 + [{"question": "say " + "1 2 3 " * 200, "answer": "0"}])
    transform.run(TransformConfig(), {"train": raw}, root)
    return root / "train.parquet"


def test_a_prompt_longer_than_the_models_context_stops_the_first_round(tmp_path):
    """A prompt that leaves less room than rollout.max_completion_length in the model's context
    (max_position_embeddings) stops round 0, naming the prompts file's row and the lengths, whichever round
    would first draw it; rollout.max_prompt_length (TRL's left truncation) lets the round run."""
    from stages.rollout import rollout
    from stages.rollout.engines import Policy

    prompts = _tiny_model_and_a_long_prompt(tmp_path)
    cfg = rollout.RolloutConfig(num_generations=2, prompts_per_round=1, max_completion_length=4, engine="transformers")

    with pytest.raises(BadRowError, match=rf"{prompts}: row 3 \(prompt_id train-000003\) has \d{{3,}} prompt "
                                          r"tokens.*context of 256 tokens.*max_completion_length 4.*"
                                          r"max_prompt_length: 252"):
        rollout.run(cfg, Policy(tmp_path / "model"), prompts, 0, tmp_path)  # round 0 draws row 0 only
    assert not (tmp_path / "rollouts.parquet").exists()

    cut = cfg.model_copy(update={"max_prompt_length": 252})
    assert rollout.run(cut, Policy(tmp_path / "model"), prompts, 0, tmp_path)["rows"] == 2


def test_under_drop_a_prompt_longer_than_the_models_context_is_left_out_of_every_round(tmp_path, caplog):
    """transform.on_bad_rows: drop makes rollout.too_long_prompts drop (and puts it in the rollout key): the prompt
    that leaves less room than max_completion_length in the model's context is left out of the pool every round
    draws from, the same rows after a new process measures them again, with one warning naming the count and the
    row, and the count in the round's summary."""
    import logging

    from flows.config import PipelineConfig
    from stages.rollout import rollout
    from stages.rollout.engines import Policy
    from stages.runtime.keys import key_fields

    config = PipelineConfig.model_validate({"transform": {"on_bad_rows": "drop"}})
    assert key_fields(config.rollout)["too_long_prompts"] == key_fields(config.eval)["too_long_prompts"] == "drop"
    assert key_fields(PipelineConfig().rollout)["too_long_prompts"] == "fail"

    prompts = _tiny_model_and_a_long_prompt(tmp_path)
    cfg = config.rollout.model_copy(update={"num_generations": 2, "prompts_per_round": 2, "max_completion_length": 4})
    fitting = pq.read_table(prompts).to_pylist()[:3]

    drawn = []
    with caplog.at_level(logging.WARNING, logger="stages.rollout.rollout"):
        for round_index in range(3):  # 6 draws from a pool of 3: each prompt twice
            out = tmp_path / f"r{round_index}"
            out.mkdir()
            summary = rollout.run(cfg, Policy(tmp_path / "model"), prompts, round_index, out)
            assert summary["prompts_too_long"] == 1 and summary["prompts"] == 2
            ids = sorted(set(pq.read_table(out / "rollouts.parquet").column("prompt_id").to_pylist()))
            assert ids == sorted(r["prompt_id"] for r in rollout.select_prompts(fitting, round_index, 2, cfg.seed))
            drawn += ids
    assert sorted(drawn) == sorted(["train-000000", "train-000001", "train-000002"] * 2)
    warned = [r.getMessage() for r in caplog.records if "too_long_prompts: drop" in r.getMessage()]
    assert len(warned) == 1 and "left out 1 prompt(s)" in warned[0]
    assert "row 3 (prompt_id train-000003" in warned[0]

    rollout._measured.clear()  # as a resumed run's new process: measured again, the same rows left out
    again = tmp_path / "again"
    again.mkdir()
    assert rollout.run(cfg, Policy(tmp_path / "model"), prompts, 1, again)["prompts_too_long"] == 1
    assert pq.read_table(again / "rollouts.parquet").equals(pq.read_table(tmp_path / "r1" / "rollouts.parquet"))
