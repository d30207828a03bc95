"""Prefill's posting/completion path (pdserve.disagg.nixl.prefill.sender) with a stub NIXL
engine: what is posted where, on which thread, and how decode is told (``XferDone`` by the
notifier agent, never riding on a WRITE). No thread is started (the queued jobs are run by
calling the worker's steps here)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from pdserve.disagg.base import AuxRecord, KVPoll
from pdserve.disagg.nixl.prefill import sender as tw
from pdserve.disagg.wire import decode_xfer_done


class StubEngine:
    """Records posts and notifications; a handle is DONE after ``polls_to_done`` polls."""

    def __init__(self, kv_mem: str = "VRAM", polls_to_done: int = 1, fail_post: bool = False):
        self.kv_mem = kv_mem
        self.page_bytes = 1 << 20
        self.kv_args = SimpleNamespace(device="cpu")
        self.posts: list[tuple] = []
        self.released: list[int] = []
        self.polls: dict[int, int] = {}
        self.polls_to_done = polls_to_done
        self.fail_post = fail_post
        self.threads: set[str] = set()

    def post_room_write(self, remote, src, dst, src_slot=None, dst_slot=None, notif=b""):
        self.threads.add(threading.current_thread().name)
        if self.fail_post:
            raise RuntimeError("post refused")
        self.posts.append((remote.agent_name, list(src), list(dst), notif))
        h = len(self.posts)
        self.polls[h] = 0
        return [h]

    def post(self, h, notif=b""):  # a WRITE made ahead (make_room_write)
        self.threads.add(threading.current_thread().name)
        if self.fail_post:
            raise RuntimeError("post refused")
        self.posts.append(("premade", h, None, notif))
        self.polls[h] = 0

    def state(self, h):
        self.polls[h] += 1
        return "DONE" if self.polls[h] >= self.polls_to_done else "PROC"

    def release(self, h):
        self.released.append(h)

    def send_notif(self, agent, payload):  # never: notifications are the notifier's
        raise AssertionError("a notification from the WRITEs' agent")


class StubNotifier:
    """The notifier agent: records notifications and progress calls."""

    def __init__(self, fail: bool = False) -> None:
        self.notifs: list[tuple[str, bytes]] = []
        self.progressed = 0
        self.fail = fail

    def send_notif(self, agent, payload):
        if self.fail:
            raise RuntimeError("peer gone")
        self.notifs.append((agent, payload))

    def progress(self):
        self.progressed += 1


class StubSender:
    """The part of NixlSender the workers use; ``peers``: decode ranks written."""

    def __init__(self, peers=(0,), rows: int = 1):
        self.room = 42
        self.aux_bytes = b"aux-record"
        self.abort_request = None
        self._targets = [
            (None, SimpleNamespace(engine_rank=r, remote=SimpleNamespace(agent_name=f"d{r}", num_rows=rows)))
            for r in peers
        ]  # fmt: skip
        self.inflight = 0
        self.finished: list[str | None] = []
        self.chunk_errors: list[str | None] = []
        self.state = KVPoll.Transferring

    def targets(self):
        return self._targets

    def writes_aux(self, peer):
        return peer.engine_rank == 0

    def chunk_finished(self, error):
        self.chunk_errors.append(error)
        self.inflight -= 1
        return self.inflight == 0 and error is None

    def transfer_finished(self, error):
        self.finished.append(error)
        ok = error is None and self.abort_request is None
        self.state = KVPoll.Success if ok else KVPoll.Failed

    def poll_state(self):
        return self.state


def _workers(engine, notifier=None) -> tw.TransferWorkers:
    return tw.TransferWorkers(
        engine, "prefill-instance", timeout_s=5.0, notifier=notifier or StubNotifier()
    )


def _drain(workers: tw.TransferWorkers) -> None:
    """Run the queued jobs the way a transfer thread does."""
    while not workers._jobs.empty():
        job = workers._jobs.get()
        if not job.t0:
            workers._post(job)
        workers._poll(job, job.t0 + tw.SPIN_S, spin_only=False)
        workers._finish(job)


def test_one_page_last_send_is_one_write_then_xferdone_by_the_notifier_on_the_caller():
    engine, sender, notifier = StubEngine(), StubSender(), StubNotifier()
    workers = _workers(engine, notifier)
    sender.inflight = 1
    workers.submit(sender, [5], [9], last=True)
    assert engine.posts == [("d0", [5], [9], b"")]  # one KV WRITE, nothing rides on it
    assert len(notifier.notifs) == 1 and notifier.progressed == 1
    agent, payload = notifier.notifs[0]
    done = decode_xfer_done(payload)
    assert agent == "d0"
    assert (done.room, done.prefill_instance, done.aux) == (42, "prefill-instance", b"aux-record")
    assert sender.finished == [None] and engine.released == [1]  # ended inline
    assert workers._jobs.empty()
    assert engine.threads == {threading.current_thread().name}


def test_aux_goes_to_decode_rank_0_only():
    engine, sender, notifier = StubEngine(), StubSender(peers=(0, 1)), StubNotifier()
    workers = _workers(engine, notifier)
    sender.inflight = 1
    workers.submit(sender, [1, 2], [3, 4], last=True)
    auxes = {agent: decode_xfer_done(p).aux for agent, p in notifier.notifs}
    assert auxes == {"d0": b"aux-record", "d1": b""}
    assert [p[3] for p in engine.posts] == [b"", b""]


def test_an_unfinished_inline_write_is_completed_by_a_transfer_thread():
    engine, sender, notifier = StubEngine(polls_to_done=10**9), StubSender(), StubNotifier()
    workers = _workers(engine, notifier)
    sender.inflight = 1
    workers.submit(sender, [5], [9], last=True)
    assert len(engine.posts) == 1 and sender.finished == []  # posted, still running
    assert notifier.notifs == []  # decode is told only once the WRITE is done
    assert not workers._jobs.empty()
    engine.polls_to_done = 0
    _drain(workers)
    assert sender.finished == [None] and len(notifier.notifs) == 1 and len(engine.posts) == 1


def test_with_an_earlier_send_in_flight_xferdone_is_sent_after_every_write():
    engine, sender, notifier = StubEngine(), StubSender(), StubNotifier()
    workers = _workers(engine, notifier)
    sender.inflight = 2  # an earlier chunk is still in flight
    workers.submit(sender, [5], [9], last=True)
    assert engine.posts[0][3] == b""
    assert sender.finished == [] and notifier.notifs == []
    sender.chunk_finished(None)  # ... the earlier chunk ends: nothing to tell yet
    sender.inflight = 1
    workers.submit(sender, [6], [10], last=True)
    assert len(notifier.notifs) == 1 and sender.finished == [None]
    assert decode_xfer_done(notifier.notifs[0][1]).aux == b"aux-record"


def test_a_last_send_without_pages_notifies_alone():
    engine, sender, notifier = StubEngine(), StubSender(), StubNotifier()
    workers = _workers(engine, notifier)
    sender.inflight = 1
    workers.submit(sender, [], [], last=True)
    assert engine.posts == [] and len(notifier.notifs) == 1 and sender.finished == [None]


def test_the_room_ends_before_decode_is_told_and_an_unsent_notification_only_warns(caplog):
    engine, sender, notifier = StubEngine(), StubSender(), StubNotifier()
    workers = _workers(engine, notifier)
    order = []
    real_finished, real_send = sender.transfer_finished, notifier.send_notif
    sender.transfer_finished = lambda e: (order.append("success"), real_finished(e))
    notifier.send_notif = lambda a, p: (order.append("notif"), real_send(a, p))
    sender.inflight = 1
    workers.submit(sender, [5], [9], last=True)
    assert order == ["success", "notif"]
    engine, sender, notifier = StubEngine(), StubSender(), StubNotifier(fail=True)
    sender.inflight = 1
    _workers(engine, notifier).submit(sender, [5], [9], last=True)
    assert sender.finished == [None] and sender.state == KVPoll.Success
    assert "completion notification failed: RuntimeError: peer gone" in caplog.text


def test_decode_is_told_before_the_ended_writes_are_released_unless_one_failed():
    """Releasing a handle NIXL reported DONE is not on decode's path: it follows
    ``XferDone``. After an error every handle is released before the room learns it."""
    engine, sender, notifier = StubEngine(), StubSender(), StubNotifier()
    order: list[str] = []
    real_release, real_send, real_chunk = engine.release, notifier.send_notif, sender.chunk_finished
    engine.release = lambda h: (order.append("release"), real_release(h))
    notifier.send_notif = lambda a, p: (order.append("notif"), real_send(a, p))
    sender.chunk_finished = lambda e: (order.append("room"), real_chunk(e))[1]
    sender.inflight = 1
    _workers(engine, notifier).submit(sender, [5], [9], last=True)
    assert order == ["room", "notif", "release"] and sender.state == KVPoll.Success
    engine.state = lambda h: "ERR"
    order.clear()
    sender.inflight = 1
    _workers(engine, notifier).submit(sender, [5], [9], last=True)
    assert order[:2] == ["release", "room"] and "notif" not in order
    assert sender.chunk_errors[-1] == "NIXL reported ERR for a WRITE"


def test_a_room_that_failed_as_its_writes_ended_sends_no_xferdone():
    engine, sender, notifier = StubEngine(), StubSender(), StubNotifier()
    workers = _workers(engine, notifier)
    sender.inflight = 1
    real = sender.chunk_finished

    def abort_meanwhile(error):  # an abort lands after the WRITEs ended
        done = real(error)
        sender.abort_request = ("aborted", "aborted")
        return done

    sender.chunk_finished = abort_meanwhile
    workers.submit(sender, [5], [9], last=True)
    assert sender.finished == [None] and sender.state == KVPoll.Failed
    assert notifier.notifs == []  # decode hears of it through RoomStatus instead


@pytest.mark.parametrize(
    "kv_mem,pages,rows,inline",
    [
        ("VRAM", 512, 1, True),  # 512 consecutive pages: one descriptor
        ("VRAM", tw.INLINE_MAX_DESCS + 1, 1, False),  # every page apart below
        ("VRAM", 1, tw.INLINE_MAX_DESCS + 1, False),  # head slices: a row per (layer, K|V)
        ("DRAM", 4, 1, True),  # 4 MiB on host memory
        ("DRAM", 5, 1, False),  # the CMA copy would run on the caller
    ],
)
def test_what_is_posted_inline(kv_mem, pages, rows, inline):
    engine, sender = StubEngine(kv_mem=kv_mem), StubSender(rows=rows)
    workers = _workers(engine)
    contiguous = not (kv_mem == "VRAM" and pages == tw.INLINE_MAX_DESCS + 1)
    src = list(range(pages)) if contiguous else list(range(0, 2 * pages, 2))
    sender.inflight = 1
    workers.submit(sender, src, list(range(100, 100 + pages)), last=True)
    assert (len(engine.posts) == 1) is inline
    _drain(workers)
    assert len(engine.posts) == 1 and sender.finished == [None]


def test_a_refused_post_fails_the_send_without_raising_to_the_caller():
    engine, sender, notifier = StubEngine(fail_post=True), StubSender(), StubNotifier()
    workers = _workers(engine, notifier)
    sender.inflight = 1
    workers.submit(sender, [5], [9], last=True)
    assert sender.chunk_errors == ["RuntimeError: post refused"]
    assert sender.finished == [] and notifier.notifs == []


def test_a_write_made_ahead_is_posted_as_made_then_xferdone_and_released():
    engine, sender, notifier = StubEngine(), StubSender(peers=(0, 1)), StubNotifier()
    workers = _workers(engine, notifier)
    sender.inflight = 1
    workers.submit(sender, [5], [9], last=True, premade=tw.Premade({0: "made-0"}))
    kinds = {p[0]: p for p in engine.posts}
    assert set(kinds) == {"premade", "d1"}  # rank 1 had none made: the usual post
    assert kinds["premade"][1] == "made-0" and kinds["premade"][3] == b""
    auxes = {agent: decode_xfer_done(p).aux for agent, p in notifier.notifs}
    assert auxes == {"d0": b"aux-record", "d1": b""}  # rank 0 takes aux
    assert sender.finished == [None]
    assert sorted(map(str, engine.released)) == ["2", "made-0"]


@pytest.mark.parametrize("why", ["abort", "refused"])
def test_a_write_made_ahead_and_never_posted_is_released(why):
    engine, sender = StubEngine(fail_post=why == "refused"), StubSender()
    workers = _workers(engine)
    sender.inflight = 1
    if why == "abort":
        sender.abort_request = ("aborted", "aborted")
    workers.submit(sender, [5], [9], last=True, premade=tw.Premade({0: "made-0"}))
    assert engine.posts == [] and engine.released == ["made-0"]
    assert sender.chunk_errors == [None if why == "abort" else "RuntimeError: post refused"]


def test_merged_runs_counts_pages_consecutive_on_both_sides():
    a = np.asarray
    assert tw.merged_runs(a([], dtype=np.int32), a([], dtype=np.int32)) == 0
    assert tw.merged_runs(a([3]), a([7])) == 1
    assert tw.merged_runs(a([1, 2, 3, 9]), a([5, 6, 7, 8])) == 2
    assert tw.merged_runs(a([1, 2, 3]), a([5, 7, 8])) == 2


class _Agent:
    def __init__(self):
        self.made: list[tuple] = []
        self.posted = 0
        self.notifs: list[bytes] = []

    def make_prepped_xfer(self, op, local, li, remote, ri, notif=b""):
        self.made.append((op, list(li), list(ri), notif))
        return len(self.made)

    def transfer(self, h, notif=b""):
        self.posted += 1
        self.notifs.append(notif)
        return "PROC"

    def release_xfer_handle(self, h):
        pass


def _engine_with_stub_agent():
    from pdserve.disagg.nixl.agent.transfer_engine import NixlTransferEngine

    eng = NixlTransferEngine.__new__(NixlTransferEngine)  # no NIXL: the index/validation part
    eng.agent, eng.num_pages, eng.num_aux_slots = _Agent(), 8, 2
    eng.local_aux = "local-aux"
    eng._lock, eng._made, eng.premade_made, eng.premade_posted = threading.Lock(), set(), 0, 0
    remote = SimpleNamespace(
        num_pages=4, num_rows=1, local_kv="l", kv="r", aux="ra", num_aux_slots=2
    )
    return eng, remote


def test_post_room_write_passes_the_notification_with_the_kv_write_and_checks_ids():
    eng, remote = _engine_with_stub_agent()
    assert eng.post_room_write(remote, [7, 1], [3, 0], notif=b"done") == [1]
    assert eng.agent.made == [("WRITE", [7, 1], [3, 0], b"done")] and eng.agent.posted == 1
    for src, dst, what in (([8], [0], "source"), ([0], [4], "destination"), ([-1], [0], "source")):
        with pytest.raises(ValueError, match=f"{what} page id out of range"):
            eng.post_room_write(remote, src, dst)
    with pytest.raises(ValueError, match="out of range"):
        eng.post_room_write(remote, [2**40], [0])
    with pytest.raises(ValueError, match="page count mismatch"):
        eng.post_room_write(remote, [1, 2], [0])
    with pytest.raises(ValueError, match="rides on a KV WRITE"):
        eng.post_room_write(remote, [], [], notif=b"done")
    assert eng.post_room_write(remote, [], [], 1, 0) == [2]  # the aux slot alone


def test_make_room_write_makes_without_notification_and_post_sets_it():
    eng, remote = _engine_with_stub_agent()
    h = eng.make_room_write(remote, [2, 3], [0, 1])
    assert eng.agent.made == [("WRITE", [2, 3], [0, 1], b"")] and eng.agent.posted == 0
    assert eng.num_premade_writes() == 1
    eng.post(h, b"done")
    assert eng.agent.notifs == [b"done"] and eng.premade_posted == 1
    eng.release(h)
    assert eng.num_premade_writes() == 0
    with pytest.raises(ValueError, match="destination page id out of range"):
        eng.make_room_write(remote, [0], [4])
    with pytest.raises(ValueError, match="needs pages"):
        eng.make_room_write(remote, [], [])
    assert eng.num_premade_writes() == 0


# --- a WRITE made ahead, planned when made (NixlSender._premake -> plan_premade) ---------


class _MakingEngine(StubEngine):
    """A StubEngine that also makes WRITEs ahead (``make_room_write``), for NixlSender."""

    def __init__(self, kv_mem: str = "VRAM") -> None:
        super().__init__(kv_mem=kv_mem)
        self.num_aux_slots = 4
        self.made: list[tuple[str, list[int], list[int]]] = []

    def make_room_write(self, remote, src, dst):
        self.made.append((remote.agent_name, list(src), list(dst)))
        return f"made-{remote.agent_name}"


def _room(planned: bool, monkeypatch, ranks=(0,), skip: int = 0, rows: int = 1):
    """A NixlSender whose destinations (decode ``ranks``, ``skip`` pages held) arrived; its
    sends are recorded, not posted."""
    from pdserve.disagg.base import FailureInjector, RoomTable
    from pdserve.disagg.metrics import TransferMetrics
    from pdserve.disagg.wire import RoomDest
    from pdserve.parallel import TPRank

    monkeypatch.setenv("PDSERVE_DISAGGREGATION_PLANNED_POST", "1" if planned else "0")
    engine, sent = _MakingEngine(), []
    ctx = tw.SenderContext(
        RoomTable("prefill"),
        TransferMetrics(),
        FailureInjector(),
        engine,  # type: ignore[arg-type]
        TPRank(0, 1),
        60.0,
        lambda *a: sent.append(a),
        lambda *a: None,
    )
    s = tw.NixlSender(7, ctx)
    dest = RoomDest(7, "p", "d", [20, 21, 22, 30], 1, skip)
    for r in ranks:
        remote = SimpleNamespace(agent_name=f"d{r}", num_rows=rows, item_lens=(1 << 20,))
        peer = tw.DecodePeer(f"d{r}", b"id", remote, engine_rank=r)  # type: ignore[arg-type]
        s.attach_dest(dest, peer, f"i{r}".encode(), frozenset(ranks))
    return s, engine, sent


@pytest.mark.parametrize("skip", [0, 2])
def test_a_planned_write_made_ahead_brings_what_the_send_would_compute(monkeypatch, skip):
    pages = list(range(4 + skip))
    plans = {}
    for planned in (True, False):
        s, engine, sent = _room(planned, monkeypatch, ranks=(1, 0), skip=skip)
        s.init(len(pages), 0)
        s.expect_pages(pages)
        assert engine.made == [("d0", pages[skip:], [20, 21, 22, 30])] + [
            ("d1", pages[skip:], [20, 21, 22, 30])
        ]
        s.send(pages, last=True, aux=AuxRecord(7, 1, -0.5))
        ((_, src, dst, last, premade),) = sent
        assert last and premade.handles == {0: "made-d0", 1: "made-d1"}
        plans[planned] = (src, dst, premade)
    src, dst, p = plans[True]
    assert src == [] and dst == []  # not computed at the send: the plan has them
    assert p.src.tolist() == plans[False][0] == pages[skip:]
    assert p.dst.tolist() == plans[False][1] == [20, 21, 22, 30]
    assert p.src.dtype == p.dst.dtype == np.int32
    assert p.order == ("made-d0", "made-d1")  # target (decode rank) order
    # 2 runs (21 -> 22 -> 30) x 2 destinations, 8 MiB: inline, and polled
    assert (p.inline, p.spin) == (True, tw.INLINE_SPIN_S)
    assert plans[False][2].src is None and plans[False][2].order == ()


def test_a_send_that_is_not_the_planned_one_drops_the_plan_and_slices_its_pages(monkeypatch):
    s, engine, sent = _room(True, monkeypatch, skip=2)
    s.init(6, 0)
    s.expect_pages([0, 1, 2, 3, 4, 5])
    s.send([0, 1, 2], last=False)  # a chunk: pages 0, 1 decode holds
    s.send([3, 4, 5], last=True, aux=AuxRecord(7, 1, -0.5))
    assert [(a[1], a[2], a[4]) for a in sent] == [
        ([2], [20], None),
        ([3, 4, 5], [21, 22, 30], None),
    ]
    assert engine.released == ["made-d0"] and s.premade is None


@pytest.mark.parametrize(
    "src,dst,rows,kv_mem,want",
    [
        ([1, 2, 3], [7, 8, 9], 1, "VRAM", (True, tw.INLINE_SPIN_S)),
        (list(range(0, 34, 2)), list(range(17)), 1, "VRAM", (False, 0.0)),  # 17 runs
        ([1], [1], tw.INLINE_MAX_DESCS + 1, "VRAM", (False, 0.0)),  # head slices
        ([1, 2, 3, 4], [1, 2, 3, 4], 1, "DRAM", (True, tw.INLINE_SPIN_S)),  # 4 MiB
        ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], 1, "DRAM", (False, 0.0)),
        (list(range(65)), list(range(65)), 1, "VRAM", (True, 0.0)),  # 65 MiB: no spin
    ],
)
def test_post_inline_decides_as_the_module_doc_says(src, dst, rows, kv_mem, want):
    a = lambda x: np.asarray(x, dtype=np.int32)  # noqa: E731
    targets = [SimpleNamespace(num_rows=rows)]
    assert tw.post_inline(a(src), a(dst), targets, 1 << 20, kv_mem == "DRAM") == want


def test_a_planned_write_is_posted_as_planned_without_the_pages_given():
    engine, sender, notifier = StubEngine(), StubSender(peers=(0, 1)), StubNotifier()
    workers = _workers(engine, notifier)
    sender.inflight = 1
    plan = tw.Premade(
        {0: "made-0", 1: "made-1"}, np.asarray([5], np.int32), np.asarray([9], np.int32),
        ("made-0", "made-1"), True, tw.INLINE_SPIN_S,
    )  # fmt: skip
    workers.submit(sender, [], [], last=True, premade=plan)
    assert [p[1] for p in engine.posts] == ["made-0", "made-1"]  # posted inline, in order
    assert sender.finished == [None] and len(notifier.notifs) == 2
    assert sorted(engine.released) == ["made-0", "made-1"]
    queued = tw.Premade(dict(plan.handles), plan.src, plan.dst, plan.order, False, 0.0)
    engine.posts.clear()
    sender.inflight = 1
    workers.submit(sender, [], [], last=True, premade=queued)
    assert engine.posts == []  # a transfer thread posts it
    _drain(workers)
    assert [p[1] for p in engine.posts] == ["made-0", "made-1"]


def test_a_refused_planned_post_releases_what_was_not_posted():
    engine, sender = StubEngine(), StubSender(peers=(0, 1))
    refuse = {"made-1"}

    def post(h, notif=b""):
        if h in refuse:
            raise RuntimeError("post refused")
        engine.posts.append(("premade", h, None, notif))
        engine.polls[h] = 0

    engine.post = post  # type: ignore[method-assign]
    workers = _workers(engine)
    sender.inflight = 1
    a = np.asarray([5], np.int32)
    plan = tw.Premade({0: "made-0", 1: "made-1"}, a, a, ("made-0", "made-1"), True, 0.0)
    workers.submit(sender, [], [], last=True, premade=plan)
    _drain(workers)
    assert [p[1] for p in engine.posts] == ["made-0"]
    assert sender.chunk_errors == ["RuntimeError: post refused"]
    assert sorted(engine.released) == ["made-0", "made-1"]  # the posted one after it ended


def test_a_destination_attached_after_the_plan_takes_the_usual_post(monkeypatch):
    s, engine, sent = _room(True, monkeypatch, ranks=(0,))
    s.init(4, 0)
    s.expect_pages([0, 1, 2, 3])
    assert s.premade is not None and s.premade.order == ("made-d0",)
    from pdserve.disagg.wire import RoomDest

    late = tw.DecodePeer(
        "d1",
        b"id",
        SimpleNamespace(agent_name="d1", num_rows=1),
        engine_rank=1,  # type: ignore[arg-type]
    )
    s.attach_dest(RoomDest(7, "p", "d", [20, 21, 22, 30], 1, 0), late, b"i1", frozenset({0}))
    assert sorted(s.dests) == [0, 1]
    s.send([0, 1, 2, 3], last=True, aux=AuxRecord(7, 1, -0.5))
    ((_, src, dst, _, premade),) = sent
    # unplanned: the send's pages, and the workers post rank 1 the usual way (_post)
    assert premade.src is None and premade.handles == {0: "made-d0"}
    assert src == [0, 1, 2, 3] and dst == [20, 21, 22, 30]
