"""The engine's disaggregation hooks over the package's fake KV backend
(pdserve/disagg/fake.py): loopback managers (the KV really moves between two engines: PD
output equals mixed output) and scripted ones (the test plays the peer: prefill and decode
state machines, failures, abort at every state), pages back to baseline, every room
closed once after a terminal poll."""

from __future__ import annotations

import itertools

import pytest

from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.disagg.base import AuxRecord, DuplicateRoomError, KVPoll
from pdserve.disagg.fake import TERMINAL, FakeKVManager, link
from pdserve.engine.disagg_flow import DisaggFlow
from pdserve.engine.engine import EngineCore
from pdserve.engine.request import DisaggRequestInfo
from pdserve.engine.sampling_params import SamplingParams

PROMPT = list(range(300, 322))  # 22 tokens = 6 pages of 4
rooms = itertools.count(1000)


def pd_pair(cfg):
    """(prefill engine, decode engine, managers): "p"/"d" a loopback pair bound as
    ``nixl``, "pm"/"dm" scripted managers bound as ``fake`` (the managers need the
    engines' pools, so they are bound after construction)."""
    prefill, decode = EngineCore(cfg), EngineCore(cfg)
    m = {}
    for core, role, key in ((prefill, "prefill", "p"), (decode, "decode", "d")):
        m[key] = FakeKVManager(core.pool.kv_args(), role)
        m[key + "m"] = FakeKVManager(core.pool.kv_args(), role, scripted=True)
        core.bind_kv_managers({"nixl": m[key], "fake": m[key + "m"]})
    link(m["p"], m["d"])
    return prefill, decode, m


def assert_closed_once_after_terminal(managers, before=frozenset()):
    """Every room (but those of ``before``, ids of handles seen earlier) was closed exactly
    once, after a terminal poll (or after an abort that followed a poll that raised: the
    engine counts that as terminal)."""
    for mgr in managers:
        for h in mgr.handles():
            if id(h) in before:
                continue
            assert len(h.closes) == 1, (h.room, h.closes)
            assert h.closes[0] in TERMINAL or (h.aborted and "poll" in h.raised), h.room


@pytest.fixture(scope="module")
def cores(tiny_model_dir):
    """(prefill engine, decode engine, managers) sharing one tiny Llama."""
    cfg = EngineConfig(
        model=ModelConfig(model=tiny_model_dir("llama"), device="cpu"),
        cache=CacheConfig(page_size=4, num_pages=64),
    )
    return pd_pair(cfg)


@pytest.fixture(autouse=True)
def clean(cores):
    """Every test must leave both engines idle with all pages and aux slots free, and
    every room closed once after a terminal poll."""
    before = frozenset(id(h) for mgr in cores[2].values() for h in mgr.handles())
    yield
    for core in cores[:2]:
        assert core.num_free_pages == 64 and not core.has_unfinished_requests()
        assert core.pool.num_free_aux_slots == core.pool.aux.shape[0]
    assert_closed_once_after_terminal(cores[2].values(), before)


def info(role, room, fake=False):
    return DisaggRequestInfo(
        role=role, bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=room, fake=fake
    )


