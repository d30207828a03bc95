"""Router pieces without a network: policies, prompt-logprob merging, room reservation,
RouterConfig validation."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.config import RouterConfig
from pdserve.disagg.base import ROOM_LIMIT, check_room, rooms_needed, sample_room
from pdserve.http.http_errors import error_json, error_status
from pdserve.router.answer_merge import merge_prompt_logprobs
from pdserve.router.pd_pair import LiveRooms
from pdserve.router.request_facts import num_samples
from pdserve.router.workers import WorkerState, _block_keys, create_policy, routing_key


def _workers(n: int) -> list[WorkerState]:
    return [WorkerState(f"http://w{i}", "mixed", healthy=True) for i in range(n)]


def test_round_robin_cycles_in_order():
    ws = _workers(3)
    policy = create_policy("round_robin")
    assert [policy.pick(ws).url for _ in range(6)] == ["http://w0", "http://w1", "http://w2"] * 2


def test_power_of_two_prefers_fewer_outstanding():
    ws = _workers(2)
    ws[0].outstanding, ws[1].outstanding = 5, 1
    policy = create_policy("power_of_two", random.Random(0))
    assert all(policy.pick(ws) is ws[1] for _ in range(20))
    ws3 = _workers(3)
    ws3[0].outstanding = 100
    picks = [create_policy("power_of_two", random.Random(s)).pick(ws3) for s in range(50)]
    assert ws3[0] not in picks  # never chosen against a less loaded second pick


def test_random_policy_covers_all_and_unknown_policy_rejected():
    ws = _workers(3)
    policy = create_policy("random", random.Random(1))
    assert {policy.pick(ws).url for _ in range(60)} == {w.url for w in ws}
    with pytest.raises(ValueError, match="policy"):
        create_policy("least_cache")


SYSTEM = [f"You are agent {g}. " * 40 for g in range(4)]  # 4 long shared prefixes


def test_cache_aware_sends_a_shared_prefix_to_one_worker_and_spreads_the_groups():
    ws = _workers(3)
    policy = create_policy("cache_aware", random.Random(0))
    chosen: dict[int, set[str]] = {g: set() for g in range(4)}
    for i in range(40):
        g = i % 4
        chosen[g].add(policy.pick(ws, SYSTEM[g] + f"question {i}").url)
    assert all(len(urls) == 1 for urls in chosen.values())  # each group sticks
    assert len({u for urls in chosen.values() for u in urls}) == 3  # new prefixes spread


def test_cache_aware_follows_a_growing_conversation():
    ws = _workers(2)
    policy = create_policy("cache_aware", random.Random(0))
    chat = [{"role": "system", "content": SYSTEM[0]}, {"role": "user", "content": "hi"}]
    first = policy.pick(ws, routing_key("/v1/chat/completions", {"messages": chat}))
    policy.pick(ws, "something else entirely " * 30)  # another conversation elsewhere
    chat += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    again = policy.pick(ws, routing_key("/v1/chat/completions", {"messages": chat}))
    assert again is first


def test_cache_aware_balances_load_when_out_of_balance():
    ws = _workers(2)
    policy = create_policy("cache_aware", random.Random(0))
    hot = policy.pick(ws, SYSTEM[0])
    hot.outstanding = 40  # > 32 more than the other: the load threshold wins over the cache
    assert policy.pick(ws, SYSTEM[1]) is not hot
    hot.outstanding = 10  # within the threshold: the cache wins
    assert policy.pick(ws, SYSTEM[0] + "y") is hot


def test_cache_aware_forgets_a_removed_worker():
    """A worker removed from the pool leaves the index; added again at the same URL it
    starts with an empty index (its cache is gone)."""
    import asyncio

    import httpx

    from pdserve.router.workers import WorkerPool

    async def scenario() -> None:
        async with httpx.AsyncClient() as client:
            pool = WorkerPool(
                {"mixed": ["http://w0", "http://w1"]},
                policy="cache_aware",
                client=client,
                check_interval=60.0,
                check_timeout=1.0,
                failure_threshold=1,
            )
            for w in pool.all():
                w.healthy = True
            policy = pool._policies["mixed"]
            hot = pool.pick("mixed", SYSTEM[0])
            other = next(w for w in pool.all() if w is not hot)
            pool.pick("mixed", SYSTEM[1])  # the other group: the worker with no index
            assert policy.indexed_urls() == {hot.url, other.url}
            assert await pool.drain(hot)
            assert policy.indexed_urls() == {other.url} and pool.find(hot.url) is None
            back = WorkerState(hot.url, "mixed", healthy=True)  # restarted, cache empty
            pool.workers["mixed"].append(back)
            assert policy.matched_blocks(back, _block_keys(SYSTEM[0], policy.block_chars)) == 0
            # a new prefix goes to the worker with the smallest index: the empty one
            assert pool.pick("mixed", SYSTEM[2]) is back

    asyncio.run(scenario())


def test_routing_key_per_endpoint():
    assert routing_key("/generate", {"text": "abc"}) == "abc"
    assert routing_key("/generate", {"input_ids": [1, 2, 3]}) == "1 2 3"
    assert routing_key("/v1/completions", {"prompt": ["p1", "p2"]}) == "p1"
    assert routing_key("/v1/completions", {"prompt": [[5, 6], [7]]}) == "5 6"
    assert routing_key("/v1/completions", {}) is None
    key = routing_key(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hey"}]}]},
    )
    assert key is not None and "hey" in key and "user" in key


def test_merge_generate_and_openai():
    decode = {
        "text": "d",
        "meta_info": {"input_token_logprobs": None, "output_token_logprobs": [[-1, 5, None]]},
    }
    prefill = {
        "text": "p",
        "meta_info": {
            "input_token_logprobs": [[None, 1, None]],
            "input_top_logprobs": [None],
            "output_token_logprobs": [[-9, 9, None]],
        },
    }
    merged = merge_prompt_logprobs("/generate", decode, prefill)
    assert merged["meta_info"] == {
        "input_token_logprobs": [[None, 1, None]],
        "input_top_logprobs": [None],
        "output_token_logprobs": [[-1, 5, None]],
    }
    many_d = [{"index": i, "meta_info": {}} for i in range(2)]
    many_p = [
        {"index": i, "meta_info": {"input_token_logprobs": [[None, i, None]]}} for i in range(2)
    ]
    assert [
        m["meta_info"]["input_token_logprobs"][0][1]
        for m in merge_prompt_logprobs("/generate", many_d, many_p)
    ] == [0, 1]

    dec = {
        "choices": [{"index": 0, "prompt_logprobs": None}, {"index": 1, "prompt_logprobs": None}]
    }
    pre = {
        "choices": [
            {"index": 0, "prompt_logprobs": [None, {"a": 1}]},
            {"index": 1, "prompt_logprobs": [None]},
        ]
    }
    done: set[int] = set()
    merge_prompt_logprobs("/v1/completions", dec, pre, done)
    assert dec["choices"][0]["prompt_logprobs"] == [None, {"a": 1}] and done == {0, 1}
    later = {"choices": [{"index": 0, "text": "x"}]}
    assert (
        "prompt_logprobs"
        not in merge_prompt_logprobs("/v1/completions", later, pre, done)["choices"][0]
    )
    untouched = {"choices": [{"index": 0, "prompt_logprobs": None}]}
    assert (
        merge_prompt_logprobs("/v1/completions", untouched, {"choices": [{"index": 0}]})
        == untouched
    )


def test_rooms_are_unique_63_bit_and_cover_n_samples():
    class Rng(random.Random):
        """Draws the same room twice first, to exercise the collision check."""

        calls = 0

        def randrange(self, a, b):
            Rng.calls += 1
            return 42 if Rng.calls <= 2 else 1000

    d = LiveRooms(set(), Rng())
    first = d.reserve(3)
    second = d.reserve(3)
    assert first == 42 and second == 1000 and d.live == {42, 43, 44, 1000, 1001, 1002}
    d.release(first, 3)
    assert d.live == {1000, 1001, 1002}
    real = LiveRooms(set())
    rooms = [real.reserve(5) for _ in range(200)]
    assert all(r >= 0 and r + 5 <= ROOM_LIMIT for r in rooms) and len(real.live) == 1000


def test_room_plan_numbers_sample_i_of_prompt_p_after_the_p_prompts_before_it():
    n, prompts, room = 3, 2, 100
    rooms = [sample_room(room, p, n, i) for p in range(prompts) for i in range(n)]
    assert rooms == list(range(room, room + rooms_needed(prompts, n)))
    assert check_room(ROOM_LIMIT - 1) == ROOM_LIMIT - 1 and check_room(0) == 0
    for bad in (-1, ROOM_LIMIT, True, 1.0, "1"):
        with pytest.raises(ValueError, match="the_field must be an integer in"):
            check_room(bad, "the_field")


def test_num_samples_reads_n_per_endpoint():
    assert num_samples("/v1/completions", {"n": 3}) == 3
    assert num_samples("/generate", {"sampling_params": {"n": 4}}) == 4
    assert (
        num_samples("/v1/completions", {"n": "x"}) == 1
        and num_samples("/v1/completions", {"n": True}) == 1
    )


def test_num_samples_reads_n_as_the_workers_do_null_and_integral_floats():
    # the workers read n: null as 1 and n: 2.0 as 2 (protocol.Int): as many rooms
    assert num_samples("/v1/completions", {"n": None}) == 1
    assert num_samples("/v1/completions", {"n": 2.0, "prompt": ["a", "b"]}) == 4
    assert num_samples("/generate", {"sampling_params": {"n": 3.0}}) == 3
    assert num_samples("/generate", {"sampling_params": None}) == 1
    assert num_samples("/v1/completions", {"n": 2.5}) == 1  # the workers' 400


def test_num_samples_counts_n_per_prompt_of_a_completions_batch():
    assert num_samples("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}) == 6
    assert num_samples("/v1/completions", {"prompt": [[1, 2], [3]]}) == 2
    assert num_samples("/v1/completions", {"prompt": [1, 2, 3], "n": 2}) == 2  # one prompt
    assert num_samples("/v1/completions", {"prompt": "abc", "n": 2}) == 2
    assert num_samples("/v1/chat/completions", {"prompt": ["a", "b"], "n": 2}) == 2


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({}, "worker_urls"),
        ({"prefill_urls": ("http://a",)}, "decode_urls"),
        ({"decode_urls": ("http://a",)}, "prefill_urls"),
        (
            {
                "worker_urls": ("http://a",),
                "prefill_urls": ("http://b",),
                "decode_urls": ("http://c",),
            },
            "worker_urls",
        ),
        ({"worker_urls": ("a:1",)}, "worker_urls"),
        ({"worker_urls": ("http://a",), "policy": "x"}, "policy"),
        ({"worker_urls": ("http://a",), "port": 70000}, "port"),
        ({"worker_urls": ("http://a",), "request_timeout": 0}, "request_timeout"),
        ({"worker_urls": ("http://a",), "health_failure_threshold": 0}, "health_failure_threshold"),
    ],
)
def test_router_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**kwargs)


def test_error_status_reads_back_the_status_of_an_error_body():
    for status in (400, 409, 500, 502, 503, 504):
        assert error_status(error_json(status, "m")) == status
    for status in (404, 413):  # OpenAI's type of a 404 or a 413: the 4xx one
        assert error_status(error_json(status, "m")) == 400
    assert error_status({"error": {"type": "something_else"}}) == 500
    for body in ({"choices": []}, {"error": "text"}, [1], None):
        assert error_status(body) is None


def _healthy_pool(urls: dict[str, list[str]]):
    """A round-robin WorkerPool of ``urls`` (role -> URLs), every worker healthy, no probe
    running."""
    from pdserve.router.workers import WorkerPool

    pool = WorkerPool(
        urls,
        policy="round_robin",
        client=None,  # type: ignore[arg-type]  # no probe runs here
        check_interval=1.0,
        check_timeout=1.0,
        failure_threshold=1,
    )
    for w in pool.all():
        w.healthy = True
    return pool


def test_selective_pd_decides_on_the_uncached_part_and_prefers_the_decode_holding_it():
    """Decode-only when the prompt's estimate less the share the decode prefix index holds
    is under the threshold, on the decode worker holding the most; PD otherwise (the pair's
    decode then holds the prompt); an ejected decode worker's index is forgotten."""
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.picking import Picker
    from pdserve.router.workers import NoHealthyWorker

    pool = _healthy_pool({"prefill": ["http://p0"], "decode": ["http://d0", "http://d1"]})
    d = Picker(pool, RouterMetrics(pool, set()), pd_mode=True, pd_min_prefill_tokens=64)
    long = "x" * 1024  # 256 tokens by the estimate, 16 blocks of 64 bytes

    def pick(prompt: str, ok: bool = True):
        route = d.pick_now("/v1/completions", {"prompt": prompt})
        if ok:  # the request ended well: its decode worker now holds the prompt
            route.held()
        return route.pair, route.worker if route.pair is None else None, route.info

    # a request that failed or was abandoned records nothing: the same prompt is still PD
    pair, _, info = pick(long, ok=False)
    assert pair is not None and info["pd_decision"] == "pd"
    assert all(pool.decode_prefixes.size(w.url) == 0 for w in pool.all())
    pair, _, info = pick(long)  # nothing held: PD, and its decode now holds it
    assert pair is not None and info["pd_decision"] == "pd"
    assert info["uncached_tokens_estimate"] == 256 and info["decode_cached_share"] == 0.0
    holder = pair[1]
    other = next(w for w in pool.healthy("decode") if w is not holder)
    other.outstanding = 0
    holder.outstanding = 5  # busier, but it holds the prefix
    pair, worker, info = pick(long + "y" * 100)  # 16 of 18 blocks held: 31 tokens uncached
    assert pair is None and worker is holder, info
    assert info == {
        "pd_decision": "decode_only",
        "prompt_tokens_estimate": 281,
        "decode_cached_share": round(16 / 18, 3),
        "uncached_tokens_estimate": round(281 * (1 - 16 / 18)),
        "pd_min_prefill_tokens": 64,
    }
    pair, _, info = pick(long[:512] + "z" * 512)  # half held: 128 uncached, PD
    assert pair is not None and info["pd_decision"] == "pd"
    assert info["decode_cached_share"] == 0.5
    pair, worker, info = pick("short")  # 1 token: decode-only on the policy's pick
    assert pair is None and info["decode_cached_share"] == 0.0
    pool.eject(holder.url, "gone")  # back later with an empty cache
    holder.healthy = True
    assert pool.decode_prefixes.size(holder.url) == 0
    pair, _, info = pick(long + "y" * 100)
    assert pair is not None and info["pd_decision"] == "pd", info
    # no healthy decode worker: the pick fails (the dispatcher polls it) and counts nothing
    for w in pool.healthy("decode"):
        w.healthy = False
    for _ in range(3):
        with pytest.raises(NoHealthyWorker):
            pick("short")
    metrics = d.metrics.render().decode()
    assert 'pdserve_router_pd_decisions_total{path="decode_only"} 2.0' in metrics
    assert 'pdserve_router_pd_decisions_total{path="pd"} 4.0' in metrics


