"""A real prefill worker and a real decode worker (KV over NIXL on CPU), no router, and a
mixed worker for reference: what prefill does with prompts it computes before decode's
destination arrives (issue 24) when that destination is late or never comes. The cap holds
(--pd-compute-ahead-fraction 0.25 of 64 pages: two 7-page prompts of four computed ahead,
the other two wait without pages); after --pd-compute-ahead-timeout a computed prompt gives
its pages back and waits without them, not failed, and the next waiting one is computed in
its place; a destination that comes after that gets its prompt computed again (from the
prefix cache) and a 200 with the mixed worker's text; the ones whose destination never
comes end at the bootstrap timeout (PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT, from arrival)
as before compute-ahead; a client that goes away frees a computed room's pages at once.
Greedy PD output against mixed through the router: tests/e2e/test_pd_parity.py."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pdserve_procs import assert_all_healthy, start_worker, stop, wait_for, wait_healthy

pytestmark = pytest.mark.timeout(240)

TIMEOUT_S = 3.0  # --pd-compute-ahead-timeout
BOOTSTRAP_S = 12.0  # PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT of prefill
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
        env={"PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_S)},
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
    mixed = start_worker("mixed", "mixed", logs, extra=pool)
    procs = [prefill, decode, mixed]
    try:
        wait_healthy(procs)
        yield {
            "prefill": prefill,
            "decode": decode,
            "mixed": mixed,
            "port": prefill.get_info()["bootstrap_port"],
            "baseline": {p.name: p.get_info()["num_free_pages"] for p in procs},
        }
    finally:
        stop(procs)


def _body(port: int, room: int, i: int) -> dict:
    return {
        "prompt": list(range(100 + 200 * i, 100 + 200 * i + PROMPT_LEN)),  # no shared page
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": room,
    }


def _engine(proc) -> dict:
    return proc.get_info()["engine"]


def _post(url: str, body: dict, got: dict, key, timeout: float = 60.0) -> None:
    got[key, "sent"] = time.monotonic()
    try:
        got[key] = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        got[key] = exc
    got[key, "at"] = time.monotonic()


def test_computed_rooms_give_their_pages_back_and_a_late_destination_is_served(workers):
    p, d, mixed = workers["prefill"], workers["decode"], workers["mixed"]
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
    assert time.monotonic() - first < TIMEOUT_S, "the host was too slow for this test's bound"

    # past the bound the two computed give their pages back and the two that waited are
    # computed in their place; past it again those give theirs back: all four wait, no page
    # held, none failed
    wait_for(
        lambda: _engine(p)["pd_ahead_expired"] - base["pd_ahead_expired"] >= 4,
        3 * TIMEOUT_S + 10,
        "the four computed prompts to give their pages back",
    )
    e = _engine(p)
    assert e["prompt_tokens_computed"] - base["prompt_tokens_computed"] == 4 * PROMPT_LEN
    assert e["pd_ahead_pages"] == 0 and e["num_transferring"] == 0
    assert e["num_waiting_for_peer"] - base["num_waiting_for_peer"] == 4
    assert p.get_info()["num_free_pages"] == workers["baseline"]["prefill"]  # cached only
    assert not any(i in got for i in range(4)), "a request ended before its bootstrap timeout"

    # decode's destination for room 0 comes after the bound: prefill computes the prompt
    # again from its cached pages (6 full pages of 16: 4 tokens left) and both answer 200
    # with what a mixed worker says
    late = _body(workers["port"], rooms[0], 0)
    r = httpx.post(d.url + "/v1/completions", json=late, timeout=60)
    assert r.status_code == 200, r.text
    want = {k: v for k, v in late.items() if not k.startswith("bootstrap_")}
    ref = httpx.post(mixed.url + "/v1/completions", json=want, timeout=60)
    assert ref.status_code == 200, ref.text
    choice, ref_choice = r.json()["choices"][0], ref.json()["choices"][0]
    assert choice["token_ids"] == ref_choice["token_ids"] and len(choice["token_ids"]) == 8
    assert choice["text"] == ref_choice["text"]
    threads[0].join(30)
    assert isinstance(got[0], httpx.Response) and got[0].status_code == 200, got[0]
    assert got[0].json()["choices"][0]["token_ids"] == ref_choice["token_ids"][:1]
    e = _engine(p)
    assert e["prompt_tokens_computed"] - base["prompt_tokens_computed"] == 4 * PROMPT_LEN + 4
    assert e["num_waiting_for_peer"] - base["num_waiting_for_peer"] == 3

    # the other three's destinations never come: the bootstrap timeout (from arrival) ends
    # them, as before compute-ahead
    for t in threads[1:]:
        t.join(BOOTSTRAP_S + 30)
    for i in (1, 2, 3):
        r = got[i]
        assert isinstance(r, httpx.Response) and r.status_code == 500, r
        msg = r.json()["error"]["message"]
        assert f"within {BOOTSTRAP_S:g} s" in msg and "BOOTSTRAP_TIMEOUT" in msg, msg
        assert got[i, "at"] - got[i, "sent"] > BOOTSTRAP_S - 0.5
    e = _engine(p)
    assert e["pd_ahead_expired"] - base["pd_ahead_expired"] == 4 and e["pd_ahead_pages"] == 0
    assert e["num_waiting_for_peer"] == base["num_waiting_for_peer"]
    failed = p.get_info()["transfer"]["transfers_failed"]
    assert failed.get("bootstrap_timeout", 0) >= 3, failed
    for w in (p, d):
        wait_for(
            lambda w=w: w.get_info()["num_free_pages"] == workers["baseline"][w.name],
            10,
            f"{w.name}'s pages back at baseline",
        )
    assert_all_healthy([p, d, mixed])


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
