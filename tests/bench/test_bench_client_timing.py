"""The serve bench's client times a chunk when its bytes arrive, not when its coroutine
gets to it; its streamed path's answers and failures; repeated rates reported apart.

Against ``pdserve/bench/sse_stub.py`` in a process of its own (real HTTP, chunked SSE at a
fixed step), whose timing block says when it wrote the first chunk (``first_chunk_unix``).
A busy client is made by a callback that holds the client's event loop for ``BUSY_S`` at
every loop iteration (as ~100 other streams' chunks would): a chunk's bytes are then read
off the socket at most ~2 iterations after they arrive, but a reader that needs several
iterations to get from the bytes to the event (httpx + httpx-sse: the head, the response,
the SSE iterator) counts each of them into the TTFT.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.bench.openai_client import StreamResult, make_client, stream_request
from pdserve.bench.phases import report_stages
from pdserve.bench.report import print_report
from pdserve.bench.runner import Series, Target
from pdserve_procs import LIVE, Proc, free_port, stop, wait_healthy

BUSY_S = 0.008  # the client's event loop held this long at every iteration
STEP_MS = 25.0  # the stub's engine step


def _start_stub(tmp: Path, *flags: str) -> Proc:
    port = free_port()
    log = tmp / f"stub_{port}.log"
    with open(log, "ab") as f:
        popen = subprocess.Popen(
            [sys.executable, "-m", "pdserve.bench.sse_stub", "--port", str(port), *flags],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    proc = Proc("sse_stub", f"http://127.0.0.1:{port}", popen, log)
    LIVE.append(proc)
    return proc


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """Two stubs: the head written with the first chunk (as the router's relay), and at
    once (as a worker that starts its stream before the first token)."""
    tmp = tmp_path_factory.mktemp("sse_stub")
    late = _start_stub(tmp, "--step-ms", str(STEP_MS), "--prefill-ms", "30")
    early = _start_stub(tmp, "--step-ms", str(STEP_MS), "--prefill-ms", "30", "--head-early")
    end_late = _start_stub(tmp, "--step-ms", str(STEP_MS), "--prefill-ms", "30", "--end-late")
    try:
        wait_healthy([late, early, end_late], timeout=60)
        yield {"late": late.url, "early": early.url, "end_late": end_late.url}
    finally:
        stop([late, early, end_late])


def _to_client_ms(r: StreamResult) -> float:
    """The stub's write of the first chunk → the client's time for it, ms."""
    assert r.ok, r.error
    assert r.ttft is not None and r.timing is not None
    return (r.start_unix + r.ttft - r.timing["mixed"]["first_chunk_unix"]) * 1e3


async def _busy_streams(
    client: httpx.AsyncClient, url: str, n: int, held: list[float]
) -> list[StreamResult]:
    """``n`` streams one after the other while a callback holds the loop at every
    iteration for ``BUSY_S``; ``held`` gets the actual length of each iteration (ms: a
    loaded machine sleeps longer than asked)."""
    loop = asyncio.get_running_loop()
    running = True
    last = [time.perf_counter()]

    def hold() -> None:
        if running:
            time.sleep(BUSY_S)
            now = time.perf_counter()
            held.append((now - last[0]) * 1e3)
            last[0] = now
            loop.call_soon(hold)

    body = {"model": "stub", "prompt": "hi", "max_tokens": 3, "temperature": 0}
    results = []
    loop.call_soon(hold)
    try:
        for _ in range(n):
            results.append(await stream_request(client, url, "completions", body))
    finally:
        running = False
    return results


@pytest.mark.timeout(120)
def test_chunks_are_timed_when_their_bytes_arrive_not_when_the_loop_gets_to_them(stubs):
    held: list[float] = []

    async def main() -> tuple[list[float], list[float], list[StreamResult]]:
        async with make_client(30.0) as lean, httpx.AsyncClient(timeout=30.0) as plain:
            # warm both clients' connections, so no connect is timed below
            await _busy_streams(lean, stubs["late"], 1, [])
            await _busy_streams(plain, stubs["late"], 1, [])
            fast = await _busy_streams(lean, stubs["late"], 8, held)
            slow = await _busy_streams(plain, stubs["late"], 8, held)
            return [_to_client_ms(r) for r in fast], [_to_client_ms(r) for r in slow], fast

    lean_ms, httpx_ms, results = asyncio.run(main())
    lean, plain = statistics.median(lean_ms), statistics.median(httpx_ms)
    it = statistics.median(held)  # one loop iteration, ms (BUSY_S on a quiet machine)
    print(f"to_client median: lean {lean:.2f} ms, httpx {plain:.2f} ms, iteration {it:.2f} ms")
    # the bytes are read within two held iterations of their arrival: 1.5 on average
    # (the one under way is half over), the median of 8 well under 1.75 (+ a busy
    # machine); the httpx path's ~2.5 fails this
    assert lean <= 1.75 * it + 2.0, (lean_ms, it)
    # the httpx reader counted one more of the client's own iterations into the TTFT:
    # what the lean path removes (the measurement guarded here is no no-op)
    assert plain >= lean + 0.4 * it, (lean_ms, httpx_ms, it)
    for r in results:  # what is measured is unchanged: three text chunks, two gaps
        assert r.output_tokens == 3 and len(r.itl) == 2 and r.text == " tok" * 3
        assert r.finish_reason == "length"
    # the gaps are the stub's steps, each read at most two held iterations late: judged by
    # the median of the 16, as on a busy CI machine the stub itself sends a chunk late now
    # and then (one gap 52 ms; or two chunks in one read: a 0 ms gap), not the client
    gaps = [g * 1e3 for r in results for g in r.itl]
    assert abs(statistics.median(gaps) - STEP_MS) <= 2 * it + 6.0, gaps


@pytest.mark.timeout(60)
def test_head_first_or_with_the_first_chunk_times_the_same(stubs):
    """A stream whose head came first (a worker) and one whose head came with the first
    chunk (the router's relay) are timed alike on an idle loop: the best of four requests
    each (a busy machine only adds to a time; a fresh-clone CI under its own load saw
    medians of 5.5 ms with bests of 0.2 and 2.5)."""

    async def main() -> dict[str, list[float]]:
        body = {"model": "stub", "prompt": "hi", "max_tokens": 2, "temperature": 0}
        out: dict[str, list[float]] = {"late": [], "early": []}
        async with make_client(30.0) as client:
            for _ in range(4):
                for name in out:
                    r = await stream_request(client, stubs[name], "completions", body)
                    out[name].append(_to_client_ms(r))
        return out

    got = asyncio.run(main())
    assert all(min(values) < 5.0 for values in got.values()), got


@pytest.mark.timeout(60)
def test_streamed_path_chat_errors_and_timeout(stubs, tmp_path):
    async def main() -> dict[str, StreamResult]:
        chat = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        out = {}
        async with make_client(30.0) as client:
            out["chat"] = await stream_request(client, stubs["late"], "chat", chat)
            # the stub answers 404 to any other path: an error naming the status
            out["404"] = await stream_request(client, stubs["late"] + "/nowhere", "chat", chat)
            out["refused"] = await stream_request(
                client, f"http://127.0.0.1:{free_port()}", "chat", chat
            )
        async with make_client(0.01) as client:  # the first chunk comes after 30 ms
            out["timeout"] = await stream_request(client, stubs["late"], "chat", chat)
        async with make_client(30.0, socket_streams=False) as client:  # --stream-client httpx
            assert client.streams is None
            out["httpx"] = await stream_request(client, stubs["late"], "chat", chat)
        return out

    got = asyncio.run(main())
    chat = got["chat"]
    assert chat.ok and chat.text == " tok" * 2 and chat.output_tokens == 2, chat
    via_httpx = got["httpx"]
    assert via_httpx.ok and via_httpx.text == chat.text and len(via_httpx.itl) == 1, via_httpx
    assert not got["404"].ok and got["404"].error.startswith("HTTP 404"), got["404"]
    refused = got["refused"]
    assert not refused.ok and "WorkerConnectionError" in refused.error, refused
    timeout = got["timeout"]
    assert not timeout.ok and timeout.error.startswith("TimeoutError"), timeout
    assert "0.01 s" in timeout.error


def _series(point: int, name: str, ttft: float) -> Series:
    r = StreamResult(ok=True, ttft=ttft, latency=ttft + 0.1, output_tokens=2, itl=[0.01])
    r.timing = {
        "mixed": {"phases": {"prefill": ttft / 2}, "start_unix": 1.0, "first_chunk_unix": 0.0}
    }
    r.start_unix = 1.0
    s = Series(Target(name, "http://x", "m"), "main", 8.0, None, [r], 1.0, point=point)
    return s


def test_repeated_rates_are_reported_as_load_points_of_their_own(capsys):
    series = [
        _series(0, "target", 0.05),
        _series(0, "compare", 0.04),
        _series(1, "target", 0.07),
        _series(1, "compare", 0.03),
    ]
    entries = report_stages(series)
    assert [e["load_point"] for e in entries] == [0, 1]
    assert [e["stages"]["target"]["prefill"]["median_ms"] for e in entries] == [25.0, 35.0]
    assert entries[1]["label"] == "main @8 req/s (load point 2)"
    assert entries[1]["grew_most"]["stage"] == "prefill"
    print_report(series)
    out = capsys.readouterr().out
    assert "(load point 2)" in out and "8 (load point 1)" in out
    # one table per load point, each with the compare ÷ target column
    assert out.count("compare ÷ target") == 2
    assert json.dumps(entries)  # JSON-ready


@pytest.mark.timeout(60)
def test_connections_are_reused_and_latency_ends_at_done(stubs):
    """A stream's connection goes back to the pool once its body ends, also when the
    chunked terminator comes a step after ``[DONE]``; E2E latency ends at ``[DONE]``."""

    async def main() -> tuple[list[StreamResult], int]:
        body = {"model": "stub", "prompt": "hi", "max_tokens": 2, "temperature": 0}
        async with make_client(30.0) as client:
            results = [
                await stream_request(client, stubs["end_late"], "completions", body)
                for _ in range(3)
            ]
            return results, len(client.streams._open)

    results, opened = asyncio.run(main())
    assert all(r.ok for r in results), results
    assert opened == 1  # one connection for the three requests
    for r in results:  # [DONE] comes with the last token: not a step (25 ms) later
        assert r.ttft is not None and r.latency - r.ttft < STEP_MS / 1e3 + 0.015, r


@pytest.mark.timeout(60)
def test_bench_serve_json_has_load_points_client_gc_and_send_times(stubs, tmp_path, capsys):
    from pdserve.cli import main

    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--url", stubs["early"], "--compare", stubs["late"]]
    argv += ["--request-rate", "20,20", "--num-requests", "4", "--output-len", "3"]
    argv += ["--input-len", "4", "--phase-timing", "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert [(s["target"], s["load_point"]) for s in doc["series"]] == [
        ("target", 0),
        ("compare", 0),
        ("target", 1),
        ("compare", 1),
    ]
    assert [e["load_point"] for e in doc["ttft_stages"]] == [0, 1]
    # both stubs answer with a mixed timing block: the client's lateness is a stage
    assert all("to_client" in e["stages"]["compare"] for e in doc["ttft_stages"])
    assert all(r["start_unix"] > 0 for s in doc["series"] for r in s["requests"])
    gc_stats = doc["client_gc"]
    assert gc_stats["frozen_objects"] > 0  # the client's heap frozen after the warm-up
    # the collector is off under load: no collection counted while streams were read
    assert gc_stats["pause_seconds"]["count"] == 0, gc_stats
    assert doc["arguments"]["stream_client"] == "socket"
    proc = doc["client_process"]
    assert proc["cpu_seconds"] > 0 and proc["involuntary_context_switches"] >= 0
    assert "(load point 2)" in capsys.readouterr().out
