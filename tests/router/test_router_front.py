"""The router's front (pdserve/http/front.py) over real HTTP: the forwarded POSTs it
serves itself and what it hands to the Starlette app, HTTP/1.1 framing on a raw socket
(pipelining, chunked request bodies, ``Expect: 100-continue``, a malformed request), the
SSE relay byte for byte, the request id, the metrics, and a client leaving aborting the
worker legs."""

from __future__ import annotations

import json
import re
import select
import socket
import threading
import time

import httpx
import pytest
from fake_workers import FakeWorker

from pdserve.config import RouterConfig
from pdserve.http.front import MAX_HEAD_BYTES, FrontCycle
from pdserve.http.netutil import ThreadedServer
from pdserve.router.app import build_router_app

pytestmark = pytest.mark.timeout(60)

CAP = 4096  # the routers' --max-request-body-bytes here


def _wait(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def setup():
    prefill, decode, mixed = FakeWorker("prefill"), FakeWorker("decode"), FakeWorker("mixed")
    servers = [ThreadedServer(w.app) for w in (prefill, decode, mixed)]
    for s in servers:
        s.start()
    common = dict(
        health_check_interval=0.2,
        health_check_timeout=1.0,
        max_migrations=0,
        max_request_body_bytes=CAP,
    )
    pd = ThreadedServer(
        build_router_app(
            RouterConfig(
                prefill_urls=(servers[0].url,),
                decode_urls=(servers[1].url,),
                pd_min_prefill_tokens=0,  # every request through both legs (PD's path)
                **common,
            )
        )
    )
    regular = ThreadedServer(
        build_router_app(RouterConfig(worker_urls=(servers[2].url,), **common))
    )
    routers = [pd, regular]
    for r in routers:
        r.start()
    try:
        for r in routers:
            _wait(lambda r=r: httpx.get(r.url + "/health").status_code == 200)
        yield prefill, decode, mixed, pd, regular
    finally:
        for s in (*routers, *servers):
            s.stop()


@pytest.fixture(autouse=True)
def reset(setup):
    for w in setup[:3]:
        w.mode, w.disconnects, w.chunks, w.chunk_gap = "ok", 0, 2, 0.01
        w.gate, w.chunk_gates = None, []
        w.bodies.clear()
        w.headers.clear()


def _connect(server: ThreadedServer) -> tuple[socket.socket, object]:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock, sock.makefile("rb")


def _post(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "host: router", "content-type: application/json"]
    head += [f"content-length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _read(f) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer from the socket's file: status, headers, body (de-chunked)."""
    status_line = f.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = f.read(int(headers["content-length"]))
    else:
        assert headers.get("transfer-encoding") == "chunked", headers
        parts = []
        while (size := int(f.readline().strip(), 16)) > 0:
            parts.append(f.read(size))
            assert f.read(2) == b"\r\n"
        assert f.read(2) == b"\r\n"
        body = b"".join(parts)
    return int(status_line.split()[1]), headers, body


def _metric(server: ThreadedServer, status: int) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(
        rf'pdserve_router_requests_total\{{endpoint="/v1/completions",status="{status}"\}} (\S+)',
        text,
    )
    return float(m.group(1)) if m else 0.0


def test_front_takes_the_forwarded_posts_and_the_app_the_rest(setup):
    """A forwarded POST is served by the front (a FrontCycle on the protocol, never the
    ASGI app's cycle), every other request by the Starlette app as before."""
    prefill, decode, _, pd, _ = setup
    protocol = pd.server.config.http_protocol_class
    seen: list[str] = []
    start = protocol._start_asgi_task
    begin = protocol.on_headers_complete

    def spy_start(self, cycle, app):
        seen.append("app" if not isinstance(cycle, FrontCycle) else "front")
        return start(self, cycle, app)

    def spy_begin(self):
        begin(self)
        if isinstance(self.cycle, FrontCycle):
            seen.append("front")

    protocol._start_asgi_task, protocol.on_headers_complete = spy_start, spy_begin
    try:
        r = httpx.post(pd.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decode"
        assert seen == ["front"]
        assert httpx.get(pd.url + "/health").json() == {"status": "ok"}
        assert httpx.get(pd.url + "/v1/models").status_code == 200
        r = httpx.post(pd.url + "/v1/completions", content=b"x" * (CAP + 1))
        assert r.status_code == 413 and "--max-request-body-bytes" in r.text  # the app's cap
        assert seen == ["front", "app", "app", "app"]
    finally:
        protocol._start_asgi_task, protocol.on_headers_complete = start, begin
    assert len(decode.bodies) == len(prefill.bodies) == 1


def test_answers_request_ids_and_metrics(setup):
    """The front's answers: the worker's JSON (merged), the caller's x-request-id echoed
    and passed to both legs (a new id when absent or invalid), errors as JSON naming the
    problem, every request counted in Prometheus."""
    prefill, decode, _, pd, _ = setup
    before_200, before_400 = _metric(pd, 200), _metric(pd, 400)
    r = httpx.post(
        pd.url + "/v1/completions?x=1", json={"prompt": "x"}, headers={"x-request-id": "req-7"}
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-7"
    assert r.headers["content-type"] == "application/json"
    assert r.json()["choices"][0]["prompt_logprobs"] == [None, {"token_id": 2, "logprob": -0.5}]
    assert prefill.headers[-1]["x-request-id"] == decode.headers[-1]["x-request-id"] == "req-7"
    r = httpx.post(
        pd.url + "/v1/completions", json={"prompt": "x"}, headers={"x-request-id": "a b"}
    )
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    assert decode.headers[-1]["x-request-id"] == r.headers["x-request-id"]
    r = httpx.post(pd.url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    r = httpx.post(pd.url + "/v1/completions", json={"prompt": "x", "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    assert _metric(pd, 200) == before_200 + 2 and _metric(pd, 400) == before_400 + 2


def test_pipelined_requests_are_answered_in_order(setup):
    """Three requests in one write (two forwarded POSTs around a GET the app serves): three
    answers in order on the one connection, which stays open."""
    _, decode, _, pd, _ = setup
    sock, f = _connect(pd)
    try:
        sock.sendall(
            _post("/v1/completions", b'{"prompt": "first"}', "x-request-id: one")
            + b"GET /health HTTP/1.1\r\nhost: router\r\n\r\n"
            + _post("/v1/completions", b'{"prompt": "third"}', "x-request-id: three")
        )
        first, second, third = _read(f), _read(f), _read(f)
        assert first[0] == 200 and first[1]["x-request-id"] == "one"
        assert json.loads(first[2])["choices"][0]["text"] == "decode"
        assert second[0] == 200 and json.loads(second[2]) == {"status": "ok"}
        assert third[0] == 200 and third[1]["x-request-id"] == "three"
        assert [b["prompt"] for b in decode.bodies] == ["first", "third"]
        sock.sendall(_post("/v1/completions", b'{"prompt": "again"}'))  # still kept alive
        assert _read(f)[0] == 200
    finally:
        f.close()
        sock.close()


def test_chunked_body_expect_continue_and_malformed_request(setup):
    """A chunked request body is served (by the app); ``Expect: 100-continue`` gets its
    interim answer before the body is sent; a malformed request gets 400 and the
    connection closes."""
    _, decode, _, pd, _ = setup
    sock, f = _connect(pd)
    try:
        body = b'{"prompt": "chunked"}'
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ntransfer-encoding: chunked\r\n"
            b"content-type: application/json\r\n\r\n"
            + b"%x\r\n%s\r\n" % (5, body[:5])
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body) - 5, body[5:])
        )
        status, _, answer = _read(f)
        assert status == 200 and json.loads(answer)["choices"][0]["text"] == "decode"
        assert decode.bodies[-1]["prompt"] == "chunked"

        body = b'{"prompt": "continued"}'
        head = _post("/v1/completions", body, "expect: 100-continue")[: -len(body)]
        sock.sendall(head)
        assert f.readline() == b"HTTP/1.1 100 Continue\r\n" and f.readline() == b"\r\n"
        sock.sendall(body)
        status, _, answer = _read(f)
        assert status == 200 and decode.bodies[-1]["prompt"] == "continued"

        sock.sendall(b"POST /v1/completions HTTP/1.1\r\ncontent-length: nope\r\n\r\n")
        status, headers, _ = _read(f)
        assert status == 400 and headers.get("connection") == "close"
        assert f.read() == b""  # closed
    finally:
        f.close()
        sock.close()


def test_sse_relay_is_byte_exact_and_chunked(setup):
    """A stream through the front (regular mode, nothing to merge) is the worker's bytes
    exactly, sent with chunked transfer encoding."""
    _, _, mixed, _, regular = setup
    mixed.chunks = 3
    expected = (
        b"".join(
            f"data: {json.dumps({'choices': [{'index': 0, 'text': str(i)}]})}\n\n".encode()
            for i in range(3)
        )
        + b"data: [DONE]\n\n"
    )
    sock, f = _connect(regular)
    try:
        sock.sendall(_post("/v1/completions", b'{"prompt": "x", "stream": true}'))
        status, headers, body = _read(f)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert headers["transfer-encoding"] == "chunked" and "x-request-id" in headers
        assert body == expected
    finally:
        f.close()
        sock.close()


def test_client_leaving_aborts_the_worker_legs(setup):
    """The client closing its connection while the legs run (both legs hanging), or in the
    middle of a stream, closes the legs: the workers see the disconnect; the request is
    counted as 499."""
    prefill, decode, _, pd, _ = setup
    before = _metric(pd, 499)
    prefill.mode = decode.mode = "hang"
    sock = socket.create_connection(("127.0.0.1", pd.port), timeout=10)
    sock.sendall(_post("/v1/completions", b'{"prompt": "x"}'))
    _wait(lambda: len(prefill.bodies) == len(decode.bodies) == 1)
    sock.close()
    _wait(lambda: prefill.disconnects == decode.disconnects == 1)
    _wait(lambda: _metric(pd, 499) == before + 1)

    prefill.mode = decode.mode = "ok"
    prefill.disconnects = decode.disconnects = 0
    decode.chunks, decode.chunk_gates = 3, [threading.Event(), threading.Event()]
    decode.chunk_gates[0].set()  # chunk 1 waits: the client leaves after chunk 0
    sock, f = _connect(pd)
    try:
        sock.sendall(_post("/v1/completions", b'{"prompt": "x", "stream": true}'))
        assert f.readline().startswith(b"HTTP/1.1 200")
        while f.readline() != b"\r\n":
            pass
        f.readline()  # the first chunk's size
        assert f.readline().startswith(b"data: ")
    finally:
        f.close()  # the socket closes with its last reference
        sock.close()
    _wait(lambda: decode.disconnects == 1)
    decode.chunk_gates[1].set()


def test_tracing_on_leaves_the_forwarded_posts_to_the_app():
    """With tracing on, the app's middleware makes the spans: no front."""
    config = RouterConfig(
        worker_urls=("http://127.0.0.1:9",), otlp_traces_endpoint="http://127.0.0.1:9"
    )
    assert build_router_app(config).state.http_protocol is None
    assert build_router_app(RouterConfig(worker_urls=("http://127.0.0.1:9",))).state.http_protocol


def test_shutdown_answers_a_request_cut_by_its_grace_period_with_503_json(setup):
    """SIGTERM's path (uvicorn's should_exit) while a forwarded POST waits on legs that
    never answer: after the grace period the client gets the router's 503 JSON, not a
    bare 500, and the legs are closed."""
    prefill, decode, _, pd, _ = setup
    p_url, d_url = (w["url"] for w in httpx.get(pd.url + "/get_server_info").json()["workers"])
    router = ThreadedServer(
        build_router_app(
            RouterConfig(
                prefill_urls=(p_url,),
                decode_urls=(d_url,),
                max_migrations=0,
                pd_min_prefill_tokens=0,
            )
        ),
        timeout_graceful_shutdown=1,
    )
    router.start()
    prefill.mode = decode.mode = "hang"
    sock, f = _connect(router)
    stopper = threading.Thread(target=router.stop)
    try:
        sock.sendall(_post("/v1/completions", b'{"prompt": "x"}', "x-request-id: cut"))
        _wait(lambda: len(prefill.bodies) == len(decode.bodies) == 1)
        stopper.start()
        status, headers, body = _read(f)
        assert status == 503 and headers["x-request-id"] == "cut"
        error = json.loads(body)["error"]
        assert error["type"] == "service_unavailable"
        assert "server shutting down: the router was stopped" in error["message"]
        _wait(lambda: prefill.disconnects == decode.disconnects == 1)
    finally:
        f.close()
        sock.close()
        stopper.join(timeout=15)
        if stopper.ident is None:
            router.stop()


def test_a_request_head_over_the_limit_is_431_json_and_closed(setup):
    """A header line over ``MAX_HEAD_BYTES`` (sent whole, or trickled in and never ended):
    431 in OpenAI's error shape, connection closed; a head under the limit is served."""
    _, _, _, pd, _ = setup
    sock, f = _connect(pd)
    try:
        sock.sendall(_post("/v1/completions", b'{"prompt": "x"}', "x-big: " + "a" * 60_000))
        assert _read(f)[0] == 200
        sock.sendall(_post("/v1/completions", b'{"prompt": "x"}', "x-big: " + "a" * MAX_HEAD_BYTES))
        status, headers, body = _read(f)
        assert status == 431 and headers["connection"] == "close"
        assert "line and headers are over" in json.loads(body)["error"]["message"]
        assert json.loads(body)["request_id"] == headers["x-request-id"]
        assert f.read() == b""
    finally:
        f.close()
        sock.close()
    sock, f = _connect(pd)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\nx-big: ")
        for _ in range(2 * MAX_HEAD_BYTES // 8192):  # a header that never ends
            if select.select([sock], [], [], 0.002)[0]:
                break  # answered: sending on would only meet a reset
            sock.sendall(b"a" * 8192)
        assert _read(f)[0] == 431
    finally:
        f.close()
        sock.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/admin/workers"])
@pytest.mark.parametrize("kept", [False, True])
def test_a_bad_chunk_in_a_body_is_400_at_once(setup, path, kept):
    """A chunked body whose chunk size is not hex: the parser refuses it after the head
    was read, so the refused request is the one waiting for its body (a forwarded POST
    of the front, or one the app serves): 400 and closed at once, after the answer of
    a request before it on the connection (it waited forever for its own body before)."""
    _, decode, _, pd, _ = setup
    sock, f = _connect(pd)
    try:
        before = _post("/v1/completions", b'{"prompt": "kept"}') if kept else b""
        sock.sendall(
            before
            + f"POST {path} HTTP/1.1\r\nhost: router\r\n".encode()
            + b"transfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"
        )
        if kept:
            status, _, answer = _read(f)
            assert status == 200 and json.loads(answer)["choices"][0]["text"] == "decode"
        status, headers, _ = _read(f)
        assert status == 400 and headers["connection"] == "close"
        assert f.read() == b""
    finally:
        f.close()
        sock.close()


@pytest.mark.parametrize("refused", ["malformed", "head too large"])
def test_a_refused_request_is_answered_after_the_ones_before_it(setup, refused):
    """A valid request and, in the same write, one the parser refuses: the valid one is
    answered first (uvicorn writes its refusal at once, over an answer in flight), then
    the refusal, and the connection closes."""
    _, decode, _, pd, _ = setup
    bad = (
        b"GARBAGE\r\n\r\n"
        if refused == "malformed"
        else _post("/v1/completions", b"{}", "x-big: " + "a" * (MAX_HEAD_BYTES + 10))
    )
    sock, f = _connect(pd)
    try:
        sock.sendall(_post("/v1/completions", b'{"prompt": "kept"}') + bad)
        status, _, answer = _read(f)
        assert status == 200 and json.loads(answer)["choices"][0]["text"] == "decode"
        assert decode.bodies[-1]["prompt"] == "kept"
        status, headers, _ = _read(f)
        assert status == (400 if refused == "malformed" else 431)
        assert headers["connection"] == "close"
        assert f.read() == b""
    finally:
        f.close()
        sock.close()


def test_a_stream_whose_client_left_ends_quietly():
    """An SDK closes its connection once it read ``[DONE]``, before the last chunk's
    terminator: ``_write`` writes nothing after the transport closes (uvloop's transport
    raises on such a write: the front logged an ERROR with a traceback for 3 of 10 normal
    ``openai`` streams) and closes the stream's iterator (the relay's legs)."""
    import asyncio

    from starlette.responses import StreamingResponse

    from pdserve.http import front

    class Transport:
        def __init__(self) -> None:
            self.closed, self.written = False, []

        def is_closing(self) -> bool:
            return self.closed

        def write(self, data: bytes) -> None:
            if self.closed:
                raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")
            self.written.append(data)

        def close(self) -> None:
            self.closed = True

    class Flow:
        write_paused = False

    transport = Transport()
    closed = []

    async def body():
        try:
            yield b"data: 1\n\n"
            yield b"data: [DONE]\n\n"
            transport.close()  # the client read [DONE] and left
        finally:
            closed.append(True)

    cycle = front.FrontCycle(
        "/v1/completions", [], transport, Flow(), [], True, False, lambda: None
    )
    response = StreamingResponse(body(), media_type="text/event-stream")
    asyncio.run(front._write(cycle, response, "req-1"))
    assert cycle.disconnected and closed == [True]
    assert transport.written[-1].endswith(b"data: [DONE]\n\n\r\n")  # no terminator after close
    # a whole answer to a client that already left: nothing written, no error
    cycle2 = front.FrontCycle(
        "/v1/completions", [], transport, Flow(), [], True, False, lambda: None
    )
    n = len(transport.written)
    asyncio.run(front._write(cycle2, front._error_body(400, "x"), "req-2"))
    assert len(transport.written) == n and cycle2.disconnected


def test_a_streams_head_goes_out_with_its_first_chunk():
    """The head and the first chunk in one write (one TCP segment, not two: the router's
    relay answers once its first chunk is known, so nothing waits for the head alone); a
    stream without chunks gets its head with the terminator."""
    import asyncio

    from starlette.responses import StreamingResponse

    from pdserve.http import front

    class Transport:
        def __init__(self) -> None:
            self.written: list[bytes] = []

        def is_closing(self) -> bool:
            return False

        def write(self, data: bytes) -> None:
            self.written.append(data)

    class Flow:
        write_paused = False

    async def body(chunks):
        for chunk in chunks:
            yield chunk

    for chunks in ([b"data: 1\n\n", b"data: [DONE]\n\n"], []):
        transport = Transport()
        cycle = front.FrontCycle(
            "/v1/completions", [], transport, Flow(), [], True, False, lambda: None
        )
        response = StreamingResponse(body(chunks), media_type="text/event-stream")
        asyncio.run(front._write(cycle, response, "req-1"))
        first = transport.written[0]
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in first
        if chunks:
            assert first.endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n"), first
            assert transport.written[1:] == [b"e\r\ndata: [DONE]\n\n\r\n", b"0\r\n\r\n"]
        else:
            assert first.endswith(b"\r\n\r\n0\r\n\r\n") and len(transport.written) == 1


def test_read_timeout_spares_a_pipelined_request_waiting_its_turn_and_ends_a_stalled_one(
    setup,
):
    """The read timeout (http/read_timeout.py) on the front: a pipelined POST whose body
    arrives while the one before it is still answered (the front has stopped reading) is
    served however long that takes; a POST whose body then stops gets 408 with its request
    id, counted as 408."""
    _, _, mixed, _, regular = setup
    t = 0.5
    router = ThreadedServer(
        build_router_app(
            RouterConfig(worker_urls=(regular_worker_url(regular),), max_request_body_bytes=CAP)
        ),
        request_read_timeout=t,
    )
    router.start()
    mixed.gate = threading.Event()
    try:
        _wait(lambda: httpx.get(router.url + "/health").status_code == 200)
        sock, f = _connect(router)
        second = _post("/v1/completions", b'{"prompt": "second"}', "x-request-id: two")
        sock.sendall(_post("/v1/completions", b'{"prompt": "first"}') + second[:-6])
        time.sleep(t / 3)
        sock.sendall(second[-6:])
        assert not select.select([sock], [], [], 3 * t)[0], "answered while the gate is shut"
        mixed.gate.set()
        assert _read(f)[0] == 200 and _read(f)[0] == 200
        sock.sendall(_post("/v1/completions", b'{"prompt": "third"}', "x-request-id: s3")[:-4])
        start = time.monotonic()
        status, headers, body = _read(f)
        assert status == 408 and t - 0.05 <= time.monotonic() - start < t + 2
        assert json.loads(body)["request_id"] == headers["x-request-id"] == "s3"
        assert f.read() == b""  # closed
        sock.close()
        assert _metric(router, 408) == 1.0
    finally:
        mixed.gate.set()
        router.stop()


def regular_worker_url(regular: ThreadedServer) -> str:
    """The mixed worker's URL behind the regular-mode router ``regular``."""
    return httpx.get(regular.url + "/get_server_info").json()["workers"][0]["url"]
