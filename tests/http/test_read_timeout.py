"""The read timeout of every pdserve HTTP server (pdserve/http/read_timeout.py) on a real
uvicorn server, with each of its HTTP/1.1 parsers (h11: the workers; httptools: the
router): a head must be whole within the timeout of its first byte however it trickles
in, a body may take longer as long as no pause reaches the timeout, a connection that
sends nothing is closed without an answer, a kept-alive connection between requests is
left to uvicorn's keep-alive timeout, and time the server itself does not read (a
pipelined request waiting its turn) is not counted against the client. (The router's
front and the workers as processes: tests/e2e/test_slow_clients_and_prefill_down.py.)"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from fastapi import FastAPI, Request

from pdserve.http.netutil import ThreadedServer
from pdserve.http.read_timeout import timed_out, with_read_timeout

pytestmark = pytest.mark.timeout(60)

T = 0.6  # the servers' read timeout here, seconds
SEEN: list[tuple[str, bool]] = []  # (path, timed_out(scope)) of requests whose body failed


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        try:
            body = await request.body()
        except Exception:
            SEEN.append((request.url.path, timed_out(request.scope)))
            raise
        return {"bytes": len(body)}

    @app.post("/slow")
    async def slow(request: Request) -> dict:
        await asyncio.sleep(3 * T)
        return {"bytes": len(await request.body())}

    return app


@pytest.fixture(scope="module", params=["h11", "httptools"])
def server(request):
    s = ThreadedServer(_app(), http=request.param, request_read_timeout=T, timeout_keep_alive=30)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _post(path: str, body: bytes, request_id: str = "rid-1") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\nx-request-id: {request_id}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


def _answer(sock: socket.socket, limit_s: float = 10.0) -> bytes:
    """Bytes until the server closes the connection."""
    sock.settimeout(limit_s)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _one_answer(sock: socket.socket) -> bytes:
    """One answer (with a content-length) on a connection kept open."""
    sock.settimeout(10)
    out = b""
    while b"\r\n\r\n" not in out:
        out += sock.recv(65536)
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _status_and_json(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_body_that_stops_gets_408_with_the_request_id_and_its_app_sees_it(server):
    SEEN.clear()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_post("/echo", b"0123456789")[:-5])
        start = time.monotonic()
        answer = _answer(sock)
        waited = time.monotonic() - start
    status, body = _status_and_json(answer)
    assert status == 408 and T - 0.05 <= waited < T + 1.5, (answer, waited)
    assert body["request_id"] == "rid-1" and b"x-request-id: rid-1\r\n" in answer
    assert body["error"]["type"] == "invalid_request_error"
    assert "body stopped arriving" in body["error"]["message"]
    assert b"connection: close\r\n" in answer
    deadline = time.monotonic() + 5
    while not SEEN and time.monotonic() < deadline:  # the handler saw the client leave
        time.sleep(0.01)
    assert SEEN == [("/echo", True)]


def test_a_head_is_timed_from_its_first_byte_however_it_trickles_in(server):
    head = b"POST /echo HTTP/1.1\r\nhost: x\r\nx-a: 1\r\nx-b: 2\r\nx-c: 3\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        start = time.monotonic()
        sock.settimeout(T / 4)
        answer = b""
        for i in range(len(head)):  # a byte each T/4: never a pause as long as T
            try:
                sock.sendall(head[i : i + 1])
                answer += sock.recv(65536)
                break  # answered (or closed) before the head ended
            except TimeoutError:
                continue
            except OSError:
                break
        answer += _answer(sock)
        waited = time.monotonic() - start
    status, body = _status_and_json(answer)
    assert status == 408 and T - 0.05 <= waited < T + 1.5, (answer, waited)
    assert "line and headers did not arrive" in body["error"]["message"]
    assert len(body["request_id"]) == 32  # a new id: the client's was never read


def test_a_slow_body_that_keeps_coming_is_served(server):
    body = b"x" * 8
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        request = _post("/echo", body)
        sock.sendall(request[: -len(body)])
        for i in range(len(body)):  # 8 pauses of T/2: 4 T in all, no pause of T
            time.sleep(T / 2)
            sock.sendall(body[i : i + 1])
        answer = _one_answer(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"bytes":8}'), answer


def test_a_silent_connection_is_closed_without_an_answer(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        start = time.monotonic()
        assert _answer(sock) == b""
        assert T - 0.05 <= time.monotonic() - start < T + 1.5


def test_a_kept_alive_connection_is_not_timed_between_requests(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        for _ in range(2):
            sock.sendall(_post("/echo", b"abc"))
            assert _one_answer(sock).endswith(b'{"bytes":3}')
            time.sleep(2 * T)  # idle on a kept-alive connection (keep-alive timeout: 30 s)


def test_a_pipelined_request_waiting_its_turn_is_not_timed(server):
    """The second request's body is sent while the first is answered (3 T): the server has
    stopped reading meanwhile, which is not the client's delay."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        second = _post("/echo", b"0123456789", "rid-2")
        sock.sendall(_post("/slow", b"{}") + second[:-5])
        time.sleep(T / 3)
        sock.sendall(second[-5:])
        sock.settimeout(10)
        answers = b""
        while not answers.endswith(b"}") or answers.count(b"HTTP/1.1 ") < 2:
            chunk = sock.recv(65536)
            assert chunk, f"closed: {answers!r}"
            answers += chunk
    first, second = answers.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200 ") and first.endswith(b'{"bytes":2}'), answers
    assert second.startswith(b"200 ") and second.endswith(b'{"bytes":10}'), answers


def test_only_positive_timeouts_and_known_protocols() -> None:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be > 0 s and finite"):
            with_read_timeout(H11Protocol, bad)
    with pytest.raises(ValueError, match="no read timeout for the HTTP protocol"):
        with_read_timeout(asyncio.Protocol, 1.0)
