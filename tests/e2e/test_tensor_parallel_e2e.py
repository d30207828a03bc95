"""``pdserve serve --tp 2`` workers over real HTTP (CPU, gloo): the same completions as a TP-1
worker (tokens, text, logprobs); a rank killed mid-request fails that request with an error
naming the rank, turns ``/health`` 503 and refuses later requests, and nothing hangs; no
rank process outlives its worker."""

from __future__ import annotations

import json
import os
import re
import signal
import threading

import httpx
import pytest

from pdserve_procs import TINY, pid_alive, start_worker, stop, wait_for, wait_healthy

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time, in a land far away,"]
LP_TOL = 2e-4
ONE_THREAD = ["--num-threads", "1"]  # 2 shared cores: one per rank process


def completion(url: str, prompt: str, **extra) -> dict:
    body = {"model": TINY, "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 2}
    body.update(extra)
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120.0)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_tp2_worker_answers_as_a_tp1_worker(tmp_path):
    tp1 = start_worker("tp1", "mixed", tmp_path, extra=ONE_THREAD)
    tp2 = start_worker("tp2", "mixed", tmp_path, extra=[*ONE_THREAD, "--tp", "2"])
    procs = [tp1, tp2]
    try:
        wait_healthy(procs)
        info = tp2.get_info()
        assert info["tensor_parallel_size"] == 2 and len(set(info["tp_rank_pids"])) == 2
        assert tp1.get_info()["tensor_parallel_size"] == 1
        ranks = info["tp_rank_pids"][1:]
        assert all(pid_alive(p) for p in ranks)
        for prompt in PROMPTS:
            a, b = completion(tp2.url, prompt), completion(tp1.url, prompt)
            assert a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"]
            la, lb = a["logprobs"], b["logprobs"]
            assert la["tokens"] == lb["tokens"]
            for x, y in zip(la["token_logprobs"], lb["token_logprobs"]):
                assert abs(x - y) < LP_TOL
            assert [sorted(t) for t in la["top_logprobs"]] == [
                sorted(t) for t in lb["top_logprobs"]
            ]
    finally:
        stop(procs)  # SIGTERM to each process group: ranks included
    assert not any(pid_alive(p) for p in ranks), "a rank process outlived its worker"
    log = tp2.log_path.read_text(errors="replace")
    assert " ERROR " not in log and "SIGTERM" not in log, log[-2000:]  # a normal stop


def _rank_error_lines(log_path, rank: int) -> list[str]:
    return [
        line
        for line in log_path.read_text(errors="replace").splitlines()
        if " ERROR " in line and f"tensor-parallel rank {rank} " in line
    ]


def _stream(url: str, events: list, first: threading.Event) -> None:
    body = {
        "model": TINY,
        "prompt": "Tell me a long story:",
        "max_tokens": 3000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300.0) as resp:
        events.append(resp.status_code)
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                first.set()
    first.set()


def test_killed_rank_fails_its_request_and_the_worker_turns_unhealthy(tmp_path):
    worker = start_worker("tp2", "mixed", tmp_path, extra=[*ONE_THREAD, "--tp", "2"])
    try:
        wait_healthy([worker])
        rank1 = worker.get_info()["tp_rank_pids"][1]
        events: list = []
        first = threading.Event()
        t = threading.Thread(target=_stream, args=(worker.url, events, first))
        t.start()
        assert first.wait(240), "no first token"
        os.kill(rank1, signal.SIGKILL)
        t.join(240)
        assert not t.is_alive(), "the stream did not end after its rank died"
        assert events[0] == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert f"tensor-parallel rank 1 (pid {rank1}) was killed by SIGKILL" in error["message"]
        assert error["type"] == "service_unavailable", error  # as requests after it: 503
        tokens = [json.loads(e) for e in events[1:-2]]
        assert 0 < len(tokens) < 3000
        health = wait_for(
            lambda: (r := httpx.get(f"{worker.url}/health", timeout=10)).status_code == 503 and r,
            60,
            "/health to answer 503",
        )
        assert "rank 1" in health.text
        resp = httpx.post(
            f"{worker.url}/v1/completions",
            json={"model": TINY, "prompt": "hi", "max_tokens": 2},
            timeout=60,
        )
        assert resp.status_code == 503 and "rank 1" in resp.text, resp.text
        assert worker.exit_status() is None  # the worker still answers (unhealthy), no hang
        assert len(_rank_error_lines(worker.log_path, 1)) == 1, worker.log_tail(40)
    finally:
        stop([worker])
    assert not pid_alive(rank1)


def _running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r"^\w*num_running (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_hung_rank_fails_its_request_naming_the_rank_like_a_dead_one(tmp_path):
    """Rank 1 stopped (SIGSTOP) under a non-streamed request: after PDSERVE_TP_TIMEOUT the
    request is a 503 naming rank 1 and its pid (not rank 0, not gloo), logged once."""
    worker = start_worker(
        "tp2-hung",
        "mixed",
        tmp_path,
        env={"PDSERVE_TP_TIMEOUT": "10"},
        extra=[*ONE_THREAD, "--tp", "2"],
    )
    try:
        wait_healthy([worker])
        rank1 = worker.get_info()["tp_rank_pids"][1]
        answer: list = []
        body = {"model": TINY, "prompt": "Tell me a long story:", "max_tokens": 3000}
        t = threading.Thread(
            target=lambda: answer.append(
                httpx.post(
                    f"{worker.url}/v1/completions",
                    json={**body, "temperature": 0, "ignore_eos": True},
                    timeout=300,
                )
            )
        )
        t.start()
        wait_for(lambda: _running(worker.url) >= 1, 120, "the request to run")
        os.kill(rank1, signal.SIGSTOP)
        t.join(240)
        assert not t.is_alive(), "the request did not end after its rank hung"
        resp = answer[0]
        error = resp.json()["error"]
        assert resp.status_code == 503 and error["type"] == "service_unavailable", resp.text
        want = f"tensor-parallel rank 1 (pid {rank1}) did not answer for 10 s"
        assert want in error["message"] and "gloo" not in error["message"], error
        assert "rank 0" not in error["message"], error
        assert len(_rank_error_lines(worker.log_path, 1)) == 1, worker.log_tail(40)
        assert "gloo" not in worker.log_path.read_text(errors="replace")
    finally:
        stop([worker])
    assert not pid_alive(rank1)
