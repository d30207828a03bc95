"""Small pieces of pdserve.disagg without NIXL: run_with_deadline, the wire, the registry,
the fake backend, metrics, failure injection."""

from __future__ import annotations

import dataclasses
import threading

import msgspec
import pytest
import torch

from pdserve.disagg import wire
from pdserve.disagg.base import (
    AUX_RECORD_BYTES,
    PROTOCOL_VERSION,
    AuxRecord,
    DuplicateRoomError,
    FailureInjector,
    KVArgs,
    KVLayout,
    KVPoll,
)
from pdserve.disagg.deadline import run_with_deadline
from pdserve.disagg.fake import HISTORY, FakeKVManager, link
from pdserve.disagg.metrics import TransferMetrics
from pdserve.disagg.registry import create_kv_manager

ARGS = KVArgs((0,), (4096,), (512,), 0, 1024, 256, KVLayout("m", "float32", 4, 1, 1, 8))


def test_run_with_deadline_passes_result_and_runs_on_a_helper_thread():
    caller = threading.get_ident()
    result, ident = run_with_deadline(lambda: ("value", threading.get_ident()), 5, "probe")
    assert result == "value" and ident != caller


def test_run_with_deadline_reraises_the_same_exception_object():
    boom = KeyError("x")

    def fail():
        raise boom

    with pytest.raises(KeyError) as info:
        run_with_deadline(fail, 5, "probe")
    assert info.value is boom


@pytest.mark.timeout(10)
def test_run_with_deadline_times_out_naming_what():
    release = threading.Event()
    with pytest.raises(TimeoutError, match="the slow call did not finish within 0.1 s"):
        run_with_deadline(release.wait, 0.1, "the slow call")
    release.set()
    for t in threading.enumerate():
        if t.name == "deadline:the slow call":
            t.join(5)


def test_control_messages_round_trip_and_reject_other_versions():
    msg = wire.RoomDest(
        room=2**63 + 5, prefill_instance="p", decode_instance="d", dst_pages=[3, 1, 2], aux_slot=4
    )
    assert wire.decode_control(wire.encode_control(msg)) == msg
    assert msg.skip_pages == 0  # decode holds no prefix unless it says so
    skip = wire.RoomDest(
        room=5, prefill_instance="p", decode_instance="d", dst_pages=[7], aux_slot=0, skip_pages=3
    )
    assert wire.decode_control(wire.encode_control(skip)).skip_pages == 3
    other = msgspec.msgpack.encode({"v": 99, "msg": {"type": "dest"}})
    with pytest.raises(
        wire.WireError, match=f"protocol_version: ours {PROTOCOL_VERSION} vs theirs 99"
    ):
        wire.decode_control(other)
    with pytest.raises(wire.WireError):
        wire.decode_xfer_done(b"\xff\x00garbage")
    assert wire.decode_xfer_done(wire.encode_xfer_done(7, "p")).room == 7


def test_registry_rejects_unknown_names():
    with pytest.raises(ValueError, match="transfer backend name"):
        create_kv_manager("mooncake", ARGS, "prefill")
    with pytest.raises(ValueError, match="role"):
        create_kv_manager("fake", ARGS, "mixed")


def test_fake_backend_completes_rooms_without_a_peer():
    p = create_kv_manager("fake", ARGS, "prefill")
    d = create_kv_manager("fake", ARGS, "decode")
    s = p.create_sender(5)
    with pytest.raises(DuplicateRoomError):
        p.create_sender(5)
    assert s.poll() == KVPoll.WaitingForInput
    s.init(3, 0)
    s.send([1, 2], last=False)  # a chunk: the room is transferring, not done
    assert s.poll() == KVPoll.Transferring
    with pytest.raises(ValueError, match="aux"):
        s.send([3], last=True)
    s.send([3], last=True, aux=AuxRecord(5, 9, -0.5))
    assert s.poll() == KVPoll.Success
    s.close()
    d.provide_aux(6, AuxRecord(6, 42, -0.25))
    r, r0 = d.create_receiver("h", 1, 6), d.create_receiver("h", 1, 7)
    for rx in (r, r0):
        assert rx.poll() == KVPoll.WaitingForInput
        rx.init([0, 1], 0)
        assert rx.poll() == KVPoll.Success
        rx.close()
    assert r.aux_record() == AuxRecord(6, 42, -0.25) and r0.aux_record() == AuxRecord(7, 0, 0.0)
    assert d.stats()["live_rooms"] == 0 and d.stats()["transfers_succeeded"] == 2
    with pytest.raises(RuntimeError, match="twice"):
        r.close()
    a = p.create_sender(8)
    a.abort()
    assert a.poll() == KVPoll.Failed and "aborted" in str(a.failure_exception())
    a.close()
    assert p.stats()["transfers_failed"] == {"aborted": 1}
    with pytest.raises(ValueError, match="bootstrap_room"):
        p.create_sender(-1)


