"""Pure functions of the GSM8K eval: extraction, Wilson interval, data, prompts, comparison."""

from __future__ import annotations

import pytest

from pdserve.bench.gsm8k_data import (
    INSTRUCTION,
    build_messages,
    format_solution,
    load_gsm8k_test,
    normalize_number,
)
from pdserve.eval.gsm8k import extract_answer, split_shots, wilson_interval
from pdserve.eval.runner import QuestionResult, compare_results, summarize_eval


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18"),
        (
            "#### 1,234\nQuestion: next one #### 5",
            "1234",
        ),  # the first '####' is the committed answer
        ("So the total is 40. The answer is $1,000.00.", "1000"),
        ("The answer is: -3", "-3"),
        ("First 3 apples, then 12, finally 0.50 each.", "0.5"),  # no marker: the last number
        ("I cannot tell.", None),
        ("3,4 and 1,000,000", "1000000"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_normalize_number():
    assert normalize_number("18.00") == "18"
    assert normalize_number("$1,200") == "1200"
    assert normalize_number("0.250") == "0.25"
    with pytest.raises(ValueError, match="not a number"):
        normalize_number("abc")


def test_wilson_interval_known_values():
    low, high = wilson_interval(5, 10)
    assert (low, high) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = wilson_interval(10, 10)
    assert low == pytest.approx(0.7225, abs=1e-4) and high == pytest.approx(1.0)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)


def test_gsm8k_data_and_gold_answers():
    items = load_gsm8k_test()
    assert len(items) == 1319
    assert items[0].gold == "18" and "Janet" in items[0].question
    assert all(it.gold == normalize_number(it.gold) for it in items)
    assert items[5].index == 5


def test_few_shots_are_excluded_from_scoring():
    shots, questions = split_shots(num_questions=4, num_shots=2)
    assert [s.index for s in shots] == [0, 1] and [q.index for q in questions] == [2, 3, 4, 5]
    messages = build_messages(questions[0].question, shots)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert (
        messages[-1]["content"].startswith(INSTRUCTION)
        and questions[0].question in messages[-1]["content"]
    )
    assert "<<" not in messages[1]["content"] and messages[1]["content"].endswith("#### 18")
    assert format_solution("a <<2*3=6>>6\n#### 6") == "a 6\n#### 6"
    for kwargs, field in (
        ({"num_questions": 0, "num_shots": 0}, "num_questions"),
        ({"num_questions": 1, "num_shots": -1}, "num_shots"),
        ({"num_questions": 1319, "num_shots": 1}, "num_questions"),
    ):
        with pytest.raises(ValueError, match=field):
            split_shots(**kwargs)


def _qr(index: int, output: str | None, gold: str = "1") -> QuestionResult:
    extracted = extract_answer(output) if output is not None else None
    return QuestionResult(
        index,
        "q",
        [],
        output,
        None if output is not None else "HTTP 500: x",
        extracted,
        gold,
        extracted == gold,
        3 if output else None,
    )


def test_summary_and_comparison():
    a = [_qr(0, "#### 1"), _qr(1, "no idea"), _qr(2, "#### 7"), _qr(3, None), _qr(4, "x #### 1")]
    b = [
        _qr(0, "#### 1"),
        _qr(1, "no idea"),
        _qr(2, "#### 8"),
        _qr(3, "#### 1"),
        _qr(4, "y #### 1"),
    ]
    s = summarize_eval(a, duration_s=1.0)
    assert (s.num_questions, s.correct, s.invalid, s.failed) == (5, 2, 1, 1)
    assert s.accuracy == pytest.approx(0.4) and s.invalid_rate == pytest.approx(0.2)
    assert s.ci_low < 0.4 < s.ci_high
    c = compare_results(a, b)
    assert c["both_completed"] == 4 and c["extracted_differ"] == 1 and c["text_differ"] == 2
    assert [d["index"] for d in c["first_differences"]] == [2, 4]
    assert c["first_differences"][1]["first_difference_at_char"] == 0
    with pytest.raises(ValueError, match="same questions"):
        compare_results(a, b[:2])
