"""The built-in demo task: well-formed questions, disjoint splits, a teacher as noisy as configured."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import pytest

from stages import demo_data


def _rows(out_dir, **overrides):
    cfg = demo_data.DemoDataConfig(num_sft=2000, num_train=300, num_eval=200, **overrides)
    counts = demo_data.run(cfg, out_dir)
    assert counts == {"eval": 200, "sft": 2000, "train": 300}
    return {split: pq.read_table(out_dir / f"{split}.parquet").to_pylist() for split in demo_data.SPLITS}


@pytest.mark.parametrize("digits", [1, 2])
def test_questions_answers_and_disjoint_splits(out_dir, digits):
    rows = _rows(out_dir, number_digits=digits)
    seen = set()
    for split, split_rows in rows.items():
        for row in split_rows:
            numbers = [int(n) for n in re.findall(r"\d+", row["question"])]
            assert len(numbers) == 5
            assert all(len(str(n)) == digits for n in numbers)
            assert len({str(n)[0] for n in numbers}) == 5, "leading digits are distinct: no ties"
            assert row["answer"] == str(max(numbers))
            assert row["question"] not in seen, f"{split} repeats a question of another split"
            seen.add(row["question"])


def test_teacher_is_right_as_often_as_configured(out_dir):
    rows = _rows(out_dir, teacher_accuracy=0.4)["sft"]
    right = first = 0
    for row in rows:
        numbers = re.findall(r"\d+", row["question"])
        said = re.fullmatch(r"<answer>(\d+)</answer>", row["teacher_completion"]).group(1)
        right += said == row["answer"]
        first += said == numbers[0] != row["answer"]
        assert said in (row["answer"], numbers[0])
    # right = 0.4 + 0.6 * P(first is largest) = 0.4 + 0.6 / 5 = 0.52
    assert 0.48 < right / len(rows) < 0.56
    assert first + right == len(rows)


def test_too_many_questions_for_the_space_fails_clearly(out_dir):
    cfg = demo_data.DemoDataConfig(numbers_per_question=2, num_sft=100, num_train=10, num_eval=10)
    with pytest.raises(ValueError, match="cannot draw 100 distinct sft questions"):
        demo_data.run(cfg, out_dir)
