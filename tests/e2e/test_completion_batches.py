"""``/v1/completions`` with a batch of prompts (a list of strings or of token-id lists), as
vLLM and SGLang accept it: one choice per prompt and sample, ``index`` = ``p * n + i``
across the batch, usage summed. Real processes: a mixed worker, a regular-mode router
over it, and a PD deployment (prefill + decode + router, KV over real NIXL on CPU), sent
to with the official ``openai`` client; every batch answer equals the same prompts sent
one by one, and PD equals mixed."""

from __future__ import annotations

import httpx
import openai
import pytest
from pd_compare import assert_same, fold, pair, post, sse

from pdserve_procs import (
    assert_all_healthy,
    start_router,
    stop,
    wait_for,
    wait_healthy,
)

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["one two three", "the cat sat on the", "a b"]


@pytest.fixture(scope="module")
def c(shared_pd, tmp_path_factory):
    """The PD + mixed deployment shared with other files (tests/e2e/conftest.py) and a
    regular-mode router of this file's own over its mixed worker."""
    regular = start_router(
        "regular", tmp_path_factory.mktemp("batch-logs"), workers=[shared_pd["mixed"]]
    )
    try:
        wait_healthy([regular])
        yield dict(shared_pd, regular=regular)
    finally:
        stop([regular])


def client(proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)


def one_by_one(proc, prompts, **kw) -> list:
    """Each prompt's choices from its own request (``n`` each, in order) and the usages."""
    choices, usages = [], []
    for prompt in prompts:
        answer = client(proc).completions.create(prompt=prompt, **kw)
        choices += answer.choices
        usages.append(answer.usage)
    return [choices, usages]


@pytest.mark.parametrize("where", ["mixed", "regular", "router"])
def test_batch_of_text_prompts_equals_prompts_one_by_one(c, where):
    model = client(c["mixed"]).models.list().data[0].id
    kw = dict(model=model, max_tokens=6, temperature=0, n=2, extra_body={"ignore_eos": True})
    answer = client(c[where]).completions.create(prompt=PROMPTS, **kw)
    singles, usages = one_by_one(c["mixed"], PROMPTS, **kw)
    assert [ch.index for ch in answer.choices] == list(range(len(PROMPTS) * 2))
    assert [ch.text for ch in answer.choices] == [ch.text for ch in singles]
    assert all(ch.finish_reason == "length" for ch in answer.choices)
    assert answer.usage.prompt_tokens == sum(u.prompt_tokens for u in usages)
    assert answer.usage.completion_tokens == 6 * 2 * len(PROMPTS)
    assert answer.usage.total_tokens == sum(u.total_tokens for u in usages)
    assert_all_healthy(c["procs"])


def test_batch_of_token_id_prompts_through_pd_equals_mixed(c):
    body = {
        "prompt": [[5, 6, 7, 8], [9, 10], [11, 12, 13]],
        "max_tokens": 5,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 2,
        "return_token_ids": True,
    }
    pd, mixed = pair(c, "/v1/completions", body)
    assert_same(pd, mixed)
    assert [ch["index"] for ch in pd["choices"]] == [0, 1, 2]
    assert [ch["prompt_token_ids"] for ch in pd["choices"]] == body["prompt"]
    assert pd["usage"]["prompt_tokens"] == 9 and pd["usage"]["completion_tokens"] == 15
    # the same prompt alone gives the same choice
    alone = post(c["mixed"].url, "/v1/completions", dict(body, prompt=body["prompt"][1])).json()
    assert alone["choices"][0]["token_ids"] == pd["choices"][1]["token_ids"]


