"""Worker deaths under ``pdserve up`` as users start it (2 prefill + 2 decode workers, tiny
random model, one deployment for the module): a decode worker SIGKILLed at a random token
of a greedy stream -> the router continues the stream on the other decode and the client's
text, token ids, logprobs and usage equal an uninterrupted run's; a prefill worker killed
before its KV transfer -> the request completes on the other prefill; two deaths in a row
-> a second migration; ``up`` restarts each killed worker (the others keep serving), it is
serving again within its backoff plus its start-up, and the survivors hold no leaked KV
page."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_up_faults import Up

from pdserve_procs import TINY, Proc, assert_all_healthy, free_port, wait_for

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 600  # long enough that a kill lands while decode is still generating


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    logs = tmp_path_factory.mktemp("up-migration")
    args = ["--model", TINY, "--port", str(free_port()), "--log-dir", str(logs)]
    args += ["--num-prefill", "2", "--num-decode", "2", "--health-check-interval", "0.5"]
    # a migration may wait for a killed worker's restart (model load): on a loaded 2-core
    # machine that takes longer than the 30 s default
    args += ["--restart-backoff", "0.5", "--migration-wait", "150"]
    system = Up(args, env={"PDSERVE_LOG_LEVEL": "WARNING"})
    try:
        system.wait_line(r"pdserve is ready at", 300)
        yield system
    finally:
        system.kill()


def _kids(up: Up) -> dict[str, Proc]:
    """The children by name, with the pid of their latest (re)start."""
    kids = up.children()
    for name, pid in re.findall(r"restarted (\S+) \(pid (\d+)\)", up.text):
        kids[name].pid = int(pid)
    return kids


def _running(proc: Proc) -> int:
    try:
        return proc.get_info()["engine"]["num_running"]
    except (httpx.HTTPError, KeyError, ValueError):
        return 0


def _chat(prompt: str) -> dict:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
    }


def _stream(url: str, body: dict, on_chunk=None) -> dict:
    """Read a chat stream whole: its text, token ids, logprobs, finish reasons, usage,
    ids and error events; ``on_chunk(i)`` runs after the i-th chunk with a token."""
    out = {"text": "", "ids": [], "logprobs": [], "finish": [], "usage": None, "errors": []}
    out["chunk_ids"], out["roles"], out["prompt_ids"] = set(), 0, None
    n = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=240) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["errors"].append(chunk["error"])
                continue
            out["chunk_ids"].add(chunk["id"])
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                delta = choice["delta"]
                out["roles"] += "role" in delta
                out["text"] += delta.get("content") or ""
                out["ids"] += choice.get("token_ids") or []
                if choice.get("prompt_token_ids") is not None:
                    assert out["prompt_ids"] is None, "prompt_token_ids sent twice"
                    out["prompt_ids"] = choice["prompt_token_ids"]
                if choice.get("logprobs"):
                    out["logprobs"] += [
                        (e["token"], e["logprob"]) for e in choice["logprobs"]["content"]
                    ]
                if choice.get("finish_reason"):
                    out["finish"].append(choice["finish_reason"])
                if choice.get("token_ids"):
                    n += 1
                    if on_chunk is not None:
                        on_chunk(n)
    return out


def _migrations(router_url: str) -> dict[str, float]:
    text = httpx.get(router_url + "/metrics", timeout=10).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'pdserve_router_migrations_total\{reason="(\w+)"\} (\S+)', text)
    }


class Killer:
    """``on_chunk`` for :func:`_stream` that kills the ``role`` worker running the request,
    ``times`` times: at the first chunk, then at the first chunk once another worker of
    ``role`` runs the continued request. Each victim is SIGSTOPped at once (so it stops
    where it is: the tokens it made so far are all the client gets from it, a number set
    by timing) and SIGKILLed ``KILL_AFTER_S`` later, from a thread joined by ``join``."""

    KILL_AFTER_S = 0.3

    def __init__(self, up: Up, role: str, times: int) -> None:
        self.up, self.role, self.times = up, role, times
        self.killed: list[str] = []
        self.at: list[int] = []  # chunks read when each victim was stopped
        self.threads: list[threading.Thread] = []

    def __call__(self, n: int) -> None:
        if len(self.killed) >= self.times:
            return
        kids = self.up_kids()
        busy = [
            k
            for name, k in kids.items()
            if name.startswith(self.role) and name not in self.killed and _running(k) > 0
        ]
        if not busy:
            assert self.killed, f"no {self.role} worker runs the request at its first chunk"
            return  # the client still reads the last victim's tokens
        assert len(busy) == 1, busy
        victim = busy[0]
        os.kill(victim.pid, signal.SIGSTOP)
        self.killed.append(victim.name)
        self.at.append(n)
        thread = threading.Thread(target=self._kill_later, args=(victim.pid,))
        thread.start()
        self.threads.append(thread)

    def up_kids(self) -> dict[str, Proc]:
        return _kids(self.up)

    def _kill_later(self, pid: int) -> None:
        time.sleep(self.KILL_AFTER_S)
        os.kill(pid, signal.SIGKILL)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(10)


def _seam(up: Up, name: str) -> int:
    """Tokens sent before the stream left ``name``, from the router's log line."""
    log = _kids(up)["router"].log_path.read_text()
    found = re.findall(
        r"continuing the stream on another worker \(migration \d+ of \d+, (\d+) tokens", log
    )
    assert found, log[-2000:]
    return int(found[-1])


