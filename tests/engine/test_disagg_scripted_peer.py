"""The engine's disaggregation hooks over scripted managers of the package's fake KV backend
(pdserve/disagg/fake.py: the test plays the peer): the prefill and decode state machines
step by step, a bad aux record, failures and aborts at every state, an init that raises,
manager selection and duplicate rooms, managers bound after construction, prompts computed
before decode's destination (the cap on their pages, the pages given back after their
timeout and the prompt computed again, an abort); pages back to
baseline, every room closed once after a terminal poll (the pair: disagg_pairs.py)."""

from __future__ import annotations

import time

import pytest
from disagg_pairs import PROMPT, drive, info, rooms

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.disagg.base import BOOTSTRAP_TIMEOUT, AuxRecord, DuplicateRoomError, KVPoll
from pdserve.disagg.fake import FakeKVManager
from pdserve.engine.core.engine import EngineCore
from pdserve.engine.core.pd_flow import PDFlow
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("pd_clean")


def test_prefill_state_machine_by_hand(pd_cores):
    prefill, _, m = pd_cores
    room = next(rooms)
    prefill.add_request(
        "p",
        PROMPT,
        SamplingParams(temperature=0, max_tokens=4, logprobs=2),
        info("prefill", room, fake=True),
    )
    sender = m["pm"].handle(room)
    # the prompt is computed while decode's destination is on its way; nothing is sent
    outs = prefill.step()  # prefill, first token
    first = outs[0].outputs[0].token_ids
    assert len(first) == 1 and not outs[0].finished
    assert prefill.stats()["prompt_tokens_computed"] == len(PROMPT)
    for _ in range(3):  # the computed request holds its pages, waiting for the destination
        assert prefill.step() == []
        assert prefill.num_free_pages == 58 and sender.num_pages is None and sender.chunks == []
        stats = prefill.stats()
        assert stats["num_waiting_for_peer"] == 1 and stats["num_transferring"] == 1
    sender.advance(KVPoll.WaitingForInput)
    assert prefill.step() == []  # init, then the one last send at once: no compute again
    assert prefill.stats()["prompt_tokens_computed"] == len(PROMPT)
    assert sender.num_pages == 6 and sender.aux is not None
    pages, aux = sender.pages_sent, sender.aux
    assert len(sender.chunks) == 1 and len(pages) == 6
    assert aux.room == room and len(aux.top_ids) == 2 and first == [aux.first_token_id]
    assert m["pm"].read_aux(sender.aux_slot) == aux  # the transfer layer wrote it
    assert prefill.stats()["num_waiting_for_peer"] == 0
    for _ in range(2):  # the transfer layer owns the pages until a terminal poll
        assert prefill.step() == [] and prefill.num_free_pages == 58
    sender.advance(KVPoll.Success)
    outs = prefill.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "length"
    assert prefill.num_free_pages == 64 and sender.closes == [KVPoll.Success]


