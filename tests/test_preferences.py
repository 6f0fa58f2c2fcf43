"""Tests for stages/data/preferences.py: raw preference files -> preferences tables."""

from __future__ import annotations

import json
import re
from collections import Counter
import textwrap
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from stages.data import demo_data, demo_pairs, preferences
from stages.data.demo_data import DemoDataConfig, format_answer
from stages.data.demo_pairs import DemoPairsConfig
from stages.data.preferences import PREFERENCES, BadRowsError, PreferenceConfig
from stages.data.sources import BadRowError

SYSTEM = "Be brief."
Q1, GOOD1, BAD1 = "Which is larger, 9.8 or 9.11?", "9.8", "9.11"
Q2, GOOD2, BAD2 = "What is 2+2?", "4", "5"


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


# What every pair format below must become: row 0 has a system prompt, row 1 has none.
EXPECTED_PAIRS = [
    {"pair_id": "train-000000", "kind": "pair", "prompt": [system(SYSTEM), user(Q1)],
     "chosen": [assistant(GOOD1)], "rejected": [assistant(BAD1)],
     "completion": None, "label": None, "completions": None, "labels": None},
    {"pair_id": "train-000001", "kind": "pair", "prompt": [user(Q2)],
     "chosen": [assistant(GOOD2)], "rejected": [assistant(BAD2)],
     "completion": None, "label": None, "completions": None, "labels": None},
]

# Samples with the fields exactly as axolotl's docs/rlhf.qmd (and docs/reward_modelling.qmd) show them.
PAIR_SAMPLES = {
    "chatml.intel": ({}, [
        {"system": SYSTEM, "question": Q1, "chosen": GOOD1, "rejected": BAD1},
        {"question": Q2, "chosen": GOOD2, "rejected": BAD2},
    ]),
    "chatml.prompt_pairs": ({}, [
        {"system": SYSTEM, "prompt": Q1, "chosen": GOOD1, "rejected": BAD1},
        {"system": "", "prompt": Q2, "chosen": GOOD2, "rejected": BAD2},
    ]),
    "chatml.argilla": ({}, [
        {"system": SYSTEM, "instruction": Q1, "chosen_response": GOOD1, "rejected_response": BAD1},
        {"instruction": Q2, "chosen_response": GOOD2, "rejected_response": BAD2},
    ]),
    "chat_template.argilla_chat": ({}, [
        {"chosen": [system(SYSTEM), user(Q1), assistant(GOOD1)],
         "rejected": [system(SYSTEM), user(Q1), assistant(BAD1)]},
        {"chosen": [user(Q2), assistant(GOOD2)], "rejected": [user(Q2), assistant(BAD2)]},
    ]),
    "chat_template.default": ({}, [
        {"messages": [system(SYSTEM), user(Q1)], "chosen": assistant(GOOD1), "rejected": assistant(BAD1)},
        {"messages": [user(Q2)], "chosen": assistant(GOOD2), "rejected": assistant(BAD2)},
    ]),
    "chat_template.default/mapped": ({
        "field_messages": "conversation", "field_chosen": "better", "field_rejected": "worse",
        "message_property_mappings": {"role": "from", "content": "value"},
        "roles": {"user": ["human"], "assistant": ["gpt"], "system": ["system"]},
    }, [
        {"conversation": [{"from": "system", "value": SYSTEM}, {"from": "human", "value": Q1}],
         "better": {"from": "gpt", "value": GOOD1}, "worse": {"from": "gpt", "value": BAD1}},
        # a string prompt, string answers and answers as conversations (the last turn counts)
        {"conversation": Q2, "better": GOOD2,
         "worse": [{"from": "human", "value": Q2}, {"from": "gpt", "value": BAD2}]},
    ]),
    "user_defined.default": ({"field_prompt": "query", "field_system": "sys", "field_chosen": "good",
                              "field_rejected": "bad"}, [
        {"sys": SYSTEM, "query": Q1, "good": GOOD1, "bad": BAD1},
        {"query": Q2, "good": GOOD2, "bad": BAD2},
    ]),
    "chatml.ultra": ({}, [
        {"system": SYSTEM, "prompt": Q1, "chosen": [user(Q1), assistant(GOOD1)],
         "rejected": [user(Q1), assistant(BAD1)]},
        {"prompt": Q2, "chosen": [user(Q2), assistant(GOOD2)], "rejected": [user(Q2), assistant(BAD2)]},
    ]),
    "chatml": ({}, [  # axolotl's chatml.default: the first of prompt/input/question/instruction, ...
        {"system": SYSTEM, "input": Q1, "chosen_response": GOOD1, "rejected_response": BAD1},
        {"instruction": Q2, "chosen": GOOD2, "rejected": BAD2},
    ]),
    "chat_template.argilla": ({}, [  # ORPO's name (axolotl orpo/chat_template.py reads the same fields)
        {"system": SYSTEM, "prompt": Q1, "chosen": [user(Q1), assistant(GOOD1)],
         "rejected": [user(Q1), assistant(BAD1)]},
        {"prompt": Q2, "chosen": [user(Q2), assistant(GOOD2)], "rejected": [user(Q2), assistant(BAD2)]},
    ]),
    "user_defined.default/type mapping": ({"type": {"field_prompt": "query", "field_system": "sys",
                                                    "field_chosen": "good", "field_rejected": "bad"}}, [
        {"sys": SYSTEM, "query": Q1, "good": GOOD1, "bad": BAD1},
        {"query": Q2, "good": GOOD2, "bad": BAD2},
    ]),
    "bradley_terry.chat_template": ({}, [
        {"system": SYSTEM, "input": Q1, "chosen": GOOD1, "rejected": BAD1},
        {"input": Q2, "chosen": GOOD2, "rejected": BAD2},
    ]),
    "bradley_terry.chat_template/conversations": ({}, [
        {"chosen": [system(SYSTEM), user(Q1), assistant(GOOD1)],
         "rejected": [system(SYSTEM), user(Q1), assistant(BAD1)]},
        {"chosen": [user(Q2), assistant(GOOD2)], "rejected": [user(Q2), assistant(BAD2)]},
    ]),
}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _write_json(path: Path, rows: list[dict]) -> None:
    path.write_text(json.dumps(rows))


