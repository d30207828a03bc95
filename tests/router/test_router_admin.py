"""The router's admin API against fake workers (in-process servers, joined at teardown):
token guard, add/list/remove per role with the health checks, drain (no new requests,
in-flight ones finish), and removing a prefill worker under load fails no request."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fake_workers import FakeWorker

from pdserve.config import RouterConfig
from pdserve.http.netutil import ThreadedServer
from pdserve.router.app import build_router_app

pytestmark = pytest.mark.timeout(120)

TOKEN = "net15-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def servers():
    started: list[ThreadedServer] = []

    def start(app) -> str:
        server = ThreadedServer(app)
        server.start()
        url = server.url
        started.append(server)
        return url

    try:
        yield start
    finally:
        for s in reversed(started):
            s.stop()


def _router(start, **kw) -> str:
    config = RouterConfig(
        pd_min_prefill_tokens=0,  # every PD request through a pair, as the tests expect
        request_timeout=30.0,
        health_check_interval=0.2,
        health_check_timeout=2.0,
        health_failure_threshold=1,
        **kw,
    )
    return start(build_router_app(config))


def _wait(pred, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def test_admin_api_is_off_without_a_token_and_guarded_with_one(servers):
    mixed = FakeWorker("mixed")
    url = _router(servers, worker_urls=(servers(mixed.app),))
    r = httpx.get(url + "/admin/workers")
    assert r.status_code == 403 and "admin API is off" in r.json()["error"]["message"]

    url = _router(servers, worker_urls=(servers(mixed.app),), admin_token=TOKEN)
    assert httpx.get(url + "/admin/workers").status_code == 401
    wrong = {"Authorization": "Bearer " + TOKEN[:-1] + "x"}
    assert httpx.get(url + "/admin/workers", headers=wrong).status_code == 401
    r = httpx.post(url + "/admin/workers", json={"url": "http://x:1", "role": "mixed"})
    assert r.status_code == 401
    listed = httpx.get(url + "/admin/workers", headers=AUTH).json()
    assert [w["role"] for w in listed["mixed"]] == ["mixed"]
    assert listed["mixed"][0]["healthy"] is True and listed["mixed"][0]["draining"] is False


def test_router_starts_empty_and_serves_once_workers_are_added(servers):
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    p_url, d_url = servers(prefill.app), servers(decode.app)
    url = _router(servers, mode="pd", admin_token=TOKEN)
    assert httpx.get(url + "/health").status_code == 503
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and "no healthy prefill worker" in r.json()["error"]["message"]

    r = httpx.post(url + "/admin/workers", json={"url": p_url, "role": "prefill"}, headers=AUTH)
    assert r.status_code == 201, r.text
    assert r.json()["healthy"] is True  # probed at once: takes requests right away
    r = httpx.post(url + "/admin/workers", json={"url": d_url, "role": "decode"}, headers=AUTH)
    assert r.status_code == 201 and r.json()["healthy"] is True
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decode"
    assert len(prefill.bodies) == 1 and prefill.bodies[0]["bootstrap_port"] == 4242

    listed = httpx.get(url + "/admin/workers", headers=AUTH).json()
    assert {role: [w["url"] for w in ws] for role, ws in listed.items()} == {
        "prefill": [p_url],
        "decode": [d_url],
    }


def test_bad_admin_requests_are_clear_errors(servers):
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    p_url, d_url = servers(prefill.app), servers(decode.app)
    url = _router(servers, prefill_urls=(p_url,), decode_urls=(d_url,), admin_token=TOKEN)
    post = lambda body: httpx.post(url + "/admin/workers", json=body, headers=AUTH)  # noqa: E731
    r = post({"url": p_url, "role": "prefill"})
    assert r.status_code == 409 and "already" in r.json()["error"]["message"]
    r = post({"url": p_url + "/", "role": "decode"})  # the same URL under another role
    assert r.status_code == 409
    r = post({"url": "http://127.0.0.1:1", "role": "mixed"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "role"
    r = post({"url": "ftp://127.0.0.1:1", "role": "prefill"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "url"
    r = post({"role": "prefill"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "url"
    r = httpx.post(url + "/admin/workers", content=b"{", headers=AUTH)
    assert r.status_code == 400
    r = httpx.delete(url + "/admin/workers", params={"url": "http://nope:1"}, headers=AUTH)
    assert r.status_code == 404
    r = httpx.delete(url + "/admin/workers", params={"url": p_url, "wait_s": -1}, headers=AUTH)
    assert r.status_code == 400
    # A worker that is down when added is listed unhealthy and gets no request...
    r = post({"url": "http://127.0.0.1:1", "role": "prefill"})
    assert r.status_code == 201 and r.json()["healthy"] is False
    assert r.json()["last_error"]
    for _ in range(4):
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 200
    assert len(prefill.bodies) == 4
    # ...and the router keeps serving after all of it.
    assert httpx.get(url + "/health").status_code == 200


def test_a_worker_added_unhealthy_takes_requests_after_its_next_health_check(servers):
    first, late = FakeWorker("prefill"), FakeWorker("prefill")
    decode = FakeWorker("decode")
    late.health = 503
    p1, p2, d_url = servers(first.app), servers(late.app), servers(decode.app)
    url = _router(
        servers, prefill_urls=(p1,), decode_urls=(d_url,), admin_token=TOKEN, policy="round_robin"
    )
    r = httpx.post(url + "/admin/workers", json={"url": p2, "role": "prefill"}, headers=AUTH)
    assert r.status_code == 201 and r.json()["healthy"] is False
    late.health = 200
    listed = lambda: httpx.get(url + "/admin/workers", headers=AUTH).json()  # noqa: E731
    _wait(lambda: all(w["healthy"] for w in listed()["prefill"]), "the late worker's next check")
    for _ in range(4):
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 200
    assert len(late.bodies) == 2 and len(first.bodies) == 2  # round robin over both


def test_drain_lets_in_flight_requests_finish_and_sends_no_new_ones(servers):
    old, new = FakeWorker("prefill"), FakeWorker("prefill")
    decode = FakeWorker("decode")
    p_old, p_new, d_url = servers(old.app), servers(new.app), servers(decode.app)
    url = _router(servers, prefill_urls=(p_old,), decode_urls=(d_url,), admin_token=TOKEN)
    old.gate = threading.Event()  # holds the request until released below
    results: dict[str, httpx.Response] = {}

    def slow():
        results["slow"] = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=60)

    t = threading.Thread(target=slow)
    t.start()
    _wait(lambda: old.bodies, "the slow request to reach the old prefill")
    r = httpx.post(url + "/admin/workers", json={"url": p_new, "role": "prefill"}, headers=AUTH)
    assert r.status_code == 201 and r.json()["healthy"] is True
    r = httpx.delete(url + "/admin/workers", params={"url": p_old}, headers=AUTH)
    assert r.status_code == 202, r.text  # one request still in flight
    assert r.json() == dict(r.json(), removed=False, draining=True, outstanding=1)
    for _ in range(5):  # new requests all go to the new worker
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 200
    assert len(old.bodies) == 1 and len(new.bodies) == 5
    old.gate.set()
    t.join(timeout=60)
    assert results["slow"].status_code == 200  # the in-flight request finished
    _wait(
        lambda: (
            [w["url"] for w in httpx.get(url + "/admin/workers", headers=AUTH).json()["prefill"]]
            == [p_new]
        ),
        "the drained worker to be removed",
    )


def test_removing_a_prefill_worker_under_load_fails_no_request(servers):
    keep, leave = FakeWorker("prefill"), FakeWorker("prefill")
    decode = FakeWorker("decode")
    for w in (keep, leave, decode):
        w.delay, w.chunks, w.chunk_gap = 0.02, 4, 0.01
    p_keep, p_leave, d_url = servers(keep.app), servers(leave.app), servers(decode.app)
    url = _router(servers, prefill_urls=(p_keep, p_leave), decode_urls=(d_url,), admin_token=TOKEN)
    stop = threading.Event()
    statuses: list[int] = []
    errors: list[str] = []

    def load(i: int) -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                body = {"prompt": "x", "stream": i % 2 == 0}
                r = client.post(url + "/v1/completions", json=body)
                statuses.append(r.status_code)
                if body["stream"] and ("error" in r.text or not r.text.endswith("[DONE]\n\n")):
                    errors.append(r.text)

    with ThreadPoolExecutor(6) as ex:
        futures = [ex.submit(load, i) for i in range(6)]
        _wait(lambda: len(leave.bodies) >= 3 and len(keep.bodies) >= 3, "load on both prefills")
        r = httpx.delete(
            url + "/admin/workers", params={"url": p_leave, "wait_s": 60}, headers=AUTH
        )
        assert r.status_code == 200 and r.json()["removed"] is True, r.text
        served_by_leave = len(leave.bodies)
        before = len(statuses)
        _wait(lambda: len(statuses) >= before + 20, "more requests after the removal")
        stop.set()
        for f in futures:
            f.result()
    assert len(leave.bodies) == served_by_leave  # nothing new after the drain ended
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert not errors, errors[:2]
    listed = httpx.get(url + "/admin/workers", headers=AUTH).json()
    assert [w["url"] for w in listed["prefill"]] == [p_keep]
