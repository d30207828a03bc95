"""The router's PD dispatch against fake prefill/decode workers (in-process servers,
joined at teardown): bootstrap fields, merged prompt logprobs, one clear error with the
other leg cancelled, SSE error events, timeouts, health ejection and restore, metrics.
Orders (a chunk relayed before prefill answered, one chunk at a time) are stated with
the fakes' event gates, never with seconds, so the tests hold on a loaded machine."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fake_workers import STREAM_ERROR, FakeWorker
from prometheus_client.parser import text_string_to_metric_families

from pdserve.config import RouterConfig
from pdserve.http.netutil import ThreadedServer
from pdserve.router.app import build_router_app

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def setup():
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    servers = [ThreadedServer(prefill.app), ThreadedServer(decode.app)]
    for s in servers:
        s.start()
    p_url, d_url = (s.url for s in servers)
    config = RouterConfig(
        prefill_urls=(p_url,),
        decode_urls=(d_url,),
        pd_min_prefill_tokens=0,  # every request through the pair: these tests are about PD
        request_timeout=60.0,  # never reached: the timeout test runs its own router
        health_check_interval=0.1,
        health_check_timeout=1.0,
        health_failure_threshold=1,
        max_migrations=0,  # one attempt per request here: test_router_migration.py moves them
    )
    router = ThreadedServer(build_router_app(config))
    router.start()
    url = router.url
    try:
        yield prefill, decode, url
    finally:
        router.stop()
        for s in servers:
            s.stop()


@pytest.fixture(autouse=True)
def reset(setup):
    for w in setup[:2]:
        w.mode, w.health, w.disconnects = "ok", 200, 0
        w.delay, w.chunks, w.chunk_gap = 0.0, 2, 0.01
        w.gate, w.chunk_gates, w.chunks_sent = None, [], 0
        w.answered.clear()
        w.stream_done.clear()
        w.bodies.clear()
    _wait_health(setup[2], 200)


def _wait_health(url: str, status: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health").status_code != status:
        assert time.monotonic() < deadline, f"router /health never became {status}"
        time.sleep(0.05)


def _wait(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_both_legs_get_the_body_with_one_room_and_prompt_logprobs_are_merged(setup):
    prefill, decode, url = setup
    r = httpx.post(
        url + "/generate", json={"text": "hi", "return_logprob": True, "logprob_start_len": 0}
    )
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "decode"
    assert r.json()["meta_info"]["input_token_logprobs"] == [[None, 1, None], [-0.5, 2, None]]
    (pb,), (db,) = prefill.bodies, decode.bodies
    assert pb["bootstrap_room"] == db["bootstrap_room"] and 0 <= db["bootstrap_room"] < 2**63
    assert pb["bootstrap_host"] == db["bootstrap_host"] == "127.0.0.1"
    assert pb["bootstrap_port"] == db["bootstrap_port"] == 4242
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "prompt_logprobs": 1, "n": 3})
    assert r.json()["choices"][0]["prompt_logprobs"] == [None, {"token_id": 2, "logprob": -0.5}]
    rooms = {b["bootstrap_room"] for b in prefill.bodies}
    assert len(rooms) == 2  # a fresh room per request
    assert httpx.get(url + "/get_server_info").json()["live_bootstrap_rooms"] == 0


@pytest.mark.parametrize("failing", ["prefill", "decode"])
def test_one_leg_fails_the_other_is_cancelled_and_one_error_returned(setup, failing):
    prefill, decode, url = setup
    bad, other = (prefill, decode) if failing == "prefill" else (decode, prefill)
    bad.mode, other.mode = "fail", "hang"
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=60)
    assert (  # the failing leg's error, not the request timeout's 504
        r.status_code == 500
        and f"{failing} failed: KV transfer failed" in r.json()["error"]["message"]
    )
    _wait(lambda: other.disconnects == 1)


def test_stream_passes_through_and_a_broken_stream_ends_with_an_error_event(setup):
    prefill, decode, url = setup
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "stream": True})
    assert r.text.count("data: ") == 3 and r.text.endswith("data: [DONE]\n\n")
    assert "stream" not in prefill.bodies[-1]  # the prefill leg never streams
    decode.mode = "stream_break"
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "stream": True})
    events = [e for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and "decode worker" in events[-2]
    prefill.mode, decode.mode = "fail", "hang"  # prefill fails before decode's stream opens
    # prefill answers once decode has the request (else the router, whose decode connection
    # broke above, may give the leg up before it is sent: then decode never sees it)
    prefill.gate = threading.Event()
    opened = threading.Thread(
        target=lambda: (_wait(lambda: len(decode.bodies) == 3), prefill.gate.set())
    )
    opened.start()
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "stream": True})
    opened.join()
    assert r.status_code == 500 and "prefill failed" in r.json()["error"]["message"]
    _wait(lambda: decode.disconnects == 1)


def _gates(n: int, open_: int = 1) -> list[threading.Event]:
    """``n`` gates, the first ``open_`` of them open."""
    gates = [threading.Event() for _ in range(n)]
    for g in gates[:open_]:
        g.set()
    return gates


def _stream(url: str, body: dict, on_chunk) -> tuple[int, list[str]]:
    """POST a stream; calls ``on_chunk(i, data)`` as data chunk ``i`` arrives (before
    reading on) and returns the status and every event's data."""
    events: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if events[-1] != "[DONE]":
                    on_chunk(len(events) - 1, events[-1])
    return r.status_code, events