def _write_parquet(path: Path, rows: list[dict]) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path)


def _write_csv(path: Path, rows: list[dict]) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = [",".join(columns)] + [",".join(json.dumps(str(r.get(c, ""))) for c in columns) for r in rows]
    path.write_text("\n".join(lines) + "\n")


WRITERS = {".jsonl": _write_jsonl, ".json": _write_json, ".parquet": _write_parquet, ".csv": _write_csv}


def _file(tmp_path: Path, rows: list[dict], suffix: str = ".jsonl", name: str = "train") -> str:
    path = tmp_path / f"{name}{suffix}"
    WRITERS[suffix](path, rows)
    return str(path)


def _read(out_dir: Path, split: str = "train") -> list[dict]:
    table = pq.read_table(out_dir / f"{split}.parquet")
    assert table.schema == PREFERENCES
    return table.to_pylist()


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch):
    """Write a user module into tmp_path under a unique name; return the name."""

    def write(source: str) -> str:
        name = f"user_prefs_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        return name

    return write


# ---------- every built-in pair format gives the same rows ----------


@pytest.mark.parametrize("case", list(PAIR_SAMPLES))
def test_pair_formats_normalize_alike(tmp_path, out_dir, case):
    options, rows = PAIR_SAMPLES[case]
    cfg = PreferenceConfig(**{"type": case.split("/")[0], "paths": {"train": _file(tmp_path, rows)}, **options})

    summary = preferences.run(cfg, out_dir)

    assert summary == {"train": {"kinds": {"pair": 2}, "kept": 2, "dropped": 0, "dropped_indices": [],
                                 "dropped_fields": {}}}
    assert _read(out_dir) == EXPECTED_PAIRS


@pytest.mark.parametrize("suffix", list(WRITERS))
def test_each_file_format_and_splits(tmp_path, out_dir, suffix):
    _, rows = PAIR_SAMPLES["chatml.intel"]
    paths = {"train": _file(tmp_path, rows, suffix, "train"), "eval": _file(tmp_path, rows[:1], suffix, "eval")}

    summary = preferences.run(PreferenceConfig(type="chatml.intel", paths=paths), out_dir)

    assert {split: s["kept"] for split, s in summary.items()} == {"train": 2, "eval": 1}
    assert _read(out_dir) == EXPECTED_PAIRS
    assert _read(out_dir, "eval") == [dict(EXPECTED_PAIRS[0], pair_id="eval-000000")]


def test_llama3_and_chatml_prefixes_read_the_same_fields(tmp_path, out_dir):
    _, rows = PAIR_SAMPLES["chatml.argilla"]
    preferences.run(PreferenceConfig(type="llama3.argilla", paths={"train": _file(tmp_path, rows)}), out_dir)
    assert _read(out_dir) == EXPECTED_PAIRS


def test_user_defined_format_strings(tmp_path, out_dir):
    rows = [{"system": "You are terse.", "prompt": "2+2?", "chosen": "4", "rejected": "5"},
            {"prompt": "3+3?", "chosen": "6", "rejected": "7"}]
    cfg = PreferenceConfig(type="user_defined.default", paths={"train": _file(tmp_path, rows)},
                           prompt_format="[{system}] Question: {prompt}", chosen_format="Answer: {chosen}",
                           rejected_format="Answer: {rejected}")

    preferences.run(cfg, out_dir)

    got = _read(out_dir)
    # {system} in prompt_format: the system text goes into the user turn, not a system message.
    assert got[0]["prompt"] == [user("[You are terse.] Question: 2+2?")]
    assert got[0]["chosen"] == [assistant("Answer: 4")] and got[0]["rejected"] == [assistant("Answer: 5")]
    assert got[1]["prompt"] == [user("[] Question: 3+3?")]


def test_system_prompt_is_prepended(tmp_path, out_dir):
    _, rows = PAIR_SAMPLES["chatml.intel"]
    cfg = PreferenceConfig(type="chatml.intel", paths={"train": _file(tmp_path, rows)}, system_prompt="Think.")
    preferences.run(cfg, out_dir)
    assert [r["prompt"][0] for r in _read(out_dir)] == [system("Think."), system("Think.")]


# ---------- bad rows ----------