def test_decode_state_machine_and_bad_aux_guard(pd_cores):
    _, decode, m = pd_cores
    decode.kv.reset_cache()  # nothing held: all 6 prompt pages are asked for
    room = next(rooms)
    decode.add_request(
        "d", PROMPT, SamplingParams(temperature=0, max_tokens=4), info("decode", room, fake=True)
    )
    recv = m["dm"].handle(room)
    decode.step()
    assert recv.dst_pages is None and decode.num_free_pages == 64
    recv.advance(KVPoll.WaitingForInput)
    decode.step()
    assert len(recv.dst_pages) == 6 and recv.skip_pages == 0 and decode.num_free_pages == 58
    recv.advance(KVPoll.Transferring)
    assert decode.step() == []
    # the aux slot holds a record of another room: the request fails, nothing leaks
    m["dm"].write_aux(recv.aux_slot, AuxRecord(room + 1, 5, -1.0))
    recv.advance(KVPoll.Success)
    out = decode.step()[0]
    assert out.finished and out.outputs[0].finish_reason == "error" and "room" in out.error
    assert recv.closes == [KVPoll.Success]


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize(
    "when",
    ["bootstrapping", "failed-bootstrapping", "transferring", "failed-transferring", "poll-raises"],
)
def test_failures_end_the_request_with_the_message(pd_cores, role, when):
    prefill, decode, m = pd_cores
    core, mgr = (prefill, m["pm"]) if role == "prefill" else (decode, m["dm"])
    room = next(rooms)
    core.add_request(
        "r", PROMPT, SamplingParams(temperature=0, max_tokens=3), info(role, room, fake=True)
    )
    h = mgr.handle(room)
    if "transferring" in when:
        h.advance(KVPoll.WaitingForInput)
        core.step()
        core.step()
        # prefill: init + send done; decode: init done
        assert (h.aux if role == "prefill" else h.dst_pages) is not None
        h.advance(KVPoll.Transferring)
    if when == "poll-raises":
        h.raise_on("poll", RuntimeError("backend exploded"))
    elif when.startswith("failed"):
        h.fail("peer died: heartbeat missed")
    else:
        h.abort()
        core.abort_request("r")
        assert core.step() == []  # aborted: reported by the caller, drained here
        if "transferring" in when:
            assert core.num_free_pages == 58  # not freed before a terminal poll
        assert h.closes == []
        h.fail("aborted")
        core.step()
        assert h.closes == [KVPoll.Failed]
        return
    out = drive(core)["r"]
    assert out.outputs[0].finish_reason == "error"
    assert ("heartbeat" in out.error) if when.startswith("failed") else ("exploded" in out.error)
    assert len(h.closes) == 1
    if when == "poll-raises":  # counted as terminal: aborted, then closed
        assert h.aborted and h.raised[0] == "poll"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_init_that_raises_fails_the_request_and_frees_everything(pd_cores, role):
    prefill, decode, m = pd_cores
    core, mgr = (prefill, m["pm"]) if role == "prefill" else (decode, m["dm"])
    room = next(rooms)
    core.add_request(
        "r", PROMPT, SamplingParams(temperature=0, max_tokens=3), info(role, room, fake=True)
    )
    h = mgr.handle(room)
    h.raise_on("init", RuntimeError("init refused"))
    h.advance(KVPoll.WaitingForInput)
    out = core.step()[0]
    assert out.finished and out.outputs[0].finish_reason == "error" and "init refused" in out.error
    assert h.aborted and h.closes == []  # drained: closed only after a terminal poll
    h.fail("aborted")
    drive(core)
    assert h.closes == [KVPoll.Failed]


def test_manager_selection_and_duplicate_rooms(pd_cores):
    prefill, decode, m = pd_cores
    with pytest.raises(ValueError, match="disagg.role"):
        prefill.add_request("x", PROMPT, SamplingParams(), info("decode", 1))
    room = next(rooms)
    prefill.add_request("a", PROMPT, SamplingParams(), info("prefill", room, fake=True))
    assert m["pm"].handle(room) is not None and m["p"].handle(room) is None
    with pytest.raises(DuplicateRoomError):
        prefill.add_request("b", PROMPT, SamplingParams(), info("prefill", room, fake=True))
    prefill.abort_request("a")
    m["pm"].handle(room).fail("aborted")
    drive(prefill)
    no_managers = PDFlow(
        prefill.page_ids, prefill.kv, prefill.scheduler, {}, "nixl", prefill.vocab_size
    )
    with pytest.raises(ValueError, match="disagg: this engine has no 'nixl'"):
        no_managers.manager_for(info("prefill", 1))


def test_kv_managers_bound_after_construction_serve_disagg_requests(tiny_model_dir):
    cfg = EngineConfig(
        model=ModelConfig(model=tiny_model_dir("llama"), device="cpu"),
        cache=CacheConfig(page_size=4, num_pages=64),
    )
    core = EngineCore(cfg)  # no managers yet: they need core.executor.kv_args() first
    with pytest.raises(ValueError, match="disagg"):
        core.add_request(
            "early", PROMPT, SamplingParams(max_tokens=2), info("prefill", 1, fake=True)
        )
    for bad in ({}, {"fake": object()}):
        with pytest.raises(ValueError, match="kv_managers"):
            core.bind_kv_managers(bad)
    manager = FakeKVManager(core.executor.kv_args(), "prefill", scripted=True)
    core.bind_kv_managers({"fake": manager})
    with pytest.raises(ValueError, match="bound already"):
        core.bind_kv_managers({"fake": manager})
    core.add_request("p", PROMPT, SamplingParams(max_tokens=2), info("prefill", 7, fake=True))
    sender = manager.handle(7)  # the bound manager made the room's sender
    assert sender is not None and sender.room == 7 and manager.num_live_rooms() == 1
    core.abort_request("p")
    sender.fail("aborted")
    drive(core)
    assert core.num_free_pages == 64 and sender.closes == [KVPoll.Failed]

    late = EngineCore(cfg)
    late.add_request("m", PROMPT, SamplingParams(temperature=0, max_tokens=1))
    with pytest.raises(ValueError, match="before the first request"):
        late.bind_kv_managers({"fake": FakeKVManager(late.executor.kv_args(), "prefill")})
    drive(late)
    with pytest.raises(ValueError, match="bound already"):
        EngineCore(cfg, {"fake": manager}).bind_kv_managers({"fake": manager})


