"""``pdserve eval gsm8k`` end to end: real HTTP against a tiny worker (counts, JSON, no crash)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.gsm8k_data import load_gsm8k_test
from pdserve.cli import main
from pdserve.eval.gsm8k import extract_answer


@pytest.mark.timeout(120)
def test_eval_with_shots_and_compare_on_the_same_worker(pdserve_url, tmp_path, capsys):
    out_json = tmp_path / "gsm8k.json"
    rc = main(
        [
            "eval",
            "gsm8k",
            "--url",
            pdserve_url,
            "--compare",
            pdserve_url,
            "--num-questions",
            "5",
            "--num-shots",
            "1",
            "--max-tokens",
            "12",
            "--concurrency",
            "3",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    stdout = capsys.readouterr().out
    assert (
        "95% CI (Wilson)" in stdout and "0 extracted answers differ, 0 raw outputs differ" in stdout
    )
    doc = json.loads(out_json.read_text())
    assert "####" in doc["prompt_format"]["instruction"]
    items = load_gsm8k_test()
    for target in doc["targets"]:
        questions = target["questions"]
        assert [q["index"] for q in questions] == [1, 2, 3, 4, 5]  # row 0 is the shot
        for q in questions:
            assert q["error"] is None and isinstance(q["output"], str)
            assert q["gold"] == items[q["index"]].gold
            assert q["extracted"] == extract_answer(q["output"])
            assert q["correct"] == (q["extracted"] == q["gold"])
            assert len(q["messages"]) == 3 and q["messages"][1]["role"] == "assistant"
            assert 1 <= q["completion_tokens"] <= 12
        s = target["summary"]
        assert s["num_questions"] == 5 and s["failed"] == 0
        assert s["correct"] == sum(q["correct"] for q in questions)
        assert s["invalid"] == sum(q["extracted"] is None for q in questions)
        assert 0.0 <= s["ci_low"] <= s["accuracy"] <= s["ci_high"] <= 1.0
    # greedy on the same worker: the same answers, token for token
    assert doc["comparison"]["both_completed"] == 5
    assert doc["comparison"]["text_differ"] == 0
    assert [q["output"] for q in doc["targets"][0]["questions"]] == [
        q["output"] for q in doc["targets"][1]["questions"]
    ]


@pytest.mark.timeout(60)
def test_differences_and_failures_are_counted(fake_urls, tmp_path, capsys):
    healthy, flaky = fake_urls
    out_json = tmp_path / "diff.json"
    rc = main(
        [
            "eval",
            "gsm8k",
            "--url",
            healthy,
            "--compare",
            flaky,
            "--num-questions",
            "6",
            "--concurrency",
            "1",
            "--no-progress",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    doc = json.loads(out_json.read_text())
    target, compare = doc["targets"]
    assert (
        target["summary"]["failed"] == 0 and compare["summary"]["failed"] == 2
    )  # every third fails
    assert "injected failure" in capsys.readouterr().out
    comparison = doc["comparison"]
    assert comparison["both_completed"] == 4
    # the flaky fake answers (crc % 7) + 1 instead of crc % 7: every extracted answer differs
    assert comparison["extracted_differ"] == 4 and comparison["text_differ"] == 4
    assert len(comparison["first_differences"]) == 4


def test_bad_arguments(fake_urls, capsys):
    assert main(["eval", "gsm8k", "--url", fake_urls[0], "--num-questions", "2000"]) == 2
    assert "num_questions + num_shots must be <= 1319" in capsys.readouterr().err
    assert main(["eval", "gsm8k", "--url", fake_urls[0], "--max-tokens", "0"]) == 2
    assert "--max-tokens must be >= 1" in capsys.readouterr().err