BAD_INTEL = [
    {"question": Q1, "chosen": GOOD1, "rejected": BAD1},  # 0 good
    {"question": Q1, "chosen": GOOD1},  # 1 rejected missing
    {"question": Q1, "chosen": GOOD1, "rejected": GOOD1},  # 2 chosen == rejected
    {"question": "   ", "chosen": GOOD1, "rejected": BAD1},  # 3 empty question
    {"question": Q1, "chosen": [1, 2], "rejected": BAD1},  # 4 wrong type
    {"question": Q2, "chosen": GOOD2, "rejected": BAD2},  # 5 good
]


def test_bad_rows_fail_names_split_row_and_field(tmp_path, out_dir):
    cfg = PreferenceConfig(type="chatml.intel", paths={"train": _file(tmp_path, BAD_INTEL)})

    with pytest.raises(BadRowsError) as info:
        preferences.run(cfg, out_dir)

    message = str(info.value)
    assert "4 bad row(s)" in message
    assert "train row 1, field 'rejected': missing" in message
    assert "train row 2, field 'rejected': identical to chosen" in message
    assert "train row 3, field 'question': empty" in message
    assert "train row 4, field 'chosen': expected a string, got list" in message
    assert [(split, index, field) for split, index, field, _ in info.value.bad] == [
        ("train", 1, "rejected"), ("train", 2, "rejected"), ("train", 3, "question"), ("train", 4, "chosen")]
    assert isinstance(info.value, BadRowError)  # callers catching the transform's error catch this too
    assert not list(out_dir.iterdir())  # nothing written


def test_bad_rows_drop_are_counted(tmp_path, out_dir):
    paths = {"train": _file(tmp_path, BAD_INTEL), "eval": _file(tmp_path, BAD_INTEL[:1], name="eval")}
    cfg = PreferenceConfig(type="chatml.intel", paths=paths, on_bad_rows="drop")

    summary = preferences.run(cfg, out_dir)

    assert summary["train"] == {"kinds": {"pair": 2}, "kept": 2, "dropped": 4, "dropped_indices": [1, 2, 3, 4],
                                "dropped_fields": {"rejected": 2, "question": 1, "chosen": 1}}
    assert summary["eval"]["kept"] == 1 and summary["eval"]["dropped"] == 0
    assert [r["pair_id"] for r in _read(out_dir)] == ["train-000000", "train-000005"]  # ids keep raw indices


def test_many_bad_rows_are_listed_then_counted(tmp_path, out_dir):
    rows = [{"question": Q1, "chosen": "x", "rejected": "x"}] * 8 + [{"question": Q1, "chosen": "a", "rejected": "b"}]
    with pytest.raises(BadRowsError, match=r"8 bad row\(s\)[\s\S]*and 3 more"):
        preferences.run(PreferenceConfig(type="chatml.intel", paths={"train": _file(tmp_path, rows)}), out_dir)

    rows = [{"question": Q1, "chosen": "x", "rejected": "x"}] * 30 + [{"question": Q1, "chosen": "a", "rejected": "b"}]
    cfg = PreferenceConfig(type="chatml.intel", paths={"train": _file(tmp_path, rows)}, on_bad_rows="drop")
    summary = preferences.run(cfg, out_dir)
    assert summary["train"]["dropped"] == 30 and summary["train"]["dropped_indices"] == list(range(20))


def test_every_row_bad_under_drop_raises(tmp_path, out_dir):
    cfg = PreferenceConfig(type="chatml.intel", paths={"train": _file(tmp_path, BAD_INTEL[1:5])}, on_bad_rows="drop")
    with pytest.raises(BadRowError, match="every row of split 'train' is bad"):
        preferences.run(cfg, out_dir)


def test_bad_chat_rows(tmp_path, out_dir):
    rows = [
        # 0: the conversations differ before the answer
        {"chosen": [user(Q1), assistant(GOOD1)], "rejected": [user(Q2), assistant(BAD1)]},
        # 1: no prompt turn
        {"chosen": [assistant(GOOD1)], "rejected": [assistant(BAD1)]},
        # 2: empty answer content
        {"chosen": [user(Q1), assistant(GOOD1)], "rejected": [user(Q1), assistant("")]},
        # 3: the answer is not an assistant turn
        {"chosen": [user(Q1), assistant(GOOD1)], "rejected": [user(Q1), user(BAD1)]},
        # 4: unknown role
        {"chosen": [{"role": "bot", "content": Q1}, assistant(GOOD1)], "rejected": [user(Q1), assistant(BAD1)]},
    ]
    cfg = PreferenceConfig(type="chat_template.argilla_chat", paths={"train": _file(tmp_path, rows)})

    with pytest.raises(BadRowsError) as info:
        preferences.run(cfg, out_dir)

    reasons = {index: (field, reason) for _, index, field, reason in info.value.bad}
    assert reasons[0] == ("rejected", "conversation before the last turn differs from 'chosen''s")
    assert reasons[1][0] == "chosen" and "prompt turn" in reasons[1][1]
    assert reasons[2] == ("rejected", "message 1 (assistant) has empty content")
    assert reasons[3][0] == "rejected" and "expected 'assistant'" in reasons[3][1]
    assert reasons[4][0] == "chosen" and "'bot'" in reasons[4][1]


# ---------- KTO and stepwise ----------


