"""A real prefill worker and a real decode worker (KV over NIXL on CPU), no router: what
prefill does with prompts it computes before decode's destination arrives (issue 24) when
that destination never comes. The cap holds (--pd-compute-ahead-fraction 0.25 of 64 pages:
two 7-page prompts of four computed ahead, the other two wait without pages); a computed
room fails after --pd-compute-ahead-timeout with a bootstrap-timeout error and its pages
come back, the next waiting one is computed in its place; a decode whose destination comes
after that gets the same failure; a client that goes away frees a computed room's pages at
once. Greedy PD output against mixed: tests/e2e/test_pd_parity.py."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pdserve_procs import assert_all_healthy, start_worker, stop, wait_for, wait_healthy

pytestmark = pytest.mark.timeout(240)

TIMEOUT_S = 4.0  # --pd-compute-ahead-timeout
PAGES, PAGE = 64, 16  # cap: 16 pages; a 100-token prompt takes 7
PROMPT_LEN = 100


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ahead-logs")
    pool = ["--num-pages", str(PAGES), "--page-size", str(PAGE)]
    prefill = start_worker(
        "prefill",
        "prefill",
        logs,
        extra=[
            "--disaggregation-bootstrap-port",
            "0",
            *pool,
            "--pd-compute-ahead-fraction",
            "0.25",
            "--pd-compute-ahead-timeout",
            str(TIMEOUT_S),
        ],
    )
    decode = start_worker("decode", "decode", logs, extra=pool)
    procs = [prefill, decode]
    try:
        wait_healthy(procs)
        yield {
            "prefill": prefill,
            "decode": decode,
            "port": prefill.get_info()["bootstrap_port"],
            "baseline": {p.name: p.get_info()["num_free_pages"] for p in procs},
        }
    finally:
        stop(procs)


def _body(port: int, room: int, i: int) -> dict:
    return {
        "prompt": list(range(100 + 200 * i, 100 + 200 * i + PROMPT_LEN)),  # no shared page
        "max_tokens": 4,
        "temperature": 0,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": room,
    }


def _engine(proc) -> dict:
    return proc.get_info()["engine"]


def _post(url: str, body: dict, got: dict, key, timeout: float = 60.0) -> None:
    try:
        got[key] = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        got[key] = exc
    got[key, "at"] = time.monotonic()


def test_cap_holds_and_unclaimed_computed_rooms_fail_after_the_ahead_timeout(workers):
    p, d = workers["prefill"], workers["decode"]
    base = _engine(p)
    rooms = [880_000 + i for i in range(4)]
    got: dict = {}
    threads = []
    for i, room in enumerate(rooms):  # one at a time: arrival order is room order
        t = threading.Thread(target=_post, args=(p.url, _body(workers["port"], room, i), got, i))
        t.start()
        threads.append(t)
        wait_for(
            lambda n=i + 1: _engine(p)["num_waiting_for_peer"] - base["num_waiting_for_peer"] >= n,
            20,
            f"room {room} to be live on prefill",
        )
    wait_for(
        lambda: (
            _engine(p)["prompt_tokens_computed"] - base["prompt_tokens_computed"] >= 2 * PROMPT_LEN
        ),
        20,
        "two prompts computed ahead",
    )
    first = time.monotonic()
    e = _engine(p)
    assert e["prompt_tokens_computed"] - base["prompt_tokens_computed"] == 2 * PROMPT_LEN
    assert e["pd_ahead_pages"] == 14 and e["pd_ahead_capped"] - base["pd_ahead_capped"] == 2
    assert p.get_info()["num_free_pages"] == workers["baseline"]["prefill"] - 14
    time.sleep(1.0)  # still only two: the others wait without pages
    assert _engine(p)["prompt_tokens_computed"] - base["prompt_tokens_computed"] == 2 * PROMPT_LEN
    assert time.monotonic() - first < TIMEOUT_S, "the host was too slow for this test's bound"
    for t in threads:
        t.join(60)
    for i in range(4):
        r = got[i]
        assert isinstance(r, httpx.Response) and r.status_code == 500, r
        msg = r.json()["error"]["message"]
        assert (
            f"did not arrive within {TIMEOUT_S:g} s" in msg and "--pd-compute-ahead-timeout" in msg
        )
    # two rounds: the two that waited were computed when the first two failed
    assert min(got[2, "at"], got[3, "at"]) - max(got[0, "at"], got[1, "at"]) > TIMEOUT_S - 1.0
    e = _engine(p)
    assert e["prompt_tokens_computed"] - base["prompt_tokens_computed"] == 4 * PROMPT_LEN
    assert e["pd_ahead_expired"] - base["pd_ahead_expired"] == 4 and e["pd_ahead_pages"] == 0
    wait_for(
        lambda: p.get_info()["num_free_pages"] == workers["baseline"]["prefill"],
        10,
        "prefill's pages back at baseline",
    )
    failed = p.get_info()["transfer"]["transfers_failed"]
    assert failed.get("bootstrap_timeout", 0) >= 4, failed

    # decode's destination for an expired room comes late: it gets prefill's failure
    late = _body(workers["port"], rooms[0], 0)
    r = httpx.post(d.url + "/v1/completions", json=late, timeout=60)
    assert r.status_code == 500 and "--pd-compute-ahead-timeout" in r.json()["error"]["message"]
    wait_for(
        lambda: d.get_info()["num_free_pages"] == workers["baseline"]["decode"],
        10,
        "decode's pages back at baseline",
    )
    assert_all_healthy([p, d])


def test_a_client_that_goes_away_frees_a_computed_room_at_once(workers):
    p = workers["prefill"]
    base = _engine(p)
    got: dict = {}
    t = threading.Thread(
        target=_post, args=(p.url, _body(workers["port"], 890_000, 5), got, 0, 1.5)
    )
    t.start()
    wait_for(
        lambda: _engine(p)["prompt_tokens_computed"] - base["prompt_tokens_computed"] >= PROMPT_LEN,
        20,
        "the prompt computed ahead",
    )
    computed = time.monotonic()
    assert p.get_info()["num_free_pages"] == workers["baseline"]["prefill"] - 7  # held
    t.join(10)
    assert isinstance(got[0], httpx.ReadTimeout)  # the client gave up
    wait_for(
        lambda: p.get_info()["num_free_pages"] == workers["baseline"]["prefill"],
        TIMEOUT_S,
        "prefill's pages back once the client went away",
    )
    assert time.monotonic() - computed < TIMEOUT_S
    e = _engine(p)
    assert e["pd_ahead_expired"] == base["pd_ahead_expired"] and e["pd_ahead_pages"] == 0
    assert e["num_waiting_for_peer"] == 0 and e["num_transferring"] == 0