def test_decode_chunks_are_relayed_while_prefill_is_still_busy(setup):
    prefill, decode, url = setup
    prefill.gate = threading.Event()  # prefill answers once decode's stream has ended
    decode.chunks, decode.chunk_gates = 4, _gates(4)

    def release_prefill() -> None:
        decode.stream_done.wait(60)
        prefill.gate.set()

    release = threading.Thread(target=release_prefill)
    release.start()
    busy, done_after_answer = [], []

    def on_chunk(i: int, data: str) -> None:
        busy.append(not prefill.answered.is_set())
        if i + 1 < decode.chunks:  # chunk i+1 exists only once chunk i arrived: one by one
            decode.chunk_gates[i + 1].set()

    status, events = _stream(url, {"prompt": "x", "stream": True}, on_chunk)
    done_after_answer.append(prefill.answered.is_set())
    release.join(60)
    assert status == 200 and events[-1] == "[DONE]"
    assert [json.loads(d)["choices"][0]["text"] for d in events[:-1]] == ["0", "1", "2", "3"]
    # Chunks 0-2 arrived while prefill could not have answered (its gate opens only after
    # decode's last chunk), and [DONE] only once it had (its room was live till then).
    assert busy[:3] == [True, True, True] and done_after_answer == [True]
    assert (
        prefill.disconnects == 0
        and httpx.get(url + "/get_server_info").json()["live_bootstrap_rooms"] == 0
    )


def test_prefill_failing_mid_stream_cancels_decode_with_one_sse_error(setup):
    prefill, decode, url = setup
    prefill.mode, prefill.gate = "fail", threading.Event()
    decode.chunks, decode.chunk_gates = 15, _gates(15)  # decode sends chunk 0, then waits

    def on_chunk(i: int, data: str) -> None:
        if i == 0:
            assert "error" not in json.loads(data), data
            prefill.gate.set()  # prefill fails once the client has a decode chunk

    status, events = _stream(url, {"prompt": "x", "stream": True}, on_chunk)
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 3, events
    error = json.loads(events[-2])["error"]
    assert "prefill failed: KV transfer failed" in error["message"] and error["code"] is None
    assert error["type"] == "internal_server_error"
    _wait(lambda: decode.disconnects == 1)  # decode's stream was cancelled