def test_kto_unpaired_rows(tmp_path, out_dir):
    rows = [
        {"system": SYSTEM, "prompt": Q1, "completion": GOOD1, "label": True},
        {"prompt": [user(Q1)], "completion": [assistant(BAD1)], "label": False},
        {"prompt": Q1, "completion": GOOD1, "label": "maybe"},  # 2: bad label
        {"prompt": Q1, "completion": " ", "label": True},  # 3: empty completion
        {"prompt": Q1, "label": True},  # 4: no completion
    ]
    cfg = PreferenceConfig(type="kto", paths={"train": _file(tmp_path, rows)}, on_bad_rows="drop")

    summary = preferences.run(cfg, out_dir)

    assert summary["train"]["kinds"] == {"unpaired": 2}
    assert summary["train"]["dropped_indices"] == [2, 3, 4]
    assert summary["train"]["dropped_fields"] == {"label": 1, "completion": 2}
    assert _read(out_dir) == [
        {"pair_id": "train-000000", "kind": "unpaired", "prompt": [system(SYSTEM), user(Q1)], "chosen": None,
         "rejected": None, "completion": [assistant(GOOD1)], "label": True, "completions": None, "labels": None},
        {"pair_id": "train-000001", "kind": "unpaired", "prompt": [user(Q1)], "chosen": None,
         "rejected": None, "completion": [assistant(BAD1)], "label": False, "completions": None, "labels": None},
    ]


def test_kto_labels_from_csv_text(tmp_path, out_dir):
    rows = [{"prompt": Q1, "completion": GOOD1, "label": "true"}, {"prompt": Q1, "completion": BAD1, "label": "False"}]
    preferences.run(PreferenceConfig(type="kto", paths={"train": _file(tmp_path, rows, ".csv")}), out_dir)
    assert [r["label"] for r in _read(out_dir)] == [True, False]


def test_nectar_ranked_answers(tmp_path, out_dir):
    """zephyr.nectar: the best-ranked answer (rank 1) is chosen, the next one rejected."""
    rows = [
        {"prompt": Q1, "answers": [{"answer": "9.11", "rank": 2}, {"answer": "9.8", "rank": 1},
                                   {"answer": "neither", "rank": 3}]},
        {"prompt": Q1, "answers": [{"answer": "9.8", "rank": 1}]},  # 1: one answer
        {"prompt": Q1, "answers": [{"answer": "9.8", "rank": 1}, {"answer": "9.11", "rank": 1}]},  # 2: a tie
        {"prompt": Q1, "answers": [{"answer": "9.8"}, {"answer": "9.11", "rank": 2}]},  # 3: no rank
    ]
    cfg = PreferenceConfig(type="zephyr.nectar", paths={"train": _file(tmp_path, rows)}, on_bad_rows="drop")

    summary = preferences.run(cfg, out_dir)

    assert summary["train"]["dropped_indices"] == [1, 2, 3] and summary["train"]["dropped_fields"] == {"answers": 3}
    row = _read(out_dir)[0]
    assert (row["chosen"], row["rejected"]) == ([assistant("9.8")], [assistant("9.11")])


# axolotl's kto types (prompt_strategies/kto/chatml.py, llama3.py) with their documented fields; each must give
# the same two rows: a desirable answer with a system prompt and an undesirable one without.
EXPECTED_KTO = [
    {"pair_id": "train-000000", "kind": "unpaired", "prompt": [system(SYSTEM), user(Q1)], "chosen": None,
     "rejected": None, "completion": [assistant(GOOD1)], "label": True, "completions": None, "labels": None},
    {"pair_id": "train-000001", "kind": "unpaired", "prompt": [user(Q2)], "chosen": None,
     "rejected": None, "completion": [assistant(BAD2)], "label": False, "completions": None, "labels": None},
]
KTO_SAMPLES = {
    "chatml.argilla": ({}, [{"system": SYSTEM, "instruction": Q1, "completion": GOOD1, "label": True},
                            {"instruction": Q2, "completion": BAD2, "label": False}]),
    "chatml.intel": ({}, [{"system": SYSTEM, "question": Q1, "completion": GOOD1, "label": True},
                          {"question": Q2, "completion": BAD2, "label": False}]),
    "chatml.prompt_pairs": ({}, [{"system": SYSTEM, "prompt": Q1, "completion": GOOD1, "label": True},
                                 {"prompt": Q2, "completion": BAD2, "label": False}]),
    "llama3.ultra": ({}, [{"system": SYSTEM, "prompt": Q1, "completion": GOOD1, "label": True},
                          {"system": "", "prompt": Q2, "completion": BAD2, "label": False}]),
    "chatml.argilla_chat": ({}, [{"completion": [system(SYSTEM), user(Q1), assistant(GOOD1)], "label": True},
                                 {"completion": [user(Q2), assistant(BAD2)], "label": False}]),
    "chatml.argilla_chat/as documented": ({}, [  # axolotl's rlhf docs: the prompt turns under `chosen`
        {"chosen": [system(SYSTEM), user(Q1)], "completion": [assistant(GOOD1)], "label": True},
        {"chosen": [user(Q2)], "completion": [assistant(BAD2)], "label": False}]),
    "user_defined.default": ({"type": {"field_prompt": "q", "field_system": "s", "field_completion": "a",
                                       "field_label": "ok"}},
                             [{"s": SYSTEM, "q": Q1, "a": GOOD1, "ok": True}, {"q": Q2, "a": BAD2, "ok": False}]),
}


