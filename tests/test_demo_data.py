"""The built-in demo task: well-formed questions, a held-out eval split, balanced answers, a teacher
as noisy as configured."""

from __future__ import annotations

import re
from collections import Counter

import pyarrow.parquet as pq
import pytest

from stages.data import demo_data


def _rows(out_dir, **overrides):
    cfg = demo_data.DemoDataConfig(num_sft=2000, num_train=300, num_eval=200, **overrides)
    counts = demo_data.run(cfg, out_dir)
    assert counts == {"eval": 200, "sft": 2000, "train": 300}
    return {split: pq.read_table(out_dir / f"{split}.parquet").to_pylist() for split in demo_data.SPLITS}


@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("balanced", [True, False])
def test_questions_answers_and_held_out_eval(out_dir, digits, balanced):
    rows = _rows(out_dir, number_digits=digits, balanced_answers=balanced)
    for split_rows in rows.values():
        for row in split_rows:
            numbers = [int(n) for n in re.findall(r"\d+", row["question"])]
            assert len(numbers) == 5
            assert all(len(str(n)) == digits for n in numbers)
            assert len({str(n)[0] for n in numbers}) == 5, "leading digits are distinct: no ties"
            assert row["answer"] == str(max(numbers))
    eval_questions = [r["question"] for r in rows["eval"]]
    assert len(set(eval_questions)) == len(eval_questions), "eval questions are distinct"
    trained_on = {r["question"] for split in ("sft", "train") for r in rows[split]}
    assert not trained_on & set(eval_questions), "no eval question appears in sft or train"


def test_balanced_answers_leave_no_good_constant_answer(out_dir):
    rows = _rows(out_dir)
    for split, split_rows in rows.items():
        counts = Counter(r["answer"][0] for r in split_rows)  # the largest number's leading digit
        assert set(counts) == {"5", "6", "7", "8", "9"}
        assert max(counts.values()) - min(counts.values()) <= 1, f"{split}: {counts}"
        positions = Counter(re.findall(r"\d", r["question"]).index(r["answer"]) for r in split_rows)
        assert max(positions.values()) / len(split_rows) < 0.3, f"{split}: the largest sits anywhere ({positions})"
    unbalanced = Counter(r["answer"] for r in _rows(out_dir, balanced_answers=False)["eval"])
    assert unbalanced["9"] / 200 > 0.45, "uniform numbers: 9 is the answer of ~5/9 of the questions"


@pytest.mark.parametrize("mistake", ["first", "second_largest", "random"])
def test_teacher_is_right_as_often_as_configured(out_dir, mistake):
    rows = _rows(out_dir, teacher_accuracy=0.4, teacher_mistake=mistake)["sft"]
    right = 0
    for row in rows:
        numbers = re.findall(r"\d+", row["question"])
        said = re.fullmatch(r"<answer>(\d+)</answer>", row["teacher_completion"]).group(1)
        right += said == row["answer"]
        assert said in numbers
        if said != row["answer"] and mistake != "random":
            assert said == (numbers[0] if mistake == "first" else sorted(numbers, key=int)[-2])
    # first: right = 0.4 + 0.6 * P(first is largest) = 0.4 + 0.6 / 5 = 0.52; the others are never right by mistake
    expected = 0.52 if mistake == "first" else 0.4
    assert expected - 0.04 < right / len(rows) < expected + 0.04


def test_too_many_eval_questions_for_the_space_fails_clearly(out_dir):
    cfg = demo_data.DemoDataConfig(numbers_per_question=2, num_sft=10, num_train=10, num_eval=100)
    with pytest.raises(ValueError, match="cannot draw 100 distinct eval questions"):
        demo_data.run(cfg, out_dir)
