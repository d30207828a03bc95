"""The request-body cap (pdserve/http/body_limit.py) on a real uvicorn server: a client
that sends an oversized body always reads the 413 (the rest of the body is drained, not
reset), the connection stays usable after it, a client waiting for ``100 Continue`` gets
the 413 without sending the body, and a body past the drain bound is answered at once
with ``Connection: close``."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request

from pdserve.http import body_limit
from pdserve.http.body_limit import BodySizeLimit

CAP = 1 << 20  # 1 MiB

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def port():
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(BodySizeLimit(app, CAP), log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(15)
    assert not thread.is_alive()
    sock.close()


def _assert_413(resp: http.client.HTTPResponse) -> None:
    body = json.loads(resp.read())
    assert resp.status == 413 and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["code"] is None, body  # OpenAI's shape: a string or null
    assert "larger than the limit of 1048576 bytes" in body["error"]["message"]


def test_oversized_body_with_length_is_drained_then_413_on_a_usable_connection(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    # 4 MiB is far more than the socket buffers hold: a server that answered and closed
    # without reading would make this send fail (EPIPE / reset) instead of reading a 413.
    conn.request("POST", "/echo", body=b"x" * (4 * CAP))
    resp = conn.getresponse()
    _assert_413(resp)
    assert resp.getheader("connection") != "close"
    conn.request("POST", "/echo", body=b"y" * 10)  # the same connection serves the next one
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"bytes": 10}
    conn.close()


def test_oversized_chunked_body_gets_413(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    chunks = (b"z" * (256 << 10) for _ in range(16))  # 4 MiB, no Content-Length
    conn.request("POST", "/echo", body=chunks, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413, resp.read()[:300]
    resp.read()
    conn.close()


def test_a_body_at_the_cap_is_accepted(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/echo", body=b"a" * CAP)
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"bytes": CAP}
    conn.close()


def _head(length: int, extra: str = "") -> bytes:
    return (f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n{extra}\r\n").encode()


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data or not data.endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_expect_100_continue_gets_413_without_sending_the_body(port):
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_head(4 * CAP, "Expect: 100-continue\r\n"))
        data = _read_response(sock)  # nothing of the body was sent
    assert data.startswith(b"HTTP/1.1 413") and b"connection: close" in data.lower(), data[:300]


def test_a_body_past_the_drain_bound_is_answered_at_once_with_close(port, monkeypatch):
    monkeypatch.setattr(body_limit, "DRAIN_LIMIT_BYTES", CAP)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(_head(2 * CAP + 1))  # more than CAP past the cap: not drained
        data = _read_response(sock)
    assert data.startswith(b"HTTP/1.1 413") and b"connection: close" in data.lower(), data[:300]