@pytest.mark.parametrize("case", list(KTO_SAMPLES))
def test_kto_formats_normalize_alike(tmp_path, out_dir, case):
    options, rows = KTO_SAMPLES[case]
    cfg = PreferenceConfig(**{"type": case.split("/")[0], "namespace": "kto", "paths": {"train": _file(tmp_path, rows)},
                              **options})

    summary = preferences.run(cfg, out_dir)

    assert summary["train"]["kinds"] == {"unpaired": 2}
    assert _read(out_dir) == EXPECTED_KTO


def test_kto_bad_rows_are_named(tmp_path, out_dir):
    rows = [{"instruction": Q1, "completion": GOOD1},  # 0: no label
            {"instruction": Q1, "chosen": GOOD1, "rejected": BAD1, "label": True},  # 1: a pair row
            {"completion": [assistant(GOOD1)], "label": True}]  # 2: argilla_chat with no prompt turn
    cfg = PreferenceConfig(type="chatml.argilla", namespace="kto", paths={"train": _file(tmp_path, rows[:2])})
    with pytest.raises(BadRowsError) as e:
        preferences.run(cfg, out_dir)
    assert [(i, f) for _, i, f, _ in e.value.bad] == [(0, "label"), (1, "completion")]
    cfg = PreferenceConfig(type="chatml.argilla_chat", namespace="kto", paths={"train": _file(tmp_path, rows[2:])})
    with pytest.raises(BadRowsError, match="row 0, field 'completion': needs the prompt turn"):
        preferences.run(cfg, out_dir)
    assert not (out_dir / "train.parquet").exists()


def test_kto_user_defined_formats(tmp_path, out_dir):
    rows = [{"system": "Be terse.", "prompt": "2+2?", "completion": "4", "label": True}]
    cfg = PreferenceConfig(type="user_defined.default", namespace="kto", paths={"train": _file(tmp_path, rows)},
                           prompt_format="[{system}] Q: {prompt}", completion_format="A: {completion}")
    preferences.run(cfg, out_dir)
    row = _read(out_dir)[0]
    assert row["prompt"] == [user("[Be terse.] Q: 2+2?")] and row["completion"] == [assistant("A: 4")]


def test_namespace_decides_the_format(tmp_path, out_dir):
    """The same type name reads pairs under `pairs` and unpaired rows under `kto`; a pairs-only name under kto
    reads pairs (rl: kto splits them); a format key the namespace does not read is refused naming it."""
    _, rows = PAIR_SAMPLES["chatml.prompt_pairs"]
    path = _file(tmp_path, rows)
    assert preferences.run(PreferenceConfig(type="chatml.prompt_pairs", paths=path), out_dir)["train"]["kinds"] \
        == {"pair": 2}
    with pytest.raises(BadRowsError, match="field 'completion': missing"):
        preferences.run(PreferenceConfig(type="chatml.prompt_pairs", namespace="kto", paths=path), out_dir)
    _, rows = PAIR_SAMPLES["chat_template.argilla_chat"]
    cfg = PreferenceConfig(type="chat_template.argilla_chat", namespace="kto", paths=_file(tmp_path, rows))
    assert preferences.run(cfg, out_dir)["train"]["kinds"] == {"pair": 2}
    with pytest.raises(ValidationError, match="completion_format: not read for pairs rows"):
        PreferenceConfig(type="user_defined.default", paths=path, completion_format="{completion}!")
    with pytest.raises(ValidationError, match="chosen_format: not read for kto rows"):
        PreferenceConfig(type={"chosen_format": "A: {chosen}"}, namespace="kto", paths=path)
    with pytest.raises(ValidationError, match="type: field_answer is not a user_defined key"):
        PreferenceConfig(type={"field_answer": "a"}, paths=path)


def test_stepwise_supervised_rows(tmp_path, out_dir):
    doc_example = {  # axolotl docs/dataset-formats/stepwise_supervised.qmd
        "prompt": "Which number is larger, 9.8 or 9.11?",
        "completions": ["The fractional part of 9.8 is 0.8, while the fractional part of 9.11 is 0.11.",
                        "Since 0.11 is greater than 0.8, the number 9.11 is larger than 9.8."],
        "labels": [True, False],
    }
    rows = [
        doc_example,
        dict(doc_example, labels=[True]),  # 1: one label for two steps
        dict(doc_example, completions=["step", ""], labels=[True, True]),  # 2: empty step
        dict(doc_example, labels=[True, "sure"]),  # 3: not a bool
        dict(doc_example, completions="one step", labels=[True]),  # 4: steps not a list
    ]
    cfg = PreferenceConfig(type="stepwise_supervised", paths={"train": _file(tmp_path, rows)})

    with pytest.raises(BadRowsError) as info:
        preferences.run(cfg, out_dir)
    assert [(i, f) for _, i, f, _ in info.value.bad] == [(1, "labels"), (2, "completions"), (3, "labels"),
                                                       (4, "completions")]
    assert "train row 1, field 'labels': 1 labels for 2 completions" in str(info.value)

    summary = preferences.run(cfg.model_copy(update={"on_bad_rows": "drop"}), out_dir)
    assert summary["train"]["kept"] == 1
    assert _read(out_dir) == [{
        "pair_id": "train-000000", "kind": "stepwise", "prompt": [user(doc_example["prompt"])],
        "chosen": None, "rejected": None, "completion": None, "label": None,
        "completions": doc_example["completions"], "labels": [True, False]}]


