"""The engine's disaggregation hooks over loopback managers of the package's fake KV backend
(pdserve/disagg/fake.py: the KV really moves between two engines): PD output equals mixed
output (sampling params, a first token that stops, a second turn moving only its new
pages, eviction pressure, chunked prefill sending each chunk, a prompt over the
compute-ahead cap, a computed prompt that gave its pages back after the compute-ahead
timeout and was computed again), an abort at every step of a PD request; pages back to baseline, every room closed once after a terminal poll.  The
scripted peer: test_disagg_scripted_peer.py; the pair: disagg_pairs.py."""

from __future__ import annotations

import pytest
from disagg_pairs import PROMPT, assert_closed_once_after_terminal, drive, info, pd_pair, rooms

from pdserve.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.disagg.base import KVPoll
from pdserve.disagg.fake import TERMINAL
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("pd_clean")


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
def test_pd_output_equals_mixed_output(pd_cores, params):
    prefill, decode, m = pd_cores
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


def test_first_token_that_stops_ends_both_sides(pd_cores):
    prefill, decode, _ = pd_cores
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


@pytest.mark.parametrize("step_at_abort", range(6))
def test_abort_at_every_step_of_a_pd_request(pd_cores, step_at_abort):
    prefill, decode, m = pd_cores
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


def test_a_second_turn_on_the_same_decode_moves_only_its_new_pages(pd_cores):
    prefill, decode, m = pd_cores
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


def test_pd_under_eviction_pressure_equals_mixed(pd_cores):
    prefill, decode, m = pd_cores
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


@pytest.mark.parametrize(
    "steps_first, chunks",
    # drive() steps prefill before decode: one more chunk runs before the destination
    [(0, [2, 2, 2]), (1, [4, 2]), (2, [6]), (3, [6]), (5, [6])],
)
def test_prefill_computes_before_the_destination_arrives(tiny_model_dir, steps_first, chunks):
    """Prefill computes the prompt while decode's destination is still on its way (decode
    is given its request only after ``steps_first`` prefill steps; three 8-token chunks of
    a 22-token prompt, pages of 4): nothing is sent before it; on arrival every page
    computed so far goes at once (the whole prompt with the aux record if it is done),
    then the rest chunk by chunk; no prompt token is computed twice; decode's output
    equals a mixed engine's; every page comes back."""
    from pdserve.config import SchedulerConfig

    cfg = EngineConfig(
        model=ModelConfig(model=tiny_model_dir("llama"), device="cpu"),
        cache=CacheConfig(page_size=4, num_pages=64, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=8),
    )
    prefill, decode, m = pd_pair(cfg)
    prompt = list(range(600, 622))
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    decode.add_request("mixed", prompt, params)
    want = drive(decode)["mixed"].outputs[0]
    prefill.add_request("p", prompt, params, info("prefill", 78))
    sender = m["p"].handle(78)
    got = {}
    for i in range(steps_first):
        for out in prefill.step():
            got[out.request_id] = out
        computed = min(8 * (i + 1), len(prompt))
        assert prefill.stats()["prompt_tokens_computed"] == computed  # ran before the dest
        assert sender.chunks == [] and sender.num_pages is None  # nothing sent before it
        assert prefill.num_free_pages == 64 - (computed + 3) // 4  # the pages it filled
        assert prefill.stats()["num_waiting_for_peer"] == 1
    if steps_first >= 3:  # computed: out of the batch, its pages held, first token sampled
        assert got["p"].outputs[0].token_ids == [want.token_ids[0]] and not got["p"].finished
        assert prefill.stats()["num_running"] == 0 and prefill.stats()["num_transferring"] == 1
    decode.add_request("d", prompt, params, info("decode", 78))
    got.update(drive(prefill, decode))
    assert [len(c) for c in sender.chunks] == chunks
    assert len(sender.pages_sent) == 6 and sender.aux is not None
    assert prefill.stats()["prompt_tokens_computed"] == len(prompt)  # no recompute
    rest = got["d"].outputs[0]
    assert rest.token_ids == want.token_ids and rest.text == want.text
    assert rest.logprobs == want.logprobs
    assert got["p"].finished and got["p"].outputs[0].finish_reason == "length"
    for core in (prefill, decode):
        assert core.num_free_pages == 64 and not core.has_unfinished_requests()
    assert_closed_once_after_terminal(m.values())


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