def drive(*cores, max_steps=200):
    """Step every engine until all are idle; returns the final output of each request id."""
    final = {}
    for _ in range(max_steps):
        for core in cores:
            for out in core.step():
                if out.finished:
                    final[out.request_id] = out
        if not any(c.has_unfinished_requests() for c in cores):
            return final
    raise AssertionError("engines did not become idle")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0.9, seed=7, max_tokens=10, logprobs=1),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=8, min_tokens=4, ignore_eos=True),
        SamplingParams(
            temperature=0,
            max_tokens=12,
            logprobs=2,
            presence_penalty=1.5,
            frequency_penalty=0.7,
            repetition_penalty=1.3,
            logit_bias={5: 3.0, 9: -100},
        ),
        SamplingParams(
            temperature=0.9,
            seed=3,
            max_tokens=12,
            frequency_penalty=1.0,
            repetition_penalty=1.2,
            ignore_eos=True,
        ),
    ],
    ids=[
        "greedy-logprobs",
        "seeded",
        "max_tokens-1",
        "min_tokens",
        "greedy-penalties",
        "seeded-penalties",
    ],
)
def test_pd_output_equals_mixed_output(cores, params):
    prefill, decode, m = cores
    decode.add_request("mixed", PROMPT, params)
    want = drive(decode)["mixed"].outputs[0]
    room = next(rooms)
    decode.add_request("d", PROMPT, params, info("decode", room))
    prefill.add_request("p", PROMPT, params, info("prefill", room))
    got = drive(prefill, decode)
    first, rest = got["p"].outputs[0], got["d"].outputs[0]
    assert first.token_ids == want.token_ids[:1]  # prefill's answer: the first token
    assert rest.token_ids == want.token_ids and rest.text == want.text
    assert rest.finish_reason == want.finish_reason
    assert rest.logprobs == want.logprobs and rest.cumulative_logprob == pytest.approx(
        want.cumulative_logprob
    )
    # decode served the same prompt as "mixed" just before: it holds its first 5 full pages
    # (at most (22 - 1) // 4) and asked prefill for the last one only; the output above
    # shows those held pages are the right KV
    recv = m["d"].handle(room)
    assert got["d"].num_cached_tokens == 20 and recv.skip_pages == 5
    assert len(recv.dst_pages) == 1
    assert 0 <= got["p"].num_cached_tokens < len(PROMPT)
    sender = m["p"].handle(room)
    assert sender.num_pages == 6 and sender.closes == recv.closes == [KVPoll.Success]


def test_first_token_that_stops_ends_both_sides(cores):
    prefill, decode, _ = cores
    decode.add_request("m", PROMPT, SamplingParams(temperature=0, max_tokens=5))
    ref = drive(decode)["m"].outputs[0]
    first, head = ref.token_ids[0], ref.text[:2]  # the text starts with a stop string
    cases = [
        (SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first]), first),
        (SamplingParams(temperature=0, max_tokens=5, stop=[head]), head),
        (SamplingParams(temperature=0, max_tokens=2), None),
    ]
    for params, stop_reason in cases:
        decode.add_request("m", PROMPT, params)
        want = drive(decode)["m"].outputs[0]
        room = next(rooms)
        decode.add_request("d", PROMPT, params, info("decode", room))
        prefill.add_request("p", PROMPT, params, info("prefill", room))
        got = drive(prefill, decode)
        assert got["p"].outputs[0].token_ids == [first]
        c = got["d"].outputs[0]
        assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        )
        if stop_reason is None:
            assert len(c.token_ids) == 2 and c.finish_reason == "length"
        else:  # stopped at once: no text
            assert c.finish_reason == "stop" and c.stop_reason == stop_reason and c.text == ""
        if stop_reason == first:  # prefill saw it too
            assert c.token_ids == [first] and got["p"].outputs[0].finish_reason == "stop"
    assert got["p"].outputs[0].finish_reason == "length"  # prefill's one token, no stop


def test_prefill_state_machine_by_hand(cores):
    prefill, _, m = cores
    room = next(rooms)
    prefill.add_request(
        "p",
        PROMPT,
        SamplingParams(temperature=0, max_tokens=4, logprobs=2),
        info("prefill", room, fake=True),
    )
    sender = m["pm"].handle(room)
    for _ in range(3):  # no pages and no compute before decode's destination is known
        assert prefill.step() == []
    assert prefill.num_free_pages == 64 and sender.num_pages is None
    sender.advance(KVPoll.WaitingForInput)
    outs = prefill.step()  # init, prefill, first token, send
    assert sender.num_pages == 6 and sender.aux is not None
    pages, aux = sender.pages_sent, sender.aux
    assert len(pages) == 6 and aux.room == room and len(aux.top_ids) == 2
    assert m["pm"].read_aux(sender.aux_slot) == aux  # the transfer layer wrote it
    assert outs[0].outputs[0].token_ids == [aux.first_token_id] and not outs[0].finished
    for _ in range(2):  # the transfer layer owns the pages until a terminal poll
        assert prefill.step() == [] and prefill.num_free_pages == 58
    sender.advance(KVPoll.Success)
    outs = prefill.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "length"
    assert prefill.num_free_pages == 64 and sender.closes == [KVPoll.Success]


