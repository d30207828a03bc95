"""Per-rank KV transfer over real NIXL (UCX, CPU memory), one process: ``p`` prefill and
``d`` decode managers, each over a page-major pool of its rank's KV heads (cut from one
full reference pool), rooms driven rank by rank as the TP facade drives them. After the
transfer every decode rank's pages equal the reference's head slice of the prompt's
pages, the aux record is at decode rank 0, and nothing is left live.

When NIXL cannot be used here these tests fail with the probe's reason (never skip).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from pdserve.disagg.base import AUX_RECORD_BYTES, AuxRecord, KVPoll
from pdserve.disagg.bootstrap import is_writer, reads_from, writes_into
from pdserve.disagg.nixl.probe import nixl_problem
from pdserve.disagg.transfer_config import BootstrapAddress, TransferConfig
from pdserve.engine.kv.layout import KVCacheLayout
from pdserve.parallel import TPRank, kv_head_range

L, D, PS, P = 2, 8, 4, 24
TERMINAL = (KVPoll.Success, KVPoll.Failed)


class RankPool:
    """A rank's pool: the reference's heads ``kv_head_range(H, tp)`` (zeros on decode)."""

    def __init__(self, full: torch.Tensor, tp: TPRank, order: str, fill: bool) -> None:
        total = full.shape[3]
        start, end = kv_head_range(total, tp)
        self.layout = KVCacheLayout(order, L, end - start, D, PS, P, torch.float32)
        self.kv = self.layout.allocate("cpu")
        if fill:  # page-major reference [P, L, 2, H, ps, D] -> this rank's heads, this order
            part = full[:, :, :, start:end]
            if order == "layer_major":  # [L, 2, P, ps, H, D]
                part = part.permute(1, 2, 0, 4, 3, 5)
            self.kv.copy_(part)
        self.aux = torch.zeros(4, AUX_RECORD_BYTES, dtype=torch.uint8)
        self.args = self.layout.kv_args(
            self.kv,
            self.aux.data_ptr(),
            self.aux.numel(),
            self.layout.fingerprint("tp-test", total),
            engine_rank=tp.rank,
            tp_size=tp.size,
        )

    def page_major_pages(self, pages: list[int]) -> torch.Tensor:
        """``[n, L, 2, H_local, ps, D]`` of ``pages``, whatever the pool's order."""
        got = self.layout.pages(self.kv, pages)
        if self.layout.order == "layer_major":  # [L, 2, n, ps, H, D]
            got = got.permute(2, 0, 1, 4, 3, 5)
        return got


def _managers(p: int, d: int, full: torch.Tensor, order: str = "page_major", **settings):
    """``settings``: TransferConfig fields that differ from the defaults (both sides)."""
    from pdserve.disagg.registry import create_kv_manager

    pre = [RankPool(full, TPRank(r, p), order, True) for r in range(p)]
    dec = [RankPool(full, TPRank(s, d), order, False) for s in range(d)]
    p_cfg = replace(TransferConfig.from_env("prefill"), **settings)
    d_cfg = replace(TransferConfig.from_env("decode"), **settings)
    pm = [create_kv_manager("nixl", pre[0].args, "prefill", p_cfg)]
    port = pm[0].bootstrap_port
    assert port
    rank0 = replace(p_cfg, bootstrap=BootstrapAddress(port=port))
    pm += [create_kv_manager("nixl", pool.args, "prefill", rank0) for pool in pre[1:]]
    dm = [create_kv_manager("nixl", pool.args, "decode", d_cfg) for pool in dec]
    return pre, dec, pm, dm, port


def _until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def _run_rooms(pm, dm, port, rooms: dict[int, tuple[list[int], list[int]]], total, chunk):
    """Drive each room on every rank: receivers on every decode rank, senders on the
    prefill ranks that write; ``chunk`` pages per non-last send. Returns the handles."""
    p = len(pm)
    out = {}
    for room in rooms:
        recv = [m.create_receiver("127.0.0.1", port, room) for m in dm]
        send = {r: pm[r].create_sender(room) for r in range(p) if is_writer(total, TPRank(r, p))}
        out[room] = (send, recv)
    for slot, (room, (src, dst)) in enumerate(rooms.items()):
        send, recv = out[room]
        _until(lambda hs=recv: all(h.poll() >= KVPoll.WaitingForInput for h in hs), "bootstrap")
        for h in recv:
            h.init(dst, slot)
        _until(lambda hs=send: all(h.poll() >= KVPoll.WaitingForInput for h in hs.values()), "dest")
        aux = AuxRecord(room, 7 + room % 5, -0.25, (3, 4), (-0.25, -1.5))
        for h in send.values():
            h.init(len(src), 3 - slot)
            for i in range(0, len(src) - chunk, chunk):
                h.send(src[i : i + chunk], last=False)
            last = (len(src) - 1) // chunk * chunk if chunk < len(src) else 0
            h.send(src[last:], last=True, aux=aux)
    for send, recv in out.values():
        hs = [*send.values(), *recv]
        _until(lambda hs=hs: all(h.poll() in TERMINAL for h in hs), "terminal state")
    return out