def test_over_the_compute_ahead_cap_prefill_waits_for_the_destination_and_equals_mixed(
    tiny_model_dir,
):
    """A cap of 6 pages (0.1 of 64) and two 6-page prompts: the first is computed before
    decode's destination, the second waits for its destination without pages, then is
    computed and sent as before compute-ahead; both decode outputs equal a mixed
    engine's, no prompt token is computed twice and every page comes back."""
    from pdserve.config import SchedulerConfig

    cfg = EngineConfig(
        model=ModelConfig(model=tiny_model_dir("llama"), device="cpu"),
        cache=CacheConfig(page_size=4, num_pages=64, enable_prefix_caching=False),
        scheduler=SchedulerConfig(pd_compute_ahead_fraction=0.1),
    )
    prefill, decode, m = pd_pair(cfg)
    prompts = {"a": list(range(700, 722)), "b": list(range(800, 822))}
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    for rid, prompt in prompts.items():
        decode.add_request("mixed-" + rid, prompt, params)
    want = {k[len("mixed-") :]: v.outputs[0] for k, v in drive(decode).items()}
    room = {"a": next(rooms), "b": next(rooms)}
    for rid, prompt in prompts.items():
        prefill.add_request("p" + rid, prompt, params, info("prefill", room[rid]))
    for _ in range(3):
        prefill.step()
    stats = prefill.stats()
    assert stats["prompt_tokens_computed"] == 22 and stats["pd_ahead_capped"] == 1
    assert stats["pd_ahead_pages"] == 6 and prefill.num_free_pages == 64 - 6
    for rid, prompt in prompts.items():
        decode.add_request("d" + rid, prompt, params, info("decode", room[rid]))
    got = drive(prefill, decode)
    for rid in prompts:
        out = got["d" + rid].outputs[0]
        assert out.token_ids == want[rid].token_ids  # logprobs: the batches differ
        for x, y in zip(out.logprobs, want[rid].logprobs, strict=True):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert got["p" + rid].outputs[0].finish_reason == "length"
    assert prefill.stats()["prompt_tokens_computed"] == 44  # no recompute
    assert prefill.stats()["pd_ahead_pages"] == 0
    for core in (prefill, decode):
        assert core.num_free_pages == 64 and not core.has_unfinished_requests()
    assert_closed_once_after_terminal(m.values())


def test_a_prompt_that_gave_its_pages_back_is_computed_again_and_pd_equals_mixed(
    tiny_model_dir,
):
    """--pd-compute-ahead-timeout 0.3: two prompts (greedy with logprobs and prompt
    logprobs; seeded) computed before decode's destination wait past the bound: they give
    their pages back (kept in the prefix cache), their rooms alive, not failed.  Decode's
    requests come then: each prompt's KV is computed again from its cached pages (2 tokens
    of 22 computed), its first token is the one sampled the first time, the KV moves and
    decode's outputs equal a mixed engine's token for token; prefill reports each prompt
    logprob once."""
    import time

    from pdserve.config import SchedulerConfig

    cfg = EngineConfig(
        model=ModelConfig(model=tiny_model_dir("llama"), device="cpu"),
        cache=CacheConfig(page_size=4, num_pages=64),
        scheduler=SchedulerConfig(pd_compute_ahead_timeout_s=0.3),
    )
    prefill, decode, m = pd_pair(cfg)
    prompts = {"a": list(range(700, 722)), "b": list(range(800, 822))}
    params = {
        "a": SamplingParams(temperature=0, max_tokens=8, logprobs=2, prompt_logprobs=1),
        "b": SamplingParams(temperature=0.9, seed=11, max_tokens=8, logprobs=1),
    }
    for rid, prompt in prompts.items():
        decode.add_request("mixed-" + rid, prompt, params[rid])
    want = {k[len("mixed-") :]: v for k, v in drive(decode).items()}
    decode.kv.reset_cache()  # decode holds none of the prompts: every page moves
    room = {"a": next(rooms), "b": next(rooms)}
    for rid, prompt in prompts.items():
        prefill.add_request("p" + rid, prompt, params[rid], info("prefill", room[rid]))
    first = {o.request_id: o.outputs[0].token_ids for o in prefill.step()}
    assert prefill.stats()["prompt_tokens_computed"] == 44
    assert prefill.num_free_pages == 64 - 12
    time.sleep(0.4)
    assert prefill.step() == []  # past the bound: the pages go back, nobody fails
    stats = prefill.stats()
    assert stats["pd_ahead_expired"] == 2 and stats["num_waiting_for_peer"] == 2
    assert prefill.num_free_pages == 64 and prefill.kv.num_cached_pages == 2 * 5
    for rid in prompts:
        sender = m["p"].handle(room[rid])
        assert not sender.aborted and sender.closes == [] and sender.chunks == []
    for rid, prompt in prompts.items():
        decode.add_request("d" + rid, prompt, params[rid], info("decode", room[rid]))
    got = drive(prefill, decode)
    assert prefill.stats()["prompt_tokens_computed"] == 44 + 2 * 2  # from the cached pages
    for rid in prompts:
        out, ref = got["d" + rid].outputs[0], want[rid].outputs[0]
        assert first["p" + rid] == ref.token_ids[:1]  # sampled once, on the first compute
        assert got["p" + rid].outputs[0].token_ids == ref.token_ids[:1]
        assert out.token_ids == ref.token_ids and out.text == ref.text
        assert out.finish_reason == ref.finish_reason
        for x, y in zip(out.logprobs, ref.logprobs, strict=True):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
        recv = m["d"].handle(room[rid])
        assert recv.skip_pages == 0 and len(recv.dst_pages) == 6
        assert m["p"].handle(room[rid]).closes == recv.closes == [KVPoll.Success]
    lps, ref_lps = got["pa"].prompt_logprobs, want["a"].prompt_logprobs
    assert len(lps) == len(ref_lps) == 22 and lps[0] is None
    for x, y in zip(lps[1:], ref_lps[1:], strict=True):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert prefill.stats()["pd_ahead_pages"] == 0
    for core in (prefill, decode):
        assert core.num_free_pages == 64 and not core.has_unfinished_requests()
    assert_closed_once_after_terminal(m.values())
