"""The worker's 503 answers while its model loads (pdserve/http/loading.py), on a real
listening socket with real HTTP clients."""

from __future__ import annotations

import re
import socket
import threading

import httpx

from pdserve.http.loading import answer_503_while_loading
from pdserve.http.netutil import bind_socket


def test_every_request_gets_503_json_while_loading_then_the_socket_is_handed_back() -> None:
    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with answer_503_while_loading(sock, "the decode worker is loading m"):
            with httpx.Client(timeout=5.0) as client:
                health = client.head(f"{url}/health")  # a probe's HEAD too
                post = client.post(
                    f"{url}/v1/completions",
                    json={"prompt": "x" * 20000},
                    headers={"x-request-id": "load-1"},
                )
                named = client.get(f"{url}/health", headers={"x-request-id": "a b"})
            assert health.status_code == 503 and health.content == b""
            for r in (post, named):
                assert r.status_code == 503
                assert r.headers["retry-after"] == "1"
                error = r.json()["error"]
                assert error["type"] == "service_unavailable"
                assert error["message"] == "the decode worker is loading m"
                # the request's id (the caller's when well-formed), in header and body
                assert r.json()["request_id"] == r.headers["x-request-id"]
            assert post.headers["x-request-id"] == "load-1"
            assert re.fullmatch(r"[0-9a-f]{32}", named.headers["x-request-id"])
            # a client that connects and sends nothing does not stop the others
            idle = socket.create_connection(sock.getsockname(), timeout=5.0)
            assert httpx.get(f"{url}/health", timeout=5.0).status_code == 503
            idle.close()
        assert not [t for t in threading.enumerate() if t.name == "pdserve-loading-503"]
        # after the block the socket is the real server's: still listening and blocking
        assert sock.getblocking()
        client_sock = socket.create_connection(sock.getsockname(), timeout=5.0)
        conn, _ = sock.accept()
        client_sock.sendall(b"ping")
        assert conn.recv(4) == b"ping"
        conn.close()
        client_sock.close()
    finally:
        sock.close()