def test_prompt_logprobs_hold_only_the_first_chunk_until_prefill_answers(setup):
    prefill, decode, url = setup
    prefill.gate = threading.Event()
    decode.chunks, decode.chunk_gates = 3, _gates(3)

    # prefill answers once decode produced its first chunk (which the router must hold)
    def release_prefill() -> None:
        _wait(lambda: decode.chunks_sent >= 1, 60)
        prefill.gate.set()

    release = threading.Thread(target=release_prefill)
    release.start()
    answered_first: list[bool] = []

    def on_chunk(i: int, data: str) -> None:
        answered_first.append(prefill.answered.is_set())
        if i + 1 < decode.chunks:  # later chunks are made only after the client has this one
            decode.chunk_gates[i + 1].set()

    body = {"prompt": "x", "stream": True, "prompt_logprobs": 1}
    status, events = _stream(url, body, on_chunk)
    release.join(60)
    chunks = [json.loads(d)["choices"][0] for d in events[:-1]]
    assert status == 200 and [c["text"] for c in chunks] == ["0", "1", "2"]
    assert answered_first[0]  # the first chunk waited for prefill's answer ...
    assert chunks[0]["prompt_logprobs"] == [None, {"token_id": 2, "logprob": -0.5}]
    assert "prompt_logprobs" not in chunks[1]  # ... the others were relayed as they came


def test_request_timeout_gives_504_and_cancels_both_legs(setup):
    prefill, decode, url = setup
    prefill.mode = decode.mode = "hang"  # neither answers until its client leaves
    p_url, d_url = (w["url"] for w in httpx.get(url + "/get_server_info").json()["workers"])
    config = RouterConfig(
        prefill_urls=(p_url,),
        decode_urls=(d_url,),
        request_timeout=0.5,
        max_migrations=0,
        pd_min_prefill_tokens=0,  # both legs
    )
    router = ThreadedServer(build_router_app(config))
    router.start()
    r_url = router.url
    try:
        _wait_health(r_url, 200, timeout=30)
        r = httpx.post(r_url + "/generate", json={"text": "x"}, timeout=60)
        assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
        _wait(lambda: prefill.disconnects == 1 and decode.disconnects == 1)
    finally:
        router.stop()


def test_unhealthy_worker_is_ejected_then_restored(setup):
    prefill, decode, url = setup
    prefill.health = 503
    _wait_health(url, 503)
    assert "prefill" in httpx.get(url + "/health").json()["error"]["message"]
    # no prefill worker: the decode worker serves the request whole (no bootstrap fields)
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decode", r.text
    assert not prefill.bodies and len(decode.bodies) == 1
    assert "bootstrap_room" not in decode.bodies[0]
    metrics = httpx.get(url + "/metrics").text
    assert 'pdserve_router_pd_fallbacks_total{reason="no_healthy_prefill"} 1.0' in metrics
    decode.health = 503  # neither role: 503
    _wait(lambda: "decode" in httpx.get(url + "/health").text)
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "no healthy prefill worker" in r.json()["error"]["message"]
    assert len(decode.bodies) == 1
    prefill.health = decode.health = 200
    _wait_health(url, 200)
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 200
    assert len(prefill.bodies) == 1 and "bootstrap_room" in decode.bodies[-1]  # a pair again


def test_router_bad_input_and_metrics(setup):
    prefill, decode, url = setup
    for content in (b"{oops", b"[1]", b'{"stream": "yes"}'):
        r = httpx.post(url + "/v1/chat/completions", content=content)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # the bootstrap fields are the router's: from a client they would point a worker at an
    # address of the client's choosing (the decode-only path sent them on as they came)
    for field, value in (
        ("bootstrap_host", "10.0.0.1"),
        ("bootstrap_port", 80),
        ("bootstrap_room", 7),
    ):
        for path, body in (("/v1/chat/completions", {"messages": []}), ("/v1/completions", {})):
            r = httpx.post(url + path, json={**body, field: value})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field
            assert "is set by the router" in r.json()["error"]["message"]
    assert not prefill.bodies and not decode.bodies
    httpx.post(url + "/generate", json={"text": "x"})
    text = httpx.get(url + "/metrics").text
    assert 'pdserve_router_requests_total{endpoint="/generate",status="200"}' in text
    assert (
        "pdserve_router_worker_healthy" in text and "pdserve_router_request_latency_seconds" in text
    )
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "fake"