def test_batch_echo_with_logprobs_through_pd_equals_mixed(c):
    body = {
        "prompt": ["score me please", "and me"],
        "max_tokens": 0,
        "echo": True,
        "logprobs": 1,
        "temperature": 0.0,
    }
    pd, mixed = pair(c, "/v1/completions", body)
    assert_same(pd, mixed)
    assert [ch["text"] for ch in pd["choices"]] == body["prompt"]
    for ch in pd["choices"]:  # the echoed prompts' logprobs came from the prefill leg
        lp = ch["logprobs"]["token_logprobs"]
        assert lp[0] is None and all(isinstance(x, float) for x in lp[1:])
        tokens, tops = ch["logprobs"]["tokens"], ch["logprobs"]["top_logprobs"]
        # each prompt token is in its own top dict (OpenAI: up to logprobs + 1 entries)
        assert tops[0] is None and all(
            top[t] == pytest.approx(x) and 1 <= len(top) <= 2
            for t, x, top in zip(tokens[1:], lp[1:], tops[1:])
        )
    assert pd["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("where", ["mixed", "router"])
def test_streamed_batch_tells_prompts_apart_by_index(c, where):
    model = client(c["mixed"]).models.list().data[0].id
    kw = dict(model=model, max_tokens=5, temperature=0, n=2, extra_body={"ignore_eos": True})
    whole = client(c["mixed"]).completions.create(prompt=PROMPTS, **kw)
    chunks = list(
        client(c[where]).completions.create(
            prompt=PROMPTS,
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
    )
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert sorted(texts) == list(range(len(PROMPTS) * 2))
    assert [texts[i] for i in sorted(texts)] == [ch.text for ch in whole.choices]
    assert set(finish.values()) == {"length"}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )


def test_streamed_batch_through_pd_folds_to_mixed_with_continuous_usage(c):
    body = {
        "prompt": [[5, 6, 7], [8, 9, 10, 11, 12]],
        "max_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 1,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    raw = sse(post(c["router"].url, "/v1/completions", body))
    pd, mixed = fold(raw), fold(sse(post(c["mixed"].url, "/v1/completions", body)))
    assert_same(pd, mixed)
    assert pd["usage"]["prompt_tokens"] == 8 and pd["usage"]["completion_tokens"] == 8
    # chunked differently (decode's first chunk has prefill's token too), a stream adds up
    # to the whole answer, text offsets included
    # the same request unstreamed (stream_options is a 400 without stream)
    whole_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    whole = post(c["mixed"].url, "/v1/completions", whole_body).json()
    for choice in whole["choices"]:
        assert_same(pd[choice["index"]]["logprobs"], choice["logprobs"])
        assert pd[choice["index"]]["token_ids"] == choice["token_ids"]
    for chunk in raw:  # every choice chunk's usage counts its own prompt
        if chunk["choices"]:
            index = chunk["choices"][0]["index"]
            assert chunk["usage"]["prompt_tokens"] == (3 if index == 0 else 5)


def test_bad_batches_are_400s_and_rooms_are_released(c):
    bad = [
        ({"prompt": ["ok", ""]}, "prompt[1]"),
        ({"prompt": [[1, 2], []]}, "prompt[1]"),
        ({"prompt": []}, "prompt must not be empty"),
        ({"prompt": ["a", [1, 2]]}, "prompt"),
    ]
    for where in ("mixed", "router"):
        for extra, needle in bad:
            resp = post(c[where].url, "/v1/completions", dict(extra, max_tokens=2))
            assert resp.status_code == 400, (where, extra, resp.text)
            assert needle in resp.text, (where, resp.text)
    # more rooms than the router reserves per request (9 x 128 > 1024): the router's 400
    resp = post(c["router"].url, "/v1/completions", {"prompt": ["a"] * 9, "n": 128})
    assert resp.status_code == 400 and "at most 1024 samples" in resp.text, resp.text
    # a prompt of a batch over the context limit fails the whole request before any runs
    limit = c["mixed"].get_info()["max_model_len"]
    resp = post(
        c["router"].url, "/v1/completions", {"prompt": [[5, 6], [7] * limit], "max_tokens": 2}
    )
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    info = httpx.get(c["router"].url + "/get_server_info", timeout=10).json()
    assert info["live_bootstrap_rooms"] == 0
    for name in ("prefill", "decode"):
        wait_for(
            lambda proc=c[name], name=name: (
                proc.get_info()["num_free_pages"] == c["baseline"][name]
            ),
            60,
            f"{name} free KV pages back at baseline",
        )
    assert_all_healthy(c["procs"])