# ---------- user transforms (axolotl convention) ----------

USER_TRANSFORMS = """
def pairs(cfg):
    def transform_fn(example, tokenizer=None):
        return {"prompt": example["q"],
                "chosen": [{"role": "assistant", "content": example["good"]}],
                "rejected": example["bad"]}
    return transform_fn, {"remove_columns": ["q"]}

def unpaired(cfg):
    def transform_fn(example):
        return {"prompt": [{"role": "user", "content": example["q"]}], "completion": example["a"],
                "label": example["ok"]}
    return transform_fn

def broken(cfg):
    def transform_fn(example):
        if example["q"] == "boom":
            raise RuntimeError("cannot parse")
        if example["q"] == "bot":
            return {"prompt": [{"role": "bot", "content": "hi"}], "chosen": "a", "rejected": "b"}
        if example["q"] == "list":
            return ["not", "a", "dict"]
        return {"prompt": example["q"], "chosen": "a", "rejected": "b"}
    return transform_fn
"""


def test_user_transform_pairs(tmp_path, out_dir, user_module):
    name = user_module(USER_TRANSFORMS)
    rows = [{"q": Q1, "good": GOOD1, "bad": BAD1}, {"q": Q2, "good": GOOD2, "bad": BAD2}, {"good": "x", "bad": "y"}]
    cfg = PreferenceConfig(type=f"{name}.pairs", paths={"train": _file(tmp_path, rows)}, system_prompt=SYSTEM)

    with pytest.raises(BadRowsError, match="train row 2, field 'q': missing"):
        preferences.run(cfg, out_dir)

    summary = preferences.run(cfg.model_copy(update={"on_bad_rows": "drop"}), out_dir)
    assert summary["train"]["dropped_indices"] == [2]
    # strings become messages: same rows as the built-ins give
    expected = [dict(EXPECTED_PAIRS[0]), dict(EXPECTED_PAIRS[1], prompt=[system(SYSTEM), user(Q2)])]
    assert _read(out_dir) == expected


def test_user_transform_bare_function_unpaired(tmp_path, out_dir, user_module):
    name = user_module(USER_TRANSFORMS)
    rows = [{"q": Q1, "a": GOOD1, "ok": True}, {"q": Q1, "a": BAD1, "ok": False}]
    preferences.run(PreferenceConfig(type=f"{name}.unpaired", paths={"train": _file(tmp_path, rows)}), out_dir)
    got = _read(out_dir)
    assert [(r["kind"], r["completion"], r["label"]) for r in got] == [
        ("unpaired", [assistant(GOOD1)], True), ("unpaired", [assistant(BAD1)], False)]


def test_user_transform_errors_name_the_row(tmp_path, out_dir, user_module):
    name = user_module(USER_TRANSFORMS)
    rows = [{"q": "fine"}, {"q": "boom"}, {"q": "bot"}, {"q": "list"}]
    cfg = PreferenceConfig(type=f"{name}.broken", paths={"train": _file(tmp_path, rows)})

    with pytest.raises(BadRowsError) as info:
        preferences.run(cfg, out_dir)

    bad = {index: (field, reason) for _, index, field, reason in info.value.bad}
    assert bad[1] == ("<transform>", f"'{name}.broken' failed: RuntimeError: cannot parse")
    assert bad[2][0] == "prompt" and "'bot'" in bad[2][1]
    assert bad[3] == ("<transform>", "returned list, expected a dict")


def test_unknown_type_and_module(tmp_path, out_dir):
    path = _file(tmp_path, PAIR_SAMPLES["chatml.intel"][1])
    with pytest.raises(ValueError, match="neither a built-in nor `module.fn`"):
        preferences.run(PreferenceConfig(type="intel", paths={"train": path}), out_dir)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        preferences.run(PreferenceConfig(type="no_such_module_xyz.fn", paths={"train": path}), out_dir)


# ---------- config ----------


def test_config_aliases_and_validation(tmp_path, out_dir):
    path = _file(tmp_path, PAIR_SAMPLES["chatml.intel"][1])
    cfg = PreferenceConfig.model_validate({"type": "chatml.intel", "data_files": path, "ds_type": "json"})
    assert cfg.paths == {"train": path}
    assert preferences.run(cfg, out_dir)["train"]["kept"] == 2  # json covers .jsonl

    with pytest.raises(ValueError, match="does not match ds_type 'parquet'"):
        preferences.run(cfg.model_copy(update={"ds_type": "parquet"}), out_dir)
    with pytest.raises(FileNotFoundError, match="preferences.paths.train"):
        preferences.run(PreferenceConfig(type="chatml.intel", paths={"train": str(tmp_path / "nope.jsonl")}), out_dir)
    with pytest.raises(ValidationError, match="extra"):
        PreferenceConfig(type="chatml.intel", paths={"train": path}, field_answer="x")
    with pytest.raises(ValidationError, match="prompt_format"):
        PreferenceConfig(type="user_defined.default", paths={"train": path}, prompt_format="{question}")
    with pytest.raises(ValidationError, match="role and content"):
        PreferenceConfig(type="chat_template.default", paths={"train": path},
                         message_property_mappings={"role": "from"})