def _prefill_alone(tiny_model_dir, prefix_caching=True, **scheduler):
    """A prefill engine (pool of 64 pages of 4 tokens) over a scripted fake manager bound as
    ``fake`` (the test plays decode), with ``scheduler``'s SchedulerConfig fields."""
    cfg = EngineConfig(
        model=ModelConfig(model=tiny_model_dir("llama"), device="cpu"),
        cache=CacheConfig(page_size=4, num_pages=64, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(**scheduler),
    )
    core = EngineCore(cfg)
    manager = FakeKVManager(core.executor.kv_args(), "prefill", scripted=True)
    core.bind_kv_managers({"fake": manager})
    return core, manager


def _prompt(i: int) -> list[int]:
    return list(range(400 + 30 * i, 422 + 30 * i))  # 22 tokens = 6 pages of 4, no shared page


def test_compute_ahead_cap_holds_later_requests_wait_for_their_destination(tiny_model_dir):
    """A cap of 12 pages (0.2 of 64) and five 6-page prompts whose destination has not come,
    after a 13-page one (over the whole cap: it waits, holding none of them back): two are
    computed ahead, three wait without pages (counted as capped); a waiting one
    whose destination comes is computed then, past the cap; when a computed one's
    destination comes its prompt goes at once and the cap takes the next waiting one, first
    come first served; aborted rooms (nothing sent) give every page back."""
    core, mgr = _prefill_alone(tiny_model_dir, pd_compute_ahead_fraction=0.2)
    params = SamplingParams(temperature=0, max_tokens=4)
    senders = {}
    room = next(rooms)  # first, a prompt larger than the whole cap (13 pages): it waits,
    core.add_request("big", list(range(10, 62)), params, info("prefill", room, fake=True))
    senders["big"] = mgr.handle(room)  # holding no later one back
    for i in range(5):
        room = next(rooms)
        core.add_request(f"c{i}", _prompt(i), params, info("prefill", room, fake=True))
        senders[f"c{i}"] = mgr.handle(room)
    for _ in range(3):
        core.step()
    stats = core.stats()
    assert stats["prompt_tokens_computed"] == 2 * 22  # c0 and c1 only
    assert stats["pd_ahead_pages"] == 12 and stats["pd_ahead_capped"] == 4
    assert core.num_free_pages == 64 - 12
    assert stats["num_waiting_for_peer"] == 6 and stats["num_transferring"] == 2
    assert stats["num_waiting"] == 0 and stats["num_running"] == 0
    assert all(s.num_pages is None and s.chunks == [] for s in senders.values())

    # c3's destination comes: computed now (the old order: destination, then compute),
    # whatever the cap; c2 and c4 still wait
    senders["c3"].advance(KVPoll.WaitingForInput)
    outs = core.step()
    assert [o.request_id for o in outs] == ["c3"] and senders["c3"].aux is not None
    assert core.stats()["prompt_tokens_computed"] == 3 * 22
    assert core.stats()["pd_ahead_pages"] == 12
    senders["c3"].advance(KVPoll.Success)
    assert core.step()[0].finished

    # c0's destination comes: its computed prompt goes at once (one send, no recompute)
    # and c2, the first to wait, is computed ahead in its place; c4 still waits
    senders["c0"].advance(KVPoll.WaitingForInput)
    core.step()
    assert len(senders["c0"].chunks) == 1 and len(senders["c0"].pages_sent) == 6
    stats = core.stats()
    assert stats["prompt_tokens_computed"] == 4 * 22
    assert stats["pd_ahead_pages"] == 12 and stats["pd_ahead_capped"] == 4
    assert senders["c4"].chunks == [] and core.num_free_pages == 64 - 18
    senders["c0"].advance(KVPoll.Success)
    assert core.step()[0].finished

    for rid in ("big", "c1", "c2", "c4"):  # the decode side never comes: the router gives up
        core.abort_request(rid)
        assert senders[rid].aborted and senders[rid].chunks == []
        senders[rid].fail("aborted")
    drive(core)
    stats = core.stats()
    assert core.num_free_pages == 64 and stats["pd_ahead_pages"] == 0
    assert stats["prompt_tokens_computed"] == 4 * 22  # c4 never computed
    assert not core.has_unfinished_requests()
    assert all(
        s.closes == [KVPoll.Failed] or s.closes == [KVPoll.Success] for s in senders.values()
    )


def test_a_computed_prompt_gives_its_pages_back_after_the_ahead_timeout_and_is_not_failed(
    tiny_model_dir,
):
    """--pd-compute-ahead-timeout 0.5: three prompts computed ahead hold their pages while
    they wait; a destination that comes before the bound is served as usual; 0.5 s after
    they were computed the other two give their pages back (their full pages stay in the
    prefix cache) and wait for their destination without pages, their rooms alive, not
    failed, not computed ahead again, holding no later request back; a destination that
    comes then gets the prompt computed again (prefix-cache hits: only the tokens past the
    last full page) and the first token sampled the first time, nothing sampled again; the
    backend's bootstrap timeout still ends one whose destination never comes."""
    core, mgr = _prefill_alone(
        tiny_model_dir, pd_compute_ahead_fraction=0.5, pd_compute_ahead_timeout_s=0.5
    )
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=1)
    senders = {}
    for i in range(3):
        room = next(rooms)
        core.add_request(f"t{i}", _prompt(i), params, info("prefill", room, fake=True))
        senders[f"t{i}"] = mgr.handle(room)
    outs = core.step()  # all three computed in one step (66 tokens < 2048)
    computed = time.perf_counter()
    first = {o.request_id: o.outputs[0].token_ids for o in outs}
    assert sorted(first) == ["t0", "t1", "t2"] and all(len(t) == 1 for t in first.values())
    assert core.num_free_pages == 64 - 18 and core.stats()["pd_ahead_pages"] == 18
    senders["t2"].advance(KVPoll.WaitingForInput)
    assert core.step() == [] and senders["t2"].aux is not None  # sent at once
    assert time.perf_counter() - computed < 0.5, "the host was too slow for this test's bound"
    assert core.stats()["pd_ahead_expired"] == 0 and core.num_free_pages == 64 - 18
    time.sleep(0.6)
    senders["t2"].advance(KVPoll.Success)
    outs = core.step()  # t0 and t1 give their pages back; t2 ends
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("t2", "length")]
    for _ in range(3):  # they wait for their destination without pages; nothing computed
        assert core.step() == []
    stats = core.stats()
    assert stats["pd_ahead_expired"] == 2 and stats["pd_ahead_pages"] == 0
    assert stats["num_waiting_for_peer"] == 2 and stats["num_transferring"] == 0
    assert stats["num_waiting"] == stats["num_running"] == 0
    assert stats["prompt_tokens_computed"] == 3 * 22
    assert core.num_free_pages == 64  # t0's and t1's full pages: cached, evictable
    assert core.kv.num_cached_pages == 3 * 5  # t0, t1 and t2: 5 full pages each
    for rid in ("t0", "t1"):
        s = senders[rid]
        assert not s.aborted and s.closes == [] and s.chunks == [] and s.num_pages is None

    # a later request is computed ahead: the two waiting hold none back
    room = next(rooms)
    core.add_request("t3", _prompt(3), params, info("prefill", room, fake=True))
    senders["t3"] = mgr.handle(room)
    core.step()
    stats = core.stats()
    assert stats["prompt_tokens_computed"] == 4 * 22 and stats["pd_ahead_pages"] == 6

    # t0's destination comes: queued, its prompt computed again from its cached pages (5
    # full pages of 4: 2 tokens left), nothing sampled: the first token of the first time
    senders["t0"].advance(KVPoll.WaitingForInput)
    assert core.step() == []
    s = senders["t0"]
    assert core.stats()["prompt_tokens_computed"] == 4 * 22 + 2
    assert s.num_pages == 6 and len(s.pages_sent) == 6 and s.aux is not None
    assert [s.aux.first_token_id] == first["t0"]
    senders["t0"].advance(KVPoll.Success)
    out = core.step()[0]
    assert out.request_id == "t0" and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == first["t0"] and len(out.outputs[0].logprobs) == 1
    assert s.closes == [KVPoll.Success]

    # t1's destination never comes: the backend's bootstrap timeout (counted from arrival,
    # played here) ends it, as before compute-ahead
    senders["t1"].fail(
        "room: decode's destination did not arrive within 300 s (test)", BOOTSTRAP_TIMEOUT
    )
    core.abort_request("t3")
    senders["t3"].fail("aborted")
    got = drive(core)
    assert got["t1"].outputs[0].finish_reason == "error" and "300 s (test)" in got["t1"].error
    assert senders["t1"].closes == [KVPoll.Failed] and senders["t1"].chunks == []
    stats = core.stats()
    assert stats["pd_ahead_expired"] == 2 and stats["pd_ahead_pages"] == 0
    assert core.num_free_pages == 64 and not core.has_unfinished_requests()
    assert mgr.stats()["transfers_failed"]["bootstrap_timeout"] == 1