def test_a_non_streamed_request_counts_its_workers_outstanding_from_its_pick():
    """``WorkerPool.drain`` waits for every request that picked a worker before the worker
    was marked draining: a non-streamed PD request counts its prefill and decode workers
    outstanding in the loop step that picks them (its legs run in tasks started one and
    two iterations later, which drain's one yield did not wait for: a request could still
    reach a worker after its removal returned), once each while its legs run, and not
    after it ends."""
    from pdserve.router.dispatch import Dispatcher
    from pdserve.router.metrics import RouterMetrics

    pool = _healthy_pool({"prefill": ["http://p0"], "decode": ["http://d0"]})
    pool.workers["prefill"][0].server_info = {"bootstrap_port": 8998}
    posted: list[str] = []

    class Client:  # the legs' POSTs wait until the request is cancelled
        async def post(self, url, body, headers):
            posted.append(url)
            await asyncio.Event().wait()

    d = Dispatcher(
        pool,
        Client(),  # type: ignore[arg-type]
        RouterMetrics(pool, set()),
        set(),
        pd_mode=True,
        request_timeout=30.0,
    )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(d._whole("/v1/completions", {"prompt": "x"}, loop.time() + 30))
        await asyncio.sleep(0)  # the request's first step: its pick, nothing posted yet
        assert not posted
        assert [w.outstanding for w in pool.all()] == [1, 1]
        for _ in range(5):  # the legs' tasks start and post: still once each
            await asyncio.sleep(0)
        assert sorted(posted) == ["http://d0/v1/completions", "http://p0/v1/completions"]
        assert [w.outstanding for w in pool.all()] == [1, 1]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert [w.outstanding for w in pool.all()] == [0, 0]

    asyncio.run(main())
