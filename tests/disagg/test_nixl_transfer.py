"""End to end over real NIXL (UCX, CPU memory): prefill and decode managers in two
processes, driven like the engine drives them (tests/disagg/disagg_peer.py).

When NIXL cannot be used here these tests fail with the probe's reason (never skip).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from disagg_peer import Peer  # tests/disagg is on sys.path (rootdir-less test dirs)

from pdserve.disagg.nixl.probe import nixl_problem

QUICK = {
    "PDSERVE_DISAGGREGATION_TRANSFER_WORKERS": "2",
    "PDSERVE_DISAGGREGATION_NIXL_NUM_THREADS": "0",
}
RESET = (
    "PDSERVE_TEST_DISAGG_FAILURE_PROB",
    "PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
    "PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL",
    "PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",
)


@pytest.fixture(scope="module")
def pair():
    problem = nixl_problem()
    if problem:
        pytest.fail(problem)  # fail, never skip
    prefill = Peer("prefill", QUICK, wait=False)
    decode = Peer("decode", QUICK, wait=False)
    try:
        yield prefill.wait(), decode.wait()
    finally:
        prefill.close()
        decode.close()


@pytest.fixture
def fresh(pair):
    """The pair with new managers (default env) for each test."""
    prefill, decode = pair
    prefill.reset(QUICK, unset=RESET)
    decode.reset(QUICK, unset=RESET)
    return prefill, decode


def _nothing_leaked(*peers: Peer) -> None:
    for peer in peers:
        state = peer.call("state")
        assert state["free_pages"] == state["num_pages"], (peer.role, state)
        assert state["free_slots"] == peer.num_slots, (peer.role, state)
        assert state["live_rooms"] == 0, (peer.role, state)
        assert state["quarantined"] == 0, (peer.role, state)
        assert state["healthy"], (peer.role, state)


@pytest.mark.timeout(120)
def test_many_concurrent_rooms_scattered_pages_byte_exact(fresh):
    prefill, decode = fresh
    rooms = {(1 << 62) + 17 * i: 1 + (i * 5) % 9 for i in range(64)}  # 1..9 pages each
    decode.run(rooms, port=prefill.port)
    prefill.run(rooms)
    got_d, got_p = decode.result(), prefill.result()
    assert {r["state"] for r in got_p.values()} == {"Success"}, got_p
    assert {r["state"] for r in got_d.values()} == {"Success"}, got_d
    assert all(r["bytes_ok"] and r["aux_ok"] for r in got_d.values())
    _nothing_leaked(prefill, decode)
    stats_p, stats_d = prefill.call("state")["stats"], decode.call("state")["stats"]
    pages = sum(rooms.values())
    assert stats_p["pages_transferred"] == stats_d["pages_transferred"] == pages
    assert stats_p["transfer_latency_seconds"]["count"] == len(rooms)
    assert stats_p["transfers_failed_total"] == stats_d["transfers_failed_total"] == 0
    # the notification hop counts both ends: every XferDone sent was read and matched
    assert stats_p["notifs_sent"] == stats_d["notifs_received"] == len(rooms)
    assert stats_d["notifs_unmatched"] == 0
    assert 0 <= stats_d["notifs_read_age_s"] < 5  # the notification thread reads
    assert set(stats_d["rooms"]) == {
        "Failed",
        "Bootstrapping",
        "WaitingForInput",
        "Transferring",
        "Success",
    }


@pytest.mark.timeout(120)
def test_each_room_wakes_the_engine_when_it_is_ready_and_when_it_ends(fresh):
    """Each side's manager calls its wake-up (``set_wakeup``: an idle engine's wait ends
    at once instead of at its next poll) when a room may be init'ed (its destination /
    writers known: ``WaitingForInput``) and when it ends (decode: on reading the
    XferDone), twice a room, not once per poll."""
    prefill, decode = fresh
    before = prefill.call("state")["wakeups"], decode.call("state")["wakeups"]
    rooms = {(1 << 57) + 13 * i: 1 + i % 3 for i in range(8)}
    decode.run(rooms, port=prefill.port)
    prefill.run(rooms)
    got_d, got_p = decode.result(), prefill.result()
    assert {r["state"] for r in got_p.values()} == {"Success"}, got_p
    assert {r["state"] for r in got_d.values()} == {"Success"}, got_d
    after = prefill.call("state")["wakeups"], decode.call("state")["wakeups"]
    assert [a - b for a, b in zip(after, before)] == [2 * len(rooms)] * 2
    _nothing_leaked(prefill, decode)


@pytest.mark.timeout(60)
def test_a_notification_matching_no_room_is_counted_not_silent(fresh):
    """An XferDone decode cannot match (no live room, or not from the room's writer) is
    counted in stats() (and logged): a room it was meant for would hang silently else."""
    _, decode = fresh
    before = decode.call("state")["stats"]
    assert before["notifs_unmatched"] == 0
    after = decode.call("stray_notif", room=12345)
    assert after["notifs_unmatched"] == 1
    assert after["notifs_received"] == before["notifs_received"]  # not read from NIXL


@pytest.mark.timeout(120)
def test_chunked_sends_and_decode_held_prefix_byte_exact(fresh):
    """Prefill sends each room 2 pages at a time (last=False) then the rest with the aux
    record; decode declares its first page held (skip_pages=1): every other page arrives
    byte for byte, one completion per room, nothing leaked; both ends count the pages
    written, not the one decode held."""
    prefill, decode = fresh
    rooms = {(1 << 61) + 7 * i: 3 + i % 6 for i in range(24)}  # 3..8 pages: 2..4 sends
    decode.run(rooms, port=prefill.port, skip=1)
    prefill.run(rooms, chunk=2)
    got_d, got_p = decode.result(), prefill.result()
    assert {r["state"] for r in got_p.values()} == {"Success"}, got_p
    assert {r["state"] for r in got_d.values()} == {"Success"}, got_d
    assert all(r["bytes_ok"] and r["aux_ok"] for r in got_d.values())
    _nothing_leaked(prefill, decode)
    stats_p, stats_d = prefill.call("state")["stats"], decode.call("state")["stats"]
    assert stats_p["completion_latency_seconds"]["count"] == len(rooms)
    assert stats_p["transfers_succeeded"] == len(rooms)
    written = sum(rooms.values()) - len(rooms)  # each room's first page is decode's
    assert stats_p["pages_transferred"] == stats_d["pages_transferred"] == written
    assert stats_p["bytes_transferred"] == stats_d["bytes_transferred"]


@pytest.mark.timeout(120)
def test_writes_made_ahead_are_posted_with_the_notification_byte_exact(fresh):
    """Prefill hints every room's pages (``expect_pages``) before its single last send:
    the WRITE made ahead is what is posted, with ``XferDone`` (and the aux record) set at
    post time; every page arrives byte for byte (decode holding a first page or not), and
    no handle made ahead is left."""
    prefill, decode = fresh
    for skip in (0, 1):
        rooms = {(1 << 60) + 11 * i + skip: 2 + i % 8 for i in range(24)}  # 2..9 pages
        before = prefill.call("state")["stats"]["premade_writes_posted"]
        decode.run(rooms, port=prefill.port, skip=skip)
        prefill.run(rooms, expect=True)
        got_d, got_p = decode.result(), prefill.result()
        assert {r["state"] for r in got_p.values()} == {"Success"}, got_p
        assert {r["state"] for r in got_d.values()} == {"Success"}, got_d
        assert all(r["bytes_ok"] and r["aux_ok"] for r in got_d.values())
        stats = prefill.call("state")["stats"]
        assert stats["premade_writes_posted"] - before == len(rooms)
        assert stats["premade_writes"] == 0
    _nothing_leaked(prefill, decode)


@pytest.mark.timeout(120)
def test_writes_made_ahead_are_released_on_chunked_sends_and_aborts(fresh):
    """A hinted room sent in chunks posts the usual way (what was made ahead is released
    at its first send); hinted rooms aborted from either side before their send (the
    send waits 20 ms) release theirs: none is posted, none is left, nothing leaked."""
    prefill, decode = fresh
    rooms = {(1 << 59) + 3 * i: 3 + i % 5 for i in range(16)}
    decode.run(rooms, port=prefill.port)
    prefill.run(rooms, chunk=2, expect=True)
    got_d, got_p = decode.result(), prefill.result()
    assert {r["state"] for r in got_p.values()} == {"Success"}, got_p
    assert all(r["bytes_ok"] and r["aux_ok"] for r in got_d.values())
    stats = prefill.call("state")["stats"]
    assert stats["premade_writes_posted"] == 0
    assert stats["premade_writes"] == 0
    rooms = {(1 << 58) + 5 * i: 1 + i % 4 for i in range(24)}
    aborts_p = {r: 0.1 for i, r in enumerate(rooms) if i % 2 == 0}
    aborts_d = {r: 0.2 for i, r in enumerate(rooms) if i % 2 == 1}
    decode.run(rooms, port=prefill.port, abort_after=aborts_d)
    prefill.run(rooms, abort_after=aborts_p, send_delay=0.5, expect=True)
    got_d, got_p = decode.result(), prefill.result()
    assert all(got_p[r]["state"] == "Failed" for r in aborts_p), got_p
    assert all(r["bytes_ok"] and r["aux_ok"] for r in got_d.values() if r["state"] == "Success")
    stats = prefill.call("state")["stats"]
    assert stats["premade_writes_made"] > stats["premade_writes_posted"]  # some never posted
    assert stats["premade_writes"] == 0
    _nothing_leaked(prefill, decode)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "field,value",
    [
        ("head_dim", 32),
        ("dtype", "bfloat16"),
        ("model", "other-model"),
        ("kv_order", "layer_major"),
        ("speculative", "ngram k=4 n=1-3"),  # speculative decoding on one side only
        ("k_scales", (0.5, 0.5)),  # an FP8 pool's per-layer scales (issue 26)
        ("v_scales", (2.0,)),
    ],
)
def test_layout_mismatch_fails_fast_on_both_sides_naming_the_field(pair, field, value):
    prefill, decode = pair
    prefill.reset(QUICK, unset=RESET)
    decode.reset(QUICK, unset=RESET, layout_over={field: value})
    rooms = {11: 2, 12: 3}
    t0 = time.monotonic()
    decode.run(rooms, port=prefill.port, timeout=20)
    prefill.run(rooms, timeout=20)
    got_d, got_p = decode.result(), prefill.result()
    for got in (got_d, got_p):
        assert {r["state"] for r in got.values()} == {"Failed"}
        assert all(field in r["error"] for r in got.values()), got
    assert time.monotonic() - t0 < 10  # the bootstrap timeout (300 s) plays no part
    _nothing_leaked(prefill, decode)


@pytest.mark.timeout(120)
def test_decode_never_comes_prefill_fails_after_bootstrap_timeout(pair):
    prefill, decode = pair
    prefill.reset(dict(QUICK, PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT="1.0"), unset=RESET)
    prefill.run({21: 2, 22: 4}, timeout=20)
    got = prefill.result()
    assert {r["state"] for r in got.values()} == {"Failed"}
    assert all("PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT" in r["error"] for r in got.values()), got
    assert all(0.9 < r["t"] < 5 for r in got.values()), got
    _nothing_leaked(prefill)
    assert prefill.call("state")["stats"]["transfers_failed"] == {"bootstrap_timeout": 2}


@pytest.mark.timeout(120)
def test_failure_injection_leaks_nothing(pair):
    prefill, decode = pair
    env = dict(QUICK, PDSERVE_TEST_DISAGG_FAILURE_PROB="0.2")
    prefill.reset(env, unset=RESET)
    decode.reset(env, unset=RESET)
    rooms = {1000 + i: 1 + i % 4 for i in range(100)}
    decode.run(rooms, port=prefill.port, timeout=60)
    prefill.run(rooms, timeout=60)
    got_d, got_p = decode.result(90), prefill.result(90)
    assert len(got_d) == len(got_p) == 100  # every room reached a terminal state and was closed
    assert any(r["state"] == "Failed" and "injected" in r["error"] for r in got_d.values())
    assert any(r["state"] == "Failed" and "injected" in r["error"] for r in got_p.values())
    assert any(
        r["state"] == "Success" for r in got_d.values()
    )  # injection is per state, not per call
    assert all(r["bytes_ok"] and r["aux_ok"] for r in got_d.values() if r["state"] == "Success")
    _nothing_leaked(prefill, decode)


@pytest.mark.timeout(120)
def test_abort_from_either_side_at_any_state(fresh):
    prefill, decode = fresh
    rooms = {2000 + i: 1 + i % 6 for i in range(60)}
    aborts_d = {r: (i % 7) * 0.01 for i, r in enumerate(rooms) if i % 3 == 0}
    aborts_p = {r: (i % 5) * 0.01 for i, r in enumerate(rooms) if i % 3 == 1}
    decode.run(rooms, port=prefill.port, abort_after=aborts_d)
    prefill.run(rooms, abort_after=aborts_p, send_delay=0.02)
    got_d, got_p = decode.result(), prefill.result()
    assert len(got_d) == len(got_p) == len(rooms)
    for room in aborts_d:
        assert got_d[room]["state"] == "Failed" or got_p[room]["state"] == "Success"
    assert all(r["bytes_ok"] and r["aux_ok"] for r in got_d.values() if r["state"] == "Success")
    untouched = [r for i, r in enumerate(rooms) if i % 3 == 2]
    assert all(got_d[r]["state"] == got_p[r]["state"] == "Success" for r in untouched)
    _nothing_leaked(prefill, decode)


@pytest.mark.timeout(60)
def test_duplicate_live_room_is_rejected(pair):
    prefill, decode = pair
    for peer in (prefill, decode):
        assert peer.call("duplicate").startswith(
            "DuplicateRoomError: bootstrap_room 7 is still live"
        )


@pytest.mark.timeout(150)
def test_killing_prefill_mid_transfer_fails_decode_rooms_within_heartbeat_bound_then_restart(pair):
    _, decode = pair
    decode.reset(
        dict(
            QUICK,
            PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL="0.2",
            PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="2",
        ),
        unset=RESET,
    )
    victim = Peer("prefill", QUICK)
    port = victim.port
    try:
        rooms = {3000 + i: 3 for i in range(8)}
        decode.run(rooms, port=port, timeout=30)
        victim.run(rooms, send_delay=60)  # destinations arrive, KV never sent: rooms stay in flight
        deadline = time.monotonic() + 60
        while (
            decode.call("state")["stats"]["rooms"]["Transferring"] < len(rooms)
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert decode.call("state")["stats"]["rooms"]["Transferring"] == len(rooms)
        victim.kill()
        got = decode.result()
        assert {r["state"] for r in got.values()} == {"Failed"}
        # Failed by the heartbeat check (2 missed heartbeats of 0.2 s), not by the rooms'
        # 30 s transfer timeout: the reason says which bound ended them, no clock needed.
        assert all("missed 2 heartbeats" in r["error"] for r in got.values()), got
    finally:
        victim.kill()
    _nothing_leaked(decode)
    # The prefill comes back on the same port as a new instance: decode serves it at once.
    reborn = Peer("prefill", QUICK, bootstrap_port=port)
    try:
        rooms = {4000 + i: 2 for i in range(4)}
        decode.run(rooms, port=port)
        reborn.run(rooms)
        got_d, got_p = decode.result(), reborn.result()
        assert (
            {r["state"] for r in got_d.values()}
            == {r["state"] for r in got_p.values()}
            == {"Success"}
        )
        assert all(r["bytes_ok"] and r["aux_ok"] for r in got_d.values())
        _nothing_leaked(decode, reborn)
    finally:
        reborn.close()
    decode.call("break_thread")  # a dead background thread makes the manager unhealthy
    deadline = time.monotonic() + 5
    while decode.call("state")["healthy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not decode.call("state")["healthy"]


FAST_HEARTBEAT = dict(
    QUICK,
    PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL="0.2",
    PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="2",
    PDSERVE_DISAGGREGATION_QUARANTINE_BOUND="0.5",
)


# the restart loop's: a live prefill's /health may take longer than 0.2 s twice in a row on
# a loaded 2-core machine (a fresh-clone CI run failed a room that way); four misses of
# 0.3 s still forget a dead peer within seconds
TOLERANT_HEARTBEAT = dict(
    FAST_HEARTBEAT,
    PDSERVE_DISAGGREGATION_HEARTBEAT_INTERVAL="0.3",
    PDSERVE_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="4",
)


def _wait(cond, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(240)
def test_frozen_prefill_resuming_late_cannot_write_into_reused_pages(pair):
    """A prefill frozen (SIGSTOP) after decode sent its destination is declared dead by the
    heartbeat: decode's room fails but its pages stay quarantined (counted, the peer
    reported unhealthy past the bound), so a room of another prefill that takes every
    other page is never touched when the frozen one resumes (SIGCONT) and WRITEs late:
    its bytes equal the baseline, and decode's accounting returns to baseline once the
    frozen prefill ended the room."""
    _, decode = pair
    decode.reset(FAST_HEARTBEAT, unset=RESET)
    frozen, other = Peer("prefill", QUICK, wait=False), Peer("prefill", QUICK, wait=False)
    frozen.wait(), other.wait()
    stopped = False
    try:
        late = {5000: 4}
        decode.run(late, port=frozen.port, timeout=60)
        frozen.run(late, send_delay=1.5, timeout=60)  # WRITEs 1.5 s after the destination
        _wait(lambda: decode.call("state")["stats"]["rooms"]["Transferring"] == 1, "dest")
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        stopped = True
        got = decode.result()[5000]
        assert got["state"] == "Failed" and got.get("quarantined"), got
        assert "missed 2 heartbeats" in got["error"]
        state = decode.call("state")
        assert state["quarantined"] == 1 and state["free_pages"] == state["num_pages"] - 4
        assert state["stats"]["quarantined_pages"] == 4
        _wait(lambda: decode.call("state")["stats"]["unhealthy_prefill_peers"], "unhealthy")
        # every page not quarantined goes to a room of another prefill, kept for a recheck
        busy = {5001: state["num_pages"] - 4}
        decode.run(busy, port=other.port, keep=True, timeout=60)
        other.run(busy, timeout=60)
        assert decode.result()[5001]["bytes_ok"] and other.result()[5001]["state"] == "Success"
        os.kill(frozen.proc.pid, signal.SIGCONT)
        stopped = False
        frozen.result(timeout=60)  # it sent (late) or acknowledged decode's abort
        _wait(lambda: decode.call("state")["quarantined"] == 0, "quarantine released")
        assert decode.call("recheck") is True  # the late WRITE did not touch them
        state = decode.call("state")
        assert state["stats"]["quarantined_pages"] == 0
        assert not state["stats"]["unhealthy_prefill_peers"]
        _nothing_leaked(decode, frozen, other)
    finally:
        if stopped:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        frozen.close()
        other.close()


@pytest.mark.timeout(600)
def test_restart_loop_leaves_remote_agents_and_prepared_lists_flat(fresh):
    """20 restarts of decode against one prefill, then 20 restarts of prefill against one
    decode, a room through each pairing: the survivor's remote agents and prepared
    descriptor lists stay flat (dead or restarted peers are forgotten)."""
    prefill, decode = fresh
    decode.reset(TOLERANT_HEARTBEAT, unset=RESET)

    def one_room(room: int) -> None:
        decode.run({room: 2}, port=prefill.port)
        prefill.run({room: 2}, expect=room % 2 == 0)  # every other room's WRITE made ahead
        got = decode.result() | prefill.result()
        assert {r["state"] for r in got.values()} == {"Success"}, got

    def prefill_agents() -> list[int]:  # remote agents of prefill's two NIXL agents
        stats = prefill.call("state")["stats"]
        return [stats["remote_agents"], stats["notifier_remote_agents"]]

    # Flat means: after each restart the survivor gets back to exactly one remote agent (the
    # live peer) and the same number of prepared lists. Forgetting runs on the survivor's own
    # clock (a ping round a second), so each round waits for it instead of racing it.
    seen = []
    for i in range(20):  # decode restarts; prefill must forget each old decode
        decode.reset(TOLERANT_HEARTBEAT, unset=RESET)
        one_room(7000 + i)
        _wait(lambda: prefill_agents() == [1, 1], "prefill forgets")
        stats = prefill.call("state")["stats"]
        seen.append(
            (
                stats["remote_agents"],
                stats["notifier_remote_agents"],  # its notifier agent forgets them too
                stats["prepared_dlists"],
                stats["premade_writes"],
            )
        )
    assert len(set(seen)) == 1, seen
    seen = []
    for i in range(20):  # prefill restarts (a new port each time); decode forgets the old
        prefill.reset(QUICK, unset=RESET)
        one_room(8000 + i)
        _wait(lambda: decode.call("state")["stats"]["remote_agents"] == 1, "decode forgets")
        stats = decode.call("state")["stats"]
        seen.append((stats["remote_agents"], stats.get("prepared_dlists")))
    assert len(set(seen)) == 1, seen
    _nothing_leaked(prefill, decode)