def test_a_worker_of_the_wrong_role_is_never_used(setup):
    prefill, decode, _ = setup
    p_url = httpx.get(setup[2] + "/get_server_info").json()["workers"][0]["url"]
    wrong = RouterConfig(
        prefill_urls=(p_url,),
        decode_urls=(p_url,),
        health_check_interval=0.1,
        pd_min_prefill_tokens=0,
    )
    router = ThreadedServer(build_router_app(wrong))
    router.start()
    url = router.url
    try:
        assert httpx.get(url + "/health").status_code == 503
        info = httpx.get(url + "/get_server_info").json()["workers"]
        assert (
            "serves role 'prefill', not 'decode'"
            in [w for w in info if w["role"] == "decode"][0]["last_error"]
        )
        r = httpx.post(url + "/generate", json={"text": "x"})
        assert r.status_code == 503 and "no healthy decode worker" in r.json()["error"]["message"]
    finally:
        router.stop()


def test_huge_body_is_413_and_unknown_routes_are_openai_errors(setup):
    prefill, decode, url = setup
    r = httpx.post(
        url + "/v1/completions", content=b'{"prompt": "' + b"a" * (33 * 2**20) + b'"}', timeout=30
    )
    err = r.json()["error"]
    assert r.status_code == 413 and err["type"] == "invalid_request_error", r.text[:300]
    assert not prefill.bodies and not decode.bodies
    for method, path, status in (
        ("GET", "/nope", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/health", 405),
        ("POST", "/v1/models", 405),
    ):
        for given in (None, "probe-7"):
            headers = {"x-request-id": given} if given else {}
            r = httpx.request(method, url + path, headers=headers)
            assert r.status_code == status and r.json()["error"]["code"] is None, r.text
            assert f"{method} {path}" in r.json()["error"]["message"], r.text
            # the error body's request_id is the answer's x-request-id (the caller's if given)
            assert (
                r.json()["request_id"]
                == r.headers["x-request-id"]
                == (given or r.headers["x-request-id"])
            ), r.text


def test_head_of_the_probe_paths_answers_like_get_without_a_body(setup):
    """Load balancers and Kubernetes probes may send HEAD: GET's status and headers, no
    body; a POST-only path stays a 405."""
    prefill, decode, url = setup
    with httpx.Client(base_url=url, timeout=10) as client:
        for path in ("/health", "/v1/models", "/metrics", "/get_server_info", "/version"):
            get, head = client.get(path), client.head(path)
            assert get.status_code == head.status_code == 200, (path, head.text)
            assert head.content == b"" and get.content, path
            assert head.headers["content-type"] == get.headers["content-type"], path
        decode.health = 503  # the router's health follows its workers' (HEAD too)
        _wait(lambda: client.head("/health").status_code == 503)
        assert client.head("/health").content == b""
        decode.health = 200
        _wait(lambda: client.head("/health").status_code == 200)
        post_only = client.head("/v1/completions")
        assert post_only.status_code == 405 and post_only.headers["allow"] == "POST"
    assert not prefill.bodies and not decode.bodies


def test_nan_infinity_and_lone_surrogates_are_400_and_counted(setup):
    prefill, decode, url = setup
    bodies = [
        (p, b)
        for p in ("/v1/completions", "/generate")
        for b in (
            b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}',
            b'{"prompt": "hi", "top_p": Infinity}',
            b'{"text": "hi", "sampling_params": {"temperature": -Infinity}}',
            b'{"prompt": "hi \\ud800"}',
        )
    ]
    for path, content in bodies:
        r = httpx.post(url + path, content=content)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error", (path, r.text)
    assert not prefill.bodies and not decode.bodies
    text = httpx.get(url + "/metrics").text
    assert 'pdserve_router_requests_total{endpoint="/generate",status="400"} 4.0' in text
    # a lone surrogate is named by its place (param), as a worker names it
    for path, content, param in (
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages[0].content",
        ),
        ("/v1/completions", b'{"prompt": "ok", "stop": ["a", "\\udfffb"]}', "stop[1]"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", b'{"prompt": "ok", "\\ud800": 1}', None),  # a key: the body's
    ):
        r = httpx.post(url + path, content=content)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, (path, r.text)
        assert "lone surrogate" in err["message"] and r.json()["request_id"], r.text
    assert not prefill.bodies and not decode.bodies


