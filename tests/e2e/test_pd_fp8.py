"""FP8 through PD (issue 26): 1 prefill + 1 decode + router (KV over real NIXL on CPU), all
with FP8 weights (``--quantization fp8``) and an FP8 KV cache (``--kv-cache-dtype
fp8_e4m3``), against a mixed worker with the same flags: the router's answers — token ids,
logprobs, usage — equal the mixed worker's token for token; the e4m3 pages move as they are
(every worker's layout says ``float8_e4m3fn``, its scales 1.0)."""

from __future__ import annotations

import httpx
import pytest
from pd_compare import assert_same, fold, pair, sse

from pdserve_procs import (
    assert_all_healthy,
    pd_and_mixed,
    start_router,
    start_worker,
    stop,
    wait_healthy,
)

pytestmark = pytest.mark.timeout(300)
FP8 = ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-fp8-logs")
    with pd_and_mixed(logs, worker_extra=FP8) as c:
        yield c


def _completion(prompt, **kw) -> dict:
    return {"prompt": prompt, "temperature": 0.0, "return_token_ids": True, "logprobs": 2, **kw}


CASES = {
    "greedy": _completion("The capital of France is", max_tokens=12),
    "long_prompt": _completion(" ".join(["pages of KV"] * 30), max_tokens=6),  # many pages
    "seeded_n2": _completion("A seeded story", max_tokens=8, temperature=0.9, n=2, seed=5),
    "prompt_logprobs": _completion("Check the prompt logprobs", max_tokens=3, prompt_logprobs=2),
}


def test_every_worker_holds_an_fp8_pool(cluster):
    for name in ("prefill", "decode", "mixed"):
        layout = cluster[name].get_info()["layout"]
        assert layout["dtype"] == "float8_e4m3fn", (name, layout)
        assert set(layout["k_scales"]) == {1.0} and set(layout["v_scales"]) == {1.0}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_pd_equals_fp8_mixed(cluster, case):
    pd, mixed = pair(cluster, "/v1/completions", CASES[case])
    assert_same(pd, mixed)
    assert len(mixed["choices"][0]["token_ids"]) == CASES[case]["max_tokens"]


def test_fp8_stream_chat_equals_mixed(cluster):
    body = {
        "messages": [{"role": "user", "content": "Stream please"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    got = [
        sse(httpx.post(c.url + "/v1/chat/completions", json=body, timeout=120))
        for c in (cluster["router"], cluster["mixed"])
    ]
    assert_same(fold(got[0]), fold(got[1]))
    assert_all_healthy(cluster["procs"])


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory):
    """Prefill TP 2 -> decode TP 1 with FP8 KV (the tiny model's 2 KV heads: each e4m3 page
    moves as per-head slices), beside a mixed TP-1 FP8-KV worker. FP8 KV only: online
    weight quantization takes a row-parallel weight's channel scales over the rank's
    columns, so FP8 weights under TP 2 are not TP 1's numbers."""
    logs = tmp_path_factory.mktemp("pd-fp8-tp-logs")
    kv = ["--kv-cache-dtype", "fp8_e4m3", "--num-threads", "1"]
    mixed = start_worker("mixed-fp8kv", "mixed", logs, extra=kv)
    p2 = start_worker(
        "prefill-tp2",
        "prefill",
        logs,
        extra=[*kv, "--tp", "2", "--disaggregation-bootstrap-port", "0"],
    )
    d1 = start_worker("decode-tp1", "decode", logs, extra=kv)
    router = start_router("router-p2d1", logs, prefill=[p2], decode=[d1])
    procs = [mixed, p2, d1, router]
    try:
        wait_healthy(procs)
        yield {"mixed": mixed, "router": router, "procs": procs}
    finally:
        stop(procs)


@pytest.mark.parametrize("case", ["greedy", "long_prompt"])
def test_fp8_kv_heterogeneous_tp_equals_mixed(tp_cluster, case):
    pd, mixed = pair(tp_cluster, "/v1/completions", CASES[case])
    assert_same(pd, mixed)
