"""The router never pairs a prefill with a decode that reports it unhealthy (its
``/get_server_info`` lists the prefill's bootstrap address under
``transfer.unhealthy_prefill_peers``: KV pages quarantined longer than the bound): two
prefill and two decode fake workers over real HTTP; other pairs serve, no pair left is a
503 naming them, a cleared report restores the pair. The router's view is awaited through
its own ``/get_server_info``, never a sleep."""

from __future__ import annotations

import time

import httpx
import pytest
from fake_workers import FakeWorker

from pdserve.config import RouterConfig
from pdserve.http.netutil import ThreadedServer
from pdserve.router.app import build_router_app
from pdserve.router.workers import WorkerState, refuses, unhealthy_prefill_peers

pytestmark = pytest.mark.timeout(120)
# random picks: an allowed pair is missed with probability <= 4 * (3/4)**N, about 4e-6
N = 48


@pytest.fixture(scope="module")
def cluster():
    """({"p0", "p1", "d0", "d1"} -> (fake worker, its URL), router URL)."""
    workers = {"p0": FakeWorker("prefill"), "p1": FakeWorker("prefill")}
    workers |= {"d0": FakeWorker("decode"), "d1": FakeWorker("decode")}
    workers["p0"].bootstrap_port, workers["p1"].bootstrap_port = 4242, 4343
    servers = {name: ThreadedServer(w.app) for name, w in workers.items()}
    for s in servers.values():
        s.start()
    config = RouterConfig(
        prefill_urls=(servers["p0"].url, servers["p1"].url),
        decode_urls=(servers["d0"].url, servers["d1"].url),
        policy="random",
        pd_min_prefill_tokens=0,  # every request through a pair: the pairs are the subject
        health_check_interval=0.05,
        # no worker here ever fails its health check: a slow answer on a loaded CI machine
        # (2 s was seen) must not eject both prefills and turn a request into a 503
        health_check_timeout=30.0,
        health_failure_threshold=3,
    )
    router = ThreadedServer(build_router_app(config))
    router.start()
    try:
        yield {n: (w, servers[n].url) for n, w in workers.items()}, router.url
    finally:
        router.stop()
        for s in servers.values():
            s.stop()


def report(cluster, reports: dict[str, list[str]]) -> None:
    """Make each decode report the named prefills unhealthy, then wait until the router
    shows exactly those reports (its health check read them) and every worker healthy."""
    workers, url = cluster
    want = {}
    for d in ("d0", "d1"):
        peers = {f"127.0.0.1:{workers[p][0].bootstrap_port}": 99.0 for p in reports.get(d, [])}
        workers[d][0].transfer = {"unhealthy_prefill_peers": peers, "quarantined_rooms": 1}
        want[workers[d][1]] = peers
    deadline = time.monotonic() + 30
    while True:
        info = httpx.get(url + "/get_server_info").json()["workers"]
        seen = {w["url"]: w["unhealthy_prefill_peers"] for w in info if w["role"] == "decode"}
        if seen == want and all(w["healthy"] for w in info):
            return
        assert time.monotonic() < deadline, f"the router never showed {want}: {info}"
        time.sleep(0.02)


def pairs_served(cluster, n: int) -> set[tuple[str, str]]:
    """Send ``n`` requests (each must succeed); the (prefill, decode) names that served."""
    workers, url = cluster
    for w, _ in workers.values():
        w.bodies.clear()
    for i in range(n):
        r = httpx.post(url + "/v1/completions", json={"prompt": f"q{i}"})
        assert r.status_code == 200, r.text
    prefill_of = {b["bootstrap_room"]: p for p in ("p0", "p1") for b in workers[p][0].bodies}
    pairs = set()
    for d in ("d0", "d1"):
        for b in workers[d][0].bodies:
            p = prefill_of[b["bootstrap_room"]]  # both legs got the room
            # decode was told the bootstrap address of the very prefill that got the room
            assert b["bootstrap_port"] == workers[p][0].bootstrap_port
            pairs.add((p, d))
    assert len(prefill_of) == sum(len(workers[d][0].bodies) for d in ("d0", "d1")) == n
    return pairs


def test_every_pair_serves_when_no_decode_reports_a_prefill(cluster):
    report(cluster, {})
    assert pairs_served(cluster, N) == {("p0", "d0"), ("p0", "d1"), ("p1", "d0"), ("p1", "d1")}


def test_a_reported_pair_is_avoided_and_its_workers_serve_with_others(cluster):
    report(cluster, {"d0": ["p0"]})
    assert pairs_served(cluster, N) == {("p0", "d1"), ("p1", "d0"), ("p1", "d1")}
    metrics = httpx.get(cluster[1] + "/metrics").text
    p0, d0 = cluster[0]["p0"][1], cluster[0]["d0"][1]
    assert f'pdserve_router_avoided_pd_pairs{{decode="{d0}",prefill="{p0}"}} 1.0' in metrics
    # p0 is reported by both decodes: only p1 prefills, with both decodes
    report(cluster, {"d0": ["p0"], "d1": ["p0"]})
    assert pairs_served(cluster, N) == {("p1", "d0"), ("p1", "d1")}
    report(cluster, {"d0": ["p0", "p1"], "d1": ["p1"]})
    assert pairs_served(cluster, N) == {("p0", "d1")}


def test_no_pair_left_is_a_503_naming_the_reports_and_a_cleared_report_restores_it(cluster):
    workers, url = cluster
    report(cluster, {"d0": ["p0", "p1"], "d1": ["p0", "p1"]})
    for w, _ in workers.values():
        w.bodies.clear()
    for stream in (False, True):
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "stream": stream})
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert "PDSERVE_DISAGGREGATION_QUARANTINE_BOUND" in msg
        assert f"{workers['d1'][1]} reports {workers['p0'][1]}" in msg
    assert not any(w.bodies for w, _ in workers.values())  # no worker was sent anything
    assert httpx.get(url + "/get_server_info").json()["live_bootstrap_rooms"] == 0
    report(cluster, {"d1": ["p0", "p1"]})
    assert pairs_served(cluster, N) == {("p0", "d0"), ("p1", "d0")}
    report(cluster, {})
    assert len(pairs_served(cluster, N)) == 4


def test_refuses_reads_only_a_well_formed_report():
    prefill = WorkerState("http://p", "prefill", server_info={"bootstrap_port": 7})
    for info in ({}, {"transfer": None}, {"transfer": {"unhealthy_prefill_peers": []}}):
        decode = WorkerState("http://d", "decode", server_info=info)
        assert unhealthy_prefill_peers(decode) == {} and not refuses(decode, prefill)
    decode = WorkerState(
        "http://d", "decode", server_info={"transfer": {"unhealthy_prefill_peers": {"p:7": 1.0}}}
    )
    assert refuses(decode, prefill)  # the URL's host, as the router hands it out
    assert not refuses(
        decode, WorkerState("http://p", "prefill", server_info={"bootstrap_port": 8})
    )
    assert not refuses(decode, WorkerState("http://p", "prefill"))  # no bootstrap port known