def test_numbers_beyond_a_double_and_deep_nesting_are_400_json_not_500(setup):
    """1e400 parses to inf (JSON cannot carry it on to the workers) and 5,000 nested lists
    overflow Python's parser: both were a plain-text 500 from the router."""
    prefill, decode, url = setup
    deep = b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for path, content, what in (
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e400}', "out of range"),
        ("/generate", b'{"text": "hi", "sampling_params": {"temperature": -1e400}}', "range"),
        ("/v1/completions", deep, "nested too deeply"),
    ):
        r = httpx.post(url + path, content=content)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error", (path, r.text)
        assert what in err["message"], err
    assert not prefill.bodies and not decode.bodies
    ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1e300 / 1e300})
    assert ok.status_code == 200, ok.text  # a float in range still passes (1.0)


def test_router_shutdown_ends_open_streams_with_an_error_event_and_done(setup):
    prefill, decode, url = setup
    decode.chunks, decode.chunk_gates = 200, _gates(3, open_=2)  # chunks 0-1, then it waits
    p_url, d_url = (w["url"] for w in httpx.get(url + "/get_server_info").json()["workers"])
    router = ThreadedServer(
        build_router_app(
            RouterConfig(prefill_urls=(p_url,), decode_urls=(d_url,), pd_min_prefill_tokens=0)
        )
    )
    router.start()
    r_url = router.url
    stopper = threading.Thread(target=router.stop)  # should_exit: uvicorn's SIGTERM path
    try:
        lines = []
        with httpx.stream(
            "POST", r_url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=10
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 2:
                        stopper.start()
        assert (
            lines[-1] == "[DONE]"
            and json.loads(lines[-2])["error"]["type"] == "service_unavailable"
        ), lines[-3:]
        # the router's own 503 + [DONE] (a stream cut at uvicorn's 5 s grace has neither)
        assert "shutting down" in lines[-2]
        _wait(lambda: decode.disconnects == 1)  # the decode leg was closed
    finally:
        if not stopper.is_alive() and stopper.ident is None:
            router.stop()
        stopper.join(timeout=15)


def test_a_worker_dying_mid_request_is_502_streaming_or_not(setup):
    prefill, decode, url = setup
    decode.mode = "drop"
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert (
        r.status_code == 502
        and r.json()["error"]["type"] == "bad_gateway"
        and "decode worker" in r.text
    ), r.text
    decode.mode = "stream_break"
    _wait_health(url, 200)  # the failure ejected decode until its next good probe
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "stream": True})
    assert json.loads(r.text.split("data: ")[-2])["error"]["type"] == "bad_gateway"


