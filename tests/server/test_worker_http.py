"""A real mixed worker (``pdserve serve``, tiny random model) over HTTP: OpenAI and native
shapes, usage and cached tokens, logprob lengths, n/seed semantics, streaming equal to
non-streaming, stop strings and stop token ids.  Bad input: test_worker_request_checks.py;
disconnects, health, metrics and the other endpoints: test_worker_endpoints.py."""

from __future__ import annotations

import httpx
import pytest
from http_calls import post, sse_events

pytestmark = pytest.mark.timeout(300)


def test_completion_shape_usage_and_token_ids(worker):
    r = post(
        worker,
        "/v1/completions",
        {"prompt": "Hello there", "max_tokens": 5, "temperature": 0, "return_token_ids": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == "random:tiny"
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 5
    assert body["usage"] == {
        "prompt_tokens": len(choice["prompt_token_ids"]),
        "completion_tokens": 5,
        "total_tokens": len(choice["prompt_token_ids"]) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},  # 2 tokens: not a full page
    }
    assert isinstance(choice["text"], str) and choice["text"]


def test_a_repeated_prompt_reports_cached_tokens_and_the_same_answer(worker):
    prompt = "A long shared system prompt about nothing in particular. " * 8
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    first = post(worker, "/v1/completions", body).json()
    again = post(worker, "/v1/completions", body).json()
    streamed = sse_events(
        post(
            worker,
            "/v1/completions",
            {**body, "stream": True, "stream_options": {"include_usage": True}},
        )
    )
    n = first["usage"]["prompt_tokens"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (n - 1) // 16 * 16 and cached > 0  # full pages of all but the last token
    assert streamed[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    lp1, lp2 = first["choices"][0]["logprobs"], again["choices"][0]["logprobs"]
    assert lp2["tokens"] == lp1["tokens"]
    # the suffix is computed in another batch shape: equal to fp32 rounding, not bit for bit
    assert lp2["token_logprobs"] == pytest.approx(lp1["token_logprobs"], abs=1e-4)
    metrics = httpx.get(worker.url + "/metrics").text
    assert "pdserve_engine_prefix_cache_hit_tokens" in metrics
    assert "pdserve_engine_prefix_cache_evicted_pages" in metrics


def test_completion_logprob_lengths(worker):
    r = post(
        worker,
        "/v1/completions",
        {
            "prompt": "Hello there friend",
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": 3,
            "prompt_logprobs": 2,
            "return_token_ids": True,
        },
    )
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(len(top) <= 3 for top in lp["top_logprobs"])
    # greedy: the sampled token is the best one
    assert all(
        max(top.values()) == pytest.approx(t)
        for top, t in zip(lp["top_logprobs"], lp["token_logprobs"])
    )
    prompt_lps = choice["prompt_logprobs"]
    assert len(prompt_lps) == len(choice["prompt_token_ids"]) and prompt_lps[0] is None
    assert [e["token_id"] for e in prompt_lps[1:]] == choice["prompt_token_ids"][1:]
    assert all(len(e["top_logprobs"]) == 2 for e in prompt_lps[1:])


def _assert_top_has_own_token(lp: dict, k: int) -> None:
    """Each legacy ``top_logprobs`` dict holds its own token with its logprob (OpenAI:
    up to ``logprobs + 1`` entries); the first echoed prompt token's is null."""
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        if logprob is None:
            assert top is None
            continue
        assert top[token] == pytest.approx(logprob) and k <= len(top) <= k + 1, (token, top)


def test_completion_top_logprobs_always_hold_the_sampled_token(worker):
    # temperature 1.5: the sampled tokens are mostly not the model's best one
    body = {"prompt": "The sky is", "max_tokens": 8, "temperature": 1.5, "seed": 3}
    lp = post(worker, "/v1/completions", dict(body, logprobs=1)).json()["choices"][0]["logprobs"]
    _assert_top_has_own_token(lp, 1)
    assert any(len(top) == 2 for top in lp["top_logprobs"])  # some sampled token not the best
    only = post(worker, "/v1/completions", dict(body, logprobs=0)).json()["choices"][0]
    assert [list(t) for t in only["logprobs"]["top_logprobs"]] == [[t] for t in lp["tokens"]]
    events = sse_events(post(worker, "/v1/completions", dict(body, logprobs=1, stream=True)))
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"]]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [t for s in streamed for t in s["top_logprobs"]] == lp["top_logprobs"]
    # echo: each prompt token is in its own top dict too (they are rarely the best)
    scored = post(
        worker,
        "/v1/completions",
        {"prompt": "The sky is blue today", "max_tokens": 0, "echo": True, "logprobs": 1},
    ).json()["choices"][0]["logprobs"]
    _assert_top_has_own_token(scored, 1)
    echoed = post(worker, "/v1/completions", dict(body, logprobs=1, echo=True)).json()
    _assert_top_has_own_token(echoed["choices"][0]["logprobs"], 1)


def test_chat_logprobs_and_generate_logprobs(worker):
    r = post(
        worker,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    body = r.json()
    content = body["choices"][0]["logprobs"]["content"]
    assert (
        body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    )
    assert len(content) == body["usage"]["completion_tokens"] == 3
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    # a token's bytes are its text's, but where it holds part of a character (its text "\ufffd")
    assert all(
        c["bytes"] == list(c["token"].encode()) for c in content if "\ufffd" not in c["token"]
    )

    r = post(
        worker,
        "/generate",
        {
            "input_ids": [5, 6, 7, 8, 9],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 1,
            "top_logprobs_num": 2,
        },
    )
    meta = r.json()["meta_info"]
    assert (
        len(r.json()["output_ids"]) == meta["completion_tokens"] == 3 and meta["prompt_tokens"] == 5
    )
    assert [row[1] for row in meta["input_token_logprobs"]] == [6, 7, 8, 9]
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 3
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    r = post(
        worker,
        "/generate",
        {
            "input_ids": [5, 6, 7],
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
    )
    assert (
        r.json()["meta_info"]["input_token_logprobs"][0][0] is None
    )  # nothing predicts the first token


def test_n_samples_follow_seed_plus_index(worker):
    """Sample i of an n-sample request with seed s is the n=1 request with seed s + i
    (SamplingParams.fan_out), so the router can split/merge consistently."""
    base = {
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 1.0,
        "return_token_ids": True,
    }
    many = post(worker, "/v1/completions", dict(base, n=3, seed=11)).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    for i in range(3):
        one = post(worker, "/v1/completions", dict(base, seed=11 + i)).json()["choices"][0]
        assert one["token_ids"] == many["choices"][i]["token_ids"]
    assert many["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in many["choices"])


def test_streaming_equals_non_streaming(worker):
    base = {"prompt": "The weather today", "max_tokens": 7, "temperature": 0, "logprobs": 1}
    full = post(worker, "/v1/completions", base).json()
    r = post(
        worker, "/v1/completions", dict(base, stream=True, stream_options={"include_usage": True})
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_events(r)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full["choices"][0]["text"]
    lps = [x for c in chunks if c["choices"] for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert lps == pytest.approx(full["choices"][0]["logprobs"]["token_logprobs"])
    assert (
        chunks[-1]["usage"] == full["usage"]
        and chunks[-2]["choices"][0]["finish_reason"] == "length"
    )

    chat = {
        "messages": [{"role": "user", "content": "Say something"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    full = post(worker, "/v1/chat/completions", chat).json()
    chunks = sse_events(post(worker, "/v1/chat/completions", dict(chat, stream=True)))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert (
        "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        == full["choices"][0]["message"]["content"]
    )
    gen = sse_events(
        post(
            worker,
            "/generate",
            {
                "text": "abc",
                "stream": True,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            },
        )
    )
    assert (
        len(gen[-1]["output_ids"]) == 4
        and gen[-1]["meta_info"]["finish_reason"]["type"] == "length"
    )


def test_stop_strings_and_stop_token_ids(worker):
    base = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    free = post(worker, "/v1/completions", base).json()["choices"][0]
    ids = free["token_ids"]
    k = next(
        i for i in range(1, len(ids)) if ids[i] not in ids[:i]
    )  # first new token after the first
    stopped = post(worker, "/v1/completions", dict(base, stop_token_ids=[ids[k]])).json()[
        "choices"
    ][0]
    assert stopped["token_ids"] == ids[: k + 1] and stopped["finish_reason"] == "stop"
    word = free["text"].split()[1] if len(free["text"].split()) > 1 else free["text"][1:3]
    by_string = post(worker, "/v1/completions", dict(base, stop=[word])).json()["choices"][0]
    assert word not in by_string["text"] and by_string["finish_reason"] == "stop"
