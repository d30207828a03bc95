"""The router's admin API with real workers (KV over real NIXL on CPU): a router started
with one prefill worker gets a second one added at run time, which takes requests at once
(its first health probe runs inside the add call, well within one health interval); then
the first is removed under a load of streamed and plain requests, and no request fails."""

from __future__ import annotations

import threading

import httpx
import pytest

from pdserve_procs import start_router, start_worker, stop, wait_for, wait_healthy

pytestmark = pytest.mark.timeout(600)

TOKEN = "e2e-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _transfers(proc) -> int:
    return proc.get_info()["transfer"]["transfers_succeeded"]


def test_add_then_remove_a_prefill_worker_under_load(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    p1 = start_worker("prefill-1", "prefill", tmp_path)
    p2 = start_worker("prefill-2", "prefill", tmp_path)
    d = start_worker("decode", "decode", tmp_path)
    router = start_router(
        "router", tmp_path, prefill=[p1], decode=[d], extra=["--admin-token-file", str(token)]
    )
    procs = [p1, p2, d, router]
    try:
        wait_healthy(procs)
        admin = router.url + "/admin/workers"
        r = httpx.post(admin, json={"url": p2.url, "role": "prefill"}, headers=AUTH, timeout=30)
        assert r.status_code == 201 and r.json()["healthy"] is True, r.text
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
        before = _transfers(p2)
        for _ in range(8):  # power of two over both: the new one gets some at once
            assert httpx.post(router.url + "/v1/completions", json=body, timeout=120).is_success
        assert _transfers(p2) > before

        stop_load = threading.Event()
        results: list[tuple[int, str]] = []

        def load(i: int) -> None:
            with httpx.Client(timeout=120) as client:
                while not stop_load.is_set():
                    b = dict(body, max_tokens=6, stream=i % 2 == 0)
                    r = client.post(router.url + "/v1/completions", json=b)
                    results.append((r.status_code, r.text))

        threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(results) >= 8, 240, "load through both prefill workers")
            r = httpx.delete(
                admin, params={"url": p1.url, "wait_s": 120}, headers=AUTH, timeout=180
            )
            assert r.status_code == 200 and r.json()["removed"] is True, r.text
            p1_done = _transfers(p1)
            n = len(results)
            wait_for(lambda: len(results) >= n + 8, 240, "load after the removal")
        finally:
            stop_load.set()
            for t in threads:
                t.join(timeout=180)
        failed = [(s, t[:300]) for s, t in results if s != 200 or '"error"' in t]
        assert not failed, failed[:3]
        assert _transfers(p1) == p1_done  # nothing reached it after its drain ended
        listed = httpx.get(admin, headers=AUTH, timeout=30).json()
        assert [w["url"] for w in listed["prefill"]] == [p2.url]
        assert p1.health_problem() is None  # drained, not killed: the operator stops it
    finally:
        stop(procs)
