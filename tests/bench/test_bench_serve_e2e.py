"""``pdserve bench serve`` end to end: real HTTP against a tiny worker (counts, files, no crash)."""

from __future__ import annotations

import json

import pytest

from pdserve.cli import main
from pdserve_procs import free_port

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _series(doc: dict, target: str, stream: str = "main") -> list[dict]:
    return [s for s in doc["series"] if s["target"] == target and s["stream"] == stream]


@pytest.mark.timeout(120)
def test_standard_compare_two_rates_json_and_plot(pdserve_url, tmp_path, capsys):
    out_json, out_png = tmp_path / "serve.json", tmp_path / "serve.png"
    rc = main(
        [
            "bench",
            "serve",
            "--url",
            pdserve_url,
            "--compare",
            pdserve_url + "/v1",
            "--num-requests",
            "6",
            "--input-len",
            "12",
            "--output-len",
            "5",
            "--range-ratio",
            "0.2",
            "--request-rate",
            "40,inf",
            "--concurrency",
            "3",
            "--blocks",
            "2",
            "--seed",
            "1",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "compare ÷ target" in stdout and "throughput vs request rate" in stdout
    doc = json.loads(out_json.read_text())
    assert doc["workload"]["num_requests"] == 6 and doc["workload"]["seed"] == 1
    assert doc["load"]["request_rates"] == [40.0, None]  # null = closed loop (inf)
    assert [t["name"] for t in doc["targets"]] == ["target", "compare"]
    assert len(doc["series"]) == 4
    lens_by_rate: dict = {}
    for name in ("target", "compare"):
        for s in _series(doc, name):
            summary = s["summary"]
            assert (summary["num_requests"], summary["completed"], summary["failed"]) == (6, 6, 0)
            assert len(s["requests"]) == 6
            lens = [r["output_tokens"] for r in s["requests"]]
            assert all(4 <= n <= 6 for n in lens)  # ignore_eos: exactly max_tokens, 5 ± 20%
            # same seeded workload on both targets at a rate
            assert lens_by_rate.setdefault(s["request_rate"], lens) == lens
            assert all(
                r["ttft_ms"] > 0 and len(r["itl_ms"]) <= r["output_tokens"] - 1
                for r in s["requests"]
            )
            assert summary["total_output_tokens"] == sum(lens)
    # each rate draws prompts of its own (seed + its index): no rate finds the last one's
    # prompts in the prefix cache
    assert len(lens_by_rate) == 2
    a, b = lens_by_rate.values()
    assert a != b
    assert out_png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(120)
def test_gsm8k_dataset_chat(pdserve_url, tmp_path):
    out_json = tmp_path / "gsm8k.json"
    rc = main(
        [
            "bench",
            "serve",
            "--url",
            pdserve_url,
            "--dataset",
            "gsm8k",
            "--num-requests",
            "4",
            "--output-len",
            "4",
            "--concurrency",
            "2",
            "--num-warmups",
            "0",
            "--no-progress",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert doc["workload"]["endpoint"] == "chat"
    (s,) = doc["series"]
    assert s["summary"]["completed"] == 4
    assert all(r["output_tokens"] == 4 and r["prompt_tokens"] > 20 for r in s["requests"])


@pytest.mark.timeout(120)
def test_interference_scenario(pdserve_url, tmp_path, capsys):
    out_json, out_png = tmp_path / "intf.json", tmp_path / "intf.png"
    rc = main(
        [
            "bench",
            "serve",
            "--url",
            pdserve_url,
            "--compare",
            pdserve_url,
            "--scenario",
            "interference",
            "--num-requests",
            "4",
            "--concurrency",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "12",
            "--long-input-len",
            "96",
            "--long-request-rate",
            "50",
            "--blocks",
            "1",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    assert rc == 0
    assert "decode ITL p99 under long-prompt interference" in capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    assert doc["interference"] == {"long_input_len": 96, "long_request_rate": 50.0}
    head = doc["interference_headline"]
    assert set(head["decode_itl_p99_ms"]) == {"target", "compare"}
    assert head["ratio_compare_over_target"] > 0
    for name in ("target", "compare"):
        (decode,) = _series(doc, name, "decode")
        assert decode["summary"]["completed"] == 4
        assert all(r["output_tokens"] == 12 for r in decode["requests"])
        (long,) = _series(doc, name, "long")
        assert long["summary"]["failed"] == 0
        assert all(r["output_tokens"] == 1 and r["prompt_tokens"] >= 96 for r in long["requests"])
    assert out_png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(60)
def test_failures_are_counted_and_reported(fake_urls, tmp_path, capsys):
    healthy, flaky = fake_urls
    out_json = tmp_path / "fail.json"
    rc = main(
        [
            "bench",
            "serve",
            "--url",
            healthy,
            "--compare",
            flaky,
            "--dataset",
            "gsm8k",
            "--num-requests",
            "9",
            "--output-len",
            "6",
            "--concurrency",
            "3",
            "--num-warmups",
            "0",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    assert "injected failure" in capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    (good,), (bad,) = _series(doc, "target"), _series(doc, "compare")
    assert (good["summary"]["completed"], good["summary"]["failed"]) == (9, 0)
    assert (bad["summary"]["completed"], bad["summary"]["failed"]) == (6, 3)  # every third fails
    assert bad["summary"]["errors"] == ['HTTP 500: {"error":{"message":"injected failure"}}']
    # the fake sends a role-only first chunk: TTFT is measured at the first text, not at it
    assert all(len(r["itl_ms"]) == 5 for r in good["requests"])


def test_bad_arguments_and_unreachable_url(fake_urls, capsys):
    assert main(["bench", "serve", "--url", fake_urls[0], "--concurrency", "0"]) == 2
    assert "--concurrency must be >= 1" in capsys.readouterr().err
    assert main(["bench", "serve", "--url", fake_urls[0], "--request-rate", "fast"]) == 2
    assert "--request-rate" in capsys.readouterr().err
    assert (
        main(["bench", "serve", "--url", f"http://127.0.0.1:{free_port()}", "--num-requests", "1"])
        == 1
    )
    assert "could not list models" in capsys.readouterr().err


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dataset", ["shared-prefix", "multi-turn"])
def test_prefix_workloads_report_cache_hits(pdserve_url, tmp_path, capsys, dataset):
    out_json = tmp_path / f"{dataset}.json"
    rc = main(
        [
            "bench",
            "serve",
            "--url",
            pdserve_url,
            "--dataset",
            dataset,
            "--num-requests",
            "6",
            "--num-groups",
            "2",
            "--system-prompt-len",
            "80",
            "--num-turns",
            "3",
            "--input-len",
            "20",
            "--output-len",
            "4",
            "--concurrency",
            "1",
            "--no-progress",
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    assert "cache hit rate" in capsys.readouterr().out
    (s,) = _series(json.loads(out_json.read_text()), "target")
    summary = s["summary"]
    assert summary["completed"] == 6
    # one at a time: after the first of each group (conversation), most of a prompt is cached
    assert 0.3 < summary["cache_hit_rate"] < 1.0
    assert summary["kv_bytes_per_request"] is None  # a mixed worker moves no KV
    if dataset == "multi-turn":
        prompts = [r["prompt_tokens"] for r in s["requests"]]
        assert prompts[1] > prompts[0] and prompts[2] > prompts[1]  # the history grows
