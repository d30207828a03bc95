"""``pdserve bench grammar`` end to end on a tiny random model: it times decode steps and
the xgrammar mask per token (fill, apply, accept) and writes them as JSON."""

from __future__ import annotations

import json

from pdserve.cli import main


def test_bench_grammar_writes_its_measurements(tmp_path, capsys):
    out = tmp_path / "grammar.json"
    rc = main(
        [
            "bench", "grammar", "--model", "random:tiny", "--batch-sizes", "1,2",
            "--libraries", "xgrammar", "--decode-steps", "2", "--repeats", "1",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        assert row["decode_step_ms"] > 0 and row["xgrammar_mask_ms"] > 0
        parts = sum(row[f"xgrammar_{p}_ms"] for p in ("fill", "apply", "accept"))
        assert abs(parts - row["xgrammar_mask_ms"]) < 1e-6
        assert (
            abs(row["xgrammar_fraction"] - row["xgrammar_mask_ms"] / row["decode_step_ms"]) < 1e-9
        )
    assert "batch   2: decode step" in capsys.readouterr().out


def test_bench_grammar_rejects_an_unknown_library(capsys):
    assert main(["bench", "grammar", "--libraries", "outlines"]) == 2
    assert "libraries must be among" in capsys.readouterr().err