def _samples(url: str) -> dict[tuple, float]:
    """The router's /metrics as {(sample name, sorted labels...): value}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def _latency_count(url: str, endpoint: str) -> float:
    return _samples(url).get(
        ("pdserve_router_request_latency_seconds_count", ("endpoint", endpoint)), 0.0
    )


def _requests(url: str, endpoint: str, status: int) -> float:
    key = ("pdserve_router_requests_total", ("endpoint", endpoint), ("status", str(status)))
    return _samples(url).get(key, 0.0)


def test_a_stream_is_observed_when_it_ends_with_the_status_it_ended_with(setup):
    prefill, decode, url = setup
    ep = "/v1/completions"
    lat, ok, bad_gw = _latency_count(url, ep), _requests(url, ep, 200), _requests(url, ep, 502)
    r = httpx.post(url + ep, json={"prompt": "x", "stream": True})
    assert r.text.endswith("data: [DONE]\n\n")
    assert _latency_count(url, ep) == lat + 1 and _requests(url, ep, 200) == ok + 1
    decode.mode = "stream_break"  # 200 at its start, the router's 502 SSE error at its end
    r = httpx.post(url + ep, json={"prompt": "x", "stream": True})
    assert "bad_gateway" in r.text
    assert _latency_count(url, ep) == lat + 2
    assert _requests(url, ep, 200) == ok + 1 and _requests(url, ep, 502) == bad_gw + 1
    # the client leaves after the first chunk: counted when the relay ends, as 499
    decode.mode, gone = "ok", _requests(url, ep, 499)
    decode.chunks, decode.chunk_gates = 200, _gates(3, open_=1)
    with httpx.stream("POST", url + ep, json={"prompt": "x", "stream": True}, timeout=10) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    decode.chunk_gates[1].set()  # one more chunk: the router finds the client gone
    _wait(lambda: _requests(url, ep, 499) == gone + 1, timeout=20)
    assert _latency_count(url, ep) == lat + 3 and _requests(url, ep, 200) == ok + 1
    _wait(lambda: decode.disconnects == 1, timeout=20)  # and closed the decode leg


@pytest.mark.parametrize("stream", [False, True])
def test_a_workers_400_is_no_leg_failure_and_keeps_it_healthy(setup, stream):
    prefill, decode, url = setup
    ep = "/v1/completions"

    def failures(role: str, reason: str) -> float:
        key = ("pdserve_router_leg_failures_total", ("reason", reason), ("role", role))
        return _samples(url).get(key, 0.0)

    before = {r: (failures(r, "http_400"), failures(r, "http_500")) for r in ("prefill", "decode")}
    prefill.mode = decode.mode = "bad"
    for _ in range(3):
        r = httpx.post(url + ep, json={"prompt": "x", "max_tokens": 0, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    for role in ("prefill", "decode"):
        assert failures(role, "http_400") == before[role][0] == 0.0
    workers = httpx.get(url + "/get_server_info").json()["workers"]
    assert all(w["healthy"] for w in workers), workers
    assert _requests(url, ep, 400) >= 3
    prefill.mode, decode.mode = "ok", "fail"  # a 5xx is still the worker's failure
    r = httpx.post(url + ep, json={"prompt": "x", "stream": stream})
    assert r.status_code == 500
    assert failures("decode", "http_500") == before["decode"][1] + 1


def test_a_workers_error_event_mid_stream_is_relayed_then_done_and_counted_as_its_status(setup):
    """A worker whose request fails after its stream started sends an SSE error event and
    ``[DONE]`` (as vLLM): the client gets exactly that after the chunks before it, and the
    router counts the request with the error's status, not as a 200."""
    prefill, decode, url = setup
    ep = "/v1/completions"
    ok, failed = _requests(url, ep, 200), _requests(url, ep, 500)
    decode.mode = "stream_error"
    r = httpx.post(url + ep, json={"prompt": "x", "stream": True})
    events = [e[len("data: ") :] for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and events[-1] == "[DONE]", r.text
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-2]] == ["0", "1"], events
    assert json.loads(events[-2]) == STREAM_ERROR, events
    assert _requests(url, ep, 500) == failed + 1 and _requests(url, ep, 200) == ok, _samples(url)
    leg = ("pdserve_router_leg_failures_total", ("reason", "stream_error"), ("role", "decode"))
    assert _samples(url)[leg] == 1.0
    assert all(w["healthy"] for w in httpx.get(url + "/get_server_info").json()["workers"])


def test_a_prefill_failing_before_the_clients_first_chunk_is_its_status_and_json(setup):
    """Decode's stream is open but its first chunk waits for prefill's prompt logprobs:
    prefill's failure then reaches the client before any byte of the stream, so it is
    prefill's own status and JSON body (as a worker's error before its first byte), not a
    200 with an SSE error event; decode's leg is closed."""
    prefill, decode, url = setup
    prefill.mode, prefill.gate = "fail", threading.Event()
    decode.chunks, decode.chunk_gates = 3, _gates(3)

    def release_prefill() -> None:  # prefill fails once decode's first chunk is held
        _wait(lambda: decode.chunks_sent >= 1, 60)
        prefill.gate.set()

    release = threading.Thread(target=release_prefill)
    release.start()
    body = {"prompt": "x", "stream": True, "prompt_logprobs": 1}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    release.join(60)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    assert "prefill failed: KV transfer failed" in r.json()["error"]["message"], r.text
    _wait(lambda: decode.disconnects == 1)
    assert _requests(url, "/v1/completions", 500) >= 1
    assert httpx.get(url + "/get_server_info").json()["live_bootstrap_rooms"] == 0