# ---------- demo pairs ----------

NUMBERS = re.compile(r"Which is the largest of ([\d, ]+)\?")


def _numbers(question: str) -> list[int]:
    return [int(n) for n in NUMBERS.fullmatch(question).group(1).split(", ")]


@pytest.mark.parametrize("digits", [1, 2])
def test_demo_pairs_are_correct_and_disjoint_from_demo_eval(tmp_path, digits):
    demo = DemoDataConfig(num_sft=50, num_train=50, num_eval=200, number_digits=digits, seed=7)
    demo_data.run(demo, tmp_path)  # the eval split the pipeline would evaluate on
    eval_questions = set(pq.read_table(tmp_path / "eval.parquet").column("question").to_pylist())
    assert demo_pairs.demo_eval_questions(demo) == eval_questions

    pairs = demo_pairs.demo_pair_rows(DemoPairsConfig(num_train=400, num_eval=100), demo)

    questions = {split: [r["prompt"][-1]["content"] for r in rows] for split, rows in pairs.items()}
    assert len(questions["train"]) == 400 and len(questions["eval"]) == 100
    assert not set(questions["train"]) & eval_questions
    assert not set(questions["eval"]) & eval_questions
    assert not set(questions["train"]) & set(questions["eval"])
    assert len(set(questions["eval"])) == 100, "eval pairs are distinct; train pairs may repeat a question"
    largest = Counter(max(_numbers(q)) // 10 ** (digits - 1) for q in questions["train"])
    assert set(largest.values()) == {80}, f"balanced answers, as the demo task: {largest}"
    first_is_wrong = 0
    for rows in pairs.values():
        for row in rows:
            numbers = _numbers(row["prompt"][-1]["content"])
            assert row["chosen"] == [assistant(format_answer(max(numbers)))]
            wrong = int(re.fullmatch(r"<answer>(\d+)</answer>", row["rejected"][0]["content"]).group(1))
            assert wrong in numbers and wrong != max(numbers)
            first_is_wrong += numbers[0] != max(numbers)
            if numbers[0] != max(numbers):  # default rejected: "first", the noisy teacher's mistake
                assert wrong == numbers[0]
    assert first_is_wrong > 0


def test_demo_pairs_written_and_deterministic(tmp_path):
    demo = DemoDataConfig(num_sft=20, num_train=20, num_eval=20)
    cfg = DemoPairsConfig(num_train=30, num_eval=10, rejected="second_largest", system_prompt="Answer in tags.")

    summary = demo_pairs.write_demo_pairs(cfg, tmp_path, demo)

    assert summary["train"]["kept"] == 30 and summary["eval"]["kept"] == 10
    rows = _read(tmp_path)
    assert rows == _read(tmp_path, "train")
    assert rows[0]["pair_id"] == "train-000000" and rows[0]["prompt"][0] == system("Answer in tags.")
    for row in rows:
        numbers = sorted(_numbers(row["prompt"][-1]["content"]))
        assert row["rejected"] == [assistant(format_answer(numbers[-2]))]
    again = demo_pairs.demo_pair_rows(cfg, demo)
    assert [r["prompt"] for r in again["train"]] == [r["prompt"] for r in rows]


# ---------- axolotl's datasets: list (hub ids, files, slices, a type per source) ----------


def test_datasets_sources_of_different_types_with_slices(tmp_path, out_dir):
    """Two sources of different formats make the train split (a slice of the first), test_datasets the eval
    split; each keeps its raw row index in pair_id; a bad row is named by its source and row."""
    _, intel = PAIR_SAMPLES["chatml.intel"]
    _, default = PAIR_SAMPLES["chat_template.default"]
    first, second = _file(tmp_path, intel * 2, name="intel"), _file(tmp_path, default, ".parquet", name="chat")
    cfg = PreferenceConfig(type="chat_template.default", datasets=[
        {"path": first, "type": "chatml.intel", "split": "train[:2]", "ds_type": "json"}, {"path": second}],
        test_datasets=[{"path": first, "type": "chatml.intel", "split": "train[3:]"}])

    summary = preferences.run(cfg, out_dir)

    train = _read(out_dir)
    assert [r["pair_id"] for r in train] == ["train-0-000000", "train-0-000001", "train-1-000000", "train-1-000001"]
    assert [{k: v for k, v in r.items() if k != "pair_id"} for r in train[:2]] == \
        [{k: v for k, v in r.items() if k != "pair_id"} for r in EXPECTED_PAIRS]
    assert _read(out_dir, "eval")[0]["pair_id"] == "eval-000003"
    assert summary["train"]["sources"] == {f"datasets.0 {first} (split=train[:2])": 2,
                                           f"datasets.1 {second} (split=train)": 2}

    bad = _file(tmp_path, [intel[0], {"question": Q2, "chosen": GOOD2}], name="bad")
    cfg = PreferenceConfig(type="chatml.intel", datasets=[{"path": first}, {"path": bad}])
    with pytest.raises(BadRowsError, match=re.escape(f"datasets.1 {bad} (split=train) row 1, field 'rejected': "
                                                     "missing")):
        preferences.run(cfg, out_dir)


def test_val_set_size_holds_out_pairs_of_the_datasets(tmp_path, out_dir):
    """axolotl's val_set_size: a seeded share of the datasets' rows is the eval split; each row keeps its raw
    index, so train and eval ids are disjoint and cover every row."""
    _, intel = PAIR_SAMPLES["chatml.intel"]
    path = _file(tmp_path, intel * 5)
    cfg = PreferenceConfig(type="chatml.intel", datasets=[{"path": path}], val_set_size=0.3)

    summary = preferences.run(cfg, out_dir)

    train, held = _read(out_dir), _read(out_dir, "eval")
    assert (summary["train"]["kept"], summary["eval"]["kept"]) == (7, 3)
    indices = sorted(int(r["pair_id"].rsplit("-", 1)[1]) for r in train + held)
    assert indices == list(range(10)) and all(r["pair_id"].startswith("eval-") for r in held)
    again = tmp_path / "again"
    again.mkdir()
    preferences.run(cfg, again)
    assert _read(again, "eval") == held  # the same seed holds out the same rows
    with pytest.raises(ValidationError, match="val_set_size holds out rows of datasets"):
        PreferenceConfig(type="chatml.intel", paths=path, val_set_size=0.1)


def test_datasets_config_errors_name_the_key(tmp_path, out_dir):
    path = _file(tmp_path, PAIR_SAMPLES["chatml.intel"][1])
    with pytest.raises(ValidationError, match="datasets.0 name no type of their own"):
        PreferenceConfig(datasets=[{"path": path}])
    with pytest.raises(ValidationError, match="paths .* or datasets .*both are set"):
        PreferenceConfig(type="chatml.intel", paths=path, datasets=[{"path": path}])
    with pytest.raises(ValidationError, match="conversation"):
        PreferenceConfig(type="chatml.intel", datasets=[{"path": path, "conversation": "chatml"}])
    cfg = PreferenceConfig(type="chatml.intel", datasets=[{"path": path, "ds_type": "parquet"}])
    with pytest.raises(ValueError, match="does not match ds_type 'parquet'"):
        preferences.run(cfg, out_dir)


HUB_COMMITS = ["a" * 40, "b" * 40]


@pytest.fixture
def preference_hub(tmp_path, monkeypatch):
    """An offline hub cache holding `org/prefs` (data/train.parquet, chatml.intel rows) at two commits, refs/main
    on the first, laid out as huggingface_hub lays it out."""
    repo = tmp_path / "hub" / "datasets--org--prefs"
    for n, commit in enumerate(HUB_COMMITS):
        rows = [{"question": f"{Q2} ({n}.{i})", "chosen": GOOD2, "rejected": BAD2} for i in range(3)]
        blob = repo / "blobs" / commit[:8]
        blob.parent.mkdir(parents=True, exist_ok=True)
        _write_parquet(blob, rows)
        link = repo / "snapshots" / commit / "data" / "train.parquet"
        link.parent.mkdir(parents=True)
        link.symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_COMMITS[0])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    return repo


