"""``pdserve bench offline --speculative`` runs end to end: the acceptance-controlled mode
at rate 1 accepts every draft and keeps the outputs identical; a bad mode is a usage error."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main

ARGS = ["bench", "offline", "--model", "random:tiny", "--device", "cpu", "--max-tokens", "8"]
ARGS += ["--repeats", "1", "--num-speculative-tokens", "3"]


@pytest.mark.timeout(300)
def test_replay_and_ngram_reports(tmp_path):
    out = tmp_path / "spec.json"
    rc = main(
        ARGS
        + [
            "--num-prompts",
            "1,2",
            "--speculative",
            "replay:1.0",
            "--spec-workload",
            "copy",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["speculative"] == "acceptance-controlled (rate 1.0)"
    assert [r["num_prompts"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        assert row["identical_outputs"] == 1.0 and row["first_differences"] == []
        assert row["acceptance_rate"] == 1.0 and row["acceptance_length"] > 2
        assert row["plain_tok_s"] > 0 and row["spec_tok_s"] > 0
    out2 = tmp_path / "ngram.json"
    assert main(ARGS + ["--num-prompts", "1", "--speculative", "ngram", "--json", str(out2)]) == 0
    row = json.loads(out2.read_text())["results"][0]
    assert row["identical_outputs"] == 1.0 and json.loads(out2.read_text())["workload"] == "copy"


@pytest.mark.timeout(300)
def test_draft_mode_and_paid_replay(tmp_path):
    """Draft model == target: every draft accepted; replay with a draft model paid for."""
    out = tmp_path / "draft.json"
    flags = ["--num-prompts", "2", "--speculative-model", "random:tiny", "--json", str(out)]
    assert main(ARGS + flags + ["--speculative", "draft"]) == 0
    report = json.loads(out.read_text())
    assert report["speculative"] == "draft model random:tiny"
    row = report["results"][0]
    assert row["identical_outputs"] == 1.0 and row["acceptance_rate"] == 1.0
    assert main(ARGS + flags + ["--speculative", "replay:0.5"]) == 0
    report = json.loads(out.read_text())
    assert report["speculative"].endswith("draft model random:tiny run for its cost")
    assert report["results"][0]["identical_outputs"] == 1.0


def test_bad_mode_is_a_usage_error(capsys):
    assert main(ARGS + ["--speculative", "replay:2"]) == 2
    assert "speculative" in capsys.readouterr().err
    assert main(ARGS + ["--speculative", "reference:"]) == 2
    assert "reference:RATE" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_reference_mode_reports_its_overrides(tmp_path):
    """reference:RATE in fp32: outputs identical, no position overridden, labelled."""
    out = tmp_path / "reference.json"
    flags = ["--num-prompts", "2", "--speculative", "reference:0.8", "--json", str(out)]
    assert main(ARGS + flags) == 0
    report = json.loads(out.read_text())
    assert report["speculative"].startswith("acceptance-controlled, reference kept (rate 0.8")
    assert "benchmark only" in report["speculative"] and report["workload"] == "gsm8k"
    row = report["results"][0]
    assert row["identical_outputs"] == 1.0 and row["reference_mismatches"] == 0
    assert row["acceptance_length"] > 1.0 and row["kept_tokens"] > 0


def test_first_difference_positions():
    """Where a speculative output first left the plain one: the first unequal position,
    or the shorter length when one is a prefix of the other."""
    from pdserve.bench.speculative import first_difference

    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [9, 2, 3]) == 0
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
