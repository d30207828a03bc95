"""``pdserve bench offline`` runs end to end and compares like with like."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main


@pytest.mark.timeout(300)
def test_bench_offline_writes_json_with_identical_outputs(tmp_path, capsys):
    out = tmp_path / "offline.json"
    rc = main(
        [
            "bench",
            "offline",
            "--model",
            "random:tiny",
            "--device",
            "cpu",
            "--num-prompts",
            "1,2",
            "--max-tokens",
            "4",
            "--repeats",
            "1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["num_prompts"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        assert row["ours_tok_s"] > 0 and row["hf_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["ours_tok_s"] / row["hf_tok_s"])
        assert (
            row["identical_outputs"] == row["identical_first_tokens"] == 1.0
        )  # same weights, greedy
    assert "ratio" in capsys.readouterr().out


def test_bench_offline_rejects_bad_arguments(capsys):
    assert main(["bench", "offline", "--model", "random:tiny", "--num-prompts", "0"]) == 2
    assert "num-prompts" in capsys.readouterr().err