def test_an_axolotl_dpo_config_reads_a_hub_dataset_keyed_by_its_commit(preference_hub, key_of, out_dir):
    """rl: dpo with axolotl's top-level `datasets` (a hub id, as its docs write it): the rows are the
    preferences, read offline from the hub cache; the preferences key follows the commit main points to."""
    from flows.config import PipelineConfig
    from tasks import stage_tasks

    config = {"rl": "dpo", "datasets": [{"path": "org/prefs", "split": "train[:2]", "type": "chatml.intel"}]}
    cfg = PipelineConfig.model_validate(config)
    assert cfg.transform.datasets is None and cfg.preferences.datasets[0].path == "org/prefs"
    assert preferences.run(cfg.preferences, out_dir)["train"]["kept"] == 2
    assert _read(out_dir)[0]["prompt"] == [user(f"{Q2} (0.0)")]

    first = key_of(stage_tasks.preferences_task, config)
    (preference_hub / "refs" / "main").write_text(HUB_COMMITS[1])
    assert key_of(stage_tasks.preferences_task, config) != first


def test_an_axolotl_kto_config_reads_kto_rows(tmp_path, out_dir):
    """rl: kto resolves the datasets' types in KTO's namespace (chatml.argilla: instruction/completion/label)."""
    from flows.config import ConfigError, PipelineConfig, load_config

    path = _file(tmp_path, KTO_SAMPLES["chatml.argilla"][1])
    cfg = PipelineConfig.model_validate({"rl": "kto", "datasets": [{"path": path, "type": "chatml.argilla"}]})
    assert cfg.preferences.namespace == "kto" and cfg.dpo.rl == "kto"
    assert PipelineConfig.model_validate(cfg.run_config()) == cfg  # the saved translation round-trips
    summary = preferences.run(cfg.preferences, out_dir)
    assert summary["train"]["kinds"] == {"unpaired": 2}

    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"rl": "dpo", "preferences": {"type": "kto", "paths": path, "namespace": "kto"}}))
    with pytest.raises(ConfigError, match="preferences.namespace: 'kto' does not fit rl: dpo"):
        load_config(config)
    config.write_text(json.dumps({"rl": "kto", "datasets": [{"path": path, "type": "chatml.argilla"}],
                                  "val_set_size": 1}))
    assert load_config(config).preferences.val_set_size == 1
