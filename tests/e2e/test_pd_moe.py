"""A mixture-of-experts model through PD: 1 prefill + 1 decode + router (KV over real NIXL
on CPU) against a mixed worker, all on ``random:tiny-qwen3-moe`` (8 experts, 2 per token).

The KV layout is the attention's, so nothing in PD knows about experts: the router's
answers (token ids, text, logprobs, finish_reason, usage) equal the mixed worker's for
greedy, seeded sampling, n > 1, prompt logprobs, concurrent batches, a repeated prompt
(prefix cache) and a JSON-schema constrained output; every process stays healthy with its
KV pages back.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from pd_compare import assert_same, pair, post

from pdserve_procs import assert_all_healthy, pd_and_mixed, wait_for

pytestmark = pytest.mark.timeout(300)

MODEL = "random:tiny-qwen3-moe"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with pd_and_mixed(tmp_path_factory.mktemp("pd-moe-logs"), MODEL) as c:
        yield c


def _completion(prompt, **kw) -> dict:
    return {"prompt": prompt, "temperature": 0.0, "return_token_ids": True, "logprobs": 2, **kw}


CASES = {
    "greedy": _completion("The capital of France is", max_tokens=12, ignore_eos=True),
    "max_tokens_1": _completion("Once upon a time", max_tokens=1),
    "seeded": _completion(
        "A seeded story", max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=1234
    ),
    "n3_seeded": _completion("Three samples", max_tokens=6, temperature=1.0, n=3, seed=99),
    "prompt_logprobs": _completion(
        "Check the prompt logprobs here", max_tokens=3, logprobs=5, prompt_logprobs=3
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_completions_equal_mixed(cluster, case):
    pd, mixed = pair(cluster, "/v1/completions", CASES[case])
    assert_same(pd, mixed)
    assert pd["model"] == MODEL


def test_concurrent_requests_batch_and_equal_mixed(cluster):
    """Six prompts at once: decode batches them (experts see several tokens per step)."""
    bodies = [
        _completion(f"Story number {i}: " + "word " * (3 * i), max_tokens=8, ignore_eos=True)
        for i in range(6)
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        pds = list(pool.map(lambda b: post(cluster["router"].url, "/v1/completions", b), bodies))
        mixeds = list(pool.map(lambda b: post(cluster["mixed"].url, "/v1/completions", b), bodies))
    for pd, mixed in zip(pds, mixeds):
        assert pd.status_code == 200 and mixed.status_code == 200, pd.text + mixed.text
        assert_same(pd.json(), mixed.json())
        assert len(pd.json()["choices"][0]["token_ids"]) == 8


def test_repeated_prompt_hits_the_prefix_cache(cluster):
    prompt = "Every request of this test shares this fairly long opening sentence. " * 4
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 1}
    router = cluster["router"].url
    first = post(router, "/v1/completions", body).json()
    again = post(router, "/v1/completions", body).json()
    n = first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": (n - 1) // 16 * 16}
    assert_same(again["choices"], first["choices"])
    assert_same(
        again["choices"], post(cluster["mixed"].url, "/v1/completions", body).json()["choices"]
    )


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def test_json_schema_output_equals_mixed_and_validates(cluster):
    body = {
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "temperature": 0.0,
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    }
    pd, mixed = pair(cluster, "/v1/chat/completions", body)
    assert_same(pd, mixed)
    jsonschema.validate(json.loads(pd["choices"][0]["message"]["content"]), SCHEMA)


def test_every_process_healthy_and_kv_pages_back(cluster):
    assert_all_healthy(cluster["procs"])
    for p in (cluster["prefill"], cluster["decode"]):
        wait_for(
            lambda p=p: p.get_info()["num_free_pages"] == cluster["baseline"][p.name],
            30,
            f"{p.name}'s KV pages back",
        )
