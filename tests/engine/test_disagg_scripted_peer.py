"""The engine's disaggregation hooks over scripted managers of the package's fake KV backend
(pdserve/disagg/fake.py: the test plays the peer): the prefill and decode state machines
step by step, a bad aux record, failures and aborts at every state, an init that raises,
manager selection and duplicate rooms, managers bound after construction; pages back to
baseline, every room closed once after a terminal poll (the pair: disagg_pairs.py)."""

from __future__ import annotations

import pytest
from disagg_pairs import PROMPT, drive, info, rooms

from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.disagg.base import AuxRecord, DuplicateRoomError, KVPoll
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