def _same(got: dict, ref: dict) -> None:
    assert not got["errors"], got["errors"]
    assert got["ids"] == ref["ids"] and len(got["ids"]) == MAX_TOKENS  # none repeated, none lost
    assert got["text"] == ref["text"]
    assert got["prompt_ids"] == ref["prompt_ids"]
    assert [t for t, _ in got["logprobs"]] == [t for t, _ in ref["logprobs"]]
    for (_, a), (_, b) in zip(got["logprobs"], ref["logprobs"]):
        assert abs(a - b) < 1e-3
    assert got["finish"] == ref["finish"] == ["length"]
    assert got["roles"] == 1 and len(got["chunk_ids"]) == 1  # one opening, one id: one stream
    usage, ref_usage = dict(got["usage"]), dict(ref["usage"])
    usage.pop("prompt_tokens_details", None)
    ref_usage.pop("prompt_tokens_details", None)
    assert usage == ref_usage and usage["completion_tokens"] == MAX_TOKENS


def _back_serving(up: Up, name: str, since: int) -> None:
    """``name`` was restarted after the up's line ``since`` and serves again (up says so,
    the router's health checks took it back)."""
    wait_for(
        lambda: re.search(rf"{name} \(pid \d+\) is serving again", "\n".join(up.lines[since:])),
        120,
        f"{name} to be restarted and serving again",
    )
    router = _kids(up)["router"]
    wait_for(
        lambda: all(
            w["healthy"]
            for w in httpx.get(router.url + "/get_server_info", timeout=10).json()["workers"]
        ),
        30,
        "the router to take every worker back",
    )


def _no_page_leak(up: Up) -> None:
    kids = [k for n, k in _kids(up).items() if n != "router"]
    for k in kids:
        wait_for(
            lambda k=k: (info := k.get_info())["num_free_pages"] == info["num_total_pages"],
            60,
            f"{k.name}'s KV pages all free or cached",
        )


def test_decode_killed_mid_stream_continues_on_the_other(up):
    router = _kids(up)["router"]
    body = _chat("Tell me a long story about a lighthouse keeper.")
    ref = _stream(router.url, body)
    assert ref["usage"]["completion_tokens"] == MAX_TOKENS and not ref["errors"]
    before = _migrations(router.url)
    since = len(up.lines)
    killer = Killer(up, "decode", 1)
    got = _stream(router.url, body, killer)
    killer.join()
    killed = killer.killed
    assert len(killed) == 1, "the kill did not happen"
    _same(got, ref)
    seam = _seam(up, killed[0])
    print(f"\n{killed[0]} SIGKILLed after {seam} of {MAX_TOKENS} tokens: the stream went on")
    assert 0 < seam < MAX_TOKENS
    after = _migrations(router.url)
    assert sum(after.values()) - sum(before.values()) == 1, (before, after)
    up.wait_line(rf"{killed[0]} \(pid \d+\) was killed by SIGKILL; the others keep serving", 10)
    _back_serving(up, killed[0], since)
    _no_page_leak(up)