def test_fake_backend_enforces_the_send_contract_and_remembers_a_bounded_history():
    p = create_kv_manager("fake", ARGS, "prefill")
    s = p.create_sender(1)
    with pytest.raises(RuntimeError, match="before init"):
        s.send([0], last=False)
    s.init(2, 0)
    with pytest.raises(RuntimeError, match="init"):
        s.init(2, 0)  # once only
    with pytest.raises(ValueError, match="3 pages sent of the 2 declared"):
        s.send([0, 1, 2], last=False)
    with pytest.raises(ValueError, match="1 pages sent of the 2 declared"):
        s.send([0], last=True, aux=AuxRecord(1, 0, 0.0))  # the last send completes the prompt
    with pytest.raises(ValueError, match="aux.room"):
        s.send([0, 1], last=True, aux=AuxRecord(2, 0, 0.0))
    s.send([0, 1], last=True, aux=AuxRecord(1, 0, 0.0))
    with pytest.raises(RuntimeError, match="send"):
        s.send([], last=True, aux=AuxRecord(1, 0, 0.0))  # after the last
    assert s.poll() == KVPoll.Success and s.chunks == [[0, 1]] and s.closes == []
    s.close()
    assert s.closes == [KVPoll.Success] and p.handle(1) is s
    for room in range(2, 2 + HISTORY):  # a health probe's manager must not grow forever
        h = p.create_sender(room)
        h.abort()
        h.close()
    assert len(p.handles()) == HISTORY and p.handle(1) is None
    assert p.handle(1 + HISTORY).aborted and p.handle(1 + HISTORY).closes == [KVPoll.Failed]


def test_scripted_fake_rooms_move_only_as_the_test_says():
    aux = torch.zeros(2, AUX_RECORD_BYTES, dtype=torch.uint8)
    args = dataclasses.replace(
        ARGS, aux_data_ptr=aux.data_ptr(), aux_data_len=aux.numel(), aux_item_len=AUX_RECORD_BYTES
    )
    p = FakeKVManager(args, "prefill", scripted=True)
    d = FakeKVManager(args, "decode", scripted=True)
    with pytest.raises(ValueError, match="scripted"):
        link(p, d)
    s, r = p.create_sender(9), d.create_receiver("h", 1, 9)
    assert s.poll() == r.poll() == KVPoll.Bootstrapping
    with pytest.raises(RuntimeError, match="Bootstrapping"):
        s.init(1, 0)
    s.advance(KVPoll.WaitingForInput)
    r.advance(KVPoll.WaitingForInput)
    r.init([5], 1, skip_pages=2)
    assert r.poll() == KVPoll.Transferring and (r.dst_pages, r.aux_slot, r.skip_pages) == (
        [5],
        1,
        2,
    )
    s.init(1, 0)
    rec = AuxRecord(9, 4, -1.0, (4,), (-1.0,))
    s.send([3], last=True, aux=rec)
    assert s.poll() == KVPoll.Transferring and p.read_aux(0) == rec  # its own slot only
    s.abort()  # recorded; the room ends when the test says (a peer may still write)
    assert s.aborted and s.poll() == KVPoll.Transferring
    assert s.fail("peer gone") and s.poll() == KVPoll.Failed
    assert "peer gone" in str(s.failure_exception()) and p.stats()["transfers_failed"]
    with pytest.raises(RuntimeError, match="terminal"):
        s.advance(KVPoll.Success)
    r.advance(KVPoll.Success)
    with pytest.raises(Exception, match="guard"):
        r.aux_record()  # decode's slot was never written: room 0 found there
    d.write_aux(1, rec)
    assert r.aux_record() == rec
    r.raise_on("poll", RuntimeError("backend exploded"))
    with pytest.raises(RuntimeError, match="exploded"):
        r.poll()
    r.raise_on("poll", None)
    assert r.poll() == KVPoll.Success and r.raised == ["poll"]
    with pytest.raises(ValueError, match="method"):
        r.raise_on("close", RuntimeError())
    with pytest.raises(ValueError, match="fail"):
        d.create_receiver("h", 1, 10).advance(KVPoll.Failed)
    with pytest.raises(RuntimeError, match="scripted"):
        create_kv_manager("fake", ARGS, "prefill").create_sender(1).advance(KVPoll.Success)


