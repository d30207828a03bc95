"""``bench/phases.py``: TTFT cut into stages from the answers' timing blocks, their
statistics, the stage that grew most, the PNG."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.openai_client import StreamResult
from pdserve.bench.phases import (
    grew_most,
    phase_png_path,
    plot_stages,
    stage_stats,
    stream_back_parts,
    ttft_stages,
)

PD_TIMING = {
    "prefill": {
        "phases": {
            "tokenize": 0.001,
            "engine_inbox": 0.0005,
            "bootstrap": 0.002,
            "queue": 0.003,
            "prefill": 0.010,
            "kv_transfer": 0.004,
            "respond": 0.001,
        }
    },
    "decode": {
        "phases": {
            "tokenize": 0.001,
            "engine_inbox": 0.0005,
            "bootstrap": 0.001,
            "kv_alloc_wait": 0.0005,
            "kv_transfer": 0.020,
            "kv_notice": 0.002,
            "decode_queue": 0.001,
            "decode": 0.050,
        },
        "first_token_out": 0.001,
    },
}
MIXED_TIMING = {
    "mixed": {
        "phases": {"tokenize": 0.001, "engine_inbox": 0.0005, "queue": 0.002, "prefill": 0.010}
    }
}


def test_pd_stages_split_the_clients_ttft():
    r = StreamResult(ok=True, ttft=0.030, timing=PD_TIMING)
    stages = ttft_stages(r)
    assert stages is not None
    assert stages["prefill"] == pytest.approx(0.010)
    assert stages["kv_transfer"] == pytest.approx(0.004)
    # decode's path to the notification (0.023 s) beyond prefill's path to sending it (0.0205 s)
    assert stages["decode_wait"] == pytest.approx(0.023 - 0.0205)
    assert stages["kv_notice"] == pytest.approx(0.002)  # then decode's engine noticed it
    assert stages["first_token_out"] == pytest.approx(0.001)  # decode's engine -> its loop
    # the rest of the client's 30 ms: router, HTTP, the first chunk's way back
    assert stages["router_and_stream"] == pytest.approx(0.030 - 0.026)
    assert sum(stages.values()) == pytest.approx(r.ttft)
    # with the decode worker's start time: the way there and the way back apart
    timed = {**PD_TIMING, "decode": {**PD_TIMING["decode"], "start_unix": 1000.003}}
    split = ttft_stages(StreamResult(ok=True, ttft=0.030, timing=timed, start_unix=1000.0))
    assert split is not None and "router_and_stream" not in split
    assert split["to_worker"] == pytest.approx(0.003)
    assert split["stream_back"] == pytest.approx(0.030 - 0.026 - 0.003)
    assert (
        stream_back_parts(StreamResult(ok=True, ttft=0.030, timing=timed, start_unix=1000.0)) == {}
    )


def test_stream_back_parts_from_the_worker_and_relay_times():
    """The first token held by decode's loop at 1000.029 (client start 1000.0 + to_worker 3
    ms + decode's 23.5 ms path + 2 ms notice + 1 ms out... = the client's 30 ms TTFT minus
    stream_back): its SSE chunk out at +0.2 ms, the relay took it at +0.5 ms and rendered
    it at +0.6 ms, the client had it at 1000.030; the parts add up to stream_back."""
    decode = {**PD_TIMING["decode"], "start_unix": 1000.003}
    r = StreamResult(ok=True, ttft=0.030, start_unix=1000.0, timing={**PD_TIMING, "decode": decode})
    stream_back = ttft_stages(r)["stream_back"]
    held = 1000.030 - stream_back
    chunk, t_in, t_out = held + 0.0002, held + 0.0005, held + 0.0006
    r.timing["decode"] = {**decode, "first_chunk_unix": chunk}
    r.timing["relay"] = {"first_chunk_in_unix": t_in, "first_chunk_out_unix": t_out}
    parts = stream_back_parts(r)
    assert parts["sse_write"] == pytest.approx(0.0002, abs=1e-7)
    assert parts["relay_in"] == pytest.approx(0.0003, abs=1e-7)
    assert parts["relay"] == pytest.approx(0.0001, abs=1e-7)
    assert parts["to_client"] == pytest.approx(stream_back - 0.0006, abs=1e-7)
    assert sum(parts.values()) == pytest.approx(stream_back)
    assert set(stage_stats([r])) >= {"stream_back", "sse_write", "relay_in", "relay", "to_client"}
    # a worker answering directly (no router): its chunk, then the way to the client
    del r.timing["relay"]
    assert stream_back_parts(r) == pytest.approx(
        {"sse_write": 0.0002, "to_client": stream_back - 0.0002, "text_wait": 0.0}, abs=1e-7
    )
    # the client's first event carried no text (its TTFT counts the next, 9 ms on): that
    # wait is text_wait, not the way to the client, and the parts still add up
    r.first_event = 0.030
    r.ttft = 0.039
    stream_back = ttft_stages(r)["stream_back"]
    parts = stream_back_parts(r)
    assert parts["text_wait"] == pytest.approx(0.009, abs=1e-7)
    assert parts["sse_write"] == pytest.approx(0.0002, abs=1e-7)
    assert parts["to_client"] == pytest.approx(0.030 - (chunk - 1000.0), abs=1e-7)
    assert sum(parts.values()) == pytest.approx(stream_back)


def test_mixed_stages_and_missing_blocks():
    stages = ttft_stages(StreamResult(ok=True, ttft=0.020, timing=MIXED_TIMING))
    assert stages is not None and "kv_transfer" not in stages
    assert stages["router_and_stream"] == pytest.approx(0.020 - 0.0135)
    assert ttft_stages(StreamResult(ok=True, ttft=0.02, timing=None)) is None
    assert (
        ttft_stages(StreamResult(ok=True, ttft=0.02, timing={"prefill": PD_TIMING["prefill"]}))
        is None
    )
    assert ttft_stages(StreamResult(ok=True, ttft=None, timing=MIXED_TIMING)) is None


def test_stats_and_the_stage_that_grew_most(tmp_path):
    pd = stage_stats(
        [StreamResult(ok=True, ttft=0.030 + i / 1000, timing=PD_TIMING) for i in range(5)]
    )
    mixed = stage_stats([StreamResult(ok=True, ttft=0.020, timing=MIXED_TIMING)] * 5)
    assert pd["router_and_stream"]["median_ms"] == pytest.approx(6.0)
    assert pd["prefill"]["count"] == 5
    assert "decode_wait" not in mixed
    stage, delta = grew_most(pd, mixed)
    # kv_transfer is 4 ms in PD and absent (0) in mixed; router_and_stream 6 vs 6.5 ms
    assert (stage, delta) == ("kv_transfer", pytest.approx(4.0))
    assert grew_most({}, {}) is None
    assert stage_stats([StreamResult(ok=False, ttft=0.1, timing=PD_TIMING)]) == {}
    path = phase_png_path(str(tmp_path / "run.json"))
    assert path.endswith("run.phases.png")
    plot_stages([("pd", pd), ("mixed", mixed)], path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not math.isnan(pd["kv_transfer"]["p99_ms"])


def test_decode_only_answers_are_counted():
    """Answers the router sent whole to decode (selective PD) carry no PD stages: counted,
    so the report says why they are missing from the table."""
    from pdserve.bench.phases import decode_only_count

    whole = {"decode": {"phases": {"tokenize": 0.001}}, "router": {"pd_decision": "decode_only"}}
    pd = {**PD_TIMING, "router": {"pd_decision": "pd"}}
    results = [
        StreamResult(ok=True, ttft=0.02, timing=whole),
        StreamResult(ok=True, ttft=0.02, timing=pd),
        StreamResult(ok=False, timing=whole),
        StreamResult(ok=True, ttft=0.02, timing=None),
    ]
    assert decode_only_count(results) == 1
    assert ttft_stages(results[0]) is None and ttft_stages(results[1]) is not None


def test_bench_serve_refuses_a_missing_json_folder_before_the_run(tmp_path):
    """--json/--plot into a folder that does not exist: a one-line error (exit 2) before
    any request, not a traceback after the whole run."""
    import subprocess
    import sys

    missing = tmp_path / "no" / "such"
    for flag in ("--json", "--plot"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve",
                "bench",
                "serve",
                "--url",
                "http://127.0.0.1:9",
                "--num-requests",
                "1",
                flag,
                str(missing / "x.out"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert f"error: {flag}: folder {missing} does not exist" in proc.stderr
        assert "Traceback" not in proc.stderr