def test_a_prompt_computed_again_in_chunks_sends_each_chunk_then_the_first_aux(
    tiny_model_dir,
):
    """No prefix cache and chunks of 8 tokens: a 22-token prompt computed ahead gives its
    pages back after the bound (0.3 s), then, its destination come, is computed again in
    three chunks: the first two send the pages they filled, the last the rest with the aux
    record of the first compute; nothing is sampled again."""
    core, mgr = _prefill_alone(
        tiny_model_dir,
        prefix_caching=False,
        max_num_batched_tokens=8,
        pd_compute_ahead_timeout_s=0.3,
    )
    room = next(rooms)
    core.add_request(
        "c", _prompt(0), SamplingParams(temperature=0, max_tokens=4), info("prefill", room, True)
    )
    sender = mgr.handle(room)
    outs = drive_until(core, lambda: core.stats()["num_transferring"] == 1)
    first = [o for o in outs if o.request_id == "c"][-1].outputs[0].token_ids
    assert len(first) == 1 and core.stats()["prompt_tokens_computed"] == 22
    time.sleep(0.35)
    assert core.step() == [] and core.num_free_pages == 64 and sender.chunks == []
    assert core.stats()["pd_ahead_expired"] == 1
    sender.advance(KVPoll.WaitingForInput)
    for want in (2, 4):  # chunks of 8 tokens: 2 more full pages each
        assert core.step() == []
        assert len(sender.pages_sent) == want and sender.aux is None
    assert core.step() == []
    assert [len(c) for c in sender.chunks] == [2, 2, 2] and sender.num_pages == 6
    assert sender.aux is not None and [sender.aux.first_token_id] == first
    assert core.stats()["prompt_tokens_computed"] == 44
    sender.advance(KVPoll.Success)
    out = core.step()[0]
    assert out.finished and out.outputs[0].token_ids == first
    assert core.num_free_pages == 64 and not core.has_unfinished_requests()


def drive_until(core, done, max_steps=20):
    """Step ``core`` until ``done()``; returns every output on the way."""
    outs = []
    for _ in range(max_steps):
        outs += core.step()
        if done():
            return outs
    raise AssertionError("the condition was not reached")


def test_an_abort_frees_a_computed_room_s_pages_at_the_next_step(pd_cores):
    """A prompt computed ahead, its destination not come (loopback manager: an abort
    fails the room at once): the router's abort gives its pages back at the next step,
    long before any timeout; nothing was sent."""
    prefill, _, m = pd_cores
    room = next(rooms)
    prefill.add_request(
        "a", PROMPT, SamplingParams(temperature=0, max_tokens=4), info("prefill", room)
    )
    outs = prefill.step()
    assert outs[0].request_id == "a" and not outs[0].finished
    assert prefill.num_free_pages == 58 and prefill.stats()["num_transferring"] == 1
    prefill.abort_request("a")
    prefill.step()
    sender = m["p"].handle(room)
    assert sender.aborted and sender.chunks == [] and sender.closes == [KVPoll.Failed]
    assert prefill.num_free_pages == 64 and prefill.stats()["pd_ahead_pages"] == 0
    assert not prefill.has_unfinished_requests()
