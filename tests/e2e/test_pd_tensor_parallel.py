"""PD with tensor parallelism over real processes, HTTP and NIXL (CPU, gloo ranks): prefill
TP 2 / decode TP 1 and prefill TP 1 / decode TP 2 (the tiny model's 2 KV heads split
over the TP-2 side, so each page moves as per-head slices) answer exactly as a mixed TP-1
worker, every rank's transfers counted and every page back afterwards; a prefill rank
killed while its room waits makes the request fail cleanly (no hang) and leaves decode
healthy with its pages back."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from pdserve_procs import (
    TINY,
    assert_all_healthy,
    start_router,
    start_worker,
    stop,
    wait_for,
    wait_healthy,
)

pytestmark = pytest.mark.timeout(600)

ONE_THREAD = ["--num-threads", "1"]  # 2 shared cores: one thread per rank process
BOOT = ["--disaggregation-bootstrap-port", "0"]
LP_TOL = 2e-4  # other batch shapes and another reduction order than the mixed worker
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    " ".join(f"word{i}" for i in range(90)),  # several pages, chunked sends
]


def completion(url: str, prompt: str) -> dict:
    body = {"model": TINY, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=180.0)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-tp-logs")
    mixed = start_worker("mixed", "mixed", logs, extra=ONE_THREAD)
    p2 = start_worker("prefill-tp2", "prefill", logs, extra=[*ONE_THREAD, *BOOT, "--tp", "2"])
    d1 = start_worker("decode-tp1", "decode", logs, extra=ONE_THREAD)
    p1 = start_worker("prefill-tp1", "prefill", logs, extra=[*ONE_THREAD, *BOOT])
    d2 = start_worker("decode-tp2", "decode", logs, extra=[*ONE_THREAD, "--tp", "2"])
    r21 = start_router("router-p2d1", logs, prefill=[p2], decode=[d1])
    r12 = start_router("router-p1d2", logs, prefill=[p1], decode=[d2])
    procs = [mixed, p2, d1, p1, d2, r21, r12]
    try:
        wait_healthy(procs)
        yield {"mixed": mixed, "p2": p2, "d1": d1, "p1": p1, "d2": d2, "r21": r21, "r12": r12,
               "procs": procs}  # fmt: skip
    finally:
        stop(procs)


@pytest.mark.parametrize("pair", ["p2d1", "p1d2"])
def test_pd_with_different_tp_sizes_answers_as_a_mixed_tp1_worker(cluster, pair):
    router = cluster["r21" if pair == "p2d1" else "r12"]
    prefill, decode = (cluster["p2"], cluster["d1"]) if pair == "p2d1" else (
        cluster["p1"], cluster["d2"])  # fmt: skip
    baseline = {w.name: w.get_info()["num_free_pages"] for w in (prefill, decode)}
    for prompt in PROMPTS:
        pd, mixed = completion(router.url, prompt), completion(cluster["mixed"].url, prompt)
        assert pd["text"] == mixed["text"] and pd["finish_reason"] == mixed["finish_reason"]
        lp, lm = pd["logprobs"], mixed["logprobs"]
        assert lp["tokens"] == lm["tokens"]
        for a, b in zip(lp["token_logprobs"], lm["token_logprobs"]):
            assert abs(a - b) < LP_TOL
        assert [sorted(t) for t in lp["top_logprobs"]] == [sorted(t) for t in lm["top_logprobs"]]
    info = {w.name: w.get_info() for w in (prefill, decode)}
    for w in (prefill, decode):
        wait_for(
            lambda w=w: w.get_info()["num_free_pages"] == baseline[w.name],
            30,
            f"{w.name}'s pages back",
        )
    tp_side = info[prefill.name if pair == "p2d1" else decode.name]
    assert tp_side["tensor_parallel_size"] == 2
    ranks = tp_side["transfer"]["ranks"]  # every rank moved (or received) its heads
    assert len(ranks) == 2 and all(r["transfers_succeeded"] >= len(PROMPTS) for r in ranks)
    assert_all_healthy(cluster["procs"])


def test_prefill_rank_killed_while_its_room_waits_fails_the_request_cleanly(tmp_path):
    p2 = start_worker("prefill-tp2", "prefill", tmp_path, extra=[*ONE_THREAD, *BOOT, "--tp", "2"])
    d1 = start_worker("decode-tp1", "decode", tmp_path, extra=ONE_THREAD)
    # its one prefill is lost: the request is not sent again after a 1 s wait for another
    router = start_router(
        "router", tmp_path, prefill=[p2], decode=[d1], extra=["--migration-wait", "1"]
    )
    procs = [p2, d1, router]
    stopped = False
    try:
        wait_healthy(procs)
        baseline = d1.get_info()["num_free_pages"]
        rank1 = p2.get_info()["tp_rank_pids"][1]
        # decode is frozen: the prefill room waits for its destination, deterministically
        os.kill(d1.popen.pid, signal.SIGSTOP)
        stopped = True
        result: list = []

        def ask() -> None:
            body = {"model": TINY, "prompt": "Hello TP", "max_tokens": 5, "temperature": 0}
            try:
                result.append(httpx.post(f"{router.url}/v1/completions", json=body, timeout=300))
            except httpx.HTTPError as exc:
                result.append(exc)

        t = threading.Thread(target=ask)
        t.start()
        wait_for(
            lambda: p2.get_info()["transfer"]["live_rooms"] >= 1, 60, "the prefill room is live"
        )
        os.kill(rank1, signal.SIGKILL)
        health = wait_for(
            lambda: (r := httpx.get(f"{p2.url}/health", timeout=10)).status_code == 503 and r,
            60,
            "prefill /health to answer 503",
        )
        assert "rank 1" in health.text
        os.kill(d1.popen.pid, signal.SIGCONT)
        stopped = False
        t.join(120)
        assert not t.is_alive(), "the request hung after its prefill rank died"
        resp = result[0]
        assert isinstance(resp, httpx.Response), resp
        ok = resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] != "error"
        assert not ok and "tensor-parallel rank 1" in resp.text, resp.text
        # decode failed its room cleanly: healthy, every page back
        wait_for(lambda: d1.get_info()["num_free_pages"] == baseline, 60, "decode's pages back")
        wait_for(lambda: d1.get_info()["transfer"]["live_rooms"] == 0, 60, "decode rooms closed")
        assert httpx.get(f"{d1.url}/health", timeout=10).status_code == 200
    finally:
        if stopped:
            os.kill(d1.popen.pid, signal.SIGCONT)
        stop(procs)