def test_prefill_killed_before_its_transfer_completes_on_the_other(up):
    kids = _kids(up)
    router = kids["router"]
    prompts = [f"Question {i}: name a colour." for i in range(8)]
    bodies = [dict(_chat(p), max_tokens=8) for p in prompts]
    refs = [_stream(router.url, b) for b in bodies]
    before = _migrations(router.url)
    since = len(up.lines)
    victim = kids["prefill-0"]
    os.kill(victim.pid, signal.SIGSTOP)  # it takes requests and computes nothing
    try:
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(_stream, router.url, b) for b in bodies]
            time.sleep(1.5)  # the requests reached it (or the other)
            os.kill(victim.pid, signal.SIGKILL)
            results = [f.result() for f in futures]
    finally:
        try:
            os.kill(victim.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for got, ref in zip(results, refs):
        assert not got["errors"] and got["ids"] == ref["ids"] and got["text"] == ref["text"]
        assert got["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
    after = _migrations(router.url)
    moved = after.get("prefill_failed", 0) - before.get("prefill_failed", 0)
    moved += after.get("open_failed", 0) - before.get("open_failed", 0)
    assert moved >= 1, f"no request was on the stopped prefill: {before} -> {after}"
    _back_serving(up, "prefill-0", since)
    _no_page_leak(up)


def test_two_decode_deaths_in_a_row_migrate_twice(up):
    router = _kids(up)["router"]
    body = _chat("Describe the sea at night, slowly.")
    ref = _stream(router.url, body)
    before = _migrations(router.url)
    since = len(up.lines)
    killer = Killer(up, "decode", 2)
    got = _stream(router.url, body, killer)
    killer.join()
    killed = killer.killed
    assert len(killed) == 2 and killed[0] != killed[1], killed
    _same(got, ref)
    after = _migrations(router.url)
    assert sum(after.values()) - sum(before.values()) == 2, (before, after)
    for name in killed:
        _back_serving(up, name, since)
    _no_page_leak(up)
    assert_all_healthy(list(_kids(up).values()))


def test_selective_pd_runs_short_prompts_on_decode_with_the_same_output(up, tmp_path):
    """A router with ``--pd-min-prefill-tokens 64`` over the same workers: a short prompt
    runs whole on a decode worker (no prefill request, counted ``decode_only``) and a long
    one through a pair (``pd``), both with the PD router's tokens and usage."""
    from pdserve_procs import start_router, stop, wait_healthy

    kids = _kids(up)
    workers = {n: k for n, k in kids.items() if n != "router"}
    selective = start_router(
        "selective",
        tmp_path,
        prefill=[workers["prefill-0"], workers["prefill-1"]],
        decode=[workers["decode-0"], workers["decode-1"]],
        extra=["--pd-min-prefill-tokens", "64"],
    )
    try:
        wait_healthy([selective])
        prefills = [workers["prefill-0"], workers["prefill-1"]]

        def prefilled() -> int:
            return sum(p.get_info()["engine"]["finished_requests"] for p in prefills)

        for prompt, path in (("Hi there.", "decode_only"), ("long words " * 60, "pd")):
            body = dict(_chat(prompt), max_tokens=24)
            ref = _stream(kids["router"].url, body)
            before = prefilled()
            got = _stream(selective.url, body)
            assert got["ids"] == ref["ids"] and got["text"] == ref["text"], path
            assert got["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
            assert got["usage"]["completion_tokens"] == 24
            assert prefilled() - before == (0 if path == "decode_only" else 1), path
            metrics = httpx.get(selective.url + "/metrics", timeout=10).text
            assert f'pdserve_router_pd_decisions_total{{path="{path}"}} 1.0' in metrics
    finally:
        stop([selective])
