"""A worker stopped (SIGTERM, as ``pdserve up`` on Ctrl-C) while a non-streaming request
runs past the graceful-shutdown time: the request is answered 503 ``service_unavailable``
"server shutting down" JSON, not uvicorn's bare 500 and a traceback in the log, and a
router in front passes that answer on; a router stopped the same way answers so itself.
Real processes, real HTTP."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from pdserve_procs import start_router, start_worker, stop, wait_for, wait_healthy

pytestmark = pytest.mark.timeout(300)

# The graceful-shutdown window each test waits out (a stopped process cuts the request
# after it): 1 s, not the default 5 (every request here runs far longer).
GRACE_S = "1"


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_GRACEFUL_SHUTDOWN_S", GRACE_S)  # the processes started here


def _first_token_seen(url: str) -> bool:
    text = httpx.get(url + "/metrics", timeout=10.0).text
    counts = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdserve_time_to_first_token_seconds_count")
    ]
    return sum(counts) > 0


def _stop_during_a_long_request(target, worker, victim) -> httpx.Response:
    """POST a long completion to ``target``, SIGTERM ``victim`` once ``worker`` generates,
    and return the answer the client got."""
    # 4 samples x 4000 tokens: far longer than the GRACE_S of graceful shutdown
    body = {"prompt": "Hello", "max_tokens": 4000, "n": 4, "ignore_eos": True}
    answer: dict = {}

    def send() -> None:
        answer["r"] = httpx.post(target.url + "/v1/completions", json=body, timeout=120.0)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        wait_for(lambda: _first_token_seen(worker.url), 60.0, "generation to start")
        os.killpg(victim.popen.pid, signal.SIGTERM)
    finally:
        sender.join(120.0)
    return answer["r"]


def _assert_shutdown_503(r: httpx.Response, message_start: str, victim) -> None:
    """A 503 service_unavailable JSON error, and no traceback in the stopped process's log."""
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "service_unavailable", error
    assert error["message"].startswith(message_start), error
    victim.popen.wait(60.0)
    log = victim.log_path.read_text(errors="replace")
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log


@pytest.mark.parametrize("through_router", [False, True])
def test_stopping_a_worker_answers_an_inflight_request_503_json(tmp_path, through_router):
    worker = start_worker("mixed", "mixed", tmp_path, extra=["--num-threads", "1"])
    router = None
    try:
        wait_healthy([worker])
        target = worker
        if through_router:
            # the router resends the worker's 503 to a healthy worker if one comes within
            # --migration-wait (30 s by default); with none it passes the 503 on: wait 1 s
            router = start_router(
                "regular", tmp_path, workers=[worker], extra=["--migration-wait", "1"]
            )
            wait_healthy([router])
            target = router
        r = _stop_during_a_long_request(target, worker, victim=worker)
        _assert_shutdown_503(r, "server shutting down", worker)
    finally:
        stop([p for p in (router, worker) if p is not None])


def test_stopping_the_router_answers_an_inflight_request_503_json(tmp_path):
    worker = start_worker("mixed", "mixed", tmp_path, extra=["--num-threads", "1"])
    router = None
    try:
        wait_healthy([worker])
        router = start_router("regular", tmp_path, workers=[worker])
        wait_healthy([router])
        r = _stop_during_a_long_request(router, worker, victim=router)
        _assert_shutdown_503(r, "server shutting down: the router", router)
    finally:
        stop([p for p in (router, worker) if p is not None])
