"""``pdserve bench attention``: the decode kernel alone, checked against sdpa and its bytes
(on CPU under TRITON_INTERPRET=1, set by this folder's conftest)."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.bench.attention import context_lengths, decode_read_bytes, parse_config
from pdserve.cli import main

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1 (conftest)


@pytest.mark.timeout(300)
def test_bench_attention_rows_match_sdpa_and_count_their_bytes(tmp_path, capsys):
    out = tmp_path / "attention.json"
    args = ["bench", "attention", "--device", DEVICE, "--dtype", "float32", "--batch", "2"]
    args += ["--context", "40", "--layout", "uniform,skewed", "--num-heads", "8"]
    args += ["--num-kv-heads", "2", "--head-dim", "16", "--page-size", "16", "--iters", "1"]
    args += ["--configs", "eager,graph,3/16/4/1/4,2/16/4/1/0/1", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert len(rows) == 2 * 4
    assert [(r["layout"], r["config_spec"]) for r in rows[:4]] == [
        ("uniform", "eager"),
        ("uniform", "graph"),
        ("uniform", "given"),
        ("uniform", "given"),
    ]
    assert (rows[2]["splits"], rows[2]["block_n"], rows[2]["balance"]) == (3, 16, 4)
    assert rows[3]["prefetch"] and not rows[2]["prefetch"]
    for r in rows:
        assert r["max_abs_diff_vs_sdpa"] < 1e-5
        lens = context_lengths(2, 40, r["layout"])
        assert r["seq_lens_sum"] == sum(lens)
        assert r["bytes"] == decode_read_bytes(lens, 8, 2, 16, 4)
        assert r["fraction"] == pytest.approx(
            r["bytes"] / (r["us_per_call"] * 1e-6) / report["copy_bandwidth_bytes_per_s"]
        )
    assert "fraction" in capsys.readouterr().out


def test_bytes_lengths_and_configs():
    # K and V: 2 x (40 + 1) tokens x 2 heads x 16 dims x 2 bytes; q and out: 2 x 2 x 8 x 16 x 2
    assert decode_read_bytes([40, 1], 8, 2, 16, 2) == 2 * 41 * 2 * 16 * 2 + 2 * 2 * 8 * 16 * 2
    assert context_lengths(3, 64, "skewed") == [64, 2, 2]
    assert context_lengths(2, 5, "uniform") == [5, 5]
    assert parse_config("eager") == "eager"
    assert parse_config("4/64/4/2").splits == 4
    assert parse_config("1/32/4/1/0/1").prefetch and not parse_config("1/32/4/1/0").prefetch
    for bad in ("4/64", "0/64/4/2", "x", "1/32/4/1/0/2", "1/32/4/1/0/1/1"):
        with pytest.raises(ValueError, match="configs"):
            parse_config(bad)


@pytest.mark.parametrize(
    "extra, field",
    [
        (["--batch", "0"], "batch"),
        (["--layout", "zigzag"], "layout"),
        (["--configs", "1/48/4/2"], "configs"),
        (["--num-heads", "6", "--num-kv-heads", "4"], "num-heads"),
    ],
)
def test_bench_attention_rejects_bad_arguments(extra, field, capsys):
    assert main(["bench", "attention", "--device", "cpu"] + extra) == 2
    assert field in capsys.readouterr().err


def test_bench_attention_on_cpu_without_the_interpreter_is_a_usage_error(monkeypatch, capsys):
    # without TRITON_INTERPRET=1 every row would fail ("0 active drivers"): refused up front
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["bench", "attention", "--device", "cpu", "--iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "needs CUDA" in err and "TRITON_INTERPRET=1" in err