def _close(out) -> None:
    for send, recv in out.values():
        for h in [*send.values(), *recv]:
            h.close()


@pytest.fixture(scope="module")
def nixl_ok():
    problem = nixl_problem()
    if problem:
        pytest.fail(problem)  # fail, never skip


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "p,d,heads",
    [(1, 2, 4), (2, 1, 4), (2, 2, 4), (4, 2, 2), (2, 4, 2)],
    ids=["p1d2", "p2d1", "p2d2", "p4d2-prefill-replicas", "p2d4-decode-replicas"],
)
def test_each_decode_rank_gets_its_head_slices_byte_exact(nixl_ok, p, d, heads):
    g = torch.Generator().manual_seed(p * 10 + d)
    full = torch.randn(P, L, 2, heads, PS, D, generator=g)
    pre, dec, pm, dm, port = _managers(p, d, full)
    try:
        rooms = {  # src pages on prefill -> dst pages on decode (scattered, some runs)
            101: ([0, 1, 2, 3, 4], [10, 11, 12, 5, 6]),
            102: ([7, 9, 8], [20, 22, 21]),
            103: ([15], [3]),
        }
        out = _run_rooms(pm, dm, port, rooms, heads, chunk=2)
        for room, (send, recv) in out.items():
            states = [h.poll() for h in [*send.values(), *recv]]
            errors = [str(h.failure_exception()) for h in [*send.values(), *recv]]
            assert set(states) == {KVPoll.Success}, errors
            src, dst = rooms[room]
            for s, pool in enumerate(dec):
                start, end = kv_head_range(heads, TPRank(s, d))
                want = full[src][:, :, :, start:end]
                assert torch.equal(pool.page_major_pages(dst), want), (room, s)
            assert recv[0].aux_record().room == room
            assert recv[0].aux_record().first_token_id == 7 + room % 5
        # pages no room listed were not touched on any decode rank
        used = {pg for _, dst in rooms.values() for pg in dst}
        for pool in dec:
            rest = [pg for pg in range(P) if pg not in used]
            assert not pool.page_major_pages(rest).any()
        # every decode rank hears from exactly its writers: one notification each
        writers = [len(writes_into(heads, p, TPRank(s, d))) for s in range(d)]
        assert sum(len(reads_from(heads, TPRank(r, p), d)) for r in range(p)) == sum(writers)
        _close(out)
        _until(
            lambda: all(m.num_live_rooms() == 0 for m in [*pm, *dm]),
            "rooms released",  # type: ignore[attr-defined]
        )
        assert all(m.is_healthy() for m in [*pm, *dm])
        assert sum(m.stats()["transfers_succeeded"] for m in dm) == len(rooms) * d
    finally:
        for m in [*dm, *pm]:
            m.shutdown()


@pytest.mark.timeout(120)
def test_layer_major_with_different_tp_fails_at_bootstrap_naming_kv_order(nixl_ok):
    full = torch.randn(P, L, 2, 4, PS, D, generator=torch.Generator().manual_seed(5))
    pre, dec, pm, dm, port = _managers(2, 1, full, order="layer_major")
    try:
        room = 301
        recv = dm[0].create_receiver("127.0.0.1", port, room)
        send = [m.create_sender(room) for m in pm]
        _until(lambda: recv.poll() in TERMINAL, "decode fails")
        assert recv.poll() == KVPoll.Failed
        assert "kv_order" in str(recv.failure_exception())
        # prefill's senders are told (decode aborts them): they fail fast too, not at the
        # bootstrap timeout
        _until(lambda: all(s.poll() in TERMINAL for s in send), "prefill fails")
        assert all("kv_order" in str(s.failure_exception()) for s in send)
        for h in [recv, *send]:
            h.close()
    finally:
        for m in [*dm, *pm]:
            m.shutdown()