def test_decode_state_machine_and_bad_aux_guard(cores):
    _, decode, m = cores
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
def test_failures_end_the_request_with_the_message(cores, role, when):
    prefill, decode, m = cores
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
def test_init_that_raises_fails_the_request_and_frees_everything(cores, role):
    prefill, decode, m = cores
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


@pytest.mark.parametrize("step_at_abort", range(6))
def test_abort_at_every_step_of_a_pd_request(cores, step_at_abort):
    prefill, decode, m = cores
    room = next(rooms)
    params = SamplingParams(temperature=0, max_tokens=6)
    decode.add_request("d", PROMPT, params, info("decode", room))
    for _ in range(step_at_abort):
        decode.step()
        if _ == 1:
            prefill.add_request("p", PROMPT, params, info("prefill", room))
        prefill.step()
    decode.abort_request("d")
    prefill.abort_request("p")
    drive(prefill, decode)
    handles = [m["d"].handle(room), m["p"].handle(room)]
    assert (handles[1] is not None) == (step_at_abort > 1)
    for h in handles[: 1 + (step_at_abort > 1)]:
        assert len(h.closes) == 1 and h.closes[0] in TERMINAL


def test_a_second_turn_on_the_same_decode_moves_only_its_new_pages(cores):
    prefill, decode, m = cores
    prefill.kv.reset_cache()
    decode.kv.reset_cache()
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    room = next(rooms)
    decode.add_request("t1", PROMPT, params, info("decode", room))
    prefill.add_request("p1", PROMPT, params, info("prefill", room))
    t1 = drive(prefill, decode)["t1"].outputs[0]
    assert m["d"].handle(room).skip_pages == 0  # nothing held yet: all 6 pages moved
    turn2 = PROMPT + t1.token_ids + list(range(400, 409))  # 37 tokens: 10 pages
    room = next(rooms)
    decode.add_request("t2", turn2, params, info("decode", room))
    prefill.add_request("p2", turn2, params, info("prefill", room))
    got = drive(prefill, decode)
    recv, sender = m["d"].handle(room), m["p"].handle(room)
    # turn 1 left KV for 22 + 5 tokens on decode (its last token's KV is never computed):
    # 6 full pages held; of the 10 prompt pages prefill sends the last 4
    assert recv.skip_pages == 6 and len(recv.dst_pages) == 4 and len(sender.pages_sent) == 10
    assert got["t2"].num_cached_tokens == 24
    assert got["p2"].num_cached_tokens == 20  # prefill had turn 1's prompt: 5 full pages
    prefill.add_request("ref", turn2, params)  # the same prompt, mixed
    want = drive(prefill)["ref"].outputs[0]
    a = got["t2"].outputs[0]
    assert a.token_ids == want.token_ids and a.finish_reason == want.finish_reason
    for x, y in zip(a.logprobs, want.logprobs, strict=True):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_pd_under_eviction_pressure_equals_mixed(cores):
    prefill, decode, m = cores
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=2)
    # 24 prompts of 6 pages sharing 2 full pages: each keeps 3 (prefill) or 4 (decode)
    # pages of its own cached, so 64-page pools must evict to serve them all
    prompts = [PROMPT[:10] + list(range(500 + 20 * i, 512 + 20 * i)) for i in range(24)]
    before = [c.stats()["prefix_cache_evicted_pages"] for c in (prefill, decode)]
    got = []
    for i, prompt in enumerate(prompts):
        room = next(rooms)
        decode.add_request(f"e{i}", prompt, params, info("decode", room))
        prefill.add_request(f"q{i}", prompt, params, info("prefill", room))
        got.append(drive(prefill, decode)[f"e{i}"].outputs[0])
    after = [c.stats()["prefix_cache_evicted_pages"] for c in (prefill, decode)]
    assert all(a > b for a, b in zip(after, before))
    assert m["d"].handle(room).skip_pages == 2  # the shared head survived eviction (LRU)
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"ref{i}", prompt, params)
        want = drive(prefill)[f"ref{i}"].outputs[0]
        assert got[i].token_ids == want.token_ids
        assert got[i].finish_reason == want.finish_reason
        for x, y in zip(got[i].logprobs, want.logprobs, strict=True):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_manager_selection_and_duplicate_rooms(cores):
    prefill, decode, m = cores
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
    no_managers = DisaggFlow(
        prefill.pool, prefill.kv, prefill.scheduler, {}, "nixl", prefill.vocab_size, None
    )
    with pytest.raises(ValueError, match="disagg: this engine has no 'nixl'"):
        no_managers.manager_for(info("prefill", 1))


