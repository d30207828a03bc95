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
            "--kv-order",
            "layer_major",  # not the CPU default: the flag reaches the pool
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["num_prompts"] for r in report["results"]] == [1, 2]
    assert report["kv_order"] == "layer_major"
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
    with pytest.raises(SystemExit) as exc:  # refused while parsing (engine_args.config_value)
        main(["bench", "offline", "--model", "random:tiny", "--kv-order", "diagonal"])
    assert exc.value.code == 2
    assert "--kv-order" in capsys.readouterr().err


def test_prefill_row_times_new_prompts_every_run(monkeypatch):
    """Repeated prompts would hit the prefix cache and time nothing: each timed run of the
    prefill row gets prompts no earlier run had."""
    from types import SimpleNamespace

    from pdserve.bench import offline

    seen: list[tuple[int, ...]] = []

    def fake_ours(llm, prompts, max_tokens):
        seen.append(tuple(prompts[0]))
        return 1.0, None

    monkeypatch.setattr(offline, "_time_ours", fake_ours)
    monkeypatch.setattr(offline, "_time_hf", lambda *a: (2.0, None))
    llm = SimpleNamespace(engine=SimpleNamespace(vocab_size=1000, device="cpu"))
    row = offline._time_prefill(llm, None, (2, 16), 0, 3)
    assert len(seen) == 4 and len(set(seen)) == 4  # the warm-up and 3 runs, all different
    assert row["ours_tok_s"] == 32.0 and row["ratio"] == 2.0


@pytest.mark.timeout(300)
def test_one_token_runs_are_warmed_up_before_they_are_timed(monkeypatch, capsys):
    """The one-token run (the decode rate's reference) has step shapes of its own; its first
    run must be a warm-up, never a timed one."""
    from pdserve.bench import offline

    calls: list[int] = []
    real = offline._time_ours

    def recording(llm, prompts, max_tokens):
        calls.append(max_tokens)
        return real(llm, prompts, max_tokens)

    monkeypatch.setattr(offline, "_time_ours", recording)
    args = ["bench", "offline", "--model", "random:tiny", "--device", "cpu"]
    assert main(args + ["--num-prompts", "2", "--max-tokens", "3", "--repeats", "2"]) == 0
    assert calls == [3, 1, 3, 1, 3, 1]  # warm-up of both lengths, then 2 timed pairs
    calls.clear()
    assert main(args + ["--num-prompts", "2", "--max-tokens", "1", "--repeats", "1"]) == 0
    assert calls == [1, 1]
    capsys.readouterr()
