"""Two production faults on real processes (prefill + decode + router, KV over real NIXL on
CPU, beside a mixed worker; tiny model):

- slow clients: a request whose body stops part-way, or whose head never ends, gets 408
  (OpenAI error body, the request's id) from the router and from a worker within
  ``--request-read-timeout`` of the stall, the connection closed, while the server keeps
  answering others meanwhile; a body over ``--max-request-body-bytes`` gets 413 naming
  the limit and the flag (pdserve/http/read_timeout.py, http/body_limit.py);
- no healthy prefill worker (killed): PD requests are served whole on the healthy decode
  worker, their greedy output equal to the mixed worker's, counted by reason and warned
  about once (router/picking.py ``Picker._without_prefill``). This test kills the prefill, so it
  runs last.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import pytest
from pd_compare import assert_same, fold, post, sse

from pdserve_procs import pd_and_mixed, wait_for

pytestmark = pytest.mark.timeout(300)

ROUTER_TIMEOUT_S = 1.0  # the router's --request-read-timeout here
WORKER_TIMEOUT_S = 2.0  # the workers'
CAP = 65536  # --max-request-body-bytes of all


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("slow-logs")
    limits = ["--max-request-body-bytes", str(CAP)]
    with pd_and_mixed(
        logs,
        worker_extra=["--request-read-timeout", str(WORKER_TIMEOUT_S), *limits],
        router_extra=["--request-read-timeout", str(ROUTER_TIMEOUT_S), *limits],
    ) as c:
        yield c


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _read_all(sock: socket.socket, limit_s: float) -> bytes:
    """Everything the server sends until it closes (or ``limit_s`` passes)."""
    sock.settimeout(limit_s)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except TimeoutError:
        pytest.fail(f"the server neither answered nor closed within {limit_s} s: {out!r}")
    return out


def _targets(c):
    """(name, URL, its read timeout) of the router and the two kinds of worker it fronts."""
    return [
        ("router", c["router"].url, ROUTER_TIMEOUT_S),
        ("decode", c["decode"].url, WORKER_TIMEOUT_S),
        ("mixed", c["mixed"].url, WORKER_TIMEOUT_S),
    ]


@pytest.mark.parametrize("stall", ["mid_body", "mid_head"])
def test_a_stalled_request_gets_408_in_time_and_others_are_served(cluster, stall):
    body = json.dumps({"prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
    for name, url, timeout in _targets(cluster):
        rid = f"slow-{stall}-{name}"
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"x-request-id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        sent = head + body[: len(body) // 2] if stall == "mid_body" else head[:40]
        with socket.create_connection(_address(url)) as sock:
            sock.sendall(sent)
            start = time.monotonic()
            # the server keeps serving others while this client holds its connection
            r = httpx.post(url + "/v1/completions", content=body, timeout=30)
            assert r.status_code == 200, (name, r.text)
            assert time.monotonic() - start < timeout, f"{name}: another request waited"
            answer = _read_all(sock, timeout + 10)
            waited = time.monotonic() - start
        assert answer.startswith(b"HTTP/1.1 408 "), (name, answer[:300])
        assert b"\r\nconnection: close\r\n" in answer.lower(), (name, answer[:300])
        # within the configured timeout (and a scheduling margin on a busy machine)
        assert timeout - 0.2 <= waited < timeout + 3, (name, waited)
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert "--request-read-timeout" in error["error"]["message"], error
        if stall == "mid_body":  # its head was read: the client's request id
            assert error["request_id"] == rid, error
            assert f"x-request-id: {rid}".encode() in answer
        else:
            assert error["request_id"], error
    # counted as 408 (the router's front and the worker's app alike)
    if stall == "mid_body":
        router_metrics = httpx.get(cluster["router"].url + "/metrics").text
        assert (
            'pdserve_router_requests_total{endpoint="/v1/completions",status="408"}'
            in router_metrics
        )
        worker_metrics = httpx.get(cluster["mixed"].url + "/metrics").text
        assert 'pdserve_requests_total{endpoint="/v1/completions",status="408"}' in worker_metrics


def test_an_oversized_body_gets_413_naming_the_limit_and_the_flag(cluster):
    body = json.dumps({"prompt": "a" * (CAP + 10), "max_tokens": 1}).encode()
    for name, url, _ in _targets(cluster):
        r = httpx.post(url + "/v1/completions", content=body, timeout=30)
        assert r.status_code == 413, (name, r.text[:300])
        message = r.json()["error"]["message"]
        assert str(CAP) in message and "--max-request-body-bytes" in message, (name, message)
        assert httpx.get(url + "/health", timeout=10).status_code == 200


CASES = {
    "completion": (
        "/v1/completions",
        {
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 2,
            "return_token_ids": True,
        },
    ),
    "chat": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Tell me a story"}],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
}


def _finished(c, name: str) -> int:
    return c[name].get_info()["engine"]["finished_requests"]


def test_with_the_prefill_killed_decode_serves_requests_whole_as_a_mixed_worker(cluster):
    router = cluster["router"]
    path, body = CASES["completion"]
    before = _finished(cluster, "prefill")
    assert_same(post(router.url, path, body).json(), post(cluster["mixed"].url, path, body).json())
    assert _finished(cluster, "prefill") > before, "premise: the router's answer went through PD"

    os.kill(cluster["prefill"].pid, signal.SIGKILL)
    cluster["prefill"].popen.wait(timeout=30)
    wait_for(
        lambda: (
            not any(
                w["healthy"]
                for w in httpx.get(router.url + "/get_server_info").json()["workers"]
                if w["role"] == "prefill"
            )
        ),
        30,
        "the router to find the prefill worker unhealthy",
    )
    served = _finished(cluster, "decode")
    sent = 0
    for path, body in CASES.values():
        for stream in (False, True):
            request = dict(body, stream=stream)
            pd = post(router.url, path, request)
            mixed = post(cluster["mixed"].url, path, request)
            if stream:
                assert_same(fold(sse(pd)), fold(sse(mixed)))
            else:
                assert pd.status_code == 200, pd.text
                assert_same(pd.json(), mixed.json())
            sent += 1
    assert _finished(cluster, "decode") == served + sent  # each whole on decode
    metrics = httpx.get(router.url + "/metrics").text
    assert f'pdserve_router_pd_fallbacks_total{{reason="no_healthy_prefill"}} {sent}.0' in metrics
    log = router.log_path.read_text()
    assert log.count("serving PD requests whole on decode workers") == 1, log[-2000:]