def test_kv_managers_bound_after_construction_serve_disagg_requests(tiny_model_dir):
    cfg = EngineConfig(
        model=ModelConfig(model=tiny_model_dir("llama"), device="cpu"),
        cache=CacheConfig(page_size=4, num_pages=64),
    )
    core = EngineCore(cfg)  # no managers yet: they need core.pool (its kv_args) first
    with pytest.raises(ValueError, match="disagg"):
        core.add_request(
            "early", PROMPT, SamplingParams(max_tokens=2), info("prefill", 1, fake=True)
        )
    for bad in ({}, {"fake": object()}):
        with pytest.raises(ValueError, match="kv_managers"):
            core.bind_kv_managers(bad)
    manager = FakeKVManager(core.pool.kv_args(), "prefill", scripted=True)
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
        late.bind_kv_managers({"fake": FakeKVManager(late.pool.kv_args(), "prefill")})
    drive(late)
    with pytest.raises(ValueError, match="bound already"):
        EngineCore(cfg, {"fake": manager}).bind_kv_managers({"fake": manager})


def test_chunked_prefill_sends_each_chunk_and_pd_equals_mixed(tiny_model_dir):
    """A prompt spanning three prefill chunks (8-token budget, 22 tokens, pages of 4): the
    sender gets the full pages of chunk 1 and 2 as soon as each is computed, then the rest
    with the aux record; decode's output equals a mixed engine's."""
    from pdserve.config import SchedulerConfig

    def cfg(prefix_caching):
        return EngineConfig(
            model=ModelConfig(model=tiny_model_dir("llama"), device="cpu"),
            cache=CacheConfig(page_size=4, num_pages=64, enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=8),
        )

    prefill, decode, m = pd_pair(cfg(False))
    p_mgr = m["p"]
    prompt = list(range(500, 522))
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    decode.add_request("mixed", prompt, params)
    want = drive(decode)["mixed"].outputs[0]
    decode.add_request("d", prompt, params, info("decode", 77))
    prefill.add_request("p", prompt, params, info("prefill", 77))
    steps_seen = []
    for _ in range(50):
        for core in (prefill, decode):
            for out in core.step():
                if out.finished:
                    steps_seen.append(out)
        sender = p_mgr.handle(77)
        if sender is not None and sender.chunks and sender.aux is None:
            # pages of finished chunks are sent while the prompt is still being computed
            assert prefill.stats()["num_running"] == 1
        if not prefill.has_unfinished_requests() and not decode.has_unfinished_requests():
            break
    got = {o.request_id: o for o in steps_seen}
    sender = p_mgr.handle(77)
    assert [len(c) for c in sender.chunks] == [2, 2, 2]  # 8 tokens, 16 tokens, the rest
    assert len(sender.pages_sent) == 6 and sender.aux is not None
    rest = got["d"].outputs[0]
    assert rest.token_ids == want.token_ids and rest.text == want.text
    assert rest.logprobs == want.logprobs
    for core in (prefill, decode):
        assert core.num_free_pages == 64 and not core.has_unfinished_requests()
    assert_closed_once_after_terminal(m.values())