@pytest.mark.timeout(120)
def test_layer_major_with_equal_tp_moves_whole_pages(nixl_ok):
    """Equal head ranges need no split: a layer-major TP-2 pair keeps working."""
    full = torch.randn(P, L, 2, 4, PS, D, generator=torch.Generator().manual_seed(6))
    pre, dec, pm, dm, port = _managers(2, 2, full, order="layer_major")
    try:
        rooms = {401: ([1, 2, 3], [4, 5, 6])}
        out = _run_rooms(pm, dm, port, rooms, 4, chunk=8)
        send, recv = out[401]
        assert {h.poll() for h in [*send.values(), *recv]} == {KVPoll.Success}
        for s, pool in enumerate(dec):
            start, end = kv_head_range(4, TPRank(s, 2))
            assert torch.equal(
                pool.page_major_pages([4, 5, 6]), full[[1, 2, 3]][:, :, :, start:end]
            )
        _close(out)
    finally:
        for m in [*dm, *pm]:
            m.shutdown()


@pytest.mark.timeout(120)
def test_a_deregistered_prefill_rank_fails_decode_rooms_through_the_heartbeat(nixl_ok):
    """Prefill TP 2 -> decode TP 1: destinations went out, prefill rank 1's process "dies"
    (rank 0 deregisters it, as the TP facade does once the executor failed; its manager is
    left silent, as a killed process is). Decode's next
    heartbeat finds rank 1 missing from ``/health``: the room fails naming it, rank 0 is
    told (its sender fails too), and no page stays quarantined (a gone rank cannot write)."""
    full = torch.randn(P, L, 2, 4, PS, D, generator=torch.Generator().manual_seed(9))
    pre, dec, pm, dm, port = _managers(2, 1, full, heartbeat_interval_s=0.2)
    try:
        room = 501
        recv = dm[0].create_receiver("127.0.0.1", port, room)
        send = [m.create_sender(room) for m in pm]
        _until(lambda: recv.poll() >= KVPoll.WaitingForInput, "bootstrap")
        recv.init([1, 2], 0)
        _until(lambda: all(s.poll() == KVPoll.WaitingForInput for s in send), "destinations")
        pm[0].forget_rank(1)
        _until(lambda: recv.poll() in TERMINAL, "decode fails")
        assert recv.poll() == KVPoll.Failed
        assert "rank 1 is gone" in str(recv.failure_exception())
        assert not recv.holds_pages()
        _until(lambda: send[0].poll() in TERMINAL, "prefill rank 0 is told")
        assert send[0].poll() == KVPoll.Failed
        for h in (recv, *send):
            h.close()
    finally:
        for m in [*dm, *pm]:
            m.shutdown()


@pytest.mark.timeout(120)
def test_every_decode_ranks_destination_before_the_room_is_created_is_kept(nixl_ok):
    """The router sends to both workers at once, so under load every rank of a TP-2 decode
    can send its destination before prefill's engine creates the room: prefill keeps each
    rank's (not the last one only) and the transfer completes on both ranks."""
    heads, room, src, dst = 4, 301, [0, 1, 2], [7, 8, 9]
    full = torch.randn(P, L, 2, heads, PS, D, generator=torch.Generator().manual_seed(3))
    pre, dec, pm, dm, port = _managers(1, 2, full)
    try:
        recv = [m.create_receiver("127.0.0.1", port, room) for m in dm]
        _until(lambda: all(h.poll() >= KVPoll.WaitingForInput for h in recv), "bootstrap")
        for h in recv:
            h.init(dst, 0)
        _until(
            lambda: pm[0].stats()["early_dests"] == 2, "both ranks early destinations", timeout=15
        )
        send = pm[0].create_sender(room)
        assert pm[0].stats()["early_dests"] == 0
        _until(lambda: send.poll() >= KVPoll.WaitingForInput, "destinations attached")
        send.init(len(src), 0)
        send.send(src, last=True, aux=AuxRecord(room, 5, -0.5, (3,), (-0.5,)))
        _until(lambda: all(h.poll() in TERMINAL for h in [send, *recv]), "terminal state")
        assert [h.poll() for h in [send, *recv]] == [KVPoll.Success] * 3
        for s, pool in enumerate(dec):
            start, end = kv_head_range(heads, TPRank(s, 2))
            assert torch.equal(pool.page_major_pages(dst), full[src][:, :, :, start:end])
        _close({room: ({0: send}, recv)})
    finally:
        for m in [*dm, *pm]:
            m.shutdown()