def test_metrics_histogram_is_cumulative():
    m = TransferMetrics()
    for s in (0.0005, 0.003, 0.003, 400.0):
        m.record_success(100, 2, s)
    m.record_failure("waiting_timeout")
    snap = m.snapshot()
    lat = snap["transfer_latency_seconds"]
    assert (
        lat["buckets"]["0.001"] == 1 and lat["buckets"]["0.005"] == 3 and lat["buckets"]["300"] == 3
    )
    assert lat["buckets"]["+Inf"] == lat["count"] == 4
    assert snap["bytes_transferred"] == 400 and snap["transfers_failed"] == {"waiting_timeout": 1}


def test_failure_injection_probability(monkeypatch):
    inj = FailureInjector(0.2, seed=1)
    hits = sum(inj.roll() for _ in range(5000))
    assert 800 < hits < 1200
    assert not any(FailureInjector().roll() for _ in range(100))  # 0: never
    with pytest.raises(ValueError, match="PDSERVE_TEST_DISAGG_FAILURE_PROB"):
        FailureInjector(1.5)
    # the worker's edge reads it from the environment, and names the variable
    from pdserve.disagg.transfer_config import TransferConfig

    monkeypatch.setenv("PDSERVE_TEST_DISAGG_FAILURE_PROB", "0.2")
    assert TransferConfig.from_env("prefill").failure_prob == 0.2
    monkeypatch.setenv("PDSERVE_TEST_DISAGG_FAILURE_PROB", "1.5")
    with pytest.raises(ValueError, match="PDSERVE_TEST_DISAGG_FAILURE_PROB"):
        TransferConfig.from_env("decode")


@pytest.mark.timeout(180)
def test_bench_transfer_runs_and_checks_the_data(tmp_path):
    """The benchmark command end to end at a tiny size (correctness only, no timing)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "t.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "bench",
            "transfer",
            "--model-shape",
            "smollm2-135m",
            "--prompt-len",
            "64",
            "--page-size",
            "4",
            "--dtype",
            "float32",
            "--repeats",
            "1",
            "--pattern",
            "runs",
            "--kv-order",
            "layer_major",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ratio NIXL / copy" in proc.stdout
    # both processes end cleanly: no thread of ours left inside NIXL at interpreter exit
    # (that aborts with std::terminate's line and exit code 134)
    assert "terminate called" not in proc.stderr + proc.stdout
    result = json.loads(out.read_text())
    assert result["decode_threads_at_exit"] == [] and result["decode_exit_code"] == 0
    assert (
        result["data_checked"] is True
        and result["pages"] == 16
        and result["source_page_runs"] == 16
    )
    assert result["bytes"] == 16 * 60 * 4 * 3 * 64 * 4
    # every page apart (--run-len 1), 60 buffers a page (30 layers x K, V): nothing merges
    assert result["descriptors_posted"] == result["descriptors_merged"] == 16 * 60
    for row in ("nixl", "nixl_decode", "raw_nixl", "copy", "one_page", "one_page_decode"):
        assert result["median_s"][row] > 0, row
    assert result["fixed_cost_s"]["prefill"] == result["median_s"]["one_page"]
    assert result["ratio_to_raw_nixl"] > 0


def test_served_pattern_is_what_the_allocator_hands_out():
    from pdserve.bench.transfer_pages import served_pages
    from pdserve.engine.kv.cache import paired_runs, runs_of

    pages = served_pages(64, 256, seed=3)
    assert len(pages) == len(set(pages)) == 64 and all(0 <= p < 256 for p in pages)
    assert served_pages(64, 256, seed=3) == pages  # deterministic
    assert 1 <= len(runs_of(pages)) < 64  # a busy pool: some runs, far fewer than pages
    assert paired_runs(pages, pages) == len(runs_of(pages))
    assert paired_runs([4, 5, 6], [9, 1, 2]) == 2
